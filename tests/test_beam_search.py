"""The batched engine's target-only search == transformers' generate, batched and unbatched,
under the same constraint (trie, seen items, composed exclusions)."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessorList

from genrec.app.bench.decode import BenchModels, hf_generate_items, load_models
from genrec.online.decoding.constraints import ItemConstraint, SeenItems, TrieLogitsProcessor
from genrec.online.decoding.engine import BatchedDecode, batched_beam_search
from genrec.online.decoding.trie import ItemTrie
from genrec.online.decoding.trie_tables import DeadNodes, TrieTables
from tests.helpers import DECODING_PRESETS

BEAM_WIDTHS = [1, 3, 5, 10, 20]


@pytest.fixture(scope="module", params=DECODING_PRESETS)
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
    batched = batched_beam_search(
        case.target, prompts, case.trie, case.layout, k, score_mode=score_mode
    )
    assert torch.equal(batched.tokens, expected)
    for row, prompt in enumerate(prompts):
        alone = batched_beam_search(
            case.target, [prompt], case.trie, case.layout, k, score_mode=score_mode
        )
        assert torch.equal(alone.tokens[0], expected[row])
        torch.testing.assert_close(alone.scores[0], batched.scores[row])


def test_results_are_valid_items_best_first(case: BenchModels):
    prompts = [u.prompt for u in case.eval_users]
    result = batched_beam_search(case.target, prompts, case.trie, case.layout, 10)
    assert result.tokens.shape == (len(prompts), 10, case.layout.depth)
    assert (result.item_index >= 0).all()
    assert torch.equal(case.trie.item_tokens[result.item_index], result.tokens)
    assert (result.scores[:, :-1] >= result.scores[:, 1:]).all()
    for row in result.item_index:  # K distinct items per user
        assert len(set(row.tolist())) == 10


def test_decided_items_cost_no_call(case: BenchModels):
    prompts = [u.prompt for u in case.eval_users[:3]]
    allowed = batched_beam_search(case.target, prompts, case.trie, case.layout, 5)
    full = batched_beam_search(case.target, prompts, case.trie, case.layout, 5, score_mode="full")
    for fast, slow in zip(allowed.stats, full.stats, strict=True):
        assert slow.target_calls == case.layout.depth and slow.forced_steps == 0
        assert fast.target_calls + fast.forced_steps == case.layout.depth
    assert sum(s.forced_steps for s in allowed.stats) > 0  # the dedup level is forced


def test_tiny_catalog_pads_missing_beams():
    case = load_models("tiny")
    few = case.trie.item_tokens[:3]
    trie = ItemTrie(few, case.layout)
    result = batched_beam_search(case.target, [case.eval_users[0].prompt], trie, case.layout, 5)
    assert sorted(result.item_index[0, :3].tolist()) == [0, 1, 2]
    assert result.item_index[0, 3:].tolist() == [-1, -1]
    assert torch.isinf(result.scores[0, 3:]).all()


def test_bad_input_is_refused(case: BenchModels):
    with pytest.raises(ValueError):
        batched_beam_search(case.target, [[]], case.trie, case.layout, 3)
    with pytest.raises(ValueError):
        batched_beam_search(case.target, [[1]], case.trie, case.layout, 0)
    with pytest.raises(ValueError):
        batched_beam_search(case.target, [[1]], case.trie, case.layout, 3, score_mode="bogus")


def test_dead_nodes_are_the_subtrees_of_excluded_items_only(case):
    trie = case.trie
    tables = TrieTables.of(trie)
    rows = torch.arange(0, trie.n_items, 3)
    dead = SeenItems(trie, [rows.tolist()]).dead_nodes().dense()[0]
    assert torch.equal(dead[tables.item_offset : tables.sink].nonzero()[:, 0], rows)
    excluded = set(rows.tolist())
    for d in range(1, case.layout.depth):
        for node in tables.item_nodes[:, d].unique().tolist():
            below = (tables.item_nodes[:, d].long() == node).nonzero()[:, 0].tolist()
            assert bool(dead[node]) == (set(below) <= excluded)


def generate_items(case, prompts: list[list[int]], k: int, processor) -> torch.Tensor:
    """Tokens [B, k, depth] of ``generate(num_beams=k)`` under ``processor(prompt_width)``."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), case.layout.pad_token_id, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
    out = case.target.generate(
        ids, attention_mask=(ids != case.layout.pad_token_id).long(), num_beams=k,
        num_return_sequences=k, max_new_tokens=case.layout.depth, do_sample=False,
        logits_processor=LogitsProcessorList([processor(width)]),
        pad_token_id=case.layout.pad_token_id, eos_token_id=case.layout.eos_token_id,
    )  # fmt: skip
    return out[:, width : width + case.layout.depth].reshape(len(prompts), k, -1)


