"""One training run (offline step, models): target + three drafts on the active semantic IDs.

Load the active semantic IDs and the leave-one-out split, train the target, the
SFT draft, the target's teacher beams, the AtSpeed-S and AtSpeed-R drafts,
measure them, save everything as a new model version and activate it. Used by
``genrec offline train`` (``offline/training/cli.py``) and by the refresh job
(``train_for_refresh``).

The training itself (``train_parts``: target, SFT draft, teacher beams, aligned drafts)
runs here with ``train.workers = 1``; with more it runs in that many data-parallel
Ray Train workers (``genrec.offline.training.ray_train``), each calling ``train_parts``
on its share of the data, and the models come back as safetensors. Measuring and saving
are the same either way.

Example::

    >>> version, metrics = train_models(settings, engine, preset_name="tiny")  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from genrec.offline.executor import executor_for
from genrec.offline.semantic_ids.build import load_active_semantic_ids
from genrec.offline.splits import load_split
from genrec.offline.training.draft import (
    ALIGNED_VARIANTS,
    TeacherData,
    align_draft,
    make_teacher_data,
    sample_training_prompts,
    train_sft_draft,
)
from genrec.offline.training.parallel import SINGLE, DataShard
from genrec.offline.training.target import evaluate_cases, plot_curves, train_target
from genrec.online.decoding.trie import ItemTrie
from genrec.online.models.generative import GenerativeModels, draft_agreement
from genrec.online.models.presets import (
    count_parameters,
    get_preset,
    pick_device,
    scratch_tokenizer,
)
from genrec.online.models.smollm2 import load_pretrained_with_items, pretrained_item_layout
from genrec.online.models.store import ModelBundle, load_model_version, save_model_version
from genrec.online.prompts import ItemTokens
from genrec.schemas.token_layout import TokenLayout

log = logging.getLogger("genrec.models")


def train_for_refresh(settings, engine, preset: str | None = None, target: bool = True) -> int:
    """Entry point of the refresh job: retrain everything, or only re-align the drafts.

    With progress: the longest step of a refresh (minutes) shows a bar on a terminal and,
    in a log file, a line every few seconds (infra/progress.py), not silence."""
    version, _ = train_models(settings, engine, preset_name=preset, train_target_model=target,
                              progress=True)  # fmt: skip
    return version


def train_models(
    settings,
    engine,
    preset_name: str | None = None,
    train_target_model: bool = True,
    overrides: dict[str, Any] | None = None,
    progress: bool = True,
    semantic_ids=None,
) -> tuple[int, dict[str, Any]]:
    """Train target + drafts, save and activate a model version; returns (version, metrics)."""
    config = settings.model
    torch.set_num_threads(config.torch_threads)
    chosen = {"teacher_prompts": config.teacher_prompts, "teacher_beams": config.teacher_beams}
    chosen.update({k: v for k, v in (overrides or {}).items() if v is not None})
    preset = get_preset(preset_name or config.preset).with_overrides(**chosen)
    if semantic_ids is None:
        semantic_ids = load_active_semantic_ids(engine, settings)
    split = load_split(engine, max_events=settings.train.max_events)
    item_tokens, tokenizer, base_model = _tokens_and_tokenizer(preset, semantic_ids)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="genrec-train-") as scratch:
        bundle_parts = _train_all(settings, engine, preset, split, item_tokens, base_model,
                                  train_target_model, Path(scratch), progress)  # fmt: skip
        metrics = {**bundle_parts["metrics"], "seconds_total": time.perf_counter() - started}
        metrics.update(
            train_events=_split_events(split), train_max_events=settings.train.max_events
        )
        bundle = ModelBundle(
            target=bundle_parts["target"], drafts=bundle_parts["drafts"], tokenizer=tokenizer,
            item_tokens=item_tokens, preset=preset.name, history_items=config.history_items,
            semantic_id_version=getattr(semantic_ids, "version", None),
            params={"preset": preset.to_dict(), "history_items": config.history_items,
                    "align_weight": config.align_weight, "seed": config.seed},
            metrics=metrics, plots=bundle_parts["plots"],
        )  # fmt: skip
        version = save_model_version(settings, engine, bundle)
    log.info("model version %s: %s", version, metrics)
    return version, metrics


def _split_events(split) -> int:
    """Events of the split's users (training, validation and test items together)."""
    return sum(len(split.test[u].history) + 1 if u in split.test else len(items)
               for u, items in split.train.items())  # fmt: skip


