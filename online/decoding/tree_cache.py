"""The KV cache of a batched beam decode, one row per user, fed as a tree (online decoding step).

``TreeCache`` holds one KV-cache row per USER (not per beam). The row holds the
user's prompt once, then generated tokens as tree nodes; every forward passes a
4D mask in which a node sees the prompt and its own ancestors only, at position
``prompt_len + level``. Beams share the prompt's KV instead of copying it K
times, and the same call verifies a whole drafted tree (``feed_beams`` with
``trees``).

``Beams`` are one user's beams; every token remembers its slot in each model's
cache (-1 while not yet fed to that model). ``maybe_compact`` drops the nodes
no beam reaches any more.

Example::

    cache = TreeCache(model, [[1, 7, 260, 517, 772]])
    beams = initial_beams(cache.device, torch.float32, ("target",))
    fed = feed_beams(cache, {0: beams}, "target")
    fed[0].at_tips()   # hidden state after the prompt, [1, H]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from genrec.online.decoding.prefix_kv import PrefixBatch, cache_argument, output_cache

Prompts = list[list[int]] | PrefixBatch
TreeLevel = tuple[
    torch.Tensor, torch.Tensor
]  # (parent in the level before [n], path tokens [n, t])


@dataclass
class Beams:
    """One user's beams, all ``t`` tokens long; ``slots`` per model cache, -1 = not fed yet."""

    tokens: torch.Tensor  # LongTensor[W, t]
    scores: torch.Tensor  # Tensor[W]
    slots: dict[str, torch.Tensor]  # model name -> LongTensor[W, t]

    @property
    def level(self) -> int:
        return self.tokens.shape[1]

    def select(self, parents: torch.Tensor, tokens: torch.Tensor, scores: torch.Tensor) -> Beams:
        """Children ``tokens`` of beams ``parents``: the new tokens are not fed yet."""
        unfed = torch.full_like(parents[:, None], -1)
        return Beams(
            torch.cat([self.tokens[parents], tokens[:, None]], 1),
            scores,
            {name: torch.cat([s[parents], unfed], 1) for name, s in self.slots.items()},
        )


