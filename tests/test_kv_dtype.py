"""Half-precision prefix caches (``refresh.kv_dtype``): the top-K they give vs float32.

Random ``small`` models over an ML-100K-shaped catalog (``bench_models``), 64 users of
169-token prompts, the newest 2 items as the suffix: float32 caches vs the same caches
cast as the refresh casts them (``cast_prefix_kvs``), written and read back through the
decoder's safetensors files, decoded by the float32 model (the slot cache casts each
prefix to the model's dtype as it copies it in). Measured (torch 2.15, seeds 0, 1):
top-10 overlap 1.000 for float16 and bfloat16; the same list in the same order for
100% of users with float16, 97-100% with bfloat16; largest score gap 2.4e-5 (float16),
2.0e-4 (bfloat16). The floors below leave room for other seeds and torch versions.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from genrec.app.bench.decode import bench_models
from genrec.offline.refresh import cast_prefix_kvs
from genrec.online.decoding.engine import batched_beam_search
from genrec.online.decoding.prefix_kv import (
    PrefixBatch,
    compute_prefix_kv,
    load_prefix_kv,
    save_prefix_kv,
)

K = 10
FLOORS = {"float16": (0.98, 0.95), "bfloat16": (0.95, 0.85)}  # (top-K overlap, same list)


@pytest.fixture(scope="module")
def float32_case():
    torch.set_num_threads(2)
    models = bench_models("small", n_users=64, seed=0)
    depth = models.layout.depth
    prefixes = [u.prompt[: len(u.prompt) - u.suffix_items * depth] for u in models.eval_users]
    suffixes = [u.prompt[len(p) :] for u, p in zip(models.eval_users, prefixes, strict=True)]
    caches = compute_prefix_kv(models.target, prefixes, "v1")
    reference = batched_beam_search(
        models.target, PrefixBatch(caches, suffixes), models.trie, models.layout, K
    )
    return models, caches, suffixes, reference


def overlap_and_same(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """Mean share of the top-K items in common, and the share of identical lists."""
    rows_a, rows_b = a.tolist(), b.tolist()
    common = sum(len(set(x) & set(y)) for x, y in zip(rows_a, rows_b, strict=True))
    same = sum(x == y for x, y in zip(rows_a, rows_b, strict=True))
    return common / (K * len(rows_a)), same / len(rows_a)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_caches_keep_the_top_k(float32_case, dtype: str, tmp_path: Path) -> None:
    models, caches, suffixes, reference = float32_case
    loaded = []
    for n, cache in enumerate(cast_prefix_kvs(caches, dtype)):
        save_prefix_kv(tmp_path / f"u{n}.safetensors", cache)
        loaded.append(load_prefix_kv(tmp_path / f"u{n}.safetensors", "v1"))
    assert {t.dtype for c in loaded for t in c.keys + c.values} == {getattr(torch, dtype)}
    result = batched_beam_search(
        models.target, PrefixBatch(loaded, suffixes), models.trie, models.layout, K
    )
    overlap, same = overlap_and_same(reference.item_index, result.item_index)
    min_overlap, min_same = FLOORS[dtype]
    assert overlap >= min_overlap and same >= min_same, (dtype, overlap, same)
    assert (result.item_index >= 0).all()


def test_float16_refuses_a_cache_it_cannot_hold(float32_case) -> None:
    _models, caches, _suffixes, _reference = float32_case
    big = caches[1].to("cpu")
    big.values[0][0, 0, 0] = 1e5  # beyond float16's largest, 65504
    cast = cast_prefix_kvs([caches[0], big], "float16")
    assert cast[0] is not None and cast[1] is None
    assert cast_prefix_kvs([big], "bfloat16")[0] is not None  # bfloat16 has float32's range
    assert cast_prefix_kvs([caches[0]], "float32")[0] is caches[0]  # nothing to do
