"""Prompts, tokenizer, prefix tree and constrained beam search of the generative models."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from genrec.online.decoding.trie import ItemTrie
from genrec.online.models.generative import decode_batched
from genrec.online.models.presets import (
    PRESETS,
    build_draft,
    build_target,
    item_logits,
    scratch_tokenizer,
)
from genrec.online.prompts import (
    IGNORE_INDEX,
    ItemTokens,
    history_prompt,
    history_tokens,
    target_tokens,
    training_example,
)
from genrec.schemas.token_layout import TokenLayout
from tests.helpers import random_items


def test_prompt_layout_and_prefix_property():
    items = random_items(20)
    history = [f"i{k}" for k in range(8)]
    prompt = history_prompt(history, items, max_items=50)
    assert prompt[0] == items.layout.bos_token_id
    assert len(prompt) == 1 + 8 * items.layout.depth
    assert prompt[1:4] == items.tokens_of("i0")
    # Newer events extend the prompt at the end while the history fits in H items.
    longer = history_prompt([*history, "i9", "i10"], items, max_items=50)
    assert longer[: len(prompt)] == prompt
    # Beyond H items the window slides: only the last H items remain.
    window = history_prompt(history, items, max_items=3)
    assert window[1:] == sum((items.tokens_of(i) for i in history[-3:]), [])
    # Unknown items (no semantic ID yet) are skipped.
    assert history_prompt(["unknown", *history], items, 50) == prompt


def test_last_known_is_the_tail_of_the_known_items():
    items = random_items(20)
    rng = np.random.default_rng(0)
    for _ in range(50):
        history = [
            f"i{k}" if k < 20 else f"new{k}" for k in rng.integers(0, 30, rng.integers(0, 40))
        ]
        for count in (1, 3, 50):
            assert items.last_known(history, count) == items.known(history)[-count:]


def test_prompt_of_a_history_is_its_cached_prefix_followed_by_the_suffix():
    items = random_items(20)
    history = ["i3", "unknown", "i0", "i7", "i11", "new-item", "i5"]
    titles = {"i0": [2, 2], "i7": [3]}
    for n in range(len(history) + 1):
        for title_tokens in (None, titles):
            prefix = history_prompt(history[:n], items, 50, title_tokens)
            suffix = history_tokens(history[n:], items, 50, title_tokens)
            assert prefix + suffix == history_prompt(history, items, 50, title_tokens)
    # the suffix keeps the window too: only its last max_items known items
    assert history_tokens(history, items, 2) == items.tokens_of("i11") + items.tokens_of("i5")
    with pytest.raises(ValueError, match="max_items"):
        history_tokens(history, items, 0)


def test_target_is_id_then_eos_and_training_labels_shift():
    items = random_items(10)
    assert target_tokens("i3", items) == [*items.tokens_of("i3"), items.layout.eos_token_id]
    with pytest.raises(KeyError):
        target_tokens("nope", items)
    ids, labels = training_example(["i1", "i2"], items)
    full = [items.layout.bos_token_id, *items.tokens_of("i1"), *items.tokens_of("i2")]
    assert ids == full[:-1]
    assert labels == full[1:]
    titled_ids, titled_labels = training_example(["i1", "i2"], items, {"i1": [3, 3]})
    assert titled_ids[4:6] == [3, 3] and titled_labels[3:5] == [IGNORE_INDEX, IGNORE_INDEX]


def test_item_tokens_rejects_duplicate_ids():
    layout = TokenLayout.for_scratch_model((4, 4))
    with pytest.raises(ValueError, match="unique"):
        ItemTokens(["a", "b"], np.array([[1, 1], [1, 1]]), layout)


def test_scratch_tokenizer_knows_item_tokens():
    layout = TokenLayout.for_scratch_model((4, 3))
    tokenizer = scratch_tokenizer(layout)
    assert len(tokenizer) == layout.vocab_size
    assert tokenizer.convert_tokens_to_ids(["<a_2>", "<b_0>"]) == layout.encode([[2, 0]])[0]
    assert tokenizer.bos_token_id == layout.bos_token_id


def _exact_item_scores(model, items: ItemTokens, prompt: list[int]) -> torch.Tensor:
    """log p(item | prompt) of every item, each level renormalized over valid children."""
    layout = items.layout
    sequences = torch.as_tensor([prompt + row for row in items.table.tolist()])
    logits, _ = item_logits(model, layout, sequences)
    offsets = np.asarray([layout.level_start(i) for i in range(layout.depth)])
    codes = items.table - offsets
    scores = torch.zeros(len(items))
    for level in range(layout.depth):
        start = layout.level_start(level) - layout.item_token_start
        level_logits = logits[
            :, len(prompt) - 1 + level, start : start + layout.codes_per_level[level]
        ]
        for row, code in enumerate(codes):
            siblings = sorted({c[level] for c in codes if tuple(c[:level]) == tuple(code[:level])})
            scores[row] += level_logits[row, code[level]] - torch.logsumexp(
                level_logits[row, siblings], 0
            )
    return scores


def test_full_width_beam_search_is_exact_and_valid():
    torch.manual_seed(0)
    items = random_items(40)
    model = build_target(PRESETS["tiny"], items.layout).eval()
    tree = ItemTrie.from_item_tokens(items)
    rng = np.random.default_rng(1)
    prompts = [
        history_prompt([f"i{k}" for k in rng.integers(0, 40, n)], items, 50) for n in (1, 4, 2)
    ]
    result = decode_batched(model, tree, prompts, beam_width=len(items), batch_size=2)
    for row, prompt in enumerate(prompts):
        exact = _exact_item_scores(model, items, prompt)
        order = torch.argsort(exact, descending=True)
        assert result.item_index[row].tolist() == order.tolist()
        assert torch.allclose(result.scores[row], exact[order], atol=1e-4)
    # Tokens returned are the items' semantic IDs.
    assert (result.tokens[0, 0].numpy() == items.table[result.item_index[0, 0]]).all()


def test_beam_search_only_returns_valid_unexcluded_items():
    torch.manual_seed(1)
    items = random_items(30)
    model = build_target(PRESETS["tiny"], items.layout).eval()
    draft = build_draft(PRESETS["tiny"], items.layout).eval()
    tree = ItemTrie.from_item_tokens(items)
    prompts = [history_prompt(["i1", "i2"], items, 50), history_prompt(["i3"], items, 50)]
    exclude = [[0, 1, 2], []]
    result = decode_batched(model, tree, prompts, 5, exclude, shadow=draft, shadow_width=5)
    assert result.item_index.shape == (2, 5)
    assert set(result.item_index[0].tolist()).isdisjoint({0, 1, 2})
    assert ((result.item_index >= 0) & (result.item_index < len(items))).all()
    assert len(result.step_acceptance) == items.layout.depth
    # More beams than items: the extra slots say so with -1.
    few = decode_batched(model, tree, prompts[:1], 50)
    assert sorted(i for i in few.item_index[0].tolist() if i >= 0) == list(range(30))
