"""TrieTables' compact edge list and sparse dead nodes == the dense tables they replaced.

The reference here is the former layout, built straight from ``ItemTrie``: a dense
[nodes, width] child table for every global node (items and the sink included) and a
dense [B, nodes] dead table; on random tries of several shapes, every lookup of the
compact tables and every membership test of ``DeadNodes`` must answer the same.
"""

from __future__ import annotations

import pytest
import torch

from genrec.app.bench.decode import random_catalog
from genrec.online.decoding import trie_tables
from genrec.online.decoding.trie import ItemTrie
from genrec.online.decoding.trie_tables import DeadNodes, TrieTables

SHAPES = [((4, 4, 2), 12), ((5, 4, 3, 2), 60), ((16, 8, 8, 4), 300), ((3, 9, 2), 25)]


def dense_child(trie: ItemTrie, tables: TrieTables) -> torch.Tensor:
    """The former ``child`` table: LongTensor[n_nodes, width], ``sink`` where no child."""
    child = torch.full((tables.n_nodes, tables.width), tables.sink, dtype=torch.long)
    for d in range(trie.layout.depth):
        children = trie.children_of(d, torch.arange(len(trie.keys_by_level[d])))
        rows, codes = slice(tables.offsets[d], tables.offsets[d + 1]), children.shape[1]
        child[rows, :codes] = torch.where(
            children >= 0, children + tables.offsets[d + 1], tables.sink
        )
    return child


def dense_dead(tables: TrieTables, exclude: list[list[int]]) -> torch.Tensor:
    """The former definition: BoolTensor[B, n_nodes], node dead when no item below is allowed."""
    dead = torch.zeros(len(exclude), tables.n_nodes, dtype=torch.bool)
    for user, rows in enumerate(exclude):
        excluded = torch.zeros(tables.trie.n_items, dtype=torch.bool)
        excluded[rows] = True
        for d in range(1, tables.depth + 1):
            nodes = tables.item_nodes[:, d].long()
            alive = torch.zeros(tables.n_nodes, dtype=torch.long).index_add_(
                0, nodes, (~excluded).long()
            )
            dead[user, nodes.unique()] = alive[nodes.unique()] == 0
    return dead


@pytest.fixture(params=range(len(SHAPES)), ids=[str(s) for s, _ in SHAPES])
def tables(request) -> TrieTables:
    codes, n_items = SHAPES[request.param]
    layout, items = random_catalog(codes, n_items=n_items, seed=request.param)
    return TrieTables(ItemTrie(items, layout))


def test_compact_lookups_equal_the_dense_child_table(tables: TrieTables):
    trie = tables.trie
    child = dense_child(trie, tables)
    nodes = torch.arange(tables.n_nodes)  # every node: internal, items and the sink
    codes = torch.arange(tables.width)
    assert torch.equal(tables.child_of(nodes[:, None], codes[None, :]), child)
    assert torch.equal(tables.allowed(nodes), child != tables.sink)
    row_codes, row_children, exists = tables.rows(nodes, tables.width)
    for node in range(tables.n_nodes):  # the row: the node's children, ascending by code
        real = exists[node]
        assert (
            row_codes[node][real].tolist() == (child[node] != tables.sink).nonzero()[:, 0].tolist()
        )
        assert row_children[node][real].tolist() == child[node][child[node] != tables.sink].tolist()
    assert not exists[tables.item_offset :].any()  # items and the sink have no children
    only_codes, only_exists = tables.codes(nodes[:, None], 3)  # rows' codes, batched shape
    assert torch.equal(only_codes[:, 0], row_codes[:, :3])
    assert torch.equal(only_exists[:, 0], exists[:, :3])
    for d in range(tables.depth):
        level = slice(tables.offsets[d], tables.offsets[d + 1])
        assert tables.level_fan[d] == int((child[level] != tables.sink).sum(1).max())
    # one row per internal node plus the sink row; one edge per non-root node
    assert len(tables.first_edge) == tables.item_offset + 1
    assert len(tables.edge_key) == tables.n_nodes - 2


