"""The online worker loop behind ``genrec serve``: consume, gather, recommend, publish, commit.

The worker joins consumer group ``online.group_id`` on ``kafka.topic_events``
(several workers split the partitions). Each user's latest event in a batch is
one request; the user's earlier events in the batch ride along
(``covered_event_ids``), so every event is answered by exactly one message.

Continuous batching: a batch is handed to the ``DecodeStage``
(``genrec.online.batch_pipeline``) as soon as it is free, so at low load a
request waits for little more than its own decoding, and under load the next
batch is whatever came while the last one was served, up to
``online.max_batch_users`` users per decoding call. By default the stage
decodes on the consumer's thread: Kafka's own I/O thread fetches the next
records meanwhile, and acknowledgements and commits no longer hold the loop up.
With ``online.decode_thread`` it decodes on a thread of its own while the
consumer's thread polls and prepares the next batch (``Recommender.prepare``:
one store query for its histories, its prefix KVs, its branch lists), handed
over when the stage is predicted to be free less the time a preparation takes.
``online.batch_window_ms`` (default 0) makes a batch wait that long for more
events even when the stage is idle. While the consumer's thread serves a batch
the cyclic garbage collector is held off (``online.gc_between_batches``), so it
collects between batches, over what outlived them.

Kafka acknowledges messages on the producer's I/O thread; the consumer's thread
commits a batch's offsets (asynchronously) once every message of the batch is
acknowledged, and never before an earlier batch's. Delivery is at-least-once:
a crash between publish and commit re-delivers those events and they are
answered again, with the same ``request_id`` (the triggering event's id),
which consumers deduplicate on. A failed batch (a failed publish, or the
behavior store away) is never committed: the worker drops it and every batch
after it, seeks back to their first offsets and serves them again. SIGTERM
(``request_stop``) finishes the batches in hand, commits them and leaves the
group. Polling (through broker outages), stop requests, the idle exit, health
and closing are the shared ``ConsumerLoop``'s (``infra/consumer_loop.py``).

Example::

    worker = OnlineWorker(settings, Recommender(settings, engine), versions)
    worker.run(exit_when_idle_s=10)
"""

from __future__ import annotations

import gc
import logging
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from kafka import AsyncConsumerRebalanceListener, KafkaConsumer, KafkaProducer
from kafka.structs import OffsetAndMetadata, TopicPartition

from genrec.infra import metrics
from genrec.infra.consumer_loop import BatchHandler, ConsumerLoop
from genrec.infra.kafka_clients import open_client
from genrec.infra.librdkafka import LibrdkafkaProducer
from genrec.infra.settings import Settings
from genrec.infra.topics import subscribe_when_ready
from genrec.online.batch_pipeline import BatchTimer, DecodeStage, InFlightBatch
from genrec.online.live_version import ServingVersions
from genrec.online.recommender import Recommender, Request
from genrec.online.transactions import ProducerFenced, TransactionAborted, TransactionalPublisher
from genrec.schemas.events import UserEvent, validate_event

log = logging.getLogger(__name__)

POLL_IDLE_MS = 200  # poll timeout while nothing is in hand: bounds how fast SIGTERM is seen
# Poll timeout while batches are in flight: how late a decode thread that finished early,
# or an acknowledgement to commit, is noticed (a poll cannot be woken before its timeout).
# 5 ms cost the decode thread more (its Python work contends with the polls') than it won.
LOOK_AGAIN_S = 0.01
PUBLISH_RETRY_S = 1.0  # wait before a failed batch is served again
FAILING_BATCHES = 3  # failed attempts in a row after which /healthz answers 503
PROGRESS_EVERY_S = 5.0  # seconds between progress lines in the log


@dataclass
class WorkerReport:
    """What one ``run`` did, for the CLI and tests."""

    batches: int = 0
    requests: int = 0
    events: int = 0
    invalid_events: int = 0
    publish_failures: int = 0
    commit_failures: int = 0
    versions: list[str] = field(default_factory=list)
    fenced: bool = False  # exactly-once: another worker with our transactional.id took over


@dataclass
class _Polled:
    record: Any  # kafka ConsumerRecord
    event: UserEvent | None
    received_at: float


