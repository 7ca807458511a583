"""The online worker (online/worker.py) and its pipeline, with in-memory Kafka clients and a fake
recommender: requests, commits in order after every acknowledgement, rewinds, stop, rebalances."""

from __future__ import annotations

import gc
import threading
import time
from collections import deque
from dataclasses import dataclass

import pytest
from kafka import errors as kafka_errors
from kafka.future import Future
from kafka.structs import ConsumerGroupMetadata, TopicPartition

from genrec.infra.settings import Settings
from genrec.online import worker as worker_module
from genrec.online.batch_pipeline import InFlightBatch
from genrec.online.live_version import ServingBundle, ServingVersions
from genrec.online.recommender import PreparedBatch
from genrec.online.transactions import TransactionAborted, TransactionalPublisher
from genrec.online.worker import OnlineWorker, _Polled, collector_held_off, group_requests
from genrec.schemas.events import UserEvent
from genrec.schemas.recommendations import RecommendationMessage

TOPIC = "genrec.user-events"
MEMBER = ConsumerGroupMetadata("genrec-online", 1, "member-1", None)  # a joined consumer
WAIT_S = 10.0  # for conditions another thread brings about
IDLE_S = 0.2  # exit_when_idle_s of runs that end by themselves: time to read rewound records


@dataclass
class Record:
    topic: str
    partition: int
    offset: int
    key: bytes
    value: bytes


class FakeConsumer:
    """A partitioned log: each poll appends the next scripted arrival (raises it if it is an
    exception) and returns every record past the positions; seeks move the positions back.
    Commits are remembered, and asynchronous ones answered at the next poll, as in kafka-python."""

    def __init__(self, arrivals: list, paced: bool = False) -> None:
        self.arrivals = deque(arrivals)
        self.paced = paced  # the next arrival only once everything before it was committed
        self.revealed = 0
        self.log: dict[int, list[Record]] = {}
        self.positions: dict[int, int] = {}
        self.commits: list[dict] = []  # every commit, in the order issued
        self.committed: dict = {}  # what the group holds
        self.commit_errors: deque = deque()  # errors for the next commits, None: success
        self.seeks: list[tuple] = []
        self.closed = False
        self.listener = None
        self.polls = 0
        self._callbacks: list = []

    def poll(self, timeout_ms=0, max_records=None):
        self.polls += 1
        self._answer_commits()
        if self.arrivals and (not self.paced or len(self.commits) >= self.revealed):
            arrival = self.arrivals.popleft()
            self.revealed += 1
            if isinstance(arrival, Exception):
                raise arrival
            for record in arrival:
                self.log.setdefault(record.partition, []).append(record)
        by_tp: dict = {}
        for partition, records in self.log.items():
            position = self.positions.get(partition, records[0].offset)
            fresh = [r for r in records if r.offset >= position]
            if fresh:
                by_tp[TopicPartition(TOPIC, partition)] = fresh
                self.positions[partition] = fresh[-1].offset + 1
        if not by_tp and timeout_ms:
            time.sleep(min(timeout_ms, 2) / 1000)  # a real poll waits; keep the loop polite
        return by_tp

    def commit_async(self, offsets, callback=None):
        error = self.commit_errors.popleft() if self.commit_errors else None
        self._record(offsets, error)
        self._callbacks.append((callback, offsets, error))
        future = Future()
        return future.failure(error) if error is not None else future.success(None)

    def commit(self, offsets):
        error = self.commit_errors.popleft() if self.commit_errors else None
        self._record(offsets, error)
        if error is not None:
            raise error

    def _record(self, offsets, error) -> None:
        offsets = {tp: meta.offset for tp, meta in offsets.items()}
        self.commits.append(offsets)
        if error is None:
            self.committed.update(offsets)

    def _answer_commits(self) -> None:
        callbacks, self._callbacks = self._callbacks, []
        for callback, offsets, error in callbacks:
            if callback is not None:
                callback(offsets, error)

    def assignment(self):
        return {TopicPartition(TOPIC, p) for p in range(3)}

    def seek(self, tp, offset):
        self.seeks.append((tp.partition, offset))
        self.positions[tp.partition] = offset

    def highwater(self, tp):
        return None

    def close(self):
        self._answer_commits()
        self.closed = True


class FakeProducer:
    """Acknowledges every send at once, or fails the first ``fail_first_sends``; with
    ``manual`` the futures stay pending until the test resolves them (``futures``)."""

    def __init__(self, fail_first_sends: int = 0, manual: bool = False) -> None:
        self.sent: list[tuple[bytes, RecommendationMessage]] = []
        self.futures: list[Future] = []
        self.fail_first_sends = fail_first_sends
        self.manual = manual
        self.closed = False

    def send(self, topic, key, value):
        future = Future()
        self.futures.append(future)
        if self.fail_first_sends > 0:
            self.fail_first_sends -= 1
            return future.failure(RuntimeError("broker said no"))
        self.sent.append((key, RecommendationMessage.model_validate_json(value)))
        return future if self.manual else future.success("ack")

    def close(self, timeout=None):
        self.closed = True


class EchoRecommender:
    """One message per request naming the bundle that prepared it; records its batches."""

    def __init__(self) -> None:
        self.batches: list[list] = []

    def prepare(self, requests, bundle):
        self.batches.append(list(requests))
        return PreparedBatch(list(requests), bundle, None, [{} for _ in requests], {})

    def finish(self, prepared):
        return [
            RecommendationMessage(
                request_id=r.event.event_id,
                user_id=r.user_id,
                event_id=r.event.event_id,
                items=[],
                model_version=prepared.bundle.key,
                latency_ms=0.0,
                covered_event_ids=[e.event_id for e in r.covered],
                decoding={"path": "fake"},
            )  # fmt: skip
            for r in prepared.requests
        ]


