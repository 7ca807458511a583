"""Operational subcommands (infra step): the local Kafka broker and topic creation.

Example::

    $ genrec kafka up          # prints the bootstrap address once the broker is ready
    $ genrec topics create     # works against any cluster in settings.kafka
    $ genrec kafka status      # exit code 0 when running, 3 when stopped
    $ genrec kafka down
"""

from __future__ import annotations

import argparse
from pathlib import Path

from genrec.infra.settings import get_settings

# Handlers import their step's modules when they run, so that `genrec --help` and
# every other command start without torch, transformers, pandas or a database.

STOPPED_EXIT_CODE = 3  # as LSB init scripts' `status`: "program is not running"


def register(commands: argparse._SubParsersAction, groups) -> None:
    """Add ``genrec kafka`` and ``genrec topics``."""
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
    up.set_defaults(handler=_kafka_up)
    down = kafka_commands.add_parser("down", help="stop the broker (SIGTERM, then SIGKILL)")
    down.add_argument("--timeout", type=float, default=30.0, help="seconds before SIGKILL")
    down.set_defaults(handler=_kafka_down)
    status = kafka_commands.add_parser("status", help="running/stopped, pid, address")
    status.set_defaults(handler=_kafka_status)

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


def _broker():
    from genrec.app.kafka_broker import KafkaBroker

    return KafkaBroker.from_settings(get_settings())


def _kafka_up(args: argparse.Namespace) -> int:
    timeout = (
        args.timeout if args.timeout is not None else get_settings().kafka_broker.start_timeout_s
    )
    print(_broker().up(timeout=timeout))
    return 0


def _kafka_down(args: argparse.Namespace) -> int:
    broker = _broker()
    broker.down(timeout=args.timeout)
    print(broker.status())
    return 0


def _kafka_status(args: argparse.Namespace) -> int:
    broker = _broker()
    status = broker.status()
    print(f"{status} data={broker.data_dir}")
    return 0 if status.running else STOPPED_EXIT_CODE


def _topics_create(args: argparse.Namespace) -> int:
    from genrec.infra.kafka_clients import wait_for_kafka
    from genrec.infra.topics import create_topics, topic_specs

    kafka = get_settings().kafka
    wait_for_kafka(kafka, timeout=args.wait)  # KafkaUnreachableError: one line, exit code 2
    created = set(create_topics(kafka))
    for name, spec in topic_specs(kafka).items():
        if name in created:
            print(f"created {name} partitions={spec['num_partitions']}")
        else:
            print(f"exists {name}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from genrec.app.demo import run_demo

    run_demo(get_settings(), json_path=args.json, rate=args.rate)
    return 0
