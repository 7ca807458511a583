"""``genrec bench serve``: prefix-KV serving vs recomputing the full history prompt (online step).

Both sides decode the same users with the same ``ModelDecoder`` (same mode,
draft, beam width, threads) from the same logical prompt: BOS + the user's
last H items. The *full prompt* side prefills all of it; the *prefix KV* side
starts from the cache of everything but the newest ``suffix_events`` items
(computed beforehand, as the refresh does) and the target prefills only those
items, exactly as ``genrec serve`` does for a user whose cache is one or two
events old. The two sides alternate, pass after pass, and the median pass
counts, so a busy machine slows both alike. The draft (strict/relaxed) has
its own prefix KV of the same prompt, computed on the warm-up pass as a
worker computes it on a user's first request. A third column adds what a
worker's in-memory LRU miss costs: reading the user's cache file from disk,
plus the draft's prefill of the cached prompt.

Models: the active serving version's pinned model when one exists, else the
active model version, else freshly built models of ``--preset`` over random
semantic IDs (decoding time does not depend on the weights). Users: those with
the longest histories in the behavior store (ML-100K when it is empty).

Example::

    $ genrec bench serve --users 16 --batch-sizes 1,8
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from genrec.infra.database import make_engine
from genrec.infra.progress import progress_bar
from genrec.infra.serving_versions import active_serving_version
from genrec.infra.settings import get_settings
from genrec.ingest.history import load_user_histories
from genrec.ingest.movielens import load_ml100k
from genrec.online.decoding.prefix_kv import compute_prefix_kv, load_prefix_kv, save_prefix_kv
from genrec.online.models.generative import GenerativeModels
from genrec.online.models.presets import build_draft, build_target, get_preset, pick_device
from genrec.online.models.smollm2 import pretrained_item_layout
from genrec.online.models.store import NoActiveModels, load_model_version
from genrec.online.prompts import ItemTokens
from genrec.online.recommender import GenerativeRequest, ModelDecoder
from genrec.schemas.token_layout import TokenLayout


@dataclass
class BenchModels:
    models: Any  # GenerativeModels
    source: str  # what was loaded, for the report


def run_serve_bench(
    users: int = 32,
    suffix_events: int = 2,
    batch_sizes: tuple[int, ...] = (1, 8),
    json_path: Path | None = None,
    preset: str = "small",
    mode: str = "strict",
    repeats: int = 3,
    threads: int | None = None,
    random_models: bool = False,
    history_items: int = 50,
    beam_width: int | None = None,
) -> dict[str, Any]:
    """Time both sides per batch size, print a table and the ratio; returns the figures."""

    if suffix_events < 1 or users < 1 or repeats < 1 or not batch_sizes:
        raise ValueError("need users >= 1, suffix_events >= 1, repeats >= 1 and a batch size")
    settings = get_settings()
    torch.set_num_threads(threads or settings.online.torch_threads)
    loaded, histories = _models_and_histories(
        settings, preset, users, suffix_events, random_models, history_items
    )
    models = loaded.models
    decoder = ModelDecoder(models, settings.online.model_copy(update={"mode": mode}))
    full, cached, cache_files = _requests(models, histories, suffix_events)
    beam_width = beam_width or settings.online.generative_beams()  # the worker's
    figures: dict[str, Any] = {
        "models": loaded.source, "mode": mode, "beam_width": beam_width, "users": len(full),
        "torch_threads": torch.get_num_threads(), "device": str(decoder.device),
        "mean_prompt_tokens": float(np.mean([len(r.full_prompt) for r in full])),
        "mean_suffix_tokens": float(np.mean([len(r.suffix_tokens) for r in cached])),
        "suffix_events": suffix_events, "repeats": repeats, "batches": {},
    }  # fmt: skip
    _print_header(figures, decoder)
    load_ms = _load_ms_per_user(cache_files, str(models.version))
    draft_ms = _draft_prefill_ms_per_user(decoder, cached)
    for batch_size in batch_sizes:
        row = _measure(decoder, full, cached, batch_size, beam_width, repeats)
        row["prefix_kv_with_load_ms"] = row["prefix_kv_ms"] + load_ms + draft_ms
        row["speedup_with_load"] = row["full_prompt_ms"] / row["prefix_kv_with_load_ms"]
        figures["batches"][batch_size] = row
        _print_row(batch_size, row)
    figures["disk_load_ms_per_user"] = load_ms
    figures["draft_prefill_ms_per_user"] = draft_ms
    print(f"(prefix KV + disk: a worker's in-memory LRU miss: each user's cache file read from "
          f"disk, {load_ms:.2f} ms/user, plus the draft's prefill of the cached prompt, "
          f"{draft_ms:.2f} ms/user; on a hit the worker keeps both)")  # fmt: skip
    _write_outputs(figures, json_path, settings)
    return figures


# --- what is timed ------------------------------------------------------------------


def _requests(models, histories, suffix_events: int):
    """Per user: the full-prompt request and the prefix-KV request of the same prompt."""

    tokens, depth = models.item_tokens, models.item_tokens.layout.depth
    full, cached, files = [], [], []
    folder = Path(tempfile.mkdtemp(prefix="genrec-bench-kv-"))
    for n, history in enumerate(progress_bar(histories, desc="prefix KV", leave=False)):
        items = tokens.known(history)[-models.history_items :]
        prompt = models.prompt(items)
        prefix = prompt[: len(prompt) - suffix_events * depth]
        seen = sorted({tokens.index[i] for i in items})
        prefix_kv = compute_prefix_kv(models.target, [prefix], str(models.version))[0]
        full.append(GenerativeRequest(f"u{n}", prompt, exclude=seen))
        cached.append(GenerativeRequest(f"u{n}", prompt, prefix_kv, prompt[len(prefix) :], seen))
        files.append(folder / f"u{n}.safetensors")
        save_prefix_kv(files[-1], prefix_kv)
    return full, cached, files


def _measure(decoder, full, cached, batch_size: int, beam_width: int, repeats: int) -> dict:
    """Median ms/request of alternating passes; also whether both sides found the same items."""
    for side in (full, cached):  # warm-up: first calls allocate
        decoder.decode(side[:batch_size], beam_width)
    passes: dict[str, list[float]] = {"full": [], "cached": []}
    results: dict[str, list] = {}
    for _ in progress_bar(range(repeats), desc=f"batch {batch_size}", leave=False):
        for name, side in (("full", full), ("cached", cached)):
            started = time.perf_counter()
            items, calls = [], []
            for start in range(0, len(side), batch_size):
                batch = decoder.decode(side[start : start + batch_size], beam_width)
                items.extend(batch.items)
                calls.extend(s.get("target_calls", 0) for s in batch.stats)
            passes[name].append((time.perf_counter() - started) * 1000.0 / len(side))
            results[name] = items
            results[f"{name}_calls"] = calls
    full_ms, cached_ms = statistics.median(passes["full"]), statistics.median(passes["cached"])
    # Same prompt on both sides: the same items, unless float rounding flips near-ties (as
    # untrained item embeddings of random pretrained-preset models produce): then the scores
    # still agree rank by rank, which ``same_scores_users`` counts.
    pairs = list(zip(results["full"], results["cached"], strict=True))
    same = sum([r for r, _ in a] == [r for r, _ in b] for a, b in pairs)
    gaps = [_rank_score_gap(a, b) for a, b in pairs]
    return {
        "full_prompt_ms": full_ms, "prefix_kv_ms": cached_ms, "speedup": full_ms / cached_ms,
        "same_items_users": same, "users": len(full), "passes_ms": passes,
        "same_scores_users": sum(gap <= SCORE_TOLERANCE for gap in gaps),
        "max_rank_score_gap": max(gaps, default=0.0),
        "target_calls_per_request": float(np.mean(results["cached_calls"])),
    }  # fmt: skip


# Log-probability difference that float32 rounding of the two prefill orders explains.
SCORE_TOLERANCE = 1e-4


def _rank_score_gap(a: list[tuple[int, float]], b: list[tuple[int, float]]) -> float:
    """Largest |score difference| at equal rank (inf when the lists differ in length)."""
    if len(a) != len(b):
        return float("inf")
    return max((abs(x - y) for (_, x), (_, y) in zip(a, b, strict=True)), default=0.0)


def _draft_prefill_ms_per_user(decoder, cached) -> float:
    """What a worker spends once per user and cached prefix on the draft's own prefix KV."""
    if decoder.draft is None:
        return 0.0

    prompts = [r.prefix_kv.prompt_ids for r in cached]
    started = time.perf_counter()
    for prompt in prompts:
        compute_prefix_kv(decoder.draft, [prompt], "timing")
    return (time.perf_counter() - started) * 1000.0 / len(prompts)


