"""ItemConstraint: the trie's codes, minus what composed exclusions (seen items, ...) block."""

from __future__ import annotations

import pytest
import torch

from genrec.online.decoding.constraints import (
    ItemConstraint,
    SeenItems,
    TrieLogitsProcessor,
    mask_blocked,
)
from genrec.online.decoding.trie import ItemTrie
from genrec.schemas.token_layout import TokenLayout

LAYOUT = TokenLayout.for_scratch_model((4, 4, 2))
CODES = [[0, 1, 0], [0, 1, 1], [0, 2, 0], [3, 1, 1]]


@pytest.fixture
def trie() -> ItemTrie:
    return ItemTrie(torch.tensor(LAYOUT.encode(CODES)), LAYOUT)


def prefixes(*codes: list[int]) -> torch.Tensor:
    """Token ids of equally long code prefixes."""
    tokens = [[LAYOUT.level_start(level) + c for level, c in enumerate(p)] for p in codes]
    return torch.tensor(tokens, dtype=torch.long).reshape(len(codes), -1)


def test_without_exclusions_the_trie_alone_decides(trie):
    constraint = ItemConstraint.for_users(trie, None, 2)
    allowed, blocked = constraint.masks(prefixes([0], [3]), user=1)
    assert torch.equal(allowed, trie.allowed_mask(prefixes([0], [3])))
    assert blocked is None and constraint.dead_nodes() is None


def test_seen_items_block_only_subtrees_with_nothing_else_below(trie):
    constraint = ItemConstraint.for_users(trie, [[0, 1], []], 2)
    allowed, blocked = constraint.masks(prefixes([0]), user=0)
    assert allowed.int().tolist() == [[0, 1, 1, 0]]
    assert blocked.int().tolist() == [[0, 1, 0, 0]]  # items 0 and 1 are all of <a_0><b_1>
    assert constraint.masks(prefixes([]), user=0)[1] is None  # <a_0> still leads to item 2
    assert constraint.masks(prefixes([0]), user=1)[1] is None  # user 1 excludes nothing
    with pytest.raises(ValueError, match="exclude"):
        ItemConstraint.for_users(trie, [[0]], 2)


def test_exclusions_compose_as_a_union(trie):
    one, other = SeenItems(trie, [[0]]), SeenItems(trie, [[1]])
    both = ItemConstraint(trie).excluding(one).excluding(other)
    at = prefixes([0, 1])
    children = trie.child_nodes(at)
    _, blocked = both.masks(at, user=0)
    assert torch.equal(blocked, one.blocked(children, 2, 0) | other.blocked(children, 2, 0))
    assert blocked.int().tolist() == [[1, 1]]
    # each blocks its own item; neither empties <a_0><b_1> alone (one SeenItems of both would)
    assert both.masks(prefixes([0]), user=0)[1] is None
    assert SeenItems(trie, [[0, 1]]).blocked(trie.child_nodes(prefixes([0])), 1, 0).any()
    # the batched engine's [B, nodes] table is the union too
    assert torch.equal(
        both.dead_nodes().dense(), one.dead_nodes().dense() | other.dead_nodes().dense()
    )


def test_mask_blocked_sets_blocked_codes_to_minus_infinity():
    scores = torch.zeros(1, 3)
    assert mask_blocked(scores, None) is scores
    masked = mask_blocked(scores, torch.tensor([[False, True, False]]))
    assert masked.tolist() == [[0.0, float("-inf"), 0.0]]


def test_logits_processor_masks_renormalizes_then_excludes(trie):
    width = 1  # prompt: one BOS token
    processor = TrieLogitsProcessor(trie, width, exclude=[[0, 1]], num_beams=2)
    vocabulary = LAYOUT.item_token_end + 1
    ids = torch.tensor([[1, LAYOUT.level_start(0)]] * 2)  # both beams after <a_0>
    out = processor(ids, torch.zeros(2, vocabulary))
    codes = LAYOUT.level_range(1)
    expected = torch.log(torch.tensor(0.5))  # two valid codes, renormalized
    assert torch.isinf(out[:, codes.start + 1]).all()  # <b_1>: only seen items below
    assert torch.allclose(out[:, codes.start + 2], expected.expand(2))
    assert torch.isinf(out[:, : codes.start]).all() and torch.isinf(out[:, codes.stop :]).all()
    same = TrieLogitsProcessor.for_constraint(processor.constraint, width, num_beams=2)
    assert torch.equal(same(ids, torch.zeros(2, vocabulary)), out)
