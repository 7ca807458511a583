"""FAISS item index and nearest-code assignment (seconds)."""

import numpy as np
import pytest

from genrec.offline.semantic_ids.faiss_index import (
    ItemIndex,
    brute_force_topk,
    build_item_index,
    residual_codes,
    save_index,
)


def unit(n, dim=32, seed=0):
    x = np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def test_exact_index_matches_numpy_brute_force():
    vectors, queries = unit(500), unit(20, seed=1)
    index = build_item_index(vectors)
    assert index.__class__.__name__ == "IndexFlatIP"
    scores, rows = index.search(queries, 10)
    exact_scores, exact_rows = brute_force_topk(vectors, queries, 10)
    assert np.array_equal(rows, exact_rows)
    assert np.allclose(scores, exact_scores, atol=1e-5)


def test_ivf_above_threshold_keeps_recall():
    vectors = unit(5000)
    index = build_item_index(vectors, exact_max_items=1000, nprobe=32)
    assert "IVF" in index.__class__.__name__
    # k-means sampled 64 items a list (128 lists: 8,192 > 5,000, so here every item)
    assert index.cp.max_points_per_centroid == 64
    queries = vectors[:50] + 0.05 * unit(50, seed=2)
    _, rows = index.search(queries, 10)
    _, exact = brute_force_topk(vectors, queries, 10)
    recall = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(rows, exact, strict=True)])
    # 32 of 128 lists on uniform random data (IVF's worst case: no cluster structure)
    assert recall >= 0.7
    assert all(rows[i, 0] == i for i in range(50))


def test_item_index_round_trip_and_errors(tmp_path):
    vectors = unit(100)
    save_index(build_item_index(vectors), tmp_path / "items.faiss")
    item_ids = [f"i{n}" for n in range(100)]
    index = ItemIndex.load(tmp_path / "items.faiss", item_ids)
    assert index.search_item_ids(vectors[7], 3)[0][0] == "i7"
    assert index.search(vectors[:2], 1000)[1].shape == (2, 100)
    with pytest.raises(ValueError, match="query dim"):
        index.search(np.zeros((1, 5), np.float32), 3)
    with pytest.raises(ValueError, match="index holds"):
        ItemIndex.load(tmp_path / "items.faiss", item_ids[:5])


def test_residual_codes_agree_with_numpy():
    rng = np.random.default_rng(0)
    codebooks = rng.standard_normal((3, 16, 4)).astype(np.float32)
    latent = rng.standard_normal((40, 4)).astype(np.float32)
    codes, candidates = residual_codes(latent, codebooks, k_last=5)
    residual = latent.copy()
    for level in range(3):
        distances = ((residual[:, None, :] - codebooks[level][None]) ** 2).sum(-1)
        assert np.array_equal(codes[:, level], distances.argmin(1))
        residual -= codebooks[level][codes[:, level]]
    assert candidates.shape == (40, 5)
    assert np.array_equal(candidates[:, 0], codes[:, 2])
