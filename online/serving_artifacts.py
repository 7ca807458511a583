"""Which files make up a serving version, and where a worker reads them (online step).

A worker loads, for the serving version it switches to, the model version it pins (target,
drafts, tokenizer and ``semantic_ids.safetensors``: the semantic IDs the model was trained
on) and the fitted recall branches. With ``artifacts.store = local`` it reads them where
they were written: the folder ``model_versions.artifact_dir`` names and
``recall.artifacts_dir`` (one volume shared with the refresh). With ``database`` the
refresh publishes them as the serving version's files (``publish_serving_version``,
before activation), laid out as::

    model/target/..., model/drafts/<variant>/..., model/semantic_ids.safetensors, ...
    recall/<branch>/manifest.json, recall/<branch>/arrays.npz

and the worker reads its cached copy of that tree (``resolve_serving_artifacts``), fetched
from the database on version switch (``genrec.infra.artifact_store``).

Example::

    >>> artifacts = resolve_serving_artifacts(settings, engine, pinned)  # doctest: +SKIP
    >>> models = load_model_version(settings, engine, 3, folder=artifacts.model_dir)  # doctest: +SKIP
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, select

from genrec.infra.artifact_store import ArtifactMissing, folder_files, open_artifact_store
from genrec.infra.serving_versions import ServingVersion
from genrec.schemas.tables import model_versions

log = logging.getLogger(__name__)

MODEL = "model"
RECALL = "recall"


@dataclass(frozen=True)
class ServingArtifacts:
    """Where one serving version's files are; None: where the database and settings name
    them (``artifacts.store = local``)."""

    model_dir: Path | None = None
    recall_root: Path | None = None


def recall_root(settings) -> Path:
    """The folder the refresh fits recall branches into (one folder per branch)."""
    return Path(settings.recall.artifacts_dir or settings.path("recall", "x").parent)


def serving_files(model_dir: Path, recall: Path) -> dict[str, Path]:
    """A serving version's files by published path: the model folder and every fitted
    recall branch (a folder with a ``manifest.json``)."""
    files = folder_files(model_dir, MODEL)
    for branch in sorted(p for p in Path(recall).glob("*") if (p / "manifest.json").is_file()):
        files.update(folder_files(branch, f"{RECALL}/{branch.name}"))
    return files


def model_artifact_dir(settings, engine: Engine, model_version: Any) -> Path:
    query = select(model_versions.c.artifact_dir).where(
        model_versions.c.version == int(model_version)
    )
    with engine.connect() as connection:
        folder = connection.execute(query).scalar()
    if not folder:
        raise RuntimeError(f"model version {model_version} has no artifact folder")
    return settings.resolve_stored(folder)


def publish_serving_version(
    settings, engine: Engine, version: int, model_version: Any
) -> dict[str, int] | None:
    """Publish serving version ``version``'s files to ``artifacts.store`` (the refresh calls
    this before it activates the version); None where the store is ``local``."""
    store = open_artifact_store(settings, engine)
    if store is None:
        return None
    if model_version is None:
        raise RuntimeError(f"serving version {version} pins no model version: nothing to serve")
    files = serving_files(
        model_artifact_dir(settings, engine, model_version), recall_root(settings)
    )
    return store.publish(version, files)


def resolve_serving_artifacts(settings, engine: Engine, pinned: ServingVersion) -> ServingArtifacts:
    """Where the worker reads ``pinned``'s files; with ``artifacts.store = database`` the
    local copy, fetched now for the files the cache lacks (verified, see the store)."""
    store = open_artifact_store(settings, engine)
    if store is None:
        return ServingArtifacts()
    try:
        tree = store.fetch(pinned.version)
    except ArtifactMissing as exc:
        raise RuntimeError(
            f"{exc}: serving version {pinned.version} was activated without publishing its "
            "artifacts; run `genrec offline refresh` with GENREC_ARTIFACTS__STORE=database"
        ) from exc
    log.info("serving version %d: artifacts in %s", pinned.version, tree)
    return ServingArtifacts(model_dir=tree / MODEL, recall_root=tree / RECALL)