class OnlineWorker(BatchHandler):
    """One consumer in the ``genrec-online`` group; ``run`` until stopped or idle."""

    def __init__(
        self,
        settings: Settings,
        recommender: Recommender,
        versions: ServingVersions,
        consumer_factory: Callable[[Any], Any] | None = None,
        producer_factory: Callable[[], Any] | None = None,
    ) -> None:
        self.settings = settings
        self.online = settings.online
        self.recommender = recommender
        self.versions = versions
        self._consumer_factory = consumer_factory or self._kafka_consumer
        self._producer_factory = producer_factory or self._kafka_producer
        self.loop = ConsumerLoop(
            "online", self, health_stall_s=self.online.health_stall_s, idle_poll_ms=POLL_IDLE_MS,
            batch_window_s=self.online.batch_window_ms / 1000.0,
            max_records=self.online.max_poll_records,
        )  # fmt: skip
        self._open: list[_Polled] = []  # the batch being gathered
        self._open_users: set[str] = set()
        self._in_flight: deque[InFlightBatch] = deque()  # handed over, not committed; in order
        self._epoch = 0  # rewinds so far: a batch gathered before the last one is void
        self._prepare_time = BatchTimer()  # how long preparing a batch takes, by its users
        self._committed: dict[Any, int] = {}  # next offset per partition, as last committed
        self._dropped: dict[Any, int] = {}  # first unanswered offset of each revoked partition
        self._last_progress = time.monotonic()
        self.report = WorkerReport()
        self._failures = 0  # batches in a row that could not be answered
        self._commit_failures = 0  # answered batches in a row whose offsets did not commit
        self.exactly_once = self.online.processing_guarantee == "exactly_once"
        threaded = self.online.decode_thread and not self.exactly_once
        if self.online.decode_thread and self.exactly_once:
            # A transaction brackets consume -> publish -> commit of one batch at a time,
            # on the consumer's thread (whose group generation the offsets carry).
            log.warning("online.decode_thread is ignored with exactly_once processing")
        self.decoder = DecodeStage(self._serve, threaded=threaded)
        self.consumer: Any = None
        self.producer: Any = None
        self.publisher: TransactionalPublisher | None = None

    # --- lifecycle ------------------------------------------------------------------

    def request_stop(self, *_args: Any) -> None:
        """Finish the batches in hand, commit them, leave the group (safe from a signal handler)."""
        self.loop.request_stop()

    def health(self) -> tuple[bool, dict[str, Any]]:
        """Healthy while the loop turns and the decode thread is not stuck on one batch."""
        return self.loop.health()

    def run(
        self, exit_when_idle_s: float | None = None, max_requests: int | None = None
    ) -> WorkerReport:
        """Serve until ``request_stop``, ``exit_when_idle_s`` without events, or ``max_requests``."""
        self.consumer = self._consumer_factory(_Rebalance(self))
        try:
            if self.exactly_once:
                self.publisher = TransactionalPublisher(self._producer_factory)
                self.producer = self.publisher.producer
            else:
                self.producer = self._producer_factory()
        except BaseException:  # e.g. Kafka gone meanwhile: leave the group now, not later
            self.consumer.close()
            raise
        self.decoder.start()
        report = self.report
        try:
            self.loop.run(
                self.consumer,
                exit_when_idle_s=exit_when_idle_s,
                until=None if max_requests is None else lambda: report.requests >= max_requests,
            )
        finally:
            log.info("worker stopped", extra={"fields": vars(self.report)})
        return self.report

    # --- the loop's hooks (BatchHandler) -------------------------------------------------

    def take_records(self, polled: dict[Any, list[Any]], received_at: float) -> None:
        for partition, records in polled.items():
            for record in self._not_answered(partition, records):
                item = _Polled(record, self._parse(record), received_at)
                self._open.append(item)
                if item.event is not None:
                    self._open_users.add(item.event.user_id)

    def has_batch(self) -> bool:
        return bool(self._open)

    def batch_full(self) -> bool:
        return len(self._open_users) >= self.online.max_batch_users

    def hand_over_in_s(self, window_left_s: float) -> float:
        if self.decoder.has_waiting():  # the next batch is prepared already: keep gathering
            return LOOK_AGAIN_S
        # Prepared just in time: ready when the decode thread is predicted to be free.
        lead_s = self._prepare_time.predict(len(self._open_users)) or 0.0
        return max(window_left_s, self.decoder.busy_for_s(time.monotonic()) - lead_s)

    def poll_timeout_s(self, timeout_s: float) -> float:
        return min(timeout_s, LOOK_AGAIN_S) if self._in_flight else timeout_s

    def after_poll(self) -> None:
        self._collect()

    def handle_batch(self) -> None:
        if not self.online.gc_between_batches:
            return self._handle_batch()
        with collector_held_off():
            self._handle_batch()

    def _handle_batch(self) -> None:
        polled, self._open, self._open_users = self._open, [], set()
        batch = InFlightBatch(polled, group_requests(polled), self._epoch)
        received = min(p.received_at for p in polled)
        metrics.STAGE_LATENCY.labels(stage="gather").observe(batch.gathered_at - received)
        if not batch.requests:  # only invalid events: nothing to answer, offsets to commit
            self._in_flight.append(batch)
            if self.exactly_once:
                self._publish_transaction(batch, [])
            else:
                batch.mark_sent()
            return
        if self._prepare(batch):
            self._in_flight.append(batch)
            batch.handed_at = time.monotonic()
            self.decoder.hand_over(batch)  # waits only if a full batch follows a waiting one

    def settle(self) -> None:
        self._collect()

    def drain(self) -> None:
        """Serve every batch in hand, then commit synchronously before the consumer closes."""
        self._finish_in_flight()
        self._collect()
        self._commit_now()

    def health_details(self) -> dict[str, Any]:
        bundle = self.versions.current() if self.versions else None
        return {
            "requests": self.report.requests,
            "failing_batches": self._failures,
            "failing_commits": self._commit_failures,
            "decoding_batch_s": round(self.decoder.busy_s(time.monotonic()), 1),
            "version": bundle.describe() if bundle else None,
        }

    def failing(self) -> bool:
        # The decode thread stuck on one batch: the loop may still turn (it gathers), so
        # the loop's own stall clock would not show it.
        stuck = self.decoder.busy_s(time.monotonic()) >= self.online.health_stall_s
        return stuck or max(self._failures, self._commit_failures) >= FAILING_BATCHES

    def release(self) -> None:
        self.decoder.stop(timeout_s=self.online.publish_timeout_s)
        try:
            if self.publisher is not None:
                self.publisher.close()
            elif self.producer is not None:
                self.producer.close()
        except Exception:
            log.exception("closing the Kafka producer failed")

    # --- gather and prepare (the consumer's thread) --------------------------------------

    def _not_answered(self, partition: Any, records: list[Any]) -> list[Any]:
        """Exactly-once: records below the offset this worker's last committed transaction
        gave the partition were answered in it; read again (the group's committed offset
        went back, say), they are skipped, not answered twice."""
        floor = self.publisher.committed.get(partition) if self.publisher else None
        if floor is None or not records or records[0].offset >= floor:  # in offset order
            return records
        kept = [r for r in records if r.offset >= floor]
        skipped = len(records) - len(kept)
        log.warning(
            "skipping %d events of %s from offset %d: answered already, up to offset %d",
            skipped, partition, records[0].offset, floor - 1,
        )  # fmt: skip
        metrics.ERRORS.labels(component="online", kind="already_answered").inc(skipped)
        return kept

    def _parse(self, record: Any) -> UserEvent | None:
        result = validate_event(record.value, self.settings.ingest.max_message_bytes)
        if isinstance(result, UserEvent):
            metrics.EVENTS.labels(component="online", outcome="consumed").inc()
            return result
        # ingest dead-letters it; the worker only skips it (its offset is still committed)
        metrics.EVENTS.labels(component="online", outcome="invalid").inc()
        self.report.invalid_events += 1
        log.debug(
            "skipping invalid event at %s:%s: %s", record.partition, record.offset, result.reason
        )
        return None

    def _prepare(self, batch: InFlightBatch) -> bool:
        """Histories, prefix KVs and branch lists; on failure the batch is read again later."""
        bundle = self.versions.current()
        if bundle.key not in self.report.versions:
            self.report.versions.append(bundle.key)
        started = time.monotonic()
        try:
            batch.prepared = self.recommender.prepare(batch.requests, bundle)
        except Exception:  # e.g. the behavior store is briefly away: answer this batch later
            log.exception("recommending %d requests failed; the batch will be retried", batch.users)
            metrics.ERRORS.labels(component="online", kind="recommend").inc()
            self._failures += 1
            self._seek_back(batch.polled)  # the batches before it are fine: only this one
            self.loop.stop_requested.wait(PUBLISH_RETRY_S)
            self.loop.restart_idle_clock()  # its records wait to be read again: not idle
            return False
        self._prepare_time.record(batch.users, time.monotonic() - started)
        return True

    # --- decode, serialise, send (the decode thread) --------------------------------------

    def _serve(self, batch: InFlightBatch) -> bool:
        """Finish a prepared batch and hand its messages to the producer; False if void."""
        # The batch waits for its acknowledgements and commit after this: let go of its
        # histories, prompts and lists now (freed, not left to the garbage collector's walks)
        prepared, batch.prepared = batch.prepared, None
        if batch.epoch != self._epoch:  # rewound meanwhile: its records will be read again
            return False
        metrics.STAGE_LATENCY.labels(stage="queue").observe(time.monotonic() - batch.handed_at)
        try:
            messages = self.recommender.finish(prepared)
            started = time.perf_counter()
            payloads = [(m.kafka_key(), m.to_json_bytes()) for m in messages]
            metrics.STAGE_LATENCY.labels(stage="serialise").observe(time.perf_counter() - started)
        except Exception as exc:
            log.exception("recommending %d requests failed; the batch will be retried", batch.users)
            batch.failed(exc, "recommend")
            return True
        batch.paths = [m.decoding.get("path", "unknown") for m in messages]
        if batch.epoch == self._epoch:
            self._send(batch, payloads)
        return True

    def _send(self, batch: InFlightBatch, payloads: Sequence[tuple[bytes, bytes]]) -> None:
        if self.exactly_once:
            self._publish_transaction(batch, payloads)
            return
        topic = self.settings.kafka.topic_recommendations
        batch.expect_acks(len(payloads))
        try:
            for key, value in payloads:
                future = self.producer.send(topic, key=key, value=value)
                future.add_callback(batch.acked)
                future.add_errback(batch.failed)
        except Exception as exc:  # e.g. the producer's buffer stayed full past max_block_ms
            batch.failed(exc)
        batch.mark_sent()

    def _publish_transaction(
        self, batch: InFlightBatch, payloads: Sequence[tuple[bytes, bytes]]
    ) -> None:
        """Exactly-once: the batch's messages and next offsets in one transaction, committed
        before this returns (the consumer's thread: the offsets carry its group generation)."""
        offsets = _next_offsets(batch.polled)
        batch.expect_acks(0)
        if set(self._owned(offsets)) != set(offsets):  # revoked meanwhile: its new owner's
            log.info("%d requests not published: their partitions were revoked", batch.users)
            batch.failed(TransactionAborted("partitions revoked before publishing"))
            return
        try:
            self.publisher.publish(
                self.settings.kafka.topic_recommendations, payloads, offsets,
                self.consumer.group_metadata(),
            )  # fmt: skip
        except TransactionAborted as exc:  # logged here (a rebalance may drop the batch
            # unseen), and only here: _rewind does not log it again
            log.warning("transaction of %d requests aborted (%s); they will be served again",
                        batch.users, exc)  # fmt: skip
            batch.failed(exc)
            return
        except ProducerFenced as exc:
            log.error(
                "fenced: another worker with transactional.id %s took over (%s); stopping",
                self.online.transactional_id(), exc,
            )  # fmt: skip
            metrics.ERRORS.labels(component="online", kind="fenced").inc()
            self.report.fenced = True
            batch.failed(exc)
            self.loop.request_stop()
            return
        batch.mark_sent()  # committed: every message is acknowledged

    # --- acknowledge and commit (the consumer's thread) ------------------------------------

    def _collect(self) -> None:
        """Commit the batches at the head that are acknowledged; rewind at a failed one."""
        done: list[InFlightBatch] = []
        now = time.monotonic()
        while self._in_flight:
            state = self._in_flight[0].state(now, self.online.publish_timeout_s)
            if state == "pending":
                break
            if state == "failed":
                self._answered(done)
                self._rewind()
                return
            done.append(self._in_flight.popleft())
        self._answered(done)

    def _answered(self, batches: Sequence[InFlightBatch]) -> None:
        if not batches:
            return
        self._failures = 0
        if not self.exactly_once:  # exactly-once batches committed theirs in the transaction
            self._commit_async(_next_offsets(p for b in batches for p in b.polled))
        for batch in batches:
            self._account(batch)
        metrics.record_lag("online", self.consumer)

    def _account(self, batch: InFlightBatch) -> None:
        """Metrics, report and progress of one acknowledged batch."""
        if batch.send_started is not None and batch.acked_at is not None:
            metrics.STAGE_LATENCY.labels(stage="publish").observe(
                batch.acked_at - batch.send_started
            )
        acked_at = batch.acked_at or time.monotonic()
        for request, path in zip(batch.requests, batch.paths, strict=True):
            metrics.REQUEST_LATENCY.observe(acked_at - request.received_at)
            metrics.REQUESTS.labels(path=path).inc()
        self.report.batches += 1
        self.report.requests += batch.users
        self.report.events += len(batch.polled)
        now = time.monotonic()
        if now - self._last_progress >= PROGRESS_EVERY_S:
            self._last_progress = now
            log.info(
                "serve: %d requests (%d events) in %d batches, version %s",
                self.report.requests, self.report.events, self.report.batches,
                self.report.versions[-1] if self.report.versions else None,
            )  # fmt: skip

    def _commit_async(self, offsets: dict[Any, int]) -> None:
        offsets = self._owned(offsets)
        if not offsets:
            return
        self._committed.update(offsets)
        try:
            self.consumer.commit_async(_commit_request(offsets), callback=self._commit_answered)
        except Exception as exc:
            self._commit_failed(exc)

    def _commit_answered(self, _offsets: Any, response: Any) -> None:
        """kafka-python's answer to an asynchronous commit (inside a later poll)."""
        if isinstance(response, Exception):
            self._commit_failed(response)
        else:
            self._commit_failures = 0

    def _commit_now(self) -> None:
        """Commit the offsets committed asynchronously so far, and wait for it (at the end)."""
        offsets = self._owned(self._committed)
        if not offsets:
            return
        try:
            self.consumer.commit(_commit_request(offsets))
        except Exception as exc:
            self._commit_failed(exc)
        else:
            self._commit_failures = 0

    def _commit_failed(self, error: BaseException) -> None:
        # Published but not committed (e.g. the group rebalanced meanwhile): the new
        # owner answers these events again; consumers dedupe on request_id. One
        # failure is routine; several in a row (e.g. lost permissions on the group)
        # would re-answer everything after a restart, so /healthz turns red.
        log.error("committing offsets failed (%s); these events may be answered twice", error)
        metrics.ERRORS.labels(component="online", kind="commit").inc()
        self._commit_failures += 1
        self.report.commit_failures += 1

    def _owned(self, offsets: dict[Any, int]) -> dict[Any, int]:
        """Only partitions still assigned: a revoked one's offsets are its new owner's."""
        assigned = set(self.consumer.assignment())
        return {tp: offset for tp, offset in offsets.items() if tp in assigned}

    def _finish_in_flight(self) -> None:
        """Wait until every batch handed over is acknowledged or failed (no commit)."""
        while self._in_flight:
            now = time.monotonic()
            if all(
                b.state(now, self.online.publish_timeout_s) != "pending" for b in self._in_flight
            ):
                return
            self.decoder.progress.wait(LOOK_AGAIN_S)
            self.decoder.progress.clear()

    # --- failures and rebalances -------------------------------------------------------

    def _rewind(self) -> None:
        """The head batch failed: void it and every later batch, read them all again."""
        failed = self._in_flight[0]
        metrics.ERRORS.labels(component="online", kind=failed.failed_in).inc()
        if failed.failed_in == "publish":
            # A transaction's failure was logged where it happened (_publish_transaction).
            if not isinstance(failed.error, (TransactionAborted, ProducerFenced)):
                log.error(
                    "publishing %d recommendations failed (%s); the batch will be retried",
                    failed.users, failed.error,
                )  # fmt: skip
            self.report.publish_failures += 1
        self._failures += 1
        records = [p for batch in self._in_flight for p in batch.polled] + self._open
        self._in_flight.clear()
        self._open, self._open_users = [], set()
        self._epoch += 1
        self._seek_back(records)
        self.loop.stop_requested.wait(PUBLISH_RETRY_S)
        self.loop.restart_idle_clock()  # their records wait to be read again: not idle

    def _seek_back(self, records: Sequence[_Polled]) -> None:
        """Seek to the records' first offsets so the next polls read them again."""
        assigned = set(self.consumer.assignment())
        for partition, first in _first_offsets(records).items():
            if partition in assigned:
                self.consumer.seek(partition, first)

    def _partitions_revoked(self, revoked: Iterable[Any], lost: bool) -> dict[Any, int]:
        """Hand the partitions over drained; returns the offsets to commit first (none if lost).

        Revoked (still ours until the group rejoins): every batch in hand is finished,
        the acknowledged ones' offsets are returned for the caller to commit, and the
        rest, failed or not handed over, is left to the partitions' next owner. Lost
        (the group moved on already): nothing of ours may be committed any more, and
        nothing is remembered to read again: another member may have served those
        partitions meanwhile, and kafka-python, which forgets a lost partition's
        position, starts it again from its committed offset.
        """
        revoked = set(revoked)
        for partition in revoked:  # a stale offset must never be committed again
            self._committed.pop(partition, None)
        offsets: dict[Any, int] = {}
        if not lost:
            self._finish_in_flight()
        left: list[_Polled] = []
        for batch in self._in_flight:
            finished = batch.state(time.monotonic(), float("inf")) == "done"
            # Exactly-once: a done batch's transaction committed its offsets, lost or not;
            # reading it again would answer it twice.
            committed = self.exactly_once and finished
            if committed or (finished and not lost and not left):
                self._account(batch)
                if not self.exactly_once:
                    offsets.update(_next_offsets(batch.polled))
            else:
                left.extend(batch.polled)
        if self._in_flight:
            self._in_flight.clear()
            self._epoch += 1
        kept = []
        for polled in [*left, *self._open]:
            partition = _partition(polled.record)
            if partition in revoked:
                if not lost:  # a lost one restarts from its committed offset (docstring)
                    offset = polled.record.offset
                    self._dropped[partition] = min(offset, self._dropped.get(partition, offset))
            else:
                kept.append(polled)
        self._open = kept
        self._open_users = {p.event.user_id for p in kept if p.event is not None}
        return self._owned(offsets)

    def _seek_back_reassigned(self, assigned: Sequence[Any]) -> None:
        # A partition revoked and assigned back to us keeps its fetch position in
        # kafka-python (past the records dropped above): read them again from the first
        # unanswered one, or they would never be answered (nor re-read by anyone).
        for partition in assigned:
            first = self._dropped.get(partition)
            if first is not None:
                self.consumer.seek(partition, first)
        self._dropped.clear()  # the other partitions are their new owners' now

    # --- Kafka clients -------------------------------------------------------------------

    def _kafka_consumer(self, listener: Any) -> Any:
        consumer = open_client(
            KafkaConsumer,
            self.settings.kafka,
            group_id=self.online.group_id,
            enable_auto_commit=False,
            auto_offset_reset=self.online.auto_offset_reset,
            max_poll_records=self.online.max_poll_records,
            session_timeout_ms=self.online.session_timeout_ms,
            heartbeat_interval_ms=max(100, self.online.session_timeout_ms // 3),
            max_poll_interval_ms=self.online.max_poll_interval_ms,
            fetch_max_wait_ms=self.online.fetch_max_wait_ms,  # (settings: why not 500)
            # Exactly-once: offsets a transaction is still committing are waited for on a
            # rebalance (OffsetFetch require_stable), not read stale and answered twice.
            isolation_level="read_committed" if self.exactly_once else "read_uncommitted",
        )
        subscribe_when_ready(
            consumer, self.settings.kafka.topic_events, listener=listener,
            timeout_s=self.settings.kafka.topic_wait_s, should_stop=self.loop.stop_requested.is_set,
        )  # fmt: skip
        return consumer

    def _kafka_producer(self) -> Any:
        # linger 0: a batch's messages leave at once (the decode thread sends them all in
        # one go, and the sender packs whatever queued meanwhile into its next request).
        if not self.exactly_once and self.online.producer_client == "librdkafka":
            return LibrdkafkaProducer(self.settings.kafka, linger_ms=0)
        options: dict[str, Any] = {"acks": "all", "linger_ms": 0, "enable_idempotence": True}
        if self.exactly_once:
            options["transactional_id"] = self.online.transactional_id()
        return open_client(KafkaProducer, self.settings.kafka, **options)


@contextmanager
def collector_held_off() -> Iterator[None]:
    """The cyclic garbage collector off for the block (if it was on), on again after.

    Why: a batch's histories and prompts are young containers of ~1,000 references each
    (240,000 for 64 users), and every young collection during the batch walked them all:
    ~4 ms each, several a batch (7-11% of a batch of 64 users in one process). At the end
    of the block most of them are freed already, and the next collection walks only
    what outlived the batch. A batch's cyclic garbage waits until then (bounded by it).
    """
    if not gc.isenabled():  # off already (the embedding program's choice): leave it so
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def group_requests(polled: Sequence[_Polled]) -> list[Request]:
    """One request per user: the latest event in Kafka order, earlier ones covered by it."""
    by_user: dict[str, list[_Polled]] = defaultdict(list)
    for item in sorted(polled, key=lambda p: (p.record.partition, p.record.offset)):
        if item.event is not None:
            by_user[item.event.user_id].append(item)
    return [
        Request.of([p.event for p in items], received_at=items[0].received_at)
        for items in by_user.values()
    ]


def _partition(record: Any) -> TopicPartition:
    return TopicPartition(record.topic, record.partition)


def _next_offsets(polled: Iterable[_Polled]) -> dict[Any, int]:
    """Per partition, the offset after the last record: what a commit of them names."""
    last: dict[Any, int] = {}
    for p in polled:
        tp = _partition(p.record)
        last[tp] = max(last.get(tp, -1), p.record.offset + 1)
    return last


def _first_offsets(polled: Iterable[_Polled]) -> dict[Any, int]:
    first: dict[Any, int] = {}
    for p in polled:
        tp = _partition(p.record)
        first[tp] = min(first.get(tp, p.record.offset), p.record.offset)
    return first


def _commit_request(offsets: dict[Any, int]) -> dict[Any, OffsetAndMetadata]:
    return {tp: OffsetAndMetadata(offset, "", -1) for tp, offset in offsets.items()}


class _Rebalance(AsyncConsumerRebalanceListener):
    """Rebalance callbacks. kafka-python 3 runs them inside its client's event loop, where a
    blocking commit would deadlock; as coroutines they can await an asynchronous one, which
    then reaches the coordinator before the group rejoins."""

    def __init__(self, worker: OnlineWorker) -> None:
        self.worker = worker

    async def on_partitions_revoked(self, revoked: Any) -> None:
        log.info("partitions revoked: %s", sorted(str(tp) for tp in revoked))
        offsets = self.worker._partitions_revoked(revoked, lost=False)
        if offsets:
            try:
                await self.worker.consumer.commit_async(_commit_request(offsets))
            except Exception as exc:
                self.worker._commit_failed(exc)

    async def on_partitions_lost(self, lost: Any) -> None:
        log.info("partitions lost: %s", sorted(str(tp) for tp in lost))
        self.worker._partitions_revoked(lost, lost=True)

    async def on_partitions_assigned(self, assigned: Any) -> None:
        log.info("partitions assigned: %s", sorted(str(tp) for tp in assigned))
        self.worker._seek_back_reassigned(assigned)
