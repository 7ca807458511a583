"""Subcommands of the online step: ``genrec serve`` and ``genrec bench serve``."""

from __future__ import annotations

import argparse
import signal
from pathlib import Path


def register(commands: argparse._SubParsersAction, groups) -> None:
    """Add this step's subcommands to ``genrec``."""
    serve = commands.add_parser(
        "serve",
        help="answer user events with recommendations (the online worker)",
        description="Consume genrec.user-events (group genrec-online), recommend for each user's "
        "latest event and publish to genrec.recommendations; offsets are committed after Kafka "
        "acknowledges. SIGTERM/SIGINT finish the batch in hand and exit 0.",
    )
    serve.add_argument(
        "--exit-when-idle",
        type=float,
        default=None,
        metavar="SECONDS",
        help="stop after this long with no new event",
    )
    serve.add_argument("--max-requests", type=int, default=None, help="stop after this many")
    serve.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="port of /metrics and /healthz (0: a free one; default: settings)",
    )
    serve.add_argument("--no-metrics", action="store_true", help="do not serve /metrics")
    serve.set_defaults(handler=_serve)

    bench = groups.group("bench", "Benchmarks that measure side by side and print ratios")
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
    bench_serve.set_defaults(handler=_bench)


def _serve(args: argparse.Namespace) -> int:
    import torch

    from genrec.infra import metrics
    from genrec.infra.database import make_engine
    from genrec.infra.settings import get_settings
    from genrec.online.recommender import Recommender
    from genrec.online.serving_version import (
        ServingVersions,
        active_serving_key,
        load_serving_bundle,
    )
    from genrec.online.worker import OnlineWorker

    settings = get_settings()
    torch.set_num_threads(settings.online.torch_threads)
    engine = make_engine(settings.database_url)
    versions = ServingVersions(
        probe=lambda: active_serving_key(engine),
        load=lambda key: load_serving_bundle(settings, engine, key),
        poll_s=settings.online.version_poll_s,
    ).start()
    worker = OnlineWorker(settings, Recommender(settings, engine), versions)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, worker.request_stop)
    port = args.metrics_port if args.metrics_port is not None else settings.online.metrics_port
    server = None
    if port is not None and not args.no_metrics:
        server = metrics.start_metrics_server(port, worker.health, settings.online.metrics_host)
    try:
        report = worker.run(exit_when_idle_s=args.exit_when_idle, max_requests=args.max_requests)
    finally:
        versions.stop()
        if server is not None:
            server.stop()
    print(f"served {report.requests:,} requests ({report.events:,} events) in "
          f"{report.batches:,} batches; versions {report.versions}")  # fmt: skip
    return 0


def _bench(args: argparse.Namespace) -> int:
    from genrec.online.bench import run_serve_bench

    batch_sizes = tuple(int(b) for b in args.batch_sizes.split(",") if b.strip())
    run_serve_bench(
        args.users, args.suffix_events, batch_sizes, args.json, args.preset, args.mode,
        repeats=args.repeats, threads=args.threads, random_models=args.random,
        history_items=args.history_items, beam_width=args.beam_width,
    )  # fmt: skip
    return 0
