"""``genrec replay`` end to end: MovieLens-100K and a CSV/Parquet log through Kafka into the store."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from sqlalchemy import select

from genrec.infra.database import make_engine
from genrec.infra.settings import Settings
from genrec.ingest.consumer import Ingestor
from genrec.schemas.tables import events, items

pytestmark = pytest.mark.integration

GENREC = Path(sys.executable).parent / "genrec"


def run_genrec(kafka_settings, database_url: str, home: Path, *args: str) -> str:
    env = {
        **os.environ,
        "GENREC_HOME": str(home),
        "GENREC_DATABASE_URL": database_url,
        "GENREC_KAFKA__BOOTSTRAP": kafka_settings.bootstrap,
        "GENREC_KAFKA__TOPIC_EVENTS": kafka_settings.topic_events,
        "GENREC_KAFKA__TOPIC_DLQ": kafka_settings.topic_dlq,
    }
    done = subprocess.run(
        [str(GENREC), *args], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_replay_ml100k_window_keeps_the_store_order(
    kafka_settings, database_url, tmp_path, ml100k_engine
):
    out = run_genrec(
        kafka_settings, database_url, tmp_path, "replay", "--dataset", "ml-100k", "--end", "0.05"
    )
    assert "5,000 produced" in out and "1,682 upserted" in out
    settings = Settings(home=tmp_path, database_url=database_url, kafka=kafka_settings)
    assert Ingestor(settings).run(exit_when_idle_s=3).events_stored == 5000

    order = select(events.c.event_id, events.c.user_id, events.c.ts_ms, events.c.value).order_by(
        events.c.user_id, events.c.ts_ms, events.c.id
    )
    engine = make_engine(database_url)
    with engine.connect() as connection:
        replayed = connection.execute(order).all()
        catalog = dict(connection.execute(select(items.c.item_id, items.c.title)).all())
    engine.dispose()
    with ml100k_engine.connect() as connection:
        reference = connection.execute(
            order.where(events.c.event_id.in_([r.event_id for r in replayed]))
        ).all()
    assert [tuple(r) for r in replayed] == [tuple(r) for r in reference]  # same ids, same tie order
    assert len(catalog) == 1682 and catalog["1"].startswith("Toy Story")


def test_replay_any_file_with_items_and_options(kafka_settings, tmp_path):
    url = f"sqlite:///{tmp_path / 'store.db'}"
    log = tmp_path / "clicks.csv"
    pd.DataFrame(
        {
            "user_id": ["a", "b", "a", "c", "b"],
            "item_id": ["x", "y", "z", "x", "x"],
            "timestamp": [
                "2024-01-01T00:00:03Z",
                "2024-01-01T00:00:01Z",
                "2024-01-01T00:00:01Z",
                "2024-01-01T00:00:09Z",
                "2024-01-01T00:00:05Z",
            ],
            "event_type": ["view", "click", "view", "purchase", "cart"],
        }
    ).to_csv(log, index=False)
    catalog = tmp_path / "items.parquet"
    pd.DataFrame({"item_id": ["x", "y", "z"], "brand": ["acme", "", "zed"]}).to_parquet(catalog)
    out = run_genrec(
        kafka_settings,
        url,
        tmp_path,
        "replay",
        "--events",
        str(log),
        "--items",
        str(catalog),
        "--start",
        "2024-01-01T00:00:02Z",
        "--limit",
        "2",
        "--rate",
        "100",
    )
    assert "2 produced" in out
    settings = Settings(home=tmp_path, database_url=url, kafka=kafka_settings)
    Ingestor(settings).run(exit_when_idle_s=3)
    engine = make_engine(url)
    with engine.connect() as connection:
        stored = connection.execute(
            select(events.c.event_id, events.c.event_type).order_by(events.c.ts_ms)
        ).all()
        attributes = dict(connection.execute(select(items.c.item_id, items.c.attributes)).all())
    engine.dispose()
    assert [tuple(r) for r in stored] == [("clicks-0", "view"), ("clicks-4", "cart")]
    assert attributes == {"x": {"brand": "acme"}, "y": None, "z": {"brand": "zed"}}
