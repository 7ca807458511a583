"""Operational subcommands (infra step): the local Kafka broker, topics, the store's indexes.

Example::

    $ genrec kafka up          # prints the bootstrap address once the broker is ready
    $ genrec topics create     # works against any cluster in settings.kafka
    $ genrec store indexes --create   # the indexes a store made by an older release lacks
    $ genrec kafka status      # exit code 0 when running, 3 when stopped
    $ genrec kafka down
"""

from __future__ import annotations

import argparse
from pathlib import Path

from genrec.infra.errors import UserFacingError
from genrec.infra.settings import get_settings

# Handlers import their step's modules when they run, so that `genrec --help` and
# every other command start without torch, transformers, pandas or a database.

STOPPED_EXIT_CODE = 3  # as LSB init scripts' `status`: "program is not running"


def register(commands: argparse._SubParsersAction, groups) -> None:
    """Add ``genrec kafka``, ``genrec topics``, ``genrec store`` and ``genrec demo``."""
    kafka = commands.add_parser(
        "kafka",
        help="run the local single-node Kafka broker (development and tests)",
        description="A real Apache Kafka broker (KRaft, one node) on settings.kafka.bootstrap, "
        "data and logs in DATA_DIR/kafka. Production points settings.kafka at its own cluster.",
    )
    kafka.set_defaults(handler=lambda _args, p=kafka: p.print_help() or 2)
    kafka_commands = kafka.add_subparsers(dest="kafka_command", metavar="COMMAND")
    up = kafka_commands.add_parser("up", help="start the broker (no-op if running), print address")
    up.add_argument("--timeout", type=float, default=None, help="seconds to wait for readiness")
    down = kafka_commands.add_parser("down", help="stop the broker (SIGTERM, then SIGKILL)")
    down.add_argument("--timeout", type=float, default=30.0, help="seconds before SIGKILL")
    status = kafka_commands.add_parser("status", help="running/stopped, pid, address")
    for command, handler in ((up, _kafka_up), (down, _kafka_down), (status, _kafka_status)):
        command.add_argument(
            "--brokers", type=int, default=None,
            help="nodes of a local cluster (default: kafka_broker.brokers, 1)",
        )  # fmt: skip
        command.set_defaults(handler=handler)

    topics = commands.add_parser("topics", help="create genrec's Kafka topics")
    topics.set_defaults(handler=lambda _args, p=topics: p.print_help() or 2)
    topics_commands = topics.add_subparsers(dest="topics_command", metavar="COMMAND")
    create = topics_commands.add_parser(
        "create", help="create the events, recommendations and dead-letter topics if missing"
    )
    create.add_argument(
        "--wait", type=float, default=30.0, help="seconds to wait for the cluster to answer"
    )
    create.set_defaults(handler=_topics_create)

    store = commands.add_parser("store", help="the behavior store's schema: indexes")
    store.set_defaults(handler=lambda _args, p=store: p.print_help() or 2)
    store_commands = store.add_subparsers(dest="store_command", metavar="COMMAND")
    indexes = store_commands.add_parser(
        "indexes",
        help="list the schema's indexes the store lacks, and those it replaced (a store made "
        "by an older release)",
        description="Tables are created if missing, but an index added to an existing table "
        "is not: list the schema's indexes that settings.database_url lacks and the ones the "
        "schema replaced that it still has; with --create build the missing ones, then drop "
        "the replaced ones of each table that has all of its own (CONCURRENTLY on PostgreSQL: "
        "ingest and serve keep running). Exit code 1 when something is left to do.",
    )  # fmt: skip
    indexes.add_argument(
        "--create", action="store_true", help="build the missing indexes, drop the replaced ones"
    )
    indexes.set_defaults(handler=_store_indexes)
    paths = store_commands.add_parser(
        "artifact-paths",
        help="list artifact folders the store names by absolute path (rows of an older "
        "release), and rewrite them relative to the data directory",
        description="Rows written since artifact paths are stored relative to the data "
        "directory move with it; older rows name their folders absolutely. List those, and "
        "with --rewrite store the ones under settings.data_dir relative to it (run it where "
        "the store is, before moving or copying it). Exit code 1 when some are left absolute.",
    )  # fmt: skip
    paths.add_argument("--rewrite", action="store_true", help="store them relative")
    paths.set_defaults(handler=_store_artifact_paths)

    demo = commands.add_parser(
        "demo",
        help="run the whole system on embedded defaults (what `make demo` runs)",
        description="Local Kafka up, replay the first 80% of MovieLens-100K and ingest it, "
        "one offline refresh (small preset), then serve the last 20% replayed at a steady rate "
        "and print online prequential hit rates, latency and throughput.",
    )
    demo.add_argument("--json", type=Path, default=None, help="also write the figures here")
    demo.add_argument(
        "--rate", type=float, default=100.0, help="events/s of the replayed last 20%% (default 100)"
    )
    demo.set_defaults(handler=_demo)


