"""``genrec bench load``: open-loop load through the real broker against ``genrec serve`` (app).

The bench produces events of existing users (read from the behavior store, each about
a catalog item the user has not seen) to ``kafka.topic_events`` at offered rates that
step up. Send times are fixed by the schedule and never wait for an answer (open loop):
a worker that falls behind shows as growing latency, not as a load that politely slows
down with it. A consumer of the bench's own, assigned every partition at its end, reads
``kafka.topic_recommendations`` and times every event from its scheduled send to the
receipt of the first message that covers it (``covered_event_ids``: an event coalesced
into another's request counts as answered by that request's message).

Per step it reports offered and answered events/s, requests/s (messages), p50/p95/p99
and max latency, the workers' own share of it (p50/p99 of the messages' ``latency_ms``:
from the worker holding the request's first event to its message; the rest is the trips
through the broker and the wait before a worker polls the event), events still unanswered
after a drain wait, events answered twice, and the CPU (utime + stime from /proc, % of one
core) of the workers and, beside it, of the host's other parts of the path: the ``genrec
ingest`` it started, the local broker (``genrec kafka up``'s, when it runs on this host) and
the bench itself. From the messages' ``decoding`` it also reports the users per decoding
call (the batch grows with load) and the median tokens the target prefilled: the suffix
past the cached prefix, or the whole prompt where none was cached (how far the store has
moved on since the last refresh; a long suffix costs every request, so refresh before
comparing runs). A step overloads when its
p99 exceeds ``p99_ms`` or an event is left unanswered; each phase stops after the first
step that overloads, and its held rate is the highest offered rate that did not.

Its events are stored by ingest as a user's would be; after each phase the bench deletes
them from the store again (``remove_sent_events``; ``keep_events`` leaves them), so every
phase and the next run meet the store as the first phase found it.

By default each phase starts its own services as production runs them, one
``genrec ingest`` beside N ``genrec serve`` workers (N = 1, then 2), in fresh consumer
groups committed at the end of the events topic so no older event is served, and stops
them when the phase ends (also on Ctrl-C or an error). With ``start=False`` it drives
workers that already run; their pids, when given, let it read their CPU.

Example::

    $ genrec bench load --workers 1,2 --step-s 30
    $ genrec bench load --no-start --worker-pids 4242 --append
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import platform
import random
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from kafka import KafkaAdminClient
from kafka.partitioner.default import murmur2
from pydantic_core import from_json

from genrec.app.kafka_broker import KafkaBroker, KafkaBrokerError
from genrec.app.services import skip_group_to_end, stop_service
from genrec.infra.database import make_engine
from genrec.infra.errors import UserFacingError
from genrec.infra.kafka_clients import open_client, wait_for_listener
from genrec.infra.librdkafka import LibrdkafkaProducer
from genrec.infra.progress import progress_bar, stderr_is_terminal
from genrec.infra.topics import create_topics
from genrec.ingest.history import load_item_ids, load_user_histories
from genrec.ingest.store import count_events, delete_events, reuses_event_ids
from genrec.schemas.events import UserEvent

if TYPE_CHECKING:
    from genrec.infra.settings import Settings

log = logging.getLogger(__name__)

FIRST_RATE = 25.0  # events/s of the first step
LAST_RATE = 3200.0  # ... and of the last one, doubling in between
WARMUP_RATE = 20.0  # events/s of the warm-up traffic
START_LEAD_S = 0.05  # between planning a step and its first send
ANSWER_POLL_MS = 100  # the answers consumer's poll timeout: bounds how fast it stops
ANSWER_FETCH_WAIT_MS = 10  # the broker holds an empty fetch this long (librdkafka's own thread)
STOP_TIMEOUT_S = 60.0  # SIGTERM, then this long before SIGKILL
GROUP_POLL_S = 0.5
GROUP_SETTLE_S = 3.0  # a group counts as joined once it has stayed so this long
START_ATTEMPTS = 2  # started services that never join are restarted once
ITEM_TRIES = 32  # random catalog picks before settling for an item the user has seen


@dataclass(frozen=True)
class LoadConfig:
    """What one ``bench load`` run does."""

    rates: tuple[float, ...] = ()  # offered events/s per step; empty: FIRST_RATE..LAST_RATE
    steps_per_doubling: int = 1  # without ``rates``: steps from one doubling to the next
    step_s: float = 30.0
    drain_s: float = 30.0  # after a step's last send: wait this long for its answers at most
    p99_ms: float = 100.0
    workers: tuple[int, ...] = (1, 2)  # one phase per count (started services)
    # Processing guarantees of the started workers, each run with every worker count;
    # empty: online.processing_guarantee alone.
    guarantees: tuple[str, ...] = ()
    start: bool = True  # False: drive workers that already run (one phase)
    worker_pids: tuple[int, ...] = ()  # their processes, for CPU (start=False)
    users: int | None = None  # at most this many store users (None: all)
    warmup_events: int = 40  # per worker, after the first answer, before the first step
    ready_timeout_s: float = 300.0  # for the workers to answer their first event
    join_timeout_s: float = 180.0  # for started workers to join and warm up; else restarted once
    seed: int = 0
    progress: bool = True  # a tqdm bar per step, on a terminal only
    # Before each started phase, refresh the prefix KVs from the store as the phases before
    # left it (``genrec offline refresh --no-semantic-ids``): a store that moved on since its
    # last refresh (or keeps the bench's events) makes every request prefill a longer suffix.
    refresh: bool = False
    refresh_timeout_s: float = 3600.0
    # After each phase, delete the events the bench sent from the behavior store again, so
    # the next phase (and the next run) meets the store as this one found it, and synthetic
    # events never reach a refresh's training or prefixes. True: leave them stored.
    keep_events: bool = False

    def __post_init__(self) -> None:
        # here, not where the steps run: a bad run stops before it starts any service
        if self.steps_per_doubling < 1:
            raise ValueError(f"steps_per_doubling must be >= 1, got {self.steps_per_doubling}")
        if self.refresh and not self.start:
            raise ValueError("refresh runs before the phases it starts: not with start=False")

    def step_rates(self) -> tuple[float, ...]:
        return self.rates or tuple(doubling_rates(FIRST_RATE, LAST_RATE, self.steps_per_doubling))

    def phase_workers(self) -> tuple[int, ...]:
        """Worker counts, one phase each; already running workers are one phase."""
        if self.start:
            return self.workers
        return (len(self.worker_pids) or self.workers[0],)


# --- the schedule and the figures (pure) ------------------------------------------------


def doubling_rates(
    first: float = FIRST_RATE, last: float = LAST_RATE, steps_per_doubling: int = 1
) -> list[float]:
    """``first``, twice that, ... up to ``last`` (inclusive); with ``steps_per_doubling`` n > 1,
    n geometric steps per doubling (n = 2: 25, 35, 50, 71, 100, ...), the ones between the
    doublings rounded to whole events/s. A held rate, and the 2-worker / 1-worker ratio of
    held rates, can only be as fine as the steps: with doublings alone the ratio reads 1x or
    2x."""
    if first <= 0 or last < first:
        raise ValueError(f"rates need 0 < first <= last, got {first} and {last}")
    if steps_per_doubling < 1:
        raise ValueError(f"steps_per_doubling must be >= 1, got {steps_per_doubling}")
    rates = []
    for i in itertools.count():
        doublings, within = divmod(i, steps_per_doubling)
        rate = float(first * 2**doublings)
        if within:
            rate = float(round(rate * 2 ** (within / steps_per_doubling)))
        if rate > last * (1 + 1e-9):
            return rates
        rates.append(rate)
    raise AssertionError("unreachable")


def send_offsets(rate: float, step_s: float) -> np.ndarray:
    """Seconds after a step's start at which its events are due: evenly spaced, at least one."""
    if rate <= 0 or step_s <= 0:
        raise ValueError(f"a step needs a positive rate and length, got {rate} and {step_s}")
    return np.arange(max(1, round(rate * step_s))) / rate


