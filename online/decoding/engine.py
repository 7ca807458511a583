"""The decoding engine: constrained beam search, target-only or speculative (online decoding step).

One round loop (``BatchedDecode``) runs target-only search
(``batched_beam_search``), strict and relaxed speculative search
(``batched_speculative_beam_search``) and the strict-acceptance diagnostic
(``strict_acceptance_per_level``, its ``probe`` mode) for serving, evaluation,
training and the benches, with a fixed number of tensor operations per step
whatever the batch size:

- beams are flat tensors (``BeamBatch``: [B, W] scores and trie nodes,
  [B, W, depth] tokens and, per model, the cache slot of every token);
- each model's KV lives in preallocated per-layer tensors addressed by slot
  (``slot_cache.SlotModel``): a new token attends to its user's prompt and its
  own path through a 4D mask, at position ``prompt_len + level``;
- trie lookups are gathers on global, padded tables (``trie_tables``), so users
  at different levels share a step; seen items are one [B, nodes] mask;
- finished users are masked, not removed. Target-only search takes one step
  per level and reads nothing back from the device; on a CPU, where a read
  costs nothing, it reads one flag per level and stops once every beam of the
  batch has a single item left (``stop_early``). A speculative round reads
  back the pair (anyone still decoding, the longest draft) and, after each
  drafted level, the longest draft left: they size its calls.

A round, for every user still decoding (at level t, with K beams):

1. Draft (speculative only): g = min(gamma, depth - t - 1) steps of a width-N
   beam search with the draft from the K beams, 0 when every beam "settles in
   one" (one more code decides each item), and stopped early once every drafted
   path settles. Step j keeps D_j (N (parent, code) pairs) and, for relaxed,
   q_j: the draft's softmax over the cumulative scores of all parent x code.
2. ONE target call over the beams' newest tokens and every drafted node.
3. The walk, j = 1 .. g + 1: T_j = the target's top-K of (current beams x
   allowed codes). ``strict``: when every (parent, code) of T_j was drafted,
   the beams become those D_j nodes and the walk goes on, else T_j ends the
   round; level g + 1 is a free bonus. The output equals target-only search
   (lossless). ``relaxed``: a drafted node is accepted with probability
   min(1, p/q); with >= K accepted the best K go on, else the missing ones are
   sampled without replacement from max(p - q, 0) (exponential races) and the round
   ends. Seeded; not lossless. Target-only rounds are the bonus level alone.

The probe (``strict_acceptance_per_level``) drafts one level every round from
the target's K beams, feeds nothing drafted to the target, and at step 3 only
records whether strict would have taken D_1; the round ends with T_1.

Levels with a single valid child for every beam take a call (their log-prob is
0 under ``"allowed"`` scores), except where every beam of a user has a single
item left: the rest of its IDs is forced, so the user is done (``single_items``).

Scores (``score_mode``): ``"allowed"`` (default) is the log-softmax over the
trie-allowed codes at each step (the model's distribution restricted to valid
items; only the level's rows of the output projection are computed);
``"full"`` is the log-softmax over the whole vocabulary, then masked. Each
equals transformers' ``generate(num_beams=K)`` with ``TrieLogitsProcessor``
(renormalizing, or not), item for item; seen items (``exclude``) are masked
after normalizing by the same ``ItemConstraint`` (constraints.py).

Measured (2-core CPU, one torch thread, random models of the ``small`` preset's
shape over an ML-100K-shaped catalog, 169-token prompts from cached prefixes,
K = 10, N = 20; ``app/bench/engine.py``): docs/decoding.md.

Example::

    result = batched_beam_search(target, [[1, 7, 260, 517, 772]], trie, layout, k=10)
    result.item_index[0]   # catalog rows of the 10 best items, best first
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F

from genrec.online.decoding.constraints import ItemConstraint
from genrec.online.decoding.prefix_kv import PrefixBatch, PrefixKV
from genrec.online.decoding.slot_cache import Prompts, SlotModel
from genrec.online.decoding.trie_tables import TrieTables

if TYPE_CHECKING:
    from genrec.online.decoding.trie import ItemTrie
    from genrec.schemas.token_layout import TokenLayout

ScoreMode = Literal["allowed", "full"]
Level = int | torch.Tensor  # the level of every user: one int when all share it, else LongTensor[B]
Edges = tuple[torch.Tensor, torch.Tensor]  # (codes, exists) [B, W, F]: TrieTables.codes
Mode = Literal["target", "strict", "relaxed", "probe"]
NEG_INF = -math.inf  # a score of -inf: no beam (scores are finite or -inf, never +inf or nan)


@dataclass
class DecodeStats:
    """Cost of one request: model calls it took part in, and draft acceptance."""

    target_calls: int = 0
    draft_calls: int = 0
    rounds: int = 0
    drafted_steps: int = 0
    accepted_steps: int = 0
    forced_steps: int = 0
    speculative: bool = False

    @property
    def acceptance(self) -> float:
        """Accepted / drafted steps (nan when nothing was drafted)."""
        return self.accepted_steps / self.drafted_steps if self.drafted_steps else math.nan


# The per-user counters the engine keeps in one tensor: every DecodeStats field but the flag
# (the last field: ``result`` builds DecodeStats positionally).
STAT_NAMES = tuple(f.name for f in fields(DecodeStats))[:-1]
if fields(DecodeStats)[-1].name != "speculative":
    raise TypeError("DecodeStats.speculative must stay its last field")


@dataclass
class DecodeResult:
    """Top-K items per user, best first. Missing beams (tiny catalogs) have item -1, score -inf."""

    tokens: torch.Tensor  # LongTensor[B, K, depth]
    item_index: torch.Tensor  # LongTensor[B, K]
    scores: torch.Tensor  # Tensor[B, K]
    stats: list[DecodeStats] = field(default_factory=list)
    # with ``keep_prompt_kv``: each user's prompt KV (``SlotModel.prompt_kvs``), the target's
    # and, in a speculative decode, the draft's
    prompt_kv: list[PrefixKV] | None = None
    draft_prompt_kv: list[PrefixKV] | None = None


class AcceptanceMonitor:
    """Falls back to target-only decoding when draft acceptance over recent requests is too
    low (a draft no longer aligned with the target), still probing every ``probe_every``th
    call so that it can switch back."""

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


def check_inputs(model, prompts: Prompts, layout: TokenLayout, trie: ItemTrie, k: int) -> ItemTrie:
    """Refuse bad arguments; returns the trie on the model's device."""
    if k < 1:
        raise ValueError(f"beam width k must be >= 1, got {k}")
    if trie.layout != layout:
        raise ValueError("the trie was built for another token layout")
    if not isinstance(prompts, PrefixBatch) and not isinstance(prompts, list):
        raise TypeError("prompts must be a list of token-id lists or a PrefixBatch")
    return trie.to(next(model.parameters()).device)


