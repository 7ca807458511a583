"""Prefix KV: cache + suffix prefill == full prefill; safetensors round trip; version check."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from genrec.app.bench.decode import BenchModels, load_models
from genrec.online.decoding.engine import batched_beam_search, batched_speculative_beam_search
from genrec.online.decoding.prefix_kv import (
    ModelVersionMismatch,
    PrefixBatch,
    cache_argument,
    compute_prefix_kv,
    load_prefix_kv,
    output_cache,
    save_prefix_kv,
)
from tests.helpers import DECODING_PRESETS, split_prompts


@pytest.fixture(scope="module", params=DECODING_PRESETS)
def case(request) -> BenchModels:
    torch.set_num_threads(2)
    return load_models(request.param)


def test_cached_prefix_plus_suffix_gives_the_same_next_token_logits(case: BenchModels):
    prefixes, suffixes, full = split_prompts(case)
    cached = compute_prefix_kv(case.target, prefixes, "v1", batch_size=3)
    for prefix_kv, suffix, prompt in zip(cached, suffixes, full, strict=True):
        assert prefix_kv.length == len(prefix_kv.prompt_ids) - 1
        expected = case.target(torch.tensor([prompt])).logits[0, -1]
        layers = [(k[None], v[None]) for k, v in zip(prefix_kv.keys, prefix_kv.values, strict=True)]
        cache = DynamicCache(ddp_cache_data=layers, config=case.target.config)
        tail = prefix_kv.prompt_ids[-1:] + suffix
        positions = torch.arange(prefix_kv.length, prefix_kv.length + len(tail))[None]
        cache_kwarg = {cache_argument(type(case.target)): cache}  # either transformers 5.x name
        got = case.target(torch.tensor([tail]), position_ids=positions, **cache_kwarg).logits[0, -1]
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("k", [1, 5, 10])
def test_batched_prefix_caches_of_different_lengths_give_the_same_top_k(case: BenchModels, k: int):
    prefixes, suffixes, full = split_prompts(case)
    assert len({len(p) for p in prefixes}) > 1
    batch = PrefixBatch(compute_prefix_kv(case.target, prefixes, "v1"), suffixes)
    reference = batched_beam_search(case.target, full, case.trie, case.layout, k)
    result = batched_beam_search(case.target, batch, case.trie, case.layout, k)
    assert torch.equal(result.tokens, reference.tokens)
    torch.testing.assert_close(result.scores, reference.scores)
    assert (result.item_index >= 0).all()
    empty_suffix = PrefixBatch(compute_prefix_kv(case.target, full, "v1"))
    assert torch.equal(
        batched_beam_search(case.target, empty_suffix, case.trie, case.layout, k).tokens,
        reference.tokens,
    )


def test_speculative_from_prefix_caches_is_lossless(case: BenchModels):
    prefixes, suffixes, full = split_prompts(case)
    reference = batched_beam_search(case.target, full, case.trie, case.layout, 10)
    target_batch = PrefixBatch(compute_prefix_kv(case.target, prefixes, "v1"), suffixes)
    draft_batch = PrefixBatch(compute_prefix_kv(case.draft, prefixes, "d1"), suffixes)
    for prompts in ((target_batch, draft_batch), target_batch):
        result = batched_speculative_beam_search(
            case.target, case.draft, prompts, case.trie, case.layout, 10
        )
        assert torch.equal(result.tokens, reference.tokens)


def test_safetensors_round_trip_and_version_check(case: BenchModels, tmp_path):
    prefixes, suffixes, _ = split_prompts(case, slice(0, 2))
    cached = compute_prefix_kv(case.target, prefixes, "v7")
    paths = [tmp_path / f"user{i}.safetensors" for i in range(2)]
    for path, prefix_kv in zip(paths, cached, strict=True):
        save_prefix_kv(path, prefix_kv)
    loaded = [load_prefix_kv(path, "v7") for path in paths]
    for a, b in zip(cached, loaded, strict=True):
        assert a.prompt_ids == b.prompt_ids and b.model_version == "v7"
        for x, y in zip(a.keys + a.values, b.keys + b.values, strict=True):
            assert torch.equal(x, y)
    with pytest.raises(ModelVersionMismatch, match="v7.*v8"):
        load_prefix_kv(paths[0], "v8")
    other = compute_prefix_kv(case.target, prefixes[:1], "v8")
    with pytest.raises(ModelVersionMismatch):
        PrefixBatch([loaded[0], other[0]], [[], []])
    (tmp_path / "junk.safetensors").write_bytes(b"not a file")
    with pytest.raises(Exception):  # noqa: B017 - any loader error is fine, never a silent load
        load_prefix_kv(tmp_path / "junk.safetensors", "v7")


def test_a_bos_only_prompt_has_an_empty_cache(case: BenchModels):
    (prefix_kv,) = compute_prefix_kv(case.target, [[case.layout.bos_token_id]], "v1")
    assert prefix_kv.length == 0 and all(k.shape[1] == 0 for k in prefix_kv.keys)
    user = case.eval_users[0]
    batch = PrefixBatch([prefix_kv], [user.prompt[1:]])
    reference = batched_beam_search(case.target, [user.prompt], case.trie, case.layout, 5)
    assert torch.equal(
        batched_beam_search(case.target, batch, case.trie, case.layout, 5).tokens, reference.tokens
    )


def test_the_cache_keyword_follows_the_installed_transformers():
    """transformers 5.17 takes ``past_key_values``, 5.24 ``cache``: an unknown keyword would be
    swallowed by ``**kwargs`` and the model would silently run without its cache."""

    class Old:
        def forward(self, input_ids, past_key_values=None, **kwargs): ...

    class New:
        def forward(self, input_ids, cache=None, **kwargs): ...

    assert cache_argument(Old) == "past_key_values"
    assert cache_argument(New) == "cache"
    marker = object()

    class OldOutput:
        past_key_values = marker

    class NewOutput:
        cache = marker

        @property
        def past_key_values(self):  # deprecated alias in newer transformers: never read
            raise AssertionError("read the deprecated name")

    assert output_cache(OldOutput()) is marker and output_cache(NewOutput()) is marker
    NewOutput.cache = None  # a forward without a cache
    assert output_cache(NewOutput()) is None
