"""Serving versions: which (semantic-ID, model, prefix-KV) versions the online workers use.

Written by the offline refresh, read by the online workers. Exactly one row of
``serving_versions`` has ``active = true`` (a partial unique index enforces
it); activation retires the old row and activates the new one in ONE
transaction, so a reader sees either the old triple or the new one. Online
workers poll ``active_serving_version`` every few seconds (one indexed row)
and switch when its ``version`` changes.

Example::

    >>> from genrec.infra.database import make_engine
    >>> active_serving_version(make_engine("sqlite:///:memory:")) is None
    True
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from sqlalchemy import Connection, Engine, insert, select, update

from genrec.schemas.tables import serving_versions


@dataclass(frozen=True)
class ServingVersion:
    """One activated (or candidate) triple; ``kv_version`` keys the prefix-KV store."""

    version: int
    status: str
    semantic_id_version: int | None
    model_version: str | None
    kv_version: int | None
    event_cutoff_row: int | None  # every events.id <= this was read by the refresh
    activated_at: dt.datetime | None


def _utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def active_serving_version(engine: Engine) -> ServingVersion | None:
    """The version the online workers must serve, or None before the first refresh."""
    query = select(serving_versions).where(serving_versions.c.active.is_(True))
    with engine.connect() as connection:
        row = connection.execute(query).mappings().first()
    return _version(row) if row else None


def recent_activated_versions(engine: Engine, limit: int) -> list[int]:
    """The ``limit`` most recently activated versions, newest first (the active one first)."""
    query = (
        select(serving_versions.c.version)
        .where(serving_versions.c.activated_at.is_not(None))
        .order_by(serving_versions.c.activated_at.desc(), serving_versions.c.version.desc())
        .limit(limit)
    )
    with engine.connect() as connection:
        return [int(v) for (v,) in connection.execute(query)]


def create_candidate(engine: Engine, job_run_id: int, event_cutoff_row: int) -> int:
    """A new ``building`` row; its number is also the KV version the run writes."""
    statement = insert(serving_versions).values(
        status="building",
        active=False,
        event_cutoff_row=event_cutoff_row,
        job_run_id=job_run_id,
        created_at=_utcnow(),
    )
    with engine.begin() as connection:
        return int(connection.execute(statement).inserted_primary_key[0])


def activate(
    connection: Connection,
    version: int,
    semantic_id_version: int | None,
    model_version: str | None,
    kv_version: int | None,
) -> None:
    """Make ``version`` the active one; call inside the caller's single transaction."""
    now = _utcnow()
    connection.execute(
        update(serving_versions)
        .where(serving_versions.c.active.is_(True))
        .values(active=False, status="retired")
    )
    done = connection.execute(
        update(serving_versions)
        .where(serving_versions.c.version == version, serving_versions.c.status == "building")
        .values(
            active=True,
            status="active",
            semantic_id_version=semantic_id_version,
            model_version=None if model_version is None else str(model_version),
            kv_version=kv_version,
            activated_at=now,
        )
    )
    if done.rowcount != 1:
        raise RuntimeError(f"serving version {version} is no longer a building candidate")


def mark_failed(engine: Engine, version: int) -> None:
    with engine.begin() as connection:
        connection.execute(
            update(serving_versions)
            .where(serving_versions.c.version == version, serving_versions.c.status == "building")
            .values(status="failed")
        )


def _version(row) -> ServingVersion:
    return ServingVersion(
        version=int(row["version"]),
        status=row["status"],
        semantic_id_version=row["semantic_id_version"],
        model_version=row["model_version"],
        kv_version=row["kv_version"],
        event_cutoff_row=row["event_cutoff_row"],
        activated_at=row["activated_at"],
    )
