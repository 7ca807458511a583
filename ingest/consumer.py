"""The ingest loop (ingest step): Kafka events -> validated -> behavior store, at least once.

Per batch: poll, validate every message, write the valid ones in ONE database
transaction (idempotent on event_id), publish the invalid ones to the
dead-letter topic and wait for its acks, and only then commit the Kafka offsets
of the batch. A crash anywhere before the commit means redelivery, and
redelivered events are skipped by the store, so every event is stored exactly
once. ``run`` overlaps the store of one batch with the poll and validation of
the next: by default a writer *process* (``ingest.writer``, see ``writer.py``)
stores batch N on the other core while this process polls and validates N+1;
the writer thread is the fallback (an ``engine=`` passed in, an in-memory
SQLite URL, or ``ingest.writer = "thread"``). A rebalance waits for the write
in flight. Polling, stop requests, the idle exit, broker outages, health and
closing are the shared ``ConsumerLoop``'s (``infra/consumer_loop.py``); this
module adds what is ingest's: validate, store, dead-letter, commit.

Example::

    >>> from genrec.infra.settings import get_settings
    >>> ingestor = Ingestor(get_settings())          # doctest: +SKIP
    >>> ingestor.run(exit_when_idle_s=10)            # doctest: +SKIP
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from kafka import ConsumerRebalanceListener, KafkaConsumer
from kafka.errors import CommitFailedError, KafkaError, RebalanceInProgressError
from kafka.structs import OffsetAndMetadata
from sqlalchemy import Engine
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError

from genrec.infra import metrics
from genrec.infra.consumer_loop import BatchHandler, ConsumerLoop
from genrec.infra.database import make_engine
from genrec.infra.kafka_clients import open_client
from genrec.infra.settings import Settings
from genrec.infra.topics import subscribe_when_ready
from genrec.ingest.dlq import DeadLetterPublisher
from genrec.ingest.store import write_event_rows
from genrec.ingest.writer import WriterProcess
from genrec.schemas.events import DeadLetter, Rejection, validate_event_fields

log = logging.getLogger("genrec.ingest")


@dataclass
class PreparedBatch:
    """One poll, validated: rows to store, letters to dead-letter, offsets to commit after.

    Rows are tuples in ``store.EVENT_COLUMNS`` order.
    """

    rows: list[tuple[Any, ...]] = field(default_factory=list)
    letters: list[DeadLetter] = field(default_factory=list)
    offsets: dict[Any, int] = field(default_factory=dict)
    message: bytes | None = None  # the rows, encoded for the writer process


@dataclass
class IngestStats:
    """Counters of one ingest process, read by the progress line (and a metrics endpoint)."""

    events_seen: int = 0
    events_stored: int = 0
    events_duplicate: int = 0
    events_rejected: int = 0
    batches: int = 0
    commits: int = 0
    lag: int | None = None
    rejected_by_reason: Counter = field(default_factory=Counter)
    started_at: float = field(default_factory=time.monotonic)
    first_event_at: float | None = None
    last_store_at: float | None = None

    def rate(self) -> float:
        """Events handled per second since the start."""
        elapsed = time.monotonic() - self.started_at
        return self.events_seen / elapsed if elapsed > 0 else 0.0

    def progress_line(self) -> str:
        lag = "?" if self.lag is None else str(self.lag)
        return (
            f"ingest: {self.rate():,.0f} events/s, stored {self.events_stored:,}, "
            f"duplicates {self.events_duplicate:,}, rejected {self.events_rejected:,}, "
            f"batches {self.batches:,}, lag {lag}"
        )


def consumer_config(settings: Settings, *, group_id: str | None = None) -> dict[str, Any]:
    """kafka-python consumer settings tuned for throughput, with manual commits."""
    ingest = settings.ingest
    return {
        **settings.kafka.client_config(),
        "group_id": group_id or ingest.group_id,
        "enable_auto_commit": False,
        "auto_offset_reset": "earliest",
        "max_poll_records": ingest.batch_size,
        "fetch_max_bytes": ingest.fetch_max_bytes,
        "max_partition_fetch_bytes": ingest.max_partition_fetch_bytes,
        "fetch_max_wait_ms": ingest.batch_timeout_ms,
        "fetch_min_bytes": ingest.fetch_min_bytes,
        "max_poll_interval_ms": ingest.max_poll_interval_ms,
        "session_timeout_ms": ingest.session_timeout_ms,
        "heartbeat_interval_ms": max(ingest.session_timeout_ms // 4, 500),
        "reconnect_backoff_max_ms": 2000,
    }


class Ingestor(BatchHandler):
    """Consumes ``kafka.topic_events`` into the store; ``run`` until idle or ``stop()``."""

    def __init__(
        self,
        settings: Settings,
        *,
        engine: Engine | None = None,
        consumer: Any = None,
        dead_letters: DeadLetterPublisher | None = None,
        group_id: str | None = None,
    ) -> None:
        self.settings = settings
        self.engine = engine or make_engine(str(settings.database_url))
        ingest = settings.ingest
        self.loop = ConsumerLoop(
            "ingest", self, health_stall_s=ingest.health_stall_s,
            idle_poll_ms=ingest.poll_timeout_ms,
            # After a crash the group assigns nothing until the dead member's session expires.
            join_grace_s=2 * ingest.session_timeout_ms / 1000 + 15,
        )  # fmt: skip
        # Started before the group join, which hides its start-up (imports, engine).
        self.writer_process: WriterProcess | None = None
        if engine is None and uses_writer_process(settings):
            self.writer_process = WriterProcess(str(settings.database_url))
        try:
            self.consumer = consumer or self._make_consumer(group_id)
        except BaseException:  # e.g. no such topic: the writer child must not outlive us
            if self.writer_process is not None:
                self.writer_process.close()
            raise
        self.dead_letters = dead_letters or DeadLetterPublisher(settings)
        self.stats = IngestStats()
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ingest-writer")
        self._in_flight: Callable[[], dict[Any, int]] | None = None
        self._uncommitted: dict[Any, int] = {}
        self._polled: dict[Any, list[Any]] = {}  # the open batch, not validated yet

    def _make_consumer(self, group_id: str | None) -> Any:
        kafka = self.settings.kafka
        consumer = open_client(
            KafkaConsumer, kafka, **consumer_config(self.settings, group_id=group_id)
        )
        subscribe_when_ready(
            consumer, kafka.topic_events, listener=_RebalanceLog(self), timeout_s=kafka.topic_wait_s
        )
        return consumer

    def stop(self) -> None:
        """Ask ``run`` to finish the batch in hand, commit, and return (signal-safe)."""
        self.loop.request_stop()

    def run(
        self,
        *,
        exit_when_idle_s: float | None = None,
        progress_every_s: float = 5.0,
        until: Callable[[IngestStats], bool] | None = None,
    ) -> IngestStats:
        """Consume until ``stop()``, ``until(stats)``, or ``exit_when_idle_s`` s without a message.

        Pipelined: while the writer (process or thread) stores batch N, this thread
        polls and validates batch N+1; batch N's offsets are committed (here: the
        consumer is not thread-safe) as soon as its write and dead letters are done.
        """
        stats = self.stats
        self.loop.run(
            self.consumer,
            exit_when_idle_s=exit_when_idle_s,
            until=None if until is None else lambda: until(stats),
            progress_every_s=progress_every_s,
        )
        self._update_lag()
        log.info("%s (done)", self.stats.progress_line())
        return self.stats

    # --- the loop's hooks (BatchHandler) -------------------------------------------------

    def take_records(self, polled: dict[Any, list[Any]], received_at: float) -> None:
        if not self._polled:
            self._polled = polled
            return
        # A second poll joins the open batch only with a batch window, which ingest does not use.
        for partition, records in polled.items():
            self._polled[partition] = self._polled.get(partition, []) + records

    def has_batch(self) -> bool:
        return bool(self._polled)

    def handle_batch(self) -> None:
        """Validate the poll, hand it to the writer, then commit the batch stored before it."""
        batch, self._polled = self._polled, {}
        prepared = self.prepare(batch)
        offsets = self._collect()
        # The writer gets batch N+1 before batch N's commit round trip:
        # it should never sit idle while this thread talks to the broker.
        self._in_flight = self._start_store(prepared)
        if offsets is not None:
            self._commit_with_retry(offsets)

    def settle(self) -> None:
        self.drain()

    def log_progress(self) -> None:
        self._update_lag()
        log.info("%s", self.stats.progress_line())

    def health_details(self) -> dict[str, Any]:
        return {
            "stored": self.stats.events_stored,
            "rejected": self.stats.events_rejected,
            "lag": self.stats.lag,
            "writer": "process" if self.writer_process is not None else "thread",
        }

    def release(self) -> None:
        self._writer.shutdown(wait=True)
        if self.writer_process is not None:
            self.writer_process.close()
        self.dead_letters.close()

    # --- one batch -------------------------------------------------------------------------

    def process_batch(self, batch: dict[Any, list[Any]]) -> None:
        """Validate, store, dead-letter and commit one poll's records, synchronously."""
        prepared = self.prepare(batch)
        self.store(prepared)
        self._commit_with_retry(prepared.offsets)

    def prepare(self, batch: dict[Any, list[Any]]) -> PreparedBatch:
        """Validate every record: rows for the store, dead letters, next offsets per partition."""
        prepared = PreparedBatch()
        max_bytes = self.settings.ingest.max_message_bytes
        rows, letters = prepared.rows, prepared.letters
        for partition, records in batch.items():
            for record in records:
                outcome = validate_event_fields(record.value, max_bytes)
                # EVENT_COLUMNS order: the event's fields, then where it came from.
                # (A type test, not isinstance(Rejection): that goes through ABCMeta.)
                if type(outcome) is tuple:
                    rows.append((*outcome, record.topic, record.partition, record.offset))
                else:
                    letters.append(_dead_letter(outcome, record))
            prepared.offsets[partition] = records[-1].offset + 1
        if self.writer_process is not None:
            prepared.message = self.writer_process.encode(rows)
        self.stats.events_seen += len(prepared.rows) + len(prepared.letters)
        self.stats.first_event_at = self.stats.first_event_at or time.monotonic()
        return prepared

    def store(self, prepared: PreparedBatch) -> dict[Any, int]:
        """ONE transaction for the rows, then the dead letters acked; returns offsets to commit."""
        return self._start_store(prepared)()

    def _start_store(self, prepared: PreparedBatch) -> Callable[[], dict[Any, int]]:
        """Hand the rows to the writer; the callable returned waits for them, then dead-letters.

        Dead letters are published by the consumer's thread, in either mode.
        """
        if self.writer_process is None:
            written = self._writer.submit(self._write_timed, prepared.rows)
            return lambda: self._finish_store(prepared, *written.result())
        writer = self.writer_process
        writer.send(prepared.message)  # encoded by ``prepare``, off the writer's critical path
        return lambda: self._finish_store(
            prepared, writer.wait(stop=self.loop.stop_requested), writer.finished_at
        )

    def _write_timed(self, rows: list[tuple[Any, ...]]) -> tuple[int, float]:
        return self._write_with_retry(rows), time.monotonic()

    def _finish_store(
        self, prepared: PreparedBatch, stored: int, written_at: float | None
    ) -> dict[Any, int]:
        self.stats.events_stored += stored
        self.stats.events_duplicate += len(prepared.rows) - stored
        _EVENTS_STORED.inc(stored)
        _EVENTS_DUPLICATE.inc(len(prepared.rows) - stored)
        if prepared.letters:
            self.dead_letters.publish(prepared.letters, stop=self.loop.stop_requested)
            self.stats.events_rejected += len(prepared.letters)
            self.stats.rejected_by_reason.update(letter.reason for letter in prepared.letters)
            _EVENTS_DEAD_LETTERED.inc(len(prepared.letters))
        self.stats.batches += 1
        # When the write ended, not when this thread got round to hearing of it.
        self.stats.last_store_at = written_at if not prepared.letters else time.monotonic()
        return prepared.offsets

    def drain(self, *, commit: bool = True) -> None:
        """Wait for the batch being stored; then commit its offsets (the consumer's thread only)."""
        offsets = self._collect() or {}
        if not commit:
            self._uncommitted = _newest(self._uncommitted, offsets)
        elif offsets or self._uncommitted:
            # Offsets a rebalance left behind are committed now, not with the next batch,
            # which may be long in coming: a restart would re-read them meanwhile.
            self._commit_with_retry(offsets)

    def _collect(self) -> dict[Any, int] | None:
        """Wait for the batch in flight (if any); its offsets, now safe to commit."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None:
            return None
        return in_flight()  # re-raises a failed write: nothing gets committed

    def _write_with_retry(self, rows: list[tuple[Any, ...]]) -> int:
        # A database outage must not lose the batch: keep trying (nothing is committed
        # to Kafka yet). Only a stop request gives up, and then redelivery covers it.
        # (The writer process runs the same loop in WriterProcess.wait.)
        delay = 0.5
        while True:
            try:
                return write_event_rows(self.engine, rows)
            except DBAPIError as exc:
                metrics.ERRORS.labels(component="ingest", kind="db_write").inc()
                if self.loop.stop_requested.is_set():
                    raise
                log.warning("database write failed (%s); retrying in %.1f s", _short(exc), delay)
                time.sleep(delay)
                delay = min(delay * 2, 10.0)

    def _commit_with_retry(self, offsets: dict[Any, int]) -> None:
        offsets = _newest(self._uncommitted, offsets)
        self._uncommitted = {}
        owned = self.consumer.assignment()
        # Partitions lost in a rebalance are the new owner's to commit (it re-reads
        # them from the last commit; the store skips what we already wrote).
        to_commit = {
            tp: OffsetAndMetadata(offset, "", -1) for tp, offset in offsets.items() if tp in owned
        }
        if not to_commit:
            return
        while True:
            try:
                self.consumer.commit(offsets=to_commit, timeout_ms=10_000)
                self.stats.commits += 1
                return
            except (CommitFailedError, RebalanceInProgressError) as exc:
                # The group is rebalancing, or went on without us, and only poll() rejoins
                # it: retrying here would spin forever. The offsets wait; at the next turn
                # of the loop those of partitions this consumer still owns are committed,
                # the others' new owners re-read from the last commit (the store skips
                # what we wrote).
                self._uncommitted = _newest(self._uncommitted, offsets)
                log.warning("offset commit deferred to after the rebalance: %s", _short(exc))
                return
            except KafkaError as exc:
                metrics.ERRORS.labels(component="ingest", kind="commit").inc()
                if not getattr(exc, "retriable", False):
                    # Authorization, a fenced instance, an unsupported broker: waiting
                    # cannot fix these, so stop with the error (nothing is lost: the
                    # batch is stored and will be re-read, and skipped, after a restart).
                    raise
                if self.loop.stop_requested.is_set():
                    log.warning("offset commit failed while stopping: %s", _short(exc))
                    return
                log.warning("offset commit failed (%s); retrying", _short(exc))
                time.sleep(1.0)

    def _update_lag(self) -> None:
        """Lag = newest offset the broker reported - our position, over assigned partitions
        (also the per-partition ``genrec_consumer_lag`` gauge)."""
        try:
            self.stats.lag = metrics.record_lag("ingest", self.consumer)
        except Exception as exc:  # lag is cosmetic; never let it stop ingest
            log.debug("lag unavailable: %s", exc)

    def health(self) -> tuple[bool, dict[str, Any]]:
        """Healthy while the loop turns: a stuck write, broker or database shows as unhealthy."""
        return self.loop.health()


_EVENTS_STORED = metrics.EVENTS.labels(component="ingest", outcome="stored")
_EVENTS_DUPLICATE = metrics.EVENTS.labels(component="ingest", outcome="duplicate")
_EVENTS_DEAD_LETTERED = metrics.EVENTS.labels(component="ingest", outcome="dead_lettered")


def uses_writer_process(settings: Settings) -> bool:
    """Whether ``settings`` get the writer process: not for an in-memory SQLite database."""
    if settings.ingest.writer != "process":
        return False
    url = make_url(str(settings.database_url))
    if url.get_backend_name() != "sqlite":
        return True
    # Another process would open its own, empty database.
    in_memory = url.database in (None, "", ":memory:") or url.query.get("mode") == "memory"
    return not in_memory


def _newest(offsets: dict[Any, int], more: dict[Any, int]) -> dict[Any, int]:
    """Both offset maps merged, keeping the higher offset per partition (never go back)."""
    merged = dict(offsets)
    for partition, offset in more.items():
        merged[partition] = max(offset, merged.get(partition, offset))
    return merged


def _dead_letter(rejection: Rejection, record: Any) -> DeadLetter:
    return DeadLetter.from_message(
        rejection,
        value=record.value,
        key=record.key,
        topic=record.topic,
        partition=record.partition,
        offset=record.offset,
        timestamp_ms=getattr(record, "timestamp", None),
    )


def _short(exc: BaseException) -> str:
    return str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__


class _RebalanceLog(ConsumerRebalanceListener):
    """Finishes the write in flight when partitions are revoked, and logs rebalances.

    Its offsets are committed at the next turn of the loop (for the partitions this
    consumer still owns then), batch or no batch.

    An assignment restarts the idle clock: joining a group can take longer than
    ``--exit-when-idle`` on a busy machine.
    """

    def __init__(self, ingestor: Ingestor) -> None:
        self.ingestor = ingestor

    def on_partitions_revoked(self, revoked) -> None:
        # Runs inside the client's event loop, where a commit would deadlock: finish the
        # write in flight, and leave its offsets for the next commit (owned ones only).
        self.ingestor.drain(commit=False)
        if revoked:
            log.info(
                "partitions revoked: %s", sorted(f"{tp.topic}-{tp.partition}" for tp in revoked)
            )

    def on_partitions_assigned(self, assigned) -> None:
        self.ingestor.loop.restart_idle_clock()
        log.info("partitions assigned: %s", sorted(f"{tp.topic}-{tp.partition}" for tp in assigned))
