"""Writes validated events and the item catalog into the behavior store (ingest step).

Every write is idempotent: events are inserted with ``ON CONFLICT (event_id) DO
NOTHING`` (SQLite and PostgreSQL alike), users are upserted with their first and
last event time, items are upserted by ``item_id``. One call, one transaction.
``write_events`` takes dicts; ``write_event_rows`` takes plain tuples in
``EVENT_COLUMNS`` order, which is what the ingest loop and its writer process use.
``delete_events`` takes events out again by id (``genrec bench load`` removes its own
synthetic events) and narrows their users' spans to the events left.

Example::

    >>> from genrec.infra.database import make_engine
    >>> engine = make_engine("sqlite:///:memory:")
    >>> row = {"event_id": "e1", "user_id": "7", "item_id": "42", "event_type": "view",
    ...        "ts_ms": 1, "value": None, "context": None, "kafka_topic": None,
    ...        "kafka_partition": None, "kafka_offset": None}
    >>> write_events(engine, [row]), write_events(engine, [row])
    (1, 0)
    >>> write_event_rows(engine, [("e2", "7", "43", "view", 2, None, None, "t", 0, 5)])
    1
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import Connection, Engine, case, delete, exists, func, select, text, update
from sqlalchemy.dialects import postgresql, sqlite

from genrec.schemas.tables import events, items, users

EVENT_COLUMNS = (
    "event_id",
    "user_id",
    "item_id",
    "event_type",
    "ts_ms",
    "value",
    "context",
    "kafka_topic",
    "kafka_partition",
    "kafka_offset",
)
ITEM_TEXT_COLUMNS = ("title", "year", "genres")


def _insert(connection: Connection, table):
    """The dialect's INSERT, which knows ON CONFLICT (plain insert has no upsert)."""
    dialect = connection.dialect.name
    if dialect == "postgresql":
        return postgresql.insert(table)
    if dialect == "sqlite":
        return sqlite.insert(table)
    raise NotImplementedError(
        f"idempotent inserts are implemented for sqlite and postgresql, not {dialect}"
    )


def write_events(engine: Engine, rows: Sequence[dict[str, Any]]) -> int:
    """Insert ``rows`` (keys ``EVENT_COLUMNS``) and upsert their users in ONE transaction.

    Returns how many events were new; already stored event_ids are skipped.
    Rows are inserted in the given order, so ``events.id`` follows it.
    """
    return write_event_rows(engine, [tuple(row.get(c) for c in EVENT_COLUMNS) for row in rows])


def write_event_rows(engine: Engine, rows: Sequence[Sequence[Any]]) -> int:
    """``write_events`` for rows given as sequences in ``EVENT_COLUMNS`` order."""
    if not rows:
        return 0
    with engine.begin() as connection:
        return insert_events(connection, rows)


def insert_events(connection: Connection, rows: Sequence[Sequence[Any]]) -> int:
    """``write_event_rows`` inside a transaction the caller holds."""
    if connection.dialect.name == "postgresql":
        stored = _insert_events_postgres(connection, rows)
    elif connection.dialect.name == "sqlite":
        _tune_sqlite(connection)
        stored = _insert_events_sqlite(connection, rows)
    else:
        raise NotImplementedError(
            f"events are written to sqlite or postgresql, not {connection.dialect.name}"
        )
    upsert_users(connection, rows)
    return stored


_CONTEXT = EVENT_COLUMNS.index("context")


def _context_as_text(rows: Sequence[Sequence[Any]]) -> Sequence[Sequence[Any]]:
    """Rows with their context dict as JSON text (the drivers take text for JSON columns)."""
    if all(row[_CONTEXT] is None for row in rows):
        return rows
    return [
        (*row[:_CONTEXT], None if row[_CONTEXT] is None else json.dumps(row[_CONTEXT]))
        + tuple(row[_CONTEXT + 1 :])
        for row in rows
    ]


# One statement for the whole batch: arrays in, rows out in array order. Faster than
# executemany on PostgreSQL, and its rowcount is the number of new events.
_POSTGRES_INSERT = text(
    """
    INSERT INTO events (event_id, user_id, item_id, event_type, ts_ms, value, context,
                        kafka_topic, kafka_partition, kafka_offset)
    SELECT event_id, user_id, item_id, event_type, ts_ms, value, CAST(context AS JSON),
           kafka_topic, kafka_partition, kafka_offset
    FROM unnest(CAST(:event_id AS TEXT[]), CAST(:user_id AS TEXT[]), CAST(:item_id AS TEXT[]),
                CAST(:event_type AS TEXT[]), CAST(:ts_ms AS BIGINT[]),
                CAST(:value AS DOUBLE PRECISION[]), CAST(:context AS TEXT[]),
                CAST(:kafka_topic AS TEXT[]), CAST(:kafka_partition AS INTEGER[]),
                CAST(:kafka_offset AS BIGINT[]))
         WITH ORDINALITY AS batch(event_id, user_id, item_id, event_type, ts_ms, value, context,
                                  kafka_topic, kafka_partition, kafka_offset, position)
    ORDER BY position
    ON CONFLICT (event_id) DO NOTHING
    """
)