def record(partition: int, offset: int, event_id: str, user_id: str, item_id: str = "1") -> Record:
    event = UserEvent(
        event_id=event_id, user_id=user_id, item_id=item_id, event_type="view", ts=offset
    )
    return Record(TOPIC, partition, offset, user_id.encode(), event.to_json_bytes())


def make_worker(
    arrivals, producer=None, recommender=None, probe=lambda: "v1", paced=False, **online
):
    settings = Settings(online=online)
    consumer = FakeConsumer(arrivals, paced)
    producer = producer or FakeProducer()
    versions = ServingVersions(probe, lambda key: ServingBundle(key)).start(background=False)

    def factory(listener):
        consumer.listener = listener
        return consumer

    worker = OnlineWorker(
        settings, recommender or EchoRecommender(), versions,
        consumer_factory=factory, producer_factory=lambda: producer,
    )  # fmt: skip
    worker.loop.stop_requested.wait = lambda timeout=None: False  # no retry back-off in tests
    return worker, consumer, producer, versions


def in_background(worker: OnlineWorker, **run) -> threading.Thread:
    thread = threading.Thread(target=worker.run, kwargs=run, daemon=True)
    thread.start()
    return thread


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def run_listener(coroutine) -> None:
    """Drive a rebalance coroutine as kafka-python's loop would (the fakes never suspend it)."""
    with pytest.raises(StopIteration):
        coroutine.send(None)


def test_latest_event_per_user_is_the_request_and_offsets_commit_after_publish() -> None:
    batch = [
        record(0, 10, "a1", "alice"), record(1, 5, "b1", "bob"), record(0, 11, "a2", "alice"),
        Record(TOPIC, 1, 6, b"x", b"not json"), record(0, 12, "a3", "alice"),
    ]  # fmt: skip
    worker, consumer, producer, _ = make_worker([batch])
    report = worker.run(exit_when_idle_s=IDLE_S)
    answered = {m.event_id: m for _, m in producer.sent}
    assert set(answered) == {"a3", "b1"}
    assert answered["a3"].covered_event_ids == ["a1", "a2", "a3"]
    assert [key for key, _ in producer.sent] == [b"alice", b"bob"]
    # committed asynchronously once acknowledged, then once more, waited for, at the end
    assert consumer.commits == [{TopicPartition(TOPIC, 0): 13, TopicPartition(TOPIC, 1): 7}] * 2
    assert report.requests == 2 and report.events == 5 and report.invalid_events == 1
    assert consumer.closed and producer.closed


def test_failed_publish_is_not_committed_and_the_batch_is_retried() -> None:
    batch = [record(2, 40, "c1", "carol"), record(2, 41, "d1", "dave")]
    worker, consumer, producer, _ = make_worker([batch], FakeProducer(fail_first_sends=1))
    report = worker.run(exit_when_idle_s=IDLE_S)
    assert consumer.seeks == [(2, 40)]  # read again from the batch's first offset
    assert consumer.commits[0] == {TopicPartition(TOPIC, 2): 42}  # nothing before the retry
    # d1 went out in the failed batch too: at-least-once, consumers dedupe on request_id
    assert {m.event_id for _, m in producer.sent} == {"c1", "d1"}
    assert report.publish_failures == 1 and report.requests == 2


def test_a_failing_recommender_rewinds_the_batch_and_turns_health_red() -> None:
    class FlakyRecommender(EchoRecommender):
        def __init__(self, failures: int) -> None:
            super().__init__()
            self.failures = failures

        def prepare(self, requests, bundle):
            if self.failures > 0:
                self.failures -= 1
                raise OSError("behavior store unreachable")
            return super().prepare(requests, bundle)

    worker, consumer, producer, _ = make_worker(
        [[record(1, 7, "f1", "frank")]], recommender=FlakyRecommender(failures=3)
    )
    health = []
    worker.loop.stop_requested.wait = lambda timeout=None: (
        health.append(worker.health()[0]) or False
    )
    worker.run(exit_when_idle_s=IDLE_S)
    assert consumer.seeks == [(1, 7)] * 3 and health == [True, True, False]
    assert [m.event_id for _, m in producer.sent] == ["f1"]
    assert consumer.committed == {TopicPartition(TOPIC, 1): 8}
    assert worker.health()[1]["failing_batches"] == 0


def test_a_poll_beyond_max_batch_users_is_one_batch_and_one_commit() -> None:
    batch = [record(0, i, f"e{i}", f"user{i}") for i in range(7)]
    recommender = EchoRecommender()
    worker, consumer, producer, _ = make_worker([batch], recommender=recommender, max_batch_users=3)
    worker.run(exit_when_idle_s=IDLE_S)
    # the recommender decodes it in calls of max_batch_users (tests/test_online_recommender.py)
    assert [len(b) for b in recommender.batches] == [7]
    assert len(producer.sent) == 7 and consumer.commits[0] == {TopicPartition(TOPIC, 0): 7}


def test_new_version_is_used_from_the_next_batch_on() -> None:
    active = {"key": "v1"}
    recommender = EchoRecommender()
    worker, _, producer, versions = make_worker(
        [[record(0, 0, "e0", "u0")], [record(0, 1, "e1", "u1")]],
        recommender=recommender, probe=lambda: active["key"],
    )  # fmt: skip
    original = recommender.prepare

    def switch_after_first(requests, bundle):
        prepared = original(requests, bundle)
        active["key"] = "v2"
        versions.check_now()
        return prepared

    recommender.prepare = switch_after_first
    report = worker.run(exit_when_idle_s=IDLE_S)
    assert [(m.event_id, m.model_version) for _, m in producer.sent] == [("e0", "v1"), ("e1", "v2")]
    assert report.versions == ["v1", "v2"]


