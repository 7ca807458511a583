"""The trie as flat, compact tables for the batched engine (online decoding step).

``ItemTrie`` keeps one children table per level and finds a prefix's node by a
``searchsorted`` over packed keys. The batched engine (``engine.py``) decodes
users that stand at different levels in the same step, so it wants every
lookup to be a few batched ops whatever the level: ``TrieTables`` numbers the
nodes of all levels in one global range and lists every node's children as one
sorted edge list (CSR), whose size is the number of trie edges, not nodes x codes.

Global node ids: level ``d``'s nodes are ``offsets[d] + i`` (``i`` as in
``ItemTrie.child_of(d - 1, ...)``; node 0 is the root), complete items are
``item_offset + row`` (their catalog row), and ``sink`` is a node with no
children that missing beams and finished users point at. Nodes below
``item_offset`` are internal; items and the sink share one empty child row.

Tables, and how they grow with the catalog (n items, E = edges = nodes - 1, about 2n on
a 4-level layout whose last-but-one level already tells most items apart):

- ``edge_key`` [E] int64: ``parent * width + code`` of every edge, ascending (parent, then
  code); ``child_of(nodes, codes)`` is one ``searchsorted`` in it;
- ``edge_code`` [E + width] int16 and ``edge_child`` [E + width] int32: each edge's code and
  child node (the last ``width`` entries pad, so a row read never runs off the end);
- ``edge_of_item`` [n] int32: each item's edge (an internal node n's is n - 1);
- ``first_edge`` [internal + 1] int64 and ``fan`` [internal + 1] int16: where a node's
  edges start and how many (the last row, the sink row, has none); ``rows(nodes, F)`` reads
  F edges per node: the node's codes, children and which of the F exist (``codes``: the
  same without the children);
- per global node (1-D, n + internal + 1): ``settles`` (bool: every child holds a single
  item, ``ItemTrie.settles``), ``item_below`` (int32: the catalog row of the node's only
  item, -1 if several), ``items_under`` (int32);
- ``item_nodes`` [n, depth + 1] int32: the global node of each item's first d codes;
- ``level_fan[d]``: the widest level-d node's child count (``narrow_fan``: the F a top-K
  at one level need look at); ``item_row``, ``level_start``: per level and code, constant.

So every table is O(n) with a small constant (~40 bytes per item at depth 4) and nothing
is padded to the widest level: the engine builds a step's [B, W, width] mask from the
F edges of each beam's node (``codes``).

``dead_nodes(exclude)`` turns per-user catalog rows to exclude into ``DeadNodes``: the
sorted keys ``user * n_nodes + node`` of the nodes all of whose items a user excludes,
O(excluded items x depth) whatever the catalog (found by sorts, or through dense users x
nodes tables without one where those are small beside the keys: ``DENSE_DEAD_*``);
membership is one ``searchsorted`` (``DeadNodes.contains``); ``dead_children`` re-keys
it by parent and code, for the engine's per-step mask (``DeadChildren.blocked``: one search
per beam, not per child). It is the one seen-item table (``constraints.SeenItems`` serves it
to the engine and to ``generate``'s logits processor).

Example::

    >>> import torch
    >>> from genrec.schemas.token_layout import TokenLayout
    >>> layout = TokenLayout.for_scratch_model((4, 4, 2))
    >>> trie = ItemTrie(torch.tensor(layout.encode([[0, 1, 0], [0, 2, 0], [3, 1, 1]])), layout)
    >>> tables = TrieTables.of(trie)
    >>> root = torch.tensor([0])
    >>> root_children = tables.child_of(root, torch.tensor([0, 3]))  # <a_0>, <a_3>
    >>> tables.allowed(root_children).int().tolist()
    [[0, 1, 1, 0], [0, 1, 0, 0]]
    >>> tables.dead_nodes([[0, 1], []]).contains(root_children[None]).tolist()  # 0, 1: <a_0>
    [[True, False]]
"""

from __future__ import annotations

import functools
import itertools
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from genrec.online.decoding.trie import ItemTrie

