"""Shared pytest fixtures. Sections are owned by the step whose tests use them."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, func, insert, select

from genrec.app.postgres import LocalPostgres, PostgresUnavailable
from genrec.infra.database import make_engine
from genrec.ingest.movielens import load_ml100k, store_ml100k
from genrec.schemas.tables import events, items

# --- data -------------------------------------------------------------------


@pytest.fixture(scope="session")
def ml100k_engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    """A SQLite behavior store holding all of ML-100K (read-only for tests: copy if you write)."""
    path: Path = tmp_path_factory.mktemp("ml100k") / "genrec.db"
    engine = make_engine(f"sqlite:///{path}")
    store_ml100k(engine)
    return engine


# --- database ---------------------------------------------------------------


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[LocalPostgres | None]:
    """A private PostgreSQL cluster for the whole run (``make test`` installs the server).

    Set GENREC_TEST_SKIP_POSTGRES=1 to skip the PostgreSQL variants explicitly.
    """
    if os.environ.get("GENREC_TEST_SKIP_POSTGRES") == "1":
        yield None
        return
    try:
        server = LocalPostgres.start()
    except PostgresUnavailable as exc:
        raise RuntimeError(f"{exc}; run `make test`, or set GENREC_TEST_SKIP_POSTGRES=1") from exc
    yield server
    server.stop()


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh, empty behavior-store database: once on SQLite, once on PostgreSQL."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'genrec.db'}"
    server = request.getfixturevalue("postgres_server")
    if server is None:
        pytest.skip("GENREC_TEST_SKIP_POSTGRES=1")
    return server.create_database(f"genrec_{uuid.uuid4().hex[:12]}")


# --- kafka ------------------------------------------------------------------


@pytest.fixture(scope="session")
def kafka_broker(tmp_path_factory: pytest.TempPathFactory):
    """A real local Kafka broker on free ports for the whole run (data in a tmp dir).

    Tests may call ``kafka_broker.down()`` / ``.up()`` / ``.kill()``: the object keeps
    its ports and data, and ``kafka_settings`` brings it back up for the next test.
    """
    from genrec.app.kafka_broker import KafkaBroker, pick_free_ports

    port, controller_port = pick_free_ports(2)
    data_dir = tmp_path_factory.mktemp("kafka-var") / "kafka"  # laid out like DATA_DIR/kafka
    broker = KafkaBroker(data_dir, bootstrap=f"127.0.0.1:{port}", controller_port=controller_port)
    broker.up(timeout=180.0)  # 2 shared cores: a loaded machine starts the JVM slowly
    yield broker
    broker.down()


def unique_kafka(kafka_broker):
    """KafkaSettings for the test broker with topic names of their own, not yet created."""
    from genrec.infra.settings import KafkaSettings

    kafka_broker.up(timeout=180.0)  # no-op unless an earlier test left it stopped
    suffix = uuid.uuid4().hex[:10]
    return KafkaSettings(
        bootstrap=kafka_broker.bootstrap,
        client_id=f"genrec-test-{suffix}",
        topic_events=f"genrec.user-events.{suffix}",
        topic_recommendations=f"genrec.recommendations.{suffix}",
        topic_dlq=f"genrec.user-events.{suffix}.dlq",
    )


def fresh_kafka(kafka_broker):
    """KafkaSettings for the test broker with their own topics, already created."""
    from genrec.infra.topics import create_topics

    kafka = unique_kafka(kafka_broker)
    create_topics(kafka)
    return kafka


@pytest.fixture
def kafka_settings(kafka_broker):
    """KafkaSettings for the test broker with this test's own topics, already created."""
    return fresh_kafka(kafka_broker)


def wait_for(condition, timeout: float, what: str) -> None:
    """Poll ``condition`` until it holds; fail with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.2)


def count_rows(database_url: str, table=events) -> int:
    """Rows in ``table`` of the store at ``database_url`` (a fresh engine, disposed after)."""
    engine = make_engine(database_url)
    try:
        with engine.connect() as connection:
            return connection.execute(select(func.count()).select_from(table)).scalar_one()
    finally:
        engine.dispose()


# --- online -----------------------------------------------------------------

SERVING_USERS = 100  # ML-100K users (ids 1..100) in the small serving version


def build_small_serving_version(home: Path, users: int = SERVING_USERS) -> None:
    """A real serving version in ``home`` via ``run_refresh``: semantic IDs, a ``tiny``-preset
    target and drafts, every user's prefix KV, plus fitted recall branches (about 30 s).

    The catalog is stored without titles so the semantic IDs come from interaction
    embeddings: the text encoder would double the build time and serving does not care.
    """
    from genrec.infra.settings import Settings
    from genrec.offline.recall import fit_store_branches, save_branches
    from genrec.offline.refresh import run_refresh

    settings = Settings(
        home=home,
        semantic_ids={"epochs": 20, "codes_per_level": 16, "dedup_codes": 16,
                      "hidden_dims": (64,), "latent_dim": 16, "kmeans_iters": 5},
        model={"preset": "tiny", "history_items": 20, "agreement_users": 20,
               "teacher_prompts": 16},
        refresh={"retrain_target": True, "train_preset": "tiny", "kv_batch_size": 64},
    )  # fmt: skip
    engine = make_engine(settings.database_url)
    dataset = load_ml100k()
    kept = dataset.events[dataset.events.user_id.astype(int) <= users]
    with engine.begin() as connection:
        connection.execute(insert(items), [{"item_id": i} for i in sorted(set(kept.item_id))])
        connection.execute(insert(events), [
            {"event_id": f"ml-100k-{row.file_row}", "user_id": row.user_id, "item_id": row.item_id,
             "event_type": "rate", "ts_ms": int(row.timestamp) * 1000, "value": float(row.rating)}
            for row in kept.itertuples()
        ])  # fmt: skip
    run_refresh(settings, engine)
    save_branches(fit_store_branches(settings, engine), settings.path("recall", "x").parent)
    engine.dispose()  # checkpoints SQLite's WAL: the folder can be copied as it is


@pytest.fixture(scope="session")
def serving_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """GENREC_HOME of a small, real, active serving version (read-only: copy it to refresh)."""
    home = tmp_path_factory.mktemp("serving-home")
    build_small_serving_version(home)
    return home


# --- models -----------------------------------------------------------------


def random_items(n: int, codes_per_level=(6, 5, 4), seed: int = 0):
    """``n`` items with distinct random semantic IDs over a small scratch layout."""
    import numpy as np

    from genrec.online.prompts import ItemTokens
    from genrec.schemas.token_layout import TokenLayout

    rng = np.random.default_rng(seed)
    chosen = rng.choice(int(np.prod(codes_per_level)), size=n, replace=False)
    codes = np.stack(np.unravel_index(chosen, codes_per_level), axis=1)
    layout = TokenLayout.for_scratch_model(codes_per_level)
    return ItemTokens([f"i{k}" for k in range(n)], codes, layout)


def split_prompts(case, users=slice(None)):
    """(prefix prompts, suffixes, full prompts) of a decoding bench case's users: the newest
    ``suffix_items`` items form the suffix."""
    depth = case.layout.depth
    prefixes, suffixes, full = [], [], []
    for user in case.eval_users[users]:
        cut = len(user.prompt) - user.suffix_items * depth
        prefixes.append(user.prompt[:cut])
        suffixes.append(user.prompt[cut:])
        full.append(user.prompt)
    return prefixes, suffixes, full