def test_stop_request_drains_the_batch_in_hand() -> None:
    arrivals = [[record(0, 0, "e0", "u0")], [record(0, 1, "e1", "u1")], [record(0, 2, "e2", "u2")]]
    recommender = EchoRecommender()
    worker, consumer, producer, _ = make_worker(arrivals, recommender=recommender)
    original = recommender.prepare

    def stop_during_first(requests, bundle):
        worker.request_stop()  # as SIGTERM would, while a batch is being prepared
        return original(requests, bundle)

    recommender.prepare = stop_during_first
    worker.run()
    assert [m.event_id for _, m in producer.sent] == ["e0"]
    assert consumer.committed == {TopicPartition(TOPIC, 0): 1} and consumer.closed


class GatedRecommender(EchoRecommender):
    """Decoding waits for ``gate`` (set: no wait): the test decides when a batch finishes."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.decoding = threading.Event()  # set while a batch waits at the gate

    def finish(self, prepared):
        self.decoding.set()
        self.gate.wait(WAIT_S)
        self.decoding.clear()
        return super().finish(prepared)


def one_decoding_one_waiting():
    """A worker with a decode thread: e0's batch decoding (held at the gate), f0's prepared
    and waiting. The decode thread has no timing yet, so f0's was prepared at once."""
    recommender = GatedRecommender()
    worker, consumer, producer, _ = make_worker(
        [[record(0, 0, "e0", "u0")]], recommender=recommender, decode_thread=True
    )
    thread = in_background(worker)
    wait_until(recommender.decoding.is_set, "the first batch to decode")
    consumer.arrivals.append([record(1, 0, "f0", "u1")])
    wait_until(lambda: len(recommender.batches) == 2, "a second batch to be prepared")
    return worker, consumer, producer, recommender, thread


def test_with_a_decode_thread_the_next_batch_is_prepared_while_one_decodes() -> None:
    worker, consumer, producer, recommender, thread = one_decoding_one_waiting()
    # what comes next gathers behind the waiting batch until the decode thread takes it
    consumer.arrivals.extend([[record(2, 0, "g0", "u2")], [record(0, 1, "e1", "u3")]])
    wait_until(lambda: len(worker._open) == 2, "the other arrivals gathered")
    assert consumer.commits == [] and len(recommender.batches) == 2
    recommender.gate.set()
    wait_until(lambda: len(producer.sent) == 4, "every answer")
    worker.request_stop()
    thread.join(WAIT_S)
    assert [sorted(r.user_id for r in b) for b in recommender.batches] == [
        ["u0"],
        ["u1"],
        ["u2", "u3"],
    ]
    assert consumer.committed == {TopicPartition(TOPIC, p): n for p, n in ((0, 2), (1, 1), (2, 1))}


def test_a_batch_is_handed_over_at_once_while_the_decode_thread_is_idle() -> None:
    worker, *_ = make_worker([])
    worker.take_records({TopicPartition(TOPIC, 0): [record(0, 0, "e0", "u0")]}, time.monotonic())
    assert worker.hand_over_in_s(window_left_s=0.0) <= 0  # no fixed window to wait out
    assert worker.hand_over_in_s(window_left_s=0.02) > 0  # unless one is configured
    worker.decoder.timer.record(1, 0.5)
    worker.decoder._current = (time.monotonic(), 1)  # busy with a batch for ~0.5 s more
    assert 0.3 < worker.hand_over_in_s(window_left_s=0.0) <= 0.5


def two_batches_awaiting_acks(decode_thread: bool = False):
    """A worker that sent e5's batch (partition 0), then f9's (partition 1), and waits for
    Kafka: ``producer.futures`` stay pending until the test resolves them."""
    arrivals = [[record(0, 5, "e5", "u0")], [record(1, 9, "f9", "u1")]]
    producer = FakeProducer(manual=True)
    worker, consumer, _, _ = make_worker(arrivals, producer=producer, decode_thread=decode_thread)
    thread = in_background(worker)
    wait_until(lambda: len(producer.futures) == 2, "both batches sent")
    return worker, consumer, producer, thread


BOTH_COMMITTED = {TopicPartition(TOPIC, 0): 6, TopicPartition(TOPIC, 1): 10}


@pytest.mark.parametrize("decode_thread", [False, True])
def test_commits_follow_the_acknowledgements_in_batch_order(decode_thread) -> None:
    worker, consumer, producer, thread = two_batches_awaiting_acks(decode_thread)
    producer.futures[1].success("ack")  # the second batch is acknowledged first ...
    polls = consumer.polls
    wait_until(lambda: consumer.polls > polls + 3, "a few more turns of the loop")
    assert consumer.commits == []  # ... but it may not be committed before the first
    producer.futures[0].success("ack")
    wait_until(lambda: consumer.commits, "a commit")
    assert consumer.commits[0] == BOTH_COMMITTED
    worker.request_stop()
    thread.join(WAIT_S)


@pytest.mark.parametrize("decode_thread", [False, True])
def test_a_failed_batch_rewinds_every_batch_after_it(decode_thread) -> None:
    worker, consumer, producer, thread = two_batches_awaiting_acks(decode_thread)
    producer.futures[1].success("ack")
    producer.futures[0].failure(RuntimeError("broker said no"))
    wait_until(lambda: len(producer.futures) == 4, "both read again and sent again")
    assert sorted(consumer.seeks) == [(0, 5), (1, 9)]  # from their first offsets
    for future in producer.futures[2:]:
        future.success("ack")
    wait_until(lambda: consumer.committed, "the retry committed")
    worker.request_stop()
    thread.join(WAIT_S)
    assert consumer.committed == BOTH_COMMITTED and worker.report.publish_failures == 1


