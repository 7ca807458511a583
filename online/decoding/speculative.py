"""Speculative constrained beam search: a small draft proposes, the target verifies (online step).

One round per user at level t (t item tokens decoded), with g = min(gamma,
depth - t - 1) drafted steps:

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
from dataclasses import dataclass
from typing import Literal

import torch

from genrec.online.decoding.beam_search import (
    Beams,
    DecodeResult,
    DecodeStats,
    ItemScorer,
    Prompts,
    ScoreMode,
    TreeCache,
    add_beam_tips,
    assemble,
    beam_search,
    check_inputs,
    child_log_probs,
    excluded_nodes,
    feed_beams,
    initial_beams,
    maybe_compact,
    retire_finished,
    top_k_children,
)
from genrec.online.decoding.prefix_kv import PrefixBatch
from genrec.online.decoding.trie import ItemTrie
from genrec.schemas.token_layout import TokenLayout

Mode = Literal["strict", "relaxed"]


@dataclass
class DraftStep:
    """Step j of a user's draft: D_j as (parent in D_{j-1}, code), its beams, and q_j."""

    parents: torch.Tensor  # LongTensor[n_j]
    codes: torch.Tensor  # LongTensor[n_j]
    beams: Beams  # n_j drafted paths (tokens, draft scores, draft slots)
    q: torch.Tensor  # Tensor[n_{j-1}, C]: draft sequence-level distribution over parent x code


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
    engine = _Speculation(target, draft, target_prompts, draft_prompts, trie, layout, score_mode)
    engine.excluded = excluded_nodes(trie, exclude, engine.n_users)
    result = engine.run(k, n_draft, gamma, mode, generator)
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


class _Speculation:
    """State of one batched speculative decode."""

    def __init__(
        self, target, draft, target_prompts, draft_prompts, trie, layout, score_mode
    ) -> None:
        self.trie, self.layout, self.score_mode = trie, layout, score_mode
        self.target_scorer = ItemScorer(target, layout, score_mode)
        self.draft_scorer = ItemScorer(draft, layout, score_mode)
        self.target_cache = TreeCache(target, target_prompts)
        self.draft_cache = TreeCache(draft, draft_prompts)
        if self.target_cache.prompt_len != self.draft_cache.prompt_len:
            raise ValueError("target and draft prompts differ in length")
        self.n_users = len(self.target_cache.pending)
        self.stats = [DecodeStats(speculative=True) for _ in range(self.n_users)]
        self.excluded: list[list[torch.Tensor] | None] = [None] * self.n_users

    def run(
        self, k: int, n_draft: int, gamma: int, mode: Mode, generator: torch.Generator
    ) -> DecodeResult:
        dtype, device = self.target_scorer.dtype, self.target_cache.device
        active = {b: initial_beams(device, dtype, ("target", "draft")) for b in range(self.n_users)}
        finished: dict[int, Beams] = {}
        while active:
            retire_finished(active, finished, self.trie, self.stats, self.excluded, self.score_mode)
            if not active:
                break
            lengths = {b: self._draft_length(beams, gamma) for b, beams in active.items()}
            drafts = self._draft(active, lengths, n_draft)
            active = self._verify(active, drafts, k, mode, generator)
            maybe_compact(self.target_cache, active, "target")
            maybe_compact(self.draft_cache, active, "draft")
        return assemble([finished[b] for b in range(self.n_users)], self.trie, k, self.stats)

    def _draft_length(self, beams: Beams, gamma: int) -> int:
        """g = min(gamma, depth - t - 1); 0 when one target step decides every item anyway."""
        if bool(self.trie.settles_in_one(beams.tokens).all()):
            return 0
        return min(gamma, self.layout.depth - beams.level - 1)

    def _draft(
        self, roots: dict[int, Beams], lengths: dict[int, int], n_draft: int
    ) -> dict[int, list[DraftStep]]:
        """Draft beam search, one draft call per step for all users still drafting."""
        cache, scorer = self.draft_cache, self.draft_scorer
        current = {
            b: Beams(r.tokens, r.scores, {"draft": r.slots["draft"]}) for b, r in roots.items()
        }
        steps: dict[int, list[DraftStep]] = {b: [] for b in roots}
        for j in range(1, max(lengths.values(), default=0) + 1):
            users = [b for b in roots if lengths[b] >= j]
            hidden = feed_beams(cache, {b: current[b] for b in users}, "draft")
            for b in users:
                self.stats[b].draft_calls += 1
                beams = current[b]
                if j == 1:
                    roots[b].slots["draft"] = beams.slots["draft"]
                log_probs = child_log_probs(
                    scorer, hidden[b], beams.tokens, self.trie, self.excluded[b]
                )
                candidates = beams.scores[:, None] + log_probs
                q = torch.softmax(candidates.flatten(), 0).view_as(candidates)
                parents, codes, best = top_k_children(beams.scores, log_probs, n_draft)
                current[b] = beams.select(
                    parents, codes + self.layout.level_start(beams.level), best
                )
                steps[b].append(DraftStep(parents, codes, current[b], q))
                if j < lengths[b] and bool(self.trie.settles_in_one(current[b].tokens).all()):
                    # the bonus step decides every drafted path's item: drafting on is waste
                    lengths[b] = j
        return steps

    def _verify(self, roots, drafts, k, mode, generator) -> dict[int, Beams]:
        """One target call over every user's beams and drafted tree, then the acceptance walk."""
        cache = self.target_cache
        builders, tips, root_nodes, tree_nodes = {}, {}, {}, {}
        for b, beams in roots.items():
            builders[b], prompt_tip = cache.builder(b)
            tips[b], root_nodes[b] = add_beam_tips(
                builders[b], beams, "target", cache.prompt_len[b], prompt_tip
            )
            parent_nodes, tree_nodes[b] = tips[b], []
            for step in drafts[b]:
                tokens = step.beams.tokens
                positions = torch.full_like(step.codes, cache.prompt_len[b] + tokens.shape[1] - 1)
                parent_nodes = builders[b].add_children(
                    tokens[:, -1], positions, parent_nodes[step.parents]
                )
                tree_nodes[b].append(parent_nodes)
        offset = cache.length
        hidden = cache.forward(builders)
        out = {}
        for b, beams in roots.items():
            self.stats[b].target_calls += 1
            self.stats[b].rounds += 1
            self.stats[b].drafted_steps += len(drafts[b])
            beams.slots["target"] = torch.where(
                root_nodes[b] >= 0, offset + root_nodes[b], beams.slots["target"]
            )
            walk = _Walk(self, beams, hidden[b], tips[b], drafts[b], tree_nodes[b], offset)
            walk.excluded = self.excluded[b]
            out[b] = walk.run(k, mode, generator, self.stats[b])
        return out