class NodeBuilder:
    """The new tokens of one user for one forward, and what each may attend to."""

    def __init__(self, ctx: torch.Tensor) -> None:
        self.ctx = ctx  # BoolTensor[L]: cache slots of this user's prompt
        self.tokens: list[torch.Tensor] = []
        self.positions: list[torch.Tensor] = []
        self.groups: list[tuple[str, torch.Tensor, torch.Tensor | None]] = []
        self.size = 0
        self.prompt_nodes: torch.Tensor | None = None

    def _add(self, tokens: torch.Tensor, positions: torch.Tensor, kind: str, data) -> torch.Tensor:
        index = torch.arange(self.size, self.size + len(tokens), device=tokens.device)
        self.tokens.append(tokens)
        self.positions.append(positions)
        self.groups.append((kind, index, data))
        self.size += len(tokens)
        return index

    def add_prompt(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Prompt tokens not in the cache yet: a causal chain; they join the prompt after the call."""
        self.prompt_nodes = self._add(tokens, positions, "prompt", None)
        return self.prompt_nodes

    def add_roots(
        self, tokens: torch.Tensor, positions: torch.Tensor, cache_rows: torch.Tensor
    ) -> torch.Tensor:
        """Nodes whose ancestors are all in the cache (``cache_rows[n, L]``) or in the pending prompt."""
        return self._add(tokens, positions, "roots", cache_rows)

    def add_children(
        self, tokens: torch.Tensor, positions: torch.Tensor, parents: torch.Tensor
    ) -> torch.Tensor:
        """Nodes whose parent is an earlier node of this builder."""
        return self._add(tokens, positions, "children", parents)

    def visibility(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(BoolTensor[Q, L] over cache slots, BoolTensor[Q, Q] over the new nodes)."""
        device = self.ctx.device
        cache_vis = torch.zeros(self.size, len(self.ctx), dtype=torch.bool, device=device)
        new_vis = torch.zeros(self.size, self.size, dtype=torch.bool, device=device)
        for kind, index, data in self.groups:
            if kind == "prompt":
                cache_vis[index] = self.ctx
                new_vis[index[:, None], index[None, :]] = torch.ones(
                    len(index), len(index), dtype=torch.bool, device=device
                ).tril()
                continue
            if kind == "roots":
                cache_vis[index] = data
                if self.prompt_nodes is not None:
                    new_vis[index[:, None], self.prompt_nodes[None, :]] = True
            else:
                cache_vis[index] = cache_vis[data]
                new_vis[index] = new_vis[data]
            new_vis[index, index] = True
        return cache_vis, new_vis


class TreeCache:
    """A model's KV cache for a batch of users: row b = user b's prompt, then generated nodes."""

    def __init__(self, model, prompts: Prompts) -> None:
        self.model = model
        self.base = model.get_decoder()
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        # An input embedding that reads the codes before a token (offline.item_vectors) needs
        # them passed in when a call starts inside a cached prompt.
        self.embedding = model.get_input_embeddings()
        self.context_width = int(getattr(self.embedding, "context_width", 0))
        self.pending_context: list[list[int]] = []
        if isinstance(prompts, PrefixBatch):
            self._init_from_prefixes(prompts)
        else:
            if not prompts or any(len(p) == 0 for p in prompts):
                raise ValueError("prompts must be a non-empty list of non-empty token lists")
            self.pending = [torch.tensor(p, dtype=torch.long, device=self.device) for p in prompts]
            self.prefix_len = [0] * len(prompts)
            self.ctx = torch.zeros(len(prompts), 0, dtype=torch.bool, device=self.device)
            self.cache = DynamicCache(config=model.config)
        self.prompt_len = [p + len(s) for p, s in zip(self.prefix_len, self.pending, strict=True)]

    def _init_from_prefixes(self, batch: PrefixBatch) -> None:
        width = max(p.length for p in batch.prefixes)
        n_layers = len(batch.prefixes[0].keys)
        expected = self.model.config.get_text_config(decoder=True).num_hidden_layers
        if any(len(p.keys) != expected for p in batch.prefixes):
            raise ValueError(f"prefix KV with the wrong number of layers (model has {expected})")
        self.ctx = torch.zeros(len(batch), width, dtype=torch.bool, device=self.device)
        layers = []
        for layer in range(n_layers):
            keys, values = [], []
            for prefix in batch.prefixes:
                pad = width - prefix.length
                k, v = (
                    prefix.keys[layer].to(self.device, self.dtype),
                    prefix.values[layer].to(self.device, self.dtype),
                )
                keys.append(F.pad(k, (0, 0, pad, 0)))
                values.append(F.pad(v, (0, 0, pad, 0)))
            layers.append((torch.stack(keys), torch.stack(values)))
        for row, prefix in enumerate(batch.prefixes):
            self.ctx[row, width - prefix.length :] = True
        self.cache = (
            DynamicCache(ddp_cache_data=layers, config=self.model.config)
            if width
            else DynamicCache(config=self.model.config)
        )
        self.prefix_len = [p.length for p in batch.prefixes]
        self.pending = [
            torch.tensor(p.prompt_ids[-1:] + list(s), dtype=torch.long, device=self.device)
            for p, s in zip(batch.prefixes, batch.suffixes, strict=True)
        ]
        if self.context_width:  # the cached tokens just before each pending chain
            self.pending_context = [
                p.prompt_ids[:-1][-self.context_width :] for p in batch.prefixes
            ]

    @property
    def length(self) -> int:
        return self.ctx.shape[1]

    def builder(self, user: int) -> tuple[NodeBuilder, torch.Tensor | None]:
        """A builder for ``user``, with its pending prompt added; returns (builder, prompt tip node)."""
        builder = NodeBuilder(self.ctx[user])
        tip = None
        if len(self.pending[user]):
            n = len(self.pending[user])
            positions = torch.arange(
                self.prefix_len[user], self.prefix_len[user] + n, device=self.device
            )
            tip = builder.add_prompt(self.pending[user], positions)[-1]
        return builder, tip

    @torch.no_grad()
    def forward(self, builders: dict[int, NodeBuilder]) -> dict[int, torch.Tensor]:
        """One model call over every user's new nodes; returns hidden states [q_b, H] per user.

        Node i of user b lands in cache slot ``self.length`` (before the call) + i.
        """
        builders = {b: nb for b, nb in builders.items() if nb.size}
        if not builders:
            return {}
        n_users, width, old = (
            self.ctx.shape[0],
            max(nb.size for nb in builders.values()),
            self.length,
        )
        ids = torch.zeros(n_users, width, dtype=torch.long, device=self.device)
        positions = torch.zeros(n_users, width, dtype=torch.long, device=self.device)
        vis = torch.zeros(n_users, width, old + width, dtype=torch.bool, device=self.device)
        diagonal = torch.arange(width, device=self.device)
        vis[:, diagonal, old + diagonal] = True  # padding nodes see only themselves
        new_ctx = torch.zeros(n_users, width, dtype=torch.bool, device=self.device)
        for b, nb in builders.items():
            q = nb.size
            ids[b, :q] = torch.cat(nb.tokens)
            positions[b, :q] = torch.cat(nb.positions)
            cache_vis, new_vis = nb.visibility()
            vis[b, :q, :old] = cache_vis
            vis[b, :q, old : old + q] = new_vis
            if nb.prompt_nodes is not None:
                new_ctx[b, nb.prompt_nodes] = True
                self.pending[b] = self.pending[b][:0]
        mask = torch.zeros(vis.shape, dtype=self.dtype, device=self.device)
        mask.masked_fill_(~vis, torch.finfo(self.dtype).min)
        output = self.base(
            **self._inputs(ids, builders),
            position_ids=positions,
            attention_mask=mask[:, None],
            use_cache=True,
            **{cache_argument(type(self.base)): self.cache},
        )
        self.cache = output_cache(output)
        self.ctx = torch.cat([self.ctx, new_ctx], 1)
        hidden = output.last_hidden_state
        return {b: hidden[b, : nb.size] for b, nb in builders.items()}

    def _inputs(self, ids: torch.Tensor, builders: dict[int, NodeBuilder]) -> dict:
        """``input_ids``, or for an embedding that reads the codes before a token its output,
        given the cached tokens before each pending prompt fed in this call (-1: none)."""
        if not self.context_width:
            return {"input_ids": ids}
        if all(nb.prompt_nodes is None for nb in builders.values()):
            # Generated codes only: no complete history item here (a leaf's own output is
            # never used), so the item lookup is skipped; it costs more than the call's tokens.
            return {"inputs_embeds": self.embedding(ids, find_items=False)}
        context = torch.full(
            (len(ids), self.context_width), -1, dtype=torch.long, device=self.device
        )
        for b, nb in builders.items():
            before = self.pending_context[b] if self.pending_context else []
            if nb.prompt_nodes is not None and before:
                context[b, self.context_width - len(before) :] = torch.tensor(before)
        return {"inputs_embeds": self.embedding(ids, context=context)}

    def compact(self, keep: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Drop dead nodes: keep each user's prompt plus the slots in ``keep[b]``.

        Returns per user a LongTensor[old_length] mapping old slot -> new slot (-1 if dropped).
        """
        n_users, old = self.ctx.shape
        kept, remaps = [], {}
        for b in range(n_users):
            extra = keep.get(b, torch.zeros(0, dtype=torch.long, device=self.device))
            slots = torch.cat([self.ctx[b].nonzero()[:, 0], extra[extra >= 0]]).unique()
            remap = torch.full((old,), -1, dtype=torch.long, device=self.device)
            remap[slots] = torch.arange(len(slots), device=self.device)
            kept.append(slots)
            remaps[b] = remap
        width = max(len(s) for s in kept)
        if width >= old:
            return {b: torch.arange(old, device=self.device) for b in range(n_users)}
        index = torch.zeros(n_users, width, dtype=torch.long, device=self.device)
        new_ctx = torch.zeros(n_users, width, dtype=torch.bool, device=self.device)
        for b, slots in enumerate(kept):
            index[b, : len(slots)] = slots
            new_ctx[b, : len(slots)] = self.ctx[b, slots]
        for layer in self.cache.layers:
            gather = index[:, None, :, None].expand(
                -1, layer.keys.shape[1], -1, layer.keys.shape[3]
            )
            layer.keys = layer.keys.gather(2, gather)
            layer.values = layer.values.gather(2, gather)
        self.ctx = new_ctx
        return remaps


def cache_rows(ctx: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """BoolTensor[W, L]: the prompt plus each row's fed slots (``slots`` LongTensor[W, t], -1 = unfed)."""
    rows = ctx.expand(slots.shape[0], -1).clone()
    fed = slots >= 0
    row_index = torch.arange(slots.shape[0], device=slots.device)[:, None].expand_as(slots)
    rows[row_index[fed], slots[fed]] = True
    return rows


def add_beam_tips(
    builder: NodeBuilder, beams: Beams, name: str, prompt_len: int, prompt_tip: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Feed each beam's unfed tokens; returns (tip node per beam [W], node of each new token [W, t] or -1)."""
    tokens, slots = beams.tokens, beams.slots[name]
    width, level = tokens.shape
    node_at = torch.full_like(slots, -1)
    unfed = (slots < 0).sum(1)
    if level == 0 or int(unfed.max()) == 0:
        if prompt_tip is None:
            raise RuntimeError(
                "a beam has no token to feed: its next-token distribution is unknown"
            )
        return prompt_tip.expand(width), node_at
    rows = cache_rows(builder.ctx, slots)
    previous = torch.full((width,), -1, dtype=torch.long, device=tokens.device)
    for i in range(int(unfed.max())):
        beam = (unfed > i).nonzero()[:, 0]
        column = level - unfed[beam] + i
        token, position = tokens[beam, column], prompt_len + column
        if i == 0:
            nodes = builder.add_roots(token, position, rows[beam])
        else:
            nodes = builder.add_children(token, position, previous[beam])
        previous[beam] = nodes
        node_at[beam, column] = nodes
    if (unfed == 0).any():
        raise RuntimeError("beams of one user must all have an unfed token")
    return previous, node_at


@dataclass
class FedNodes:
    """What one call computed for one user: the hidden state of every node it fed."""

    hidden: torch.Tensor  # Tensor[q, H], by node
    tips: torch.Tensor  # LongTensor[W]: node of each beam's last token (or the prompt's)
    tree: list[torch.Tensor]  # per drafted level, LongTensor[n_j]: node of each drafted path
    offset: int  # cache slot of node 0

    def at_tips(self) -> torch.Tensor:
        return self.hidden[self.tips]


def feed_beams(
    cache: TreeCache,
    active: dict[int, Beams],
    name: str,
    trees: dict[int, Sequence[TreeLevel]] | None = None,
) -> dict[int, FedNodes]:
    """One call of ``cache``'s model on every user's unfed beam tokens, plus the drafted
    ``trees[b]`` hanging off the beams' tips; the beams' ``slots[name]`` are updated."""
    builders, tips, tree_nodes, new_nodes = {}, {}, {}, {}
    for b, beams in active.items():
        builders[b], prompt_tip = cache.builder(b)
        tips[b], new_nodes[b] = add_beam_tips(
            builders[b], beams, name, cache.prompt_len[b], prompt_tip
        )
        parent_nodes, tree_nodes[b] = tips[b], []
        for parents, tokens in (trees or {}).get(b, ()):
            positions = torch.full_like(parents, cache.prompt_len[b] + tokens.shape[1] - 1)
            parent_nodes = builders[b].add_children(tokens[:, -1], positions, parent_nodes[parents])
            tree_nodes[b].append(parent_nodes)
    offset = cache.length
    hidden = cache.forward(builders)
    for b, beams in active.items():
        nodes = new_nodes[b]
        beams.slots[name] = torch.where(nodes >= 0, offset + nodes, beams.slots[name])
    return {b: FedNodes(hidden[b], tips[b], tree_nodes[b], offset) for b in active}


def initial_beams(device: torch.device, dtype: torch.dtype, names: tuple[str, ...]) -> Beams:
    empty = torch.zeros(1, 0, dtype=torch.long, device=device)
    return Beams(
        empty, torch.zeros(1, dtype=dtype, device=device), {n: empty.clone() for n in names}
    )


def remap_slots(beams: Beams, name: str, remap: torch.Tensor) -> None:
    slots = beams.slots[name]
    beams.slots[name] = torch.where(slots >= 0, remap[slots.clamp(min=0)], slots)


def maybe_compact(cache: TreeCache, all_beams: dict[int, Beams], name: str) -> None:
    """Compact once dead nodes are a third of the cache (cheap relative to attention over them)."""
    keep = {b: beams.slots[name].flatten().unique() for b, beams in all_beams.items()}
    prompt = cache.ctx.sum(1)
    live = max(
        int(prompt[b]) + int((keep[b] >= 0).sum()) if b in keep else int(prompt[b])
        for b in range(len(prompt))
    )
    if live * 3 > cache.length * 2:
        return
    remaps = cache.compact(keep)
    for b, beams in all_beams.items():
        remap_slots(beams, name, remaps[b])