def test_sigterm_finishes_every_batch_in_hand_before_closing() -> None:
    worker, consumer, producer, recommender, thread = one_decoding_one_waiting()
    worker.request_stop()
    time.sleep(0.05)
    assert thread.is_alive() and not consumer.closed  # still draining
    recommender.gate.set()
    thread.join(WAIT_S)
    assert sorted(m.event_id for _, m in producer.sent) == ["e0", "f0"]
    assert consumer.committed == {TopicPartition(TOPIC, 0): 1, TopicPartition(TOPIC, 1): 1}
    assert consumer.closed and producer.closed


def test_sigterm_waits_for_the_acknowledgements_of_every_batch_in_hand() -> None:
    worker, consumer, producer, thread = two_batches_awaiting_acks()
    worker.request_stop()
    time.sleep(0.05)
    assert thread.is_alive() and consumer.commits == []  # still waiting for Kafka
    for future in producer.futures:
        future.success("ack")
    thread.join(WAIT_S)
    assert consumer.committed == BOTH_COMMITTED and consumer.closed and producer.closed


@pytest.mark.parametrize("decode_thread", [False, True])
def test_a_batch_waiting_for_its_acknowledgements_holds_nothing_it_was_served_from(
    decode_thread,
) -> None:
    worker, _, producer, thread = two_batches_awaiting_acks(decode_thread)
    in_flight = list(worker._in_flight)
    assert len(in_flight) == 2 and all(batch.prepared is None for batch in in_flight)
    worker.request_stop()
    for future in producer.futures:
        future.success("ack")
    thread.join(WAIT_S)


def test_revoked_partitions_are_dropped_from_the_open_batch() -> None:
    class RevokingConsumer(FakeConsumer):
        def poll(self, timeout_ms=0, max_records=None):
            polled = super().poll(timeout_ms, max_records)
            if not polled and worker._open and not self.seeks:  # a rebalance mid-gathering
                self.seeks.append("revoked")
                run_listener(self.listener.on_partitions_revoked([TopicPartition(TOPIC, 1)]))
            return polled

    consumer = RevokingConsumer([[record(0, 0, "e0", "u0"), record(1, 0, "f0", "u1")]])
    worker, producer = listening_worker(consumer)
    worker.run(exit_when_idle_s=IDLE_S)
    assert [m.event_id for _, m in producer.sent] == ["e0"]
    assert consumer.committed == {TopicPartition(TOPIC, 0): 1}


def test_a_partition_assigned_back_is_read_again_from_its_first_dropped_record() -> None:
    """An eager rebalance revokes every partition, then hands some back; kafka-python keeps
    their fetch positions, so the worker must seek back to the records it dropped."""
    tp0, tp1, tp2 = (TopicPartition(TOPIC, p) for p in range(3))

    class RebalancingConsumer(FakeConsumer):
        def poll(self, timeout_ms=0, max_records=None):
            polled = super().poll(timeout_ms, max_records)
            if not polled and worker._open and not self.seeks:  # a rebalance mid-gathering
                run_listener(self.listener.on_partitions_revoked([tp0, tp1, tp2]))
                run_listener(self.listener.on_partitions_assigned([tp1, tp2]))
                self.assigned = {tp1, tp2}  # tp0 went to another worker
            return polled

        def assignment(self):
            return getattr(self, "assigned", {tp0, tp1, tp2})

    consumer = RebalancingConsumer(
        [[record(0, 7, "e7", "u0"), record(1, 3, "f3", "u1"), record(1, 4, "f4", "u2")]]
    )
    worker, producer = listening_worker(consumer)
    worker.run(exit_when_idle_s=IDLE_S)
    assert consumer.seeks == [(1, 3)]  # back to f3 on tp1; tp0 is its new owner's
    assert sorted(m.event_id for _, m in producer.sent) == ["f3", "f4"]  # read again
    assert consumer.committed == {tp1: 5}


@pytest.mark.parametrize("decode_thread", [False, True])
def test_a_revocation_waits_for_the_batches_in_flight_and_commits_them_first(
    decode_thread,
) -> None:
    tp0 = TopicPartition(TOPIC, 0)
    producer = FakeProducer(manual=True)
    revoking, revoked = threading.Event(), threading.Event()

    class RevokingConsumer(FakeConsumer):
        def poll(self, timeout_ms=0, max_records=None):
            if producer.futures and not revoking.is_set():  # a rebalance with a batch in flight
                revoking.set()
                run_listener(self.listener.on_partitions_revoked([tp0]))
                revoked.set()
            return super().poll(timeout_ms, max_records)

    consumer = RevokingConsumer([[record(0, 3, "e3", "u0")]])
    worker, _ = listening_worker(consumer, producer, decode_thread=decode_thread)
    thread = in_background(worker)
    wait_until(revoking.is_set, "the rebalance")
    time.sleep(0.05)
    assert not revoked.is_set() and consumer.commits == []  # it waits for the acknowledgement
    producer.futures[0].success("ack")
    wait_until(revoked.is_set, "the revocation to return")
    assert consumer.commits == [{tp0: 4}]  # committed before the group moves on
    worker.request_stop()
    thread.join(WAIT_S)
    assert worker.report.requests == 1 and consumer.commits == [{tp0: 4}]


