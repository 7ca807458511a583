"""The batched engine: target-only == strict == transformers generate, item for item.

Random tiny Llama models (float64, so that two orders of summation cannot reorder
near-tied items) over a random catalog; batched and one user at a time; full
prompts and cached prefixes with ragged suffixes; seen-item exclusion; the
relaxed rule; and the engine's defining property: a decode costs the same
number of tensor operations whatever the batch size.
"""

from __future__ import annotations

import pytest
import torch
from torch.profiler import profile
from transformers import LlamaConfig, LlamaForCausalLM

from genrec.app.bench.decode import hf_generate_items
from genrec.online.decoding import slot_cache
from genrec.online.decoding.constraints import ItemConstraint, SeenItems
from genrec.online.decoding.engine import batched_beam_search, batched_speculative_beam_search
from genrec.online.decoding.prefix_kv import PrefixBatch, compute_prefix_kv
from genrec.online.decoding.slot_cache import pending_chunks
from genrec.online.decoding.trie import ItemTrie
from genrec.online.decoding.trie_tables import TrieTables
from genrec.online.models.item_vectors import attach_item_vectors
from genrec.schemas.token_layout import TokenLayout

BEAM_WIDTHS = [1, 3, 5, 10, 20]
CODES = (12, 6, 6, 3)


