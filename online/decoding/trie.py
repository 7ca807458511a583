"""The trie of valid semantic IDs: which item token may follow a prefix (online decoding step).

Every lookup is batched and runs on tensors on the model's device. A prefix of
``d`` tokens is packed into one int64 key (mixed radix over the per-level code
counts) and found with ``searchsorted`` in the sorted keys of level ``d``; each
trie node keeps a boolean row over the codes of the next level.

Masks are level-local: column ``c`` of ``allowed_mask(prefixes)`` for prefixes
of length ``d`` means token ``layout.level_start(d) + c``.

``children[d][node, c]`` is the node of level d+1 reached from ``node`` by code
``c`` (-1 if no item has that prefix); at the last level it is the item's row
in ``item_tokens``. Node ids are the ranks of the sorted prefix keys, so node 0
of level 0 is the root. ``child_nodes`` looks them up for whole prefixes (e.g.
the items one step away). The batched engine reads the trie as flat global
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
        # keys_by_level[d]: sorted unique keys of the length-d prefixes (d = 0 .. depth)
        # allowed[d]: BoolTensor[n_nodes_d, C_d], the codes that may follow node i of level d
        # children[d]: LongTensor[n_nodes_d, C_d], the node they lead to (the item row at the end)
        depth = self.layout.depth
        keys = torch.zeros(self.n_items, dtype=torch.long)
        parent_of_item = torch.zeros(self.n_items, dtype=torch.long)  # node of the previous level
        self.keys_by_level: list[torch.Tensor] = []
        self.allowed: list[torch.Tensor] = []
        self.children: list[torch.Tensor] = []
        self.items_under: list[torch.Tensor] = []  # [d]: items below each node of level d
        for level in range(depth + 1):
            unique_keys, node_of_item = torch.unique(keys, return_inverse=True)
            self.keys_by_level.append(unique_keys.to(self.device))
            self.items_under.append(torch.bincount(node_of_item, minlength=len(unique_keys)))
            if level == depth:
                if len(unique_keys) != self.n_items:
                    raise ValueError("the catalog holds duplicate semantic IDs")
                item_of_node = torch.empty(self.n_items, dtype=torch.long)
                item_of_node[node_of_item] = torch.arange(self.n_items)
                self.item_of_leaf = item_of_node.to(self.device)
                self.children[-1][parent_of_item, codes[:, -1]] = torch.arange(self.n_items)
                break
            if level:
                self.children[-1][parent_of_item, codes[:, level - 1]] = node_of_item
            shape = (len(unique_keys), self.layout.codes_per_level[level])
            mask = torch.zeros(shape, dtype=torch.bool)
            mask[node_of_item, codes[:, level]] = True
            self.allowed.append(mask)
            self.children.append(torch.full(shape, -1, dtype=torch.long))
            parent_of_item = node_of_item
            keys = keys * self.layout.codes_per_level[level] + codes[:, level]
        self.allowed = [mask.to(self.device) for mask in self.allowed]
        self.children = [table.to(self.device) for table in self.children]
        self.items_under = [count.to(self.device) for count in self.items_under]
        self.child_counts = [mask.sum(1) for mask in self.allowed]
        # settles[d]: every child of the node holds one item (one more token decides the item)
        self.settles = [
            ((table < 0) | (self.items_under[d + 1][table.clamp(min=0)] == 1)).all(1)
            for d, table in enumerate(self.children)
        ]

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
        nodes = self._node_ids(prefixes)
        mask = self.allowed[d][nodes.clamp(min=0)]
        return mask & (nodes >= 0)[:, None]

    def child_nodes(self, prefixes: torch.Tensor) -> torch.Tensor:
        """LongTensor[B, C_d]: node each code of level d leads to (item rows at the last level), -1 if none."""
        d = prefixes.shape[1]
        if d >= self.layout.depth:
            raise ValueError("a complete item has no next token")
        nodes = self._node_ids(prefixes)
        table = self.children[d][nodes.clamp(min=0)]
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
        names = ("keys_by_level", "allowed", "children", "items_under", "child_counts")
        for name in (*names, "settles"):
            setattr(clone, name, [t.to(device) for t in getattr(self, name)])
        return clone
