"""The generative branch: top-K items from the target (or a draft) by constrained beam search.

Owned by the offline models step; used by ``genrec eval`` and as the reference
decoder for teacher data and draft agreement. ``beam_search`` is batched (left
padded prompts, one prefill, then one step per semantic-ID level with a KV
cache) and constrained by a prefix tree of the valid semantic IDs, so every
result is a real item. Scores are sums of log-probabilities renormalized over
the valid children at each level, i.e. the model's distribution over items.

Example::

    >>> from genrec.infra.database import make_engine
    >>> from genrec.infra.settings import get_settings
    >>> from genrec.offline.splits import load_split
    >>> settings = get_settings()
    >>> engine = make_engine(settings.database_url)
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
from tqdm.auto import tqdm

from genrec.offline.models import item_logits
from genrec.offline.prompts import ItemTokens, history_prompt
from genrec.schemas.token_layout import TokenLayout

VARIANTS = ("target", "sft", "atspeed_s", "atspeed_r")
DRAFT_VARIANTS = ("sft", "atspeed_s", "atspeed_r")


class PrefixTree:
    """Valid semantic IDs as one child table per level.

    ``children[level][node, code]`` is the node reached from prefix ``node`` by
    ``code`` (-1 if no item has that prefix); at the last level it is the item's
    index in ``item_tokens``. Level 0 has the single root node 0.
    """

    def __init__(self, item_tokens: ItemTokens, device: torch.device | str = "cpu") -> None:
        layout = item_tokens.layout
        offsets = np.asarray([layout.level_start(i) for i in range(layout.depth)])
        codes = item_tokens.table - offsets
        node = np.zeros(len(codes), dtype=np.int64)
        num_nodes = 1
        self.children: list[torch.Tensor] = []
        for level, size in enumerate(layout.codes_per_level):
            table = np.full((num_nodes, size), -1, dtype=np.int64)
            if level == layout.depth - 1:
                table[node, codes[:, level]] = np.arange(len(codes))
            else:
                unique, inverse = np.unique(node * size + codes[:, level], return_inverse=True)
                table[node, codes[:, level]] = inverse
                node, num_nodes = inverse.reshape(-1), len(unique)
            self.children.append(torch.as_tensor(table, device=device))
        self.layout = layout

    def to(self, device: torch.device | str) -> PrefixTree:
        self.children = [table.to(device) for table in self.children]
        return self


@dataclass
class BeamResult:
    """Per prompt: ``item_index`` [B, K] (-1 where fewer than K items exist) and ``scores``."""

    item_index: torch.Tensor
    scores: torch.Tensor
    tokens: torch.Tensor  # [B, K, depth] token ids of the items (garbage where item_index < 0)
    step_acceptance: list[list[bool]] = field(default_factory=list)  # per level, per prompt


def _left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device) -> tuple[torch.Tensor, ...]:
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


class _Decoder:
    """One model's KV cache following the target's beams step by step."""

    def __init__(self, model, layout: TokenLayout, prompts, device) -> None:
        self.model, self.layout = model, layout
        ids, self.mask, positions = _left_pad(prompts, layout.pad_token_id, device)
        logits, self.cache = item_logits(model, layout, ids, self.mask, positions, use_cache=True)
        self.last_position = positions[:, -1]
        self.logits = logits[:, -1:].float()  # [B, beams, V]

    def advance(self, flat_parent: torch.Tensor, tokens: torch.Tensor) -> None:
        """Keep rows ``flat_parent`` (beams may repeat) and feed one token per row."""
        self.cache.batch_select_indices(flat_parent)
        ones = torch.ones_like(self.mask[flat_parent, :1])
        self.mask = torch.cat([self.mask[flat_parent], ones], dim=1)
        self.last_position = self.last_position[flat_parent] + 1
        logits, self.cache = item_logits(
            self.model, self.layout, tokens.view(-1, 1), self.mask,
            self.last_position.view(-1, 1), self.cache, use_cache=True,
        )  # fmt: skip
        batch = tokens.shape[0]
        self.logits = logits[:, -1].float().view(batch, -1, logits.shape[-1])


def _level_log_probs(logits, nodes, tree: PrefixTree, level: int) -> torch.Tensor:
    """[B, beams, C_level] log-probs renormalized over valid children (-inf elsewhere)."""
    layout = tree.layout
    start = layout.level_start(level) - layout.item_token_start
    level_logits = logits[..., start : start + layout.codes_per_level[level]]
    allowed = tree.children[level][nodes] >= 0
    masked = level_logits.masked_fill(~allowed, float("-inf"))
    log_probs = masked - torch.logsumexp(masked, dim=-1, keepdim=True)
    return torch.where(allowed, log_probs, torch.full_like(log_probs, float("-inf")))


@torch.no_grad()
def beam_search(
    model,
    tree: PrefixTree,
    prompts: Sequence[Sequence[int]],
    beam_width: int,
    exclude: Sequence[Sequence[int]] | None = None,
    shadow=None,
    shadow_width: int | None = None,
) -> BeamResult:
    """Constrained beam search of width ``beam_width`` for one batch of prompts.

    ``exclude[b]``: item indices prompt ``b`` must not get (e.g. already seen).
    ``shadow``: a draft model whose top-``shadow_width`` expansion of the
    target's beams is compared with the target's top-K at every level (strict
    acceptance); the draft never changes the result.
    """
    layout = tree.layout
    device = next(model.parameters()).device
    target = _Decoder(model, layout, prompts, device)
    draft = _Decoder(shadow, layout, prompts, device) if shadow is not None else None
    batch = len(prompts)
    nodes = torch.zeros((batch, 1), dtype=torch.long, device=device)
    scores = torch.zeros((batch, 1), device=device)
    draft_scores = torch.zeros((batch, 1), device=device)
    tokens = torch.zeros((batch, 1, 0), dtype=torch.long, device=device)
    acceptance: list[list[bool]] = []
    for level in range(layout.depth):
        size = layout.codes_per_level[level]
        candidates = scores[..., None] + _level_log_probs(target.logits, nodes, tree, level)
        if level == layout.depth - 1 and exclude is not None:
            candidates = _mask_excluded(candidates, tree.children[level][nodes], exclude)
        width = min(beam_width, candidates[0].numel())
        top = candidates.view(batch, -1).topk(width, dim=1)
        if draft is not None:
            draft_candidates = draft_scores[..., None] + _level_log_probs(
                draft.logits, nodes, tree, level
            )
            acceptance.append(_strict_accepts(top, draft_candidates, shadow_width or width))
            draft_scores = draft_candidates.view(batch, -1).gather(1, top.indices)
        parent, code = top.indices // size, top.indices % size
        scores = top.values
        nodes = tree.children[level][nodes.gather(1, parent), code]
        token = code + layout.level_start(level)
        tokens = torch.cat([tokens.gather(1, parent[..., None].expand(-1, -1, level)),
                            token[..., None]], dim=2)  # fmt: skip
        nodes = torch.where(torch.isfinite(scores), nodes, torch.full_like(nodes, -1))
        if level < layout.depth - 1:
            flat_parent = (parent + torch.arange(batch, device=device)[:, None] * parent.new_tensor(
                target.logits.shape[1])).view(-1)  # fmt: skip
            target.advance(flat_parent, token)
            if draft is not None:
                draft.advance(flat_parent, token)
            nodes = nodes.clamp(min=0)
    item_index = torch.where(torch.isfinite(scores), nodes, torch.full_like(nodes, -1))
    return BeamResult(item_index.cpu(), scores.cpu(), tokens.cpu(), acceptance)


def _mask_excluded(candidates, leaf_items, exclude) -> torch.Tensor:
    blocked = torch.zeros_like(candidates, dtype=torch.bool)
    for row, items in enumerate(exclude):
        if len(items):
            wanted = torch.as_tensor(list(items), device=leaf_items.device)
            blocked[row] = torch.isin(leaf_items[row], wanted)
    return candidates.masked_fill(blocked, float("-inf"))


def _strict_accepts(top, draft_candidates, draft_width: int) -> list[bool]:
    """Per prompt: is every (parent, token) of the target's top-K among the draft's top-N?"""
    flat = draft_candidates.view(draft_candidates.shape[0], -1)
    drafted = flat.topk(min(draft_width, flat.shape[1]), dim=1).indices
    finite = torch.isfinite(top.values)
    hit = (top.indices[..., None] == drafted[:, None, :]).any(-1) | ~finite
    return hit.all(dim=1).tolist()


def decode_batched(
    model,
    tree: PrefixTree,
    prompts: Sequence[Sequence[int]],
    beam_width: int,
    exclude: Sequence[Sequence[int]] | None = None,
    batch_size: int = 64,
    shadow=None,
    shadow_width: int | None = None,
    progress: bool = False,
) -> BeamResult:
    """``beam_search`` over many prompts in batches of similar length (results in input order).

    This is the single switch point to genrec's online decoder once it covers
    the options used here.
    """
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    parts: list[BeamResult] = []
    starts = range(0, len(order), batch_size)
    for start in tqdm(starts, desc="beam search", disable=not progress, leave=False):
        rows = order[start : start + batch_size]
        parts.append(
            beam_search(
                model,
                tree,
                [prompts[i] for i in rows],
                beam_width,
                [exclude[i] for i in rows] if exclude is not None else None,
                shadow,
                shadow_width,
            )  # fmt: skip
        )
    inverse = torch.as_tensor(np.argsort(order))
    levels = len(parts[0].step_acceptance) if parts else 0
    in_order = [sum((part.step_acceptance[level] for part in parts), []) for level in range(levels)]
    return BeamResult(
        torch.cat([p.item_index for p in parts])[inverse],
        torch.cat([p.scores for p in parts])[inverse],
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
    tree: PrefixTree = field(init=False)

    def __post_init__(self) -> None:
        self.tree = PrefixTree(self.item_tokens, self.device)

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


def load_active_models(settings, engine) -> GenerativeModels:
    """The active model version (target + drafts) ready for decoding."""
    from genrec.offline.model_store import load_model_version

    return load_model_version(settings, engine)


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
    expansions of the target's current beams (default ``max(k, 40)``: the N=40
    draft beams of the AtSpeed paper and of the online decoder).
    """
    prompts = [models.prompt(case.history) for case in cases]
    reference = decode_batched(models.target, models.tree, prompts, k, batch_size=batch_size)
    target_sets = [set(row) - {-1} for row in reference.item_index.tolist()]
    report: dict[str, dict[str, Any]] = {}
    for variant, draft in models.drafts.items():
        own = decode_batched(draft, models.tree, prompts, k, batch_size=batch_size)
        overlap = [
            len(target & set(row)) / k
            for target, row in zip(target_sets, own.item_index.tolist(), strict=True)
        ]
        shadowed = decode_batched(
            models.target, models.tree, prompts, k, batch_size=batch_size,
            shadow=draft, shadow_width=draft_width or max(k, 40),
        )  # fmt: skip
        report[variant] = {
            "topk_overlap": float(np.mean(overlap)) if overlap else 0.0,
            "strict_acceptance_per_step": [
                float(np.mean(level)) if level else 0.0 for level in shadowed.step_acceptance
            ],
        }
    return report