def split_prompts(prompts) -> tuple[Prompts, Prompts]:
    """(target, draft) prompts; a lone PrefixBatch is the target's, the draft prefills in full."""
    if isinstance(prompts, tuple):
        return prompts
    if isinstance(prompts, PrefixBatch):
        full = [
            p.prompt_ids + list(s) for p, s in zip(prompts.prefixes, prompts.suffixes, strict=True)
        ]
        return prompts, full
    return prompts, prompts


@dataclass
class BeamBatch:
    """W beams (or drafted nodes) per user; ``paths[name][b, w, d]``: slot of token d in model
    ``name``'s cache, -1 while not fed to it."""

    scores: torch.Tensor  # [B, W]; -inf: no beam here
    nodes: torch.Tensor  # [B, W]: global trie node of the beam's prefix (TrieTables)
    tokens: torch.Tensor  # [B, W, depth]
    paths: dict[str, torch.Tensor]

    def take(self, index: torch.Tensor) -> BeamBatch:
        """The beams at ``index`` ([B, N] in [0, W))."""
        per_token = index[..., None].expand(-1, -1, self.tokens.shape[2])
        return BeamBatch(
            self.scores.gather(1, index),
            self.nodes.gather(1, index),
            self.tokens.gather(1, per_token),
            {name: path.gather(1, per_token) for name, path in self.paths.items()},
        )

    def where(self, keep: torch.Tensor, other: BeamBatch) -> BeamBatch:
        """Per user: these beams where ``keep[b]``, else ``other``'s."""
        row, cell = keep[:, None], keep[:, None, None]
        return BeamBatch(
            torch.where(row, self.scores, other.scores),
            torch.where(row, self.nodes, other.nodes),
            torch.where(cell, self.tokens, other.tokens),
            {n: torch.where(cell, p, other.paths[n]) for n, p in self.paths.items()},
        )


@dataclass
class DraftLevel:
    """D_j for every user: its nodes, their parents (in D_{j-1}, or the beams for j = 1) and codes,
    q_j (relaxed only) and the rows of the verification call that fed them."""

    beams: BeamBatch
    parents: torch.Tensor  # [B, n_j]
    codes: torch.Tensor  # [B, n_j]
    q: torch.Tensor | None  # [B, n_{j-1}, C]
    previous: int  # n_{j-1}
    rows: torch.Tensor | None = None  # [B, n_j]


