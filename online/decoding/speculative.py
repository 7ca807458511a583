"""Speculative constrained beam search: a small draft proposes, the target verifies (online step).

The rounds run in the one beam loop (``beam_search.BeamLoop``); this module
plugs in what differs: the draft's proposals (``DraftProposer``) and the rule
that accepts them (``SpeculativeRounds``; ``StrictAcceptanceProbe`` for the
diagnostic). One round per user at level t (t item tokens decoded), with g =
min(gamma, depth - t - 1) drafted steps:

1. Draft: beam search of width N from the K target beams for g steps, trie-
   constrained. Step j keeps D_j (N drafted (parent, token) pairs) and q_j, the
   draft's sequence-level distribution (softmax over the cumulative scores of
   all parent x code pairs; cumulative scores start from the target's beam
   scores so that q_j and the target's p_j share their root part).
2. Verify: ONE target call over the K beams' unfed tokens and every drafted node
   (tree attention: one cache row per user, a 4D mask lets each node see the
   prompt and its ancestors, position = prompt length + level; the pending
   prompt or suffix rides along in the first round). Walk j = 1 .. g+1:
   - ``strict``: T_j = target top-K of (current beams x allowed codes). If every
     (parent, token) of T_j is in D_j the walk goes on from T_j, else T_j is the
     target's correction and the round ends. Step g+1 is a free bonus. The
     result equals ``beam_search`` (lossless); only the number of calls changes.
   - ``relaxed``: each drafted y extending a current beam is accepted with
     probability min(1, p(y)/q(y)), p the target's sequence-level distribution;
     with >= K accepted the best K by target score go on, else the missing ones
     are sampled without replacement from max(p - q, 0) (accepted zeroed) and
     the round ends. Seeded; not lossless.
3. Both caches keep only the prompt and the surviving beams' tokens.

Why tree attention rather than batch expansion (one row per drafted path): it
verifies every drafted node, including those the draft pruned at a later step
(strict acceptance at step j needs the target's logits at all of T_j, wherever
the draft's final paths went), and it reads the prompt's KV once instead of N
times. Measured (``genrec bench decode --random``, 4x256 target, 105-token
prompt, K=10, N=40, gamma=3, 1 CPU thread): one verification call 13.6 ms as a
tree vs 26.4 ms as batch expansion; a target-only step (K nodes) 4.4 ms.

Why g = min(gamma, depth - t - 1): step g+1 is the free bonus from the same
call, so drafting the last remaining level would only add N nodes to verify.
For the same reason drafting stops early once every drafted path "settles in
one" (each of its children holds a single item, as the dedup level of semantic
IDs mostly does): the bonus step then decides the items and the rest is forced.

``strict_acceptance_per_level`` is target-only search in which the draft
expands the target's beams by one level every round and the strict rule only
records whether it would have accepted (the drafted nodes are not verified).

``AcceptanceMonitor`` watches acceptance over a window of requests and switches
to target-only decoding when it collapses (a draft no longer aligned with the
target), still probing now and then so that it can switch back.

Example::

    result = speculative_beam_search(target, draft, prompts, trie, layout, k=10)
    result.stats[0].target_calls, result.stats[0].acceptance
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Literal

import torch

from genrec.online.decoding.beam_search import (
    BeamLoop,
    Choice,
    DecodeResult,
    DecodeStats,
    DraftStep,
    ItemScorer,
    RoundPolicy,
    ScoreMode,
    TargetLevel,
    beam_search,
    check_inputs,
    child_log_probs,
    top_k_children,
)
from genrec.online.decoding.constraints import ItemConstraint
from genrec.online.decoding.prefix_kv import PrefixBatch
from genrec.online.decoding.tree_cache import Beams, Prompts, TreeCache, feed_beams, maybe_compact
from genrec.online.decoding.trie import ItemTrie
from genrec.schemas.token_layout import TokenLayout

Mode = Literal["strict", "relaxed"]


class AcceptanceMonitor:
    """Falls back to target-only decoding when draft acceptance over recent requests is too low."""

    def __init__(self, window: int = 200, threshold: float = 0.2, probe_every: int = 20) -> None:
        self.window: deque[tuple[int, int]] = deque(maxlen=window)
        self.threshold = threshold
        self.probe_every = probe_every
        self.requests = 0

    @classmethod
    def from_settings(cls, decode) -> AcceptanceMonitor:
        """From ``get_settings().decode`` (``DecodeSettings``)."""
        return cls(decode.fallback_window, decode.fallback_threshold, decode.fallback_probe_every)

    def record(self, stats: DecodeStats) -> None:
        if stats.speculative and stats.drafted_steps:
            self.window.append((stats.accepted_steps, stats.drafted_steps))

    @property
    def acceptance(self) -> float:
        drafted = sum(d for _, d in self.window)
        return sum(a for a, _ in self.window) / drafted if drafted else 1.0

    def use_speculative(self) -> bool:
        """Speculate unless the window is full enough and below threshold (then probe every Nth call)."""
        self.requests += 1
        if len(self.window) < max(1, self.window.maxlen // 4) or self.acceptance >= self.threshold:
            return True
        return self.requests % self.probe_every == 0


class DraftProposer:
    """The draft's side of a round: its cache, and a beam search of width ``n_draft``
    from the target's beams, one draft call per level for all users still drafting."""

    def __init__(
        self,
        draft,
        prompts: Prompts,
        constraint: ItemConstraint,
        n_draft: int,
        score_mode: ScoreMode = "allowed",
    ) -> None:
        self.constraint, self.n_draft = constraint, n_draft
        self.scorer = ItemScorer(draft, constraint.trie.layout, score_mode)
        self.cache = TreeCache(draft, prompts)

    def propose(
        self, roots: dict[int, Beams], lengths: dict[int, int], stats: Sequence[DecodeStats]
    ) -> dict[int, list[DraftStep]]:
        """Up to ``lengths[b]`` drafted levels per user; fewer once every path settles in one."""
        trie = self.constraint.trie
        current = {
            b: Beams(r.tokens, r.scores, {"draft": r.slots["draft"]}) for b, r in roots.items()
        }
        steps: dict[int, list[DraftStep]] = {b: [] for b in roots}
        for j in range(1, max(lengths.values(), default=0) + 1):
            users = [b for b in roots if lengths[b] >= j]
            fed = feed_beams(self.cache, {b: current[b] for b in users}, "draft")
            for b in users:
                stats[b].draft_calls += 1
                beams = current[b]
                if j == 1:
                    roots[b].slots["draft"] = beams.slots["draft"]
                log_probs = child_log_probs(
                    self.scorer, fed[b].at_tips(), beams.tokens, self.constraint, b
                )
                parents, codes, best = top_k_children(beams.scores, log_probs, self.n_draft)
                current[b] = beams.select(
                    parents, codes + trie.layout.level_start(beams.level), best
                )
                candidates = beams.scores[:, None] + log_probs
                steps[b].append(DraftStep(parents, codes, current[b], candidates))
                if j < lengths[b] and bool(trie.settles_in_one(current[b].tokens).all()):
                    # the bonus step decides every drafted path's item: drafting on is waste
                    lengths[b] = j
        return steps

    def compact(self, active: dict[int, Beams]) -> None:
        maybe_compact(self.cache, active, "draft")


