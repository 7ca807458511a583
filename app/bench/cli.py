"""``genrec bench ...``: the benchmarks that measure side by side and print ratios (app layer).

They load what the lower layers build (trained versions, the store, a local PostgreSQL)
and time it, so they sit at the top: ``bench ingest``, ``bench serve``, ``bench decode``.

Example::

    $ genrec bench decode --ks 10 --batch-sizes 1,8
"""

from __future__ import annotations

import argparse
from pathlib import Path


def register(commands: argparse._SubParsersAction, groups) -> None:
    """Add ``genrec bench ingest``, ``bench serve`` and ``bench decode``."""
    bench = groups.group("bench", "Benchmarks that measure side by side and print ratios")
    bench_ingest = bench.add_parser(
        "ingest",
        help="ingest rate vs a bare kafka-python consumer",
        description="Produce N events to a fresh topic; time a bare consumer and the ingest path.",
    )
    bench_ingest.add_argument("--events", type=int, default=200_000)
    bench_ingest.add_argument(
        "--stores", default="sqlite",
        help="comma-separated: sqlite (a temporary file), postgres (a private local cluster "
        "started for the run, fsync on; needs the PostgreSQL server binaries)",
    )  # fmt: skip
    bench_ingest.add_argument("--json", type=Path, default=None, help="also write the figures here")
    bench_ingest.set_defaults(handler=_bench_ingest)
    bench_serve = bench.add_parser(
        "serve", help="prefix-KV serving vs recomputing the full history prompt",
        description="Side by side in one run, for the same users, prompts and decoder: a request "
        "served from the cached prefix KV (the target prefills only the newest events) vs from "
        "the full history prompt; alternating passes, medians, ms/request and the ratio. Uses "
        "the active serving version's model when there is one, else random --preset models.",
    )  # fmt: skip
    bench_serve.add_argument("--users", type=int, default=32, help="users measured")
    bench_serve.add_argument(
        "--suffix-events", type=int, default=2, help="newest events left out of the cached prefix"
    )
    bench_serve.add_argument("--batch-sizes", default="1,8", help="comma-separated")
    bench_serve.add_argument("--mode", choices=["strict", "relaxed", "target"], default="strict")
    bench_serve.add_argument("--repeats", type=int, default=3, help="alternating passes per side")
    bench_serve.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: online.torch_threads)"
    )
    bench_serve.add_argument(
        "--random", action="store_true", help="time random --preset models even if one is trained"
    )
    bench_serve.add_argument(
        "--preset", default="small", help="model preset timed when no version is trained"
    )
    bench_serve.add_argument(
        "--history-items", type=int, default=50, help="H of random models (trained: their own)"
    )
    bench_serve.add_argument(
        "--beam-width", type=int, default=None,
        help="generative beams (default: the worker's, online.beam_width or 2 x online.k)",
    )  # fmt: skip
    bench_serve.add_argument("--json", type=Path, default=None, help="also write the figures here")
    bench_serve.set_defaults(handler=_bench_serve)
    decode = bench.add_parser(
        "decode", help="HF generate vs target-only vs prefix cache vs speculative strict/relaxed",
        description="For K in --ks and each batch size, time transformers generate on the full "
        "prompt, our target-only beam search (full prompt and prefix cache) and speculative "
        "strict/relaxed from the prefix cache; print ms/request, model calls, acceptance, HR@K "
        "and whether strict equalled target-only; write JSON and a PNG of speed-up vs K.",
    )  # fmt: skip
    decode.add_argument(
        "--preset", default="random",
        help="random, tiny, or a trained preset (small, smollm2-135m: the active model version)",
    )  # fmt: skip
    decode.add_argument("--random", action="store_true", help="random models (preset 'random')")
    decode.add_argument("--users", type=int, default=16, help="users timed per (K, batch size)")
    decode.add_argument("--ks", default="1,5,10,20", help="beam widths, comma-separated")
    decode.add_argument("--batch-sizes", default="1,8", help="comma-separated")
    decode.add_argument("--seed", type=int, default=0)
    decode.add_argument("--threads", type=int, default=1, help="torch threads (1: steadiest)")
    decode.add_argument(
        "--clock", choices=["auto", "cpu", "wall"], default="auto",
        help="process CPU time (robust on a shared machine) or wall time; auto: wall on a "
        "GPU (synchronized), CPU time otherwise",
    )  # fmt: skip
    decode.add_argument(
        "--n-draft", type=int, default=None, help="draft beams N (default: settings)"
    )
    decode.add_argument(
        "--align-steps", type=int, default=150,
        help="distil a random draft towards the random target this many steps first (cached)",
    )  # fmt: skip
    decode.add_argument("--json", type=Path, default=None, help="default: var/bench/decode.json")
    decode.add_argument("--png", type=Path, default=None, help="default: beside the JSON")
    decode.set_defaults(handler=_bench_decode)


def _bench_decode(args: argparse.Namespace) -> int:
    import torch

    from genrec.app.bench.decode import (
        RANDOM_PRESETS,
        align_random_draft,
        load_models,
        print_report,
        run_decode_bench,
    )
    from genrec.infra.errors import UserFacingError
    from genrec.infra.settings import get_settings

    settings = get_settings()
    torch.set_num_threads(args.threads)
    preset = "random" if args.random else args.preset
    try:
        models = load_models(preset, seed=args.seed)
    except ValueError as exc:
        raise UserFacingError(str(exc)) from exc
    if preset in RANDOM_PRESETS:
        cache = settings.path(
            "bench", f"draft-{models.model_version}-{args.align_steps}.safetensors"
        )
        align_random_draft(models, args.align_steps, cache, seed=args.seed)
    json_path = args.json or settings.path("bench", "decode.json")
    report = run_decode_bench(
        models,
        ks=[int(k) for k in args.ks.split(",")],
        batch_sizes=[int(b) for b in args.batch_sizes.split(",")],
        n_users=args.users,
        decode=settings.decode,
        json_path=json_path,
        png_path=args.png or json_path.with_suffix(".png"),
        clock=args.clock,
        n_draft=args.n_draft,
    )
    print_report(report)
    return 0


def _bench_ingest(args: argparse.Namespace) -> int:
    from genrec.app.bench.ingest import run_bench
    from genrec.app.postgres import PostgresUnavailable
    from genrec.infra.errors import UserFacingError
    from genrec.infra.settings import get_settings

    stores = tuple(s.strip() for s in args.stores.split(",") if s.strip())
    try:
        run_bench(get_settings(), n_events=args.events, json_path=args.json, stores=stores)
    except (ValueError, PostgresUnavailable) as exc:
        raise UserFacingError(str(exc)) from exc
    return 0


def _bench_serve(args: argparse.Namespace) -> int:
    from genrec.app.bench.serve import run_serve_bench

    batch_sizes = tuple(int(b) for b in args.batch_sizes.split(",") if b.strip())
    run_serve_bench(
        args.users, args.suffix_events, batch_sizes, args.json, args.preset, args.mode,
        repeats=args.repeats, threads=args.threads, random_models=args.random,
        history_items=args.history_items, beam_width=args.beam_width,
    )  # fmt: skip
    return 0