def test_per_node_tables_follow_the_trie(tables: TrieTables):
    trie, child = tables.trie, dense_child(tables.trie, tables)
    codes = trie.item_tokens - torch.tensor(
        [trie.layout.level_start(d) for d in range(tables.depth)]
    )
    path = [torch.zeros(trie.n_items, dtype=torch.long)]
    for d in range(tables.depth):
        path.append(child[path[-1], codes[:, d]])
    assert torch.equal(tables.item_nodes.long(), torch.stack(path, 1))
    assert torch.equal(tables.items(tables.item_nodes[:, -1].long()), torch.arange(trie.n_items))
    for node in range(tables.n_nodes):
        below = (tables.item_nodes.long() == node).any(1).nonzero()[:, 0]
        assert int(tables.items_under[node]) == len(below)
        assert int(tables.item_below[node]) == (int(below[0]) if len(below) == 1 else -1)
    for d in range(tables.depth):
        assert torch.equal(
            tables.settles[tables.offsets[d] : tables.offsets[d + 1]], trie.settles[d]
        )
    assert not tables.settles[tables.item_offset :].any()


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("table_entries", [0, 1 << 30], ids=["sorted", "dense-tables"])
def test_sparse_dead_nodes_equal_the_dense_definition(
    tables: TrieTables, seed: int, table_entries: int, monkeypatch
):
    # both ways of finding them (sorts, or users x nodes tables on small batches) agree
    monkeypatch.setattr(trie_tables, "DENSE_DEAD_ENTRIES", table_entries)
    monkeypatch.setattr(trie_tables, "DENSE_DEAD_MIN", table_entries)
    generator = torch.Generator().manual_seed(seed)
    n_items, depth = tables.trie.n_items, tables.depth
    exclude = []
    for user in range(5):
        share = [0.0, 0.1, 0.5, 1.0, 0.3][user]  # nothing, some, half, all, ...
        chosen = torch.rand(n_items, generator=generator) < share
        exclude.append(
            chosen.nonzero()[:, 0].tolist() + chosen.nonzero()[:1, 0].tolist()
        )  # a repeat
    dead = tables.dead_nodes(exclude)
    expected = dense_dead(tables, exclude)
    assert torch.equal(dead.dense(), expected)
    assert len(dead.keys) <= sum(len(set(rows)) for rows in exclude) * depth
    assert torch.equal(dead.keys, dead.keys.unique())  # sorted, unique
    queries = torch.randint(0, tables.n_nodes, (5, 7, 11), generator=generator)
    assert torch.equal(
        dead.contains(queries), expected.gather(1, queries.flatten(1)).view_as(queries)
    )
    for user in range(5):
        assert torch.equal(dead.contains(queries[0], user=user), expected[user][queries[0]])
        for d in range(depth + 1):
            first, end = ([*tables.offsets, tables.sink, tables.n_nodes])[d : d + 2]
            assert dead.any_between(user, first, end) == bool(expected[user, first:end].any())


def test_dead_children_block_the_codes_that_lead_to_dead_nodes(tables: TrieTables):
    generator = torch.Generator().manual_seed(7)
    n_items, child = tables.trie.n_items, dense_child(tables.trie, tables)
    exclude = [
        (torch.rand(n_items, generator=generator) < share).nonzero()[:, 0].tolist()
        for share in (0.2, 0.0, 0.6, 1.0)
    ]
    dead = tables.dead_nodes(exclude)
    expected_dead = dense_dead(tables, exclude)
    by_parent = tables.dead_children(dead)
    nodes = torch.randint(0, tables.n_nodes, (4, 9), generator=generator)  # any node, any level
    children = child[nodes]  # [B, W, width]
    expected = expected_dead.gather(1, children.flatten(1)).view_as(children)
    expected &= children != tables.sink
    assert torch.equal(by_parent.blocked(nodes, tables.width), expected)
    for d in range(tables.depth):  # a level's own fan is enough for its nodes
        level = nodes.clamp(tables.offsets[d], tables.offsets[d + 1] - 1)
        got = by_parent.blocked(level, tables.level_fan[d])
        assert torch.equal(got, expected_dead.gather(1, child[level].flatten(1)).view_as(got))
    root_only = DeadNodes.of_pairs(torch.tensor([0]), torch.tensor([0]), 1, tables.n_nodes)
    assert tables.dead_children(root_only) is None


def test_dead_node_sets_compose_as_a_union(tables: TrieTables):
    n_items = tables.trie.n_items
    one = tables.dead_nodes([[0, 1], [], list(range(0, n_items, 2))])
    other = tables.dead_nodes([[2], [n_items - 1], list(range(1, n_items, 2))])
    both = one | other
    assert torch.equal(both.dense(), one.dense() | other.dense())
    # excluding every item kills every node below the root
    level_1 = slice(tables.offsets[1], tables.offsets[2])
    assert tables.dead_nodes([list(range(n_items))]).dense()[0, level_1].all()
    with pytest.raises(ValueError, match="different"):
        _ = one | tables.dead_nodes([[0]])
    assert DeadNodes.of_pairs(torch.tensor([]), torch.tensor([]), 1, tables.n_nodes) is None
    pairs = DeadNodes.of_pairs(torch.tensor([1, 0, 1]), torch.tensor([3, 2, 3]), 2, tables.n_nodes)
    assert pairs.keys.tolist() == [2, tables.n_nodes + 3]
