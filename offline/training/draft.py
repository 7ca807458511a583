"""Training the draft models (offline step, models): SFT, AtSpeed-S and AtSpeed-R.

The draft shares the target's tokenizer and token layout but has one or two
layers. Three variants are trained so they can be compared:

- ``sft``: the target's recipe (every next-item position, ground truth).
- ``atspeed_s`` and ``atspeed_r``: start from the SFT draft, then train on
  teacher data with ``(1 - a) * CE + a * L_align`` (``a`` =
  ``settings.model.align_weight``, 0.9), CE on the true next item.

Teacher data (``make_teacher_data``): the target's constrained top-``K_t`` beams
for a seeded sample of training prompts, and the target's log-probabilities at
every level along each beam (renormalized over the valid children, as the
decoder scores them). The draft is trained teacher-forced on those beams: one
prefill per prompt, its KV cache shared by the ``K_t`` beam suffixes. The teacher's
batches run where ``offline.executor`` says (here, or on Ray actors that each receive
the target once); the same batches give the same beams and log-probabilities.

Alignment losses, at each level ``t`` of each target beam:

- AtSpeed-S: over the draft's own top-K tokens ``S_t``, both distributions
  renormalized on ``S_t``: reverse KL ``KL(q || p)`` plus a density regularizer,
  the target's mass at the draft's K-th token times the draft's entropy on
  ``S_t`` (sharpens the draft where the top-K boundary is decided).
- AtSpeed-R: total variation distance between the target's and the draft's
  sequence probabilities on the target's top-K sequences, plus the per-level
  TVD along them (a denser signal for the same goal).

Data-parallel (``shard``, ``train.workers > 1``): the SFT draft as the target
(``train_target``); the aligned drafts on each worker's rows of the same global batches,
DDP averaging the gradients (``genrec.offline.training.parallel``).

Example::

    >>> teacher = make_teacher_data(target, item_tokens, tree, prompts, k=10)  # doctest: +SKIP
    >>> draft = align_draft(sft_draft, teacher, "atspeed_s", preset)  # doctest: +SKIP
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from genrec.infra.progress import progress_bar
from genrec.offline.executor import Executor, LocalExecutor, batches, placed_model, sendable_model
from genrec.offline.splits import Split
from genrec.offline.training.parallel import SINGLE, DataShard, step_loss
from genrec.offline.training.target import TrainResult, make_optimizer, train_target
from genrec.online.decoding.trie import ItemTrie
from genrec.online.models.generative import _left_pad, decode_batched
from genrec.online.models.presets import ModelPreset, build_draft, item_logits, pick_device
from genrec.online.prompts import ItemTokens, history_prompt

log = logging.getLogger(__name__)

ALIGNED_VARIANTS = ("atspeed_s", "atspeed_r")


@dataclass
class TeacherData:
    """Target beams for a sample of training prompts.

    ``beams``: [P, K, depth] token ids of the target's top-K items per prompt;
    ``truth``: [P, depth] tokens of the true next item; ``target_log_probs``:
    [P, K, depth, C] the target's log-probs over each level's codes along each
    beam (-inf on invalid children; C = the widest level).
    """

    prompts: list[list[int]]
    beams: torch.Tensor
    truth: torch.Tensor
    target_log_probs: torch.Tensor


def sample_training_prompts(
    split: Split, item_tokens: ItemTokens, history_items: int, count: int, seed: int = 0
) -> tuple[list[list[int]], list[str]]:
    """A seeded sample of (prompt, true next item) from every position of the training sequences."""
    positions = [
        (items, t)
        for items in (item_tokens.known(s) for s in split.train.values())
        for t in range(1, len(items))
    ]
    if not positions:
        raise ValueError("no training positions: every user needs at least two known items")
    rng = np.random.default_rng(seed)
    chosen = rng.choice(len(positions), size=min(count, len(positions)), replace=False)
    prompts, truths = [], []
    for index in chosen:
        items, t = positions[index]
        prompts.append(history_prompt(items[:t], item_tokens, history_items))
        truths.append(items[t])
    return prompts, truths


def level_log_probs(logits: torch.Tensor, prefixes: torch.Tensor, tree: ItemTrie) -> torch.Tensor:
    """Log-probs per level along given items, renormalized over valid children.

    ``logits``: [..., depth, V_item] item logits at the position before each
    level's token; ``prefixes``: [..., depth] the items' tokens. Returns
    [..., depth, C] (C = widest level; -inf on invalid or padding codes).
    """
    layout = tree.layout
    widest = max(layout.codes_per_level)
    nodes = torch.zeros(prefixes.shape[:-1], dtype=torch.long, device=logits.device)
    levels = []
    for level, size in enumerate(layout.codes_per_level):
        start = layout.level_start(level) - layout.item_token_start
        allowed = tree.children_of(level, nodes) >= 0
        masked = logits[..., level, start : start + size].masked_fill(~allowed, float("-inf"))
        log_probs = torch.log_softmax(masked, dim=-1)
        log_probs = torch.where(allowed, log_probs, torch.full_like(log_probs, float("-inf")))
        levels.append(torch.nn.functional.pad(log_probs, (0, widest - size), value=float("-inf")))
        code = (prefixes[..., level] - layout.level_start(level)).clamp(0, size - 1)
        nodes = tree.child_of(level, nodes, code).clamp(min=0)
    return torch.stack(levels, dim=-2)


def beam_logits(model, layout, prompts: Sequence[Sequence[int]], suffixes: torch.Tensor):
    """Teacher-forced item logits along ``suffixes`` [b, R, depth] after each prompt.

    Returns [b, R, depth, V_item]: index t is the distribution of level t. The
    prompt is prefilled once; its KV cache is shared by the R suffixes.
    """
    device = suffixes.device
    batch, rows, depth = suffixes.shape
    ids, mask, positions = _left_pad(prompts, layout.pad_token_id, device)
    first, cache = item_logits(model, layout, ids, mask, positions, use_cache=True)
    expand = torch.arange(batch, device=device).repeat_interleave(rows)
    cache.batch_select_indices(expand)
    mask = torch.cat([mask[expand], torch.ones((batch * rows, depth - 1), dtype=mask.dtype,
                                               device=device)], dim=1)  # fmt: skip
    steps = positions[expand, -1:] + torch.arange(1, depth, device=device)
    rest, _ = item_logits(
        model, layout, suffixes.reshape(batch * rows, depth)[:, :-1], mask, steps, cache,
        use_cache=True,
    )  # fmt: skip
    first = first[:, -1:, :].repeat_interleave(rows, dim=0)
    return torch.cat([first, rest], dim=1).view(batch, rows, depth, -1)


@torch.no_grad()
def make_teacher_data(
    target,
    item_tokens: ItemTokens,
    tree: ItemTrie,
    prompts: list[list[int]],
    truths: Sequence[str],
    k: int,
    batch_size: int = 32,
    progress: bool = True,
    executor: Executor | None = None,
) -> TeacherData:
    """The target's top-``k`` beams and per-level log-probs for each prompt (batched).

    The beam search takes the prompts in batches of similar length (``decode_batched``),
    the log-probabilities in input order; each batch is a page of ``executor`` (default:
    this process), on workers that hold the target and the trie.
    """
    target.eval()
    executor = executor or LocalExecutor()
    k = teacher_width(k, tree.n_items)
    device = next(target.parameters()).device
    # level_log_probs indexes the trie with tensors on the model's device
    if executor.remote:  # the workers get the target and the trie once, on the CPU
        local, sent = None, (sendable_model(target), tree.to("cpu"))
    else:
        local, sent = (target, tree.to(device)), ()
    by_length = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    search_pages = batches(by_length, batch_size)
    shown = {"progress": progress, "unit": "batch"}
    pool = executor.pool("teacher", _teacher_state, *sent, local=local,
                         threads=torch.get_num_threads(), pages_hint=len(search_pages))  # fmt: skip
    with pool:
        found = list(pool.map(_teacher_beams, (([prompts[i] for i in rows], k)
                                                for rows in search_pages),
                              desc="teacher beams", total=len(search_pages), **shown))  # fmt: skip
        sorted_prompts = [prompts[i] for i in by_length]
        beams = _complete_beams(pool, sorted_prompts, found, k, shown)
        beams = beams[torch.as_tensor(np.argsort(by_length))]
        starts = range(0, len(prompts), batch_size)
        pages = ((prompts[s : s + batch_size], beams[s : s + batch_size]) for s in starts)
        log_probs = list(pool.map(_teacher_log_probs, pages, desc="teacher logits",
                                  total=len(starts), **shown))  # fmt: skip
    truth = torch.as_tensor(np.stack([item_tokens.tokens_of(i) for i in truths]))
    return TeacherData(prompts, beams, truth, torch.cat(log_probs))


def teacher_width(k: int, n_items: int) -> int:
    """Teacher beams per prompt: ``k`` (the preset's ``teacher_beams``), or every item of a
    catalog smaller than that (a beam search cannot keep more beams than there are items)."""
    if n_items < k:
        log.warning("teacher beams: the catalog has %d items, fewer than the preset's "
                    "teacher_beams = %d; the drafts align on %d beams", n_items, k, n_items)  # fmt: skip
    return max(1, min(k, n_items))


def _complete_beams(
    pool, prompts: list[list[int]], found: list, k: int, shown: dict
) -> torch.Tensor:
    """Beam tokens ``[len(prompts), k, depth]`` of the batched search's results ``found``;
    a prompt that came back with missing beams is decoded again alone.

    A guard, not the normal path: a batch of mixed lengths once lost every beam of some
    users whose prompts decode alone (a 500-item catalog, trained ``tiny`` target). The
    cause was the engine's ranged prefill leaving stale KV storage (inf, NaN) in slots it
    masked, fixed in ``slot_cache``; should a batch lose beams again, the warning says so
    and those prompts, rare by then, cost one batch each.
    """
    item_index = torch.cat([index for index, _tokens in found])
    beams = torch.cat([tokens for _index, tokens in found])
    missing = (item_index < 0).any(1).nonzero().flatten().tolist()
    if not missing:
        return beams
    log.warning("teacher beams: %d of %d prompts lost beams in their batch; decoding them "
                "one at a time", len(missing), len(prompts))  # fmt: skip
    alone = pool.map(_teacher_beams, (([prompts[i]], k) for i in missing),
                     desc="teacher beams (alone)", total=len(missing), **shown)  # fmt: skip
    for i, (index, tokens) in zip(missing, alone, strict=True):
        if (index < 0).any():
            raise ValueError(
                f"teacher beams: the target found fewer than {k} items for a training prompt "
                f"even alone (its scores are not finite: a diverged target?); lower the "
                f"preset's teacher_beams or check the target's training"
            )
        beams[i] = tokens[0]
    return beams


def _teacher_state(target, tree: ItemTrie) -> tuple:
    """A worker's (target, trie) on its device (its GPU when Ray gave it one)."""
    target = placed_model(target)
    return target, tree.to(next(target.parameters()).device)


@torch.no_grad()
def _teacher_beams(state: tuple, page: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch of the teacher's beam search: (item indices [b, k], tokens [b, k, depth])."""
    target, tree = state
    prompts, k = page
    decoded = decode_batched(target, tree, prompts, k, batch_size=len(prompts))
    return decoded.item_index, decoded.tokens


@torch.no_grad()
def _teacher_log_probs(state: tuple, page: tuple) -> torch.Tensor:
    """The target's per-level log-probs along one batch of beams, on the CPU."""
    target, tree = state
    prompts, beams = page
    chunk = beams.to(next(target.parameters()).device)
    logits = beam_logits(target, tree.layout, prompts, chunk)
    return level_log_probs(logits.float(), chunk, tree).cpu()


# --- alignment losses ---------------------------------------------------------------


def _finite(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def atspeed_s_loss(draft_lp: torch.Tensor, target_lp: torch.Tensor, k: int) -> torch.Tensor:
    """Reverse KL on the draft's top-k tokens + density regularizer; inputs [..., C] log-probs."""
    valid = torch.isfinite(draft_lp).sum(-1).clamp(min=1)
    top = draft_lp.topk(min(k, draft_lp.shape[-1]), dim=-1)
    in_set = torch.arange(top.indices.shape[-1], device=draft_lp.device) < valid[..., None]
    # Finite stand-ins outside S_t keep every gradient finite (no inf - inf anywhere).
    very_low = -1e4
    q = torch.log_softmax(top.values.clamp(min=very_low).masked_fill(~in_set, very_low), dim=-1)
    p_on_set = target_lp.gather(-1, top.indices).clamp(min=very_low)
    p = torch.log_softmax(p_on_set.masked_fill(~in_set, very_low), dim=-1)
    q_prob = q.exp() * in_set
    reverse_kl = (q_prob * (q - p)).sum(-1)
    entropy = -(q_prob * q).sum(-1)
    last = (valid.clamp(max=top.indices.shape[-1]) - 1)[..., None]
    boundary_mass = target_lp.gather(-1, top.indices.gather(-1, last)).squeeze(-1).exp()
    return (reverse_kl + _finite(boundary_mass.detach()) * entropy).mean()


def atspeed_r_loss(draft_lp: torch.Tensor, target_lp: torch.Tensor, beams_codes) -> torch.Tensor:
    """TVD of sequence probabilities on the target's top-K beams, plus per-level TVD.

    ``draft_lp``/``target_lp``: [b, K, depth, C]; ``beams_codes``: [b, K, depth] code indices.
    """
    draft_seq = draft_lp.gather(-1, beams_codes[..., None]).squeeze(-1).sum(-1).exp()
    target_seq = target_lp.gather(-1, beams_codes[..., None]).squeeze(-1).sum(-1).exp()
    sequence_tvd = 0.5 * (draft_seq - target_seq).abs().sum(-1).mean()
    level_tvd = 0.5 * _finite(draft_lp.exp() - target_lp.exp()).abs().sum(-1).mean()
    return sequence_tvd + level_tvd


def truth_cross_entropy(draft_lp: torch.Tensor, truth_codes: torch.Tensor) -> torch.Tensor:
    """CE of the true next item's codes; ``draft_lp`` [b, depth, C], ``truth_codes`` [b, depth]."""
    picked = draft_lp.gather(-1, truth_codes[..., None]).squeeze(-1)
    return -picked.clamp(min=-1e4).mean()


# --- training ---------------------------------------------------------------------


def train_sft_draft(
    item_tokens: ItemTokens, split: Split, preset: ModelPreset, history_items: int,
    seed: int = 0, progress: bool = True, shard: DataShard = SINGLE,
    item_vector_fit_max_items: int | None = None,
) -> TrainResult:  # fmt: skip
    """The plain SFT draft: the target's training recipe on the draft architecture.

    Windows stay in stored time order (no ``reverse_windows``, no ``shuffle_ties``): the
    draft only ever has to follow the target on prompts in that order. It gets the same
    kind of co-occurrence item vectors as the target (``item_vector_dim``, its own
    projection): with them its top-K agrees more with a target that has them.
    """
    # --max-steps caps the target only: the draft keeps its own epochs.
    schedule = dataclasses.replace(preset, max_steps=None).with_overrides(
        name=f"{preset.name}-draft", epochs=preset.draft_epochs, lr=preset.draft_lr,
        eval_every=preset.draft_epochs, dropout=0.0, weight_decay=0.0,
        time_budget_s=preset.draft_time_budget_s, reverse_windows=0.0, shuffle_ties=False,
        ema_decay=0.0,
    )  # fmt: skip
    draft = build_draft(preset, item_tokens.layout)
    return train_target(item_tokens, split, schedule, history_items, model=draft, seed=seed,
                        progress=progress, valid_limit=300, shard=shard,
                        item_vector_fit_max_items=item_vector_fit_max_items)  # fmt: skip


def align_draft(
    sft_draft,
    teacher: TeacherData,
    variant: str,
    tree: ItemTrie,
    preset: ModelPreset,
    align_weight: float = 0.9,
    k: int | None = None,
    batch_size: int = 16,
    seed: int = 0,
    progress: bool = True,
    shard: DataShard = SINGLE,
) -> TrainResult:
    """AtSpeed-S or AtSpeed-R fine-tuning of a copy of ``sft_draft`` on ``teacher``.

    ``shard``: this worker's share of a data-parallel run (every worker returns the same model).
    """
    if variant not in ALIGNED_VARIANTS:
        raise ValueError(f"variant must be one of {ALIGNED_VARIANTS}, got {variant!r}")
    torch.manual_seed(seed)
    device = pick_device()
    layout = tree.layout
    draft = copy.deepcopy(sft_draft).to(device).train()
    # level_log_probs indexes the trie with node ids on the draft's device ("cuda:0", which
    # ItemTrie.to matches; "cuda" would make it copy the trie again)
    tree = tree.to(next(draft.parameters()).device)
    k = k or teacher.beams.shape[1]
    offsets = torch.as_tensor([layout.level_start(i) for i in range(layout.depth)]).to(device)
    batch_loss = step_loss(draft, _AlignLoss(teacher, variant, tree, offsets, k, align_weight),
                           shard)  # fmt: skip
    count = len(teacher.prompts)
    total_steps = preset.draft_epochs * -(-count // batch_size)
    optimizer, schedule = make_optimizer(draft, preset.draft_lr / 2, 0.0, total_steps)
    curve: list[float] = []
    step = 0
    started = time.perf_counter()
    rng = np.random.default_rng(seed)
    bar = progress_bar(total=total_steps, desc=f"draft {variant}", disable=not progress)
    for _epoch in range(preset.draft_epochs):
        losses = []
        order = torch.as_tensor(rng.permutation(count))
        for start in range(0, count, batch_size):
            index, weight = shard.take_weighted(order[start : start + batch_size])
            loss = batch_loss(index)
            if shard.parallel:
                loss = loss * weight
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
            optimizer.step()
            step += 1
            schedule(step / total_steps)
            losses.append(loss.item() / shard.world)
            bar.update(1)
            bar.set_postfix(loss=f"{np.mean(losses[-20:]) * shard.world:.4f}")
        curve.append(float(np.mean(shard.sum(losses))))
    bar.close()
    draft.eval()
    return TrainResult(draft, {"train_loss": curve}, {"final_loss": curve[-1]},
                       time.perf_counter() - started)  # fmt: skip


class _AlignLoss:
    """``(1 - a) * CE + a * align`` of a draft on the teacher rows ``index`` (one step's loss)."""

    def __init__(self, teacher: TeacherData, variant: str, tree: ItemTrie, offsets: torch.Tensor,
                 k: int, align_weight: float) -> None:  # fmt: skip
        self.teacher, self.variant, self.tree = teacher, variant, tree
        self.offsets, self.k, self.align_weight = offsets, k, align_weight

    def __call__(self, draft, index: torch.Tensor) -> torch.Tensor:
        device, teacher = self.offsets.device, self.teacher
        beams = teacher.beams[index].to(device)
        truth = teacher.truth[index].to(device)
        suffixes = torch.cat([beams, truth[:, None]], dim=1)
        prompts = [teacher.prompts[i] for i in index.tolist()]
        logits = beam_logits(draft, self.tree.layout, prompts, suffixes)
        draft_lp = level_log_probs(logits.float(), suffixes, self.tree)
        target_lp = teacher.target_log_probs[index].to(device)
        ce = truth_cross_entropy(draft_lp[:, -1], truth - self.offsets)
        if self.variant == "atspeed_s":
            align = atspeed_s_loss(draft_lp[:, :-1], target_lp, self.k)
        else:
            align = atspeed_r_loss(draft_lp[:, :-1], target_lp, beams - self.offsets)
        return (1 - self.align_weight) * ce + self.align_weight * align