class SpeculativeRounds(RoundPolicy):
    """Draft g = min(gamma, depth - t - 1) levels, verify them in the target call, accept
    them by the ``strict`` or ``relaxed`` rule (module docstring)."""

    speculative = True
    cache_names = ("draft",)

    def __init__(
        self, proposer: DraftProposer, gamma: int, mode: Mode, generator: torch.Generator
    ) -> None:
        self.proposer, self.gamma, self.mode, self.generator = proposer, gamma, mode, generator

    def propose(
        self, active: dict[int, Beams], stats: Sequence[DecodeStats]
    ) -> dict[int, list[DraftStep]]:
        lengths = {b: self._draft_length(beams) for b, beams in active.items()}
        return self.proposer.propose(active, lengths, stats)

    def _draft_length(self, beams: Beams) -> int:
        """g = min(gamma, depth - t - 1); 0 when one target step decides every item anyway."""
        trie = self.proposer.constraint.trie
        if bool(trie.settles_in_one(beams.tokens).all()):
            return 0
        return min(self.gamma, trie.layout.depth - beams.level - 1)

    def accept(self, target: TargetLevel, step: DraftStep) -> Choice:
        if self.mode == "strict":
            return strict_choice(target, step)
        return relaxed_choice(target, step, self.generator)

    def compact(self, active: dict[int, Beams]) -> None:
        self.proposer.compact(active)


