"""Subcommands of the ingest step: ``genrec ingest`` and ``genrec replay``."""

from __future__ import annotations

import argparse
import signal
from pathlib import Path

from genrec.infra.errors import UserFacingError
from genrec.infra.settings import get_settings


def register(commands: argparse._SubParsersAction, groups) -> None:
    """Add this step's subcommands to ``genrec``."""
    ingest = commands.add_parser(
        "ingest",
        help="consume user events from Kafka into the behavior store",
        description="Consume genrec.user-events (group genrec-ingest) into the store; bad "
        "messages go to the dead-letter topic. SIGTERM/SIGINT finish the batch and exit 0.",
    )
    ingest.add_argument(
        "--exit-when-idle",
        type=float,
        default=None,
        metavar="SECONDS",
        help="stop after this long with no new message",
    )
    ingest.add_argument("--batch-size", type=int, default=None, help="max messages per batch")
    ingest.add_argument("--group", default=None, help="consumer group (default: settings)")
    ingest.add_argument(
        "--metrics-port", type=int, default=None,
        help="serve /metrics and /healthz here (0: a free port; default: ingest.metrics_port, "
        "none when unset)",
    )  # fmt: skip
    ingest.set_defaults(handler=_ingest)

    replay = commands.add_parser(
        "replay",
        help="stream a recorded interaction log into the events topic",
        description="Produce events in stable timestamp order with deterministic ids, and "
        "load the item catalog into the store (--items alone: the catalog only).",
    )
    source = replay.add_mutually_exclusive_group()
    source.add_argument("--dataset", choices=["ml-100k"], help="a bundled dataset")
    source.add_argument(
        "--events",
        type=Path,
        help="CSV or Parquet: user_id, item_id, timestamp[, event_type, value]",
    )
    replay.add_argument("--items", type=Path, help="CSV or Parquet: item_id plus any text columns")
    replay.add_argument(
        "--rate", type=float, default=None, help="events per second (default: unlimited)"
    )
    replay.add_argument(
        "--start", default=None, help="epoch s/ms, ISO time, or fraction 0..1 (inclusive)"
    )
    replay.add_argument(
        "--end", default=None, help="epoch s/ms, ISO time, or fraction 0..1 (exclusive)"
    )
    replay.add_argument("--limit", type=int, default=None, help="at most this many events")
    replay.add_argument("--no-items", action="store_true", help="do not load the item catalog")
    replay.set_defaults(handler=_replay)


def _ingest(args: argparse.Namespace) -> int:
    # Imported here, not at the top: kafka and sqlalchemy load for `genrec ingest` only.
    from genrec.infra import metrics
    from genrec.ingest.consumer import Ingestor

    settings = get_settings()
    if args.batch_size is not None:
        settings = settings.model_copy(deep=True)
        settings.ingest.batch_size = args.batch_size
    ingestor = Ingestor(settings, group_id=args.group)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: ingestor.stop())
    port = args.metrics_port if args.metrics_port is not None else settings.ingest.metrics_port
    server = None
    if port is not None:
        server = metrics.start_metrics_server(port, ingestor.health, settings.ingest.metrics_host)
    try:
        ingestor.run(
            exit_when_idle_s=args.exit_when_idle, progress_every_s=settings.ingest.progress_every_s
        )
    finally:
        if server is not None:
            server.stop()
    return 0


def _replay(args: argparse.Namespace) -> int:
    from genrec.ingest import replay

    settings = get_settings()
    if args.dataset is None and args.events is None:
        return _load_catalog(settings, args)
    if args.dataset == "ml-100k":
        frame, prefix = replay.ml100k_events(), "ml-100k"
        item_rows = None if args.no_items else replay.ml100k_items()
    else:
        frame, prefix = replay.read_table(args.events), args.events.name.split(".")[0]
        item_rows = (
            replay.item_rows(replay.read_table(args.items))
            if args.items and not args.no_items
            else None
        )
    if item_rows:
        count = replay.load_items(settings, item_rows)
        print(f"items: {count:,} upserted into the store")
    result = replay.replay_events(
        settings,
        frame,
        rate=args.rate,
        start=args.start,
        end=args.end,
        limit=args.limit,
        event_id_prefix=prefix,
    )
    print(f"events: {result.produced:,} produced to {settings.kafka.topic_events}")
    return 0


def _load_catalog(settings, args: argparse.Namespace) -> int:
    """``genrec replay --items FILE`` without events: new and changed items for the next refresh."""
    from genrec.ingest import replay

    if args.items is None or args.no_items:
        raise UserFacingError("give --dataset or --events to replay, or --items to load a catalog")
    count = replay.load_items(settings, replay.item_rows(replay.read_table(args.items)))
    print(f"items: {count:,} upserted into the store (no events replayed)")
    return 0
