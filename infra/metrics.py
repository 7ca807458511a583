"""Prometheus metrics and the ``/metrics`` + ``/healthz`` HTTP endpoint (shared by ingest and online).

Every metric genrec exports is defined once, here, at module level, with a
``component`` label (``ingest`` or ``online``) where both steps count the same
thing. A process serves them with ``start_metrics_server(port, health_fn)``:

- ``GET /metrics``: the Prometheus text format (plus the client's process metrics);
- ``GET /healthz``: ``health_fn()`` -> ``(ok, details)``; 200 with JSON when ok, else 503.

Example::

    >>> from genrec.infra import metrics
    >>> server = metrics.start_metrics_server(0, lambda: (True, {"role": "doc"}))
    >>> metrics.EVENTS.labels(component="ingest", outcome="stored").inc()
    >>> import urllib.request
    >>> b"genrec_events_total" in urllib.request.urlopen(server.url + "/metrics").read()
    True
    >>> server.stop()
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from genrec.infra.errors import UserFacingError

log = logging.getLogger(__name__)

HealthFn = Callable[[], tuple[bool, dict[str, Any]]]

# --- shared by ingest and online ----------------------------------------------

EVENTS = Counter(
    "genrec_events_total",
    "User events consumed from Kafka, by what happened to them.",
    ["component", "outcome"],  # ingest: stored|duplicate|dead_lettered; online: consumed|invalid
)
CONSUMER_LAG = Gauge(
    "genrec_consumer_lag",
    "Messages between the consumer's position and the partition's end offset.",
    ["component", "topic", "partition"],
)
ERRORS = Counter(
    "genrec_errors_total",
    "Errors by where they happened (the process keeps running unless stated in logs).",
    ["component", "kind"],
)

# --- online worker ----------------------------------------------------------------

REQUEST_LATENCY = Histogram(
    "genrec_request_latency_seconds",
    "From receiving a request's event to its recommendation being acknowledged by Kafka.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
STAGE_LATENCY = Histogram(
    "genrec_stage_latency_seconds",
    "Time per micro-batch spent in each serving stage.",
    # gather (first event to hand-over), history, prefix_kv, branches (the consumer's
    # thread); queue (prepared, waiting for the decode thread), generative (per decoding
    # call), merge, serialise (the decode thread); publish (first send to last
    # acknowledgement, on the producer's I/O thread).
    ["stage"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0),
)
BATCH_USERS = Histogram(
    "genrec_batch_users",
    "Requests (distinct users) per decoding call (at most online.max_batch_users).",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
)
REQUESTS = Counter(
    "genrec_requests_total",
    "Recommendation requests published, by how the generative list was produced.",
    ["path"],  # prefix_kv|full_prompt|no_generative
)
DECODE_BATCHES = Counter(
    "genrec_decode_batches_total",
    "Micro-batches decoded, by decoding mode (online.mode auto alternates strict and target "
    "while it times them, then serves the faster).",
    ["mode"],  # strict|relaxed|target
)
TARGET_CALLS = Histogram(
    "genrec_target_calls_per_request",
    "Target-model forward calls per request (a batch's calls are shared by its requests).",
    buckets=(0, 1, 2, 3, 4, 5, 6, 8, 10, 15, 20),
)
ACCEPTANCE_RATE = Histogram(
    "genrec_draft_acceptance_rate",
    "Share of drafted tokens the target accepted, per micro-batch.",
    buckets=(0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0),
)
FALLBACKS = Counter(
    "genrec_fallbacks_total",
    "Requests served on a degraded path.",
    # no_prefix_kv|kv_store_unavailable|prompt_limit|target_only|generative_error|branch_error|empty_history
    ["reason"],
)
PREFIX_KV_LOOKUPS = Counter(
    "genrec_prefix_kv_lookups_total",
    "Prefix KV lookups by where they were answered.",
    # memory|store|miss|unavailable (the KV store unreachable: served from the prompt);
    # served: decoded from the KV of the user's previous prompt (online.served_prompts)
    ["result"],
)
HISTORY_READS = Counter(
    "genrec_history_reads_total",
    "Users' store histories read per request, by how (online.history_cache_events).",
    ["read"],  # full|incremental (only the rows stored since the user's last read)
)
SERVING_VERSION = Gauge(
    "genrec_serving_version_info",
    "1 for the serving version in use (labels name it).",
    ["model_version", "semantic_id_version", "kv_version"],
)
VERSION_SWITCHES = Counter(
    "genrec_version_switches_total", "Times the worker switched to a newly activated version."
)


class MetricsServer:
    """A tiny threaded HTTP server for ``/metrics`` and ``/healthz``; ``stop()`` closes it."""

    def __init__(
        self,
        port: int,
        health_fn: HealthFn | None = None,
        host: str = "0.0.0.0",
        registry: CollectorRegistry = REGISTRY,
    ) -> None:
        handler = _make_handler(health_fn or (lambda: (True, {})), registry)
        self._server = ThreadingHTTPServer((host, port), handler)
        self._server.daemon_threads = True
        self.host = host
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="genrec-metrics", daemon=True
        )
        self._thread.start()

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def start_metrics_server(
    port: int, health_fn: HealthFn | None = None, host: str = "0.0.0.0"
) -> MetricsServer:
    """Serve ``/metrics`` and ``/healthz`` on ``port`` (0 picks a free one) in a daemon thread."""
    try:
        server = MetricsServer(port, health_fn, host)
    except OSError as exc:
        raise UserFacingError(
            f"cannot serve metrics on {host}:{port} ({exc}); pick another port "
            "(each process on a host needs its own) or 0 for a free one"
        ) from exc
    log.info("metrics on %s/metrics, health on %s/healthz", server.url, server.url)
    return server


def record_lag(component: str, consumer: Any, partitions: Iterable[Any] | None = None) -> int:
    """Set ``genrec_consumer_lag`` from a kafka-python consumer's highwater and position.

    Uses the highwater marks that fetch responses already carried, so it costs
    no extra request; partitions without one yet are skipped. Returns the total.
    """
    total = 0
    for tp in partitions if partitions is not None else consumer.assignment():
        highwater = consumer.highwater(tp)
        if highwater is None:
            continue
        try:
            position = consumer.position(tp, timeout_ms=0)
        except Exception:  # no position yet (e.g. mid-rebalance)
            continue
        if position is None:
            continue
        lag = max(0, highwater - position)
        CONSUMER_LAG.labels(component=component, topic=tp.topic, partition=str(tp.partition)).set(
            lag
        )
        total += lag
    return total


def _make_handler(health_fn: HealthFn, registry: CollectorRegistry) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._send(200, generate_latest(registry), CONTENT_TYPE_LATEST)
            elif path == "/healthz":
                try:
                    ok, details = health_fn()
                except Exception as exc:  # a broken check means unhealthy
                    ok, details = False, {"error": repr(exc)}
                body = json.dumps({"ok": ok, **details}, default=str).encode()
                self._send(200 if ok else 503, body, "application/json")
            else:
                self._send(404, b"not found: try /metrics or /healthz\n", "text/plain")

        def _send(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # scrapes are noise
            return

    return Handler
