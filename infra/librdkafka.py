"""A Kafka producer over librdkafka (core services): the online worker's at-least-once publisher.

kafka-python builds, sends and acknowledges every produce request in Python, on two
threads of its own (the sender and the network loop) that contend with the decoding
thread for the GIL: 10-12% of a worker's CPU at 50-100 events/s on the 2-core CPU
(py-spy, docs/online.md), for one ~3 KB message a request. librdkafka
(``confluent-kafka``) does that work in C threads that need no GIL; Python only hands
it the message and, on a thread of ours, runs the delivery callbacks.

``LibrdkafkaProducer`` offers the part of ``kafka.KafkaProducer`` the worker uses:
``send(topic, key=, value=)`` returning a future with ``add_callback`` /
``add_errback``, ``flush`` and ``close``. Settings are ``KafkaSettings.librdkafka_config``
(the same bootstrap, SASL and TLS options as every other client; secrets never logged).
Idempotent with ``acks=all``, as the kafka-python producer it replaces. Exactly-once
serving keeps kafka-python's transactional producer: a transaction's offsets carry the
consumer's group metadata, which only the same library's consumer gives.

Example::

    producer = LibrdkafkaProducer(settings.kafka)
    future = producer.send("genrec.recommendations", key=b"7", value=b"{...}")
    future.add_callback(lambda metadata: ...)
    future.add_errback(lambda error: ...)
    producer.close()
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from genrec.infra.kafka_clients import KafkaUnreachableError, silent_message, wait_for_listener
from genrec.infra.settings import KafkaSettings

log = logging.getLogger("genrec.kafka")

REPORTS_POLL_S = 0.05  # the delivery thread's longest wait in librdkafka (C, GIL released)
FULL_QUEUE_RETRY_S = 0.01  # a full local queue: serve reports, then try the message again
CLOSE_TIMEOUT_S = 30.0  # a close waits this long for queued messages (a broker away: no hang)


class ProduceFailed(Exception):
    """librdkafka could not deliver a message (its error's text)."""


class Delivery:
    """The future of one message: callbacks run once it is acknowledged or failed (on the
    delivery thread; at once when added after that)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[Any], None]] = []
        self._errbacks: list[Callable[[BaseException], None]] = []
        self._outcome: tuple[bool, Any] | None = None

    def add_callback(self, fn: Callable[[Any], None]) -> Delivery:
        self._add(fn, on_success=True)
        return self

    def add_errback(self, fn: Callable[[BaseException], None]) -> Delivery:
        self._add(fn, on_success=False)
        return self

    def _add(self, fn: Callable, on_success: bool) -> None:
        with self._lock:
            if self._outcome is None:
                (self._callbacks if on_success else self._errbacks).append(fn)
                return
            succeeded, value = self._outcome
        if succeeded == on_success:
            fn(value)

    def report(self, error: Any, message: Any) -> None:
        """librdkafka's delivery report for this message."""
        outcome = (True, message) if error is None else (False, ProduceFailed(str(error)))
        with self._lock:
            self._outcome = outcome
            callbacks = self._callbacks if outcome[0] else self._errbacks
            self._callbacks, self._errbacks = [], []
        for fn in callbacks:
            try:
                fn(outcome[1])
            except Exception:  # a callback's bug must not stop the delivery thread
                log.exception("a delivery callback failed")


class LibrdkafkaProducer:
    """Idempotent ``acks=all`` producer with kafka-python's ``send``/``close`` shape."""

    def __init__(
        self, kafka: KafkaSettings, *, linger_ms: int = 0, max_block_s: float = 60.0
    ) -> None:
        from confluent_kafka import KafkaException, Producer

        wait_for_listener(kafka, kafka.connect_timeout_s)
        config = {
            **kafka.librdkafka_config(),
            "acks": "all",
            "enable.idempotence": True,
            "linger.ms": linger_ms,
            "delivery.timeout.ms": 120_000,  # kafka-python's default, which it replaces
        }
        self._producer = Producer(config, logger=logging.getLogger("genrec.kafka.librdkafka"))
        try:  # a metadata round trip: TLS, SASL or "not a broker" fail here, not later
            self._producer.list_topics(timeout=kafka.connect_timeout_s)
        except KafkaException as exc:
            raise KafkaUnreachableError(
                silent_message(kafka, kafka.connect_timeout_s, exc)
            ) from exc
        self.max_block_s, self.connect_timeout_s = max_block_s, kafka.connect_timeout_s
        self._stopping = threading.Event()
        self._reports = threading.Thread(
            target=self._serve_reports, name="librdkafka-deliveries", daemon=True
        )
        self._reports.start()

    def send(self, topic: str, key: bytes | None = None, value: bytes | None = None) -> Delivery:
        """Queue one message; a local queue full for ``max_block_s`` raises ``BufferError``."""
        delivery = Delivery()
        deadline = time.monotonic() + self.max_block_s
        while True:
            try:
                self._producer.produce(topic, value=value, key=key, on_delivery=delivery.report)
                return delivery
            except BufferError:
                if time.monotonic() >= deadline:
                    raise
                self._producer.poll(FULL_QUEUE_RETRY_S)

    def partitions_for(self, topic: str) -> set[int]:
        """The topic's partition ids (a metadata request; empty for an unknown topic)."""
        metadata = self._producer.list_topics(topic, timeout=self.connect_timeout_s)
        found = metadata.topics.get(topic)
        return set() if found is None or found.error is not None else set(found.partitions)

    def flush(self, timeout: float | None = None) -> int:
        """Wait for every queued message's report; returns how many are still queued."""
        return self._producer.flush(-1 if timeout is None else timeout)

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Deliver what is queued (up to ``timeout`` s; the rest are never acknowledged, so their
        offsets stay uncommitted and are served again), then stop the delivery thread."""
        left = self.flush(timeout)
        if left:
            log.warning("producer closed with %d messages undelivered", left)
        self._stopping.set()
        self._reports.join()

    def _serve_reports(self) -> None:
        while not self._stopping.is_set():
            self._producer.poll(REPORTS_POLL_S)