def users_by_partition(users: Sequence[str], partitions: int) -> dict[int, str]:
    """One user per events partition, by the producer's key hash (murmur2 of ``user_id``):
    a round of their events reaches every worker of the group."""
    chosen: dict[int, str] = {}
    for user in users:
        chosen.setdefault((murmur2(user.encode()) & 0x7FFFFFFF) % partitions, user)
        if len(chosen) == partitions:
            break
    return chosen


@dataclass(frozen=True)
class Answers:
    """What the answers consumer saw of some events."""

    first_at: Mapping[str, float]  # event id -> monotonic receipt of its first answer
    times: Mapping[str, int]  # event id -> messages that covered it
    requests: int  # messages triggered by one of these events
    # trigger event id -> its first message's ``latency_ms`` (the worker's own share)
    worker_ms: Mapping[str, float] = field(default_factory=dict)
    # trigger event id -> its first message's ``decoding``: users in its decoding call,
    # tokens prefilled past the cached prefix (absent when the message does not say)
    batch_users: Mapping[str, int] = field(default_factory=dict)
    suffix_tokens: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class StepResult:
    """One offered rate against one worker count."""

    workers: int
    offered_eps: float
    events: int
    answered: int
    answered_eps: float  # answered events / (first due send .. last first answer)
    requests: int
    requests_ps: float
    p50_ms: float | None
    p95_ms: float | None
    p99_ms: float | None
    max_ms: float | None
    unanswered: int  # after the drain wait
    answered_twice: int
    worker_cpu_pct: float | None  # % of one core, summed over the workers
    send_lag_p99_ms: float  # how late the bench itself sent (included in the latency)
    overloaded: bool
    host_load_1m: float | None = None  # the host's 1-minute load average at the step's end
    worker_p50_ms: float | None = None  # of the messages' latency_ms: in the worker
    worker_p99_ms: float | None = None
    # % of one core of the rest of the path on this host (None: not measured)
    ingest_cpu_pct: float | None = None
    broker_cpu_pct: float | None = None
    bench_cpu_pct: float | None = None
    batch_users_mean: float | None = None  # users per decoding call, over the step's messages
    # tokens prefilled: past the cached prefix, or the whole prompt where none was cached
    suffix_tokens_p50: float | None = None


def latency_figures(latencies_ms: Sequence[float]) -> dict[str, float | None]:
    """p50/p95/p99 (linear interpolation) and max, in ms; all None without a latency."""
    if len(latencies_ms) == 0:
        return dict.fromkeys(("p50_ms", "p95_ms", "p99_ms", "max_ms"))
    values = np.asarray(latencies_ms, dtype=float)
    p50, p95, p99 = np.percentile(values, [50, 95, 99])
    return {
        "p50_ms": round(float(p50), 2),
        "p95_ms": round(float(p95), 2),
        "p99_ms": round(float(p99), 2),
        "max_ms": round(float(values.max()), 2),
    }


def is_overloaded(p99_ms: float | None, unanswered: int, p99_limit_ms: float) -> bool:
    """Over the latency bound, nothing answered at all, or anything left unanswered."""
    return p99_ms is None or p99_ms > p99_limit_ms or unanswered > 0


def summarize_step(
    workers: int,
    rate: float,
    scheduled: Mapping[str, float],
    answers: Answers,
    *,
    p99_limit_ms: float,
    cpu_pct: float | None = None,
    send_lags_s: Sequence[float] = (),
    host_load: float | None = None,
    others_cpu_pct: Mapping[str, float | None] | None = None,
) -> StepResult:
    """The step's figures from each event's due time and its answers' receipt times;
    ``others_cpu_pct``: CPU of ``ingest``, ``broker`` and ``bench`` where measured."""
    latencies = [
        1000.0 * (answers.first_at[event_id] - due)
        for event_id, due in scheduled.items()
        if event_id in answers.first_at
    ]
    figures = latency_figures(latencies)
    in_worker = latency_figures([answers.worker_ms[e] for e in scheduled if e in answers.worker_ms])
    answered = len(latencies)
    span = 0.0
    if answered:
        span = max(answers.first_at[e] for e in scheduled if e in answers.first_at)
        span -= min(scheduled.values())
    unanswered = len(scheduled) - answered
    lag = float(np.percentile(send_lags_s, 99)) * 1000.0 if len(send_lags_s) else 0.0
    others = others_cpu_pct or {}
    batch_users = [answers.batch_users[e] for e in scheduled if e in answers.batch_users]
    suffixes = [answers.suffix_tokens[e] for e in scheduled if e in answers.suffix_tokens]
    return StepResult(
        workers=workers,
        offered_eps=rate,
        events=len(scheduled),
        answered=answered,
        answered_eps=round(answered / span, 2) if span > 0 else 0.0,
        requests=answers.requests,
        requests_ps=round(answers.requests / span, 2) if span > 0 else 0.0,
        **figures,
        unanswered=unanswered,
        answered_twice=sum(1 for e in scheduled if answers.times.get(e, 0) > 1),
        worker_cpu_pct=None if cpu_pct is None else round(cpu_pct, 1),
        send_lag_p99_ms=round(lag, 2),
        overloaded=is_overloaded(figures["p99_ms"], unanswered, p99_limit_ms),
        host_load_1m=None if host_load is None else round(host_load, 2),
        worker_p50_ms=in_worker["p50_ms"],
        worker_p99_ms=in_worker["p99_ms"],
        ingest_cpu_pct=_rounded(others.get("ingest")),
        broker_cpu_pct=_rounded(others.get("broker")),
        bench_cpu_pct=_rounded(others.get("bench")),
        batch_users_mean=_rounded(float(np.mean(batch_users)) if batch_users else None),
        suffix_tokens_p50=_rounded(float(np.median(suffixes)) if suffixes else None),
    )


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def held_rate(steps: Sequence[StepResult]) -> float | None:
    """The highest offered rate of a step that did not overload (None: not even the first)."""
    held = [step.offered_eps for step in steps if not step.overloaded]
    return max(held) if held else None


