"""``genrec bench decode``: the decoding engine's benchmark (online decoding step)."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(commands: argparse._SubParsersAction, groups) -> None:
    """Add ``genrec bench decode``."""
    bench = groups.group("bench", "Benchmarks that measure side by side and print ratios")
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

    from genrec.infra.cli import UserFacingError
    from genrec.infra.settings import get_settings
    from genrec.online.decoding_bench import (
        RANDOM_PRESETS,
        align_random_draft,
        load_models,
        print_report,
        run_decode_bench,
    )

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
