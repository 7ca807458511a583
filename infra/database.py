"""Database engines for the behavior store: SQLite embedded, PostgreSQL in production.

Tables are created if missing (``create_all``); see the README for why genrec
does not ship migrations yet. ``create_all`` builds a table's indexes only with the table,
so a store created by an older release lacks the indexes added since: every engine made
with ``create_tables`` logs a warning naming them, ``missing_indexes`` lists them and
``create_indexes`` builds them (``genrec store indexes --create``; on PostgreSQL
``CONCURRENTLY``, so ingest keeps writing meanwhile). Indexes the schema has replaced
(``schemas.tables.REPLACED_INDEXES``) are listed by ``replaced_indexes`` and dropped by
``drop_replaced_indexes`` once their table has every index of the schema.
``absolute_artifact_paths`` finds the artifact folders that rows written before paths were
stored relative name absolutely, and rewrites those under the data directory
(``genrec store artifact-paths --rewrite``), so that the store can be moved.

Example::

    >>> from genrec.infra.database import make_engine, missing_indexes
    >>> engine = make_engine("sqlite:///:memory:")
    >>> missing_indexes(engine)
    []
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from pathlib import Path

from sqlalchemy import Engine, Index, create_engine, event, inspect, select, text, update
from sqlalchemy.engine import make_url
from sqlalchemy.schema import CreateIndex

from genrec.infra.settings import relative_path_under
from genrec.schemas.tables import (
    REPLACED_INDEXES,
    metadata,
    model_versions,
    semantic_id_versions,
)

log = logging.getLogger("genrec.database")


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
        _warn_if_indexes_missing(engine)
    return engine


def missing_indexes(engine: Engine) -> list[Index]:
    """The schema's indexes that the store's existing tables lack (on PostgreSQL also any
    left invalid by a failed concurrent build), in table then name order."""
    inspector = inspect(engine)
    tables = set(inspector.get_table_names())
    invalid = _invalid_indexes(engine)
    missing = []
    for table in metadata.sorted_tables:
        if table.name not in tables:
            continue
        present = {index["name"] for index in inspector.get_indexes(table.name)} - invalid
        missing += sorted((i for i in table.indexes if i.name not in present), key=_name)
    return missing


def create_indexes(engine: Engine, indexes: Sequence[Index]) -> None:
    """Build ``indexes`` (from ``missing_indexes``), one statement each. On PostgreSQL each is
    built ``CONCURRENTLY`` (outside a transaction; writes go on, the build takes longer),
    after dropping an invalid one of the same name; on SQLite in a transaction of its own."""
    postgres = is_postgres(engine)
    invalid = _invalid_indexes(engine)
    for index in indexes:
        ddl = str(CreateIndex(index).compile(dialect=engine.dialect))
        log.info("building index %s on %s", index.name, index.table.name)
        if not postgres:
            with engine.begin() as connection:
                connection.exec_driver_sql(ddl)
            continue
        ddl = re.sub(r"^CREATE (UNIQUE )?INDEX", r"CREATE \1INDEX CONCURRENTLY", ddl, count=1)
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
            if index.name in invalid:
                connection.exec_driver_sql(f'DROP INDEX CONCURRENTLY IF EXISTS "{index.name}"')
            connection.exec_driver_sql(ddl)


def replaced_indexes(engine: Engine) -> list[tuple[str, str]]:
    """(table, index) of the indexes the schema has replaced that the store still has."""
    inspector = inspect(engine)
    tables = set(inspector.get_table_names())
    found = []
    for table, names in sorted(REPLACED_INDEXES.items()):
        if table in tables:
            present = {index["name"] for index in inspector.get_indexes(table)}
            found += [(table, name) for name in names if name in present]
    return found


def drop_replaced_indexes(engine: Engine) -> list[tuple[str, str]]:
    """Drop the replaced indexes of every table that lacks none of the schema's (on
    PostgreSQL ``CONCURRENTLY``: writes go on); returns those dropped."""
    incomplete = {index.table.name for index in missing_indexes(engine)}
    dropped = []
    for table, name in replaced_indexes(engine):
        if table in incomplete:  # its replacement is not built: reads still need this one
            continue
        log.info("dropping index %s on %s (replaced)", name, table)
        if is_postgres(engine):
            with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
                connection.exec_driver_sql(f'DROP INDEX CONCURRENTLY IF EXISTS "{name}"')
        else:
            with engine.begin() as connection:
                connection.exec_driver_sql(f'DROP INDEX IF EXISTS "{name}"')
        dropped.append((table, name))
    return dropped


def absolute_artifact_paths(
    engine: Engine, data_dir: Path, rewrite: bool = False
) -> list[tuple[str, int, str, str | None]]:
    """(table, version, stored path, its relative form) of every model and semantic-ID
    version whose artifact folder is stored absolute; the relative form is None where the
    folder is not under ``data_dir`` (it stays as it is). ``rewrite``: store the relative
    forms, in one transaction. One row per version: a store keeps a few dozen."""
    data_dir = Path(data_dir).resolve()
    found = []
    with engine.begin() as connection:
        for table in (model_versions, semantic_id_versions):
            rows = connection.execute(
                select(table.c.version, table.c.artifact_dir).where(
                    table.c.artifact_dir.is_not(None)
                )
            ).all()
            for version, stored in rows:
                if not Path(stored).is_absolute():
                    continue
                relative = relative_path_under(stored, data_dir)
                found.append((table.name, int(version), stored, relative))
                if rewrite and relative is not None:
                    connection.execute(
                        update(table)
                        .where(table.c.version == version)
                        .values(artifact_dir=relative)
                    )
    return found


def _warn_if_indexes_missing(engine: Engine) -> None:
    missing = missing_indexes(engine)
    if missing:
        log.warning(
            "the store lacks %s (it predates them; reads are correct but slower): "
            "run `genrec store indexes --create`",
            ", ".join(f"index {i.name} on {i.table.name}" for i in missing),
        )
    replaced = replaced_indexes(engine)
    if replaced:
        log.warning(
            "the store keeps %s, which the schema replaced (every insert pays for it): "
            "run `genrec store indexes --create`",
            ", ".join(f"index {name} on {table}" for table, name in replaced),
        )


def _invalid_indexes(engine: Engine) -> set[str]:
    """PostgreSQL's indexes that a failed ``CREATE INDEX CONCURRENTLY`` left unusable."""
    if not is_postgres(engine):
        return set()
    query = text(
        "SELECT c.relname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
        "JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE NOT i.indisvalid AND n.nspname = current_schema()"
    )
    with engine.connect() as connection:
        return {row[0] for row in connection.execute(query)}


def _name(index: Index) -> str:
    return str(index.name)


def _sqlite_pragmas(dbapi_connection, _record) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA busy_timeout=60000")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def is_postgres(engine: Engine) -> bool:
    return engine.dialect.name == "postgresql"