SQLITE_CACHE_KIB = 64 * 1024
# Checkpoint the WAL every 16,000 pages (64 MiB) instead of SQLite's 1,000: the index
# pages a batch touches are copied into the database once per checkpoint, so rarer
# checkpoints copy each hot page fewer times (measured: 11.3 -> 9.3 us per event at
# 400k events, final checkpoint included).
SQLITE_WAL_AUTOCHECKPOINT_PAGES = 16_000


def _tune_sqlite(connection: Connection) -> None:
    """Per writing connection: a 64 MiB page cache (index inserts at random keys stop
    re-reading pages) and a larger WAL between checkpoints."""
    info = connection.connection.info
    if not info.get("genrec_cache_size"):
        connection.exec_driver_sql(f"PRAGMA cache_size=-{SQLITE_CACHE_KIB}")
        connection.exec_driver_sql(f"PRAGMA wal_autocheckpoint={SQLITE_WAL_AUTOCHECKPOINT_PAGES}")
        info["genrec_cache_size"] = True


_SQLITE_INSERT = (
    "INSERT INTO events (event_id, user_id, item_id, event_type, ts_ms, value, context, "
    "kafka_topic, kafka_partition, kafka_offset) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
    "ON CONFLICT (event_id) DO NOTHING"
)


def _insert_events_sqlite(connection: Connection, rows: Sequence[Sequence[Any]]) -> int:
    # Plain tuples straight to sqlite3: SQLAlchemy's per-row parameter processing
    # costs more than the insert itself at tens of thousands of rows per second.
    # sqlite3 sums the rows changed over an executemany: exactly the new events.
    return connection.exec_driver_sql(_SQLITE_INSERT, _context_as_text(rows)).rowcount


def _insert_events_postgres(connection: Connection, rows: Sequence[Sequence[Any]]) -> int:
    transposed = zip(*_context_as_text(rows), strict=True)
    columns = dict(zip(EVENT_COLUMNS, map(list, transposed), strict=True))
    return connection.execute(_POSTGRES_INSERT, columns).rowcount


# SQLite's two-argument MIN/MAX are scalar functions: the span widens in place.
_SQLITE_UPSERT_USERS = (
    "INSERT INTO users (user_id, first_ts_ms, last_ts_ms) VALUES (?, ?, ?) "
    "ON CONFLICT (user_id) DO UPDATE SET "
    "first_ts_ms = MIN(users.first_ts_ms, excluded.first_ts_ms), "
    "last_ts_ms = MAX(users.last_ts_ms, excluded.last_ts_ms)"
)


_USER_ID, _TS_MS = EVENT_COLUMNS.index("user_id"), EVENT_COLUMNS.index("ts_ms")


def upsert_users(connection: Connection, rows: Iterable[Sequence[Any]]) -> None:
    """Create or widen each user's [first_ts_ms, last_ts_ms] span (rows in ``EVENT_COLUMNS`` order)."""
    span: dict[str, list[int]] = {}
    for row in rows:
        user_id, ts_ms = row[_USER_ID], row[_TS_MS]
        seen = span.get(user_id)
        if seen is None:
            span[user_id] = [ts_ms, ts_ms]
        else:
            seen[0] = min(seen[0], ts_ms)
            seen[1] = max(seen[1], ts_ms)
    # Sorted so that concurrent writers lock user rows in one order (no deadlock).
    spans = sorted(span.items())
    if connection.dialect.name == "sqlite":
        params = [(user_id, first, last) for user_id, (first, last) in spans]
        connection.exec_driver_sql(_SQLITE_UPSERT_USERS, params)
        return
    user_rows = [
        {"user_id": user_id, "first_ts_ms": first, "last_ts_ms": last}
        for user_id, (first, last) in spans
    ]
    statement = _insert(connection, users)
    excluded = statement.excluded
    statement = statement.on_conflict_do_update(
        index_elements=["user_id"],
        set_={
            "first_ts_ms": case(
                (excluded.first_ts_ms < users.c.first_ts_ms, excluded.first_ts_ms),
                else_=users.c.first_ts_ms,
            ),
            "last_ts_ms": case(
                (excluded.last_ts_ms > users.c.last_ts_ms, excluded.last_ts_ms),
                else_=users.c.last_ts_ms,
            ),
        },
    )
    connection.execute(statement, user_rows)