def listening_worker(
    consumer: FakeConsumer, producer: FakeProducer | None = None, decode_thread: bool = False
) -> tuple[OnlineWorker, FakeProducer]:
    """A worker with a 50 ms batch window whose rebalance listener ``consumer`` can call."""

    def factory(listener):
        consumer.listener = listener
        return consumer

    producer = producer or FakeProducer()
    worker = OnlineWorker(
        Settings(online={"batch_window_ms": 50, "decode_thread": decode_thread}),
        EchoRecommender(),
        ServingVersions(lambda: "v", ServingBundle).start(background=False),
        consumer_factory=factory, producer_factory=lambda: producer,
    )  # fmt: skip
    return worker, producer


def test_health_reports_the_serving_version() -> None:
    worker, *_ = make_worker([])
    ok, details = worker.health()
    assert ok and details["version"]["key"] == "v1" and details["decoding_batch_s"] == 0
    worker.request_stop()
    assert not worker.health()[0]


def test_health_turns_red_when_one_batch_decodes_longer_than_the_stall_setting() -> None:
    worker, *_ = make_worker([], health_stall_s=300.0)
    worker.decoder._current = (time.monotonic() - 200, 8)
    assert worker.health()[0]
    worker.decoder._current = (time.monotonic() - 301, 8)
    ok, details = worker.health()
    assert not ok and details["decoding_batch_s"] >= 301


def test_commits_failing_in_a_row_turn_health_red_until_one_succeeds() -> None:
    from kafka.errors import CommitFailedError

    arrivals = [[record(0, offset, f"e{offset}", "alice")] for offset in range(4)]
    worker, consumer, producer, _ = make_worker(arrivals, paced=True)
    consumer.commit_errors.extend([CommitFailedError("rebalanced")] * 3 + [None])
    health = []
    real_poll = consumer.poll

    def poll_and_check(**kwargs):
        polled = real_poll(**kwargs)  # answers the commits issued before it
        if consumer.commits and len(health) < len(consumer.commits):
            health.append(worker.health()[0])
        return polled

    consumer.poll = poll_and_check
    report = worker.run(exit_when_idle_s=IDLE_S)
    assert report.requests == 4 and len(producer.sent) == 4  # answered, once each
    assert health == [True, True, False, True]  # red from the third failure in a row
    assert report.commit_failures == 3 and consumer.committed == {TopicPartition(TOPIC, 0): 4}


def test_health_turns_red_when_the_loop_stalls_longer_than_the_setting() -> None:
    worker, *_ = make_worker([], health_stall_s=300.0)
    worker.loop.last_turn_at -= 200  # a batch that has taken 200 s so far
    ok, details = worker.health()
    assert ok and details["loop_stalled_s"] >= 200
    worker.loop.last_turn_at -= 150
    assert not worker.health()[0]


def test_a_broker_outage_in_poll_is_ridden_out_and_shows_in_health() -> None:
    from kafka.errors import KafkaConnectionError

    outage = KafkaConnectionError("111 ECONNREFUSED")
    worker, consumer, producer, _ = make_worker(
        [[record(0, 1, "a1", "alice")], outage, outage, [record(0, 2, "a2", "alice")]]
    )
    seen_in_outage = []
    real_poll = consumer.poll

    def poll(**kwargs):
        seen_in_outage.append(worker.loop.outage.outage_s())  # what health() reports, unrounded
        return real_poll(**kwargs)

    consumer.poll = poll
    # exit_when_idle_s=0 would end the run at the first empty poll: an outage must not.
    report = worker.run(exit_when_idle_s=IDLE_S)
    assert [m.event_id for _, m in producer.sent] == ["a1", "a2"]
    assert consumer.committed == {TopicPartition(TOPIC, 0): 3}
    assert report.requests == 2 and worker.loop.outage.errors == 2
    assert any(s > 0 for s in seen_in_outage) and worker.health()[1]["kafka_unreachable_s"] == 0


def test_a_non_retriable_poll_error_stops_the_worker_and_closes_the_clients() -> None:
    from kafka.errors import KafkaConfigurationError

    worker, consumer, producer, _ = make_worker([KafkaConfigurationError("bad sasl settings")])
    with pytest.raises(KafkaConfigurationError):
        worker.run(exit_when_idle_s=IDLE_S)
    assert consumer.closed and producer.closed


def test_health_turns_red_after_two_minutes_without_kafka() -> None:
    worker, *_ = make_worker([])
    assert worker.health()[0]
    worker.loop.outage._since = time.monotonic() - 130  # an outage that began 130 s ago
    ok, details = worker.health()
    assert not ok and details["kafka_unreachable_s"] >= 130


def test_the_batch_timer_fits_a_fixed_cost_beside_the_cost_per_user() -> None:
    from genrec.online.batch_pipeline import BatchTimer

    timer = BatchTimer()
    assert timer.predict(4) is None
    timer.record(1, 0.010)
    assert timer.predict(8) == pytest.approx(0.010)  # one size seen: its mean time
    for users in (1, 2, 4, 8, 2, 1):
        timer.record(users, 0.006 + 0.004 * users)
    assert timer.predict(16) == pytest.approx(0.070, rel=0.05)
    assert timer.predict(1) == pytest.approx(0.010, rel=0.05)


# --- exactly-once (online.processing_guarantee) ------------------------------------------


class Answered:
    """A transactional request result that runs its step when waited for."""

    def __init__(self, step) -> None:
        self.step = step

    def wait(self, timeout_ms=None) -> bool:
        self.step()
        return True


