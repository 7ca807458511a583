"""``genrec bench ...``: the benchmarks that measure side by side and print ratios (app layer).

They load what the lower layers build (trained versions, the store, a local PostgreSQL)
and time it, so they sit at the top: ``bench ingest``, ``bench serve``, ``bench decode``,
``bench load``, ``bench prefix-kv``, ``bench prefix-kv-read``, ``bench refresh-executor``,
``bench scale``, ``bench sessions``, ``bench prompt-limits``.

Example::

    $ genrec bench decode --ks 10 --batch-sizes 1,8
    $ genrec bench load --workers 1,2
    $ genrec bench prefix-kv --next-days 7
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import get_args

from genrec.infra.errors import UserFacingError
from genrec.infra.settings import CompileMode, DecodeDtype, get_settings

# Handlers import their step's modules when they run, so that `genrec --help` and
# every other command start without torch, transformers, pandas or a database.


def register(commands: argparse._SubParsersAction, groups) -> None:
    """Add ``genrec bench ingest``, ``bench serve``, ``bench decode``, ``bench load`` and
    ``bench prefix-kv``."""
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
    add_runtime_args(decode)
    decode.add_argument("--json", type=Path, default=None, help="default: var/bench/decode.json")
    decode.add_argument("--png", type=Path, default=None, help="default: beside the JSON")
    decode.set_defaults(handler=_bench_decode)
    _register_load(bench)
    _register_prefix_kv(bench)
    _register_prefix_kv_read(bench)
    _register_refresh_executor(bench)
    _register_scale(bench)
    _register_sessions(bench)
    _register_prompt_limits(bench)


def add_runtime_args(parser: argparse.ArgumentParser) -> None:
    """--dtype and --compile: the decoding runtime (online/models/runtime.py)."""
    parser.add_argument(
        "--dtype", choices=get_args(DecodeDtype), default=None,
        help="the models' number format while decoding (default: settings decode.dtype)",
    )  # fmt: skip
    parser.add_argument(
        "--compile", choices=get_args(CompileMode), default=None,
        help="torch.compile the decoder stacks; reduce-overhead: CUDA graphs on a GPU "
        "(default: settings decode.compile)",
    )  # fmt: skip


def _register_load(bench: argparse._SubParsersAction) -> None:
    load = bench.add_parser(
        "load", help="open-loop load through Kafka against genrec serve workers",
        description="Produce events of store users at offered rates that step up (doubling, "
        "open loop: send times fixed by the schedule) against genrec serve workers it starts "
        "(1, then 2, beside one genrec ingest) or already running ones (--no-start); consume "
        "genrec.recommendations and print per step answered events/s, requests/s, p50/p95/p99/"
        "max event-to-recommendation latency, unanswered events and worker CPU; stop after "
        "the first step that overloads; write JSON and a PNG of latency vs throughput.",
    )  # fmt: skip
    load.add_argument(
        "--rates", default=None,
        help="offered events/s per step, comma-separated (default: 25 doubling to 3200)",
    )  # fmt: skip
    load.add_argument(
        "--steps-per-doubling", type=int, default=1,
        help="without --rates: steps from one doubling to the next (2: 25, 35, 50, 71, 100, "
        "...), for a finer held rate and 2-worker / 1-worker ratio",
    )  # fmt: skip
    load.add_argument("--step-s", type=float, default=30.0, help="seconds per step")
    load.add_argument(
        "--drain-s", type=float, default=30.0, help="after a step: wait this long for answers"
    )
    load.add_argument("--p99-ms", type=float, default=100.0, help="a step overloads above this p99")
    load.add_argument("--workers", default="1,2", help="worker counts to start, comma-separated")
    load.add_argument(
        "--no-start", action="store_true",
        help="drive genrec serve workers that already run (and their genrec ingest)",
    )  # fmt: skip
    load.add_argument(
        "--worker-pids", default="",
        help="with --no-start: comma-separated pids of those workers, for their CPU",
    )  # fmt: skip
    load.add_argument(
        "--guarantees", default="",
        help="processing guarantees of the started workers, e.g. at_least_once,exactly_once: "
        "every worker count with each, side by side (default: online.processing_guarantee)",
    )  # fmt: skip
    load.add_argument("--users", type=int, default=None, help="store users sampled (default: all)")
    load.add_argument(
        "--warmup-events", type=int, default=40, help="warm-up events per worker before step 1"
    )
    load.add_argument(
        "--refresh", action="store_true",
        help="before each started phase, refresh the prefix KVs (genrec offline refresh "
        "--no-semantic-ids): a store that moved on since its last refresh makes every "
        "request prefill a longer suffix",
    )  # fmt: skip
    load.add_argument(
        "--keep-events", action="store_true",
        help="leave the bench's events in the behavior store (default: each phase's are "
        "deleted after it, so every phase and run meets the store as the first found it)",
    )  # fmt: skip
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--json", type=Path, default=None, help="default: var/bench/load.json")
    load.add_argument("--png", type=Path, default=None, help="default: beside the JSON")
    load.add_argument(
        "--append", action="store_true",
        help="keep the JSON's phases of other worker counts (e.g. a --no-start run per count)",
    )  # fmt: skip
    load.set_defaults(handler=_bench_load)


def _register_prefix_kv(bench: argparse._SubParsersAction) -> None:
    prefix_kv = bench.add_parser(
        "prefix-kv", help="share of requests served from a prefix under KV budgets",
        description="Cut the store --next-days before its newest event, run the refresh's "
        "prefix-KV step up to there (unlimited float32, unlimited float16, then budgets of "
        "--budgets x the float16 bytes, newest first and by user id) into a temporary KV "
        "store, replay the events after the cutoff and print the share whose user has a "
        "cache; write JSON and a PNG of coverage vs budget. The store is only read.",
    )  # fmt: skip
    prefix_kv.add_argument(
        "--data-dir", type=Path, default=None,
        help="a store folder (genrec.db and its artifacts; default: the demo's, "
        "DATA_DIR/demo, when it exists, else the configured store)",
    )  # fmt: skip
    prefix_kv.add_argument(
        "--ml100k", action="store_true",
        help="MovieLens-100K ingested into a temporary store, random --preset models",
    )  # fmt: skip
    prefix_kv.add_argument("--next-days", type=float, default=7.0, help="days replayed")
    prefix_kv.add_argument(
        "--budgets", default="0.5,0.25,0.1",
        help="budgets as shares of the unlimited float16 bytes, comma-separated",
    )  # fmt: skip
    prefix_kv.add_argument(
        "--random", action="store_true", help="random --preset models even if one is trained"
    )
    prefix_kv.add_argument("--preset", default="small", help="preset of random models")
    prefix_kv.add_argument(
        "--history-items", type=int, default=None, help="H of random models (default: settings)"
    )
    prefix_kv.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: refresh.torch_threads)"
    )
    prefix_kv.add_argument("--out", type=Path, default=None, help="default: var/bench/prefix-kv")
    prefix_kv.set_defaults(handler=_bench_prefix_kv)


def _register_prefix_kv_read(bench: argparse._SubParsersAction) -> None:
    kv_read = bench.add_parser(
        "prefix-kv-read", help="a batch of users' prefix KVs read from local files vs Redis",
        description="Write the same random caches (a preset's KV shape) to the local backend "
        "and to Redis, then time load_many of --users users, alternating the two stores: "
        "median ms per batch, MB per batch and the Redis / local ratio, per preset.",
    )  # fmt: skip
    kv_read.add_argument("--users", type=int, default=32, help="users per batch")
    kv_read.add_argument("--batches", type=int, default=4, help="distinct batches of users")
    kv_read.add_argument("--repeats", type=int, default=10, help="passes over every batch")
    kv_read.add_argument("--presets", default="small", help="comma-separated model presets")
    kv_read.add_argument("--tokens", type=int, default=169, help="prompt tokens per user")
    kv_read.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32")
    kv_read.add_argument(
        "--redis", choices=["local", "configured"], default="local",
        help="local: a redis-server started for the run on loopback; configured: the "
        "[redis] settings (keys under their prefix, removed afterwards)",
    )  # fmt: skip
    kv_read.add_argument("--json", type=Path, default=None, help="also write the figures here")
    kv_read.set_defaults(handler=_bench_prefix_kv_read)


def _register_sessions(bench: argparse._SubParsersAction) -> None:
    sessions = bench.add_parser(
        "sessions", help="long sessions between refreshes: kept prompts vs none, side by side",
        description="Users who keep sending events, served in turn three ways from the active "
        "serving version: kept prompts (online.max_prompt_items as set), kept prompts limited "
        "to H items, no kept prompts. Histories in memory (the store is not written); per way "
        "ms per request, tokens prefilled and the time over the first way's.",
    )  # fmt: skip
    sessions.add_argument("--users", type=int, default=40, help="store users (a seeded sample)")
    sessions.add_argument("--events", type=int, default=40, help="new events per user")
    sessions.add_argument("--batch-users", type=int, default=4, help="users per request batch")
    sessions.add_argument("--seed", type=int, default=0)
    sessions.add_argument("--json", type=Path, default=None, help="also write the figures here")
    sessions.set_defaults(handler=_bench_sessions)


def _bench_sessions(args: argparse.Namespace) -> int:
    from genrec.app.bench.sessions import print_report, run_sessions_bench

    def run(settings, engine, bundle) -> dict:
        return run_sessions_bench(
            settings, engine, bundle, users=args.users, events=args.events,
            batch_users=args.batch_users, seed=args.seed,
        )  # fmt: skip

    return _run_serving_bench(run, print_report, args.json)


def _register_prompt_limits(bench: argparse._SubParsersAction) -> None:
    limits = bench.add_parser(
        "prompt-limits", help="events since the refresh replayed per online.max_prompt_items",
        description="Replay the events stored after the serving prefix-KV cutoff through one "
        "Recommender per --limits value (online.max_prompt_items), each event served by every "
        "limit in turn from in-memory histories (the store is not written); per limit the "
        "prequential HR@k of the generative and merged lists, ms per request and the time "
        "over the first limit's.",
    )  # fmt: skip
    limits.add_argument("--limits", default="50,75,100", help="items, comma-separated")
    limits.add_argument("--max-events", type=int, default=20_000, help="events replayed")
    limits.add_argument("--json", type=Path, default=None, help="also write the figures here")
    limits.set_defaults(handler=_bench_prompt_limits)


def _bench_prompt_limits(args: argparse.Namespace) -> int:
    from genrec.app.bench.prompt_limits import print_report, run_prompt_limits_bench

    def run(settings, engine, bundle) -> dict:
        values = [int(v) for v in args.limits.split(",") if v.strip()]
        return run_prompt_limits_bench(settings, engine, bundle, values, args.max_events)

    return _run_serving_bench(run, print_report, args.json)


def _run_serving_bench(run, print_report, json_path: Path | None) -> int:
    """A bench of the active serving version: ``run(settings, engine, bundle)``'s report,
    printed, and written to ``json_path`` as JSON; a ValueError is the user's to fix."""
    import torch

    from genrec.app.bench.sessions import serving_bundle
    from genrec.infra.database import make_engine

    settings = get_settings()
    torch.set_num_threads(settings.online.torch_threads)
    engine = make_engine(settings.database_url)
    try:
        report = run(settings, engine, serving_bundle(settings, engine))
    except ValueError as exc:
        raise UserFacingError(str(exc)) from exc
    finally:
        engine.dispose()
    print_report(report)
    if json_path:
        json_path.write_text(json.dumps(report, indent=2) + "\n")
    return 0


