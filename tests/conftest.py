"""Shared pytest fixtures. Sections are owned by the step whose tests use them.

Plain helpers that tests call live in ``tests/helpers.py``; test modules import
from there (or from a fakes module such as ``tests/refresh_fakes.py``), never from
conftest or from each other.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import Engine, insert, select

from genrec.app.kafka_broker import KafkaBroker, KafkaCluster, pick_free_ports
from genrec.app.postgres import LocalPostgres, PostgresUnavailable
from genrec.app.redis_server import LocalRedis
from genrec.infra.database import make_engine
from genrec.infra.settings import KafkaSettings, OfflineSettings, Settings
from genrec.ingest.movielens import load_ml100k, store_ml100k
from genrec.offline.recall import fit_store_branches, save_branches
from genrec.offline.refresh import run_refresh
from genrec.schemas.tables import events, items
from genrec.schemas.token_layout import TokenLayout
from tests.helpers import ML100K_SAMPLE_USERS, SERVING_USERS, SyntheticSemanticIds, fresh_kafka

# --- markers ----------------------------------------------------------------

# Fixtures that start a server or build a trained version: a test using one gets the
# marker that ``make test-fast`` deselects even where its module forgot to set it.
FIXTURE_MARKERS = {
    "kafka_broker": "integration",
    "stoppable_kafka_broker": "integration",
    "kafka_cluster": "integration",
    "postgres_server": "integration",
    "redis_server": "integration",
    "serving_home": "slow",
    "ray_cluster": "integration",
}


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test by the server fixtures it uses (``FIXTURE_MARKERS``)."""
    for item in items:
        for fixture in FIXTURE_MARKERS.keys() & set(getattr(item, "fixturenames", ())):
            item.add_marker(FIXTURE_MARKERS[fixture])


# --- data -------------------------------------------------------------------


@pytest.fixture(scope="session")
def ml100k_engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    """A SQLite behavior store holding all of ML-100K (read-only for tests: copy if you write)."""
    path: Path = tmp_path_factory.mktemp("ml100k") / "genrec.db"
    engine = make_engine(f"sqlite:///{path}")
    store_ml100k(engine)
    return engine


@pytest.fixture
def ml100k_sample_store(ml100k_engine: Engine, tmp_path: Path) -> Engine:
    """A private store with the first ML100K_SAMPLE_USERS users of ML-100K (their last 40 events)."""
    engine = make_engine(f"sqlite:///{tmp_path / 'genrec.db'}")
    with ml100k_engine.connect() as source:
        all_users = {r[0] for r in source.execute(select(events.c.user_id).distinct())}
        users = sorted(all_users)[:ML100K_SAMPLE_USERS]
        rows = [dict(r._mapping) for r in source.execute(
            select(events).where(events.c.user_id.in_(users)).order_by(events.c.id))]  # fmt: skip
        item_rows = [dict(r._mapping) for r in source.execute(select(items))]
    kept = []
    for user in users:
        kept.extend([r for r in rows if r["user_id"] == user][-40:])
    with engine.begin() as target:
        target.execute(insert(items), item_rows)
        target.execute(insert(events), kept)
    return engine