@pytest.mark.parametrize("k", [3, 10])
def test_excluded_items_are_masked_like_generate_with_a_masking_processor(case, k: int):
    prompts = [u.prompt for u in case.eval_users[:4]]
    plain = batched_beam_search(case.target, prompts, case.trie, case.layout, k)
    # exclude some of each user's would-be top items (and one user nothing)
    exclude = [row[::2].tolist() for row in plain.item_index[:3]] + [[]]
    result = batched_beam_search(case.target, prompts, case.trie, case.layout, k, exclude=exclude)
    assert (result.item_index >= 0).all()  # K beams still give K unseen items
    for row, seen in zip(result.item_index.tolist(), exclude, strict=True):
        assert not set(row) & set(seen)
    assert torch.equal(result.tokens[3], plain.tokens[3])
    expected = generate_items(
        case, prompts, k,
        lambda width: TrieLogitsProcessor(case.trie, width, exclude=exclude, num_beams=k),
    )  # fmt: skip
    assert torch.equal(result.tokens, expected)
    # the items both lists hold keep their scores
    for row in range(len(prompts)):
        for item, score in zip(result.item_index[row], result.scores[row], strict=True):
            same = (plain.item_index[row] == item).nonzero()
            if len(same):
                torch.testing.assert_close(score, plain.scores[row, same[0, 0]])


class BannedFirstCode:
    """An exclusion of another kind: no item whose first code is ``code``."""

    def __init__(self, code: int, tables: TrieTables, n_users: int) -> None:
        self.code = code
        node = tables.child_of(torch.zeros(n_users, dtype=torch.long), torch.full((n_users,), code))
        # the engine's view: that level-1 node, for every user
        self.dead = DeadNodes.of_pairs(torch.arange(n_users), node, n_users, tables.n_nodes)

    def applies(self, level: int, user: int) -> bool:
        return level == 0

    def blocked(self, children: torch.Tensor, level: int, user: int) -> torch.Tensor:
        blocked = torch.zeros_like(children, dtype=torch.bool)
        blocked[:, self.code] = True
        return blocked

    def dead_nodes(self) -> DeadNodes:
        return self.dead


def test_composed_constraint_is_the_same_in_our_search_and_in_generate(case):
    k = 5
    prompts = [u.prompt for u in case.eval_users[:3]]
    plain = batched_beam_search(case.target, prompts, case.trie, case.layout, k)
    banned = int(plain.tokens[0, 0, 0]) - case.layout.level_start(0)
    exclude = [row[:2].tolist() for row in plain.item_index]
    seen = ItemConstraint.for_users(case.trie, exclude, len(prompts))
    tables = TrieTables.of(case.trie)
    constraint = seen.excluding(BannedFirstCode(banned, tables, len(prompts)))
    result = BatchedDecode(case.target, prompts, tables, k, constraint=constraint).run()
    assert (result.item_index >= 0).all()
    assert (result.tokens[:, :, 0] != case.layout.level_start(0) + banned).all()
    for row, rows_seen in zip(result.item_index.tolist(), exclude, strict=True):
        assert not set(row) & set(rows_seen)
    expected = generate_items(
        case, prompts, k,
        lambda width: TrieLogitsProcessor.for_constraint(constraint, width, num_beams=k),
    )  # fmt: skip
    assert torch.equal(result.tokens, expected)


def test_exclude_must_match_the_users(case):
    with pytest.raises(ValueError, match="exclude"):
        batched_beam_search(
            case.target, [case.eval_users[0].prompt], case.trie, case.layout, 3, exclude=[]
        )
