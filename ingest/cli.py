"""Subcommands of the ingest step: ``genrec ingest``, ``genrec replay`` and ``genrec synthetic``."""

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
        "load the item catalog into the store (--items alone: the catalog only). Files are "
        "read ingest.replay_chunk_rows rows at a time; a log out of time order is sorted "
        "in runs spilled under DATA_DIR/tmp (docs/ingest.md).",
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

    synthetic = commands.add_parser(
        "synthetic",
        help="generate a synthetic workload (Parquet for replay, or straight to Kafka)",
        description="A deterministic interaction log shaped like real traffic: Zipf-like item "
        "popularity, heavy-tailed user activity, sessions about a few drifting interests per "
        "user, items with category, brand and template text (docs/synthetic.md). Generated "
        "and written in row groups: memory grows with users and items (and 2 bytes per event "
        "for the filter of pairs already drawn), never holding the event log.",
    )
    synthetic.add_argument("--users", type=int, required=True, help="user population")
    synthetic.add_argument("--items", type=int, required=True, help="catalog size")
    synthetic.add_argument("--events", type=int, required=True, help="events to generate")
    synthetic.add_argument("--seed", type=int, default=0, help="same seed and sizes: same bytes")
    synthetic.add_argument(
        "--no-text", action="store_true", help="items without title and genres (opaque codes)"
    )
    synthetic.add_argument(
        "--reconsume-rate", type=float, default=0.05,
        help="share of events that repeat an item the user already had (default 0.05)",
    )  # fmt: skip
    synthetic.add_argument("--days", type=float, default=90.0, help="timeline length (default 90)")
    synthetic.add_argument(
        "--row-group-size", type=int, default=500_000, help="events per Parquet row group"
    )
    target = synthetic.add_mutually_exclusive_group(required=True)
    target.add_argument(
        "--out", type=Path, help="write DIR/events.parquet and DIR/items.parquet (for replay)"
    )
    target.add_argument(
        "--kafka", action="store_true",
        help="instead: upsert the catalog into the store and produce the events to the topic",
    )  # fmt: skip
    synthetic.set_defaults(handler=_synthetic)


def _ingest(args: argparse.Namespace) -> int:
    # Imported here, not at the top: kafka and sqlalchemy load for `genrec ingest` only.
    from genrec.infra import metrics
    from genrec.infra.logs import dump_stacks_on_sigusr1
    from genrec.ingest.consumer import Ingestor

    settings = get_settings()
    if args.batch_size is not None:
        settings = settings.model_copy(deep=True)
        settings.ingest.batch_size = args.batch_size
    ingestor = Ingestor(settings, group_id=args.group)
    dump_stacks_on_sigusr1()  # kill -USR1: every thread's stack to stderr
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
        events, prefix = replay.ml100k_events(), "ml-100k"
        if not args.no_items:
            count = replay.load_items(settings, replay.ml100k_items())
            print(f"items: {count:,} upserted into the store")
    else:
        # Files are streamed a chunk at a time (ingest.replay_chunk_rows), never read whole.
        events, prefix = replay.TableSource(args.events), args.events.name.split(".")[0]
        if args.items and not args.no_items:
            count = replay.load_item_file(settings, args.items)
            print(f"items: {count:,} upserted into the store")
    result = replay.replay_events(
        settings,
        events,
        rate=args.rate,
        start=args.start,
        end=args.end,
        limit=args.limit,
        event_id_prefix=prefix,
    )
    print(f"events: {result.produced:,} produced to {settings.kafka.topic_events}")
    return 0


def _synthetic(args: argparse.Namespace) -> int:
    import time

    from genrec.infra.progress import progress_bar
    from genrec.ingest import synthetic

    try:
        config = synthetic.SyntheticConfig(
            users=args.users,
            items=args.items,
            events=args.events,
            seed=args.seed,
            text=not args.no_text,
            reconsume_rate=args.reconsume_rate,
            days=args.days,
            row_group_size=args.row_group_size,
        )
    except ValueError as exc:
        raise UserFacingError(f"synthetic: {exc}") from None
    began = time.monotonic()
    with progress_bar(total=config.events, desc="synthetic", unit="ev") as bar:
        if args.kafka:
            settings = get_settings()
            count = synthetic.stream(settings, config, on_events=bar.update)
            where = f"produced to {settings.kafka.topic_events} (catalog upserted into the store)"
        else:
            files = synthetic.generate(config, args.out, on_events=bar.update)
            count, where = files.event_count, f"written to {files.events} and {files.items}"
    seconds = time.monotonic() - began
    print(f"events: {count:,} {where} in {seconds:.1f} s ({count / max(seconds, 1e-9):,.0f}/s)")
    return 0


def _load_catalog(settings, args: argparse.Namespace) -> int:
    """``genrec replay --items FILE`` without events: new and changed items for the next refresh."""
    from genrec.ingest import replay

    if args.items is None or args.no_items:
        raise UserFacingError("give --dataset or --events to replay, or --items to load a catalog")
    count = replay.load_item_file(settings, args.items)
    print(f"items: {count:,} upserted into the store (no events replayed)")
    return 0