class _Walk:
    """The acceptance walk of one user over its verified draft tree."""

    def __init__(
        self, spec: _Speculation, roots: Beams, hidden, tips, steps, nodes, offset: int
    ) -> None:
        self.spec, self.roots, self.hidden, self.steps = spec, roots, hidden, steps
        self.nodes = [tips] + nodes  # builder node of each root beam, then of each D_j node
        self.excluded: list[torch.Tensor] | None = None
        # the target-cache slot path of every D_j node
        self.target_paths = []
        path = roots.slots["target"]
        for step, step_nodes in zip(steps, nodes, strict=True):
            path = torch.cat([path[step.parents], offset + step_nodes[:, None]], 1)
            self.target_paths.append(path)

    def _hidden(self, j: int, index: torch.Tensor) -> torch.Tensor:
        """Target hidden states of nodes ``index`` of D_j (j = 0: the root beams)."""
        return self.hidden[self.nodes[j][index]]

    def run(self, k: int, mode: Mode, generator: torch.Generator, stats: DecodeStats) -> Beams:
        layout, trie, scorer = self.spec.layout, self.spec.trie, self.spec.target_scorer
        tokens, scores = self.roots.tokens, self.roots.scores
        target_slots, draft_slots = self.roots.slots["target"], self.roots.slots["draft"]
        index = torch.arange(len(scores), device=scores.device)  # current beams as nodes of D_{j-1}
        for j in range(1, len(self.steps) + 2):
            level = tokens.shape[1]
            log_probs = child_log_probs(
                scorer, self._hidden(j - 1, index), tokens, trie, self.excluded
            )
            if j > len(self.steps):
                parents, codes, best = top_k_children(scores, log_probs, k)
            elif mode == "strict":
                parents, codes, best, taken = _strict_step(
                    scores, log_probs, index, self.steps[j - 1], k
                )
            else:
                parents, codes, best, taken = _relaxed_step(
                    scores, log_probs, index, self.steps[j - 1], k, generator
                )
            if j <= len(self.steps) and taken is not None:
                stats.accepted_steps += 1
                step = self.steps[j - 1]
                index, scores, tokens = taken, best, step.beams.tokens[taken]
                target_slots, draft_slots = (
                    self.target_paths[j - 1][taken],
                    step.beams.slots["draft"][taken],
                )
                continue
            new_tokens = codes + layout.level_start(level)
            unfed = torch.full_like(parents[:, None], -1)
            return Beams(
                torch.cat([tokens[parents], new_tokens[:, None]], 1),
                best,
                {
                    "target": torch.cat([target_slots[parents], unfed], 1),
                    "draft": torch.cat([draft_slots[parents], unfed], 1),
                },
            )
        raise AssertionError("the walk always ends at the bonus step")


