"""The batched decoding engine's modes side by side, by batch size (online decoding step).

``compare_modes`` times, in one run and on the same users and batches, the
engine (``online/decoding/engine.py``) target-only, strict and relaxed in ms
per request (process CPU time) at several batch sizes, from the users' cached
prefixes, and checks that strict gives target-only's items.
``null_model_overhead`` (``app/bench/decode.py``) times a null model (1 layer,
width 8): what is left is the engine's own work. ``genrec bench decode``
reports the same modes next to transformers ``generate``.

Models: ``bench_models("small")`` builds random models of the ``small``
preset's shape (target 2 x 96 with item vectors, draft 1 x 64) over a random
catalog shaped like ML-100K's semantic IDs (3 x 256 codes and 4 dedup codes,
1,682 items) with 169-token prompts; any ``BenchModels`` (e.g. the trained
``small`` version, ``app.bench.decode.load_models("small")``) works too.
Figures: docs/decoding.md ("The batched engine").

Example::

    $ python -m genrec.app.bench.engine --batch-sizes 1,8,32,64 --k 10
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from genrec.app.bench.cli import add_runtime_args
from genrec.app.bench.decode import (
    BenchModels,
    bench_models,
    null_model_overhead,
    prefix_batches,
    resolve_clock,
    synchronize,
)
from genrec.online.decoding.engine import (
    DecodeResult,
    batched_beam_search,
    batched_speculative_beam_search,
)
from genrec.online.models.presets import pick_device
from genrec.online.models.runtime import apply_runtime


def mode_calls(models: BenchModels, k: int, n_draft: int, gamma: int) -> dict[str, Callable]:
    """mode name -> decode(target PrefixBatch, draft PrefixBatch)."""
    target, trie, layout = models.target, models.trie, models.layout
    calls: dict[str, Callable] = {
        "target": lambda t, d: batched_beam_search(target, t, trie, layout, k)
    }
    for mode in ("strict", "relaxed"):
        calls[mode] = _speculative(models, k, {"n_draft": n_draft, "gamma": gamma, "mode": mode})
    return calls


def _speculative(models: BenchModels, k: int, options: dict) -> Callable:
    def call(target_batch, draft_batch):
        generator = torch.Generator().manual_seed(0)
        return batched_speculative_beam_search(
            models.target, models.draft, (target_batch, draft_batch), models.trie, models.layout,
            k, generator=generator, **options,
        )  # fmt: skip

    return call


def compare_modes(
    models: BenchModels,
    batch_sizes: list[int],
    k: int = 10,
    n_users: int = 64,
    n_draft: int = 20,
    gamma: int = 3,
    modes: tuple[str, ...] = ("target", "strict", "relaxed"),
    repeats: int = 1,
) -> dict:
    """ms per request (median over batches; process CPU time, or wall time with the GPU
    synchronized on CUDA) for every mode x batch size, target and draft calls per request,
    and whether strict's items equal target-only's."""
    users = models.eval_users[:n_users]
    device = next(models.target.parameters()).device
    clock = time.perf_counter if resolve_clock("auto", device) == "wall" else time.process_time
    calls = {
        name: call
        for name, call in mode_calls(models, k, max(n_draft, k), gamma).items()
        if name in modes
    }
    by_size = [
        (size, [range(i, min(i + size, len(users))) for i in range(0, len(users), size)])
        for size in batch_sizes
    ]
    # every size's batches in one call: the users' prefix KV is computed once, not per size
    flat_inputs = iter(prefix_batches(models, users, [b for _, bs in by_size for b in bs]))
    rows = []
    for batch_size, batches in by_size:
        inputs = [next(flat_inputs) for _ in batches]
        row: dict = {"k": k, "batch_size": batch_size}
        results = {}
        for name, call in calls.items():
            call(*inputs[0])  # warm-up
            times, results[name] = [], []
            for _ in range(repeats):
                for batch, batch_input in zip(batches, inputs, strict=True):
                    synchronize(device)
                    started = clock()
                    results[name].append(call(*batch_input))
                    synchronize(device)
                    times.append(1000 * (clock() - started) / len(batch))
            row[name] = _summary(times, results[name][: len(batches)])
        row["strict_equals_target"] = _strict_equals_target(results)
        rows.append(row)
    by_batch = {r["batch_size"]: r for r in rows}
    ratios = {}
    if 1 in by_batch and 64 in by_batch:
        for name in calls:
            ratios[name] = (
                by_batch[64][name]["ms_per_request"] / by_batch[1][name]["ms_per_request"]
            )
    return {
        "threads": torch.get_num_threads(),
        "device": device.type,
        "clock": "wall" if clock is time.perf_counter else "cpu",
        "users": len(users),
        "rows": rows,
        "bs64_over_bs1": ratios,
    }


def _summary(times: list[float], results: list[DecodeResult]) -> dict:
    stats = [s for r in results for s in r.stats]
    return {
        "ms_per_request": statistics.median(times),
        "target_calls": sum(s.target_calls for s in stats) / len(stats),
        "draft_calls": sum(s.draft_calls for s in stats) / len(stats),
    }


def _strict_equals_target(results: dict[str, list[DecodeResult]]) -> bool | None:
    """Strict speculation is lossless: its items equal target-only's (None: one of them not run)."""
    if "target" not in results or "strict" not in results:
        return None
    pairs = zip(results["target"], results["strict"], strict=True)
    return all(torch.equal(a.item_index, b.item_index) for a, b in pairs)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-sizes", default="1,8,32,64")
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--n-draft", type=int, default=20)
    parser.add_argument("--users", type=int, default=64)
    parser.add_argument("--modes", default="target,strict,relaxed")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default=None, help="default: cuda when present, else cpu")
    add_runtime_args(parser)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    models = bench_models("small", n_users=args.users, device=args.device or pick_device())
    runtime = apply_runtime(models, args.dtype or "float32", args.compile or "off")
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    report = compare_modes(
        models,
        sizes,
        k=args.k,
        n_users=args.users,
        n_draft=args.n_draft,
        modes=tuple(args.modes.split(",")),
    )
    report["runtime"] = runtime
    report["null_model"] = null_model_overhead(k=args.k)
    text = json.dumps(report, indent=2)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text)
    print(text)
    return report


if __name__ == "__main__":
    main()