def _load_ms_per_user(files: list[Path], model_version: str) -> float:
    started = time.perf_counter()
    for path in files:
        load_prefix_kv(path, model_version)
    elapsed = (time.perf_counter() - started) * 1000.0 / len(files)
    shutil.rmtree(files[0].parent, ignore_errors=True)
    return elapsed


# --- report --------------------------------------------------------------------------


def _print_header(figures: dict, decoder) -> None:
    draft = "none (target only)" if decoder.draft is None else decoder.draft_name
    print("genrec bench serve: prefix-KV serving vs recomputing the full history prompt")
    print(f"  models : {figures['models']}")
    print(f"  decode : mode {figures['mode']}, draft {draft}, beam width {figures['beam_width']}, "
          f"{figures['torch_threads']} torch thread(s) on {figures['device']}")  # fmt: skip
    print(f"  users  : {figures['users']} with the longest histories; prompt "
          f"{figures['mean_prompt_tokens']:.0f} tokens on average, of which the newest "
          f"{figures['suffix_events']} events ({figures['mean_suffix_tokens']:.0f} tokens) are "
          "not in the cache")  # fmt: skip
    print(f"  timing : median of {figures['repeats']} alternating passes, ms per request")
    print(f"{'batch':>6} | {'full prompt':>11} | {'prefix KV':>9} | {'speedup':>7} | "
          f"{'prefix KV + miss':>16} | {'speedup':>7} | target calls | same items")  # fmt: skip