def _bench_prefix_kv_read(args: argparse.Namespace) -> int:
    from genrec.app.bench.kv_read import measure_preset, print_report
    from genrec.app.redis_server import RedisUnavailable

    settings = get_settings()
    redis_settings = settings.redis if args.redis == "configured" else None
    figures = []
    for preset in [p.strip() for p in args.presets.split(",") if p.strip()]:
        try:
            figures.append(measure_preset(
                preset, users=args.users, batches=args.batches, repeats=args.repeats,
                tokens=args.tokens, dtype=args.dtype, redis_settings=redis_settings,
            ))  # fmt: skip
        except (ValueError, RedisUnavailable) as exc:
            raise UserFacingError(str(exc)) from exc
    print_report(figures)
    if args.json:
        args.json.write_text(json.dumps([f.to_dict() for f in figures], indent=2) + "\n")
    return 0


def _bench_prefix_kv(args: argparse.Namespace) -> int:
    import tempfile

    import torch

    from genrec.app.bench.prefix_kv import (
        bench_models,
        ml100k_store,
        print_report,
        run_prefix_kv_bench,
        write_outputs,
    )
    from genrec.infra.database import make_engine

    settings = get_settings()
    torch.set_num_threads(args.threads or settings.refresh.torch_threads)
    fractions = [float(f) for f in args.budgets.split(",") if f.strip()]
    if not fractions or not all(0 < f < 1 for f in fractions):
        raise UserFacingError("--budgets: shares between 0 and 1, e.g. 0.5,0.25,0.1")
    out_dir = args.out or settings.path("bench", "prefix-kv")
    with tempfile.TemporaryDirectory(prefix="genrec-bench-store-") as scratch:
        store = Path(scratch) if args.ml100k else args.data_dir
        if store is None and (settings.data_dir / "demo" / "genrec.db").exists():
            store = settings.data_dir / "demo"
        if store is not None and not args.ml100k and not (store / "genrec.db").exists():
            raise UserFacingError(f"--data-dir: no store (genrec.db) in {store}")
        if store is not None:
            settings = settings.model_copy(update={
                "data_dir": store.resolve(), "database_url": f"sqlite:///{store / 'genrec.db'}"})  # fmt: skip
        engine = ml100k_store(store) if args.ml100k else make_engine(str(settings.database_url))
        history_items = args.history_items or settings.model.history_items
        models, source = bench_models(
            settings, engine, args.preset, history_items, args.random or args.ml100k
        )
        try:
            report = run_prefix_kv_bench(settings, engine, models, next_days=args.next_days,
                                         budget_fractions=fractions, source=source)  # fmt: skip
        except ValueError as exc:  # an empty store, no event in the window
            raise UserFacingError(str(exc)) from exc
        finally:
            engine.dispose()
    print_report(report)
    json_path, png_path = write_outputs(report, out_dir)
    print(f"prefix-kv: wrote {json_path} and {png_path}")
    return 0


