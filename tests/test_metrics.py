"""The shared /metrics + /healthz endpoint (infra/metrics.py)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from genrec.infra import metrics


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_metrics_and_health_endpoints() -> None:
    healthy = {"ok": True}
    server = metrics.start_metrics_server(0, lambda: (healthy["ok"], {"role": "test"}), "127.0.0.1")
    try:
        metrics.EVENTS.labels(component="online", outcome="consumed").inc()
        metrics.REQUEST_LATENCY.observe(0.02)
        metrics.FALLBACKS.labels(reason="no_prefix_kv").inc()
        status, body = _get(server.url + "/metrics")
        assert status == 200
        text = body.decode()
        for name in (
            "genrec_events_total",
            "genrec_request_latency_seconds_bucket",
            "genrec_target_calls_per_request",
            "genrec_draft_acceptance_rate",
            "genrec_fallbacks_total",
            "genrec_errors_total",
            "genrec_consumer_lag",
        ):
            assert name in text, name
        status, body = _get(server.url + "/healthz")
        assert status == 200 and json.loads(body) == {"ok": True, "role": "test"}
        healthy["ok"] = False
        status, _ = _get(server.url + "/healthz")
        assert status == 503
        assert _get(server.url + "/nope")[0] == 404
    finally:
        server.stop()


def test_health_check_that_raises_is_unhealthy() -> None:
    def broken():
        raise RuntimeError("db down")

    server = metrics.start_metrics_server(0, broken, "127.0.0.1")
    try:
        status, body = _get(server.url + "/healthz")
        assert status == 503 and "db down" in json.loads(body)["error"]
    finally:
        server.stop()


def test_port_in_use_is_a_clear_error() -> None:
    from genrec.infra.errors import UserFacingError

    server = metrics.start_metrics_server(0, host="127.0.0.1")
    try:
        try:
            metrics.start_metrics_server(server.port, host="127.0.0.1")
        except UserFacingError as exc:
            assert "pick another port" in str(exc)
        else:
            raise AssertionError("binding a used port must fail")
    finally:
        server.stop()


class _FakeConsumer:
    def __init__(self, highwater: dict, position: dict) -> None:
        self._highwater, self._position = highwater, position

    def assignment(self):
        return set(self._highwater)

    def highwater(self, tp):
        return self._highwater[tp]

    def position(self, tp, timeout_ms=None):
        return self._position[tp]


def test_record_lag_sums_partitions_and_skips_unknown() -> None:
    from kafka.structs import TopicPartition

    a, b, c = (TopicPartition("t-lag", i) for i in range(3))
    consumer = _FakeConsumer({a: 10, b: 5, c: None}, {a: 4, b: 5, c: 0})
    assert metrics.record_lag("online", consumer) == 6
    sample = metrics.CONSUMER_LAG.labels(component="online", topic="t-lag", partition="0")
    assert sample._value.get() == 6
