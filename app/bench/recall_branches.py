"""Serving latency of the recall branches against catalog size (issue #19; benchmark step).

Builds a synthetic fitted state per size, directly (no store): random popularity scores,
item-CF neighbour lists of ``--neighbors`` random items per item (random similarities), and a
FAISS flat index of random unit vectors; then times ``recommend_batch`` for batches of
``--batch`` users (histories of 10-50 random items, seen items excluded, ``--k`` deep).
With ``--old FILE`` (a copy of an earlier ``online/branches.py``) the same state is served by
that code too, in the same process, its results checked equal to the new ones. With
``--ivf-nlist N`` the ANN branch is also timed over an IVF index of the same vectors.

Example::

    git show <commit>:online/branches.py > /tmp/branches_old.py
    python -m genrec.app.bench.recall_branches --sizes 5k,50k,200k,1M --old /tmp/branches_old.py
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from pathlib import Path
from types import ModuleType

import numpy as np
from scipy import sparse

from genrec.online import branches as new_code


def parse_size(text: str) -> int:
    """``5k`` -> 5,000; ``1M`` -> 1,000,000."""
    scale = {"k": 1_000, "m": 1_000_000}.get(text[-1].lower(), 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def load_old(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("genrec_branches_old", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def neighbor_lists(rng, n: int, neighbors: int) -> sparse.csr_matrix:
    """``neighbors`` random other items per item with random similarities (canonical CSR)."""
    neighbors = min(neighbors, n - 1)
    columns = rng.integers(0, n - 1, size=(n, neighbors), dtype=np.int32)
    columns += columns >= np.arange(n, dtype=np.int32)[:, None]  # never the item itself
    columns.sort(axis=1)
    data = rng.random((n, neighbors), dtype=np.float32)
    indptr = np.arange(0, n * neighbors + 1, neighbors, dtype=np.int64)
    matrix = sparse.csr_matrix((data.ravel(), columns.ravel(), indptr), shape=(n, n))
    matrix.sum_duplicates()  # repeated random columns
    return matrix


def synthetic_branches(rng, n: int, neighbors: int, dim: int) -> dict:
    items = [f"item-{i}" for i in range(n)]
    popularity = new_code.PopularityBranch(items, {}, rng.exponential(size=n))
    itemcf = new_code.ItemCFBranch(
        items, {"last_m": 20, "recency_decay": 0.8}, neighbor_lists(rng, n, neighbors)
    )
    ann_params = {"last_m": 20, "half_life_items": 2.0, "half_life_days": None}
    ann = new_code.AnnBranch(items, ann_params, rng.standard_normal((n, dim), dtype=np.float32))
    return {"popularity": popularity, "itemcf": itemcf, "ann": ann}


def as_old(branch, old: ModuleType):
    """The same fitted state (shared arrays, no copy) served by the old module's class."""
    twin = object.__new__(getattr(old, type(branch).__name__))
    twin.__dict__.update(branch.__dict__)
    return twin


def timed(branches: list, batches, k: int) -> tuple[list[float], list]:
    """Median ms per batch of each branch, taking turns batch by batch (so that the host's
    load falls on all alike; the first batch is a warm-up), and each one's last results."""
    times: list[list[float]] = [[] for _ in branches]
    results: list = [None] * len(branches)
    for histories, excludes in batches:
        for n, branch in enumerate(branches):
            started = time.perf_counter()
            results[n] = branch.recommend_batch(histories, k, excludes)
            times[n].append((time.perf_counter() - started) * 1000)
    return [statistics.median(t[1:]) for t in times], results


def requests(rng, items: list[str], batch: int, count: int) -> list:
    out = []
    for _ in range(count):
        histories = [
            [items[i] for i in rng.integers(0, len(items), size=int(rng.integers(10, 51)))]
            for _ in range(batch)
        ]
        out.append((histories, [set(h) for h in histories]))
    return out


def same(a: list, b: list, exact: bool) -> bool:
    if [[i for i, _ in r] for r in a] != [[i for i, _ in r] for r in b]:
        return False
    if exact:
        return a == b
    return all(np.allclose([s for _, s in x], [s for _, s in y]) for x, y in zip(a, b, strict=True))


def bench_size(n: int, args, old: ModuleType | None) -> list[dict]:
    rng = np.random.default_rng(args.seed)
    started = time.perf_counter()
    fitted = synthetic_branches(rng, n, args.neighbors, args.dim)
    build_s = time.perf_counter() - started
    batches = requests(rng, fitted["popularity"].item_ids, args.batch, args.repeats + 1)
    rows = []
    for name, branch in fitted.items():
        row = {"items": n, "branch": name, "build_s": round(build_s, 1)}
        served = [branch] if old is None else [branch, as_old(branch, old)]
        ms, results = timed(served, batches, args.k)
        row["new_ms"] = round(ms[0], 2)
        if old is not None:
            row["old_ms"] = round(ms[1], 2)
            row["old_over_new"] = round(ms[1] / ms[0], 2)
            row["same_results"] = same(results[0], results[1], exact=name != "ann")
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.ivf_nlist and n > args.ivf_nlist * 39:
        rows.append(ivf_row(fitted["ann"], batches, args, rng))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def ivf_row(flat, batches, args, rng) -> dict:
    """The ANN branch over an IVF index of the same vectors (what a large catalog could
    serve; approximate): ms per batch beside the flat index, and the share of the flat
    index's items it returns."""
    import faiss

    n, dim = flat.embeddings.shape
    started = time.perf_counter()
    index = faiss.IndexIVFFlat(
        faiss.IndexFlatIP(dim), dim, args.ivf_nlist, faiss.METRIC_INNER_PRODUCT
    )
    sample = np.sort(rng.choice(n, size=min(n, 39 * args.ivf_nlist), replace=False))
    index.train(np.ascontiguousarray(flat.embeddings[sample]))
    index.add(flat.embeddings)
    index.nprobe = args.ivf_nprobe
    build_s = time.perf_counter() - started
    ivf = object.__new__(type(flat))
    ivf.__dict__.update(flat.__dict__, index=index)
    ms, results = timed([flat, ivf], batches, args.k)
    found = [len({i for i, _ in a} & {i for i, _ in b}) / max(1, len(a))
             for a, b in zip(results[0], results[1], strict=True)]  # fmt: skip
    return {
        "items": n, "branch": f"ann-ivf{args.ivf_nlist}-nprobe{args.ivf_nprobe}",
        "build_s": round(build_s, 1), "flat_ms": round(ms[0], 2), "new_ms": round(ms[1], 2),
        "recall_of_flat": round(float(np.mean(found)), 3),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="5k,50k,200k,1M")
    parser.add_argument("--old", type=Path, help="an earlier online/branches.py to compare")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--k", type=int, default=50)  # recall.merge_depth
    parser.add_argument("--neighbors", type=int, default=200)  # recall.itemcf_top_neighbors
    parser.add_argument("--dim", type=int, default=256)  # recall.ann_dim
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ivf-nlist", type=int, default=0, help="also time an IVF ANN index")
    parser.add_argument("--ivf-nprobe", type=int, default=16)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    old = load_old(args.old) if args.old else None
    rows = [
        row for size in args.sizes.split(",") for row in bench_size(parse_size(size), args, old)
    ]
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