def _bench_decode(args: argparse.Namespace) -> int:
    import torch

    from genrec.app.bench.decode import (
        RANDOM_PRESETS,
        align_random_draft,
        load_models,
        print_report,
        run_decode_bench,
    )
    from genrec.online.models.runtime import apply_runtime

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
    runtime = apply_runtime(
        models, args.dtype or settings.decode.dtype, args.compile or settings.decode.compile
    )
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
        runtime=runtime,
    )
    print_report(report)
    return 0


def _bench_load(args: argparse.Namespace) -> int:
    from genrec.app.bench.load import (
        LoadConfig,
        merge_reports,
        print_summary,
        run_load_bench,
        write_report,
    )

    settings = get_settings()
    try:
        config = LoadConfig(
            rates=tuple(float(r) for r in (args.rates or "").split(",") if r.strip()),
            steps_per_doubling=args.steps_per_doubling,
            step_s=args.step_s, drain_s=args.drain_s, p99_ms=args.p99_ms,
            workers=tuple(int(w) for w in args.workers.split(",") if w.strip()),
            start=not args.no_start,
            worker_pids=tuple(int(p) for p in args.worker_pids.split(",") if p.strip()),
            users=args.users, warmup_events=args.warmup_events, seed=args.seed,
            guarantees=tuple(g.strip() for g in args.guarantees.split(",") if g.strip()),
            refresh=args.refresh, keep_events=args.keep_events,
        )  # fmt: skip
    except ValueError as exc:  # --refresh with --no-start, --steps-per-doubling 0
        raise UserFacingError(f"bench load: {exc}") from exc
    unknown = set(config.guarantees) - {"at_least_once", "exactly_once"}
    if unknown:
        raise UserFacingError(f"--guarantees: unknown {sorted(unknown)}")
    json_path = args.json or settings.path("bench", "load.json")
    try:
        report = run_load_bench(settings, config)
    except (ValueError, TimeoutError) as exc:  # an empty store, workers that never answer
        raise UserFacingError(str(exc)) from exc
    if args.append and json_path.exists():
        report = merge_reports(json.loads(json_path.read_text()), report)
    write_report(report, json_path, args.png or json_path.with_suffix(".png"))
    print_summary(report)
    print(f"load: wrote {json_path}")
    return 0


