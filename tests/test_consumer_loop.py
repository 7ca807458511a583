"""The shared consumer loop (infra/consumer_loop.py) with a scripted consumer and a recording step."""

from __future__ import annotations

import logging
import time

import pytest
from kafka.errors import KafkaConfigurationError, KafkaConnectionError

from genrec.infra.consumer_loop import BatchHandler, ConsumerLoop


class ScriptedConsumer:
    """Each poll returns the next scripted result (raises it if it is an exception), then {}."""

    def __init__(self, script=(), assigned_after_polls: int = 0) -> None:
        self.script = list(script)
        self.polls: list[dict] = []
        self.assigned_after_polls = assigned_after_polls
        self.journal: list[str] = []
        self.close_error: Exception | None = None

    def poll(self, **kwargs):
        self.polls.append(kwargs)
        step = self.script.pop(0) if self.script else {}
        if isinstance(step, Exception):
            raise step
        return step

    def assignment(self):
        return {"tp"} if len(self.polls) >= self.assigned_after_polls else set()

    def close(self, autocommit=True):
        self.journal.append(f"consumer closed (autocommit={autocommit})")
        if self.close_error is not None:
            raise self.close_error


class RecordingStep(BatchHandler):
    """Collects records into batches and writes every hook call into ``journal``."""

    def __init__(self, journal: list[str], full_at: int | None = None) -> None:
        self.journal = journal
        self.full_at = full_at
        self.open: list = []
        self.batches: list[list] = []
        self.failing_now = False
        self.on_batch = lambda batch: None

    def take_records(self, polled, received_at):
        for records in polled.values():
            self.open.extend(records)

    def has_batch(self):
        return bool(self.open)

    def batch_full(self):
        return self.full_at is not None and len(self.open) >= self.full_at

    def handle_batch(self):
        batch, self.open = self.open, []
        self.batches.append(batch)
        self.journal.append(f"batch {batch}")
        self.on_batch(batch)

    def settle(self):
        self.journal.append("settle")

    def log_progress(self):
        self.journal.append("progress")

    def health_details(self):
        return {"batches": len(self.batches)}

    def failing(self):
        return self.failing_now

    def release(self):
        self.journal.append("released")


def make_loop(script=(), *, full_at=None, assigned_after_polls=0, **options):
    consumer = ScriptedConsumer(script, assigned_after_polls)
    step = RecordingStep(consumer.journal, full_at)
    options = {"health_stall_s": 120.0, "idle_poll_ms": 200, **options}
    loop = ConsumerLoop("test", step, **options)
    loop.stop_requested.wait = lambda timeout=None: False  # no outage back-off in tests
    return loop, consumer, step


def test_one_poll_is_one_batch_without_a_window_and_close_comes_last() -> None:
    loop, consumer, step = make_loop([{"tp": [1, 2]}, {"tp": [3]}])
    loop.run(consumer, exit_when_idle_s=0)
    assert step.batches == [[1, 2], [3]]
    assert consumer.journal == [
        "batch [1, 2]", "batch [3]", "settle",  # the empty poll: idle at once
        "settle", "released", "consumer closed (autocommit=False)",
    ]  # fmt: skip
    assert all(kwargs == {"timeout_ms": 200} for kwargs in consumer.polls)


def test_polls_join_one_batch_until_the_window_closes() -> None:
    loop, consumer, step = make_loop(
        [{"tp": [1]}, {}, {"tp": [2]}], batch_window_s=0.05, max_records=7
    )
    loop.run(consumer, exit_when_idle_s=0)
    assert step.batches == [[1, 2]]
    first, *in_window, idle = consumer.polls
    assert first == idle == {"timeout_ms": 200, "max_records": 7}  # no batch open
    assert len(in_window) >= 2  # the window stayed open past the empty poll
    assert all(kwargs["timeout_ms"] <= 50 and kwargs["max_records"] == 7 for kwargs in in_window)


def test_a_full_batch_or_a_stop_request_closes_the_window_early() -> None:
    loop, consumer, step = make_loop(
        [{"tp": [1]}, {"tp": [2]}, {"tp": [3]}], batch_window_s=60.0, full_at=2
    )
    step.on_batch = lambda batch: loop.request_stop() if batch == [1, 2] else None
    started = time.monotonic()
    loop.run(consumer)
    assert step.batches == [[1, 2]] and time.monotonic() - started < 30
    # stopping: the batch in hand is handed over at once, then the run ends
    loop, consumer, step = make_loop([{"tp": [1]}], batch_window_s=60.0)
    step.take_records = lambda polled, received_at: (step.open.extend(polled["tp"]),
                                                     loop.request_stop())  # fmt: skip
    loop.run(consumer)
    assert consumer.journal == [
        "batch [1]", "settle", "released", "consumer closed (autocommit=False)"
    ]  # fmt: skip


def test_until_is_checked_before_every_turn() -> None:
    loop, consumer, step = make_loop([{"tp": [1]}, {"tp": [2]}])
    loop.run(consumer, until=lambda: len(step.batches) == 1)
    assert step.batches == [[1]]
    loop, consumer, step = make_loop([{"tp": [1]}])
    loop.run(consumer, until=lambda: True)
    assert consumer.polls == [] and consumer.journal[0] == "settle"


def test_idle_exit_waits_for_the_idle_time_and_logs_it(caplog) -> None:
    loop, consumer, step = make_loop([{"tp": [1]}])
    started = time.monotonic()
    with caplog.at_level(logging.INFO, logger="genrec.infra.consumer_loop"):
        loop.run(consumer, exit_when_idle_s=0.2)
    assert time.monotonic() - started >= 0.2 and step.batches == [[1]]
    assert "test: no new events for 0.2 s, exiting" in caplog.text


