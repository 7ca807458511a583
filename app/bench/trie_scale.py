"""Serving cost against the catalog alone: trie tables and one decode batch (app layer, bench).

For each catalog size, a synthetic catalog of random semantic IDs in the project's layout
(``semantic_ids.levels`` levels of ``codes_per_level`` codes plus the ``dedup_codes`` level,
the balanced last level: an item takes the next free dedup code of its 3-code prefix), its
``ItemTrie`` and ``TrieTables`` (build seconds, bytes of their tensors, process peak RSS),
then ``batched_beam_search`` at ``--batch`` users, K ``--k``, each user's prompt
``--history`` random items long and those items excluded (the seen items), with a random
``--preset`` model of the same weights at every size: only the catalog changes. One
warm-up batch, then the median of ``--batches`` timed ones.

Each size runs in a process of its own (its RSS is its own). ``--compare-with DIR`` runs
every size twice, once against ``DIR`` (an older checkout's package root: a folder with
``genrec/{online,schemas,...}``) and once against this one, and prints them side by side
with the ratios. The bench uses only what both sides have (``TrieTables.of``,
``batched_beam_search``).

Example::

    $ python -m genrec.app.bench.trie_scale --sizes 5k,50k --json var/bench/trie-scale.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def synthetic_codes(n_items: int, levels: int, codes: int, dedup: int, seed: int):
    """LongTensor[n_items, levels + 1] of distinct codes: uniform random prefixes, the last
    code the item's rank among the items of its prefix (wrapped prefixes re-drawn)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, codes, (n_items, levels), generator=generator)
    key = torch.zeros(n_items, dtype=torch.long)
    for level in range(levels):
        key = key * codes + prefix[:, level]
    order = torch.argsort(key, stable=True)
    sorted_key = key[order]
    first = torch.searchsorted(sorted_key, sorted_key)  # first position of each key's run
    rank = torch.empty_like(key)
    rank[order] = torch.arange(n_items) - first
    keep = rank < dedup  # a prefix with more items than dedup codes: drop the overflow
    return torch.cat([prefix, rank[:, None]], 1)[keep]


def measure(n_items: int, args: argparse.Namespace) -> dict[str, Any]:
    """The figures of one catalog size, in this process."""
    import torch

    from genrec.app.bench.scale_stages import tensor_bytes
    from genrec.online.decoding.engine import batched_beam_search
    from genrec.online.decoding.trie import ItemTrie
    from genrec.online.decoding.trie_tables import TrieTables
    from genrec.online.models.presets import PRESETS, build_target
    from genrec.schemas.token_layout import TokenLayout

    torch.set_num_threads(args.threads)
    levels, codes, dedup = args.levels, args.codes, args.dedup
    layout = TokenLayout.for_scratch_model((codes,) * levels + (dedup,))
    item_codes = synthetic_codes(n_items, levels, codes, dedup, args.seed)
    items = torch.tensor(layout.encode(item_codes.tolist()), dtype=torch.long)
    started = time.perf_counter()
    trie = ItemTrie(items, layout)
    trie_s = time.perf_counter() - started
    started = time.perf_counter()
    tables = TrieTables.of(trie)
    tables_s = time.perf_counter() - started
    torch.manual_seed(args.seed)
    model = build_target(PRESETS[args.preset], layout).eval()
    generator = torch.Generator().manual_seed(args.seed + 1)
    n = len(items)

    def batch() -> tuple[list[list[int]], list[list[int]]]:
        seen = [torch.randint(0, n, (args.history,), generator=generator).tolist()
                for _ in range(args.batch)]  # fmt: skip
        prompts = [[layout.bos_token_id] + items[rows].flatten().tolist() for rows in seen]
        return prompts, seen

    prompts, seen = batch()
    batched_beam_search(model, prompts, trie, layout, args.k, exclude=seen)  # warm-up
    timed = []
    for _ in range(args.batches):
        prompts, seen = batch()
        began = time.perf_counter()
        batched_beam_search(model, prompts, trie, layout, args.k, exclude=seen)
        timed.append(time.perf_counter() - began)
    per_batch = statistics.median(timed)
    return {
        "items": n, "trie_build_s": round(trie_s, 3), "tables_build_s": round(tables_s, 3),
        "trie_bytes": tensor_bytes(trie), "tables_bytes": tensor_bytes(tables, skip=(ItemTrie,)),
        "ms_per_batch": round(1000 * per_batch, 2),
        "ms_per_request": round(1000 * per_batch / args.batch, 3),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
    }  # fmt: skip


def parse_size(text: str) -> int:
    text = text.strip().lower()
    scale = {"k": 1_000, "m": 1_000_000}.get(text[-1:], 1)
    return int(float(text.rstrip("km")) * scale)


def run_side(size: int, package_root: str | None, args: argparse.Namespace) -> dict[str, Any]:
    """``measure(size)`` in a child process importing genrec from ``package_root`` (None:
    this checkout)."""
    env = dict(os.environ)
    if package_root is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    command = [sys.executable, __file__, "--one", str(size), *args.passthrough]
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if out.returncode:
        return {"items": size, "error": out.stderr[-1500:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def print_table(rows: list[dict[str, Any]]) -> None:
    base = next((r for r in rows if "error" not in r), None)
    print("side   items     tables MiB  trie MiB  ms/request  x smallest  peak RSS MiB")
    for row in rows:
        if "error" in row:
            print(f"{row['side']:<6} {row['items']:>9,}  failed: {row['error'][-200:]!r}")
            continue
        first = next(r for r in rows if r["side"] == row["side"] and "error" not in r)
        growth = row["ms_per_request"] / first["ms_per_request"]
        print(f"{row['side']:<6} {row['items']:>9,}  {row['tables_bytes'] / 2**20:>10.1f}"
              f"  {row['trie_bytes'] / 2**20:>8.1f}  {row['ms_per_request']:>10.3f}"
              f"  {growth:>10.2f}  {row['peak_rss_mib']:>12,}")  # fmt: skip
    del base


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m genrec.app.bench.trie_scale")
    parser.add_argument("--sizes", default="5k,50k,200k,1M", help="catalog sizes, comma-separated")
    parser.add_argument("--compare-with", default=None, help="an older checkout's package root")
    parser.add_argument("--old-max-items", type=int, default=None, help="skip larger sizes there")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    knobs = parser.add_argument_group("the decode (passed to every size)")
    for name, default in [("--batch", 32), ("--k", 10), ("--history", 50), ("--batches", 3),
                          ("--levels", 3), ("--codes", 256), ("--dedup", 32), ("--seed", 0),
                          ("--threads", 1)]:  # fmt: skip
        knobs.add_argument(name, type=int, default=default)
    knobs.add_argument("--preset", default="tiny")
    args = parser.parse_args(argv)
    if args.one is not None:
        print(json.dumps(measure(args.one, args)))
        return 0
    args.passthrough = [f"--{k}={getattr(args, k)}" for k in
                        ("batch", "k", "history", "batches", "levels", "codes", "dedup", "seed",
                         "threads", "preset")]  # fmt: skip
    rows = []
    for size in (parse_size(s) for s in args.sizes.split(",")):
        sides = [("new", None)]
        if args.compare_with and (args.old_max_items is None or size <= args.old_max_items):
            sides.insert(0, ("old", args.compare_with))
        for side, root in sides:
            row = {"side": side, **run_side(size, root, args)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    rows.sort(key=lambda r: (r["side"], r["items"]))
    print_table(rows)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