def worker_ratio(
    by_workers: Mapping[int, float | None], more: int = 2, fewer: int = 1
) -> float | None:
    """``by_workers[more] / by_workers[fewer]`` where both are known and the divisor positive."""
    high, low = by_workers.get(more), by_workers.get(fewer)
    if high is None or not low:
        return None
    return round(high / low, 3)


# --- events in ----------------------------------------------------------------------------


class EventPicker:
    """Events of store users about catalog items each has not seen yet (seeded)."""

    def __init__(
        self,
        seen: Mapping[str, set[str]],
        catalog: Sequence[str],
        *,
        prefix: str,
        seed: int = 0,
    ) -> None:
        if not seen or not catalog:
            raise ValueError("the behavior store has no users or no items: ingest events first")
        self.users = sorted(seen)
        self.catalog = list(catalog)
        self.prefix = prefix
        self._seen = {user: set(items) for user, items in seen.items()}
        self._rng = random.Random(seed)
        self._counter = itertools.count()

    def event(self, tag: str, user_id: str | None = None) -> UserEvent:
        """The next event (a random user's unless ``user_id``); its id names the run and tag."""
        user = user_id if user_id is not None else self._rng.choice(self.users)
        return UserEvent(
            event_id=f"{self.prefix}-{tag}-{next(self._counter)}",
            user_id=user,
            item_id=self._unseen_item(user),
            event_type="view",
            ts=int(time.time() * 1000),
        )

    def _unseen_item(self, user: str) -> str:
        seen = self._seen.setdefault(user, set())
        item = self._rng.choice(self.catalog)
        for _ in range(ITEM_TRIES):
            if item not in seen:
                break
            item = self._rng.choice(self.catalog)
        seen.add(item)
        return item


def store_users(settings: Settings, limit: int | None, seed: int) -> dict[str, set[str]]:
    """Each store user's items (at most ``limit`` users, a seeded sample)."""
    engine = make_engine(str(settings.database_url))
    try:
        histories = load_user_histories(engine)
    finally:
        engine.dispose()
    users = sorted(histories)
    if limit is not None and limit < len(users):
        users = sorted(random.Random(seed).sample(users, limit))
    return {user: {event.item_id for event in histories[user]} for user in users}


def catalog_items(settings: Settings) -> list[str]:
    engine = make_engine(str(settings.database_url))
    try:
        return load_item_ids(engine)
    finally:
        engine.dispose()


class EventSender:
    """The bench's producer of user events, keyed by user like every producer of them."""

    def __init__(self, settings: Settings) -> None:
        self.topic = settings.kafka.topic_events
        # librdkafka, as the workers publish: a load generator in Python's kafka client took
        # ~15-30% of a core at 100-200 events/s on the 2-core CPU the workers share. linger
        # 0: a lingering generator adds its own wait to every event's latency (2 ms at
        # linger 2), and librdkafka still batches what queues while a request is in flight
        self.producer = LibrdkafkaProducer(settings.kafka, linger_ms=0)
        self.partitions = len(self.producer.partitions_for(self.topic))
        self._failures: list[BaseException] = []
        self.sent: list[str] = []  # event ids since the last ``take_sent`` (the phase's)

    def take_sent(self) -> list[str]:
        sent, self.sent = self.sent, []
        return sent

    def send(self, event: UserEvent) -> None:
        self.sent.append(event.event_id)
        future = self.producer.send(self.topic, key=event.kafka_key(), value=event.to_json_bytes())
        future.add_errback(self._failures.append)

    def flush(self) -> None:
        self.producer.flush(timeout=60)
        if self._failures:
            raise RuntimeError(f"{len(self._failures)} events were not acknowledged: "
                               f"{self._failures[0]!r}")  # fmt: skip

    def close(self) -> None:
        self.producer.close(timeout=10)


def send_on_schedule(
    sender: EventSender,
    picker: EventPicker,
    tag: str,
    offsets: np.ndarray,
    progress: bool = False,
) -> tuple[dict[str, float], list[float]]:
    """Send one event at each offset (open loop); returns each id's due time and the lags."""
    scheduled: dict[str, float] = {}
    lags: list[float] = []
    start = time.monotonic() + START_LEAD_S
    bar = progress_bar(offsets, desc=tag, unit="ev", leave=False, disable=not progress)
    for offset in bar:
        due = start + float(offset)
        wait = due - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        event = picker.event(tag)
        sender.send(event)
        scheduled[event.event_id] = due
        lags.append(max(0.0, time.monotonic() - due))
    bar.close()
    sender.flush()
    return scheduled, lags


# --- answers out --------------------------------------------------------------------------


def covered_ids(payload: Mapping[str, Any]) -> list[str]:
    """The event ids one recommendation message answers (the trigger last)."""
    covered = payload.get("covered_event_ids") or payload.get("decoding", {}).get(
        "covered_event_ids"
    )
    if covered:
        return [str(event_id) for event_id in covered]
    trigger = payload.get("request_id") or payload.get("event_id")
    return [str(trigger)] if trigger is not None else []


