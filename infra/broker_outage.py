"""Polling through a broker outage (infra; used by the ingest and online consumer loops).

kafka-python 3.0 lets some connection errors out of ``KafkaConsumer.poll`` while
the broker is away: a group-coordinator lookup that fails to connect is followed
by a metadata refresh, and when that refresh cannot connect either its error
is raised to the caller. The consumer itself is fine and reconnects once the
broker is back, so a service must neither die on such an error (a restart of
the whole process would not bring the broker back sooner) nor spin on it.

``OutagePoll.poll`` turns a *retriable* Kafka error into an empty poll after a
short back-off that grows to ``max_backoff_s``, logs the outage when it starts
and then every ``log_every_s``, and logs how long it lasted once a poll works
again. Errors that retrying cannot fix (authorization, configuration) are
raised as they are.

Example::

    >>> guard = OutagePoll("ingest")
    >>> batch = guard.poll(consumer, timeout_ms=1000)  # doctest: +SKIP
    >>> guard.outage_s()  # 0.0 while the broker answers
    0.0
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from kafka.errors import KafkaError

from genrec.infra import metrics

log = logging.getLogger("genrec.kafka")


class OutagePoll:
    """Wraps ``consumer.poll`` for one service loop; not thread-safe (neither is the consumer)."""

    def __init__(
        self,
        component: str,
        *,
        stop: threading.Event | None = None,
        first_backoff_s: float = 0.5,
        max_backoff_s: float = 5.0,
        log_every_s: float = 30.0,
    ) -> None:
        self.component = component
        self._stop = stop or threading.Event()
        self.first_backoff_s = first_backoff_s
        self.max_backoff_s = max_backoff_s
        self.log_every_s = log_every_s
        self.errors = 0  # retriable poll errors since the process started
        self._since: float | None = None  # when the current outage began
        self._backoff_s = first_backoff_s
        self._logged_at = 0.0

    def poll(self, consumer: Any, **poll_kwargs: Any) -> dict[Any, list[Any]]:
        """``consumer.poll(**poll_kwargs)``; ``{}`` after a back-off if the broker is away."""
        try:
            batch = consumer.poll(**poll_kwargs)
        except KafkaError as exc:
            if not getattr(exc, "retriable", False):
                raise
            self._on_error(exc)
            return {}
        if self._since is not None:
            log.info("%s: Kafka answers again after %.0f s", self.component, self.outage_s())
            self._since = None
            self._backoff_s = self.first_backoff_s
        return batch

    def outage_s(self) -> float:
        """Seconds since the first failed poll of the current outage (0.0 when none)."""
        return 0.0 if self._since is None else time.monotonic() - self._since

    def _on_error(self, exc: KafkaError) -> None:
        now = time.monotonic()
        self.errors += 1
        metrics.ERRORS.labels(component=self.component, kind="kafka_poll").inc()
        if self._since is None:
            self._since = self._logged_at = now
            log.warning(
                "%s: Kafka poll failed (%s); retrying until the broker is back",
                self.component, exc,
            )  # fmt: skip
        elif now - self._logged_at >= self.log_every_s:
            self._logged_at = now
            log.warning(
                "%s: Kafka unreachable for %.0f s (%s); still retrying",
                self.component, now - self._since, type(exc).__name__,
            )  # fmt: skip
        # An Event wait, not sleep: SIGTERM (which sets ``stop``) ends the back-off at once.
        self._stop.wait(self._backoff_s)
        self._backoff_s = min(self._backoff_s * 2, self.max_backoff_s)
