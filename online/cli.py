"""Subcommands of the online step: ``genrec serve``."""

from __future__ import annotations

import argparse
import signal
import sys


def register(commands: argparse._SubParsersAction, groups) -> None:
    """Add this step's subcommands to ``genrec``."""
    serve = commands.add_parser(
        "serve",
        help="answer user events with recommendations (the online worker)",
        description="Consume genrec.user-events (group genrec-online), recommend for each user's "
        "latest event and publish to genrec.recommendations; a batch is decoded as soon as the "
        "decoder is free, and its offsets are committed once Kafka has acknowledged all its "
        "answers. SIGTERM/SIGINT finish the batches in hand and exit 0.",
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


def _serve(args: argparse.Namespace) -> int:
    # Imported here, not at the top: torch, kafka and the models load for `genrec serve` only.
    import torch

    from genrec.infra import metrics
    from genrec.infra.database import make_engine
    from genrec.infra.logs import dump_stacks_on_sigusr1
    from genrec.infra.settings import get_settings
    from genrec.online.live_version import (
        ServingVersions,
        active_serving_key,
        load_serving_bundle,
    )
    from genrec.online.recommender import Recommender
    from genrec.online.worker import OnlineWorker

    settings = get_settings()
    torch.set_num_threads(settings.online.torch_threads)
    engine = make_engine(settings.database_url)
    versions = ServingVersions(
        probe=lambda: active_serving_key(engine),
        load=lambda key: load_serving_bundle(settings, engine, key),
        poll_s=settings.online.version_poll_s,
        freeze_gc=True,
    ).start()
    worker = OnlineWorker(settings, Recommender(settings, engine), versions)
    dump_stacks_on_sigusr1()  # kill -USR1: every thread's stack to stderr
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
    if report.fenced:  # a supervisor must not restart this instance while the other runs
        print("stopped: fenced by another worker with the same transactional.id", file=sys.stderr)
        return 3
    return 0