class StrictAcceptanceProbe(RoundPolicy):
    """Target-only rounds in which the draft expands the target's beams by one level and
    ``accepted[level][user]`` records whether strict verification would take it."""

    verifies_drafts = False  # the walk never goes past the target's own choice
    cache_names = ("draft",)

    def __init__(self, proposer: DraftProposer, n_users: int) -> None:
        self.proposer = proposer
        depth = proposer.constraint.trie.layout.depth
        # a level filled without a call (one valid child) counts as accepted
        self.accepted = [[True] * n_users for _ in range(depth)]

    def propose(
        self, active: dict[int, Beams], stats: Sequence[DecodeStats]
    ) -> dict[int, list[DraftStep]]:
        return self.proposer.propose(active, dict.fromkeys(active, 1), stats)

    def accept(self, target: TargetLevel, step: DraftStep) -> Choice:
        choice = target.top_k()
        width = target.log_probs.shape[1]
        drafted, _ = _drafted_positions(target.index, step, width)
        chosen = choice.parents * width + choice.codes
        self.accepted[step.level][target.user] = bool(torch.isin(chosen, drafted).all())
        return choice

    def compact(self, active: dict[int, Beams]) -> None:
        self.proposer.compact(active)


def _drafted_positions(index: torch.Tensor, step: DraftStep, codes_per_level: int):
    """Key (current-beam, code) of each drafted node whose parent is a current beam, and that node."""
    position_of = torch.full((len(step.candidates),), -1, dtype=torch.long, device=index.device)
    position_of[index] = torch.arange(len(index), device=index.device)
    beam = position_of[step.parents]
    drafted = (beam >= 0).nonzero()[:, 0]
    return beam[drafted] * codes_per_level + step.codes[drafted], drafted


def strict_choice(target: TargetLevel, step: DraftStep) -> Choice:
    """Target top-K; ``taken`` = their D_j nodes when all of them were drafted, else None."""
    choice = target.top_k()
    width = target.log_probs.shape[1]
    keys, nodes = _drafted_positions(target.index, step, width)
    match = (choice.parents * width + choice.codes)[:, None] == keys[None, :]
    if len(keys) and bool(match.any(1).all()):
        return choice._replace(taken=nodes[match.int().argmax(1)])
    return choice


