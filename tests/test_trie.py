"""ItemTrie: exactly the valid continuations, item lookup, single-child detection."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from genrec.app.bench.decode import random_catalog
from genrec.online.decoding.trie import ItemTrie
from genrec.online.prompts import ItemTokens
from genrec.schemas.token_layout import TokenLayout


@pytest.fixture(scope="module")
def catalog():
    layout, items = random_catalog((5, 4, 3, 2), n_items=40, seed=3)
    return layout, items, ItemTrie(items, layout)


def test_allowed_mask_is_exact_for_every_prefix(catalog):
    layout, items, trie = catalog
    catalog_rows = [tuple(r) for r in items.tolist()]
    for d in range(layout.depth):
        prefixes = list(itertools.product(*[layout.level_range(lv) for lv in range(d)]))
        tensor = torch.tensor(prefixes, dtype=torch.long).reshape(len(prefixes), d)
        mask = trie.allowed_mask(tensor)
        counts = trie.child_count(tensor)
        assert mask.shape == (len(prefixes), layout.codes_per_level[d])
        for row, prefix in enumerate(prefixes):
            expected = {r[d] for r in catalog_rows if r[:d] == prefix}
            got = {layout.level_start(d) + c for c in mask[row].nonzero()[:, 0].tolist()}
            assert got == expected, (prefix, got, expected)
            assert int(counts[row]) == len(expected)


def test_item_index_finds_items_and_rejects_the_rest(catalog):
    layout, items, trie = catalog
    everything = torch.tensor(list(itertools.product(*[layout.level_range(lv) for lv in range(4)])))
    index = trie.item_index(everything)
    lookup = {tuple(r): i for i, r in enumerate(items.tolist())}
    for row, found in zip(everything.tolist(), index.tolist(), strict=True):
        assert found == lookup.get(tuple(row), -1)
    assert trie.item_index(items[None]).tolist() == [list(range(len(items)))]


def test_tokens_of_the_wrong_level_are_invalid(catalog):
    layout, items, trie = catalog
    wrong = items[:1].clone()
    wrong[0, 1] = layout.level_start(0)  # a level-0 token at level 1
    assert trie.item_index(wrong).tolist() == [-1]
    assert not trie.allowed_mask(wrong[:, :2]).any()
    assert trie.child_count(torch.tensor([[0]])).tolist() == [0]  # a special token


def test_bad_catalogs_are_refused():
    layout = TokenLayout.for_scratch_model((4, 4))
    with pytest.raises(ValueError, match="duplicate"):
        ItemTrie(torch.tensor(layout.encode([[1, 2], [1, 2]])), layout)
    with pytest.raises(ValueError, match="outside"):
        ItemTrie(torch.tensor([[0, 5]]), layout)
    with pytest.raises(ValueError, match="must be"):
        ItemTrie(torch.tensor([4, 8]), layout)


def test_child_nodes_follow_the_trie_down_to_item_rows(catalog):
    layout, items, trie = catalog
    catalog_rows = [tuple(r) for r in items.tolist()]
    for d in range(layout.depth):
        unique = sorted({r[:d] for r in catalog_rows})
        prefixes = torch.tensor(unique, dtype=torch.long).reshape(len(unique), d)
        children = trie.child_nodes(prefixes)
        assert torch.equal(children >= 0, trie.allowed_mask(prefixes))
        if d == layout.depth - 1:
            for row, prefix in enumerate(prefixes.tolist()):
                for code, item in enumerate(children[row].tolist()):
                    token = layout.level_start(d) + code
                    expected = catalog_rows.index((*prefix, token)) if item >= 0 else -1
                    assert item == expected
    # the table walks like the keys: root -> ... -> item row
    for row, tokens in enumerate(catalog_rows):
        node = 0
        for d, token in enumerate(tokens):
            code = torch.tensor(token - layout.level_start(d))
            node = int(trie.child_of(d, torch.tensor(node), code))
        assert node == row
    assert trie.child_nodes(torch.tensor([[0]])).eq(-1).all()  # an invalid prefix


def test_from_item_tokens_keeps_the_catalog_order():
    layout = TokenLayout.for_scratch_model((4, 4, 2))
    codes = np.array([[3, 1, 1], [0, 1, 0], [0, 2, 0]])
    trie = ItemTrie.from_item_tokens(ItemTokens(["c", "a", "b"], codes, layout))
    assert trie.layout == layout and trie.n_items == 3
    assert torch.equal(trie.item_tokens, torch.tensor(layout.encode(codes)))
    assert trie.item_index(torch.tensor(layout.encode(codes))).tolist() == [0, 1, 2]


def test_trie_tables_rows_are_the_allowed_table_narrowed():
    from genrec.online.decoding.trie_tables import TrieTables

    layout, items = random_catalog((16, 8, 2), n_items=30, seed=1)
    tables = TrieTables.of(ItemTrie(items, layout))
    assert tables.narrow_fan(0) is None  # the root allows most codes: nothing to narrow
    narrowed = 0
    for d in range(layout.depth):
        fan = tables.narrow_fan(d)
        if fan is None:
            continue
        narrowed += 1
        nodes = torch.arange(tables.offsets[d], tables.offsets[d + 1])
        codes, _, exists = tables.rows(nodes, fan)
        for node, row, real in zip(nodes, codes.tolist(), exists.tolist(), strict=True):
            allowed = tables.allowed(node[None])[0].nonzero()[:, 0].tolist()
            assert [c for c, r in zip(row, real, strict=True) if r] == allowed  # ascending
            assert real == sorted(real, reverse=True)  # the node's own edges first
    assert narrowed
