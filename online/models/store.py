"""Model artifacts and the model version table (offline step, models).

A version is one target, its drafts, the tokenizer and the semantic IDs they
were trained on, stored as::

    data_dir/artifacts/models/v{n}/
        target/                     save_pretrained (safetensors) + tokenizer
        drafts/{sft,atspeed_s,atspeed_r}/
        semantic_ids.safetensors    codes [n_items, depth] (int64)
        manifest.json               preset, H, layout, item ids, metrics, params
        *.png                       loss curves

``save_model_version`` inserts a ``building`` row, writes everything into a
temporary folder, renames it to ``v{n}`` and only then activates the row (and
retires the previous one) in one transaction; a failure marks the row
``failed``. Readers (``load_model_version``) only ever see complete versions.

Example::

    >>> version = save_model_version(settings, engine, bundle)  # doctest: +SKIP
    >>> models = load_model_version(settings, engine)           # doctest: +SKIP
    >>> models = load_active_models(settings, engine)           # doctest: +SKIP
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.numpy import load_file, save_file
from sqlalchemy import Engine, insert, select, update
from transformers import AutoModelForCausalLM

from genrec.online.models.generative import GenerativeModels
from genrec.online.models.item_vectors import load_item_vectors, save_pretrained_with_item_vectors
from genrec.online.models.presets import pick_device
from genrec.online.prompts import ItemTokens
from genrec.schemas.tables import model_versions
from genrec.schemas.token_layout import TokenLayout

log = logging.getLogger("genrec.models")
FORMAT = "genrec.models/1"


class NoActiveModels(LookupError):
    """No model version is active yet: run ``genrec offline train``."""


@dataclass
class ModelBundle:
    """Everything one version holds, as produced by ``genrec offline train``."""

    target: Any
    drafts: dict[str, Any]
    tokenizer: Any
    item_tokens: ItemTokens
    preset: str
    history_items: int
    semantic_id_version: Any = None
    params: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    plots: dict[str, Path] = field(default_factory=dict)  # file name -> PNG written elsewhere


def models_root(settings) -> Path:
    return Path(settings.data_dir) / "artifacts" / "models"


def save_model_version(settings, engine: Engine, bundle: ModelBundle, activate: bool = True) -> int:
    """Write ``bundle`` as a new version and (by default) make it the active one."""
    with engine.begin() as connection:
        version = connection.execute(
            insert(model_versions).values(
                preset=bundle.preset,
                semantic_id_version=_str_or_none(bundle.semantic_id_version),
                status="building",
                params=bundle.params,
                created_at=datetime.now(UTC),
            )
        ).inserted_primary_key[0]
    root = models_root(settings)
    final = root / f"v{version}"
    scratch = root / f".v{version}.building"
    try:
        shutil.rmtree(scratch, ignore_errors=True)
        _write_artifacts(scratch, bundle)
        if final.exists():
            raise FileExistsError(f"model artifact folder already exists: {final}")
        scratch.rename(final)
        stored = settings.stored_path(final)
        if activate:
            activate_model_version(engine, version, bundle.metrics, stored)
        else:
            _set(engine, version, status="complete", metrics=bundle.metrics, artifact_dir=stored)
    except BaseException as exc:
        shutil.rmtree(scratch, ignore_errors=True)
        _set(engine, version, status="failed", error=f"{type(exc).__name__}: {exc}"[:2000])
        raise
    log.info("model version %s saved in %s", version, final)
    return int(version)


def activate_model_version(engine: Engine, version: int, metrics: dict, folder: str) -> None:
    """Retire the active version and activate ``version``, in one transaction; ``folder``
    as the row keeps it (``Settings.stored_path``)."""
    now = datetime.now(UTC)
    with engine.begin() as connection:
        connection.execute(
            update(model_versions)
            .where(model_versions.c.status == "active")
            .values(status="retired")
        )
        connection.execute(
            update(model_versions)
            .where(model_versions.c.version == version)
            .values(status="active", metrics=metrics, artifact_dir=folder, activated_at=now)
        )


def _set(engine: Engine, version: int, **values: Any) -> None:
    with engine.begin() as connection:
        connection.execute(
            update(model_versions).where(model_versions.c.version == version).values(**values)
        )


def _write_artifacts(folder: Path, bundle: ModelBundle) -> None:
    folder.mkdir(parents=True)
    save_pretrained_with_item_vectors(bundle.target, folder / "target")
    bundle.tokenizer.save_pretrained(folder / "target")
    for variant, draft in bundle.drafts.items():
        save_pretrained_with_item_vectors(draft, folder / "drafts" / variant)
        bundle.tokenizer.save_pretrained(folder / "drafts" / variant)
    save_file({"codes": _codes(bundle.item_tokens)}, str(folder / "semantic_ids.safetensors"))
    manifest = {
        "format": FORMAT,
        "preset": bundle.preset,
        "history_items": bundle.history_items,
        "semantic_id_version": _str_or_none(bundle.semantic_id_version),
        "layout": json.loads(bundle.item_tokens.layout.to_json()),
        "item_ids": bundle.item_tokens.item_ids,
        "drafts": sorted(bundle.drafts),
        "params": bundle.params,
        "metrics": bundle.metrics,
    }
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1, default=str))
    (folder / "metrics.json").write_text(json.dumps(bundle.metrics, indent=1, default=str))
    for name, path in bundle.plots.items():
        if Path(path).exists():
            shutil.copyfile(path, folder / name)


def _codes(item_tokens: ItemTokens) -> np.ndarray:
    layout = item_tokens.layout
    offsets = np.asarray([layout.level_start(i) for i in range(layout.depth)], dtype=np.int64)
    return np.ascontiguousarray(item_tokens.table - offsets)


def _str_or_none(value: Any) -> str | None:
    return None if value is None else str(value)


# --- reading --------------------------------------------------------------------------


def active_model_row(engine: Engine):
    with engine.connect() as connection:
        return connection.execute(
            select(model_versions).where(model_versions.c.status == "active")
        ).first()


def load_model_version(
    settings,
    engine: Engine,
    version: int | None = None,
    device: torch.device | str | None = None,
    folder: Path | None = None,
) -> GenerativeModels:
    """A saved version (default: the active one) as ``GenerativeModels``, in eval mode.

    ``folder``: a copy of the version's artifact folder to read instead of the one its row
    names (a worker's fetched copy, ``genrec.online.serving_artifacts``)."""
    with engine.connect() as connection:
        query = select(model_versions)
        if version is None:
            query = query.where(model_versions.c.status == "active")
        else:
            query = query.where(model_versions.c.version == version)
        row = connection.execute(query).first()
    if row is None:
        what = "active model version" if version is None else f"model version {version}"
        raise NoActiveModels(f"no {what}: run `genrec offline train` first")
    if row.status not in ("active", "complete", "retired"):
        raise NoActiveModels(f"model version {row.version} is {row.status}, not complete")
    folder = Path(folder) if folder is not None else settings.resolve_stored(row.artifact_dir)
    models = load_model_folder(folder, device, version=int(row.version))
    models.beam_width = settings.model.beam_width
    return models


def load_active_models(settings, engine: Engine) -> GenerativeModels:
    """The active model version (target + drafts) ready for decoding."""
    return load_model_version(settings, engine)


def load_model_folder(
    folder: Path, device: torch.device | str | None = None, version: int | None = None
) -> GenerativeModels:
    """Load a version's artifact folder (no database needed)."""
    manifest = json.loads((folder / "manifest.json").read_text())
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{folder}: not a genrec model folder ({manifest.get('format')!r})")
    device = torch.device(device) if device is not None else pick_device()
    layout = TokenLayout.from_json(json.dumps(manifest["layout"]))
    codes = load_file(str(folder / "semantic_ids.safetensors"))["codes"]
    item_tokens = ItemTokens(manifest["item_ids"], codes, layout)

    def load(path: Path):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        return model.to(device).eval()

    paths = {"target": folder / "target"}
    paths.update({variant: folder / "drafts" / variant for variant in manifest["drafts"]})
    models = GenerativeModels(
        target=load(paths["target"]),
        drafts={variant: load(paths[variant]) for variant in manifest["drafts"]},
        item_tokens=item_tokens,
        history_items=int(manifest["history_items"]),
        preset=manifest["preset"],
        version=version,
        semantic_id_version=manifest.get("semantic_id_version"),
        device=device,
        metrics=manifest.get("metrics") or {},
    )
    for which, path in paths.items():  # the decoder's trie also finds the items vectors go to
        load_item_vectors(models.model(which), path, models.tree)
    return models
