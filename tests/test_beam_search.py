"""Target-only constrained beam search == transformers' generate, batched and unbatched."""

from __future__ import annotations

import pytest
import torch

from genrec.online.beam_search import beam_search
from genrec.online.decoding_bench import TEST_PRESETS, BenchModels, hf_generate_items, load_models

BEAM_WIDTHS = [1, 3, 5, 10, 20]


@pytest.fixture(scope="module", params=TEST_PRESETS)
def case(request) -> BenchModels:
    torch.set_num_threads(2)
    return load_models(request.param)


def hf_generate(model, prompts, trie, k: int, renormalize: bool) -> torch.Tensor:
    return hf_generate_items(model, prompts, trie, k, renormalize).tokens


@pytest.mark.parametrize("score_mode", ["allowed", "full"])
@pytest.mark.parametrize("k", BEAM_WIDTHS)
def test_equals_transformers_generate(case: BenchModels, k: int, score_mode: str):
    prompts = [u.prompt for u in case.eval_users[:4]]
    expected = hf_generate(case.target, prompts, case.trie, k, renormalize=score_mode == "allowed")
    batched = beam_search(case.target, prompts, case.trie, case.layout, k, score_mode=score_mode)
    assert torch.equal(batched.tokens, expected)
    for row, prompt in enumerate(prompts):
        alone = beam_search(case.target, [prompt], case.trie, case.layout, k, score_mode=score_mode)
        assert torch.equal(alone.tokens[0], expected[row])
        torch.testing.assert_close(alone.scores[0], batched.scores[row])


def test_results_are_valid_items_best_first(case: BenchModels):
    prompts = [u.prompt for u in case.eval_users]
    result = beam_search(case.target, prompts, case.trie, case.layout, 10)
    assert result.tokens.shape == (len(prompts), 10, case.layout.depth)
    assert (result.item_index >= 0).all()
    assert torch.equal(case.trie.item_tokens[result.item_index], result.tokens)
    assert (result.scores[:, :-1] >= result.scores[:, 1:]).all()
    for row in result.item_index:  # K distinct items per user
        assert len(set(row.tolist())) == 10


def test_single_child_steps_cost_no_call(case: BenchModels):
    prompts = [u.prompt for u in case.eval_users[:3]]
    allowed = beam_search(case.target, prompts, case.trie, case.layout, 5)
    full = beam_search(case.target, prompts, case.trie, case.layout, 5, score_mode="full")
    for fast, slow in zip(allowed.stats, full.stats, strict=True):
        assert slow.target_calls == case.layout.depth and slow.forced_steps == 0
        assert fast.target_calls + fast.forced_steps == case.layout.depth


def test_tiny_catalog_pads_missing_beams():
    case = load_models("tiny")
    few = case.trie.item_tokens[:3]
    from genrec.online.trie import ItemTrie

    trie = ItemTrie(few, case.layout)
    result = beam_search(case.target, [case.eval_users[0].prompt], trie, case.layout, 5)
    assert sorted(result.item_index[0, :3].tolist()) == [0, 1, 2]
    assert result.item_index[0, 3:].tolist() == [-1, -1]
    assert torch.isinf(result.scores[0, 3:]).all()


def test_bad_input_is_refused(case: BenchModels):
    with pytest.raises(ValueError):
        beam_search(case.target, [[]], case.trie, case.layout, 3)
    with pytest.raises(ValueError):
        beam_search(case.target, [[1]], case.trie, case.layout, 0)
    with pytest.raises(ValueError):
        beam_search(case.target, [[1]], case.trie, case.layout, 3, score_mode="bogus")