class FakeTransactionalProducer(FakeProducer):
    """Transactions as the broker keeps them: sends and offsets visible only once committed;
    ``fail_commits`` refuses that many commits (as a coordinator refusing a stale
    generation does), ``fenced`` raises what a fenced producer raises."""

    def __init__(self, fail_commits: int = 0, fenced: bool = False) -> None:
        super().__init__()
        self.fail_commits, self.fenced = fail_commits, fenced
        self.pending: list = []
        self.pending_offsets: dict = {}
        self.committed_offsets: dict = {}
        self.log: list[str] = []

    def init_transactions(self):
        self.log.append("init")

    @property
    def _transaction_manager(self):  # what TransactionalPublisher calls to bound its waits
        producer = self

        class Manager:
            def begin_commit(self):
                return Answered(producer.commit_transaction)

            def begin_abort(self):
                return Answered(producer.abort_transaction)

            def send_offsets_to_transaction(self, offsets, group_metadata):
                return Answered(
                    lambda: producer.send_offsets_to_transaction(offsets, group_metadata)
                )

        return Manager()

    class _sender:  # noqa: N801 (kafka-python's attribute name)
        @staticmethod
        def wakeup():
            pass

        @staticmethod
        def force_close():
            pass

        @staticmethod
        def join(timeout=None):
            pass

    def begin_transaction(self):
        self.log.append("begin")
        self.pending, self.pending_offsets = [], {}

    def send(self, topic, key, value):
        self.pending.append((key, RecommendationMessage.model_validate_json(value)))
        return Future().success("ack")

    def send_offsets_to_transaction(self, offsets, group_metadata):
        assert group_metadata == MEMBER
        self.pending_offsets = {tp: meta.offset for tp, meta in offsets.items()}

    def commit_transaction(self):
        if self.fenced:
            raise kafka_errors.ProducerFencedError("another producer with this id")
        if self.fail_commits:
            self.fail_commits -= 1
            raise kafka_errors.CommitFailedError("stale generation")
        self.log.append("commit")
        self.sent.extend(self.pending)
        self.committed_offsets.update(self.pending_offsets)

    def abort_transaction(self):
        self.log.append("abort")


def worker_polled(rec) -> _Polled:
    return _Polled(rec, UserEvent.model_validate_json(rec.value), time.monotonic())


def exactly_once_worker(arrivals, producer):
    worker, consumer, producer, versions = make_worker(
        arrivals, producer, processing_guarantee="exactly_once", instance_id="w1"
    )
    consumer.group_metadata = lambda: MEMBER
    return worker, consumer, producer


def test_exactly_once_commits_messages_and_offsets_in_one_transaction() -> None:
    batch = [record(0, 10, "a1", "alice"), record(1, 5, "b1", "bob")]
    worker, consumer, producer = exactly_once_worker([batch], FakeTransactionalProducer())
    report = worker.run(exit_when_idle_s=IDLE_S)
    assert {m.event_id for _, m in producer.sent} == {"a1", "b1"}
    assert producer.committed_offsets == {TopicPartition(TOPIC, 0): 11, TopicPartition(TOPIC, 1): 6}
    assert consumer.commits == []  # no commit outside the transaction
    assert producer.log == ["init", "begin", "commit"] and report.requests == 2
    assert worker.settings.online.transactional_id() == "genrec-online.w1"


def test_exactly_once_an_aborted_transaction_is_served_again_and_never_seen_twice(
    caplog,
) -> None:
    batch = [record(2, 40, "c1", "carol"), record(2, 41, "d1", "dave")]
    producer = FakeTransactionalProducer(fail_commits=1)
    worker, consumer, producer = exactly_once_worker([batch], producer)
    with caplog.at_level("INFO", logger="genrec.online"):
        report = worker.run(exit_when_idle_s=IDLE_S)
    # Its offsets were sent: not aborted on this producer but a new one started (the
    # factory hands the same fake back), whose init aborts it on the broker.
    assert producer.log == ["init", "begin", "init", "begin", "commit"]
    assert consumer.seeks == [(2, 40)]
    assert sorted(m.event_id for _, m in producer.sent) == ["c1", "d1"]  # once each
    assert producer.committed_offsets == {TopicPartition(TOPIC, 2): 42}
    assert report.publish_failures == 1
    failures = [  # genrec's own lines: a client an earlier test left may log beside them
        r.getMessage() for r in caplog.records
        if r.name.startswith("genrec") and r.levelname in ("WARNING", "ERROR")
    ]  # fmt: skip
    assert failures == [  # one line for the aborted transaction, not one per layer
        "transaction of 2 requests aborted (CommitFailedError: stale generation; a new "
        "producer took over); they will be served again"
    ]


def test_exactly_once_a_consumer_out_of_its_group_publishes_nothing_until_it_rejoins() -> None:
    """Its heartbeat learned the session expired: kafka-python's snapshot then has
    generation -1 and no member id, which the coordinator would accept unfenced. The
    batch is not published; served again with a member's snapshot, once."""
    batch = [record(1, 7, "e1", "erin"), record(1, 8, "f1", "frank")]
    worker, consumer, producer = exactly_once_worker([batch], FakeTransactionalProducer())
    snapshots = iter([ConsumerGroupMetadata("genrec-online")])  # out of the group, once
    consumer.group_metadata = lambda: next(snapshots, MEMBER)
    report = worker.run(exit_when_idle_s=IDLE_S)
    assert producer.log == ["init", "begin", "commit"]  # nothing begun while out
    assert consumer.seeks == [(1, 7)]
    assert sorted(m.event_id for _, m in producer.sent) == ["e1", "f1"]
    assert producer.committed_offsets == {TopicPartition(TOPIC, 1): 9}
    assert report.publish_failures == 1