def tiny_llama(layout: TokenLayout, layers: int, hidden: int, seed: int, dtype=torch.float64):
    config = LlamaConfig(
        vocab_size=layout.vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
        max_position_embeddings=256, pad_token_id=layout.pad_token_id,
        bos_token_id=layout.bos_token_id, eos_token_id=layout.eos_token_id,
        initializer_range=0.2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(dtype).eval()


class Case:
    """A random catalog, a target, a draft, and ragged users."""

    def __init__(self, seed: int = 0, n_items: int = 160, n_users: int = 6) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.layout = TokenLayout.for_scratch_model(CODES)
        codes = torch.stack(
            [torch.randint(0, c, (4 * n_items,), generator=generator) for c in CODES], 1
        )
        codes = torch.unique(codes, dim=0)
        codes = codes[torch.randperm(len(codes), generator=generator)[:n_items]]
        self.items = torch.tensor(self.layout.encode(codes.tolist()))
        self.trie = ItemTrie(self.items, self.layout)
        self.target = tiny_llama(self.layout, 2, 32, seed + 1)
        self.draft = tiny_llama(self.layout, 1, 16, seed + 2)
        lengths = torch.randint(1, 8, (n_users,), generator=generator).tolist()
        rows = [torch.randint(0, n_items, (n,), generator=generator) for n in lengths]
        self.prompts = [[self.layout.bos_token_id] + self.items[r].flatten().tolist() for r in rows]

    def prefix_batch(self, model, version: str) -> PrefixBatch:
        """The users' prompts as cached prefixes plus suffixes of 0, 1 or 2 items (ragged)."""
        depth = self.layout.depth
        cuts = [
            len(p) - min(i % 3, (len(p) - 1) // depth) * depth for i, p in enumerate(self.prompts)
        ]
        prefixes = compute_prefix_kv(
            model, [p[:c] for p, c in zip(self.prompts, cuts, strict=True)], version
        )
        return PrefixBatch(prefixes, [p[c:] for p, c in zip(self.prompts, cuts, strict=True)])


@pytest.fixture(scope="module")
def case() -> Case:
    torch.set_num_threads(2)
    return Case()


def assert_same(result, reference, atol: float = 1e-9) -> None:
    """Same items in the same order; the same scores where ``reference`` has them (generate's
    output here does not)."""
    assert torch.equal(result.tokens, reference.tokens)
    assert torch.equal(result.item_index, reference.item_index)
    if getattr(reference, "scores", None) is not None:
        torch.testing.assert_close(result.scores, reference.scores, atol=atol, rtol=0)


def generated(model, prompts, trie: ItemTrie, k: int, score_mode: str = "allowed", exclude=None):
    """The reference: transformers' ``generate`` under the same constraint (TrieLogitsProcessor)."""
    renormalize = score_mode == "allowed"
    return hf_generate_items(model, prompts, trie, k, renormalize=renormalize, exclude=exclude)


@pytest.mark.parametrize("k", BEAM_WIDTHS)
def test_target_only_equals_generate_batched_and_alone(case: Case, k: int):
    reference = generated(case.target, case.prompts, case.trie, k)
    batched = batched_beam_search(case.target, case.prompts, case.trie, case.layout, k)
    assert_same(batched, reference)
    for row, prompt in enumerate(case.prompts[:3]):
        alone = batched_beam_search(case.target, [prompt], case.trie, case.layout, k)
        assert torch.equal(alone.tokens[0], reference.tokens[row])
        torch.testing.assert_close(alone.scores[0], batched.scores[row], atol=1e-9, rtol=0)
    assert all(s.target_calls + s.forced_steps == case.layout.depth for s in batched.stats)
    assert not any(s.speculative for s in batched.stats)
    every_level = batched_beam_search(
        case.target, case.prompts, case.trie, case.layout, k, stop_early=False
    )
    assert_same(every_level, reference)
    assert all(s.target_calls == case.layout.depth for s in every_level.stats)


@pytest.mark.parametrize("k", BEAM_WIDTHS)
def test_strict_equals_target_only_and_generate_for_any_draft(case: Case, k: int):
    reference = generated(case.target, case.prompts, case.trie, k)
    target_only = batched_beam_search(case.target, case.prompts, case.trie, case.layout, k)
    for draft in (case.draft, case.target):
        batched = batched_speculative_beam_search(
            case.target, draft, case.prompts, case.trie, case.layout, k
        )
        assert_same(batched, reference)
        assert torch.equal(batched.item_index, target_only.item_index)
        torch.testing.assert_close(batched.scores, target_only.scores, atol=1e-9, rtol=0)
        alone = batched_speculative_beam_search(
            case.target, draft, case.prompts[1:2], case.trie, case.layout, k, n_draft=max(k, 7)
        )
        assert torch.equal(alone.tokens[0], reference.tokens[1])


@pytest.mark.parametrize("k", [3, 10])
def test_full_vocabulary_scores_equal_generate_too(case: Case, k: int):
    reference = generated(case.target, case.prompts, case.trie, k, score_mode="full")
    target_only = batched_beam_search(
        case.target, case.prompts, case.trie, case.layout, k, score_mode="full"
    )
    strict = batched_speculative_beam_search(
        case.target, case.draft, case.prompts, case.trie, case.layout, k, score_mode="full"
    )
    assert_same(target_only, reference)
    assert_same(strict, reference)


@pytest.mark.parametrize("k", [1, 10])
def test_cached_prefixes_with_ragged_suffixes_equal_full_prompts(case: Case, k: int):
    target_batch = case.prefix_batch(case.target, "t")
    draft_batch = case.prefix_batch(case.draft, "d")
    reference = generated(case.target, case.prompts, case.trie, k)
    full = batched_beam_search(case.target, case.prompts, case.trie, case.layout, k)
    assert_same(full, reference)
    assert_same(batched_beam_search(case.target, target_batch, case.trie, case.layout, k), full)
    both = (target_batch, draft_batch)
    for prompts in (both, target_batch):  # the draft from its own prefixes, or from full prompts
        strict = batched_speculative_beam_search(
            case.target, case.draft, prompts, case.trie, case.layout, k
        )
        assert_same(strict, full)


@pytest.mark.parametrize("k", [3, 10])
def test_seen_items_are_masked_as_generate_with_a_masking_processor(case: Case, k: int):
    plain = batched_beam_search(case.target, case.prompts, case.trie, case.layout, k)
    exclude = [row[::2].tolist() for row in plain.item_index[:-1]] + [[]]
    # and one whole subtree: every item under the first user's best first code
    first = plain.tokens[0, 0, 0]
    exclude[0] += (case.items[:, 0] == first).nonzero()[:, 0].tolist()
    reference = generated(case.target, case.prompts, case.trie, k, exclude=exclude)
    ours = batched_beam_search(
        case.target, case.prompts, case.trie, case.layout, k, exclude=exclude
    )
    assert_same(ours, reference)
    strict = batched_speculative_beam_search(
        case.target, case.draft, case.prompts, case.trie, case.layout, k, exclude=exclude
    )
    assert_same(strict, ours)
    for row, seen in zip(ours.item_index.tolist(), exclude, strict=True):
        assert not set(row) & set(seen)


def test_dead_nodes_are_the_nodes_whose_items_are_all_excluded(case: Case):
    tables = TrieTables.of(case.trie)
    rows = [torch.arange(0, case.trie.n_items, 3).tolist(), [], [5]]
    dead = tables.dead_nodes(rows).dense()
    for user, user_rows in enumerate(rows):
        excluded = torch.zeros(case.trie.n_items, dtype=torch.bool)
        excluded[user_rows] = True
        expected = torch.zeros(tables.sink + 1, dtype=torch.bool)
        for d in range(1, case.layout.depth + 1):  # a node is dead when no item below is allowed
            nodes = tables.item_nodes[:, d].long()
            alive = torch.zeros_like(expected).index_put_((nodes,), ~excluded, accumulate=True)
            expected[nodes.unique()] = ~alive[nodes.unique()]
        assert torch.equal(dead[user], expected)
    assert tables.dead_nodes([[], []]) is None
    with pytest.raises(ValueError, match="item rows"):
        tables.dead_nodes([[case.trie.n_items]])


def test_generate_s_processor_reads_the_engine_s_dead_node_table(case: Case):
    rows = [torch.arange(0, case.trie.n_items, 3).tolist(), [5]]
    seen = SeenItems(case.trie, rows)
    tables = TrieTables.of(case.trie)
    assert torch.equal(seen.dead_nodes().keys, tables.dead_nodes(rows).keys)
    constraint = ItemConstraint.for_users(case.trie, rows, 2)
    for user in range(2):
        for d in range(case.layout.depth):
            prefixes = case.items[:, :d].unique(dim=0) if d else case.items[:1, :0]
            _, blocked = constraint.masks(prefixes, user)
            children = case.trie.child_nodes(prefixes)
            global_children = torch.where(
                children >= 0, tables.offsets[d + 1] + children, tables.sink
            )
            expected = seen.dead.dense()[user][global_children] & (children >= 0)
            if blocked is None:  # nothing excluded at this level
                assert not expected.any()
            else:
                assert torch.equal(blocked, expected)


def test_acceptance_is_full_with_the_target_as_its_own_draft(case: Case):
    depth = case.layout.depth
    itself = batched_speculative_beam_search(
        case.target, case.target, case.prompts, case.trie, case.layout, 10
    )
    for stats in itself.stats:
        assert stats.speculative and stats.target_calls == stats.rounds == 1
        assert stats.accepted_steps == stats.drafted_steps == stats.draft_calls == depth - 1
    other = batched_speculative_beam_search(
        case.target, case.draft, case.prompts, case.trie, case.layout, 10
    )
    assert sum(s.accepted_steps for s in other.stats) < sum(s.drafted_steps for s in other.stats)
    assert all(1 <= s.target_calls == s.rounds <= depth for s in other.stats)


@pytest.mark.parametrize("k", [1, 5, 20])
def test_relaxed_gives_valid_distinct_seeded_items(case: Case, k: int):
    def run(draft, seed: int):
        return batched_speculative_beam_search(
            case.target, draft, case.prompts, case.trie, case.layout, k, mode="relaxed",
            generator=torch.Generator().manual_seed(seed),
        )  # fmt: skip

    first, again = run(case.draft, 7), run(case.draft, 7)
    assert torch.equal(first.tokens, again.tokens)
    assert (first.item_index >= 0).all()
    assert torch.equal(case.items[first.item_index], first.tokens)
    assert all(len(set(row.tolist())) == k for row in first.item_index)
    assert (first.scores[:, :-1] >= first.scores[:, 1:]).all()
    # with the target as its own draft, p == q: every drafted node is accepted
    assert_same(run(case.target, 0), generated(case.target, case.prompts, case.trie, k))


def test_tiny_catalog_pads_missing_beams(case: Case):
    trie = ItemTrie(case.items[:3], case.layout)
    for result in (
        batched_beam_search(case.target, case.prompts[:2], trie, case.layout, 5),
        batched_speculative_beam_search(
            case.target, case.draft, case.prompts[:2], trie, case.layout, 5
        ),
    ):
        for row in range(2):
            assert sorted(result.item_index[row, :3].tolist()) == [0, 1, 2]
            assert result.item_index[row, 3:].tolist() == [-1, -1]
            assert torch.isinf(result.scores[row, 3:]).all()
            assert (result.tokens[row, 3:] == case.layout.pad_token_id).all()


def test_item_vector_target_from_prefixes_equals_generate():
    case = Case(seed=3, n_users=4)
    attach_item_vectors(
        case.target, case.trie, torch.randn(case.trie.n_items, 8, dtype=torch.float64)
    )
    batch = case.prefix_batch(case.target, "t")
    reference = generated(case.target, case.prompts, case.trie, 5)
    for prompts in (batch, case.prompts):
        assert_same(batched_beam_search(case.target, prompts, case.trie, case.layout, 5), reference)


def test_float32_models_agree_to_1e_5():
    case = Case(seed=5, n_users=5)
    case.target, case.draft = case.target.float(), case.draft.float()
    reference = generated(case.target, case.prompts, case.trie, 10)
    for result in (
        batched_beam_search(case.target, case.prompts, case.trie, case.layout, 10),
        batched_speculative_beam_search(
            case.target, case.draft, case.prompts, case.trie, case.layout, 10
        ),
    ):
        assert result.scores.dtype == torch.float32
        assert_same(result, reference)


def test_bad_input_is_refused(case: Case):
    with pytest.raises(ValueError):
        batched_beam_search(case.target, [[]], case.trie, case.layout, 3)
    with pytest.raises(ValueError):
        batched_beam_search(case.target, [[1]], case.trie, case.layout, 0)
    with pytest.raises(ValueError, match="score_mode"):
        batched_beam_search(case.target, [[1]], case.trie, case.layout, 3, score_mode="bogus")
    with pytest.raises(ValueError, match="exclude"):
        batched_beam_search(case.target, [[1]], case.trie, case.layout, 3, exclude=[[], []])
    with pytest.raises(ValueError, match="n_draft"):
        batched_speculative_beam_search(
            case.target, case.draft, [[1]], case.trie, case.layout, 5, n_draft=4
        )
    with pytest.raises(ValueError, match="mode"):
        batched_speculative_beam_search(
            case.target, case.draft, [[1]], case.trie, case.layout, 3, mode="x"
        )


def operations(decode, prompts) -> int:
    """Tensor operations ``decode(prompts)`` dispatches (not those that operations run
    inside: how torch carries out one may depend on sizes)."""
    with profile() as recorded:
        decode(prompts)
    return sum(
        1
        for event in recorded.events()
        if event.name.startswith("aten::")
        and (event.cpu_parent is None or not event.cpu_parent.name.startswith("aten::"))
    )


def test_a_decode_costs_the_same_operations_whatever_the_batch_size(case: Case, monkeypatch):
    # one prefill call for all (ranges of similar suffix length would add a call per range:
    # their number follows the spread of lengths, not the batch size)
    monkeypatch.setattr(slot_cache, "PENDING_CALL_TOKENS", 10**9)
    few, many = case.prompts[:2], case.prompts * 3
    for decode in (
        lambda prompts: batched_beam_search(
            case.target, prompts, case.trie, case.layout, 10, stop_early=False
        ),
        # the target as its own draft: every user takes one round, whatever the batch
        lambda prompts: batched_speculative_beam_search(
            case.target, case.target, prompts, case.trie, case.layout, 10
        ),
    ):
        decode(few), decode(many)  # the trie's tables, and KV storage that fits both, exist
        assert operations(decode, few) == operations(decode, many)


def test_pending_chunks_split_only_where_padding_costs_more_than_a_call():
    assert pending_chunks([4] * 64, call_tokens=256) == [(0, 64, 4)]
    assert pending_chunks([4] * 10 + [150], call_tokens=256) == [(0, 10, 4), (10, 11, 150)]
    # an outlier in the middle of unsorted rows gets a range of its own
    assert pending_chunks([5] * 20 + [200] + [5] * 20, call_tokens=64) == [
        (0, 20, 5), (20, 21, 200), (21, 41, 5)
    ]  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):  # the cost is the least of every split into ranges (brute force)
        lengths = torch.randint(1, 60, (7,), generator=generator).tolist()
        cost = lambda chunks: sum(30 + (b - a) * w for a, b, w in chunks)  # noqa: E731
        best = min(cost(_ranges(lengths, mask)) for mask in range(2 ** (len(lengths) - 1)))
        chunks = pending_chunks(lengths, call_tokens=30)
        assert cost(chunks) == best
        assert [a for a, _, _ in chunks][1:] == [b for _, b, _ in chunks][:-1]


def _ranges(lengths: list[int], cuts: int) -> list[tuple[int, int, int]]:
    """The split of ``lengths`` with a cut after row i where bit i of ``cuts`` is set."""
    ranges, first = [], 0
    for i in range(len(lengths)):
        if i == len(lengths) - 1 or cuts >> i & 1:
            ranges.append((first, i + 1, max(lengths[first : i + 1])))
            first = i + 1
    return ranges


@pytest.mark.parametrize("vectors", [False, True])
def test_prefill_in_length_ranges_equals_one_padded_call(monkeypatch, vectors: bool):
    """Long and short suffixes (and full prompts) prefilled range by range give the items and
    scores of one call padded to the longest, target-only and strict."""
    case = Case(seed=7, n_users=8)
    if vectors:
        attach_item_vectors(
            case.target, case.trie, torch.randn(case.trie.n_items, 8, dtype=torch.float64)
        )
    generator = torch.Generator().manual_seed(1)
    extra = [torch.randint(0, case.trie.n_items, (12 * (i % 4 == 1),), generator=generator)
             for i in range(len(case.prompts))]  # fmt: skip
    prompts = [
        p + case.items[r].flatten().tolist() for p, r in zip(case.prompts, extra, strict=True)
    ]
    prefixes = compute_prefix_kv(case.target, case.prompts, "t")
    draft_prefixes = compute_prefix_kv(case.draft, case.prompts, "d")
    suffixes = [p[len(q) :] for p, q in zip(prompts, case.prompts, strict=True)]
    assert {len(s) for s in suffixes} == {0, 12 * case.layout.depth}

    def decode_all():
        batch = PrefixBatch(prefixes, suffixes)
        both = (batch, PrefixBatch(draft_prefixes, suffixes))
        return [
            batched_beam_search(case.target, batch, case.trie, case.layout, 5),
            batched_beam_search(case.target, prompts, case.trie, case.layout, 5),
            batched_speculative_beam_search(
                case.target, case.draft, both, case.trie, case.layout, 5, n_draft=8
            ),
        ]

    monkeypatch.setattr(slot_cache, "PENDING_CALL_TOKENS", 10**9)  # one call
    padded = decode_all()
    monkeypatch.setattr(slot_cache, "PENDING_CALL_TOKENS", 1)  # a range per length change
    assert len(pending_chunks([len(s) + 1 for s in suffixes])) > 2
    for chunked, reference in zip(decode_all(), padded, strict=True):
        assert_same(chunked, reference, atol=1e-9)
    # KV storage reused from an earlier decode holds anything, inf and NaN included: the
    # slots a narrower range never writes must not reach the scores (they did: 0 x inf)
    monkeypatch.setattr(slot_cache, "BUFFERS", PoisonedBuffers())
    for chunked, reference in zip(decode_all(), padded, strict=True):
        assert_same(chunked, reference, atol=1e-9)


class PoisonedBuffers(slot_cache.Buffers):
    """Storage whose every element is NaN or inf when taken (what reuse may hand out)."""

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buffer = torch.full((numel,), float("nan"), dtype=dtype, device=device)
        buffer[::2] = float("inf")
        return buffer


@pytest.mark.parametrize("vectors", [False, True])
def test_a_kept_prompt_kv_serves_the_next_request_as_its_prefix(vectors: bool):
    """The prompt KV a decode keeps, used as the prefix of a longer prompt, gives that
    prompt's full-prompt items and scores (target-only and strict, the draft's kept too)."""
    case = Case(seed=11, n_users=5)
    if vectors:
        attach_item_vectors(
            case.target, case.trie, torch.randn(case.trie.n_items, 8, dtype=torch.float64)
        )
    first = batched_speculative_beam_search(
        case.target, case.draft, case.prompts, case.trie, case.layout, 5, n_draft=8,
        keep_prompt_kv=True,
    )  # fmt: skip
    assert [p.prompt_ids for p in first.prompt_kv] == case.prompts
    assert [p.prompt_ids for p in first.draft_prompt_kv] == case.prompts
    kept = first.prompt_kv[0]
    assert kept.keys[0].shape[1] == len(case.prompts[0]) - 1 == kept.length
    generator = torch.Generator().manual_seed(2)
    newer = [case.items[torch.randint(0, case.trie.n_items, (1 + i % 2,), generator=generator)]
             .flatten().tolist() for i in range(len(case.prompts))]  # fmt: skip
    longer = [p + n for p, n in zip(case.prompts, newer, strict=True)]
    reference = batched_beam_search(case.target, longer, case.trie, case.layout, 5)
    target_batch = PrefixBatch(first.prompt_kv, newer)
    draft_batch = PrefixBatch(first.draft_prompt_kv, newer)
    again = batched_beam_search(
        case.target, target_batch, case.trie, case.layout, 5, keep_prompt_kv=True
    )
    assert_same(again, reference)
    assert [p.prompt_ids for p in again.prompt_kv] == longer  # and it chains
    strict = batched_speculative_beam_search(
        case.target, case.draft, (target_batch, draft_batch), case.trie, case.layout, 5,
        n_draft=8,
    )  # fmt: skip
    assert_same(strict, reference)
