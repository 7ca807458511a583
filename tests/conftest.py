"""Shared pytest fixtures. Sections are owned by the step whose tests use them."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, insert

from genrec.infra.database import make_engine
from genrec.infra.postgres import LocalPostgres, PostgresUnavailable
from genrec.ingest.movielens import load_ml100k
from genrec.schemas.tables import events, items

# --- data -------------------------------------------------------------------


def store_ml100k(engine: Engine) -> None:
    """Write ML-100K into a store the way replay + ingest would, without Kafka."""
    dataset = load_ml100k()
    event_rows = [
        {
            "event_id": f"ml-100k-{row.file_row}",
            "user_id": row.user_id,
            "item_id": row.item_id,
            "event_type": "rate",
            "ts_ms": int(row.timestamp) * 1000,
            "value": float(row.rating),
        }
        for row in dataset.events.itertuples()
    ]
    item_rows = [
        {
            "item_id": row.item_id,
            "title": row.title or None,
            "year": None if row.year is None or str(row.year) == "<NA>" else int(row.year),
            "genres": row.genres or None,
        }
        for row in dataset.items.itertuples()
    ]
    with engine.begin() as connection:
        connection.execute(insert(items), item_rows)
        connection.execute(insert(events), event_rows)


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