@pytest.mark.parametrize(
    "snapshot",
    ["genrec-online", ConsumerGroupMetadata("genrec-online"),
     ConsumerGroupMetadata("genrec-online", 4, "", None)],
    ids=["a group id", "no generation", "no member id"],
)  # fmt: skip
def test_a_transactional_publisher_refuses_offsets_no_member_would_be_fenced_for(
    snapshot,
) -> None:
    publisher = TransactionalPublisher(FakeTransactionalProducer)
    with pytest.raises(TransactionAborted, match="out of its group"):
        publisher.publish("t", [], {TopicPartition(TOPIC, 0): 3}, snapshot)
    assert publisher.producer.log == ["init"] and publisher.aborted == 0
    publisher.publish("t", [], {}, snapshot)  # no offsets: nothing to fence


def test_a_transaction_that_failed_before_its_offsets_is_aborted_on_its_producer() -> None:
    class NoLeader(FakeTransactionalProducer):
        def send(self, topic, key, value):
            raise kafka_errors.KafkaTimeoutError("no partition leader")

    made: list = []

    def factory():
        made.append(NoLeader())
        return made[-1]

    publisher = TransactionalPublisher(factory)
    with pytest.raises(TransactionAborted, match="no partition leader; aborted"):
        publisher.publish("t", [(b"k", b"{}")], {TopicPartition(TOPIC, 0): 3}, MEMBER)
    assert len(made) == 1 and made[0].log == ["init", "begin", "abort"] and not made[0].closed
    assert publisher.aborted == 1 and publisher.committed == {}


def test_a_transactional_publisher_refuses_offsets_behind_its_last_commit() -> None:
    tp = TopicPartition(TOPIC, 0)
    publisher = TransactionalPublisher(FakeTransactionalProducer)
    publisher.publish("t", [], {tp: 36}, MEMBER)
    for behind in (8, 36):  # 36 again: its last event (35) was answered too
        with pytest.raises(TransactionAborted, match="not past those this worker committed"):
            publisher.publish("t", [], {tp: behind}, MEMBER)
    assert publisher.producer.log == ["init", "begin", "commit"]  # nothing begun for them
    publisher.publish("t", [], {tp: 37}, MEMBER)
    assert publisher.committed == {tp: 37} and publisher.producer.committed_offsets == {tp: 37}


def test_exactly_once_events_below_the_last_committed_offset_are_not_answered_again() -> None:
    """The group's committed offset went back (a stale commit) and the worker reads from
    it: what its own committed transaction answered is skipped, the rest served."""
    tp0 = TopicPartition(TOPIC, 0)
    first = [record(0, 5, "a5", "alice"), record(0, 6, "b6", "bob")]
    again = [record(0, 5, "a5", "alice"), record(0, 6, "b6", "bob"), record(0, 7, "c7", "carol")]
    worker, consumer, producer = exactly_once_worker([first], FakeTransactionalProducer())
    worker.run(exit_when_idle_s=IDLE_S)
    assert worker.publisher.committed == {tp0: 7}
    worker.take_records({tp0: again}, 0.0)
    assert [p.record.offset for p in worker._open] == [7]
    worker.take_records({tp0: [record(0, 8, "d8", "dave")]}, 0.0)  # past it: all kept
    assert [p.record.offset for p in worker._open] == [7, 8]


def test_exactly_once_a_fenced_worker_stops() -> None:
    batch = [record(0, 1, "e1", "erin")]
    worker, _consumer, producer = exactly_once_worker(
        [batch], FakeTransactionalProducer(fenced=True)
    )
    report = worker.run(exit_when_idle_s=30)  # stops at once, not when idle
    assert report.fenced and producer.sent == [] and producer.closed


def test_a_transactional_publisher_replaces_a_producer_that_cannot_abort() -> None:
    class Stuck(FakeTransactionalProducer):
        def abort_transaction(self):
            raise kafka_errors.KafkaError("fatal state")

    made: list = []

    def factory():
        made.append(Stuck(fail_commits=1) if not made else FakeTransactionalProducer())
        return made[-1]

    publisher = TransactionalPublisher(factory)
    with pytest.raises(TransactionAborted):
        publisher.publish(
            "t",
            [(b"k", RecommendationMessage(user_id="u", items=[], latency_ms=0).to_json_bytes())],
            {},
            None,
        )
    assert len(made) == 2 and made[0].closed and publisher.producer is made[1]
    assert made[1].log == ["init"]  # the new producer's init fences and aborts the old one


@pytest.mark.parametrize("guarantee", ["at_least_once", "exactly_once"])
def test_lost_partitions_read_again_only_what_was_not_committed(guarantee) -> None:
    """A batch published but not yet collected when its partitions are lost: at-least-once
    never committed it (read it again); exactly-once committed it in its transaction."""
    tp0 = TopicPartition(TOPIC, 0)
    worker, consumer, _producer, _ = make_worker([], processing_guarantee=guarantee)
    worker.consumer = consumer
    polled = [worker_polled(record(0, 7, "e7", "u7"))]
    batch = InFlightBatch(polled, group_requests(polled), worker._epoch)
    batch.paths = ["fake"]
    batch.mark_sent()  # done: acknowledged (at-least-once) / its transaction committed
    worker._in_flight.append(batch)
    assert worker._partitions_revoked([tp0], lost=True) == {}
    # Nothing to seek back to when it is assigned again: kafka-python starts a lost
    # partition from its committed offset, which another member may have moved on.
    assert worker._dropped == {}
    assert worker.report.requests == (1 if guarantee == "exactly_once" else 0)