DELETE_CHUNK = 500  # ids per statement: well under SQLite's 32,766 bound parameters


def reuses_event_ids(engine: Engine) -> bool:
    """Whether the store would give a deleted newest event's ``events.id`` to the next one: a
    SQLite events table created before ``sqlite_autoincrement`` (``schemas.tables``)."""
    if engine.dialect.name != "sqlite":
        return False  # PostgreSQL: a sequence
    with engine.connect() as connection:
        sql = connection.exec_driver_sql(
            "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'events'"
        ).scalar()
    return sql is not None and "AUTOINCREMENT" not in sql.upper()


def count_events(engine: Engine, event_ids: Sequence[str]) -> int:
    """How many of these event ids the store holds (through the unique index, in chunks)."""
    with engine.connect() as connection:
        return sum(
            connection.execute(
                select(func.count()).where(events.c.event_id.in_(event_ids[i : i + DELETE_CHUNK]))
            ).scalar_one()
            for i in range(0, len(event_ids), DELETE_CHUNK)
        )


def delete_events(engine: Engine, event_ids: Iterable[str]) -> int:
    """Delete the events with these ids (unknown ids are skipped) and set each of their users'
    [first_ts_ms, last_ts_ms] to the events the user has left (a user with none left goes);
    ONE transaction. Returns how many events were deleted.

    Every statement goes through the unique index on ``event_id`` and, per user, the history
    index: the cost grows with the ids given and their users' events, not the store. Refused
    (``ValueError``, nothing deleted) on a store that ``reuses_event_ids``: readers that keep
    "every event up to this id" would skip the events given the deleted ids.
    """
    ids = sorted(set(event_ids))
    if not ids:
        return 0
    if reuses_event_ids(engine):
        raise ValueError(
            "this SQLite store's events table predates AUTOINCREMENT, so deleted events' ids "
            "would be given to new events: nothing deleted"
        )
    deleted, touched = 0, set()
    with engine.begin() as connection:
        for start in range(0, len(ids), DELETE_CHUNK):
            chunk = ids[start : start + DELETE_CHUNK]
            found = select(events.c.user_id).where(events.c.event_id.in_(chunk)).distinct()
            touched.update(connection.execute(found).scalars())
            deleted += connection.execute(
                delete(events).where(events.c.event_id.in_(chunk))
            ).rowcount
        owners = sorted(touched)  # one lock order, as upsert_users
        for start in range(0, len(owners), DELETE_CHUNK):
            _narrow_user_spans(connection, owners[start : start + DELETE_CHUNK])
    return deleted


def _narrow_user_spans(connection: Connection, user_ids: Sequence[str]) -> None:
    """These users' spans from the events they have (users without any are deleted)."""
    theirs = events.c.user_id == users.c.user_id
    connection.execute(
        update(users)
        .where(users.c.user_id.in_(user_ids))
        .values(
            first_ts_ms=select(func.min(events.c.ts_ms)).where(theirs).scalar_subquery(),
            last_ts_ms=select(func.max(events.c.ts_ms)).where(theirs).scalar_subquery(),
        )
        .where(exists().where(theirs))
    )
    connection.execute(delete(users).where(users.c.user_id.in_(user_ids), ~exists().where(theirs)))


def upsert_items(engine: Engine, rows: Sequence[dict[str, Any]]) -> int:
    """Insert or refresh catalog items (keys: item_id, optional title/year/genres/attributes)."""
    if not rows:
        return 0
    normalized = [
        {
            "item_id": str(row["item_id"]),
            "title": row.get("title"),
            "year": row.get("year"),
            "genres": row.get("genres"),
            "attributes": row.get("attributes"),
        }
        for row in rows
    ]
    with engine.begin() as connection:
        statement = _insert(connection, items)
        excluded = statement.excluded
        statement = statement.on_conflict_do_update(
            index_elements=["item_id"],
            set_={
                "title": excluded.title,
                "year": excluded.year,
                "genres": excluded.genres,
                "attributes": excluded.attributes,
                "updated_at": func.now(),
            },
        )
        connection.execute(statement, normalized)
    return len(normalized)
