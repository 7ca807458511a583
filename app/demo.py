"""``genrec demo``: the whole system on embedded defaults, start to finish, on one machine.

1. start the local Kafka broker and create the topics;
2. replay the first 80% of MovieLens-100K (by time) and ingest it;
3. run one offline refresh with the ``small`` preset (semantic IDs, target and
   drafts, recall branches, every user's prefix KV) and activate it;
4. start ``genrec ingest`` and ``genrec serve`` as their own processes, replay
   the last 20% at a steady rate, and consume ``genrec.recommendations``;
5. print online prequential figures (``genrec.app.prequential``): hit rate
   @10 of the merged list and of each branch, event-to-recommendation latency
   and recommendations per second.

Each step is the code the individual commands run. The demo keeps its store
and artifacts in ``DATA_DIR/demo`` and starts that folder afresh each time, so
a second run measures the same thing as the first (the topics and the broker
are shared and left running; ``genrec kafka down`` stops the broker).

Example::

    $ genrec demo --json var/demo.json
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import func, select

from genrec.app.demo_online import serve_and_measure
from genrec.app.kafka_broker import KafkaBroker
from genrec.app.services import skip_group_to_end
from genrec.infra.database import make_engine
from genrec.infra.kafka_clients import wait_for_kafka
from genrec.infra.settings import Settings
from genrec.infra.topics import create_topics
from genrec.ingest.consumer import Ingestor
from genrec.ingest.replay import replay_ml100k
from genrec.offline.refresh import run_refresh
from genrec.schemas.tables import events, items, users

log = logging.getLogger("genrec.demo")

SPLIT_FRACTION = 0.8


@dataclass
class DemoReport:
    bootstrap: str = ""
    events_produced: int = 0
    events_stored: int = 0
    ingest_rate: float = 0.0
    store_counts: dict[str, int] = field(default_factory=dict)
    refresh: dict[str, Any] = field(default_factory=dict)
    online: dict[str, Any] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)


def demo_settings(settings: Settings) -> Settings:
    """The demo's own store and artifacts under ``DATA_DIR/demo``, emptied first."""
    folder = settings.data_dir / "demo"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    return settings.model_copy(
        update={"data_dir": folder, "database_url": f"sqlite:///{folder / 'genrec.db'}"}
    )


def start_kafka(settings: Settings) -> str:
    """Local broker up (idempotent) and topics created; returns the bootstrap address."""
    broker = KafkaBroker.from_settings(settings)
    bootstrap = broker.up(timeout=settings.kafka_broker.start_timeout_s)
    wait_for_kafka(settings.kafka, timeout=60)
    create_topics(settings.kafka)
    return bootstrap


def ingest_until_idle(settings: Settings, idle_s: float = 5.0) -> tuple[int, float]:
    """Stored events and the rate from first event to last write."""
    stats = Ingestor(settings).run(exit_when_idle_s=idle_s, progress_every_s=5.0)
    active = (stats.last_store_at or 0.0) - (stats.first_event_at or 0.0)
    return stats.events_stored, stats.events_stored / active if active > 0 else 0.0


def count_store(settings: Settings) -> dict[str, int]:
    engine = make_engine(str(settings.database_url))
    with engine.connect() as connection:
        counts = {
            table.name: connection.execute(select(func.count()).select_from(table)).scalar_one()
            for table in (events, users, items)
        }
    engine.dispose()
    return counts


def refresh_once(settings: Settings) -> dict[str, Any]:
    engine = make_engine(str(settings.database_url))
    report = run_refresh(settings, engine, trigger="demo")
    engine.dispose()
    return {
        "serving_version": report.serving_version,
        "model_version": report.model_version,
        "semantic_id_version": report.semantic_id_version,
        "step_seconds": report.counts.get("step_seconds", {}),
    }


def run_demo(settings: Settings, json_path: Path | None = None, rate: float = 100.0) -> DemoReport:
    report = DemoReport()
    clock = time.monotonic()
    report.bootstrap = start_kafka(settings)
    settings = demo_settings(settings)
    print(f"kafka: broker ready at {report.bootstrap}; demo data in {settings.data_dir}")
    skip_group_to_end(settings, settings.ingest.group_id, settings.kafka.topic_events)
    report.events_produced = replay_ml100k(settings, end=SPLIT_FRACTION)
    report.events_stored, report.ingest_rate = ingest_until_idle(settings)
    report.store_counts = count_store(settings)
    print(
        f"ingest: {report.events_stored:,} of the first {SPLIT_FRACTION:.0%} of ML-100K stored "
        f"at {report.ingest_rate:,.0f} events/s; store: {report.store_counts}"
    )
    report.seconds["kafka_replay_ingest"] = round(time.monotonic() - clock, 1)

    clock = time.monotonic()
    report.refresh = refresh_once(settings)
    report.seconds["offline_refresh"] = round(time.monotonic() - clock, 1)
    print(f"offline refresh: {report.refresh} in {report.seconds['offline_refresh']:.0f} s")

    clock = time.monotonic()
    report.online = serve_and_measure(settings, rate=rate, start=SPLIT_FRACTION)
    report.seconds["online"] = round(time.monotonic() - clock, 1)
    print_online(report.online)
    report.store_counts = count_store(settings)
    print(f"store: {report.store_counts} (the ingest process stored the replayed 20% too)")
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report_json(report), indent=2))
    return report


def report_json(report: DemoReport) -> dict[str, Any]:
    online = report.online
    return {
        "hit_rate_at_10": online.get("hit_rate_at_10", {}),
        "latency_ms": online.get("latency_ms", {}),
        "recs_per_s": online.get("recs_per_s", 0.0),
        "events_evaluated": online.get("events_evaluated", 0),
        "events_replayed": online.get("events_replayed", 0),
        "recommendations": online.get("recommendations", 0),
        "ingest": {"events_stored": report.events_stored, "events_per_s": report.ingest_rate},
        "store_counts": report.store_counts,
        "refresh": report.refresh,
        "seconds": report.seconds,
    }


def print_online(online: dict[str, Any]) -> None:
    rates = online.get("hit_rate_at_10", {})
    print(
        f"online: {online.get('recommendations', 0):,} recommendations for "
        f"{online.get('events_replayed', 0):,} replayed events; "
        f"{online.get('events_evaluated', 0):,} events scored against the list published "
        "after the user's previous event"
    )
    for name in sorted(rates, key=lambda n: (n != "merged", n)):
        print(f"  hit rate @10  {name:<11} {rates[name]:.4f}")
    latency = online.get("latency_ms", {})
    if latency.get("p50") is not None:
        print(f"  latency event -> recommendation: p50 {latency['p50']:.0f} ms, "
              f"p99 {latency['p99']:.0f} ms; {online.get('recs_per_s', 0):.1f} recommendations/s")  # fmt: skip