def _bench_ingest(args: argparse.Namespace) -> int:
    from genrec.app.bench.ingest import run_bench
    from genrec.app.postgres import PostgresUnavailable

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


def _register_refresh_executor(bench: argparse._SubParsersAction) -> None:
    executor = bench.add_parser(
        "refresh-executor", help="the refresh's prefix-KV step on offline.executor local vs ray",
        description="Side by side in one run: the refresh's prefix-KV step for every active "
        "user of the store (nothing reused), with offline.executor = local and = ray "
        "(offline.ray_address, or a local Ray started for the run), alternating, into "
        "scratch KV stores; seconds, users/s, the ray / local ratio and whether both wrote "
        "the same caches. The store is only read.",
    )  # fmt: skip
    executor.add_argument(
        "--data-dir", type=Path, default=None,
        help="a store folder (genrec.db and its artifacts; default: the demo's, "
        "DATA_DIR/demo, when it exists, else the configured store)",
    )  # fmt: skip
    executor.add_argument(
        "--ml100k", action="store_true",
        help="MovieLens-100K (--max-users of it) in a temporary store, random --preset models",
    )  # fmt: skip
    executor.add_argument("--max-users", type=int, default=None, help="with --ml100k: users 1..N")
    executor.add_argument(
        "--random", action="store_true", help="random --preset models even if one is trained"
    )
    executor.add_argument("--preset", default="small", help="preset of random models")
    executor.add_argument("--repeats", type=int, default=2, help="runs per executor, alternating")
    executor.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: refresh.torch_threads)"
    )
    executor.add_argument(
        "--actor-threads", type=int, default=None,
        help="torch threads per Ray actor (default: --threads / actors)",
    )  # fmt: skip
    executor.add_argument("--json", type=Path, default=None, help="also write the figures here")
    executor.set_defaults(handler=_bench_refresh_executor)