def _tokens_and_tokenizer(preset, semantic_ids):
    """The model's token layout, item tokens and tokenizer (plus the pretrained base model)."""
    codes_per_level = tuple(semantic_ids.layout.codes_per_level)
    if preset.pretrained is None:
        layout = TokenLayout.for_scratch_model(codes_per_level)
        return (
            ItemTokens(semantic_ids.item_ids, semantic_ids.codes, layout),
            scratch_tokenizer(layout),
            None,
        )

    layout = pretrained_item_layout(codes_per_level)
    model, tokenizer = load_pretrained_with_items(layout)
    return ItemTokens(semantic_ids.item_ids, semantic_ids.codes, layout), tokenizer, model


@dataclass
class TrainingInputs:
    """What ``train_parts`` reads: all of it is sent to every worker of a parallel run."""

    item_tokens: ItemTokens
    split: Any  # genrec.offline.splits.Split
    preset: Any  # genrec.online.models.presets.ModelPreset
    history_items: int
    seed: int
    beam_width: int
    align_weight: float
    base_model: Any = None  # the pretrained model to fine-tune (None: from scratch)
    target: Any = None  # the target to keep when it is not trained (drafts only)
    # OfflineSettings: where the teacher's batches run in a one-worker run (offline.executor)
    offline: Any = None
    item_vector_fit_max_items: int | None = None  # train.item_vector_fit_max_items


@dataclass
class TrainedParts:
    """The models one training run produced, with their figures and loss curves."""

    target: Any
    drafts: dict[str, Any]
    metrics: dict[str, Any] = field(default_factory=dict)
    curves: dict[str, dict[str, list[float]]] = field(default_factory=dict)  # plot -> curves


def train_parts(
    inputs: TrainingInputs, shard: DataShard = SINGLE, progress: bool = True
) -> TrainedParts:
    """Train the target (unless ``inputs.target`` is given), the SFT draft and both aligned drafts.

    ``shard``: this worker's place in a data-parallel run; every worker returns the same models.
    """
    preset, history, seed = inputs.preset, inputs.history_items, inputs.seed
    item_tokens, split = inputs.item_tokens, inputs.split
    metrics: dict[str, Any] = {}
    curves: dict[str, dict[str, list[float]]] = {}
    target = inputs.target
    if target is None:
        result = train_target(item_tokens, split, preset, history, model=inputs.base_model,
                              seed=seed, progress=progress, beam_width=inputs.beam_width,
                              shard=shard,
                              item_vector_fit_max_items=inputs.item_vector_fit_max_items)  # fmt: skip
        target = result.model
        metrics.update(target_seconds=result.seconds, target_params=count_parameters(target),
                       **{f"target_{k}": v for k, v in result.metrics.items()})  # fmt: skip
        curves["target_curves.png"] = result.curves
    sft = train_sft_draft(item_tokens, split, preset, history, seed=seed, progress=progress,
                          shard=shard,
                          item_vector_fit_max_items=inputs.item_vector_fit_max_items)  # fmt: skip
    drafts = {"sft": sft.model}
    metrics.update(sft_seconds=sft.seconds, draft_params=count_parameters(sft.model))
    started = time.perf_counter()
    tree = ItemTrie.from_item_tokens(item_tokens, pick_device())
    teacher = _teacher_data(target, inputs, tree, shard, progress)
    metrics["teacher_seconds"] = time.perf_counter() - started
    draft_curves = {"sft_train_loss": sft.curves["train_loss"]}
    for variant in ALIGNED_VARIANTS:
        aligned = align_draft(sft.model, teacher, variant, tree, preset, inputs.align_weight,
                              seed=seed, progress=progress, shard=shard)  # fmt: skip
        drafts[variant] = aligned.model
        metrics[f"{variant}_seconds"] = aligned.seconds
        draft_curves[f"{variant}_train_loss"] = aligned.curves["train_loss"]
    curves["draft_curves.png"] = draft_curves
    return TrainedParts(target, drafts, metrics, curves)