def test_a_transaction_without_an_answer_is_abandoned_and_the_producer_replaced() -> None:
    class Silent(FakeTransactionalProducer):  # its coordinator died mid-commit
        @property
        def _transaction_manager(self):
            class Manager:
                def begin_commit(self):
                    return type("Unanswered", (), {"wait": lambda self, timeout_ms=None: False})()

            return Manager()

    made: list = []

    def factory():
        made.append(Silent() if not made else FakeTransactionalProducer())
        return made[-1]

    publisher = TransactionalPublisher(factory, timeout_s=0.01)
    with pytest.raises(TransactionAborted, match="no answer within"):
        publisher.publish("t", [], {}, None)
    assert len(made) == 2 and made[0].closed and publisher.producer is made[1]


def unanswered(*_args):
    return type("Unanswered", (), {"wait": lambda self, timeout_ms=None: False})()


def test_an_abort_without_an_answer_is_abandoned_and_the_producer_replaced() -> None:
    class DeadCoordinator(FakeTransactionalProducer):  # the send failed, then its abort hangs
        def send(self, topic, key, value):
            raise kafka_errors.KafkaTimeoutError("no partition leader")

        @property
        def _transaction_manager(self):
            return type("Manager", (), {"begin_abort": unanswered})()

    made: list = []

    def factory():
        made.append(DeadCoordinator() if not made else FakeTransactionalProducer())
        return made[-1]

    publisher = TransactionalPublisher(factory, timeout_s=0.01)
    with pytest.raises(TransactionAborted, match="KafkaTimeoutError"):
        publisher.publish("t", [(b"k", b"{}")], {}, None)
    assert len(made) == 2 and made[0].closed and publisher.producer is made[1]


def test_a_replacement_that_cannot_start_is_retried_on_the_next_batch() -> None:
    """No coordinator yet: the new producer's init_transactions times out. The batch is
    aborted (served again), not a crash, and the next publish starts a producer first."""

    class Silent(FakeTransactionalProducer):
        @property
        def _transaction_manager(self):
            return type("Manager", (), {"begin_commit": unanswered})()

    class NoCoordinator(FakeTransactionalProducer):
        def init_transactions(self):
            raise kafka_errors.KafkaTimeoutError("Timeout expired while initializing")

    made: list = []

    def factory():
        kinds = [Silent, NoCoordinator, FakeTransactionalProducer]
        made.append(kinds[min(len(made), 2)]())
        return made[-1]

    publisher = TransactionalPublisher(factory, timeout_s=0.01)
    with pytest.raises(TransactionAborted, match="no new producer yet"):
        publisher.publish("t", [], {}, None)
    assert publisher.producer is None and made[1].closed
    publisher.publish("t", [], {}, None)  # starts the third producer, then commits
    assert publisher.producer is made[2] and made[2].log == ["init", "begin", "commit"]


@pytest.mark.parametrize("lost", [False, True])
def test_gathered_records_of_a_lost_partition_are_not_sought_back_to(lost) -> None:
    """Records polled but not yet answered when the partition goes: revoked and assigned
    back in the same rebalance, they are read again from the first of them; lost, another
    member may have answered them meanwhile, so the partition starts from its committed
    offset (a broker-kill run answered 38 events twice before this)."""
    tp0 = TopicPartition(TOPIC, 0)
    worker, consumer, _producer, _ = make_worker([], processing_guarantee="exactly_once")
    worker.consumer = consumer
    worker.take_records({tp0: [record(0, 12, "e12", "u12"), record(0, 13, "e13", "u13")]}, 0.0)
    worker._partitions_revoked([tp0], lost=lost)
    worker._seek_back_reassigned([tp0])
    assert consumer.seeks == ([] if lost else [(0, 12)])
    assert not worker.has_batch()


class CollectorProbe(EchoRecommender):
    """Records whether the cyclic garbage collector was on while preparing and finishing."""

    def __init__(self) -> None:
        super().__init__()
        self.collector_on: list[bool] = []

    def prepare(self, requests, bundle):
        self.collector_on.append(gc.isenabled())
        return super().prepare(requests, bundle)

    def finish(self, prepared):
        self.collector_on.append(gc.isenabled())
        return super().finish(prepared)


@pytest.mark.parametrize("between_batches", [True, False])
def test_the_garbage_collector_is_held_off_while_a_batch_is_served(between_batches) -> None:
    probe = CollectorProbe()
    worker, _, producer, _ = make_worker(
        [[record(0, 1, "a1", "alice")], [record(0, 2, "b1", "bob")]],
        recommender=probe, gc_between_batches=between_batches,
    )  # fmt: skip
    worker.run(exit_when_idle_s=IDLE_S)
    assert len(producer.sent) == 2
    assert probe.collector_on == [not between_batches] * 4
    assert gc.isenabled()  # on again after every batch


def test_holding_the_collector_off_leaves_it_as_the_program_set_it() -> None:
    with collector_held_off():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), collector_held_off():
        raise RuntimeError("a failing batch")
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_held_off():
            pass
        assert not gc.isenabled()  # the program's choice stands
    finally:
        gc.enable()


def test_the_consumer_fetches_with_the_configured_wait(monkeypatch) -> None:
    opened = {}
    monkeypatch.setattr(
        worker_module, "open_client", lambda cls, kafka, **options: opened.update(options)
    )
    monkeypatch.setattr(worker_module, "subscribe_when_ready", lambda *args, **kwargs: None)
    worker, *_ = make_worker([], fetch_max_wait_ms=7)
    worker._kafka_consumer(listener=None)
    assert opened["fetch_max_wait_ms"] == 7
    assert Settings().online.fetch_max_wait_ms == 20  # not kafka-python's 500 (settings)
