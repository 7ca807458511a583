"""Co-occurrence item vectors in the target's input: lookup, prefix-cache equality, save/load, training."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from genrec.app.bench.decode import BenchModels, load_models
from genrec.online.decoding.engine import batched_beam_search, batched_speculative_beam_search
from genrec.online.decoding.prefix_kv import PrefixBatch, compute_prefix_kv
from genrec.online.models.item_vectors import (
    FILE_NAME,
    attach_item_vectors,
    fit_item_vectors,
    item_vector_embedding,
    load_item_vectors,
    plain_input_embeddings,
    save_pretrained_with_item_vectors,
)
from genrec.online.prompts import ItemTokens
from tests.helpers import split_prompts


@pytest.fixture(scope="module")
def case() -> BenchModels:
    """The tiny random bench models, each with random item vectors, projected strongly."""
    torch.set_num_threads(2)
    case = load_models("tiny")
    generator = torch.Generator().manual_seed(5)
    vectors = torch.randn(case.trie.n_items, 6, generator=generator)
    for model in (case.target, case.draft):
        embedding = attach_item_vectors(model, case.trie, vectors)
        with torch.no_grad():
            embedding.projection.weight.normal_(0.0, 1.0, generator=generator)
        model.eval()
    return case


def test_the_vector_goes_to_the_last_code_of_each_complete_item(case: BenchModels):
    embedding = item_vector_embedding(case.target)
    item_tokens = case.trie.item_tokens.tolist()
    prompt = [case.layout.bos_token_id, *item_tokens[3], *item_tokens[7]]
    rows = embedding.item_rows(torch.tensor([prompt]))[0].tolist()
    depth = case.layout.depth
    assert rows == [-1] * depth + [3] + [-1] * (depth - 1) + [7]
    # a call that starts at the last code finds its item only with the tokens before it as context
    tail = torch.tensor([prompt[-1:]])
    assert embedding.item_rows(tail).tolist() == [[-1]]
    context = torch.tensor([prompt[-depth:-1]])
    assert embedding.item_rows(tail, context).tolist() == [[7]]
    # no effect before the first complete item; an effect from it on
    with plain_input_embeddings(case.target):
        plain = case.target(torch.tensor([prompt])).logits[0]
    with_vectors = case.target(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(with_vectors[:depth], plain[:depth])
    assert not torch.allclose(with_vectors[depth:], plain[depth:])


def test_prefix_caches_plus_suffix_give_the_same_top_k_as_full_prompts(case: BenchModels):
    prefixes, suffixes, full = split_prompts(case)
    reference = batched_beam_search(case.target, full, case.trie, case.layout, 5)
    for prompts, tails in ((prefixes, suffixes), (full, None)):
        batch = PrefixBatch(compute_prefix_kv(case.target, prompts, "v1"), tails or [])
        result = batched_beam_search(case.target, batch, case.trie, case.layout, 5)
        assert torch.equal(result.tokens, reference.tokens)
        torch.testing.assert_close(result.scores, reference.scores)


def test_beam_scores_equal_the_full_forward_of_prompt_plus_item(case: BenchModels):
    """Independent of the decoder's cache: one plain forward over the prompt and the item's codes."""
    prefixes, suffixes, _ = split_prompts(case)
    batch = PrefixBatch(compute_prefix_kv(case.target, prefixes, "v1"), suffixes)
    result = batched_beam_search(case.target, batch, case.trie, case.layout, 3)
    layout = case.layout
    for user in range(len(prefixes)):
        prompt = prefixes[user] + suffixes[user]
        for beam in range(3):
            codes = result.tokens[user, beam].tolist()
            with torch.no_grad():
                logits = case.target(torch.tensor([prompt + codes])).logits[0]
            score = 0.0
            for level, token in enumerate(codes):
                rows = layout.level_range(level)
                step = logits[len(prompt) - 1 + level, rows.start : rows.stop]
                allowed = case.trie.allowed_mask(torch.tensor([codes[:level]]))[0]
                log_probs = step.masked_fill(~allowed, -torch.inf).log_softmax(-1)
                score += float(log_probs[token - rows.start])
            assert score == pytest.approx(float(result.scores[user, beam]), abs=1e-6)


def test_speculative_search_with_item_vectors_in_both_models_is_lossless(case: BenchModels):
    prefixes, suffixes, full = split_prompts(case)
    reference = batched_beam_search(case.target, full, case.trie, case.layout, 5)
    batch = PrefixBatch(compute_prefix_kv(case.target, prefixes, "v1"), suffixes)
    draft_batch = PrefixBatch(compute_prefix_kv(case.draft, prefixes, "d1"), suffixes)
    for prompts in ((batch, draft_batch), full):
        result = batched_speculative_beam_search(
            case.target, case.draft, prompts, case.trie, case.layout, 5
        )
        assert torch.equal(result.tokens, reference.tokens)


def test_saved_target_is_a_plain_checkpoint_and_reloads_with_its_vectors(case, tmp_path):
    save_pretrained_with_item_vectors(case.target, tmp_path)
    assert item_vector_embedding(case.target) is not None  # saving leaves the model as it was
    assert (tmp_path / FILE_NAME).exists()
    plain = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=case.target.dtype).eval()
    assert item_vector_embedding(plain) is None
    prompt = torch.tensor([case.eval_users[0].prompt])
    with plain_input_embeddings(case.target):
        torch.testing.assert_close(plain(prompt).logits, case.target(prompt).logits)
    assert load_item_vectors(plain, tmp_path, case.trie) is not None
    torch.testing.assert_close(plain(prompt).logits, case.target(prompt).logits)
    empty = tmp_path / "no-vectors"
    empty.mkdir()
    assert load_item_vectors(plain, empty, case.trie) is None


def test_vectors_are_fitted_on_the_given_sequences_only():
    from genrec.schemas.token_layout import TokenLayout

    layout = TokenLayout.for_scratch_model((4, 4))
    codes = np.array([[a, b] for a in range(4) for b in range(4)])[:6]
    items = ItemTokens([f"m{i}" for i in range(6)], codes, layout)
    sequences = [["m0", "m1", "m2", "m0"], ["m1", "m2", "m3"], ["m0", "m3", "m1"]]
    vectors = fit_item_vectors(sequences, items, dim=3)
    assert vectors.shape == (6, 3)
    norms = vectors.norm(dim=1)
    torch.testing.assert_close(norms[:4], torch.ones(4))
    assert torch.equal(norms[4:], torch.zeros(2))  # never seen in the sequences: no vector


def test_vectors_above_fit_max_items_are_the_landmark_embeddings():
    """``fit_max_items`` below the catalog: the unit rows of the landmark (Nystrom) fit."""
    from genrec.online.branches import cooccurrence_embeddings, normalize_rows
    from genrec.schemas.token_layout import TokenLayout

    rng = np.random.default_rng(2)
    layout = TokenLayout.for_scratch_model((8, 8))
    codes = np.array([[a, b] for a in range(8) for b in range(8)])[:60]
    names = [f"m{i}" for i in range(60)]
    items = ItemTokens(names, codes, layout)
    sequences = [[names[i] for i in rng.zipf(1.5, size=12) % 60] for _ in range(80)]
    vectors = fit_item_vectors(sequences, items, dim=4, fit_max_items=20)
    expected = cooccurrence_embeddings(dict(enumerate(sequences)), names, dim=4, fit_max_items=20)
    torch.testing.assert_close(vectors, torch.from_numpy(normalize_rows(expected)))
    whole = fit_item_vectors(sequences, items, dim=4)
    assert not torch.allclose(vectors, whole, atol=1e-3)