def _teacher_data(target, inputs: TrainingInputs, tree, shard: DataShard, progress: bool):
    """The target's beams for the sampled training prompts; each worker decodes its share."""
    prompts, truths = sample_training_prompts(inputs.split, inputs.item_tokens,
                                              inputs.history_items, inputs.preset.teacher_prompts,
                                              seed=inputs.seed)  # fmt: skip
    # a parallel run's workers each decode their share; one worker fans out per offline.executor
    executor = None if shard.parallel or inputs.offline is None else executor_for(inputs.offline)
    mine = make_teacher_data(target, inputs.item_tokens, tree, list(shard.take(prompts)),
                             list(shard.take(truths)), inputs.preset.teacher_beams,
                             progress=progress, executor=executor)  # fmt: skip
    if not shard.parallel:
        return mine
    return TeacherData(prompts, shard.gather_rows(mine.beams, len(prompts)),
                       shard.gather_rows(mine.truth, len(prompts)),
                       shard.gather_rows(mine.target_log_probs, len(prompts)))  # fmt: skip


def _train_all(settings, engine, preset, split, item_tokens, base_model, train_target_model,
               scratch: Path, progress: bool) -> dict[str, Any]:  # fmt: skip
    config = settings.model
    history = config.history_items
    inputs = TrainingInputs(
        item_tokens, split, preset, history, config.seed, config.beam_width, config.align_weight,
        base_model=base_model,
        target=None if train_target_model else _active_target(settings, engine, item_tokens),
        offline=settings.offline,
        item_vector_fit_max_items=settings.train.item_vector_fit_max_items,
    )  # fmt: skip
    if settings.train.workers > 1:
        from genrec.offline.training.ray_train import train_parts_on_ray

        parts = train_parts_on_ray(settings, inputs, progress=progress)
    else:
        parts = train_parts(inputs, progress=progress)
    target, metrics = parts.target, dict(parts.metrics)
    metrics["train_workers"] = settings.train.workers
    plots = {name: plot_curves(curves, scratch / name, _plot_title(name, preset.name))
             for name, curves in parts.curves.items()}  # fmt: skip
    device = pick_device()
    tree = ItemTrie.from_item_tokens(item_tokens, device)
    test_cases = [c for c in split.test.values() if c.target in item_tokens][: preset.eval_users]
    test = evaluate_cases(
        target, item_tokens, tree, test_cases, history, beam_width=config.beam_width
    )
    metrics.update({f"target_test_{k}": v for k, v in test.items()})
    log.info("target test %s", test)
    models = GenerativeModels(target, parts.drafts, item_tokens, history, preset.name,
                              device=device)  # fmt: skip
    valid_cases = [c for c in split.valid.values() if c.target in item_tokens]
    agreement_users = min(config.agreement_users, preset.eval_users or config.agreement_users)
    agreement = draft_agreement(models, valid_cases[:agreement_users], k=10)
    metrics["agreement_valid@10"] = agreement
    log.info("draft agreement %s", agreement)
    return {"target": target, "drafts": parts.drafts, "metrics": metrics, "plots": plots}


def _plot_title(name: str, preset: str) -> str:
    return f"target ({preset})" if name == "target_curves.png" else "drafts"


def _active_target(settings, engine, item_tokens):
    """The active version's target, checked to fit the current semantic IDs.

    A semantic-ID refresh keeps every existing item's ID and the layout, so the
    target still fits after new items were added; anything else needs a retrain.
    """

    active = load_model_version(settings, engine)
    old = active.item_tokens
    common = [i for i in old.item_ids if i in item_tokens]
    same_ids = all(
        np.array_equal(old.table[old.index[i]], item_tokens.table[item_tokens.index[i]])
        for i in common
    )
    if old.layout != item_tokens.layout or len(common) != len(old.item_ids) or not same_ids:
        raise ValueError(
            "the active target was trained on other semantic IDs: retrain it "
            "(genrec offline train without --drafts-only)"
        )
    return active.target
