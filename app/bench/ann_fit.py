"""The ANN branch's co-occurrence embeddings: the whole catalog vs landmarks (benchmark step).

Issue #19: the eigen-decomposition of the item co-occurrence (``eigsh``, ``recall.ann_dim``
vectors) grows faster than the catalog and is the recall fit's largest cost. Above
``recall.ann_fit_max_items`` the fit decomposes the most connected items only and places
every other item by its co-occurrence with them (``landmark_embeddings`` in
``online/branches.py``). This bench measures what that costs in quality, in one process, on
a ``genrec synthetic`` workload (no text): each user's last event is held out, the
co-occurrence is summed over the rest as ``fit_store_branches`` sums it (pages, the same
bounds), then for the whole catalog and each landmark count: the fit's seconds, HR@10 of
the ANN branch (``AnnBranch.fit`` with the production IVF bound) for ``--eval-users``
held-out users (history excluded), and the share of each user's top-50 that the
whole-catalog fit also returns; and the share of items with no pair at all
(``unseen_rows``: a zero row under any fit).

Memory: the workload's events (three int64 arrays), the co-occurrence (at most
``recall.cooccurrence_max_entries`` pairs) and one fit's items x dim at a time.

Example::

    $ python -m genrec.app.bench.ann_fit --users 20000 --items 50000 --events 500000 \\
        --landmarks 5000,10000,20000 --json var/bench/ann_fit.json
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from genrec.infra.settings import get_settings
from genrec.ingest.synthetic import SyntheticConfig, event_batches
from genrec.offline.recall import cooccurrence_sums
from genrec.online.branches import AnnBranch, embeddings_of_cooccurrence

PAGE_USERS = 10_000


def user_sequences(config: SyntheticConfig) -> Iterator[np.ndarray]:
    """Each user's catalog positions in time order (the workload's events grouped by user)."""
    users, items = [], []
    for table in event_batches(config):
        users.append(table.column("user_id").to_numpy())
        items.append(table.column("item_id").to_numpy())
    user = np.concatenate(users).astype(np.int64)
    item = np.concatenate(items).astype(np.int64) - 1  # item ids count from 1
    order = np.argsort(user, kind="stable")  # stable: each user's events stay in time order
    user, item = user[order], item[order]
    starts = np.flatnonzero(np.r_[True, user[1:] != user[:-1]])
    yield from np.split(item, starts[1:])


def held_out(config: SyntheticConfig, min_events: int = 5):
    """Training sequences (every user; the last event of users with ``min_events`` or
    more left out) and the test cases: (history, held-out item)."""
    train, tests = [], []
    for sequence in user_sequences(config):
        if len(sequence) >= min_events:
            train.append(sequence[:-1].tolist())
            tests.append((sequence[:-1], int(sequence[-1])))
        else:
            train.append(sequence.tolist())
    return train, tests


def measure(embeddings: np.ndarray, item_ids, cases, recall) -> tuple[float, list]:
    """HR@10 of the ANN branch over ``cases`` and each case's top-50."""
    branch = AnnBranch.fit(
        item_ids, embeddings, last_m=recall.ann_last_m,
        half_life_items=recall.ann_half_life_items, half_life_days=None,
        exact_max_items=recall.ann_exact_max_items, nprobe=recall.ann_nprobe,
    )  # fmt: skip
    histories = [[item_ids[i] for i in history] for history, _ in cases]
    excludes = [set(h) for h in histories]
    top50 = branch.recommend_batch(histories, 50, excludes)
    hits = [item_ids[truth] in {i for i, _ in ranked[:10]} for (_, truth), ranked in
            zip(cases, top50, strict=True)]  # fmt: skip
    return float(np.mean(hits)), [{i for i, _ in ranked} for ranked in top50]


def run(args) -> dict:
    recall = get_settings().recall
    config = SyntheticConfig(users=args.users, items=args.items, events=args.events,
                             seed=args.seed, text=False)  # fmt: skip
    started = time.perf_counter()
    train, tests = held_out(config)
    _, cooccurrence = cooccurrence_sums(args.items, recall)  # the ANN sum, as the fit bounds it
    for start in range(0, len(train), PAGE_USERS):
        cooccurrence.add(train[start : start + PAGE_USERS])
    matrix = cooccurrence.matrix()
    rng = np.random.default_rng(args.seed + 1)
    cases = [tests[i] for i in rng.choice(len(tests), min(args.eval_users, len(tests)), False)]
    item_ids = [str(i) for i in range(args.items)]
    report = {"users": args.users, "items": args.items, "events": args.events,
              "pairs": int(matrix.nnz), "dim": recall.ann_dim, "eval_users": len(cases),
              "prepare_s": round(time.perf_counter() - started, 1), "fits": []}  # fmt: skip
    print(f"{args.events:,} events, {len(cases)} test users, {matrix.nnz:,} pairs", flush=True)
    # items with no pair at all: what no fit can place (a zero row whatever the landmarks)
    report["unseen_rows"] = round(float((np.diff(matrix.indptr) == 0).mean()), 4)
    counts = ([None] if args.whole else []) + args.landmarks
    whole_top = None
    for landmarks in counts:
        started = time.perf_counter()
        embeddings = embeddings_of_cooccurrence(matrix, recall.ann_dim, fit_max_items=landmarks)
        seconds = time.perf_counter() - started
        hr, top = measure(embeddings, item_ids, cases, recall)
        whole_top = top if landmarks is None else whole_top
        row = {"landmarks": landmarks or "whole catalog", "fit_s": round(seconds, 1),
               "hr_at_10": round(hr, 4),
               "zero_rows": round(float((~embeddings.any(axis=1)).mean()), 4),
               "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}  # fmt: skip
        if whole_top is not None:
            row["top50_shared_with_whole"] = round(float(np.mean(
                [len(a & b) / max(1, len(b)) for a, b in zip(whole_top, top, strict=True)])), 3)  # fmt: skip
        report["fits"].append(row)
        print(json.dumps(row), flush=True)
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--users", type=int, default=20_000)
    parser.add_argument("--items", type=int, default=50_000)
    parser.add_argument("--events", type=int, default=500_000)
    parser.add_argument("--landmarks", default="5000,10000,20000",
                        help="comma-separated landmark counts")  # fmt: skip
    parser.add_argument("--no-whole", dest="whole", action="store_false",
                        help="skip the whole-catalog fit (hours at 1M items)")  # fmt: skip
    parser.add_argument("--eval-users", type=int, default=2_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    args.landmarks = [int(n) for n in args.landmarks.split(",") if n]
    report = run(args)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
