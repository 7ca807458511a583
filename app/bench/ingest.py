"""``genrec bench ingest``: the ingest path's rate next to a bare Kafka consumer's (ingest step).

Produces N synthetic events to a fresh topic, then reads them all twice in one
run: (a) a bare kafka-python consumer that only counts messages, (b) the real
ingest path with default settings (validate, store through the writer process,
commit) once per store: a fresh SQLite database, and with ``--stores
sqlite,postgres`` also a private PostgreSQL cluster started for the run (fsync
on, on this machine: no network hop). It prints every rate, each store's ratio to
the bare consumer and which writer stored the events; no pass/fail, the numbers
are the result.

Example::

    $ genrec bench ingest --events 200000 --stores sqlite,postgres --json var/bench-ingest.json
"""

from __future__ import annotations

import contextlib
import json
import logging
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import pandas as pd

from genrec.app.postgres import LocalPostgres
from genrec.infra.kafka_clients import open_client
from genrec.infra.settings import Settings
from genrec.infra.topics import create_topics, subscribe_when_ready
from genrec.ingest.consumer import Ingestor, consumer_config
from genrec.ingest.replay import replay_events

log = logging.getLogger("genrec.app.bench.ingest")


def synthetic_events(n: int, users: int = 5000, items: int = 20000, seed: int = 0) -> pd.DataFrame:
    """N events over ``users`` x ``items`` with increasing timestamps, like a busy site."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return pd.DataFrame(
        {
            "event_id": [f"bench-{i}" for i in range(n)],
            "user_id": rng.integers(0, users, n).astype(str),
            "item_id": rng.integers(0, items, n).astype(str),
            "timestamp": 1_700_000_000_000 + np.arange(n, dtype="int64") * 10,
            "event_type": rng.choice(
                ["view", "click", "cart", "purchase"], n, p=[0.7, 0.2, 0.07, 0.03]
            ),
        }
    )


def bare_consume(settings: Settings, topic: str, expected: int) -> float:
    """Seconds for a plain group consumer (same fetch settings) to read ``expected`` messages.

    Both timers start at the first non-empty poll, so the group join (seconds,
    the same for both) does not blur the rates.
    """
    from kafka import KafkaConsumer

    config = consumer_config(settings, group_id=f"genrec-bench-bare-{uuid.uuid4().hex[:8]}")
    consumer = open_client(KafkaConsumer, settings.kafka, **config)
    subscribe_when_ready(consumer, topic, timeout_s=settings.kafka.topic_wait_s)
    seen, began = 0, None
    try:
        while seen < expected:
            batch = consumer.poll(timeout_ms=1000)
            if batch and began is None:
                began = time.monotonic()
            for records in batch.values():
                seen += len(records)
        return time.monotonic() - began
    finally:
        consumer.close(autocommit=False)


def ingest_consume(
    settings: Settings, topic: str, expected: int, database_url: str
) -> tuple[float, int, str]:
    """Seconds for the ingest path to store ``expected`` events: (seconds, stored, writer).

    Timed from the first non-empty poll to the end of the last batch's write.
    """

    settings = settings.model_copy(deep=True)
    settings.kafka.topic_events = topic
    settings.database_url = database_url
    ingestor = Ingestor(settings, group_id=f"genrec-bench-ingest-{uuid.uuid4().hex[:8]}")
    writer = "thread" if ingestor.writer_process is None else "process"
    stats = ingestor.run(until=lambda stats: stats.events_stored >= expected, progress_every_s=1e9)
    ingestor.engine.dispose()
    return stats.last_store_at - stats.first_event_at, stats.events_stored, writer


STORES = ("sqlite", "postgres")


def run_bench(
    settings: Settings,
    n_events: int = 200_000,
    json_path: Path | None = None,
    stores: tuple[str, ...] = ("sqlite",),
) -> dict[str, Any]:
    """Bare consumer vs the ingest path into each of ``stores``, on the same topic."""
    unknown = set(stores) - set(STORES)
    if unknown or not stores:
        raise ValueError(f"stores must be some of {STORES}, got {stores}")

    suffix = uuid.uuid4().hex[:8]
    kafka = settings.kafka.model_copy(
        update={
            "topic_events": f"genrec.bench-ingest-{suffix}",
            "topic_dlq": f"genrec.bench-ingest-{suffix}.dlq",
            "topic_recommendations": f"genrec.bench-ingest-{suffix}.recs",
        }
    )
    settings = settings.model_copy(update={"kafka": kafka})
    create_topics(kafka)
    try:
        produced = replay_events(settings, synthetic_events(n_events), progress=False)
        log.info("produced %d events in %.1f s", produced.produced, produced.seconds)
        bare_s = bare_consume(settings, kafka.topic_events, n_events)
        timed = {}
        for store in stores:
            with _store_url(store) as url:
                timed[store] = ingest_consume(settings, kafka.topic_events, n_events, url)
    finally:
        _delete_topics(kafka)
    result, lines = _summary(
        n_events, kafka, settings.ingest.batch_size, produced.seconds, bare_s, timed
    )
    print("\n".join(lines))
    if json_path is not None:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(result, indent=2) + "\n")
    return result


def _summary(
    n_events: int, kafka, batch_size: int, produce_s: float, bare_s: float, timed: dict
) -> tuple[dict[str, Any], list[str]]:
    """The report (rates, each store's ratio to the bare consumer) and its printed lines."""
    result: dict[str, Any] = {
        "events": n_events,
        "partitions": kafka.events_partitions,
        "produce_events_per_s": round(n_events / produce_s, 1),
        "bare_consumer_events_per_s": round(n_events / bare_s, 1),
        "batch_size": batch_size,
    }
    lines = [
        f"bench ingest: {n_events:,} events, {kafka.events_partitions} partitions",
        f"  produce             {result['produce_events_per_s']:>12,.0f} events/s",
        f"  bare consumer       {result['bare_consumer_events_per_s']:>12,.0f} events/s",
    ]
    for store, (ingest_s, stored, writer) in timed.items():
        result[f"ingest_{store}_events_per_s"] = round(n_events / ingest_s, 1)
        result[f"ingest_{store}_to_bare_ratio"] = round(bare_s / ingest_s, 3)
        result[f"{store}_stored"] = stored
        result["writer"] = writer
        lines.append(
            f"{f'  ingest ({store})':22s}{result[f'ingest_{store}_events_per_s']:>12,.0f} events/s, "
            f"ratio to bare {bare_s / ingest_s:.2f} (stored {stored:,}, writer {writer})"
        )
    if "sqlite" in timed:  # the names of the single-store report, kept for its readers
        result["ingest_to_bare_ratio"] = result["ingest_sqlite_to_bare_ratio"]
        result["stored"] = result["sqlite_stored"]
    return result, lines


@contextlib.contextmanager
def _store_url(store: str):
    """A fresh, empty database of kind ``store`` for one timed ingest, removed afterwards."""
    if store == "sqlite":
        with tempfile.TemporaryDirectory(prefix="genrec-bench-") as folder:
            yield f"sqlite:///{Path(folder) / 'bench.db'}"
        return

    server = LocalPostgres.start(fsync=True)
    try:
        yield server.create_database("genrec_bench")
    finally:
        server.stop()


def _delete_topics(kafka) -> None:
    from kafka import KafkaAdminClient

    with (
        contextlib.suppress(Exception),
        contextlib.closing(KafkaAdminClient(**kafka.client_config())) as admin,
    ):
        admin.delete_topics([kafka.topic_events, kafka.topic_dlq, kafka.topic_recommendations])
