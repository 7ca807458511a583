"""Speculative beam search: strict is lossless (== target-only == generate), relaxed is valid and seeded."""

from __future__ import annotations

import pytest
import torch

from genrec.app.bench.decode import BenchModels, hf_generate_items, load_models
from genrec.online.decoding.engine import (
    AcceptanceMonitor,
    DecodeStats,
    batched_beam_search,
    batched_speculative_beam_search,
    strict_acceptance_per_level,
)
from tests.helpers import DECODING_PRESETS

BEAM_WIDTHS = [1, 3, 5, 10, 20]


@pytest.fixture(scope="module", params=DECODING_PRESETS)
def case(request) -> BenchModels:
    torch.set_num_threads(2)
    return load_models(request.param)


@pytest.mark.parametrize("k", BEAM_WIDTHS)
def test_strict_equals_target_only_and_generate(case: BenchModels, k: int):
    prompts = [u.prompt for u in case.eval_users[:4]]
    generated = hf_generate_items(case.target, prompts, case.trie, k)
    reference = batched_beam_search(case.target, prompts, case.trie, case.layout, k)
    assert torch.equal(reference.tokens, generated.tokens)
    for draft in (case.draft, case.target):
        batched = batched_speculative_beam_search(
            case.target, draft, prompts, case.trie, case.layout, k
        )
        assert torch.equal(batched.tokens, generated.tokens)
        torch.testing.assert_close(batched.scores, reference.scores)
        for row, prompt in enumerate(prompts):
            alone = batched_speculative_beam_search(
                case.target, draft, [prompt], case.trie, case.layout, k
            )
            assert torch.equal(alone.tokens[0], generated.tokens[row])


@pytest.mark.parametrize("k", [3, 10])
def test_strict_full_vocabulary_scores_are_lossless_too(case: BenchModels, k: int):
    prompts = [u.prompt for u in case.eval_users[:4]]
    reference = hf_generate_items(case.target, prompts, case.trie, k, renormalize=False)
    result = batched_speculative_beam_search(
        case.target, case.draft, prompts, case.trie, case.layout, k, score_mode="full"
    )
    assert torch.equal(result.tokens, reference.tokens)


def test_acceptance_is_partial_for_another_draft_and_full_for_the_target_itself(case: BenchModels):
    prompts = [u.prompt for u in case.eval_users]
    other = batched_speculative_beam_search(
        case.target, case.draft, prompts, case.trie, case.layout, 10
    )
    itself = batched_speculative_beam_search(
        case.target, case.target, prompts, case.trie, case.layout, 10
    )
    for stats in itself.stats:
        assert stats.accepted_steps == stats.drafted_steps == case.layout.depth - 1
        assert stats.target_calls == 1 and stats.draft_calls == case.layout.depth - 1
    accepted = sum(s.accepted_steps for s in other.stats)
    drafted = sum(s.drafted_steps for s in other.stats)
    assert 0 < accepted < drafted
    for stats in other.stats:
        assert 1 <= stats.target_calls <= case.layout.depth
        assert stats.rounds == stats.target_calls


@pytest.mark.parametrize("k", [1, 5, 20])
def test_relaxed_gives_valid_distinct_items_and_is_seeded(case: BenchModels, k: int):
    prompts = [u.prompt for u in case.eval_users]

    def run(seed: int):
        generator = torch.Generator().manual_seed(seed)
        return batched_speculative_beam_search(
            case.target, case.draft, prompts, case.trie, case.layout, k, mode="relaxed",
            generator=generator,
        )  # fmt: skip

    first, again = run(7), run(7)
    assert torch.equal(first.tokens, again.tokens)
    assert (first.item_index >= 0).all()
    for row in first.item_index:
        assert len(set(row.tolist())) == k
    assert (first.scores[:, :-1] >= first.scores[:, 1:]).all()
    # with the target as its own draft every drafted step is accepted
    itself = batched_speculative_beam_search(
        case.target, case.target, prompts, case.trie, case.layout, k, mode="relaxed"
    )
    assert all(s.target_calls == 1 for s in itself.stats)