def _broker(args: argparse.Namespace):
    """The single local broker, or with ``--brokers N`` (N > 1) the local cluster."""
    from genrec.app.kafka_broker import KafkaBroker, KafkaCluster

    settings = get_settings()
    brokers = args.brokers if args.brokers is not None else settings.kafka_broker.brokers
    if brokers < 1:
        raise UserFacingError(f"--brokers must be at least 1, got {brokers}")
    if brokers == 1:
        return KafkaBroker.from_settings(settings)
    return KafkaCluster.from_settings(settings, brokers)


def _kafka_up(args: argparse.Namespace) -> int:
    timeout = (
        args.timeout if args.timeout is not None else get_settings().kafka_broker.start_timeout_s
    )
    print(_broker(args).up(timeout=timeout))
    return 0


def _kafka_down(args: argparse.Namespace) -> int:
    broker = _broker(args)
    broker.down(timeout=args.timeout)
    print(_status_lines(broker))
    return 0


def _status_lines(broker) -> str:
    statuses = broker.status()
    if isinstance(statuses, list):
        return "\n".join(f"node {i}: {s}" for i, s in enumerate(statuses, 1))
    return str(statuses)


def _kafka_status(args: argparse.Namespace) -> int:
    broker = _broker(args)
    statuses = broker.status()
    print(f"{_status_lines(broker)}\ndata={broker.data_dir}")
    running = all(s.running for s in statuses) if isinstance(statuses, list) else statuses.running
    return 0 if running else STOPPED_EXIT_CODE


def _topics_create(args: argparse.Namespace) -> int:
    from genrec.infra.kafka_clients import wait_for_kafka
    from genrec.infra.topics import create_topics, topic_specs

    kafka = get_settings().kafka
    wait_for_kafka(kafka, timeout=args.wait)  # KafkaUnreachableError: one line, exit code 2
    created = set(create_topics(kafka))
    for name in topic_specs(kafka):
        print(f"{'created' if name in created else 'exists'} {name}")
    return 0


def _store_indexes(args: argparse.Namespace) -> int:
    from genrec.infra.database import (
        create_indexes,
        drop_replaced_indexes,
        make_engine,
        missing_indexes,
        replaced_indexes,
    )

    engine = make_engine(get_settings().database_url)
    try:
        missing, replaced = missing_indexes(engine), replaced_indexes(engine)
        for index in missing:
            print(f"missing {index.name} on {index.table.name}")
        for table, name in replaced:
            print(f"replaced {name} on {table} (dropped by --create once the table has the rest)")
        if not missing and not replaced:
            print("every index of the schema is there, and none it replaced")
            return 0
        if not args.create:
            return 1
        create_indexes(engine, missing)
        left = {index.name for index in missing_indexes(engine)}
        for index in missing:
            print(f"{'FAILED' if index.name in left else 'built'} {index.name}")
        for table, name in drop_replaced_indexes(engine):
            print(f"dropped {name} on {table}")
        return 1 if left or replaced_indexes(engine) else 0
    finally:
        engine.dispose()


def _store_artifact_paths(args: argparse.Namespace) -> int:
    from genrec.infra.database import absolute_artifact_paths, make_engine

    settings = get_settings()
    engine = make_engine(settings.database_url)
    try:
        found = absolute_artifact_paths(engine, settings.data_dir, rewrite=args.rewrite)
        for table, version, stored, relative in found:
            if relative is None:
                print(f"{table} v{version}: {stored} (outside the data directory: kept)")
            else:
                done = "rewritten" if args.rewrite else "absolute"
                print(f"{table} v{version}: {stored} -> {relative} ({done})")
        if not found:
            print("every artifact folder is stored relative to the data directory")
        left = [row for row in found if row[3] is None or not args.rewrite]
        return 1 if left else 0
    finally:
        engine.dispose()


def _demo(args: argparse.Namespace) -> int:
    from genrec.app.demo import run_demo

    run_demo(get_settings(), json_path=args.json, rate=args.rate)
    return 0