def relaxed_choice(target: TargetLevel, step: DraftStep, generator: torch.Generator) -> Choice:
    """Accept drafted y with prob min(1, p/q); top up from the residual max(p - q, 0) if short."""
    _, scores, log_probs, index, k = target
    n_codes = log_probs.shape[1]
    candidates = (scores[:, None] + log_probs).flatten()
    p = torch.softmax(candidates.double(), 0).cpu()
    q = step.q[index].flatten().double().cpu()
    keys, nodes = _drafted_positions(index, step, n_codes)
    keys_cpu = keys.cpu()
    ratio = p[keys_cpu] / q[keys_cpu].clamp(min=1e-300)
    accepted = torch.rand(len(keys_cpu), generator=generator, dtype=torch.float64) < ratio
    accepted_keys, accepted_nodes = keys[accepted.to(keys.device)], nodes[accepted.to(keys.device)]
    if len(accepted_keys) >= k:
        order = candidates[accepted_keys].topk(k).indices
        chosen = accepted_keys[order]
        return Choice(
            chosen // n_codes, chosen % n_codes, candidates[chosen], accepted_nodes[order]
        )
    weights = (p - q).clamp(min=0)
    weights[accepted_keys.cpu()] = 0
    if int((weights > 0).sum()) < k - len(accepted_keys):
        weights = p.clone()
        weights[accepted_keys.cpu()] = 0
    n_fill = min(k - len(accepted_keys), int((weights > 0).sum()))
    sampled = (
        torch.multinomial(weights, n_fill, replacement=False, generator=generator)
        if n_fill
        else keys_cpu[:0]
    )
    chosen = torch.cat([accepted_keys, sampled.to(keys.device)])
    chosen = chosen[candidates[chosen].argsort(descending=True)]
    return Choice(chosen // n_codes, chosen % n_codes, candidates[chosen], None)


@torch.no_grad()
def speculative_beam_search(
    target,
    draft,
    prompts: Prompts | tuple[PrefixBatch, PrefixBatch],
    trie: ItemTrie,
    layout: TokenLayout,
    k: int,
    n_draft: int = 40,
    gamma: int = 3,
    mode: Mode = "strict",
    generator: torch.Generator | None = None,
    score_mode: ScoreMode = "allowed",
    monitor: AcceptanceMonitor | None = None,
    exclude: Sequence[Sequence[int]] | None = None,
) -> DecodeResult:
    """Top-``k`` valid items per user.

    ``prompts``: token-id lists; or a target ``PrefixBatch`` (the draft then
    prefills the full prompts itself); or a (target, draft) pair of those.
    ``generator`` seeds relaxed sampling (default: seed 0); it is a CPU generator
    on every device, as the acceptance draws run on the CPU. ``exclude[b]``:
    catalog rows user ``b`` must not get, masked as in ``beam_search`` for the
    target and the draft alike.
    """
    if mode not in ("strict", "relaxed"):
        raise ValueError(f"mode must be 'strict' or 'relaxed', got {mode!r}")
    if n_draft < k or gamma < 0:
        raise ValueError("need n_draft >= k and gamma >= 0")
    target_prompts, draft_prompts = _split_prompts(prompts)
    trie = check_inputs(target, target_prompts, layout, trie, k)
    if monitor is not None and not monitor.use_speculative():
        return beam_search(target, target_prompts, trie, layout, k, score_mode, exclude)
    generator = generator or torch.Generator().manual_seed(0)
    constraint = ItemConstraint.for_users(trie, exclude, len(target_prompts))
    proposer = DraftProposer(draft, draft_prompts, constraint, n_draft, score_mode)
    rounds = SpeculativeRounds(proposer, gamma, mode, generator)
    loop = BeamLoop(target, target_prompts, constraint, k, score_mode, rounds)
    _check_same_prompts(loop, proposer)
    result = loop.run()
    if monitor is not None:
        for stats in result.stats:
            monitor.record(stats)
    return result


def _split_prompts(prompts) -> tuple[Prompts, Prompts]:
    """(target, draft) prompts; a lone PrefixBatch is the target's, the draft prefills in full."""
    if isinstance(prompts, tuple):
        return prompts
    if isinstance(prompts, PrefixBatch):
        full = [
            p.prompt_ids + list(s) for p, s in zip(prompts.prefixes, prompts.suffixes, strict=True)
        ]
        return prompts, full
    return prompts, prompts


def _check_same_prompts(loop: BeamLoop, proposer: DraftProposer) -> None:
    if loop.cache.prompt_len != proposer.cache.prompt_len:
        raise ValueError("target and draft prompts differ in length")


@torch.no_grad()
def strict_acceptance_per_level(
    target,
    draft,
    prompts: list[list[int]],
    trie: ItemTrie,
    layout: TokenLayout,
    k: int,
    n_draft: int = 40,
    score_mode: ScoreMode = "allowed",
    exclude: Sequence[Sequence[int]] | None = None,
) -> tuple[DecodeResult, list[list[bool]]]:
    """Target-only beam search, and per level per user: would strict verification accept the draft?

    At every level the draft expands the target's own K beams exactly as the
    first step of a speculative round does (target beam scores + draft
    log-probs, top ``n_draft``); the level is accepted when every (parent,
    token) of the target's top-K is among them. Levels where every beam has a
    single valid child count as accepted. Returns (the target's result, equal
    to ``beam_search``; ``accepted[level][user]``). A draft-alignment signal
    per level, free of the round structure that ``DecodeStats.acceptance`` has.
    """
    trie = check_inputs(target, prompts, layout, trie, k)
    constraint = ItemConstraint.for_users(trie, exclude, len(prompts))
    proposer = DraftProposer(draft, prompts, constraint, n_draft, score_mode)
    probe = StrictAcceptanceProbe(proposer, len(prompts))
    loop = BeamLoop(target, prompts, constraint, k, score_mode, probe)
    return loop.run(), probe.accepted
