"""End to end: the tiny preset trains target + drafts on real ML-100K users in seconds."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from sqlalchemy import func, select

from genrec.offline.splits import load_split
from genrec.offline.training.run import train_models
from genrec.offline.training.target import train_target
from genrec.online.models.generative import (
    GenerativeModels,
    draft_agreement,
    recommend_generative,
)
from genrec.online.models.presets import PRESETS, scratch_tokenizer
from genrec.online.models.store import (
    ModelBundle,
    load_active_models,
    load_model_folder,
    load_model_version,
    save_model_version,
)
from genrec.online.prompts import ItemTokens
from genrec.schemas.tables import events, model_versions
from tests.helpers import tiny_settings


@pytest.mark.slow
def test_tiny_preset_trains_end_to_end(ml100k_sample_store, synthetic_semantic_ids, tmp_path):
    settings = tiny_settings(tmp_path)
    version, metrics = train_models(
        settings, ml100k_sample_store, semantic_ids=synthetic_semantic_ids, progress=False
    )
    assert version == 1
    assert set(metrics["agreement_valid@10"]) == {"sft", "atspeed_s", "atspeed_r"}
    assert 0.0 <= metrics["target_test_hr@10"] <= 1.0
    with ml100k_sample_store.connect() as connection:
        row = connection.execute(select(model_versions)).one()
        stored = connection.execute(select(func.count()).select_from(events)).scalar_one()
    # the default window (train.max_events) holds the whole sample; a smaller one cuts it
    assert metrics["train_events"] == stored and metrics["train_max_events"] >= stored
    window = load_split(ml100k_sample_store, max_events=1000)
    assert (
        sum(len(c.history) + 1 for c in window.test.values())
        + sum(len(items) for user, items in window.train.items() if user not in window.test)
        == 1000
    )
    assert row.status == "active" and row.semantic_id_version == "7" and row.activated_at
    folder = settings.data_dir / "artifacts" / "models" / "v1"
    for part in (
        "target/model.safetensors",
        "target/tokenizer.json",
        "drafts/atspeed_s/config.json",
        "semantic_ids.safetensors",
        "manifest.json",
        "target_curves.png",
        "draft_curves.png",
    ):
        assert (folder / part).exists(), part  # fmt: skip

    models = load_active_models(settings, ml100k_sample_store)
    assert models.version == 1 and sorted(models.drafts) == ["atspeed_r", "atspeed_s", "sft"]
    # the reloaded version carries its training metrics: the worker ranks its drafts by them
    assert models.metrics["agreement_valid@10"] == metrics["agreement_valid@10"]
    assert sorted(models.drafts_for("strict")) == ["atspeed_r", "atspeed_s", "sft"]
    cases = list(load_split(ml100k_sample_store).test.values())
    for which in ("target", "sft", "atspeed_s", "atspeed_r"):
        for case, recs in zip(
            cases, recommend_generative(models, cases, 10, which=which), strict=True
        ):
            assert len(recs) == 10
            real_items = set(synthetic_semantic_ids.item_ids)
            assert {item for item, _ in recs} <= real_items  # real items only
            assert not {item for item, _ in recs} & set(case.history)  # seen items excluded
    agreement = draft_agreement(models, cases[:8], k=5)
    assert len(agreement["sft"]["strict_acceptance_per_step"]) == 3

    # Re-aligning the drafts keeps the target and activates a new version (CLI-style overrides).
    overrides = {"max_steps": None, "epochs": None, "draft_epochs": 1, "teacher_prompts": 12}
    version2, _ = train_models(settings, ml100k_sample_store, train_target_model=False,
                               overrides=overrides, semantic_ids=synthetic_semantic_ids,
                               progress=False)  # fmt: skip
    with ml100k_sample_store.connect() as connection:
        statuses = dict(
            connection.execute(select(model_versions.c.version, model_versions.c.status)).all()
        )
    assert statuses == {1: "retired", version2: "active"}


@pytest.mark.slow
def test_saved_artifacts_reload_with_identical_topk(
    ml100k_sample_store, synthetic_semantic_ids, tmp_path
):
    torch.manual_seed(0)
    settings = tiny_settings(tmp_path)
    layout = synthetic_semantic_ids.layout
    item_tokens = ItemTokens(synthetic_semantic_ids.item_ids, synthetic_semantic_ids.codes, layout)
    split = load_split(ml100k_sample_store)
    target = train_target(item_tokens, split, PRESETS["tiny"], 10, progress=False).model
    draft = train_target(item_tokens, split, PRESETS["tiny"], 10, progress=False, seed=1).model
    in_memory = GenerativeModels(target, {"sft": draft}, item_tokens, 10, "tiny")
    cases = list(split.test.values())
    before = recommend_generative(in_memory, cases, 10)
    bundle = ModelBundle(target, {"sft": draft}, scratch_tokenizer(layout), item_tokens, "tiny", 10)
    version = save_model_version(settings, ml100k_sample_store, bundle)
    reloaded = load_model_folder(settings.data_dir / "artifacts" / "models" / f"v{version}")
    after = recommend_generative(reloaded, cases, 10)
    assert [[i for i, _ in row] for row in after] == [[i for i, _ in row] for row in before]
    assert np.allclose([[s for _, s in row] for row in after], [[s for _, s in row] for row in before],
                       atol=1e-4)  # fmt: skip
    sft_after = recommend_generative(reloaded, cases, 10, which="sft")
    sft_before = recommend_generative(in_memory, cases, 10, which="sft")
    assert [[i for i, _ in row] for row in sft_after] == [[i for i, _ in row] for row in sft_before]
    assert np.allclose([[s for _, s in row] for row in sft_after],
                       [[s for _, s in row] for row in sft_before], atol=1e-4)  # fmt: skip
    # The row names the folder relative to the data directory: a moved store still loads.
    with ml100k_sample_store.connect() as connection:
        stored = connection.execute(select(model_versions.c.artifact_dir).where(
            model_versions.c.version == version)).scalar()  # fmt: skip
    assert stored == f"artifacts/models/v{version}"
    moved = tmp_path / "moved"
    shutil.move(settings.data_dir, moved)
    from_moved = load_model_version(
        settings.model_copy(update={"data_dir": moved}), ml100k_sample_store, version
    )
    assert recommend_generative(from_moved, cases, 10) == after


def test_cli_registers_offline_train():
    from genrec.app.cli import build_parser

    args = build_parser().parse_args(["offline", "train", "--preset", "tiny", "--max-steps", "3"])
    assert args.preset == "tiny" and args.max_steps == 3 and callable(args.handler)
    assert not args.train_only
    assert build_parser().parse_args(["offline", "train", "--train-only"]).train_only