def test_monitor_falls_back_to_target_only_and_probes():
    monitor = AcceptanceMonitor(window=8, threshold=0.5, probe_every=4)
    assert monitor.use_speculative()
    for _ in range(8):
        monitor.record(DecodeStats(drafted_steps=3, accepted_steps=0, speculative=True))
    decisions = [monitor.use_speculative() for _ in range(8)]
    assert decisions.count(True) == 2  # probes only
    for _ in range(8):
        monitor.record(DecodeStats(drafted_steps=3, accepted_steps=3, speculative=True))
    assert monitor.use_speculative()


def test_fallback_result_is_target_only(case: BenchModels):
    monitor = AcceptanceMonitor(window=4, threshold=1.1, probe_every=1000)
    prompts = [u.prompt for u in case.eval_users[:2]]
    for _ in range(4):
        batched_speculative_beam_search(
            case.target, case.draft, prompts, case.trie, case.layout, 5, monitor=monitor
        )
    result = batched_speculative_beam_search(
        case.target, case.draft, prompts, case.trie, case.layout, 5, monitor=monitor
    )
    assert not any(s.speculative for s in result.stats)
    assert all(s.draft_calls == 0 for s in result.stats)


def test_bad_arguments_are_refused(case: BenchModels):
    prompt = [case.eval_users[0].prompt]
    with pytest.raises(ValueError):
        batched_speculative_beam_search(
            case.target, case.draft, prompt, case.trie, case.layout, 10, n_draft=5
        )
    with pytest.raises(ValueError):
        batched_speculative_beam_search(
            case.target, case.draft, prompt, case.trie, case.layout, 3, mode="x"
        )


@pytest.mark.parametrize("k", [3, 10])
def test_strict_with_excluded_items_equals_target_only(case: BenchModels, k: int):
    prompts = [u.prompt for u in case.eval_users[:4]]
    plain = batched_beam_search(case.target, prompts, case.trie, case.layout, k)
    exclude = [row[:2].tolist() + row[-1:].tolist() for row in plain.item_index]
    reference = hf_generate_items(case.target, prompts, case.trie, k, exclude=exclude)
    result = batched_speculative_beam_search(
        case.target, case.draft, prompts, case.trie, case.layout, k, exclude=exclude
    )
    assert torch.equal(result.tokens, reference.tokens)
    relaxed = batched_speculative_beam_search(
        case.target, case.draft, prompts, case.trie, case.layout, k, mode="relaxed",
        exclude=exclude,
    )  # fmt: skip
    for row, seen in zip(relaxed.item_index.tolist(), exclude, strict=True):
        assert not set(row) & set(seen)


def test_strict_acceptance_per_level(case: BenchModels):
    prompts = [u.prompt for u in case.eval_users]
    reference = hf_generate_items(case.target, prompts, case.trie, 5)
    itself, accepted = strict_acceptance_per_level(
        case.target, case.target, prompts, case.trie, case.layout, 5, n_draft=5
    )
    assert torch.equal(itself.tokens, reference.tokens)
    assert len(accepted) == case.layout.depth and all(all(level) for level in accepted)
    result, accepted = strict_acceptance_per_level(
        case.target, case.draft, prompts, case.trie, case.layout, 5, n_draft=5
    )
    assert torch.equal(result.tokens, reference.tokens)
    assert [len(level) for level in accepted] == [len(prompts)] * case.layout.depth
    assert not all(all(level) for level in accepted)  # a random draft disagrees somewhere
    wide = strict_acceptance_per_level(
        case.target, case.draft, prompts, case.trie, case.layout, 5, n_draft=100
    )[1]
    assert (torch.tensor(wide) >= torch.tensor(accepted)).all()  # more drafted, more accepted
