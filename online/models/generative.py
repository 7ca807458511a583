"""The generative branch: top-K items from the target (or a draft) by constrained beam search.

Owned by the offline models step; used by ``genrec eval``, for teacher data and
for draft agreement. Decoding is the online engine's (``genrec.online``): the
trie of valid semantic IDs (``ItemTrie``, ``ItemTrie.from_item_tokens`` for an
``ItemTokens`` catalog) and its batched engine (``batched_beam_search``), so offline metrics and
serving rank items identically. Scores are sums of log-probabilities renormalized over
the valid children at each level (``score_mode="allowed"``), i.e. the model's
distribution over items; seen items are masked at the last level.

Example::

    >>> from genrec.infra.database import make_engine
    >>> from genrec.infra.settings import get_settings
    >>> from genrec.offline.splits import load_split
    >>> settings = get_settings()
    >>> engine = make_engine(settings.database_url)
    >>> from genrec.online.models.store import load_active_models
    >>> models = load_active_models(settings, engine)  # doctest: +SKIP
    >>> cases = list(load_split(engine).test.values())[:4]
    >>> recommend_generative(models, cases, k=10)  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from genrec.infra.progress import progress_bar
from genrec.online.decoding.engine import batched_beam_search, strict_acceptance_per_level
from genrec.online.decoding.trie import ItemTrie
from genrec.online.prompts import ItemTokens, history_prompt
from genrec.schemas.token_layout import TokenLayout

VARIANTS = ("target", "sft", "atspeed_s", "atspeed_r")
DRAFT_VARIANTS = ("sft", "atspeed_s", "atspeed_r")


@dataclass
class BeamResult:
    """Per prompt: ``item_index`` [B, K] (-1 where fewer than K items exist) and ``scores``."""

    item_index: torch.Tensor
    scores: torch.Tensor
    tokens: torch.Tensor  # [B, K, depth] token ids of the items (padding where item_index < 0)
    step_acceptance: list[list[bool]] = field(default_factory=list)  # per level, per prompt


def _left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device) -> tuple[torch.Tensor, ...]:
    """(ids, attention mask, positions) of left-padded prompts (teacher-forced scoring)."""
    if any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt: a prompt starts with BOS")
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.as_tensor(list(prompt))
        mask[row, width - len(prompt) :] = 1
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    return ids.to(device), mask.to(device), positions.to(device)


def decode_batched(
    model,
    tree: ItemTrie,
    prompts: Sequence[Sequence[int]],
    beam_width: int,
    exclude: Sequence[Sequence[int]] | None = None,
    batch_size: int = 64,
    shadow=None,
    shadow_width: int | None = None,
    progress: bool = False,
) -> BeamResult:
    """The online ``batched_beam_search`` over many prompts in batches of similar length (input order kept).

    ``exclude[b]``: item indices prompt ``b`` must not get (e.g. already seen).
    ``shadow``: a draft whose top-``shadow_width`` expansion of the target's
    beams is compared with the target's top-K at every level (strict
    acceptance, ``strict_acceptance_per_level``); the draft never changes the result.
    """
    if not prompts:
        raise ValueError("no prompts to decode")
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    parts: list[BeamResult] = []
    starts = range(0, len(order), batch_size)
    for start in progress_bar(starts, desc="beam search", disable=not progress, leave=False):
        rows = order[start : start + batch_size]
        batch = [list(prompts[i]) for i in rows]
        excluded = [exclude[i] for i in rows] if exclude is not None else None
        acceptance: list[list[bool]] = []
        if shadow is None:
            result = batched_beam_search(
                model, batch, tree, tree.layout, beam_width, exclude=excluded
            )
        else:
            result, acceptance = strict_acceptance_per_level(
                model, shadow, batch, tree, tree.layout, beam_width,
                n_draft=shadow_width or beam_width, exclude=excluded,
            )  # fmt: skip
        parts.append(
            BeamResult(
                result.item_index.cpu(), result.scores.cpu(), result.tokens.cpu(), acceptance
            )
        )
    inverse = torch.as_tensor(np.argsort(order))
    levels = len(parts[0].step_acceptance)
    in_order = [sum((part.step_acceptance[level] for part in parts), []) for level in range(levels)]
    return BeamResult(
        torch.cat([p.item_index for p in parts])[inverse],
        torch.cat([p.scores.float() for p in parts])[inverse],
        torch.cat([p.tokens for p in parts])[inverse],
        [[accepted[j] for j in inverse.tolist()] for accepted in in_order],
    )


# --- the generative branch ----------------------------------------------------


@dataclass
class GenerativeModels:
    """An active model version: target, drafts and the semantic IDs they were trained on."""

    target: Any
    drafts: dict[str, Any]
    item_tokens: ItemTokens
    history_items: int
    preset: str
    version: int | None = None
    semantic_id_version: Any = None
    beam_width: int = 20
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    metrics: dict[str, Any] = field(default_factory=dict)  # the version's training metrics
    tree: ItemTrie = field(init=False)

    def __post_init__(self) -> None:
        self.tree = ItemTrie.from_item_tokens(self.item_tokens, self.device)

    @property
    def layout(self) -> TokenLayout:
        return self.item_tokens.layout

    def model(self, which: str):
        if which == "target":
            return self.target
        if which not in self.drafts:
            raise ValueError(f"unknown model {which!r}; have target and {sorted(self.drafts)}")
        return self.drafts[which]

    def prompt(self, history: Sequence[str]) -> list[int]:
        return history_prompt(history, self.item_tokens, self.history_items)

    def drafts_for(self, mode: str) -> list[str]:
        """This version's drafts, best first, for speculative decoding in ``mode``.

        Strict verification gains from acceptance alone, so for ``strict`` the drafts
        are ranked by the strict acceptance training measured for them on validation
        users (``agreement_valid@10``, mean over steps): which variant wins depends on
        the target, the IDs and ``model.align_weight`` (docs/decoding.md, "Which draft
        speculates"). Without those figures: AtSpeed-S, then SFT. ``relaxed``:
        AtSpeed-R, then SFT.
        """
        if mode == "relaxed":
            order = ["atspeed_r", "sft"]
        else:
            measured = {
                name: float(np.mean(row["strict_acceptance_per_step"]))
                for name, row in self.metrics.get("agreement_valid@10", {}).items()
                if name in self.drafts and row.get("strict_acceptance_per_step")
            }
            order = [*sorted(measured, key=lambda n: -measured[n]), "atspeed_s", "sft"]
        return [n for n in dict.fromkeys([*order, *sorted(self.drafts)]) if n in self.drafts]


def recommend_generative(
    models: GenerativeModels,
    cases: Sequence,
    k: int,
    which: str = "target",
    exclude_history: bool = True,
    beam_width: int | None = None,
    batch_size: int = 64,
    progress: bool = False,
) -> list[list[tuple[str, float]]]:
    """Top-``k`` (item_id, log-probability) per case from its history (``Case.history``).

    Items already in the history are excluded (as for every branch) unless
    ``exclude_history`` is False; the beam is ``max(k, beam_width)`` wide.
    """
    width = max(k, beam_width or models.beam_width)
    prompts = [models.prompt(case.history) for case in cases]
    exclude = None
    if exclude_history:
        index = models.item_tokens.index
        exclude = [[index[i] for i in set(case.history) if i in index] for case in cases]
    result = decode_batched(
        models.model(which), models.tree, prompts, width, exclude, batch_size, progress=progress
    )
    recommendations = []
    for items, scores in zip(result.item_index.tolist(), result.scores.tolist(), strict=True):
        row = [
            (models.item_tokens.item_ids[i], s)
            for i, s in zip(items, scores, strict=False)
            if i >= 0
        ]
        recommendations.append(row[:k])
    return recommendations


def draft_agreement(
    models: GenerativeModels,
    cases: Sequence,
    k: int,
    draft_width: int | None = None,
    batch_size: int = 64,
) -> dict[str, dict[str, Any]]:
    """How well each draft matches the target's top-``k`` beams on ``cases``.

    ``topk_overlap``: mean |target top-k ∩ draft top-k| / k of the two full beam
    searches (no exclusion). ``strict_acceptance_per_step``: per level, the share
    of cases where all k target beams are among the draft's top-``draft_width``
    expansions of the target's current beams, scored as the first step of a
    speculative round (``strict_acceptance_per_level``; default width
    ``max(k, 40)``: the N=40 draft beams of the AtSpeed paper and of the online
    decoder).
    """
    prompts = [models.prompt(case.history) for case in cases]
    width = draft_width or max(k, 40)
    target_sets: list[set[int]] | None = None
    report: dict[str, dict[str, Any]] = {}
    for variant, draft in models.drafts.items():
        shadowed = decode_batched(
            models.target, models.tree, prompts, k, batch_size=batch_size,
            shadow=draft, shadow_width=width,
        )  # fmt: skip
        if target_sets is None:  # the target's beams do not depend on the shadow
            target_sets = [set(row) - {-1} for row in shadowed.item_index.tolist()]
        own = decode_batched(draft, models.tree, prompts, k, batch_size=batch_size)
        overlap = [
            len(target & set(row)) / k
            for target, row in zip(target_sets, own.item_index.tolist(), strict=True)
        ]
        report[variant] = {
            "topk_overlap": float(np.mean(overlap)) if overlap else 0.0,
            "strict_acceptance_per_step": [
                float(np.mean(level)) if level else 0.0 for level in shadowed.step_acceptance
            ],
        }
    return report