class AnswerBook:
    """What the answers consumer has seen, per event id; thread-safe (the consumer's thread
    records, the bench's thread looks up)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._first_at: dict[str, float] = {}
        self._times: Counter[str] = Counter()
        self._triggers: Counter[str] = Counter()
        self._worker_ms: dict[str, float] = {}
        self._batch_users: dict[str, int] = {}
        self._suffix_tokens: dict[str, int] = {}

    def record(self, messages: Iterable[Mapping[str, Any]], received_at: float) -> None:
        with self.lock:
            for payload in messages:
                ids = covered_ids(payload)
                if ids:
                    self._triggers[ids[-1]] += 1
                    if isinstance(payload.get("latency_ms"), int | float):
                        self._worker_ms.setdefault(ids[-1], float(payload["latency_ms"]))
                    self._record_decoding(ids[-1], payload.get("decoding"))
                for event_id in ids:
                    self._first_at.setdefault(event_id, received_at)
                    self._times[event_id] += 1

    def _record_decoding(self, trigger: str, decoding: Any) -> None:
        """The first message's batch size and tokens prefilled (the suffix, or the whole
        prompt of a full-prompt decode), where it gives them."""
        if not isinstance(decoding, Mapping):
            return
        prefilled = "suffix_tokens" if "suffix_tokens" in decoding else "prompt_tokens"
        for key, figures in (("batch_users", self._batch_users),
                             (prefilled, self._suffix_tokens)):  # fmt: skip
            value = decoding.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                figures.setdefault(trigger, value)

    def lookup(self, event_ids: Iterable[str]) -> Answers:
        with self.lock:
            ids = list(event_ids)

            def of(figures: Mapping[str, Any]) -> dict[str, Any]:
                return {e: figures[e] for e in ids if e in figures}

            return Answers(
                first_at=of(self._first_at), times=of(self._times),
                requests=sum(self._triggers.get(e, 0) for e in ids), worker_ms=of(self._worker_ms),
                batch_users=of(self._batch_users), suffix_tokens=of(self._suffix_tokens),
            )  # fmt: skip

    def missing(self, event_ids: Sequence[str]) -> int:
        with self.lock:
            return sum(1 for e in event_ids if e not in self._first_at)


class AnswerLog:
    """Reads the recommendations topic in a thread, assigned every partition at its end.

    Assigned and positioned at the topic's end when constructed, so everything the bench
    produces afterwards is seen. librdkafka (``confluent-kafka``) fetches in C threads of
    its own, ahead of the poll: kafka-python's consumer here cost ~1-2 ms more a message
    (docs/online.md) and the bench's CPU, which the workers share. ``read_committed``, so an
    exactly-once phase counts only committed answers.
    """

    def __init__(self, settings: Settings, group_id: str, timeout_s: float) -> None:
        from confluent_kafka import Consumer

        wait_for_listener(settings.kafka, settings.kafka.connect_timeout_s)
        self.consumer = Consumer({
            **settings.kafka.librdkafka_config(), "group.id": group_id,
            "enable.auto.commit": False, "isolation.level": "read_committed",
            "fetch.wait.max.ms": ANSWER_FETCH_WAIT_MS,
        })  # fmt: skip
        try:
            _assign_at_end(self.consumer, settings.kafka.topic_recommendations, timeout_s)
        except BaseException:
            self.consumer.close()
            raise
        self.book = AnswerBook()
        self._halt = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="answers", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._halt.is_set():
                first = self.consumer.poll(ANSWER_POLL_MS / 1000)
                if first is None:
                    continue
                received_at = time.monotonic()
                polled = [first, *self.consumer.consume(num_messages=5000, timeout=0)]
                self.book.record([from_json(m.value()) for m in _valid(polled)], received_at)
        except BaseException as exc:  # seen by the main thread at its next look
            self._error = exc

    def lookup(self, event_ids: Iterable[str]) -> Answers:
        self._raise_if_failed()
        return self.book.lookup(event_ids)

    def wait_for(
        self,
        event_ids: Iterable[str],
        timeout_s: float,
        check: Callable[[], None] | None = None,
    ) -> bool:
        """True once every one of ``event_ids`` is answered; False after ``timeout_s``."""
        wanted = list(event_ids)
        deadline = time.monotonic() + timeout_s
        while True:
            self._raise_if_failed()
            if not self.book.missing(wanted):
                return True
            if time.monotonic() >= deadline:
                return False
            if check is not None:
                check()
            time.sleep(0.05)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError("reading the recommendations failed") from self._error

    def close(self) -> None:
        self._halt.set()
        self._thread.join(timeout=10)
        self.consumer.close()


def _valid(messages: Iterable[Any]) -> Iterator[Any]:
    """The messages that carry a record; a partition's end is no error, others raise."""
    from confluent_kafka import KafkaError, KafkaException

    for message in messages:
        error = message.error()
        if error is None:
            yield message
        elif error.code() != KafkaError._PARTITION_EOF:
            raise KafkaException(error)


def _assign_at_end(consumer: Any, topic: str, timeout_s: float) -> None:
    """Assign every partition of ``topic`` at its current end (waits for the topic)."""
    from confluent_kafka import TopicPartition

    deadline = time.monotonic() + timeout_s
    while True:
        found = consumer.list_topics(topic, timeout=timeout_s).topics.get(topic)
        if found is not None and found.error is None and found.partitions:
            break
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"the answers topic {topic} has no partitions after {timeout_s:.0f} s"
            )
        time.sleep(GROUP_POLL_S)
    ends = [
        TopicPartition(topic, partition, _end_offset(consumer, topic, partition, deadline))
        for partition in sorted(found.partitions)
    ]
    consumer.assign(ends)  # at numbers, not "latest": nothing sent from now on is skipped


def _end_offset(consumer: Any, topic: str, partition: int, deadline: float) -> int:
    """The partition's end offset, asked again while the broker has no leader for it yet
    (a topic just created on a fresh broker) until ``deadline``."""
    from confluent_kafka import KafkaError, KafkaException, TopicPartition

    # (librdkafka does not mark these retriable on a watermark query)
    not_ready = {
        KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE,
        KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_PARTITION,
    }  # fmt: skip
    while True:
        try:
            timeout_s = max(0.1, deadline - time.monotonic())
            return consumer.get_watermark_offsets(
                TopicPartition(topic, partition), timeout=timeout_s
            )[1]
        except KafkaException as exc:
            error = exc.args[0] if exc.args else None
            code = error.code() if isinstance(error, KafkaError) else None
            waiting = code in not_ready or (isinstance(error, KafkaError) and error.retriable())
            if not waiting or time.monotonic() > deadline:
                raise
        time.sleep(GROUP_POLL_S)


# --- the processes --------------------------------------------------------------------------


def process_cpu_s(pid: int) -> float | None:
    """utime + stime of ``pid`` in seconds, from /proc (None once it is gone)."""
    fields = _stat_fields(pid)
    if fields is None:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat from field 3 (state) on; None once the process is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # After the parenthesised name (which may hold spaces): state is field 3, ppid 4,
    # utime 14, stime 15.
    return text.rpartition(")")[2].split()


