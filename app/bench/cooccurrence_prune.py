"""The co-occurrence sum's prune, side by side with an earlier one (benchmark step).

Issue #19: a ``CooccurrenceSum`` past ``recall.cooccurrence_max_entries`` pairs cuts every
row to its best ``prune_to`` and, where rows x prune_to is still above the bound (1M
items), the weakest pairs by cosine down to half of it (``_prune_rows`` in
``online/branches.py``). At 1M items and 20M events the recall fit prunes each of its two
sums about 14 times, and those prunes were most of the refresh. This bench builds a
matrix of that shape (heavy-tailed row lengths, Zipf columns, decayed counts as values),
prunes it with the current code and, with ``--old FILE``, with an earlier
``online/branches.py``, in turns, checks both give the same matrix bit for bit, and
prints the seconds and the old/new ratio.

Memory: the matrix (12 bytes a pair) and a few int64 per pair while a prune runs.

Example::

    git show <commit>:online/branches.py > /tmp/branches_old.py
    python -m genrec.app.bench.cooccurrence_prune --items 1M --pairs 60M \\
        --old /tmp/branches_old.py --json var/bench/prune.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from scipy import sparse

from genrec.app.bench.recall_branches import load_old, parse_size
from genrec.infra.settings import get_settings
from genrec.online.branches import _prune_rows


def cooccurrence_like(items: int, pairs: int, seed: int) -> tuple[sparse.csr_matrix, np.ndarray]:
    """A CSR of about ``pairs`` entries over ``items`` rows shaped like a summed
    co-occurrence, and the column scale a prune ranks by (1 / sqrt(occurrences))."""
    rng = np.random.default_rng(seed)
    lengths = np.minimum(rng.pareto(1.2, items) * 20 + 5, 5000)
    lengths = (lengths * pairs / lengths.sum()).astype(np.int64) + 1
    rows = np.repeat(np.arange(items), lengths)
    columns = ((rng.zipf(1.2, len(rows)) + rng.integers(0, items, len(rows))) % items).astype(
        np.int32
    )
    values = rng.integers(1, 5, len(rows)) * 0.8 ** rng.integers(0, 4, len(rows))
    matrix = sparse.csr_matrix((values, (rows, columns)), shape=(items, items))
    matrix.sum_duplicates()
    occurrences = np.bincount(matrix.indices, minlength=items) + 1
    return matrix, 1.0 / np.sqrt(occurrences.astype(np.float64))


def run(args) -> dict:
    recall = get_settings().recall
    matrix, scale = cooccurrence_like(args.items, args.pairs, args.seed)
    budget = (recall.cooccurrence_max_entries or args.pairs) // 2  # what a prune leaves
    prunes = {"new": _prune_rows}
    if args.old:
        prunes["old"] = load_old(args.old)._prune_rows
    seconds: dict[str, list[float]] = {name: [] for name in prunes}
    results = {}
    for _ in range(args.rounds):
        for name, prune in prunes.items():
            started = time.perf_counter()
            results[name] = prune(matrix.copy(), recall.cooccurrence_prune_to, scale, budget)
            seconds[name].append(time.perf_counter() - started)
            print(f"{name}: {seconds[name][-1]:.2f} s", flush=True)
    report = {"items": args.items, "pairs": int(matrix.nnz), "prune_to": recall.cooccurrence_prune_to,
              "budget": budget, "kept": int(results["new"].nnz),
              "new_s": round(min(seconds["new"]), 4)}  # fmt: skip
    if args.old:
        new, old = results["new"], results["old"]
        report["identical"] = bool(
            np.array_equal(new.indptr, old.indptr) and np.array_equal(new.indices, old.indices)
            and np.array_equal(new.data, old.data)
        )  # fmt: skip
        report["old_s"] = round(min(seconds["old"]), 4)
        report["old_over_new"] = round(min(seconds["old"]) / min(seconds["new"]), 2)
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=parse_size, default=1_000_000)
    parser.add_argument("--pairs", type=parse_size, default=60_000_000)
    parser.add_argument("--old", type=Path, help="an earlier online/branches.py to compare")
    parser.add_argument("--rounds", type=int, default=2, help="turns of each (best is kept)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    report = run(args)
    print(json.dumps(report))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
