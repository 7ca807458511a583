"""The batched decoding engine against the current one, side by side (online decoding step).

``compare_engines`` times, in one run and on the same users and batches, the
current engine (``beam_search``, ``speculative_beam_search``) and the batched
engine (``online/decoding/engine.py``) in ms per request (process CPU time) at
several batch sizes, from the users' cached prefixes, and checks that the
lossless modes give the current target-only search's items.
``null_model_overhead`` times both with a null model (1 layer, width 8): what
is left is the engines' own work. ``genrec bench decode`` can call these later.

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

from genrec.app.bench.decode import (
    BenchModels,
    EvalUser,
    random_catalog,
    random_llama,
    random_prompts,
)
from genrec.online.decoding.beam_search import DecodeResult, beam_search
from genrec.online.decoding.engine import batched_beam_search, batched_speculative_beam_search
from genrec.online.decoding.prefix_kv import PrefixBatch, compute_prefix_kv
from genrec.online.decoding.speculative import speculative_beam_search
from genrec.online.decoding.trie import ItemTrie
from genrec.online.models.item_vectors import attach_item_vectors
from genrec.online.models.presets import PRESETS, build_draft, build_target

ML100K_CODES = (256, 256, 256, 4)
ML100K_ITEMS = 1682
PROMPT_ITEMS, SUFFIX_ITEMS = 42, 2  # 1 + 42 * 4 = 169 prompt tokens, 8 of them the suffix


def bench_models(shape: str = "small", n_users: int = 64, seed: int = 0) -> BenchModels:
    """Random models of preset ``shape`` (``"small"``; ``"null"``: 1 layer x 8 for target and
    draft) over an ML-100K-shaped random catalog, and ``n_users`` users."""
    layout, items = random_catalog(ML100K_CODES, ML100K_ITEMS, seed=seed)
    trie = ItemTrie(items, layout)
    torch.manual_seed(seed)
    if shape == "null":
        target = random_llama(layout, 1, 8, seed=seed + 1, heads=2)
        draft = random_llama(layout, 1, 8, seed=seed + 2, heads=2)
    else:
        preset = PRESETS[shape]
        target, draft = build_target(preset, layout).eval(), build_draft(preset, layout).eval()
        if preset.item_vector_dim:
            attach_item_vectors(target, trie, torch.randn(trie.n_items, preset.item_vector_dim))
    prompts = random_prompts(
        items, [PROMPT_ITEMS] * n_users, seed=seed + 3, bos=layout.bos_token_id
    )
    users = [EvalUser(p, held_out=0, suffix_items=SUFFIX_ITEMS) for p in prompts]
    return BenchModels(target, draft, layout, trie, users, model_version=f"random-{shape}")


def engine_calls(models: BenchModels, k: int, n_draft: int, gamma: int) -> dict[str, Callable]:
    """mode name -> decode(target PrefixBatch, draft PrefixBatch) for both engines."""
    target, trie, layout = models.target, models.trie, models.layout
    calls: dict[str, Callable] = {
        "current/target": lambda t, d: beam_search(target, t, trie, layout, k),
        "batched/target": lambda t, d: batched_beam_search(target, t, trie, layout, k),
    }
    for mode in ("strict", "relaxed"):
        options = {"n_draft": n_draft, "gamma": gamma, "mode": mode}
        calls[f"current/{mode}"] = _speculative(speculative_beam_search, models, k, options)
        calls[f"batched/{mode}"] = _speculative(batched_speculative_beam_search, models, k, options)
    return calls


def _speculative(search, models: BenchModels, k: int, options: dict) -> Callable:
    def call(target_batch, draft_batch):
        generator = torch.Generator().manual_seed(0)
        return search(
            models.target, models.draft, (target_batch, draft_batch), models.trie, models.layout,
            k, generator=generator, **options,
        )  # fmt: skip

    return call


def compare_engines(
    models: BenchModels,
    batch_sizes: list[int],
    k: int = 10,
    n_users: int = 64,
    n_draft: int = 20,
    gamma: int = 3,
    modes: tuple[str, ...] = ("target", "strict", "relaxed"),
    repeats: int = 1,
) -> dict:
    """ms per request (median over batches, process CPU time) for every engine x mode x batch
    size, target and draft calls per request, and whether the two engines' items agree."""
    users = models.eval_users[:n_users]
    depth = models.layout.depth
    prefixes = [u.prompt[: len(u.prompt) - u.suffix_items * depth] for u in users]
    suffixes = [u.prompt[len(p) :] for u, p in zip(users, prefixes, strict=True)]
    target_kv = compute_prefix_kv(models.target, prefixes, "bench")
    draft_kv = compute_prefix_kv(models.draft, prefixes, "bench-draft")
    calls = {
        name: call
        for name, call in engine_calls(models, k, max(n_draft, k), gamma).items()
        if name.split("/")[1] in modes
    }
    rows = []
    for batch_size in batch_sizes:
        batches = [
            range(i, min(i + batch_size, len(users))) for i in range(0, len(users), batch_size)
        ]
        inputs = [
            (
                PrefixBatch([target_kv[i] for i in rows_], [suffixes[i] for i in rows_]),
                PrefixBatch([draft_kv[i] for i in rows_], [suffixes[i] for i in rows_]),
            )
            for rows_ in batches
        ]
        row: dict = {"k": k, "batch_size": batch_size}
        results = {}
        for name, call in calls.items():
            call(*inputs[0])  # warm-up
            times, results[name] = [], []
            for _ in range(repeats):
                for batch, batch_input in zip(batches, inputs, strict=True):
                    started = time.process_time()
                    results[name].append(call(*batch_input))
                    times.append(1000 * (time.process_time() - started) / len(batch))
            row[name] = _summary(times, results[name][: len(batches)])
        row["same_items"] = _agreement(results)
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


def _agreement(results: dict[str, list[DecodeResult]]) -> dict[str, bool]:
    """Per lossless mode: the batched engine's items equal the current target-only search's."""
    reference = results.get("current/target")
    out = {}
    for name, found in results.items():
        if reference is None or name.endswith("relaxed") or name == "current/target":
            continue
        pairs = zip(reference, found, strict=True)
        out[name] = all(torch.equal(a.item_index, b.item_index) for a, b in pairs)
    return out


def null_model_overhead(batch_size: int = 64, k: int = 10, calls: int = 20) -> dict:
    """ms per decode call (and per request) of the batched and current engines with a null
    model: the engine's own overhead."""
    models = bench_models("null", n_users=batch_size)
    report = compare_engines(
        models, [batch_size], k=k, n_users=batch_size, modes=("target",), repeats=calls
    )
    row = report["rows"][0]
    return {
        "batch_size": batch_size,
        **{
            name: {
                "ms_per_call": row[name]["ms_per_request"] * batch_size,
                "ms_per_request": row[name]["ms_per_request"],
            }
            for name in ("current/target", "batched/target")
        },
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-sizes", default="1,8,32,64")
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--n-draft", type=int, default=20)
    parser.add_argument("--users", type=int, default=64)
    parser.add_argument("--modes", default="target,strict,relaxed")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    models = bench_models("small", n_users=args.users)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    report = compare_engines(
        models,
        sizes,
        k=args.k,
        n_users=args.users,
        n_draft=args.n_draft,
        modes=tuple(args.modes.split(",")),
    )
    report["null_model"] = null_model_overhead(k=args.k)
    text = json.dumps(report, indent=2)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text)
    print(text)
    return report


if __name__ == "__main__":
    main()
