"""The trie as flat, padded tables for the batched engine (online decoding step).

``ItemTrie`` keeps one children table per level and finds a prefix's node by a
``searchsorted`` over packed keys. The batched engine (``engine.py``) decodes
users that stand at different levels in the same step, so it wants every
lookup to be one gather whatever the level: ``TrieTables`` numbers the nodes of
all levels in one global range and pads every level's codes to the widest one.

Global node ids: level ``d``'s nodes are ``offsets[d] + i`` (``i`` as in
``ItemTrie.children[d - 1]``; node 0 is the root), complete items are
``item_offset + row`` (their catalog row), and ``sink`` is a node with no
children that missing beams and finished users point at. Per global node:

- ``allowed[node, c]``: code ``c`` of the node's level may follow (False past
  the level's code count, and everywhere for items and the sink); ``allowed_bias``:
  the same as 0 / -inf, to mask scores by adding;
- ``child[node, c]``: the node it leads to (``sink`` where not allowed);
- ``settles[node]``: every child holds a single item (``ItemTrie.settles``);
- ``item_below[node]``: the catalog row of the node's only item (-1 if several);
- ``child_codes[d][node, j]``: the j-th code a level-d node allows (padded with codes it
  does not), so that a top-K at one level need only look at allowed codes.

``dead_nodes(exclude)`` turns per-user catalog rows to exclude into one
BoolTensor[B, n_nodes] of the nodes all of whose items a user excludes: the one
seen-item table (``constraints.SeenItems`` serves it to the engine and to
``generate``'s logits processor).

Example::

    >>> import torch
    >>> from genrec.schemas.token_layout import TokenLayout
    >>> layout = TokenLayout.for_scratch_model((4, 4, 2))
    >>> trie = ItemTrie(torch.tensor(layout.encode([[0, 1, 0], [0, 2, 0], [3, 1, 1]])), layout)
    >>> tables = TrieTables.of(trie)
    >>> root_children = tables.child[0][tables.allowed[0]]   # the level-1 nodes under <a_0>, <a_3>
    >>> tables.allowed[root_children].int().tolist()
    [[0, 1, 1, 0], [0, 1, 0, 0]]
    >>> tables.dead_nodes([[0, 1], []])[0, root_children].tolist()  # items 0 and 1 are all of <a_0>
    [True, False]
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence

import torch

from genrec.online.decoding.trie import ItemTrie

_TABLES: weakref.WeakKeyDictionary[ItemTrie, TrieTables] = weakref.WeakKeyDictionary()


class TrieTables:
    """``trie``'s levels as global, padded lookup tables (module docstring)."""

    def __init__(self, trie: ItemTrie) -> None:
        layout, device = trie.layout, trie.device
        self.trie, self.depth = trie, layout.depth
        self.width = max(layout.codes_per_level)  # codes per level, padded
        counts = [len(table) for table in trie.children]
        self.offsets = [sum(counts[:d]) for d in range(self.depth + 1)]
        self.item_offset = self.offsets[-1]
        self.sink = self.item_offset + trie.n_items
        n_nodes = self.sink + 1
        self.allowed = torch.zeros(n_nodes, self.width, dtype=torch.bool, device=device)
        self.child = torch.full((n_nodes, self.width), self.sink, dtype=torch.long, device=device)
        self.settles = torch.zeros(n_nodes, dtype=torch.bool, device=device)
        self.items_under = torch.ones(n_nodes, dtype=torch.long, device=device)
        self.items_under[-1] = 0
        for d, (allowed, children) in enumerate(zip(trie.allowed, trie.children, strict=True)):
            rows, codes = slice(self.offsets[d], self.offsets[d + 1]), layout.codes_per_level[d]
            self.allowed[rows, :codes] = allowed
            self.child[rows, :codes] = torch.where(
                children >= 0, children + self.offsets[d + 1], self.sink
            )
            self.settles[rows] = trie.settles[d]
            self.items_under[rows] = trie.items_under[d]
        # item_nodes[row, d]: the global node of the item's first d codes (d = 0 .. depth)
        path = [torch.zeros(trie.n_items, dtype=torch.long, device=device)]
        codes = trie.item_tokens - torch.tensor(
            [layout.level_start(d) for d in range(self.depth)], device=device
        )
        for d in range(self.depth):
            path.append(self.child[path[-1], codes[:, d]])
        self.item_nodes = torch.stack(path, 1)
        # item_below[node]: the catalog row of the node's only item (-1 where it has several)
        self.item_below = torch.full((n_nodes,), -1, dtype=torch.long, device=device)
        rows = torch.arange(trie.n_items, device=device)
        for d in range(self.depth + 1):
            single = self.items_under[self.item_nodes[:, d]] == 1
            self.item_below[self.item_nodes[single, d]] = rows[single]
        # token id of (level, code); the item-token row of the output layer it is scored by
        starts = torch.tensor([layout.level_start(d) for d in range(self.depth)], device=device)
        self.level_start = starts
        code = torch.arange(self.width, device=device)
        self.item_row = (starts - layout.item_token_start)[:, None] + code
        self.item_row = self.item_row.clamp(max=layout.num_item_tokens - 1)  # pads: never allowed
        self.child_codes = self._child_codes()
        # 0 where allowed, -inf elsewhere: masking by adding costs a fraction of a where
        self.allowed_bias = torch.zeros(self.allowed.shape, device=device)
        self.allowed_bias.masked_fill_(~self.allowed, -math.inf)

    def _child_codes(self) -> list[torch.Tensor | None]:
        """Per level d: LongTensor[n_nodes, F_d], the codes each node allows, ascending, padded
        with codes it does not (F_d: the level's widest node); None where F_d is over half the
        padded width (the root's level: narrowing to its codes saves nothing)."""
        # every node's allowed codes first, in code order, then the others
        order = (~self.allowed).to(torch.uint8).argsort(dim=1, stable=True)
        tables: list[torch.Tensor | None] = []
        for d in range(self.depth):
            counts = self.allowed[self.offsets[d] : self.offsets[d + 1]].sum(1)
            fan = int(counts.max()) if len(counts) else 0
            tables.append(order[:, :fan].contiguous() if 0 < 2 * fan <= self.width else None)
        return tables

    @classmethod
    def of(cls, trie: ItemTrie) -> TrieTables:
        """The tables of ``trie``, built once per trie object."""
        tables = _TABLES.get(trie)
        if tables is None:
            tables = _TABLES[trie] = cls(trie)
        return tables

    def items(self, nodes: torch.Tensor) -> torch.Tensor:
        """Catalog row of each complete-item node, -1 for any other node."""
        rows = nodes - self.item_offset
        return torch.where((rows >= 0) & (nodes < self.sink), rows, torch.full_like(rows, -1))

    def dead_nodes(self, exclude: Sequence[Sequence[int]] | None) -> torch.Tensor | None:
        """BoolTensor[B, n_nodes]: node all of whose items user b excludes (None: nobody excludes)."""
        if exclude is None or not any(len(rows) for rows in exclude):
            return None
        device, n_items = self.allowed.device, self.trie.n_items
        lengths = torch.tensor([len(rows) for rows in exclude], device=device)
        rows = torch.tensor([r for user_rows in exclude for r in user_rows], device=device)
        if int(rows.min()) < 0 or int(rows.max()) >= n_items:
            raise ValueError(f"item rows must lie in [0, {n_items})")
        users = torch.repeat_interleave(torch.arange(len(exclude), device=device), lengths)
        pairs = torch.unique(users * n_items + rows)  # one (user, item) per excluded item
        users, rows = pairs // n_items, pairs % n_items
        n_nodes = self.sink + 1
        dead = torch.zeros(len(exclude), n_nodes, dtype=torch.bool, device=device)
        for d in range(1, self.depth + 1):
            keys, counts = torch.unique(
                users * n_nodes + self.item_nodes[rows, d], return_counts=True
            )
            nodes = keys % n_nodes
            full = counts == self.items_under[nodes]
            dead[keys[full] // n_nodes, nodes[full]] = True
        return dead
