"""Publishes refused messages to the dead-letter topic (ingest step), acked before any commit.

Each ``DeadLetter`` goes to ``kafka.topic_dlq`` keyed like the original message,
with a ``reason`` header, so the DLQ can be filtered without parsing JSON.
``publish`` returns only when the broker has acknowledged every letter; while
the broker is away it keeps retrying, because the batch's offsets must not be
committed before its dead letters are safe.

Example::

    >>> publisher = DeadLetterPublisher(get_settings())  # doctest: +SKIP
    >>> publisher.publish([letter])                      # doctest: +SKIP
"""

from __future__ import annotations

import base64
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from genrec.infra.kafka_clients import open_client
from genrec.infra.settings import Settings
from genrec.schemas.events import DeadLetter

log = logging.getLogger("genrec.ingest.dlq")


class DeadLetterPublisher:
    """A lazily created idempotent producer for ``kafka.topic_dlq``."""

    def __init__(self, settings: Settings, producer: Any = None) -> None:
        self.settings = settings
        self.topic = settings.kafka.topic_dlq
        self._producer = producer

    @property
    def producer(self) -> Any:
        if self._producer is None:
            from kafka import KafkaProducer

            self._producer = open_client(
                KafkaProducer,
                self.settings.kafka,
                acks="all",
                enable_idempotence=True,  # a retried send never lands twice
                linger_ms=5,
                reconnect_backoff_max_ms=2000,
            )
        return self._producer

    def publish(
        self, letters: Sequence[DeadLetter], *, stop: threading.Event | None = None
    ) -> None:
        """Send every letter and wait for its ack; retry the unacked ones until all are in."""
        pending = list(letters)
        timeout_s = self.settings.ingest.dlq_timeout_s
        while pending:
            futures = [(letter, self._send(letter)) for letter in pending]
            deadline = time.monotonic() + timeout_s
            failed = []
            for letter, future in futures:
                try:
                    future.get(timeout=max(deadline - time.monotonic(), 0.1))
                except Exception as exc:
                    failed.append(letter)
                    error = exc
            if not failed:
                return
            if stop is not None and stop.is_set():
                raise RuntimeError(f"{len(failed)} dead letters unacked at shutdown: {error}")
            log.warning("%d dead letters not acked (%s); retrying", len(failed), error)
            pending = failed
            time.sleep(1.0)

    def _send(self, letter: DeadLetter) -> Any:
        key = None
        if letter.original_key_base64 is not None:
            key = base64.b64decode(letter.original_key_base64)
        return self.producer.send(
            self.topic,
            key=key,
            value=letter.model_dump_json().encode(),
            headers=[("reason", letter.reason.encode())],
        )

    def close(self) -> None:
        if self._producer is not None:
            self._producer.close(timeout=10)
            self._producer = None