class ItemHead:
    """Log-probs of the next code from a model's last hidden states, for users at any level."""

    def __init__(self, model, tables: TrieTables, score_mode: ScoreMode) -> None:
        if score_mode not in ("allowed", "full"):
            raise ValueError(f"score_mode must be 'allowed' or 'full', got {score_mode!r}")
        layout = tables.trie.layout
        head = model.get_output_embeddings()
        if head.weight.shape[0] < layout.item_token_end:
            raise ValueError("the model's vocabulary does not cover the layout's item tokens")
        self.tables, self.score_mode = tables, score_mode
        self.weight, self.bias = head.weight, getattr(head, "bias", None)
        rows = slice(layout.item_token_start, layout.item_token_end)
        self.item_weight = head.weight[rows]
        self.item_bias = None if self.bias is None else self.bias[rows]
        self.first_item_token = layout.item_token_start
        self.level_rows = [layout.level_range(level) for level in range(layout.depth)]
        self.level_weight = [head.weight[r.start : r.stop] for r in self.level_rows]
        self.level_bias = [
            None if self.bias is None else self.bias[r.start : r.stop] for r in self.level_rows
        ]
        # HF's generate scores in float32; float64 models keep float64
        self.dtype = torch.promote_types(head.weight.dtype, torch.float32)

    def log_probs(
        self,
        hidden: torch.Tensor,
        nodes: torch.Tensor,
        level: Level,
        dead,
        edges: Edges | None = None,
    ) -> torch.Tensor:
        """[B, W, C]: log-prob of each code after each beam; -inf where invalid or excluded.

        Exclusions (``dead``: ``ItemConstraint.dead_nodes`` as ``TrieTables.dead_children``)
        are masked AFTER normalizing, so every other item keeps the score it has without them.
        ``edges``: ``self.edges(nodes, level)`` when the caller has read them already.
        """
        width = self.tables.width
        fan = self.fan(level)
        codes, exists = self.edges(nodes, level) if edges is None else edges
        columns = torch.where(exists, codes.long(), width)  # column ``width``: nowhere
        # adding 0 / -inf is the where(allowed, x, -inf) it replaces, several times cheaper
        # on a CPU than a where over a boolean mask
        bias = torch.full(
            (*nodes.shape, width + 1), -math.inf, dtype=self.dtype, device=nodes.device
        )
        bias = bias.scatter_(2, columns, 0.0)[..., :width]
        if self.score_mode == "full":
            log_probs = torch.log_softmax(
                F.linear(hidden, self.weight, self.bias).to(self.dtype), -1
            )
            log_probs = self._level_columns(log_probs, level, vocabulary=True) + bias
        else:
            logits = self._level_columns(hidden, level, vocabulary=False)
            log_probs = torch.log_softmax(logits + bias, -1)  # -inf where not allowed
            # nothing allowed (no beam, a finished user): nan, which must read -inf
            log_probs.nan_to_num_(nan=NEG_INF, posinf=math.inf, neginf=NEG_INF)
        if dead is None:
            return log_probs
        return log_probs.masked_fill(dead.blocked(nodes, fan), -math.inf)

    def fan(self, level: Level) -> int:
        """F: the edges per beam a step at ``level`` reads, the level's widest node (every code
        when users stand at different levels)."""
        return self.tables.level_fan[level] if isinstance(level, int) else self.tables.width

    def edges(self, nodes: torch.Tensor, level: Level) -> Edges:
        """(codes, exists) [B, W, F] of each beam's node (``TrieTables.codes``)."""
        return self.tables.codes(nodes, self.fan(level))

    def _level_columns(self, values: torch.Tensor, level: Level, vocabulary: bool) -> torch.Tensor:
        """[B, W, C] at each user's level: columns of full-vocabulary log-probs (``vocabulary``),
        else the logits of hidden states ``values``. Padded codes hold 0 (never allowed)."""
        width = self.tables.width
        if isinstance(level, int):  # one level for every user: only its rows of the output layer
            rows = self.level_rows[level]
            if vocabulary:
                values = values[..., rows.start : rows.stop]
            else:
                values = F.linear(values, self.level_weight[level], self.level_bias[level])
            values = values.to(self.dtype)
            return F.pad(values, (0, width - len(rows))) if width > len(rows) else values
        columns = self.tables.item_row[level.clamp(max=self.tables.depth - 1)][:, None, :]
        if vocabulary:
            columns = columns + self.first_item_token
        else:
            values = F.linear(values, self.item_weight, self.item_bias).to(self.dtype)
        return values.gather(2, columns.expand(-1, values.shape[1], -1))


def extend(
    beams: BeamBatch, keys: torch.Tensor, scores: torch.Tensor, level: Level, tables: TrieTables
) -> BeamBatch:
    """Children (parent = key // C, code = key % C) at ``level``, with ``scores``; their new
    token is unfed in every cache. A child with score -inf is no beam."""
    parents, codes = keys // tables.width, keys % tables.width
    base = beams.take(parents)
    valid = scores > NEG_INF
    if isinstance(level, int):
        token = codes + int(tables.level_start[level])
    else:
        token = tables.level_start[level.clamp(max=tables.depth - 1)][:, None] + codes
    token = torch.where(valid, token, tables.trie.layout.pad_token_id)
    tokens = set_level(base.tokens, level, token, in_place=True)
    nodes = torch.where(valid, tables.child_of(base.nodes, codes), tables.sink)
    return BeamBatch(scores, nodes, tokens, base.paths)


def top_k(candidates: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores, keys) of the ``k`` best of each row, padded with -inf where a row has fewer."""
    n = candidates.shape[1]
    if n >= k:
        return candidates.topk(k, 1)
    scores, keys = candidates.topk(n, 1)
    return F.pad(scores, (0, k - n), value=-math.inf), F.pad(keys, (0, k - n))


def at_level(values: torch.Tensor, level: Level) -> torch.Tensor:
    """``values[b, w, level[b]]`` ([B, W, depth] -> [B, W]); levels are clamped into range."""
    if isinstance(level, int):
        return values[:, :, level]
    index = level.clamp(0, values.shape[2] - 1)[:, None, None].expand(-1, values.shape[1], 1)
    return values.gather(2, index)[..., 0]


def set_level(
    values: torch.Tensor, level: Level, new: torch.Tensor, in_place: bool = False
) -> torch.Tensor:
    """``values`` with ``values[b, w, level[b]] = new[b, w]`` (levels clamped into range)."""
    if isinstance(level, int):
        values = values if in_place else values.clone()
        values[:, :, level] = new
        return values
    index = level.clamp(0, values.shape[2] - 1)[:, None, None].expand(-1, values.shape[1], 1)
    return values.scatter(2, index, new[..., None])


def positions_at(kv: SlotModel, level: Level, width: int) -> torch.Tensor:
    """LongTensor[B, width]: the position of a token at ``level`` (prompt length + level)."""
    return (kv.prompt_len + level)[:, None].expand(-1, width)


def feed_newest(
    kv: SlotModel, beams: BeamBatch, levels: Level, name: str, chain: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inputs that feed each beam's tokens at levels ``levels - chain .. levels - 1``.

    A token already in the cache is fed as a dummy nobody attends to (with one
    level for all, target-only search, the newest token is never in it). Rows
    are level-major (``chain`` blocks of W) from slot ``kv.cursor``. Returns
    (ids, positions, per-row paths, the beams' paths with the new slots).
    """
    width = beams.scores.shape[1]
    path, ids, positions, rows = beams.paths[name], [], [], []
    for i in range(chain):
        slots = kv.cursor + i * width + torch.arange(width, device=kv.device)
        level = levels - chain + i
        if isinstance(level, int):
            path = set_level(path, level, slots.expand(beams.scores.shape[0], -1))
            ids.append(at_level(beams.tokens, level))
        else:
            old = at_level(path, level)
            real = (level >= 0)[:, None] & (old < 0)
            path = set_level(path, level, torch.where(real, slots, old))
            ids.append(torch.where(real, at_level(beams.tokens, level), 0))
            level = level.clamp(min=0)
        positions.append(positions_at(kv, level, width))
        rows.append(path)
    if chain == 1:
        return ids[0], positions[0], rows[0], path
    return torch.cat(ids, 1), torch.cat(positions, 1), torch.cat(rows, 1), path


