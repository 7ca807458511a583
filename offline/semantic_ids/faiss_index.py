"""FAISS indexes over item embeddings and codebooks (offline step: item tokenization).

- ``build_item_index``: inner product (= cosine on unit vectors) over the item
  embeddings, exact up to ``index_exact_max_items`` items and IVF above (k-means on a
  sample of 64 items a list); moved to the GPU when a GPU build of FAISS sees one. The
  ANN recall branch searches it.
- ``residual_codes``: nearest-codeword assignment level by level with exact L2
  indexes over the RQ-VAE codebooks; gives each item its codes and its ranked
  last-level candidates (used for new items on a refresh and on full builds).
- ``brute_force_topk``: the NumPy reference the benchmark compares against.

Example::

    >>> import numpy as np
    >>> vectors = np.eye(4, dtype="float32")
    >>> index = build_item_index(vectors)
    >>> index.search(vectors[:1], 2)[1][0, 0]
    0
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import faiss
import numpy as np


def gpu_available() -> bool:
    return hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0


# k-means trains on at most this many items a list (a seeded sample). FAISS's default, 256,
# means every item up to ~1M, so training cost n x nlist x dim grew as n^1.5 (nlist ~ 4 sqrt n);
# with a fixed number a list it is 64 x nlist^2 x dim, linear in n. Adding the items to their
# lists stays n x nlist x dim: the part of the build that still grows as n^1.5 (docs/scale.md).
IVF_TRAIN_POINTS_PER_LIST = 64


def build_item_index(
    vectors: np.ndarray,
    *,
    exact_max_items: int = 50_000,
    nprobe: int = 16,
    kind: str = "auto",
    train_points_per_list: int = IVF_TRAIN_POINTS_PER_LIST,
) -> faiss.Index:
    """``kind``: "flat" (exact), "ivf", or "auto" (flat up to ``exact_max_items`` items)."""
    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    n, dim = vectors.shape
    if kind == "auto":
        kind = "flat" if n <= exact_max_items else "ivf"
    if kind == "flat":
        index = faiss.IndexFlatIP(dim)
    elif kind == "ivf":
        index = untrained_ivf(n, dim, train_points_per_list)
        index.train(vectors)
        index.nprobe = min(nprobe, index.nlist)
    else:
        raise ValueError(f"unknown index kind {kind!r}: flat, ivf or auto")
    index.add(vectors)
    return index


def untrained_ivf(n: int, dim: int, train_points_per_list: int) -> faiss.IndexIVFFlat:
    """The inner-product IVF index for ``n`` items, before k-means: ~4 sqrt(n) lists, but at
    least 39 training points a list (FAISS's own minimum)."""
    nlist = max(1, min(int(4 * math.sqrt(n)), n // 39))
    index = faiss.IndexIVFFlat(faiss.IndexFlatIP(dim), dim, nlist, faiss.METRIC_INNER_PRODUCT)
    index.cp.max_points_per_centroid = train_points_per_list
    return index


def to_device(index: faiss.Index) -> faiss.Index:
    """The index on GPU 0 when a GPU FAISS build sees one, else unchanged."""
    if not gpu_available():
        return index
    return faiss.index_cpu_to_gpu(faiss.StandardGpuResources(), 0, index)


def save_index(index: faiss.Index, path: Path) -> None:
    if gpu_available() and hasattr(faiss, "index_gpu_to_cpu"):
        try:
            index = faiss.index_gpu_to_cpu(index)
        except (RuntimeError, AttributeError):
            pass  # already a CPU index
    faiss.write_index(index, str(path))


@dataclass
class ItemIndex:
    """Item embeddings searchable by inner product; rows are positions in ``item_ids``."""

    item_ids: list[str]
    index: faiss.Index

    @classmethod
    def load(cls, path: Path, item_ids: list[str]) -> ItemIndex:
        index = faiss.read_index(str(path))
        if index.ntotal != len(item_ids):
            raise ValueError(
                f"{path}: index holds {index.ntotal} vectors for {len(item_ids)} items"
            )
        return cls(item_ids, to_device(index))

    def search(self, vectors: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-k scores (float32 [n, k]) and item rows (int64 [n, k], -1 where fewer exist)."""
        queries = np.ascontiguousarray(np.atleast_2d(vectors), dtype=np.float32)
        if queries.shape[1] != self.index.d:
            raise ValueError(f"query dim {queries.shape[1]} != index dim {self.index.d}")
        return self.index.search(queries, min(k, self.index.ntotal))

    def search_item_ids(self, vectors: np.ndarray, k: int) -> list[list[str]]:
        _, rows = self.search(vectors, k)
        return [[self.item_ids[r] for r in row if r >= 0] for row in rows]


def residual_codes(
    latent: np.ndarray, codebooks: np.ndarray, k_last: int
) -> tuple[np.ndarray, np.ndarray]:
    """Nearest code per level ([n, L]) and the ``k_last`` nearest last-level codes ([n, k])."""
    residual = np.ascontiguousarray(latent, dtype=np.float32).copy()
    levels = codebooks.shape[0]
    codes = np.zeros((len(residual), levels), dtype=np.int64)
    candidates = np.zeros((len(residual), 0), dtype=np.int64)
    for level in range(levels):
        index = faiss.IndexFlatL2(codebooks.shape[2])
        index.add(np.ascontiguousarray(codebooks[level], dtype=np.float32))
        k = min(k_last, codebooks.shape[1]) if level == levels - 1 else 1
        _, nearest = index.search(residual, k)
        codes[:, level] = nearest[:, 0]
        if level == levels - 1:
            candidates = nearest.astype(np.int64)
        residual -= codebooks[level][nearest[:, 0]]
    return codes, candidates


def brute_force_topk(
    vectors: np.ndarray, queries: np.ndarray, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """Exact inner-product top-k with NumPy: matmul, argpartition, then sort the k."""
    scores = queries @ vectors.T
    k = min(k, vectors.shape[0])
    top = np.argpartition(-scores, k - 1, axis=1)[:, :k]
    top_scores = np.take_along_axis(scores, top, axis=1)
    order = np.argsort(-top_scores, axis=1, kind="stable")
    return np.take_along_axis(top_scores, order, axis=1), np.take_along_axis(top, order, axis=1)