# A batch's dead nodes come from dense users x nodes tables (no sort) while the table is at
# most DENSE_DEAD_PER_KEY x the excluded (user, item) x depth keys plus DENSE_DEAD_MIN, and
# at most DENSE_DEAD_ENTRIES (~20 MB); else from sorts, sized by the excluded items only.
# 64 ML-100K users excluding ~700 items each: 6.5 -> 4.2 ms; ~106 each (ML-100K's mean):
# sorted 0.7, dense 1.3 ms; 1-8 users: dense, 0.04-0.35 ms against 0.08-0.59 (2-core CPU).
DENSE_DEAD_ENTRIES = 1 << 21
DENSE_DEAD_PER_KEY = 8
DENSE_DEAD_MIN = 1 << 16
_TABLES: weakref.WeakKeyDictionary[ItemTrie, TrieTables] = weakref.WeakKeyDictionary()


def gather(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``table[index]`` for a 1-D ``table``: one ``index_select`` over the flat index, which
    on a CPU costs a third of what advanced indexing does for a [B, W, F] index (the engine
    makes a few such reads each step)."""
    return table.index_select(0, index.reshape(-1)).view(index.shape)


@dataclass(frozen=True)
class DeadNodes:
    """Per user, the global trie nodes it must not reach, as sorted unique int64 keys
    ``user * n_nodes + node`` (size: excluded items x depth at most)."""

    keys: torch.Tensor
    n_users: int
    n_nodes: int

    @classmethod
    def of_pairs(
        cls, users: torch.Tensor, nodes: torch.Tensor, n_users: int, n_nodes: int
    ) -> DeadNodes | None:
        """The set of (users[i], nodes[i]) pairs (None when empty)."""
        if users.numel() == 0:
            return None
        return cls(torch.unique(users.long() * n_nodes + nodes.long()), n_users, n_nodes)

    def contains(self, nodes: torch.Tensor, user: int | None = None) -> torch.Tensor:
        """BoolTensor like ``nodes``: node is dead for its user (row b of ``nodes`` is user b,
        or every node is ``user``'s). One batched searchsorted, no host read."""
        if user is None:
            shape = (nodes.shape[0],) + (1,) * (nodes.ndim - 1)
            users = torch.arange(nodes.shape[0], device=nodes.device).view(shape)
            query = users * self.n_nodes + nodes.long()
        else:
            query = nodes.long() + user * self.n_nodes
        flat = query.reshape(-1)
        position = torch.searchsorted(self.keys, flat).clamp(max=len(self.keys) - 1)
        return (self.keys[position] == flat).view(nodes.shape)

    def any_between(self, user: int, first: int, end: int) -> bool:
        """Whether ``user`` has a dead node in ``first .. end - 1`` (a host read)."""
        bounds = torch.tensor([first, end], device=self.keys.device) + user * self.n_nodes
        low, high = torch.searchsorted(self.keys, bounds).tolist()
        return high > low

    def __or__(self, other: DeadNodes) -> DeadNodes:
        """The union (both over the same tables and users)."""
        if self.shape != other.shape:
            raise ValueError("dead-node sets of different tables or batches")
        return DeadNodes(torch.unique(torch.cat([self.keys, other.keys])), *other.shape)

    @property
    def shape(self) -> tuple[int, int]:
        """(users, nodes): the dense table's shape."""
        return self.n_users, self.n_nodes

    def dense(self) -> torch.Tensor:
        """BoolTensor[B, n_nodes] (for checks on small tries: it grows with the catalog)."""
        dense = torch.zeros(self.n_users * self.n_nodes, dtype=torch.bool, device=self.keys.device)
        dense[self.keys] = True
        return dense.view(self.n_users, self.n_nodes)


@dataclass(frozen=True)
class DeadChildren:
    """``DeadNodes`` keyed by where they hang: sorted int64 ``user * stride + edge_key`` of
    each dead node's edge (``stride`` = n_nodes x width), so that a step asks once per beam,
    not once per child, which of the beam's codes lead to dead nodes."""

    keys: torch.Tensor
    stride: int
    width: int

    def blocked(self, nodes: torch.Tensor, fan: int) -> torch.Tensor:
        """BoolTensor[B, W, width]: code c after beam (b, w) leads to a node user b must not
        reach; ``fan``: at most that many children per node (the level's ``level_fan``). Two
        searchsorteds over the B x W beams, a gather and a scatter; no host read."""
        users = torch.arange(nodes.shape[0], device=nodes.device)[:, None]
        base = users * self.stride + nodes.long() * self.width  # the keys of node's edges
        low = torch.searchsorted(self.keys, base.flatten()).view(base.shape)
        high = torch.searchsorted(self.keys, (base + self.width).flatten()).view(base.shape)
        steps = torch.arange(fan, device=nodes.device)
        index = (low[..., None] + steps).clamp(max=len(self.keys) - 1)
        real = steps < (high - low)[..., None]
        columns = torch.where(real, gather(self.keys, index) - base[..., None], self.width)
        mask = torch.zeros(*nodes.shape, self.width + 1, dtype=torch.bool, device=nodes.device)
        return mask.scatter_(2, columns, True)[..., : self.width]


class TrieTables:
    """``trie``'s levels as global, compact lookup tables (module docstring)."""

    def __init__(self, trie: ItemTrie) -> None:
        layout, device = trie.layout, trie.device
        self.trie, self.depth = trie, layout.depth
        self.width = max(layout.codes_per_level)  # codes per level, padded
        counts = [len(keys) for keys in trie.keys_by_level[:-1]]  # nodes of each level
        self.offsets = [sum(counts[:d]) for d in range(self.depth + 1)]
        self.item_offset = self.offsets[-1]
        self.sink = self.item_offset + trie.n_items
        self.n_nodes = self.sink + 1
        self._edges(trie)
        self._per_node(trie)
        # token id of (level, code); the item-token row of the output layer it is scored by
        starts = torch.tensor([layout.level_start(d) for d in range(self.depth)], device=device)
        self.level_start = starts
        code = torch.arange(self.width, device=device)
        self.item_row = (starts - layout.item_token_start)[:, None] + code
        self.item_row = self.item_row.clamp(max=layout.num_item_tokens - 1)  # pads: never allowed
        self._steps = torch.arange(self.width, device=device)

    def _edges(self, trie: ItemTrie) -> None:
        """The CSR edge list of every internal node (``edge_*``, ``first_edge``, ``fan``)."""
        keys, children, fans = [], [], []
        for d in range(self.depth):
            parent, code, child = trie.edges(d)  # in (parent, code) order
            keys.append((self.offsets[d] + parent) * self.width + code)
            children.append(self.offsets[d + 1] + child)  # items: item_offset + row
            fans.append(trie.child_counts[d])
        self.edge_key = torch.cat(keys)
        pad = torch.full((self.width,), self.sink, dtype=torch.long, device=trie.device)
        child_dtype = torch.int32 if self.n_nodes < 2**31 else torch.long
        self.edge_child = torch.cat([*children, pad]).to(child_dtype)
        code_dtype = torch.int16 if self.width < 2**15 else torch.int32
        codes = torch.cat([self.edge_key % self.width, pad.new_zeros(self.width)])
        self.edge_code = codes.to(code_dtype)
        fan = torch.cat([*fans, pad.new_zeros(1)])
        self.first_edge = torch.cumsum(fan, 0) - fan  # the sink row: at the end, fan 0
        self.fan = fan.to(code_dtype)
        self.level_fan = [int(f.max()) if len(f) else 0 for f in fans]
        # edges are in (parent, code) order, and so are the nodes of every level below the
        # root, except the items (catalog order): node n's edge is n - 1, an item's its leaf's
        leaf_rank = torch.empty_like(trie.item_of_leaf)
        leaf_rank[trie.item_of_leaf] = torch.arange(trie.n_items, device=trie.device)
        self.edge_of_item = (self.item_offset - 1 + leaf_rank).to(child_dtype)

    def _per_node(self, trie: ItemTrie) -> None:
        """``settles``, ``items_under``, ``item_nodes`` and ``item_below`` (1-D per node)."""
        device, n_nodes = trie.device, self.n_nodes
        self.settles = torch.zeros(n_nodes, dtype=torch.bool, device=device)
        self.items_under = torch.ones(n_nodes, dtype=torch.int32, device=device)
        self.items_under[-1] = 0
        for d in range(self.depth):
            rows = slice(self.offsets[d], self.offsets[d + 1])
            self.settles[rows] = trie.settles[d]
            self.items_under[rows] = trie.items_under[d].to(torch.int32)
        # item_nodes[row, d]: the global node of the item's first d codes (d = 0 .. depth)
        path = [torch.zeros(trie.n_items, dtype=torch.long, device=device)]
        starts = [trie.layout.level_start(d) for d in range(self.depth)]
        codes = trie.item_tokens - torch.tensor(starts, device=device)
        for d in range(self.depth):
            path.append(self.child_of(path[-1], codes[:, d]))
        item_nodes = torch.stack(path, 1)
        self.item_nodes = item_nodes.to(torch.int32 if n_nodes < 2**31 else torch.long)
        # item_below[node]: the catalog row of the node's only item (-1 where it has several)
        self.item_below = torch.full((n_nodes,), -1, dtype=torch.int32, device=device)
        rows = torch.arange(trie.n_items, dtype=torch.int32, device=device)
        for d in range(self.depth + 1):
            single = self.items_under[item_nodes[:, d]] == 1
            self.item_below[item_nodes[single, d]] = rows[single]

    @classmethod
    def of(cls, trie: ItemTrie) -> TrieTables:
        """The tables of ``trie``, built once per trie object."""
        tables = _TABLES.get(trie)
        if tables is None:
            tables = _TABLES[trie] = cls(trie)
        return tables

    def child_of(self, nodes: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """LongTensor like ``nodes``: the child by ``codes`` (``sink`` where there is none)."""
        query = nodes.long() * self.width + codes.long()
        position = torch.searchsorted(self.edge_key, query.reshape(-1)).view(query.shape)
        position = position.clamp(max=len(self.edge_key) - 1)
        found = self.edge_key[position] == query
        return torch.where(found, self.edge_child[position].long(), self.sink)

    def rows(
        self, nodes: torch.Tensor, fan: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(codes, children, exists), each [*nodes.shape, fan]: the first ``fan`` edges of each
        node, ascending by code; ``exists`` is False past the node's own child count (there the
        others hold another node's edges: mask them). Items and the sink have none."""
        index, exists = self._edge_index(nodes, fan)
        return gather(self.edge_code, index), gather(self.edge_child, index), exists

    def codes(self, nodes: torch.Tensor, fan: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes, exists) of ``rows``, without the children (all a step's mask and top-K
        read: one gather fewer)."""
        index, exists = self._edge_index(nodes, fan)
        return gather(self.edge_code, index), exists

    def _edge_index(self, nodes: torch.Tensor, fan: int) -> tuple[torch.Tensor, torch.Tensor]:
        row = nodes.clamp(max=self.item_offset)  # items and the sink: the empty sink row
        index = gather(self.first_edge, row)[..., None] + self._steps[:fan]
        exists = self._steps[:fan] < gather(self.fan, row)[..., None]
        return index, exists

    def narrow_fan(self, level: int) -> int | None:
        """The F a top-K over level ``level``'s allowed codes reads per beam; None where it is
        over half the padded width (the root's level: narrowing saves nothing)."""
        fan = self.level_fan[level]
        return fan if 0 < 2 * fan <= self.width else None

    def allowed(self, nodes: torch.Tensor) -> torch.Tensor:
        """BoolTensor[*nodes.shape, width]: the codes that may follow each node (a dense view,
        built from its edges)."""
        codes, exists = self.codes(nodes, self.width)
        column = torch.where(exists, codes.long(), self.width)  # column ``width``: nowhere
        mask = torch.zeros(*nodes.shape, self.width + 1, dtype=torch.bool, device=nodes.device)
        return mask.scatter_(-1, column, True)[..., : self.width]

    def dead_children(self, dead: DeadNodes) -> DeadChildren | None:
        """``dead`` keyed by parent and code (``DeadChildren``; the root and the sink, which
        hang nowhere, are left out; None if nothing else is dead)."""
        # NumPy on the host, as ``dead_nodes``: its sort of a batch's ~60,000 keys takes
        # 0.3 ms where torch's takes 1.6 (41 users excluding ~500 items each, 2-core CPU). A
        # users x edges table read back in order, as ``dead_nodes`` does, was slower here.
        users, nodes = np.divmod(dead.keys.cpu().numpy(), self.n_nodes)
        keep = (nodes > 0) & (nodes < self.sink)
        users, nodes = users[keep], nodes[keep]
        if not len(nodes):
            return None
        edge_of_item, edge_key = self._host_edges
        item = np.clip(nodes - self.item_offset, 0, self.trie.n_items - 1)
        edge = np.where(nodes < self.item_offset, nodes - 1, edge_of_item[item])
        stride = self.n_nodes * self.width
        keys = torch.from_numpy(np.sort(users * stride + edge_key[edge]))
        return DeadChildren(keys.to(self.edge_key.device), stride, self.width)

    def items(self, nodes: torch.Tensor) -> torch.Tensor:
        """Catalog row of each complete-item node, -1 for any other node."""
        rows = nodes - self.item_offset
        return torch.where((rows >= 0) & (nodes < self.sink), rows, torch.full_like(rows, -1))

    def dead_nodes(self, exclude: Sequence[Sequence[int]] | None) -> DeadNodes | None:
        """The nodes all of whose items user b excludes (None: nobody excludes anything)."""
        if exclude is None or not any(len(rows) for rows in exclude):
            return None
        n_items = self.trie.n_items
        lengths = np.fromiter((len(rows) for rows in exclude), np.int64, len(exclude))
        rows = np.fromiter(itertools.chain.from_iterable(exclude), np.int64, int(lengths.sum()))
        if rows.min() < 0 or rows.max() >= n_items:
            raise ValueError(f"item rows must lie in [0, {n_items})")
        # NumPy on the host: a batch's few hundred keys per user cost a torch op's dispatch
        # (~10 us on the 2-core CPU) a dozen times over; the sets are the same either way
        users = np.repeat(np.arange(len(exclude), dtype=np.int64), lengths)
        table = len(exclude) * self.n_nodes
        if table <= min(
            DENSE_DEAD_ENTRIES, DENSE_DEAD_PER_KEY * len(rows) * self.depth + DENSE_DEAD_MIN
        ):
            keys = self._dense_dead_nodes(users, rows, len(exclude))
        else:
            keys = self._sorted_dead_nodes(users, rows)
        return DeadNodes(
            torch.from_numpy(keys).to(self.edge_key.device), len(exclude), self.n_nodes
        )

    def _dense_dead_nodes(self, users: np.ndarray, rows: np.ndarray, n_users: int) -> np.ndarray:
        """The keys through users x items and users x nodes tables: a node is dead when the
        count of its distinct excluded items reaches its ``items_under``; the nonzeros of a
        flat table come out sorted and unique (no sort; O(users x nodes))."""
        n_items, n_nodes = self.trie.n_items, self.n_nodes
        item_nodes, items_under = self._host_tables
        excluded = np.zeros(n_users * n_items, dtype=bool)
        excluded[users * n_items + rows] = True  # one (user, item) per item
        users, rows = np.divmod(np.flatnonzero(excluded), n_items)
        # every level below the root: the levels' node ranges are disjoint
        nodes = users[:, None] * n_nodes + item_nodes[rows, 1:]
        counts = np.bincount(nodes.ravel(), minlength=n_users * n_nodes).reshape(n_users, -1)
        return np.flatnonzero((counts == items_under) & (counts > 0))  # (the sink has 0 under)

    def _sorted_dead_nodes(self, users: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """The keys through sorts of the excluded (user, item) pairs and their nodes
        (O(excluded items x depth), any catalog)."""
        n_items, n_nodes = self.trie.n_items, self.n_nodes
        item_nodes, items_under = self._host_tables
        pairs = np.sort(users * n_items + rows)  # fast on the sorted rows callers pass
        pairs = pairs[np.r_[True, pairs[1:] != pairs[:-1]]]  # one (user, item) per item
        users, rows = np.divmod(pairs, n_items)
        dead = []
        for d in range(1, self.depth):
            keys, counts = np.unique(users * n_nodes + item_nodes[rows, d], return_counts=True)
            dead.append(keys[counts == items_under[keys % n_nodes]])
        # an item's own node has one item below: dead as soon as it is excluded, no count
        dead.append(users * n_nodes + item_nodes[rows, self.depth])
        # levels' node ranges are disjoint: the union is a sort, not a unique
        return np.sort(np.concatenate(dead))

    @functools.cached_property
    def _host_edges(self) -> tuple[np.ndarray, np.ndarray]:
        """``edge_of_item`` (as int64) and ``edge_key`` as host arrays (kept, as
        ``_host_tables``): ~12 bytes an item and an edge."""
        return self.edge_of_item.cpu().numpy().astype(np.int64), self.edge_key.cpu().numpy()

    @functools.cached_property
    def _host_tables(self) -> tuple[np.ndarray, np.ndarray]:
        """``item_nodes`` and ``items_under`` as host arrays: views of CPU tables, one copy
        (kept) of tables on a GPU, ~24 bytes an item on a 4-level layout."""
        return self.item_nodes.cpu().numpy(), self.items_under.cpu().numpy()