def descendants(pid: int) -> list[int]:
    """Every living process below ``pid`` (children, theirs...), from /proc's parent ids."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat_fields(int(entry))
            if fields is not None:
                parents.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found.extend(children)
        todo.extend(children)
    return found


class CpuMeter:
    """CPU of a set of processes, with their children (ingest's writer process) unless
    ``children`` is False (the bench: its children are the services), between ``start``
    and ``percent``, as % of one core."""

    def __init__(self, pids: Sequence[int], children: bool = True) -> None:
        self.pids, self.children = tuple(pids), children
        self._started: tuple[float, float | None] = (time.monotonic(), None)

    def _total(self) -> float | None:
        times = [process_cpu_s(pid) for pid in self.pids]
        if not times or any(t is None for t in times):
            return None
        below_pids = [c for pid in self.pids for c in descendants(pid)] if self.children else []
        below = (process_cpu_s(child) for child in below_pids)
        return sum(t for t in times if t is not None) + sum(t for t in below if t is not None)

    def start(self) -> None:
        self._started = (time.monotonic(), self._total())

    def percent(self) -> float | None:
        began, cpu_before = self._started
        cpu_now, wall = self._total(), time.monotonic() - began
        if cpu_before is None or cpu_now is None or wall <= 0:
            return None
        # (a child that ended during the step takes its time with it: never below 0)
        return max(0.0, 100.0 * (cpu_now - cpu_before) / wall)


def settings_environment(settings: Settings) -> dict[str, str]:
    """``GENREC_*`` variables that give a child process this one's store, data and topics."""
    kafka = settings.kafka
    values = {
        "HOME": settings.home, "DATA_DIR": settings.data_dir,
        "DATABASE_URL": settings.database_url, "KAFKA__BOOTSTRAP": kafka.bootstrap,
        "KAFKA__TOPIC_EVENTS": kafka.topic_events, "KAFKA__TOPIC_DLQ": kafka.topic_dlq,
        "KAFKA__TOPIC_RECOMMENDATIONS": kafka.topic_recommendations,
    }  # fmt: skip
    return {f"GENREC_{name}": str(value) for name, value in values.items()}


def genrec_command(*args: str) -> list[str]:
    """``genrec ARGS`` as a child of this interpreter (the same environment and code)."""
    return [sys.executable, "-m", "genrec.app.cli", *args]


def child_environment(
    settings: Settings, overrides: Mapping[str, str] | None = None
) -> dict[str, str]:
    """This process's environment, its store and topics (``settings_environment``) and
    ``overrides``, output unbuffered so a child's log is current."""
    extra = dict(overrides or {})
    return {**os.environ, **settings_environment(settings), **extra, "PYTHONUNBUFFERED": "1"}


class Services:
    """One ``genrec ingest`` and ``workers`` x ``genrec serve``, in consumer groups of their own."""

    def __init__(
        self, settings: Settings, workers: int, run_id: str, guarantee: str | None = None
    ) -> None:
        self.settings = settings
        self.workers = workers
        self.guarantee = guarantee or settings.online.processing_guarantee
        self.online_group = f"{settings.online.group_id}-load-{run_id}-{workers}"
        self.ingest_group = f"{settings.ingest.group_id}-load-{run_id}-{workers}"
        self.log_dir = settings.path("logs", "x").parent
        self.run_id = run_id
        self.processes: list[tuple[str, subprocess.Popen]] = []

    def start(self) -> None:
        """Commit both groups at the end of the events topic, then start the processes."""
        topic = self.settings.kafka.topic_events
        for group in (self.ingest_group, self.online_group):
            skip_group_to_end(self.settings, group, topic)
        self._launch("ingest", ["ingest", "--group", self.ingest_group], {})
        overrides = {"GENREC_ONLINE__GROUP_ID": self.online_group,
                     "GENREC_ONLINE__AUTO_OFFSET_RESET": "earliest",
                     "GENREC_ONLINE__PROCESSING_GUARANTEE": self.guarantee}  # fmt: skip
        for n in range(self.workers):
            # one transactional.id per worker: two on one host must not fence each other
            instance = {"GENREC_ONLINE__INSTANCE_ID": f"load-{self.run_id}-{n + 1}"}
            self._launch(f"serve-{n + 1}", ["serve", "--metrics-port", "0"], overrides | instance)

    def _launch(self, name: str, args: list[str], overrides: dict[str, str]) -> None:
        path = self.log_path(name)
        with path.open("ab") as handle:
            process = subprocess.Popen(
                genrec_command(*args), env=child_environment(self.settings, overrides),
                stdout=handle, stderr=subprocess.STDOUT,
            )  # fmt: skip
        self.processes.append((name, process))

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"load-{self.run_id}-{self.workers}w-{name}.log"

    def worker_pids(self) -> list[int]:
        return [p.pid for name, p in self.processes if name.startswith("serve")]

    def ingest_pid(self) -> int | None:
        return next((p.pid for name, p in self.processes if name == "ingest"), None)

    def check_alive(self) -> None:
        """Raise if a service has exited (it should run until ``stop``)."""
        for name, process in self.processes:
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited with {process.returncode}; "
                                   f"see {self.log_path(name)}")  # fmt: skip

    def wait_ready(self, timeout_s: float) -> None:
        """Until every worker has held partitions of the events topic, in a stable group,
        for ``GROUP_SETTLE_S``: a worker's first assignment is often followed by a second
        rebalance within a second, and no event should arrive while it runs."""
        admin = open_client(KafkaAdminClient, self.settings.kafka)
        try:
            deadline = time.monotonic() + timeout_s
            settled_since: float | None = None
            while True:
                self.check_alive()
                now = time.monotonic()
                if assigned_members(admin, self.online_group) < self.workers:
                    settled_since = None
                elif settled_since is None:
                    settled_since = now
                elif now - settled_since >= GROUP_SETTLE_S:
                    return
                if now > deadline:
                    raise TimeoutError(f"{self.workers} workers did not join group "
                                       f"{self.online_group} in {timeout_s:.0f} s (see "
                                       f"{self.log_path('serve-*')})")  # fmt: skip
                time.sleep(GROUP_POLL_S)
        finally:
            admin.close()

    def stop(self) -> None:
        """Workers first (each finishes its batch in hand), then ingest; SIGKILL if stuck."""
        try:
            for name, process in reversed(self.processes):
                code = stop_service(process, timeout=STOP_TIMEOUT_S)
                if code not in (0, None):
                    log.warning("%s exited with %s; see %s", name, code, self.log_path(name))
        finally:  # interrupted while waiting (Ctrl-C, a test timeout): leave nothing behind
            for _name, process in self.processes:
                if process.poll() is None:
                    process.kill()
                    process.wait()
            self.processes.clear()