def _drafted_positions(index: torch.Tensor, step: DraftStep, codes_per_level: int):
    """Key (current-beam, code) of each drafted node whose parent is a current beam, and that node."""
    position_of = torch.full((step.q.shape[0],), -1, dtype=torch.long, device=index.device)
    position_of[index] = torch.arange(len(index), device=index.device)
    beam = position_of[step.parents]
    drafted = (beam >= 0).nonzero()[:, 0]
    return beam[drafted] * codes_per_level + step.codes[drafted], drafted


def _strict_step(scores, log_probs, index, step: DraftStep, k: int):
    """Target top-K; ``taken`` = their D_j nodes when all of them were drafted, else None."""
    parents, codes, best = top_k_children(scores, log_probs, k)
    keys, nodes = _drafted_positions(index, step, log_probs.shape[1])
    match = (parents * log_probs.shape[1] + codes)[:, None] == keys[None, :]
    if len(keys) and bool(match.any(1).all()):
        return parents, codes, best, nodes[match.int().argmax(1)]
    return parents, codes, best, None


def _relaxed_step(scores, log_probs, index, step: DraftStep, k: int, generator: torch.Generator):
    """Accept drafted y with prob min(1, p/q); top up from the residual max(p - q, 0) if short."""
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
        return chosen // n_codes, chosen % n_codes, candidates[chosen], accepted_nodes[order]
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
    return chosen // n_codes, chosen % n_codes, candidates[chosen], None


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
    target_scorer = ItemScorer(target, layout, score_mode)
    draft_scorer = ItemScorer(draft, layout, score_mode)
    caches = {"target": TreeCache(target, prompts), "draft": TreeCache(draft, prompts)}
    n_users = len(prompts)
    device = caches["target"].device
    excluded = excluded_nodes(trie, exclude, n_users)
    names = ("target", "draft")
    active = {b: initial_beams(device, target_scorer.dtype, names) for b in range(n_users)}
    finished: dict[int, Beams] = {}
    stats = [DecodeStats() for _ in range(n_users)]
    accepted = [[True] * n_users for _ in range(layout.depth)]
    while active:
        retire_finished(active, finished, trie, stats, excluded, score_mode)
        if not active:
            break
        hidden = {name: feed_beams(caches[name], active, name) for name in names}
        for b, beams in active.items():
            stats[b].target_calls += 1
            stats[b].draft_calls += 1
            level = beams.level
            log_probs = child_log_probs(target_scorer, hidden["target"][b], beams.tokens, trie,
                                        excluded[b])  # fmt: skip
            draft_log_probs = child_log_probs(draft_scorer, hidden["draft"][b], beams.tokens,
                                              trie, excluded[b])  # fmt: skip
            parents, codes, best = top_k_children(beams.scores, log_probs, k)
            drafted_parents, drafted_codes, _ = top_k_children(
                beams.scores, draft_log_probs, n_draft
            )
            width = log_probs.shape[1]
            accepted[level][b] = bool(
                torch.isin(parents * width + codes, drafted_parents * width + drafted_codes).all()
            )
            active[b] = beams.select(parents, codes + layout.level_start(level), best)
        for name in names:
            maybe_compact(caches[name], active, name)
    result = assemble([finished[b] for b in range(n_users)], trie, k, stats)
    return result, accepted
