"""The trie of valid semantic IDs: which item token may follow a prefix (online decoding step).

Every lookup is batched and runs on tensors on the model's device. A prefix of
``d`` tokens is packed into one int64 key (mixed radix over the per-level code
counts) and found with ``searchsorted`` in the sorted keys of level ``d``; the
edges below each node are a compact (CSR) list of codes, about 10 bytes a node
(a dense row over the next level's codes per node was 489 MiB at 1M items).

Masks are level-local: column ``c`` of ``allowed_mask(prefixes)`` for prefixes
of length ``d`` means token ``layout.level_start(d) + c``.

``child_of(d, node, c)`` is the node of level d+1 reached from ``node`` by code
``c`` (-1 if no item has that prefix); at the last level it is the item's row
in ``item_tokens``; ``children_of(d, nodes)`` gives the whole row of codes per
node. Node ids are the ranks of the sorted prefix keys, so node 0 of level 0 is
the root. ``child_nodes`` looks them up for whole prefixes (e.g. the items one
step away). The batched engine reads the trie as flat global
tables (``trie_tables.TrieTables``), where seen items become dead nodes.

Example::

    >>> import torch
    >>> from genrec.schemas.token_layout import TokenLayout
    >>> layout = TokenLayout.for_scratch_model((4, 4, 2))
    >>> trie = ItemTrie(torch.tensor(layout.encode([[0, 1, 0], [0, 2, 0], [3, 1, 1]])), layout)
    >>> trie.allowed_mask(torch.tensor([[4]])).int().tolist()   # after <a_0>: <b_1>, <b_2>
    [[0, 1, 1, 0]]
    >>> trie.item_index(torch.tensor(layout.encode([[3, 1, 1], [3, 1, 0]]))).tolist()
    [2, -1]
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from genrec.schemas.token_layout import TokenLayout

if TYPE_CHECKING:
    from genrec.online.prompts import ItemTokens


class ItemTrie:
    """Valid item IDs as a trie over ``layout.depth`` levels, queried in batches."""

    def __init__(self, item_tokens: torch.Tensor, layout: TokenLayout) -> None:
        item_tokens = torch.as_tensor(item_tokens, dtype=torch.long)
        if item_tokens.ndim != 2 or item_tokens.shape[1] != layout.depth:
            raise ValueError(
                f"item_tokens must be [n_items, {layout.depth}], got {tuple(item_tokens.shape)}"
            )
        if item_tokens.shape[0] == 0:
            raise ValueError("the catalog is empty")
        self.layout = layout
        self.device = item_tokens.device
        self.codes_per_level = torch.tensor(layout.codes_per_level, dtype=torch.long)
        codes = item_tokens.cpu() - torch.tensor(
            [layout.level_start(lv) for lv in range(layout.depth)]
        )
        if (codes < 0).any() or (codes >= self.codes_per_level).any():
            raise ValueError("an item token lies outside its level's token range")
        self.n_items = item_tokens.shape[0]
        self.item_tokens = item_tokens.to(self.device)
        self._build(codes)

    @classmethod
    def from_item_tokens(
        cls, item_tokens: ItemTokens, device: torch.device | str = "cpu"
    ) -> ItemTrie:
        """The trie of an ``ItemTokens`` catalog on ``device``: item rows in ``item_tokens`` order."""
        table = torch.as_tensor(item_tokens.table, dtype=torch.long, device=device)
        return cls(table, item_tokens.layout)

    def _build(self, codes: torch.Tensor) -> None:
        # keys_by_level[d]: sorted unique keys of the length-d prefixes (d = 0 .. depth); node
        # i of level d is keys_by_level[d][i]. A node of level d+1 is one edge of level d
        # (key = parent key * C_d + code), so sorted keys are edges in (parent, code) order:
        # edge e of level d leads to node e of level d+1 (at the last level, to the item
        # item_of_leaf[e]). Per level only the edges' codes and each node's first edge are
        # kept (CSR), about 10 bytes a node, instead of a dense [nodes, C_d] row per node.
        depth = self.layout.depth
        keys = torch.zeros(self.n_items, dtype=torch.long)
        self.keys_by_level: list[torch.Tensor] = []
        self.items_under: list[torch.Tensor] = []  # [d]: items below each node of level d
        for level in range(depth + 1):
            unique_keys, node_of_item = torch.unique(keys, return_inverse=True)
            self.keys_by_level.append(unique_keys)
            self.items_under.append(torch.bincount(node_of_item, minlength=len(unique_keys)))
            if level == depth:
                if len(unique_keys) != self.n_items:
                    raise ValueError("the catalog holds duplicate semantic IDs")
                item_of_node = torch.empty(self.n_items, dtype=torch.long)
                item_of_node[node_of_item] = torch.arange(self.n_items)
                self.item_of_leaf = item_of_node
                break
            keys = keys * self.layout.codes_per_level[level] + codes[:, level]
        self.first_edge: list[torch.Tensor] = []  # [d]: LongTensor[n_d + 1], CSR row pointers
        self.edge_code: list[torch.Tensor] = []  # [d]: the code of each edge (int16 / int32)
        self.max_fan: list[int] = []  # [d]: most children of one node of level d
        self.settles: list[torch.Tensor] = []
        for level, n_codes in enumerate(self.layout.codes_per_level):
            below = self.keys_by_level[level + 1]
            parent_key, code = below.div(n_codes, rounding_mode="floor"), below % n_codes
            parent = torch.searchsorted(self.keys_by_level[level], parent_key)
            fan = torch.bincount(parent, minlength=len(self.keys_by_level[level]))
            self.first_edge.append(torch.cat([fan.new_zeros(1), torch.cumsum(fan, 0)]))
            self.edge_code.append(code.to(torch.int16 if n_codes < 2**15 else torch.int32))
            self.max_fan.append(int(fan.max()))
            # settles[d]: every child of the node holds one item (one more token decides it)
            crowded = self.items_under[level + 1] > 1
            self.settles.append(torch.bincount(parent[crowded], minlength=len(fan)) == 0)
        self.child_counts = [pointers.diff() for pointers in self.first_edge]
        names = ("keys_by_level", "items_under", "first_edge", "edge_code", "settles")
        for name in (*names, "child_counts"):
            setattr(self, name, [t.to(self.device) for t in getattr(self, name)])
        self.item_of_leaf = self.item_of_leaf.to(self.device)

    def edges(self, level: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every edge of ``level`` in (parent, code) order: (parent node, code, child), the
        child a node of level + 1, or at the last level the item's row."""
        fan = self.child_counts[level]
        parent = torch.repeat_interleave(torch.arange(len(fan), device=self.device), fan)
        return parent, self.edge_code[level].long(), self._edge_child(level, None)

    def children_of(self, level: int, nodes: torch.Tensor) -> torch.Tensor:
        """LongTensor[*nodes.shape, C_level]: the child each code leads to from each node of
        ``level`` (items' rows at the last level), -1 where none: a fixed number of
        gathers and one scatter of at most ``max_fan`` entries a node, no host sync."""
        n_codes = self.layout.codes_per_level[level]
        flat = nodes.reshape(-1)
        first = self.first_edge[level][flat]
        steps = torch.arange(self.max_fan[level], device=self.device)
        real = steps < (self.first_edge[level][flat + 1] - first)[:, None]
        edge = torch.where(real, first[:, None] + steps, torch.zeros_like(steps))
        columns = torch.where(real, self.edge_code[level][edge].long(), n_codes)  # pads: a sink
        child = torch.where(real, self._edge_child(level, edge), -1)
        table = torch.full((len(flat), n_codes + 1), -1, dtype=torch.long, device=self.device)
        table.scatter_(1, columns, child)
        return table[:, :n_codes].reshape(*nodes.shape, n_codes)

    def child_of(self, level: int, nodes: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """LongTensor like ``nodes``: the child of each node of ``level`` by its code (items'
        rows at the last level), -1 where there is none; one ``searchsorted``."""
        n_codes = self.layout.codes_per_level[level]
        valid = (codes >= 0) & (codes < n_codes)
        keys = self.keys_by_level[level][nodes] * n_codes + codes.clamp(0, n_codes - 1)
        level_keys = self.keys_by_level[level + 1]
        found = torch.searchsorted(level_keys, keys).clamp(max=len(level_keys) - 1)
        valid &= level_keys[found] == keys
        return torch.where(valid, self._edge_child(level, found), -1)

    def _edge_child(self, level: int, edge: torch.Tensor | None) -> torch.Tensor:
        """The child of each ``edge`` of ``level`` (None: of every edge)."""
        last = level == self.layout.depth - 1
        if edge is None:
            n_edges = len(self.keys_by_level[level + 1])
            return self.item_of_leaf if last else torch.arange(n_edges, device=self.device)
        return self.item_of_leaf[edge] if last else edge

    def _node_ids(self, prefixes: torch.Tensor) -> torch.Tensor:
        """Trie node of each prefix (LongTensor[B]); -1 where the prefix is not a valid one."""
        prefixes = torch.as_tensor(prefixes, dtype=torch.long, device=self.device)
        if prefixes.ndim != 2 or prefixes.shape[1] > self.layout.depth:
            raise ValueError(f"prefixes must be [B, d] with d <= {self.layout.depth}")
        n, d = prefixes.shape
        keys = torch.zeros(n, dtype=torch.long, device=self.device)
        valid = torch.ones(n, dtype=torch.bool, device=self.device)
        for level in range(d):
            code = prefixes[:, level] - self.layout.level_start(level)
            valid &= (code >= 0) & (code < self.layout.codes_per_level[level])
            keys = keys * self.layout.codes_per_level[level] + code.clamp(min=0)
        level_keys = self.keys_by_level[d]
        pos = torch.searchsorted(level_keys, keys).clamp(max=len(level_keys) - 1)
        valid &= level_keys[pos] == keys
        return torch.where(valid, pos, torch.full_like(pos, -1))

    def allowed_mask(self, prefixes: torch.Tensor) -> torch.Tensor:
        """BoolTensor[B, C_d]: codes of level d = prefixes.shape[1] that keep the prefix valid."""
        d = prefixes.shape[1]
        if d >= self.layout.depth:
            raise ValueError("a complete item has no next token")
        return self.child_nodes(prefixes) >= 0

    def child_nodes(self, prefixes: torch.Tensor) -> torch.Tensor:
        """LongTensor[B, C_d]: node each code of level d leads to (item rows at the last level), -1 if none."""
        d = prefixes.shape[1]
        if d >= self.layout.depth:
            raise ValueError("a complete item has no next token")
        nodes = self._node_ids(prefixes)
        table = self.children_of(d, nodes.clamp(min=0))
        return torch.where((nodes >= 0)[:, None], table, torch.full_like(table, -1))

    def child_count(self, prefixes: torch.Tensor) -> torch.Tensor:
        """LongTensor[B]: how many tokens may follow each prefix (0 for an invalid prefix)."""
        nodes = self._node_ids(prefixes)
        counts = self.child_counts[prefixes.shape[1]][nodes.clamp(min=0)]
        return torch.where(nodes >= 0, counts, torch.zeros_like(counts))

    def item_index(self, tokens: torch.Tensor) -> torch.Tensor:
        """LongTensor[B]: row of each complete item in ``item_tokens``, -1 if not an item."""
        if tokens.shape[-1] != self.layout.depth:
            raise ValueError(f"an item is {self.layout.depth} tokens")
        flat = tokens.reshape(-1, self.layout.depth)
        nodes = self._node_ids(flat)
        items = self.item_of_leaf[nodes.clamp(min=0)]
        items = torch.where(nodes >= 0, items, torch.full_like(items, -1))
        return items.reshape(tokens.shape[:-1])

    def to(self, device: torch.device | str) -> ItemTrie:
        """The same trie with its tensors on ``device`` (``self`` if already there)."""
        if torch.device(device) == self.device:
            return self
        clone = object.__new__(type(self))
        clone.__dict__.update(self.__dict__)
        clone.device = torch.device(device)
        for name in ("item_tokens", "item_of_leaf"):
            setattr(clone, name, getattr(self, name).to(device))
        names = ("keys_by_level", "items_under", "child_counts", "first_edge", "edge_code")
        for name in (*names, "settles"):
            setattr(clone, name, [t.to(device) for t in getattr(self, name)])
        return clone