def _print_row(batch_size: int, row: dict) -> None:
    print(f"{batch_size:>6} | {row['full_prompt_ms']:>11.1f} | {row['prefix_kv_ms']:>9.1f} | "
          f"{row['speedup']:>6.2f}x | {row['prefix_kv_with_load_ms']:>16.1f} | "
          f"{row['speedup_with_load']:>6.2f}x | {row['target_calls_per_request']:>12.1f} | "
          f"{row['same_items_users']}/{row['users']} users "
          f"({row['same_scores_users']} same scores)")  # fmt: skip


def _write_outputs(figures: dict, json_path: Path | None, settings) -> None:
    if json_path is not None:
        json_path.write_text(json.dumps(figures, indent=2, default=str))
        print(f"figures written to {json_path}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(figures["batches"])
    x = np.arange(len(sizes))
    figure, axis = plt.subplots(figsize=(6, 3.5))
    for offset, (key, label) in enumerate(
        (("full_prompt_ms", "full prompt"), ("prefix_kv_ms", "prefix KV"),
         ("prefix_kv_with_load_ms", "prefix KV + LRU miss"))
    ):  # fmt: skip
        axis.bar(x + (offset - 1) * 0.27, [figures["batches"][b][key] for b in sizes], 0.27,
                 label=label)  # fmt: skip
    axis.set_xticks(x, [f"batch {b}" for b in sizes])
    axis.set_ylabel("ms per request")
    axis.set_title(f"{figures['models']}\n{figures['mode']} decoding, "
                   f"{figures['mean_prompt_tokens']:.0f}-token prompts", fontsize=9)  # fmt: skip
    axis.legend()
    figure.tight_layout()
    path = settings.path("reports", "bench_serve.png")
    figure.savefig(path, dpi=100)
    plt.close(figure)
    print(f"plot written to {path}")


# --- models and users ------------------------------------------------------------------


def _models_and_histories(
    settings, preset: str, users: int, suffix_events: int, random: bool, history_items: int
):

    engine = make_engine(settings.database_url)
    stored = load_user_histories(engine)
    if stored:
        histories = [[e.item_id for e in h] for h in stored.values()]
    else:
        events = load_ml100k().events
        histories = [list(g.item_id) for _u, g in events.groupby("user_id", sort=False)]
    loaded = None if random else _trained_models(settings, engine)
    if loaded is None:
        item_ids = sorted({i for h in histories for i in h})
        models = _random_models(preset, item_ids, history_items)
        loaded = BenchModels(models, f"random {preset!r} models, H = {history_items} items")
    known = loaded.models.item_tokens.known
    long_first = sorted(histories, key=lambda h: len(known(h)), reverse=True)
    chosen = [h for h in long_first if len(known(h)) > suffix_events][:users]
    if not chosen:
        raise ValueError(f"no user has more than {suffix_events} items with a semantic ID")
    return loaded, chosen


def _trained_models(settings, engine) -> BenchModels | None:
    """The active serving version's model, else the active model version, else None."""

    active = active_serving_version(engine)
    if active is not None and active.model_version is not None:
        models = load_model_version(settings, engine, version=int(active.model_version))
        return BenchModels(models, f"serving version {active.version} (model version "
                           f"{models.version}, preset {models.preset}, H = {models.history_items} "
                           "items)")  # fmt: skip
    try:
        models = load_model_version(settings, engine)
    except NoActiveModels:
        print("no trained model version here: timing random models instead")
        return None
    return BenchModels(models, f"active model version {models.version} (preset {models.preset}, "
                       f"H = {models.history_items} items)")  # fmt: skip


def _random_models(preset_name: str, item_ids: list[str], history_items: int = 50):
    """Fresh models of ``preset_name`` over random unique semantic IDs (3 x 256 + 32 dedup)."""

    preset = get_preset(preset_name)
    codes_per_level = (256, 256, 256, 32)
    if preset.pretrained is not None:
        layout = pretrained_item_layout(codes_per_level)
    else:
        layout = TokenLayout.for_scratch_model(codes_per_level)
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 256, size=(len(item_ids), 3))
    dedup = np.zeros((len(item_ids), 1), dtype=np.int64)
    taken: dict[tuple, int] = {}
    for row, code in enumerate(map(tuple, codes.tolist())):
        dedup[row, 0] = taken.get(code, 0)
        taken[code] = taken.get(code, 0) + 1
    item_tokens = ItemTokens(item_ids, np.concatenate([codes, dedup], axis=1), layout)
    torch.manual_seed(0)
    device = pick_device()
    target = build_target(preset, layout).to(device).eval()
    draft = build_draft(preset, layout).to(device).eval()
    return GenerativeModels(
        target, {"atspeed_s": draft, "atspeed_r": draft}, item_tokens, history_items=history_items,
        preset=preset_name, version=0, device=device,
    )  # fmt: skip
