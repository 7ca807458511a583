"""``genrec demo``: the whole system on embedded defaults, start to finish, on one machine.

Steps: start the local Kafka broker, create the topics, replay MovieLens-100K
into ``genrec.user-events``, ingest until idle, then print what the store holds
and how fast it got there. Each step is the same code the individual commands
run; the demo only strings them together.

Example::

    $ genrec demo --json var/demo.json
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from sqlalchemy import func, select

from genrec.infra.settings import Settings

log = logging.getLogger("genrec.demo")


@dataclass
class DemoReport:
    bootstrap: str = ""
    events_produced: int = 0
    replay_seconds: float = 0.0
    events_stored: int = 0
    events_rejected: int = 0
    ingest_seconds: float = 0.0
    store_counts: dict[str, int] = field(default_factory=dict)

    @property
    def ingest_rate(self) -> float:
        return self.events_stored / self.ingest_seconds if self.ingest_seconds else 0.0


def start_kafka(settings: Settings) -> str:
    """Local broker up (idempotent) and topics created; returns the bootstrap address."""
    from genrec.infra.kafka_broker import KafkaBroker
    from genrec.infra.topics import create_topics, wait_for_kafka

    bootstrap = KafkaBroker.from_settings(settings).up(
        timeout=settings.kafka_broker.start_timeout_s
    )
    wait_for_kafka(settings.kafka, timeout=60)
    create_topics(settings.kafka)
    return bootstrap


def replay_ml100k(settings: Settings, report: DemoReport, **window) -> None:
    from genrec.ingest import replay

    replay.load_items(settings, replay.ml100k_items())
    result = replay.replay_events(
        settings, replay.ml100k_events(), event_id_prefix="ml-100k", **window
    )
    report.events_produced += result.produced
    report.replay_seconds += result.seconds


def ingest_until_idle(settings: Settings, report: DemoReport, idle_s: float = 5.0) -> None:
    from genrec.ingest.consumer import Ingestor

    ingestor = Ingestor(settings)
    began = time.monotonic()
    stats = ingestor.run(exit_when_idle_s=idle_s, progress_every_s=5.0)
    active = (stats.last_store_at or time.monotonic()) - (stats.first_event_at or began)
    report.events_stored += stats.events_stored
    report.events_rejected += stats.events_rejected
    report.ingest_seconds += max(active, 1e-9)


def count_store(settings: Settings) -> dict[str, int]:
    from genrec.infra.database import make_engine
    from genrec.schemas.tables import events, items, users

    engine = make_engine(str(settings.database_url))
    with engine.connect() as connection:
        counts = {
            table.name: connection.execute(select(func.count()).select_from(table)).scalar_one()
            for table in (events, users, items)
        }
    engine.dispose()
    return counts


def run_demo(settings: Settings, json_path: Path | None = None) -> DemoReport:
    report = DemoReport()
    report.bootstrap = start_kafka(settings)
    print(f"kafka: broker ready at {report.bootstrap}, topics created")
    replay_ml100k(settings, report)
    print(f"replay: {report.events_produced:,} ML-100K events in {report.replay_seconds:.1f} s")
    ingest_until_idle(settings, report)
    report.store_counts = count_store(settings)
    print(
        f"ingest: {report.events_stored:,} new events stored, {report.events_rejected:,} "
        f"rejected, {report.ingest_rate:,.0f} events/s"
    )
    counts = report.store_counts
    print(
        f"store: {counts['events']:,} events, {counts['users']:,} users, "
        f"{counts['items']:,} items in {settings.database_url}"
    )
    if json_path is not None:
        payload = {**asdict(report), "ingest_rate": report.ingest_rate}
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(payload, indent=2))
    return report