def _bench_refresh_executor(args: argparse.Namespace) -> int:
    import tempfile

    import torch

    from genrec.app.bench.prefix_kv import bench_models
    from genrec.app.bench.refresh_executor import (
        ml100k_users_store,
        print_report,
        run_executor_bench,
    )
    from genrec.infra.database import make_engine

    settings = get_settings()
    threads = args.threads or settings.refresh.torch_threads
    torch.set_num_threads(threads)
    refresh = settings.refresh.model_copy(update={"torch_threads": threads})
    settings = settings.model_copy(update={"refresh": refresh})
    with tempfile.TemporaryDirectory(prefix="genrec-bench-store-") as scratch:
        store = Path(scratch) if args.ml100k else args.data_dir
        if store is None and (settings.data_dir / "demo" / "genrec.db").exists():
            store = settings.data_dir / "demo"
        if store is not None and not args.ml100k and not (store / "genrec.db").exists():
            raise UserFacingError(f"--data-dir {store}: no genrec.db there")
        if store is not None:
            settings = settings.model_copy(update={
                "data_dir": store.resolve(), "database_url": f"sqlite:///{store / 'genrec.db'}"})  # fmt: skip
        if args.ml100k:
            engine = ml100k_users_store(store, args.max_users)
        else:
            engine = make_engine(str(settings.database_url))
        models, source = bench_models(settings, engine, args.preset, settings.model.history_items,
                                      args.random or args.ml100k)  # fmt: skip
        try:
            report = run_executor_bench(settings, engine, models, repeats=args.repeats,
                                        actor_threads=args.actor_threads, source=source)  # fmt: skip
        except ValueError as exc:  # an empty store
            raise UserFacingError(str(exc)) from exc
        finally:
            engine.dispose()
    print_report(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


def _register_scale(bench: argparse._SubParsersAction) -> None:
    scale = bench.add_parser(
        "scale", help="every pipeline stage at growing sizes, each in a fresh store",
        description="For each USERS:ITEMS:EVENTS size: a fresh store, genrec synthetic, then "
        "each stage as its own process (replay, ingest, semantic IDs, FAISS, trie, recall, "
        "training, refresh with prefix KV and activation, one serving batch, eval); wall "
        "time, CPU, peak RSS of every process, store bytes, the stage's own figures and the "
        "growth exponent between sizes; JSON and a log-log PNG (docs/scale.md).",
    )  # fmt: skip
    scale.add_argument(
        "--sizes", default=None,
        help="comma-separated USERS:ITEMS:EVENTS with k/M suffixes "
        "(default: 10k:10k:200k,100k:100k:2M,1M:1M:20M)",
    )  # fmt: skip
    scale.add_argument(
        "--stages", default="",
        help="comma-separated subset (the stages they need are added): synthetic, replay, "
        "ingest, semantic-ids, faiss, trie, recall, train, refresh, serve, eval",
    )  # fmt: skip
    scale.add_argument("--no-text", action="store_true", help="items without text (SVD vectors)")
    scale.add_argument("--preset", default=None, help="training preset (default: model.preset)")
    scale.add_argument(
        "--train-max-steps", type=int, default=None, help="cap target optimizer steps"
    )
    scale.add_argument(
        "--eval-users", type=int, default=2000, help="genrec eval --max-users (0: every user)"
    )
    scale.add_argument("--serve-batch", type=int, default=32, help="users per serving batch")
    scale.add_argument(
        "--stage-timeout-s", type=float, default=3600.0, help="a stage running longer is stopped"
    )
    scale.add_argument(
        "--kafka", choices=["local", "configured"], default="local",
        help="local: a private broker started for the run on free ports; configured: "
        "kafka.bootstrap (each size gets topics of its own)",
    )  # fmt: skip
    scale.add_argument(
        "--keep-stores", action="store_true", help="keep each size's store and Parquet files"
    )
    scale.add_argument(
        "--resume", action="store_true",
        help="run each size on its store kept by an earlier --keep-stores run in the same "
        "--out, skipping the stages that were ok there (implies --keep-stores)",
    )  # fmt: skip
    scale.add_argument("--seed", type=int, default=0)
    scale.add_argument("--out", type=Path, default=None, help="default: var/bench/scale")
    scale.add_argument("--json", type=Path, default=None, help="default: OUT/scale.json")
    scale.add_argument("--png", type=Path, default=None, help="default: beside the JSON")
    scale.add_argument(
        "--append", action="store_true",
        help="keep the JSON's rows of other sizes (a size run later, e.g. a stage subset): "
        "exponents and verdicts over all of them",
    )  # fmt: skip
    scale.set_defaults(handler=_bench_scale)


def _bench_scale(args: argparse.Namespace) -> int:
    from genrec.app.bench.scale import (
        DEFAULT_SIZES,
        ResumeMismatch,
        ScaleConfig,
        merge_reports,
        parse_sizes,
        print_report,
        run_scale_bench,
        select_stages,
        write_outputs,
    )

    settings = get_settings()
    stages = tuple(s.strip() for s in args.stages.split(",") if s.strip())
    try:
        sizes = tuple(parse_sizes(args.sizes or DEFAULT_SIZES))
        select_stages(stages)
    except ValueError as exc:
        raise UserFacingError(f"bench scale: {exc}") from exc
    config = ScaleConfig(
        sizes=sizes, stages=stages, text=not args.no_text, preset=args.preset,
        train_max_steps=args.train_max_steps, eval_users=args.eval_users or None,
        serve_batch=args.serve_batch, stage_timeout_s=args.stage_timeout_s,
        seed=args.seed, kafka=args.kafka, keep_stores=args.keep_stores or args.resume,
        resume=args.resume,
    )  # fmt: skip
    out_dir = (args.out or settings.path("bench", "scale")).resolve()
    try:
        report = run_scale_bench(settings, config, out_dir)
    except ResumeMismatch as exc:
        raise UserFacingError(f"bench scale: {exc}") from exc
    json_path = args.json or out_dir / "scale.json"
    if args.append and json_path.exists():
        report = merge_reports(json.loads(json_path.read_text()), report)
    write_outputs(report, json_path, args.png or json_path.with_suffix(".png"))
    print_report(report)
    print(f"scale: wrote {json_path} and {args.png or json_path.with_suffix('.png')}")
    return 0
