"""Opening Kafka clients (core services): a cluster that cannot be reached is one clear line.

kafka-python's clients (``KafkaProducer``, ``KafkaConsumer``, ``KafkaAdminClient``)
connect in their constructor; with no broker at the bootstrap address they log
every refused connection for 30 s and then raise ``KafkaTimeoutError`` with a
traceback. Every client genrec opens goes through ``open_client`` instead:

1. it waits, quietly, until one of ``kafka.bootstrap``'s servers accepts a TCP
   connection, for at most ``kafka.connect_timeout_s`` (a warning line every
   5 s, as the wait for a topic does);
2. then it builds the client with that timeout for the Kafka handshake
   (``bootstrap_timeout_ms``); kafka-python's own lines now say what went wrong
   (TLS, SASL, not a broker);
3. if either step times out it raises ``KafkaUnreachableError``, a
   ``UserFacingError`` (also a ``TimeoutError``) whose message names the
   bootstrap address: the entry point prints it as one line and exits with
   code 2. Any other error (a bad option, a bug) keeps its traceback.

Once a client is open, outages are the caller's (``infra/consumer_loop.py`` rides
them out for ingest and serve).

Example::

    >>> from kafka import KafkaProducer
    >>> producer = open_client(KafkaProducer, settings.kafka, acks="all")  # doctest: +SKIP
    >>> wait_for_kafka(settings.kafka, timeout=30)                         # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from typing import Any, TypeVar

from kafka import KafkaAdminClient
from kafka.errors import KafkaError, KafkaTimeoutError

from genrec.infra.errors import UserFacingError
from genrec.infra.settings import KafkaSettings

log = logging.getLogger("genrec.kafka")

WAIT_LOG_S = 5.0  # between "waiting for Kafka" lines
PROBE_EVERY_S = 0.5  # between TCP probes of the bootstrap servers
PROBE_TIMEOUT_S = 2.0  # per connection attempt (a dropped SYN otherwise waits minutes)

Client = TypeVar("Client")


class KafkaUnreachableError(UserFacingError, TimeoutError):
    """No Kafka broker answered at the bootstrap address in time."""


def open_client(client_class: type[Client], kafka: KafkaSettings, **options: Any) -> Client:
    """``client_class(**kafka.client_config(), **options)`` once the cluster is reachable.

    Raises ``KafkaUnreachableError`` when nothing accepts a connection within
    ``kafka.connect_timeout_s``, or the client cannot bootstrap within as long.
    """
    timeout_s = kafka.connect_timeout_s
    wait_for_listener(kafka, timeout_s)
    config = {
        **kafka.client_config(),
        "bootstrap_timeout_ms": max(1, round(timeout_s * 1000)),
        **options,
    }
    try:
        return client_class(**config)
    except KafkaTimeoutError as exc:  # raised by the constructor only when it cannot bootstrap
        raise KafkaUnreachableError(silent_message(kafka, timeout_s, exc)) from exc


def wait_for_listener(kafka: KafkaSettings, timeout_s: float) -> None:
    """Until one bootstrap server accepts a TCP connection; ``KafkaUnreachableError`` after
    ``timeout_s``. A plain socket: kafka-python would log every refused attempt."""
    started = time.monotonic()
    deadline = started + timeout_s
    next_line = started + WAIT_LOG_S
    while not bootstrap_listening(
        kafka, min(PROBE_TIMEOUT_S, max(deadline - time.monotonic(), 0.1))
    ):
        now = time.monotonic()
        if now >= deadline:
            raise KafkaUnreachableError(unreachable_message(kafka, timeout_s))
        if now >= next_line:
            log.warning("waiting for Kafka at %s (%.0f s so far)", kafka.bootstrap, now - started)
            next_line = now + WAIT_LOG_S
        time.sleep(min(PROBE_EVERY_S, max(deadline - now, 0.0)))


def wait_for_kafka(kafka: KafkaSettings, timeout: float) -> None:
    """Until the cluster answers a metadata request; ``KafkaUnreachableError`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while True:
        remaining_s = deadline - time.monotonic()
        if bootstrap_listening(kafka, min(PROBE_TIMEOUT_S, max(remaining_s, 0.1))):
            timeout_ms = min(max(1000, int(remaining_s * 1000)), 10_000)
            config = {
                **kafka.client_config(),
                "bootstrap_timeout_ms": timeout_ms,
                "request_timeout_ms": timeout_ms,
            }
            try:
                with contextlib.closing(KafkaAdminClient(**config)) as admin:
                    admin.list_topics()
                return
            except (KafkaError, OSError) as exc:
                last_error = exc
        else:
            last_error = None  # the latest state decides the message
        if time.monotonic() >= deadline:
            if last_error is None:
                raise KafkaUnreachableError(unreachable_message(kafka, timeout))
            raise KafkaUnreachableError(silent_message(kafka, timeout, last_error))
        time.sleep(PROBE_EVERY_S)


def unreachable_message(kafka: KafkaSettings, timeout_s: float) -> str:
    """Nothing at the address accepted a connection."""
    return (
        f"cannot reach Kafka at {kafka.bootstrap}: nothing accepted a connection within "
        f"{_seconds(timeout_s)}; check kafka.bootstrap (GENREC_KAFKA__BOOTSTRAP) and that the "
        "brokers are up (`genrec kafka up` starts the local one)"
    )


def silent_message(kafka: KafkaSettings, timeout_s: float, error: BaseException | None) -> str:
    """Something accepted connections but never answered as a Kafka broker."""
    cause = f" ({type(error).__name__})" if error is not None else ""
    return (
        f"cannot reach Kafka at {kafka.bootstrap}: it accepts connections but did not answer "
        f"as a Kafka broker within {_seconds(timeout_s)}{cause}; check kafka.bootstrap and "
        "kafka.security_protocol (kafka's warnings above say why)"
    )


def bootstrap_listening(kafka: KafkaSettings, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether any of ``kafka.bootstrap``'s servers accepts a TCP connection now."""
    for server in kafka.client_config()["bootstrap_servers"]:
        host, _, port = server.rpartition(":")
        with contextlib.suppress(OSError, ValueError):
            with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
                return True
    return False


def _seconds(value: float) -> str:
    return f"{value:g} s"