def assigned_members(admin: KafkaAdminClient, group: str) -> int:
    """Members of a stable ``group`` that hold at least one partition (0 while rebalancing)."""
    description = admin.describe_groups([group]).get(group) or {}
    if str(description.get("group_state", "")).lower() != "stable":
        return 0
    holding = 0
    for member in description.get("members", []):
        assignment = member.get("member_assignment") or {}
        if any(topic.get("partitions") for topic in assignment.get("assigned_partitions", [])):
            holding += 1
    return holding


@contextlib.contextmanager
def started_services(
    settings: Settings, workers: int, run_id: str, guarantee: str | None = None
) -> Iterator[Services]:
    """Services running for the block, stopped on the way out whatever happens."""
    services = Services(settings, workers, run_id, guarantee)
    try:
        services.start()
        yield services
    finally:
        services.stop()


# --- the run ----------------------------------------------------------------------------------


@dataclass
class _Traffic:
    """The bench's side of Kafka for a whole run."""

    sender: EventSender
    picker: EventPicker
    answers: AnswerLog
    config: LoadConfig


def answer_each_partition(
    traffic: _Traffic, timeout_s: float, check: Callable[[], None] | None
) -> None:
    """One event per events partition, all answered within ``timeout_s``: every worker of
    the group holds its partitions and serves them (TimeoutError otherwise)."""
    users = users_by_partition(traffic.picker.users, traffic.sender.partitions)
    first = [traffic.picker.event("warm", user) for user in users.values()]
    for event in first:
        traffic.sender.send(event)
    traffic.sender.flush()
    if not traffic.answers.wait_for([e.event_id for e in first], timeout_s, check):
        raise TimeoutError(f"no answer to one event per partition in {timeout_s:.0f} s: are "
                           "the workers running on this topic?")  # fmt: skip


def warm_up(
    traffic: _Traffic, workers: int, check: Callable[[], None] | None, timeout_s: float
) -> None:
    """Until every worker answers, then a little steady traffic (auto-mode timing, first
    prefix-KV reads); all of it must be answered, each part within ``timeout_s``."""
    answer_each_partition(traffic, timeout_s, check)
    count = max(1, traffic.config.warmup_events * workers)
    scheduled, _ = send_on_schedule(
        traffic.sender, traffic.picker, "warm", send_offsets(WARMUP_RATE, count / WARMUP_RATE)
    )
    if not traffic.answers.wait_for(scheduled, timeout_s, check):
        raise TimeoutError(f"the warm-up traffic was not answered in {timeout_s:.0f} s")


def run_step(
    traffic: _Traffic,
    workers: int,
    rate: float,
    pids: Sequence[int],
    check: Callable[[], None] | None,
    others: Mapping[str, int] | None = None,
) -> StepResult:
    """Offer ``rate`` for ``step_s``, wait up to ``drain_s`` for the answers, summarize;
    ``others``: pids of the path's other processes (``ingest``, ``broker``, ``bench``)."""
    config = traffic.config
    meter = CpuMeter(pids)
    other_meters = {
        name: CpuMeter([pid], children=name != "bench") for name, pid in (others or {}).items()
    }
    for started in (meter, *other_meters.values()):
        started.start()
    scheduled, lags = send_on_schedule(
        traffic.sender, traffic.picker, f"{workers}w-{rate:g}", send_offsets(rate, config.step_s),
        progress=config.progress and stderr_is_terminal(),
    )  # fmt: skip
    traffic.answers.wait_for(scheduled, config.drain_s, check)
    return summarize_step(
        workers, rate, scheduled, traffic.answers.lookup(scheduled), p99_limit_ms=config.p99_ms,
        cpu_pct=meter.percent(), send_lags_s=lags, host_load=os.getloadavg()[0],
        others_cpu_pct={name: m.percent() for name, m in other_meters.items()},
    )  # fmt: skip


