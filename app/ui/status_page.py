"""The status page's content: the serving version, and what the workers' metrics say.

Reads ``ui.metrics_urls`` (each worker's and ingest's Prometheus ``/metrics``)
at every page load, sums them over processes, and keeps the previous scrape so
that rates and latency percentiles cover the time since the last load ("recent")
as well as each process's lifetime. A process that does not answer is listed,
not fatal.

Example::

    >>> status = status_view(live, settings, scrapes)      # doctest: +SKIP
    >>> status.recent["requests_per_s"]
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
import urllib.request
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from genrec.app.ui.serving import LiveVersion
from genrec.infra.serving_versions import active_serving_version
from genrec.infra.settings import Settings

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]  # (name, labels) -> value
LATENCY = "genrec_request_latency_seconds"


@dataclass
class Scrape:
    at: float  # time.monotonic()
    samples: Samples
    reached: list[str]
    unreachable: list[str]


@dataclass
class StatusView:
    active: dict[str, Any] | None  # the store's active serving version row
    loaded: dict[str, Any] | None  # what this explorer loaded (ServingBundle.describe)
    reached: list[str]
    unreachable: list[str]
    lifetime: dict[str, Any] = field(default_factory=dict)
    recent: dict[str, Any] = field(default_factory=dict)  # since the previous page load
    serving_versions: list[dict[str, str]] = field(default_factory=list)  # workers' labels


class Scrapes:
    """The last scrape of the metrics endpoints (rates need two)."""

    def __init__(self) -> None:
        self.last: Scrape | None = None
        self.lock = threading.Lock()

    def take(self, settings: Settings) -> tuple[Scrape, Scrape | None]:
        """A new scrape and the one before it (None on the first)."""
        now = scrape(settings.ui.metrics_urls, settings.ui.metrics_timeout_s)
        with self.lock:
            previous, self.last = self.last, now
        return now, previous


def scrape(urls, timeout_s: float) -> Scrape:
    """Every endpoint's samples, summed over endpoints (counters and histograms add up)."""
    samples: Samples = defaultdict(float)
    reached, unreachable = [], []
    for url in urls:
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310
                text = response.read().decode()
        except (OSError, ValueError) as exc:
            unreachable.append(f"{url} ({type(exc).__name__})")
            continue
        reached.append(url)
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                samples[(sample.name, tuple(sorted(sample.labels.items())))] += sample.value
    return Scrape(time.monotonic(), dict(samples), reached, unreachable)


def status_view(live: LiveVersion, settings: Settings, scrapes: Scrapes) -> StatusView:
    """The serving version and the workers' figures, lifetime and since the last load."""
    active = active_serving_version(live.engine)
    bundle = live.bundle()
    now, previous = scrapes.take(settings)
    view = StatusView(
        dataclasses.asdict(active) if active is not None else None,
        bundle.describe() if bundle is not None else None,
        now.reached, now.unreachable,
    )  # fmt: skip
    view.lifetime = summarise(now.samples, None)
    if previous is not None and now.at > previous.at:
        view.recent = summarise(_minus(now.samples, previous.samples), now.at - previous.at)
    view.serving_versions = [
        dict(labels)
        for (name, labels), value in now.samples.items()
        if name == "genrec_serving_version_info" and value > 0
    ]
    return view


def summarise(samples: Samples, seconds: float | None) -> dict[str, Any]:
    """Requests, latency percentiles, target calls, acceptance, fallbacks and decoding
    modes from ``samples`` (rates per second when ``seconds`` is given)."""
    requests = _by_label(samples, "genrec_requests_total", "path")
    total = sum(requests.values())
    figures: dict[str, Any] = {"requests": total, "requests_by_path": requests}
    if seconds:
        figures["requests_per_s"] = total / seconds
    for q in (0.5, 0.95, 0.99):
        figures[f"p{round(q * 100)}_ms"] = _quantile(samples, LATENCY, q) * 1000.0
    figures["target_calls_per_request"] = _mean(samples, "genrec_target_calls_per_request")
    figures["acceptance"] = _mean(samples, "genrec_draft_acceptance_rate")
    figures["fallbacks"] = _by_label(samples, "genrec_fallbacks_total", "reason")
    modes = _by_label(samples, "genrec_decode_batches_total", "mode")
    figures["batches_by_mode"] = modes
    # what ``online.mode = auto`` serves: the mode of most batches in the window
    figures["serving_mode"] = max(modes, key=modes.get) if any(modes.values()) else None
    figures["prefix_kv_lookups"] = _by_label(samples, "genrec_prefix_kv_lookups_total", "result")
    figures["events"] = _by_label(samples, "genrec_events_total", "component", "outcome")
    return figures


def _minus(now: Samples, before: Samples) -> Samples:
    return {key: value - before.get(key, 0.0) for key, value in now.items()}


def _by_label(samples: Samples, name: str, *label: str) -> dict[str, float]:
    """Sample ``name`` summed by the value(s) of ``label`` ("a/b" for two)."""
    values: dict[str, float] = defaultdict(float)
    for (sample, labels), value in samples.items():
        if sample == name:
            found = dict(labels)
            values["/".join(found.get(part, "") for part in label)] += value
    return dict(values)


def _mean(samples: Samples, histogram: str) -> float:
    count = sum(v for (n, _), v in samples.items() if n == f"{histogram}_count")
    total = sum(v for (n, _), v in samples.items() if n == f"{histogram}_sum")
    return total / count if count else math.nan


def _quantile(samples: Samples, histogram: str, q: float) -> float:
    """The ``q`` quantile of a histogram, linear within its bucket (Prometheus's rule)."""
    buckets: dict[float, float] = defaultdict(float)
    for (name, labels), value in samples.items():
        if name == f"{histogram}_bucket":
            buckets[float(dict(labels)["le"])] += value
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return math.nan
    rank, lower, below = q * buckets[bounds[-1]], 0.0, 0.0
    for bound in bounds:
        if buckets[bound] >= rank:
            if math.isinf(bound):
                return lower  # beyond the last finite bucket: its bound is all we know
            inside = buckets[bound] - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = bound, buckets[bound]
    return lower