class BatchedDecode:
    """One batched decode (module docstring): the state of every user, and the rounds."""

    def __init__(
        self,
        target,
        prompts: Prompts,
        tables: TrieTables,
        k: int,
        score_mode: ScoreMode = "allowed",
        exclude: Sequence[Sequence[int]] | None = None,
        draft=None,
        draft_prompts: Prompts | None = None,
        n_draft: int = 40,
        gamma: int = 0,
        mode: Mode = "target",
        generator: torch.Generator | None = None,
        stop_early: bool | None = None,
        constraint: ItemConstraint | None = None,
        keep_prompt_kv: bool = False,
    ) -> None:
        if mode not in ("target", "strict", "relaxed", "probe"):
            raise ValueError(f"mode must be 'strict' or 'relaxed', got {mode!r}")
        if mode != "target" and (n_draft < k or gamma < 0):
            raise ValueError("need n_draft >= k and gamma >= 0")
        self.tables, self.k, self.mode = tables, k, mode
        self.depth, self.width = tables.depth, tables.width
        # the probe drafts one level every round, the last one too
        self.gamma = {"target": 0, "probe": 1}.get(mode, min(gamma, self.depth - 1))
        self.widths = [k]  # n_j: nodes per drafted level
        for _ in range(self.gamma):
            self.widths.append(min(n_draft, self.widths[-1] * self.width))
        rounds_after_first = self.depth - 1
        drafted = self.depth * sum(self.widths[1:])
        self.target = SlotModel(target, prompts, rounds_after_first * k + drafted)
        self.n_users = self.target.n_users
        self.device = self.target.device
        self.target_head = ItemHead(target, tables, score_mode)
        # the rule transformers' generate is checked with (TrieLogitsProcessor); ``constraint``
        # (instead of ``exclude``): any composed one
        constraint = constraint or ItemConstraint.for_users(tables.trie, exclude, self.n_users)
        self.dead = constraint.dead_nodes()
        # the same nodes keyed by parent: a step's mask asks once per beam (DeadChildren)
        self.dead_children = None if self.dead is None else tables.dead_children(self.dead)
        self.draft = self.draft_head = None
        if self.gamma:
            redrafted = self.depth * sum(self.widths[1:-1])
            self.draft = SlotModel(draft, draft_prompts, rounds_after_first * 2 * k + redrafted)
            if not torch.equal(self.draft.prompt_len, self.target.prompt_len):
                raise ValueError("target and draft prompts differ in length")
            self.draft_head = ItemHead(draft, tables, score_mode)
        self.keep_prompt_kv = keep_prompt_kv
        # reading a flag back costs nothing on a CPU; on a GPU it would stall the queue
        self.stop_early = self.device.type == "cpu" if stop_early is None else stop_early
        self.generator = generator
        self.stats = torch.zeros(
            self.n_users, len(STAT_NAMES), dtype=torch.long, device=self.device
        )
        # probe: would strict verification take level d of user b (a level nobody drafts: yes)
        self.accepted = torch.ones(self.n_users, self.depth, dtype=torch.bool, device=self.device)

    def initial_beams(self) -> BeamBatch:
        """One beam per user at the root; speculative rounds keep K slots from the start (the
        walk merges users that stop at different levels), the others -inf."""
        n, k, device = self.n_users, self.k if self.gamma else 1, self.device
        scores = torch.full((n, k), -math.inf, dtype=self.target_head.dtype, device=device)
        scores[:, 0] = 0.0
        nodes = torch.full((n, k), self.tables.sink, dtype=torch.long, device=device)
        nodes[:, 0] = 0  # the root
        pad = self.tables.trie.layout.pad_token_id
        tokens = torch.full((n, k, self.depth), pad, dtype=torch.long, device=device)
        names = ("target", "draft") if self.draft is not None else ("target",)
        return BeamBatch(
            scores, nodes, tokens, {name: torch.full_like(tokens, -1) for name in names}
        )

    @torch.no_grad()
    def run(self) -> DecodeResult:
        try:
            result = self._run()
            if self.keep_prompt_kv and self.target.fed_pending:
                result.prompt_kv = self.target.prompt_kvs(_model_version(self.target))
                if self.draft is not None and self.draft.fed_pending:
                    result.draft_prompt_kv = self.draft.prompt_kvs(_model_version(self.draft))
            return result
        finally:
            for kv in (self.target, self.draft):
                if kv is not None:
                    kv.close()

    def _run(self) -> DecodeResult:
        beams = self.initial_beams()
        if not self.gamma:
            return self.result(self.target_only(beams))
        levels = torch.zeros(self.n_users, dtype=torch.long, device=self.device)
        for round_index in range(self.depth):  # each round decides >= 1 level of every user
            completed, done = self.single_items(beams)
            done &= levels < self.depth
            self.count("forced_steps", torch.where(done, self.depth - levels, 0))
            beams, levels = completed.where(done, beams), torch.where(done, self.depth, levels)
            active = levels < self.depth
            lengths = self.draft_lengths(beams, levels, active)
            # the one host read of a round: it sizes the draft and verification calls
            anyone, longest = torch.stack([active.any().long(), lengths.max()]).tolist()
            if not anyone:
                break
            drafts = self.propose(beams, levels, lengths, longest)
            # the probe's walk never goes past the target's own choice: nothing to verify
            verified = [] if self.mode == "probe" else drafts
            hidden, tips = self.verify(beams, levels, verified, first=round_index == 0)
            for name, amount in (
                ("target_calls", active),
                ("rounds", active),
                ("drafted_steps", lengths),
            ):
                self.count(name, amount)
            beams, levels = self.walk(beams, levels, lengths, drafts, hidden, tips)
        return self.result(beams)

    def target_only(self, beams: BeamBatch) -> BeamBatch:
        """Every user at the same level, one target call per level; with ``stop_early``, ends
        once every beam of the batch has a single item below (one host read per level)."""
        calls = self.depth
        for level in range(self.depth):
            if level and self.stop_early:
                completed, done = self.single_items(beams)
                if bool(done.all()):
                    beams, calls = completed, level
                    break
            hidden, tips = self.verify(beams, level, [], first=level == 0)
            _, top_scores, top_keys = self.target_choice(beams, hidden, tips, level)
            beams = extend(beams, top_keys, top_scores, level, self.tables)
        self.count("target_calls", torch.full_like(self.stats[:, 0], calls))
        self.count("forced_steps", torch.full_like(self.stats[:, 0], self.depth - calls))
        return beams

    def target_choice(
        self, current: BeamBatch, hidden: torch.Tensor, rows: torch.Tensor, level: Level
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(candidates [B, K*C]: scores of current beam x code, the target's top-K scores, keys)
        from the target's hidden states at ``rows`` (one per current beam)."""
        at_rows = hidden.gather(1, rows[..., None].expand(-1, -1, hidden.shape[2]))
        edges = self.target_head.edges(current.nodes, level)  # the mask's, and the top-K's
        log_probs = self.target_head.log_probs(
            at_rows, current.nodes, level, self.dead_children, edges
        )
        candidates = (current.scores[..., None] + log_probs).flatten(1)
        return (candidates, *self.top_candidates(candidates, current.nodes, level, edges))

    def top_candidates(
        self,
        candidates: torch.Tensor,
        nodes: torch.Tensor,
        level: Level,
        edges: Edges,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``top_k(candidates, k)`` (keys into [B, W*C]). At one level for every user, among the
        codes each beam's node allows (``TrieTables.codes``, F = ``narrow_fan``; every other
        candidate is -inf): a top-K over W x the level's widest node (10 x 16 on ML-100K's
        second level) instead of W x C (10 x 256) values, where CPU topk cost most of a
        step's own work. ``edges``: the nodes' (codes, exists) at the level's F
        (``ItemHead.edges``); their first ``narrow_fan`` columns are the edges read here."""
        fan = self.tables.narrow_fan(level) if isinstance(level, int) else None
        if fan is None or nodes.shape[1] * fan < self.k:
            return top_k(candidates, self.k)
        codes, exists = (part[..., :fan] for part in edges)  # a node's edges ascend by code
        beam_start = torch.arange(nodes.shape[1], device=self.device)[:, None] * self.width
        keys = (codes.long() + beam_start).flatten(1)
        # past a node's own codes the row holds another node's: -inf, as a disallowed code is
        scores = candidates.gather(1, keys).masked_fill(~exists.flatten(1), -math.inf)
        scores, index = scores.topk(self.k, 1)
        return scores, keys.gather(1, index)

    def count(self, name: str, amount: torch.Tensor) -> None:
        self.stats[:, STAT_NAMES.index(name)] += amount.long()

    def single_items(self, beams: BeamBatch) -> tuple[BeamBatch, torch.Tensor]:
        """(the beams completed to the one item below each, and per user: does every beam have
        one item below). The rest of such an ID is forced: log-prob 0 under ``"allowed"``
        scores; never under ``"full"``."""
        tables = self.tables
        items = tables.item_below[beams.nodes].long()
        valid = beams.scores > NEG_INF
        done = ((items >= 0) | ~valid).all(1) & (self.target_head.score_mode == "allowed")
        item_nodes = torch.where(valid & (items >= 0), tables.item_offset + items, tables.sink)
        tokens = tables.trie.item_tokens[items.clamp(min=0)]
        tokens = torch.where(valid[..., None], tokens, beams.tokens)
        scores = beams.scores
        if self.dead is not None:  # only a one-item catalog's root can lead to an excluded item
            scores = scores.masked_fill(self.dead.contains(item_nodes), NEG_INF)
        return BeamBatch(scores, item_nodes, tokens, beams.paths), done

    def _settled(self, beams: BeamBatch) -> torch.Tensor:
        """[B]: every beam of the user settles in one item (or is no beam)."""
        return (self.tables.settles[beams.nodes] | (beams.scores == NEG_INF)).all(1)

    def draft_lengths(self, beams: BeamBatch, levels: torch.Tensor, active: torch.Tensor):
        """g per user: min(gamma, depth - t - 1), 0 once every beam settles in one (or done)."""
        if self.mode == "probe":
            return active.long()
        settled = self._settled(beams)
        lengths = (self.depth - 1 - levels).clamp(0, self.gamma)
        return torch.where(settled | ~active, 0, lengths)

    def propose(
        self, beams: BeamBatch, levels: torch.Tensor, lengths: torch.Tensor, longest: int
    ) -> list[DraftLevel]:
        """D_1 .. D_longest: the draft's beam search from the beams, one draft call per level."""
        drafts, frontier, j = [], beams, 0
        while j < longest:
            j += 1
            level = levels + j - 1  # the level D_j decides
            hidden = self.draft_call(frontier, levels, j)
            log_probs = self.draft_head.log_probs(hidden, frontier.nodes, level, self.dead_children)
            candidates = (frontier.scores[..., None] + log_probs).flatten(1)
            scores, keys = candidates.topk(self.widths[j], 1)
            drafting = lengths >= j
            scores = scores.masked_fill(~drafting[:, None], -math.inf)
            nodes = extend(frontier, keys, scores, level, self.tables)
            q = None
            if self.mode == "relaxed":
                q = torch.softmax(candidates, 1).view(candidates.shape[0], -1, self.width)
            parents, codes = keys // self.width, keys % self.width
            drafts.append(DraftLevel(nodes, parents, codes, q, frontier.scores.shape[1]))
            self.count("draft_calls", drafting)
            if j < longest:  # the bonus level decides every drafted item: drafting on is waste
                settled = self._settled(nodes)
                lengths.copy_(torch.where(drafting & settled & (lengths > j), j, lengths))
                longest = int(lengths.max())  # a host read: it saves the draft calls nobody needs
            frontier = nodes
        return drafts

    def draft_call(self, frontier: BeamBatch, levels: torch.Tensor, j: int) -> torch.Tensor:
        """Draft hidden states [B, W, H] at the frontier: its unfed tokens are fed first."""
        kv = self.draft
        if j == 1 and not kv.fed_pending:
            empty = frontier.tokens[:, :0, 0]
            hidden = kv.forward(empty, empty, frontier.paths["draft"][:, :0], with_pending=True)
            tips = kv.tip_columns[:, None].expand_as(frontier.scores)
            return hidden.gather(1, tips[..., None].expand(-1, -1, hidden.shape[2]))
        # the beams' two newest tokens (the older may be in the cache), or D_{j-1}'s newest
        chain, newest = (2, levels) if j == 1 else (1, levels + j - 1)
        ids, positions, rows, path = feed_newest(kv, frontier, newest, "draft", chain)
        frontier.paths["draft"] = path
        hidden = kv.forward(ids, positions, rows)
        return hidden[:, -frontier.scores.shape[1] :]

    def verify(
        self, beams: BeamBatch, levels: Level, drafts: list[DraftLevel], first: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """ONE target call over the beams' newest tokens and every drafted node; sets the
        drafted nodes' target paths and rows. Returns the call's hidden states [B, Q, H] and
        the row of each beam's last token [B, K]."""
        kv, k, n_users = self.target, self.k, self.n_users
        if first:  # the pending prompt, whose last token every beam (only beam 0 exists) ends in
            parts: list[list[torch.Tensor]] = [[], [], []]
            tips = kv.tip_columns[:, None].expand_as(beams.scores)
            # the call's hidden states hold pending_columns of the pending tokens (all, or
            # only the last after a chunked prefill); their slots are pending_width wide
            offset, skipped = kv.pending_columns, kv.pending_width - kv.pending_columns
        else:
            ids, positions, rows, path = feed_newest(kv, beams, levels, "target", 1)
            beams.paths["target"] = path
            parts = [[ids], [positions], [rows]]
            tips, offset = torch.arange(k, device=self.device).expand(n_users, -1), k
            skipped = 0
        parent_paths = beams.paths["target"]
        for j, level_nodes in enumerate(drafts, 1):
            nodes, n = level_nodes.beams, level_nodes.parents.shape[1]
            level = (levels + j - 1).clamp(max=self.depth - 1)
            rows = offset + torch.arange(n, device=self.device).expand(n_users, -1)
            parent = level_nodes.parents[..., None].expand(-1, -1, self.depth)
            path = set_level(parent_paths.gather(1, parent), level, kv.cursor + skipped + rows)
            nodes.paths["target"], level_nodes.rows = path, rows
            parts[0].append(at_level(nodes.tokens, level))
            parts[1].append(positions_at(kv, level, n))
            parts[2].append(path)
            offset, parent_paths = offset + n, path
        if not parts[0]:
            empty = beams.tokens[:, :0]
            parts = [[empty[..., 0]], [empty[..., 0]], [empty]]
        hidden = kv.forward(*(torch.cat(p, 1) for p in parts), with_pending=first)
        return hidden, tips

    def walk(self, beams, levels, lengths, drafts, hidden, tips) -> tuple[BeamBatch, torch.Tensor]:
        """From the beams through the drafted levels each user's rule takes; returns the next
        beams and levels (module docstring, step 3)."""
        k = self.k
        current, rows = beams, tips
        index = torch.arange(k, device=self.device).expand(self.n_users, -1)
        walking = levels < self.depth
        final, new_levels = beams, levels
        for j in range(1, len(drafts) + 2):
            level = levels + j - 1
            candidates, top_scores, top_keys = self.target_choice(current, hidden, rows, level)
            accept = torch.zeros_like(walking)
            end_keys, end_scores = top_keys, top_scores
            if j <= len(drafts):
                step = drafts[j - 1]
                may_accept = walking & (lengths >= j)
                choice = self.accept(candidates, top_scores, top_keys, step, index, may_accept)
                accept, taken, taken_scores, keys, scores = choice
                if self.mode == "probe":
                    self.record_acceptance(level, may_accept, accept)
                    accept = torch.zeros_like(accept)
                end_keys = torch.where(may_accept[:, None], keys, top_keys)
                end_scores = torch.where(may_accept[:, None], scores, top_scores)
            ending = walking & ~accept
            ended = extend(current, end_keys, end_scores, level, self.tables)
            final = ended.where(ending, final)
            new_levels = torch.where(ending, level + 1, new_levels)
            self.count("accepted_steps", walking & accept)
            walking = walking & accept
            if self.mode == "probe":
                break  # the target's top-K ends every probe round
            if j <= len(drafts):
                current = replace(step.beams.take(taken), scores=taken_scores)
                rows = step.rows.gather(1, taken)
                index = torch.where(taken_scores > NEG_INF, taken, step.parents.shape[1])
                # ``index``: positions in D_j, where D_{j+1}'s parents point
        return final, new_levels

    def accept(self, candidates, top_scores, top_keys, step: DraftLevel, index, may_accept):
        """(go on [B], the D_j nodes they go on from [B, K] and their scores, and the beams a
        user that stops here ends with: keys [B, K] into ``candidates`` and scores)."""
        k, width = self.k, self.width
        previous = step.previous
        position = torch.full(
            (self.n_users, previous + 1), -1, dtype=torch.long, device=self.device
        )
        position.scatter_(1, index, torch.arange(k, device=self.device).expand(self.n_users, -1))
        beam = position[:, :previous].gather(1, step.parents)
        drafted = (beam >= 0) & (step.beams.scores > NEG_INF)
        keys = torch.where(drafted, beam * width + step.codes, k * width)
        n = keys.shape[1]
        node_of_key = torch.full(
            (self.n_users, k * width + 1), -1, dtype=torch.long, device=self.device
        )
        node_of_key.scatter_(1, keys, torch.arange(n, device=self.device).expand(self.n_users, -1))
        node_of_key = node_of_key[:, : k * width]
        if self.mode != "relaxed":
            found = node_of_key.gather(1, top_keys)
            finite = top_scores > NEG_INF
            go_on = may_accept & finite[:, 0] & ((found >= 0) | ~finite).all(1)
            return go_on, found.clamp(min=0), top_scores, top_keys, top_scores
        q = step.q.gather(1, index.clamp(max=previous - 1)[..., None].expand(-1, -1, width))
        return relaxed_choice(
            candidates, q.flatten(1), keys, drafted, node_of_key, may_accept, k, self.generator
        )

    def record_acceptance(self, level: torch.Tensor, drafted: torch.Tensor, go_on: torch.Tensor):
        """Probe: ``accepted[b, level[b]]`` = whether strict verification took it (``drafted``)."""
        column = level.clamp(max=self.depth - 1)[:, None]
        before = self.accepted.gather(1, column)[:, 0]
        self.accepted.scatter_(1, column, torch.where(drafted, go_on, before)[:, None])

    def result(self, beams: BeamBatch) -> DecodeResult:
        """Best first; missing beams (tiny catalogs) have item -1, score -inf, pad tokens."""
        order = beams.scores.argsort(dim=1, descending=True, stable=True)
        beams = beams.take(order)
        valid = beams.scores > NEG_INF
        pad = self.tables.trie.layout.pad_token_id
        tokens = torch.where(valid[..., None], beams.tokens, pad)
        items = torch.where(valid, self.tables.items(beams.nodes), -1)
        speculative = self.mode in ("strict", "relaxed")
        # positional: STAT_NAMES are DecodeStats' fields in order, ``speculative`` last
        stats = [DecodeStats(*row, speculative) for row in self.stats.tolist()]
        return DecodeResult(tokens, items, beams.scores, stats)


def _model_version(kv: SlotModel) -> str:
    """The model version of a batch's cached prefixes ("" for full prompts: the caller knows)."""
    return kv.prefixes[0].model_version if kv.prefixes else ""


def relaxed_choice(candidates, q, keys, drafted, node_of_key, may_accept, k: int, generator):
    """The relaxed rule at one drafted level, for every user (module docstring, step 3).

    ``candidates`` [B, K*C]: target scores of current beam x code; ``q``: the draft's
    probabilities of the same; ``keys`` [B, n]: each D_j node's index there (``drafted``:
    whether it extends a current beam). Returns what ``BatchedDecode.accept`` does.
    """
    p = torch.softmax(candidates.double(), 1)
    q = q.double()
    slot = keys.clamp(max=candidates.shape[1] - 1)
    ratio = p.gather(1, slot) / q.gather(1, slot).clamp(min=1e-300)
    draws = _uniform(keys.shape, generator, candidates.device)
    accepted = drafted & (draws < ratio)
    trash = candidates.shape[1]
    in_accepted = _key_mask(torch.where(accepted, keys, trash), trash)
    taken_scores, taken_keys = torch.where(in_accepted, candidates, NEG_INF).topk(k, 1)
    n_accepted = accepted.sum(1)
    go_on = may_accept & (n_accepted >= k)
    # short of K: top up from the residual max(p - q, 0), or from p where that has too few
    residual = (p - q).clamp(min=0).masked_fill(in_accepted, 0)
    missing = k - n_accepted
    thin = (residual > 0).sum(1) < missing
    weights = torch.where(thin[:, None], p.masked_fill(in_accepted, 0), residual)
    n_fill = torch.minimum(missing, (weights > 0).sum(1)).clamp(min=0)
    # sampling without replacement: the k largest w / E, E ~ Exp(1) (Gumbel top-k, in races)
    order = (weights / _exponential(weights.shape, generator, weights.device)).topk(k, 1).indices
    sampled = torch.arange(k, device=order.device)[None, :] < n_fill[:, None]
    chosen = in_accepted | _key_mask(torch.where(sampled, order, trash), trash)
    end_scores, end_keys = torch.where(chosen, candidates, NEG_INF).topk(k, 1)
    taken = node_of_key.gather(1, taken_keys).clamp(min=0)
    return go_on, taken, taken_scores, end_keys, end_scores


def _key_mask(keys: torch.Tensor, width: int) -> torch.Tensor:
    """BoolTensor[B, width]: True at ``keys`` (``width`` itself: nowhere)."""
    mask = torch.zeros(keys.shape[0], width + 1, dtype=torch.bool, device=keys.device)
    return mask.scatter_(1, keys, True)[:, :width]


def _exponential(shape, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """Exp(1) draws in float64 from ``generator`` (a CPU generator serves every device)."""
    draws = torch.empty(shape, dtype=torch.float64, device=generator.device)
    return draws.exponential_(generator=generator).to(device)


def _uniform(shape, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """Uniform draws in float64 from ``generator`` (a CPU generator serves every device)."""
    draws = torch.rand(shape, generator=generator, dtype=torch.float64, device=generator.device)
    return draws.to(device)


@torch.no_grad()
def batched_beam_search(
    model,
    prompts: Prompts,
    trie: ItemTrie,
    layout: TokenLayout,
    k: int,
    *,
    score_mode: ScoreMode = "allowed",
    exclude: Sequence[Sequence[int]] | None = None,
    stop_early: bool | None = None,
    keep_prompt_kv: bool = False,
) -> DecodeResult:
    """Top-``k`` valid items per user by beam search with ``model`` alone.

    ``prompts``: token-id lists (ragged is fine) or a ``PrefixBatch``; ``exclude[b]``:
    catalog rows user ``b`` must not get. One model call per level; ``stop_early``
    (default: on a CPU, where reading a flag back costs nothing) stops once every
    beam of the batch has a single item left (a host read per level; same items).
    ``keep_prompt_kv``: also return each user's prompt KV (``DecodeResult.prompt_kv``).
    """
    trie = check_inputs(model, prompts, layout, trie, k)
    tables = TrieTables.of(trie)
    decode = BatchedDecode(
        model, prompts, tables, k, score_mode, exclude, stop_early=stop_early,
        keep_prompt_kv=keep_prompt_kv,
    )  # fmt: skip
    return decode.run()


@torch.no_grad()
def batched_speculative_beam_search(
    target,
    draft,
    prompts: Prompts | tuple[PrefixBatch, PrefixBatch],
    trie: ItemTrie,
    layout: TokenLayout,
    k: int,
    *,
    n_draft: int = 40,
    gamma: int = 3,
    mode: Literal["strict", "relaxed"] = "strict",
    generator: torch.Generator | None = None,
    score_mode: ScoreMode = "allowed",
    monitor: AcceptanceMonitor | None = None,
    exclude: Sequence[Sequence[int]] | None = None,
    keep_prompt_kv: bool = False,
) -> DecodeResult:
    """Top-``k`` valid items per user, the draft proposing and the target verifying.

    ``prompts``: token-id lists; or a target ``PrefixBatch`` (the draft then
    prefills the full prompts); or a (target, draft) pair of those. ``generator``
    seeds relaxed sampling (default: a CPU generator with seed 0). With a
    ``monitor`` that says the draft no longer pays, decodes target-only.
    ``keep_prompt_kv``: as ``batched_beam_search``, the draft's too.
    """
    target_prompts, draft_prompts = split_prompts(prompts)
    trie = check_inputs(target, target_prompts, layout, trie, k)
    if monitor is not None and not monitor.use_speculative():
        options = {"score_mode": score_mode, "exclude": exclude, "keep_prompt_kv": keep_prompt_kv}
        return batched_beam_search(target, target_prompts, trie, layout, k, **options)
    decode = BatchedDecode(
        target, target_prompts, TrieTables.of(trie), k, score_mode, exclude, draft=draft,
        draft_prompts=draft_prompts, n_draft=n_draft, gamma=gamma, mode=mode,
        generator=generator or torch.Generator().manual_seed(0), keep_prompt_kv=keep_prompt_kv,
    )  # fmt: skip
    result = decode.run()
    for stats in result.stats if monitor is not None else ():
        monitor.record(stats)
    return result


@torch.no_grad()
def strict_acceptance_per_level(
    target,
    draft,
    prompts: Prompts,
    trie: ItemTrie,
    layout: TokenLayout,
    k: int,
    *,
    n_draft: int = 40,
    score_mode: ScoreMode = "allowed",
    exclude: Sequence[Sequence[int]] | None = None,
) -> tuple[DecodeResult, list[list[bool]]]:
    """Target-only beam search, and per level per user: would strict verification accept the draft?

    The probe mode of the round loop: every round the draft expands the
    target's K beams by one level (target beam scores + draft log-probs, top
    ``n_draft``, as the first drafted level of a speculative round) and the
    strict rule only records whether every (parent, code) of the target's top-K
    is among them; the round then ends with the target's top-K. Levels nobody
    drafts (the user's items are decided) count as accepted. Returns (the
    result, equal to ``batched_beam_search``'s items; ``accepted[level][user]``):
    a draft-alignment signal per level, free of the round structure that
    ``DecodeStats.acceptance`` has.
    """
    trie = check_inputs(target, prompts, layout, trie, k)
    decode = BatchedDecode(
        target, prompts, TrieTables.of(trie), k, score_mode, exclude, draft=draft,
        draft_prompts=prompts, n_draft=n_draft, mode="probe",
    )  # fmt: skip
    result = decode.run()
    return result, decode.accepted.T.tolist()