def test_a_broker_outage_is_not_idleness_and_shows_in_health() -> None:
    outage = KafkaConnectionError("111 ECONNREFUSED")
    loop, consumer, step = make_loop([{"tp": [1]}, outage, outage, {"tp": [2]}])
    seen = []
    real_poll = consumer.poll

    def poll(**kwargs):
        seen.append(loop.outage.outage_s() > 0)  # what health() reports, unrounded
        return real_poll(**kwargs)

    consumer.poll = poll
    loop.run(consumer, exit_when_idle_s=0)  # the outage's empty polls must not end the run
    assert step.batches == [[1], [2]] and loop.outage.errors == 2
    assert seen == [False, False, True, True, False]


def test_a_group_still_being_joined_is_not_idleness() -> None:
    loop, consumer, step = make_loop(assigned_after_polls=4, join_grace_s=60.0)
    loop.run(consumer, exit_when_idle_s=0)
    assert len(consumer.polls) == 4  # idle only once partitions came
    loop, consumer, step = make_loop(assigned_after_polls=4, join_grace_s=0.0)
    loop.run(consumer, exit_when_idle_s=0)
    assert len(consumer.polls) == 1  # past the grace: idle is idle


def test_restarting_the_idle_clock_postpones_the_idle_exit() -> None:
    loop, consumer, step = make_loop()
    real_poll = consumer.poll

    def slow_poll_then_assign(**kwargs):
        if len(consumer.polls) < 3:
            time.sleep(0.03)  # longer than the idle time...
            loop.restart_idle_clock()  # ...but partitions were just assigned, as a listener says
        return real_poll(**kwargs)

    consumer.poll = slow_poll_then_assign
    loop.run(consumer, exit_when_idle_s=0.02)
    assert len(consumer.polls) >= 4


def test_progress_is_logged_every_progress_every_s() -> None:
    loop, consumer, step = make_loop([{"tp": [1]}, {"tp": [2]}])
    loop.run(consumer, exit_when_idle_s=0, progress_every_s=0.0)
    assert consumer.journal.count("progress") == 3  # every turn, the idle one too
    loop, consumer, step = make_loop([{"tp": [1]}])
    loop.run(consumer, exit_when_idle_s=0)
    assert "progress" not in consumer.journal


def test_health_stall_outage_failing_and_stopping() -> None:
    loop, _, step = make_loop(health_stall_s=300.0)
    ok, details = loop.health()
    assert ok and details["role"] == "test" and details["batches"] == 0
    assert details["loop_stalled_s"] < 1 and details["kafka_unreachable_s"] == 0
    loop.last_turn_at -= 200
    assert loop.health()[0]
    loop.last_turn_at -= 150
    assert not loop.health()[0]
    loop.last_turn_at = time.monotonic()
    loop.outage._since = time.monotonic() - 301
    assert not loop.health()[0]
    loop.outage._since = None
    step.failing_now = True
    assert not loop.health()[0]
    step.failing_now = False
    loop.request_stop()
    ok, details = loop.health()
    assert not ok and details["stopping"]


def test_an_error_ends_the_run_after_closing_everything() -> None:
    def store_away(batch):
        raise OSError("store away")

    loop, consumer, step = make_loop([{"tp": [1]}])
    step.on_batch = store_away
    with pytest.raises(OSError, match="store away"):
        loop.run(consumer)
    assert consumer.journal[-2:] == ["released", "consumer closed (autocommit=False)"]
    loop, consumer, step = make_loop([KafkaConfigurationError("bad sasl")])
    with pytest.raises(KafkaConfigurationError):  # retrying cannot fix it: not an outage
        loop.run(consumer, exit_when_idle_s=0)
    assert consumer.journal[-1].startswith("consumer closed") and loop.outage.errors == 0


def test_a_consumer_that_fails_to_close_is_logged_not_raised(caplog) -> None:
    loop, consumer, step = make_loop()
    consumer.close_error = RuntimeError("socket gone")
    with caplog.at_level(logging.ERROR, logger="genrec.infra.consumer_loop"):
        loop.run(consumer, exit_when_idle_s=0)
    assert "test: closing the Kafka consumer failed" in caplog.text


def test_a_step_with_work_in_flight_decides_when_its_batch_is_handed_over() -> None:
    class PipelinedStep(RecordingStep):
        """Keeps gathering while its engine is 'busy' (three polls), shortens its polls."""

        def __init__(self, journal):
            super().__init__(journal)
            self.busy_polls = 3
            self.windows: list[float] = []

        def hand_over_in_s(self, window_left_s):
            self.windows.append(window_left_s)
            return 0.01 if self.busy_polls > 0 else 0.0

        def poll_timeout_s(self, timeout_s):
            return min(timeout_s, 0.002)

        def after_poll(self):
            self.busy_polls -= 1
            self.journal.append("after poll")

        def drain(self):
            self.journal.append("drain")

    consumer = ScriptedConsumer([{"tp": [1]}, {"tp": [2]}])
    step = PipelinedStep(consumer.journal)
    loop = ConsumerLoop("test", step, health_stall_s=120.0, idle_poll_ms=200, batch_window_s=60.0)
    loop.run(consumer, exit_when_idle_s=0)
    # one batch of both polls: the step said "not yet" past the second, despite no window left
    assert step.batches == [[1, 2]]
    assert consumer.journal[:4] == ["after poll", "after poll", "after poll", "batch [1, 2]"]
    assert consumer.journal[-3:] == ["drain", "released", "consumer closed (autocommit=False)"]
    assert all(kwargs["timeout_ms"] <= 2 for kwargs in consumer.polls)  # shortened, idle too
    assert all(w > 59 for w in step.windows)  # what is left of the loop's own window
