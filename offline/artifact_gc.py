"""Garbage collection of old model and semantic-ID versions (offline step, refresh).

Every refresh that retrains writes a model version (a SmolLM2-sized one is
~0.5 GB on disk) and every semantic-ID refresh a semantic-ID version, so
without collection a daily schedule fills the disk. After an activation the
refresh keeps what any of the ``keep_versions`` most recent serving versions
pins (a worker may still serve the previous one for a few seconds, and it is
the rollback target), plus the active model and semantic-ID versions and
anything newer than those, and collects what is older: the artifact folder is
deleted, the row stays (status ``collected``) as the history of what ran, and
a semantic-ID version's item rows are deleted. Where the refresh publishes artifacts into
the database (``artifacts.store = database``), ``collect_published_artifacts`` deletes the
file lists of serving versions that are not kept and every blob no kept version uses.

Example::

    >>> from genrec.infra.database import make_engine
    >>> from genrec.infra.settings import Settings
    >>> collect_old_versions(Settings(), make_engine("sqlite:///:memory:"), keep_serving=[])
    {'model_versions_collected': 0, 'semantic_id_versions_collected': 0}
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterable
from pathlib import Path

from sqlalchemy import Engine, delete, select, update

from genrec.infra.artifact_store import collect_published
from genrec.schemas.tables import (
    model_versions,
    semantic_id_items,
    semantic_id_versions,
    serving_versions,
)

log = logging.getLogger(__name__)

COLLECTED = "collected"
_NEVER_COLLECTED = ("building", "active", COLLECTED)  # a run in flight, the live one, done


def collect_old_versions(settings, engine: Engine, keep_serving: Iterable[int]) -> dict[str, int]:
    """Collect model and semantic-ID versions older than everything still needed.

    ``keep_serving``: serving versions whose pinned versions stay (the refresh
    passes its ``keep_versions`` most recently activated). Nothing is collected
    while no serving version is kept. Returns how many of each were collected. Only
    folders under ``settings.data_dir`` are deleted: a row written before artifact paths
    were stored relative may name another store's folder (this one copied or restored
    elsewhere), which is left in place with a warning.
    """
    needed_models, needed_sids = _needed(engine, [int(v) for v in keep_serving])
    counts = {}
    for table, needed, key in (
        (model_versions, needed_models, "model_versions_collected"),
        (semantic_id_versions, needed_sids, "semantic_id_versions_collected"),
    ):
        # Only versions older than the oldest one still needed: a newer inactive one may
        # be a build that a run is about to activate.
        old = _collectable(engine, table, min(needed)) if needed else []
        for version, folder in old:
            _collect(engine, table, int(version), _own_folder(settings, folder))
        counts[key] = len(old)
    if any(counts.values()):
        log.info("collected %s", counts)
    return counts


def collect_published_artifacts(engine: Engine, keep_serving: Iterable[int]) -> dict[str, int]:
    """Delete the published files (``artifacts.store = database``) of serving versions not
    in ``keep_serving``, and the blobs only they used; run, like the rest, after activation
    under the refresh lock (a blob published by a run in flight would look unused)."""
    return collect_published(engine, keep_serving)


def _collectable(engine: Engine, table, below: int) -> list:
    """(version, artifact_dir) of the versions of ``table`` below ``below`` not yet collected."""
    where = [table.c.version < below, table.c.status.not_in(_NEVER_COLLECTED)]
    if table is semantic_id_versions:
        where.append(table.c.active.is_(False))
    with engine.connect() as connection:
        return connection.execute(select(table.c.version, table.c.artifact_dir).where(*where)).all()


def _needed(engine: Engine, keep_serving: list[int]) -> tuple[set[int], set[int]]:
    """Model and semantic-ID versions pinned by the kept serving versions, or active."""
    if not keep_serving:
        return set(), set()
    with engine.connect() as connection:
        pinned = connection.execute(
            select(serving_versions.c.model_version, serving_versions.c.semantic_id_version).where(
                serving_versions.c.version.in_(keep_serving)
            )
        ).all()
        active_model = connection.execute(
            select(model_versions.c.version).where(model_versions.c.status == "active")
        ).all()
        active_sid = connection.execute(
            select(semantic_id_versions.c.version).where(semantic_id_versions.c.active.is_(True))
        ).all()
        models = {_number(m) for m, _ in pinned} | {_number(m) for (m,) in active_model}
        models.discard(None)
        # A kept model carries the semantic IDs it was trained on: they stay too.
        model_sids = connection.execute(
            select(model_versions.c.semantic_id_version).where(model_versions.c.version.in_(models))
        ).all()
    sids = {_number(s) for _, s in pinned} | {_number(s) for (s,) in model_sids}
    sids |= {_number(s) for (s,) in active_sid}
    sids.discard(None)
    return models, sids


def _collect(engine: Engine, table, version: int, folder: Path | None) -> None:
    """Mark the row collected and its item rows gone (one transaction), then delete its folder."""
    with engine.begin() as connection:
        connection.execute(update(table).where(table.c.version == version).values(status=COLLECTED))
        if table is semantic_id_versions:
            connection.execute(
                delete(semantic_id_items).where(semantic_id_items.c.version == version)
            )
    if folder:
        shutil.rmtree(folder, ignore_errors=True)


def _own_folder(settings, stored: str | None) -> Path | None:
    """The folder a row names, where it is this store's (under its data directory)."""
    if not stored:
        return None
    folder = settings.resolve_stored(stored)
    if not folder.is_relative_to(settings.data_dir):
        log.warning("not deleting %s: it is outside this store's data directory", folder)
        return None
    return folder


def _number(value) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None