@pytest.fixture
def synthetic_semantic_ids(ml100k_sample_store: Engine) -> SyntheticSemanticIds:
    """Random unique semantic IDs (16 x 16 x 8 codes) for every item of the sample store."""
    with ml100k_sample_store.connect() as connection:
        item_ids = sorted(r[0] for r in connection.execute(select(items.c.item_id)))
    shape = (16, 16, 8)
    chosen = np.random.default_rng(0).choice(int(np.prod(shape)), size=len(item_ids), replace=False)
    codes = np.stack(np.unravel_index(chosen, shape), axis=1).astype(np.int64)
    return SyntheticSemanticIds(7, item_ids, codes, TokenLayout.for_scratch_model(shape))


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


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.integration)])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh, empty behavior-store database: once on SQLite, once on PostgreSQL.

    The PostgreSQL variant needs the server, so it is an integration test.
    """
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'genrec.db'}"
    server = request.getfixturevalue("postgres_server")
    if server is None:
        pytest.skip("GENREC_TEST_SKIP_POSTGRES=1")
    return server.create_database(f"genrec_{uuid.uuid4().hex[:12]}")


# --- redis (the shared prefix-KV tier) -------------------------------------


@pytest.fixture(scope="session")
def redis_server() -> Iterator[LocalRedis]:
    """A private redis-server for the whole run (``make test`` installs it): a free
    loopback port, its own temporary directory, no persistence. Tests keep apart by
    ``redis.key_prefix``; one that stops Redis starts its own ``LocalRedis``."""
    server = LocalRedis.start()
    yield server
    server.stop()


# --- kafka ------------------------------------------------------------------


def _started_broker(tmp_path_factory: pytest.TempPathFactory, name: str) -> KafkaBroker:
    """A real local Kafka broker on free ports, its data in a fresh tmp dir, running."""
    port, controller_port = pick_free_ports(2)
    data_dir = tmp_path_factory.mktemp(name) / "kafka"  # laid out like DATA_DIR/kafka
    broker = KafkaBroker(data_dir, bootstrap=f"127.0.0.1:{port}", controller_port=controller_port)
    broker.up(timeout=180.0)  # 2 shared cores: a loaded machine starts the JVM slowly
    return broker


@pytest.fixture(scope="session")
def kafka_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KafkaBroker]:
    """The real local Kafka broker shared by the whole run; it stays up throughout.

    Tests share it, so none may stop, kill or restart it: one that does takes
    ``stoppable_kafka_broker`` instead.
    """
    broker = _started_broker(tmp_path_factory, "kafka-var")
    yield broker
    broker.down()


@pytest.fixture(scope="module")
def _module_kafka_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KafkaBroker]:
    broker = _started_broker(tmp_path_factory, "kafka-stoppable")
    yield broker
    broker.down()


@pytest.fixture
def stoppable_kafka_broker(_module_kafka_broker: KafkaBroker) -> KafkaBroker:
    """A broker of the test module's own, for tests that stop, kill or restart it.

    One per module rather than per test (a start takes 10-20 s); only the module's
    stopping tests use it, and it is brought back up before each of them, so none
    depends on what the previous one left behind.
    """
    _module_kafka_broker.up(timeout=180.0)  # no-op unless the previous test left it stopped
    return _module_kafka_broker


@pytest.fixture(scope="module")
def _module_kafka_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KafkaCluster]:
    ports = pick_free_ports(6)
    pairs = [(ports[i], ports[i + 1]) for i in range(0, 6, 2)]
    cluster = KafkaCluster(tmp_path_factory.mktemp("kafka-cluster"), pairs, heap="384m")
    cluster.up(timeout=240.0)
    yield cluster
    cluster.down()


@pytest.fixture
def kafka_cluster(_module_kafka_cluster: KafkaCluster) -> KafkaCluster:
    """A real three-node Kafka cluster (3 replicas, 2 in sync) of the test module's own;
    tests may kill a node: every node is brought back up before each test."""
    _module_kafka_cluster.up(timeout=240.0)
    return _module_kafka_cluster


@pytest.fixture
def kafka_settings(kafka_broker: KafkaBroker) -> KafkaSettings:
    """KafkaSettings for the shared broker with this test's own topics, already created."""
    return fresh_kafka(kafka_broker)


# --- online -----------------------------------------------------------------


def build_small_serving_version(home: Path, users: int = SERVING_USERS, **overrides) -> Settings:
    """A real serving version in ``home`` via ``run_refresh``: semantic IDs, a ``tiny``-preset
    target and drafts, every user's prefix KV, plus fitted recall branches (about 30 s).

    The catalog is stored without titles so the semantic IDs come from interaction
    embeddings: the text encoder would double the build time and serving does not care.
    ``overrides``: more settings sections (``database_url``, ``artifacts``, ``redis``, ...).
    Returns the settings it refreshed with.
    """
    settings = Settings(
        home=home,
        **overrides,
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
    return settings


@pytest.fixture
def published_serving_store(postgres_server, redis_server, tmp_path: Path) -> Settings:
    """A small real serving version kept as a deployment without a shared volume keeps it:
    the store in PostgreSQL, every user's prefix KV in Redis, the model and recall files
    published into the database (``artifacts.store = database``). Returns the refresh
    host's settings; its home holds what only the next refresh reads (model folder,
    semantic-ID build), which a worker on another host never sees."""
    if postgres_server is None:
        pytest.skip("GENREC_TEST_SKIP_POSTGRES=1")
    database_url = postgres_server.create_database(f"genrec_{uuid.uuid4().hex[:12]}")
    redis = redis_server.settings(key_prefix=f"genrec:test:{uuid.uuid4().hex[:8]}")
    return build_small_serving_version(
        tmp_path / "refresh-host", database_url=database_url, artifacts={"store": "database"},
        online={"kv_store": "redis"}, redis=redis,
    )  # fmt: skip


@pytest.fixture(scope="session")
def serving_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """GENREC_HOME of a small, real, active serving version (read-only: copy it to refresh)."""
    home = tmp_path_factory.mktemp("serving-home")
    build_small_serving_version(home)
    return home


# --- ray --------------------------------------------------------------------


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[OfflineSettings]:
    """A real local Ray cluster for the whole run (2 CPUs, 256 MiB object store, no
    dashboard), started in this process by ``connect_ray`` and stopped at the end. Returns
    ``OfflineSettings`` with ``executor = "ray"`` that reach it (``connect_ray`` keeps an
    initialized connection); give them to ``Settings(offline=...)``, with overrides. One
    actor per pool (``actors = 1``): each starts a process that imports torch and loads a
    model, seconds on 2 shared cores; a test of several actors overrides it."""
    from genrec.offline.ray_cluster import connect_ray, shutdown_ray  # Ray: only when used

    offline = OfflineSettings(executor="ray", local_cpus=2, local_object_store_mb=256, actors=1)
    connect_ray(offline)
    yield offline
    shutdown_ray()