def run_phase(
    traffic: _Traffic,
    workers: int,
    pids: Sequence[int],
    check: Callable[[], None] | None,
    others: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """Warm up, then step the rate up until a step overloads."""
    warm_up(traffic, workers, check, traffic.config.ready_timeout_s)
    return run_steps(traffic, workers, pids, check, others)


def run_steps(
    traffic: _Traffic,
    workers: int,
    pids: Sequence[int],
    check: Callable[[], None] | None,
    others: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """Step the rate up until a step overloads (the workers are warm)."""
    steps: list[StepResult] = []
    for rate in traffic.config.step_rates():
        step = run_step(traffic, workers, rate, pids, check, others)
        steps.append(step)
        print(step_line(step), flush=True)
        if step.overloaded:
            break
    return phase_report(workers, steps, pids)


def phase_report(workers: int, steps: Sequence[StepResult], pids: Sequence[int]) -> dict[str, Any]:
    return {
        "workers": workers,
        "worker_pids": list(pids),
        "held_eps": held_rate(steps),
        "peak_answered_eps": max((s.answered_eps for s in steps), default=None),
        "steps": [asdict(step) for step in steps],
    }


def run_load_bench(settings: Settings, config: LoadConfig) -> dict[str, Any]:
    """Every phase of ``config``; returns the report (see ``build_report``)."""
    run_id = uuid.uuid4().hex[:8]
    picker = EventPicker(
        store_users(settings, config.users, config.seed), catalog_items(settings),
        prefix=f"load-{run_id}", seed=config.seed,
    )  # fmt: skip
    if config.start:
        create_topics(settings.kafka)
    phases = []
    with contextlib.ExitStack() as stack:
        answers = AnswerLog(settings, f"genrec-bench-load-{run_id}", config.ready_timeout_s)
        stack.callback(answers.close)
        sender = EventSender(settings)
        stack.callback(sender.close)
        # a run stopped by an error or Ctrl-C takes its phase's events out too
        stack.callback(_remove_left_events, settings, sender, config)
        traffic = _Traffic(sender, picker, answers, config)
        guarantees = config.guarantees if config.start else ()
        for guarantee in guarantees or (settings.online.processing_guarantee,):
            for workers in config.phase_workers():
                if config.start:
                    refreshed = refresh_prefix_kv(settings, config, run_id, workers)
                    phase = run_started_phase(traffic, settings, workers, run_id, guarantee)
                    phase = {**phase, **refreshed}
                else:
                    phase = run_phase(
                        traffic, workers, config.worker_pids, None, path_pids(settings)
                    )
                # started services are stopped by now (their ingest stored what it read);
                # an ingest that runs on is given the drain time to store the rest
                removed = remove_sent_events(
                    settings, sender.take_sent(), config, 0.0 if config.start else config.drain_s
                )
                phases.append({"guarantee": guarantee, **phase, **removed})
    return build_report(settings, config, phases, run_id)


def remove_sent_events(
    settings: Settings, sent: Sequence[str], config: LoadConfig, wait_s: float
) -> dict[str, Any]:
    """Unless ``config.keep_events``: the phase's events out of the behavior store again
    (``genrec.ingest.store.delete_events``, which also narrows their users' spans back);
    first waits up to ``wait_s`` for an ingest still running to store them all. Returns the
    figures a phase reports; a store it cannot reach stops the bench."""
    if config.keep_events or not sent:
        return {}
    engine = make_engine(str(settings.database_url))
    try:
        if reuses_event_ids(engine):
            print(f"load: kept the phase's {len(sent)} events in the behavior store: its SQLite "
                  "events table predates AUTOINCREMENT and would reuse their ids")  # fmt: skip
            return {"events_sent": len(sent), "events_removed": 0}
        deadline = time.monotonic() + wait_s
        while count_events(engine, sent) < len(sent) and time.monotonic() < deadline:
            time.sleep(0.5)
        removed = delete_events(engine, sent)
    finally:
        engine.dispose()
    left = "" if removed == len(sent) else (
        f"; {len(sent) - removed} were not stored (yet): an ingest that stores them later "
        "leaves them in the store"
    )  # fmt: skip
    print(f"load: removed the phase's {removed} stored events of the {len(sent)} it sent "
          f"from the behavior store (--keep-events keeps them){left}")  # fmt: skip
    return {"events_sent": len(sent), "events_removed": removed}


def _remove_left_events(settings: Settings, sender: EventSender, config: LoadConfig) -> None:
    """On the way out of an interrupted run (nothing is left after a finished one)."""
    try:
        remove_sent_events(settings, sender.take_sent(), config, 0.0)
    except Exception:  # the error that stopped the run is the one to see
        log.exception("could not remove the bench's events from the behavior store")


def refresh_prefix_kv(
    settings: Settings, config: LoadConfig, run_id: str, workers: int
) -> dict[str, Any]:
    """With ``config.refresh``: one ``genrec offline refresh --no-semantic-ids`` now, in a
    process of its own (its models and memory go with it); returns the figures a phase
    reports (nothing without ``refresh``). A refresh that fails stops the bench."""
    if not config.refresh:
        return {}
    log_path = settings.path("logs", f"load-{run_id}-{workers}w-refresh.log")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    print(f"load: refreshing the prefix KVs before the {workers}-worker phase (log {log_path})")
    started = time.monotonic()
    command = genrec_command(
        "offline", "refresh", "--no-semantic-ids", "--wait-lock", str(config.refresh_timeout_s)
    )
    with log_path.open("ab") as handle:
        try:
            done = subprocess.run(
                command, env=child_environment(settings), stdout=handle,
                stderr=subprocess.STDOUT, timeout=config.refresh_timeout_s,
            )  # fmt: skip
        except subprocess.TimeoutExpired as exc:
            raise UserFacingError(
                f"the prefix-KV refresh ran past {config.refresh_timeout_s:.0f} s; see {log_path}"
            ) from exc
    if done.returncode != 0:
        raise UserFacingError(
            f"the prefix-KV refresh exited with {done.returncode}; see {log_path}"
        )
    seconds = time.monotonic() - started
    print(f"load: refreshed in {seconds:.1f} s")
    return {"refresh_s": round(seconds, 1), "serving_version": _active_version(settings)}


def _active_version(settings: Settings) -> str | None:
    from genrec.online.live_version import active_serving_key

    engine = make_engine(str(settings.database_url))
    try:
        return active_serving_key(engine)
    finally:
        engine.dispose()


def run_started_phase(
    traffic: _Traffic, settings: Settings, workers: int, run_id: str, guarantee: str
) -> dict[str, Any]:
    """A phase against services it starts; restarted once if the workers never serve.

    A worker whose group join stalls (seen on a loaded host: "partitions revoked" right
    after its first assignment and no assignment after it) serves nothing until the
    broker drops it; fresh processes in a fresh group join again.
    """
    config = traffic.config
    for attempt in range(1, START_ATTEMPTS + 1):
        attempt_id = f"{run_id}-{guarantee[0]}{attempt}"
        with started_services(settings, workers, attempt_id, guarantee) as services:
            print(f"load: started ingest and {workers} serve, {guarantee} "
                  f"(logs {services.log_path('*')})")  # fmt: skip
            try:
                services.wait_ready(config.join_timeout_s)
                warm_up(traffic, workers, services.check_alive, config.join_timeout_s)
            except TimeoutError as exc:
                if attempt == START_ATTEMPTS:
                    raise
                log.warning("%s; restarting them", exc)
                continue
            others = path_pids(settings, services.ingest_pid())
            return run_steps(traffic, workers, services.worker_pids(), services.check_alive, others)
    raise AssertionError("unreachable: the last attempt returns or raises")


def path_pids(settings: Settings, ingest_pid: int | None = None) -> dict[str, int]:
    """The pids of the path's other processes on this host whose CPU a step reports: this
    bench, the ingest it started, and the local broker when one runs (``genrec kafka up``)."""
    pids = {"bench": os.getpid()}
    if ingest_pid is not None:
        pids["ingest"] = ingest_pid
    try:
        broker = KafkaBroker.from_settings(settings).status()
    except KafkaBrokerError:  # a bootstrap list: not one local broker
        return pids
    # only the broker this bench talks to (tests run brokers of their own elsewhere)
    if broker.pid is not None and broker.bootstrap == settings.kafka.bootstrap:
        pids["broker"] = broker.pid
    return pids


def build_report(
    settings: Settings, config: LoadConfig, phases: Sequence[dict[str, Any]], run_id: str
) -> dict[str, Any]:
    online, kafka = settings.online, settings.kafka
    return {
        "bench": "load",
        "run_id": run_id,
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "host": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "config": {**asdict(config), "rates": list(config.step_rates())},
        "kafka": {"bootstrap": kafka.bootstrap, "topic_events": kafka.topic_events,
                  "topic_recommendations": kafka.topic_recommendations},
        # As this process reads them: the workers it starts share them; running ones may not.
        "online": {"batch_window_ms": online.batch_window_ms, "k": online.k,
                   "max_batch_users": online.max_batch_users, "mode": online.mode,
                   "beam_width": online.generative_beams()},
        "phases": list(phases),
        **ratios(phases),
    }  # fmt: skip


def ratios(phases: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The 2-worker / 1-worker ratios of held rates and of peak answered throughput (of the
    first guarantee run), and per worker count exactly-once / at-least-once held rates."""
    first = phases[0].get("guarantee") if phases else None
    ran = [p for p in phases if p.get("guarantee") == first]
    held = {p["workers"]: p["held_eps"] for p in ran}
    peak = {p["workers"]: p["peak_answered_eps"] for p in ran}
    by = {(p.get("guarantee"), p["workers"]): p["held_eps"] for p in phases}
    guarantee_ratio = {
        str(w): worker_ratio({2: by.get(("exactly_once", w)), 1: by.get(("at_least_once", w))})
        for w in sorted({p["workers"] for p in phases})
        if ("exactly_once", w) in by and ("at_least_once", w) in by
    }
    return {
        "held_ratio_2_over_1": worker_ratio(held), "peak_ratio_2_over_1": worker_ratio(peak),
        "held_ratio_exactly_once_over_at_least_once": guarantee_ratio,
    }  # fmt: skip


def _phase_key(phase: Mapping[str, Any]) -> tuple[str, int]:
    return (phase.get("guarantee") or "at_least_once", phase["workers"])


def merge_reports(previous: Mapping[str, Any], report: dict[str, Any]) -> dict[str, Any]:
    """``report`` plus the phases of ``previous`` for (guarantee, worker count) it did not run."""
    ran = {_phase_key(p) for p in report["phases"]}
    kept = [p for p in previous.get("phases", []) if _phase_key(p) not in ran]
    phases = sorted([*kept, *report["phases"]], key=_phase_key)
    return {**report, "phases": phases, **ratios(phases)}


# --- output -----------------------------------------------------------------------------------


def step_line(step: StepResult) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.0f}"

    def pct(value: float | None) -> str:
        return "-" if value is None else f"{value:.0f}%"

    verdict = "OVERLOADED" if step.overloaded else "held"
    batch = "-" if step.batch_users_mean is None else f"{step.batch_users_mean:.1f}"
    return (
        f"load {step.workers}w {step.offered_eps:>6g} ev/s offered: {step.answered_eps:7.1f} "
        f"answered, {step.requests_ps:7.1f} req/s, p50/p95/p99/max {ms(step.p50_ms)}/"
        f"{ms(step.p95_ms)}/{ms(step.p99_ms)}/{ms(step.max_ms)} ms (in the worker p50/p99 "
        f"{ms(step.worker_p50_ms)}/{ms(step.worker_p99_ms)} ms), unanswered "
        f"{step.unanswered}, twice {step.answered_twice}, CPU worker "
        f"{pct(step.worker_cpu_pct)} ingest {pct(step.ingest_cpu_pct)} broker "
        f"{pct(step.broker_cpu_pct)} bench {pct(step.bench_cpu_pct)}, users/call {batch}, "
        f"suffix {ms(step.suffix_tokens_p50)} tokens, send lag p99 "
        f"{step.send_lag_p99_ms:.0f} ms, host load {step.host_load_1m}: {verdict}"
    )


def print_summary(report: Mapping[str, Any]) -> None:
    for phase in report["phases"]:
        held = phase["held_eps"]
        held_text = f"{held:g} events/s" if held is not None else "no rate"
        print(f"load {phase['workers']} worker(s), {phase.get('guarantee', 'at_least_once')}: "
              f"held {held_text} at p99 <= "
              f"{report['config']['p99_ms']:g} ms; peak answered "
              f"{phase['peak_answered_eps'] or 0:.1f} events/s")  # fmt: skip
    held_ratio, peak_ratio = report["held_ratio_2_over_1"], report["peak_ratio_2_over_1"]
    line = "load 2-worker / 1-worker held rate: "
    line += (
        "n/a (a phase held no rate or did not run)" if held_ratio is None else f"{held_ratio:.2f}x"
    )
    if peak_ratio is not None:
        line += f"; peak answered throughput {peak_ratio:.2f}x"
    print(line)
    for workers, ratio in report.get("held_ratio_exactly_once_over_at_least_once", {}).items():
        text = "n/a (a phase held no rate)" if ratio is None else f"{ratio:.2f}x"
        print(f"load {workers} worker(s) exactly_once / at_least_once held rate: {text}")


def write_report(report: Mapping[str, Any], json_path: Path, png_path: Path) -> None:
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    plot_latency(report["phases"], report["config"]["p99_ms"], png_path)


def plot_latency(phases: Sequence[Mapping[str, Any]], p99_limit_ms: float, path: Path) -> None:
    """p50 (solid) and p99 (dashed) latency against answered events/s, a colour per worker count."""
    import matplotlib  # lazy: pyplot costs a second of start-up

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for phase, color in zip(phases, itertools.cycle(["C0", "C1", "C2", "C3"]), strict=False):
        steps = [s for s in phase["steps"] if s["p50_ms"] is not None and s["answered_eps"] > 0]
        throughput = [s["answered_eps"] for s in steps]
        label = f"{phase['workers']} worker{'s' if phase['workers'] != 1 else ''}"
        if phase.get("guarantee") == "exactly_once":
            label += ", exactly once"
        ax.plot(
            throughput, [s["p50_ms"] for s in steps], marker="o", color=color, label=f"{label} p50"
        )
        ax.plot(throughput, [s["p99_ms"] for s in steps], marker="s", ls="--", color=color,
                label=f"{label} p99")  # fmt: skip
    ax.axhline(p99_limit_ms, color="grey", lw=0.8, ls=":", label=f"p99 bound {p99_limit_ms:g} ms")
    ax.set_xscale("log")
    ax.set_yscale("log")
    for axis in (ax.xaxis, ax.yaxis):  # ticks 20, 50, 100, 200 (not 2 x 10^1)
        axis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        axis.set_major_formatter(FuncFormatter(lambda value, _pos: f"{value:g}"))
        axis.set_minor_formatter(NullFormatter())
    answered = [s["answered_eps"] for p in phases for s in p["steps"] if s["answered_eps"] > 0]
    if answered:  # room around the points: a phase of one step still gets a tick
        ax.set_xlim(min(answered) / 1.5, max(answered) * 1.5)
    ax.set_xlabel("answered events/s")
    ax.set_ylabel("event-to-recommendation latency (ms)")
    ax.set_title("genrec bench load: open-loop latency vs throughput")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
