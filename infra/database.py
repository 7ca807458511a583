"""Database engines for the behavior store: SQLite embedded, PostgreSQL in production.

Tables are created if missing (``create_all``); see the README for why genrec
does not ship migrations yet.

Example::

    >>> from genrec.infra.database import make_engine
    >>> engine = make_engine("sqlite:///:memory:")
"""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url

from genrec.schemas.tables import metadata


def make_engine(url: str, *, create_tables: bool = True) -> Engine:
    """An engine for ``url``; SQLite gets WAL and a busy timeout so several processes can share it."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"timeout": 60})
        event.listen(engine, "connect", _sqlite_pragmas)
    else:
        engine = create_engine(url, pool_pre_ping=True)
    if create_tables:
        metadata.create_all(engine)
    return engine


def _sqlite_pragmas(dbapi_connection, _record) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA busy_timeout=60000")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def is_postgres(engine: Engine) -> bool:
    return engine.dialect.name == "postgresql"
