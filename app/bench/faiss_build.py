"""The IVF item index's build, side by side for several k-means training samples (benchmark).

Issue #19: above ``semantic_ids.index_exact_max_items`` items the item index is IVF with
~4 sqrt(n) lists, and FAISS's k-means trained on up to 256 items a list: every item up to
~1M, a cost of n x nlist x dim that grows as n^1.5. ``build_item_index`` now samples
``IVF_TRAIN_POINTS_PER_LIST`` (64) a list. This bench builds the IVF index over the same
vectors with each ``--points-per-list`` in turn and reports, for each, the training and
adding seconds and recall@k against exact search on ``--queries`` item vectors (nprobe as
configured), and the build-time ratio of the first to each other.

Vectors: the active semantic-ID version's item embeddings in the configured store
(``--store``; e.g. a kept ``bench scale`` store through ``GENREC_DATA_DIR``), or unit
vectors around random centres (``--items``, ``--dim``, seeded).

Memory: the vectors twice (the index holds a copy) and ``--chunk`` x items scores at a time
for the exact search.

Example::

    python -m genrec.app.bench.faiss_build --items 200k --points-per-list 256,64
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import faiss
import numpy as np

from genrec.app.bench.recall_branches import parse_size
from genrec.infra.settings import get_settings
from genrec.offline.semantic_ids.faiss_index import brute_force_topk, untrained_ivf


def clustered_vectors(items: int, dim: int, seed: int, centres: int = 2000) -> np.ndarray:
    """Unit vectors drawn around ``centres`` random directions (embeddings have clusters)."""
    rng = np.random.default_rng(seed)
    middle = rng.standard_normal((centres, dim)).astype(np.float32)
    vectors = middle[rng.integers(0, centres, items)]
    vectors += 0.5 * rng.standard_normal((items, dim)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    return vectors


def store_vectors() -> np.ndarray:
    """The active semantic-ID version's item embeddings in the configured store."""
    from genrec.infra.database import make_engine
    from genrec.offline.semantic_ids.build import load_item_embeddings

    settings = get_settings()
    engine = make_engine(settings.database_url)
    try:
        _, vectors = load_item_embeddings(settings, engine)
    finally:
        engine.dispose()
    return np.ascontiguousarray(vectors, dtype=np.float32)


def exact_neighbours(vectors: np.ndarray, queries: np.ndarray, k: int, chunk: int) -> np.ndarray:
    """Exact inner-product top-k rows, ``chunk`` queries at a time."""
    found = [brute_force_topk(vectors, queries[start : start + chunk], k)[1]
             for start in range(0, len(queries), chunk)]  # fmt: skip
    return np.concatenate(found)


def build_ivf(
    vectors: np.ndarray, points_per_list: int, nprobe: int
) -> tuple[faiss.Index, float, float]:
    """The IVF index as ``build_item_index`` makes it, training and adding timed apart."""
    index = untrained_ivf(len(vectors), vectors.shape[1], points_per_list)
    started = time.perf_counter()
    index.train(vectors)
    trained = time.perf_counter()
    index.add(vectors)
    added = time.perf_counter()
    index.nprobe = min(nprobe, index.nlist)
    return index, trained - started, added - trained


def run(args: argparse.Namespace) -> dict:
    vectors = store_vectors() if args.store else clustered_vectors(args.items, args.dim, args.seed)
    n = len(vectors)
    rng = np.random.default_rng(args.seed + 1)
    queries = vectors[rng.choice(n, size=min(args.queries, n), replace=False)]
    exact = exact_neighbours(vectors, queries, args.k, args.chunk)
    nprobe = get_settings().semantic_ids.index_nprobe
    rows = []
    for points in args.points_per_list:
        index, train_s, add_s = build_ivf(vectors, points, nprobe)
        _, found = index.search(queries, args.k)
        recall = float(
            np.mean([len(set(a) & set(b)) / args.k for a, b in zip(found, exact, strict=True)])
        )
        rows.append({"points_per_list": points, "nlist": int(index.nlist),
                     "train_points": int(min(n, points * index.nlist)), "train_s": round(train_s, 2),
                     "add_s": round(add_s, 2), "build_s": round(train_s + add_s, 2),
                     f"recall@{args.k}": round(recall, 4)})  # fmt: skip
        print(f"{points:>4} a list: {rows[-1]['train_points']:,} training points, train "
              f"{train_s:.1f} s, add {add_s:.1f} s, recall@{args.k} {recall:.4f}", flush=True)  # fmt: skip
        del index
    first = rows[0]["build_s"]
    for row in rows[1:]:
        print(f"build {rows[0]['points_per_list']} / {row['points_per_list']} a list: "
              f"{first / row['build_s']:.2f}x")  # fmt: skip
    return {"items": n, "dim": int(vectors.shape[1]), "source": "store" if args.store else "clustered",
            "queries": len(queries), "nprobe": nprobe, "threads": faiss.omp_get_max_threads(),
            "rows": rows}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", action="store_true", help="the configured store's embeddings")
    parser.add_argument("--items", type=parse_size, default=200_000, help="without --store")
    parser.add_argument("--dim", type=int, default=384, help="without --store")
    parser.add_argument("--points-per-list", default="256,64",
                        help="comma-separated k-means training items a list; the first is the baseline")  # fmt: skip
    parser.add_argument("--queries", type=int, default=2000)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--chunk", type=int, default=200, help="queries per exact-search block")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    args.points_per_list = [int(p) for p in args.points_per_list.split(",")]
    report = run(args)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
