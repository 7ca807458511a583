"""The online worker loop behind ``genrec serve``: consume, micro-batch, recommend, publish, commit.

The worker joins consumer group ``online.group_id`` on ``kafka.topic_events``
(several workers split the partitions). It gathers a micro-batch: everything
polled until ``online.batch_window_ms`` after the batch's first event. Each
user's latest event in the batch is one request; the user's earlier events in
the window ride along (``covered_event_ids``), so every event is answered by
exactly one message. The ``Recommender`` answers the requests in chunks of
``online.max_batch_users``; the worker publishes one message per request to
``kafka.topic_recommendations`` keyed by ``user_id``, waits until Kafka has
acknowledged every one of them, and only then commits the consumed offsets.

Delivery is at-least-once: a crash between publish and commit re-delivers those
events and they are answered again, with the same ``request_id`` (the
triggering event's id), which consumers deduplicate on. A failed publish is
never committed: the worker rewinds to the batch's first offsets and retries.
SIGTERM (``request_stop``) finishes the batch in hand, commits it and leaves
the group. Polling (through broker outages), the batch window, stop requests,
the idle exit, health and closing are the shared ``ConsumerLoop``'s
(``infra/consumer_loop.py``); this module adds what is online's: group,
recommend, publish, commit or rewind.

Example::

    worker = OnlineWorker(settings, Recommender(settings, engine), versions)
    worker.run(exit_when_idle_s=10)
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kafka import ConsumerRebalanceListener, KafkaConsumer, KafkaProducer
from kafka.structs import OffsetAndMetadata, TopicPartition

from genrec.infra import metrics
from genrec.infra.consumer_loop import BatchHandler, ConsumerLoop
from genrec.infra.settings import Settings
from genrec.infra.topics import subscribe_when_ready
from genrec.online.live_version import ServingVersions
from genrec.online.recommender import Recommender, Request
from genrec.schemas.events import UserEvent, validate_event

log = logging.getLogger(__name__)

POLL_IDLE_MS = 200  # poll timeout while no batch is open: bounds how fast SIGTERM is seen
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
        self._pending: list[_Polled] = []  # the open batch
        self._dropped: dict[Any, int] = {}  # first unanswered offset of each revoked partition
        self._last_progress = time.monotonic()
        self.report = WorkerReport()
        self._failures = 0  # batches in a row that could not be answered
        self._commit_failures = 0  # answered batches in a row whose offsets did not commit
        self.consumer: Any = None
        self.producer: Any = None

    # --- lifecycle ------------------------------------------------------------------

    def request_stop(self, *_args: Any) -> None:
        """Finish the batch in hand, commit it, leave the group (safe from a signal handler)."""
        self.loop.request_stop()

    def health(self) -> tuple[bool, dict[str, Any]]:
        """Healthy while the loop turns (a stuck decode or broker shows as unhealthy)."""
        return self.loop.health()

    def run(
        self, exit_when_idle_s: float | None = None, max_requests: int | None = None
    ) -> WorkerReport:
        """Serve until ``request_stop``, ``exit_when_idle_s`` without events, or ``max_requests``."""
        self.consumer = self._consumer_factory(_RevokeListener(self))
        self.producer = self._producer_factory()
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
        for records in polled.values():
            for record in records:
                self._pending.append(_Polled(record, self._parse(record), received_at))

    def has_batch(self) -> bool:
        return bool(self._pending)

    def batch_full(self) -> bool:
        users = {p.event.user_id for p in self._pending if p.event is not None}
        return len(users) >= self.online.max_batch_users

    def handle_batch(self) -> None:
        polled, self._pending = self._pending, []
        self._serve(polled)

    def health_details(self) -> dict[str, Any]:
        bundle = self.versions.current() if self.versions else None
        return {
            "requests": self.report.requests,
            "failing_batches": self._failures,
            "failing_commits": self._commit_failures,
            "version": bundle.describe() if bundle else None,
        }

    def failing(self) -> bool:
        return max(self._failures, self._commit_failures) >= FAILING_BATCHES

    def release(self) -> None:
        try:
            if self.producer is not None:
                self.producer.close()
        except Exception:
            log.exception("closing the Kafka producer failed")

    # --- one batch ---------------------------------------------------------------------

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

    def _serve(self, polled: list[_Polled]) -> None:
        requests = group_requests(polled)
        bundle = self.versions.current()
        if bundle.key not in self.report.versions:
            self.report.versions.append(bundle.key)
        messages = []
        chunk = self.online.max_batch_users
        try:
            for start in range(0, len(requests), chunk):
                part = requests[start : start + chunk]
                metrics.BATCH_USERS.observe(len(part))
                messages.extend(self.recommender.recommend(part, bundle))
        except Exception:  # e.g. the behavior store is briefly away: answer this batch later
            log.exception(
                "recommending %d requests failed; the batch will be retried", len(requests)
            )
            metrics.ERRORS.labels(component="online", kind="recommend").inc()
            self._failures += 1
            self._rewind(polled)
            return
        if not self._publish(messages):
            self._failures += 1
            self._rewind(polled)
            return
        self._failures = 0
        self._commit(polled)
        now = time.monotonic()
        for request, message in zip(requests, messages, strict=True):
            metrics.REQUEST_LATENCY.observe(now - request.received_at)
            metrics.REQUESTS.labels(path=message.decoding.get("path", "unknown")).inc()
        self.report.batches += 1
        self.report.requests += len(requests)
        self.report.events += len(polled)
        metrics.record_lag("online", self.consumer)
        # One line per batch is for debugging; the progress line below is for operators.
        log.debug(
            "served %d requests (%d events) with version %s",
            len(requests), len(polled), bundle.key,
            extra={"fields": {"requests": len(requests), "events": len(polled), "version": bundle.key,
                              "max_latency_ms": max((m.latency_ms for m in messages), default=0.0)}},
        )  # fmt: skip
        if now - self._last_progress >= PROGRESS_EVERY_S:
            self._last_progress = now
            log.info(
                "serve: %d requests (%d events) in %d batches, version %s",
                self.report.requests, self.report.events, self.report.batches, bundle.key,
            )  # fmt: skip

    def _publish(self, messages: Sequence[Any]) -> bool:
        """Send all, flush, and check every acknowledgement; False if any failed."""
        if not messages:
            return True
        started = time.perf_counter()
        topic = self.settings.kafka.topic_recommendations
        try:
            futures = [
                self.producer.send(topic, key=m.kafka_key(), value=m.to_json_bytes())
                for m in messages
            ]
            self.producer.flush(timeout=self.online.publish_timeout_s)
            for future in futures:
                future.get(timeout=self.online.publish_timeout_s)
        except Exception:
            log.exception(
                "publishing %d recommendations failed; the batch will be retried", len(messages)
            )
            metrics.ERRORS.labels(component="online", kind="publish").inc()
            self.report.publish_failures += 1
            return False
        metrics.STAGE_LATENCY.labels(stage="publish").observe(time.perf_counter() - started)
        return True

    def _commit(self, polled: Sequence[_Polled]) -> None:
        offsets = {}
        for partition, last in _last_offsets(polled).items():
            offsets[partition] = OffsetAndMetadata(last + 1, "", -1)
        try:
            self.consumer.commit(offsets)
        except Exception:
            # Published but not committed (e.g. the group rebalanced meanwhile): the new
            # owner answers these events again; consumers dedupe on request_id. One
            # failure is routine; several in a row (e.g. lost permissions on the group)
            # would re-answer everything after a restart, so /healthz turns red.
            log.exception("committing offsets failed; these events may be answered twice")
            metrics.ERRORS.labels(component="online", kind="commit").inc()
            self._commit_failures += 1
            self.report.commit_failures += 1
            return
        self._commit_failures = 0

    def _rewind(self, polled: Sequence[_Polled]) -> None:
        """Seek back to the batch's first offsets so the next poll serves it again."""
        assigned = set(self.consumer.assignment())
        for partition, first in _first_offsets(polled).items():
            if partition in assigned:
                self.consumer.seek(partition, first)
        self.loop.stop_requested.wait(PUBLISH_RETRY_S)

    def _drop_revoked(self, revoked: Sequence[Any]) -> None:
        # Records of a revoked partition are not ours to answer any more: the new
        # owner starts from the last commit, which does not include them.
        revoked = set(revoked)
        kept = []
        for polled in self._pending:
            partition = _partition(polled.record)
            if partition in revoked:
                offset = polled.record.offset
                self._dropped[partition] = min(offset, self._dropped.get(partition, offset))
            else:
                kept.append(polled)
        self._pending[:] = kept

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
        consumer = KafkaConsumer(
            **self.settings.kafka.client_config(),
            group_id=self.online.group_id,
            enable_auto_commit=False,
            auto_offset_reset=self.online.auto_offset_reset,
            max_poll_records=self.online.max_poll_records,
            session_timeout_ms=self.online.session_timeout_ms,
            heartbeat_interval_ms=max(100, self.online.session_timeout_ms // 3),
            max_poll_interval_ms=self.online.max_poll_interval_ms,
        )
        subscribe_when_ready(
            consumer, self.settings.kafka.topic_events, listener=listener,
            timeout_s=self.settings.kafka.topic_wait_s, should_stop=self.loop.stop_requested.is_set,
        )  # fmt: skip
        return consumer

    def _kafka_producer(self) -> Any:
        return KafkaProducer(**self.settings.kafka.client_config(), acks="all", linger_ms=5)


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


def _last_offsets(polled: Sequence[_Polled]) -> dict[Any, int]:
    last: dict[Any, int] = {}
    for p in polled:
        tp = _partition(p.record)
        last[tp] = max(last.get(tp, -1), p.record.offset)
    return last


def _first_offsets(polled: Sequence[_Polled]) -> dict[Any, int]:
    first: dict[Any, int] = {}
    for p in polled:
        tp = _partition(p.record)
        first[tp] = min(first.get(tp, p.record.offset), p.record.offset)
    return first


class _RevokeListener(ConsumerRebalanceListener):
    """Rebalance callbacks (kafka-python calls them inside ``poll``, on the worker's thread)."""

    def __init__(self, worker: OnlineWorker) -> None:
        self.worker = worker

    def on_partitions_revoked(self, revoked: Sequence[Any]) -> None:
        log.info("partitions revoked: %s", sorted(str(tp) for tp in revoked))
        self.worker._drop_revoked(revoked)

    def on_partitions_assigned(self, assigned: Sequence[Any]) -> None:
        log.info("partitions assigned: %s", sorted(str(tp) for tp in assigned))
        self.worker._seek_back_reassigned(assigned)
