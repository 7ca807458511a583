"""The local Kafka broker (genrec kafka up/down/status) and topic creation, against real Kafka."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition

from genrec.app.kafka_broker import (
    KafkaBroker,
    KafkaBrokerError,
    KafkaCluster,
    new_cluster_id,
    parse_bootstrap,
    pick_free_ports,
    server_properties,
)
from genrec.infra.kafka_clients import wait_for_kafka
from genrec.infra.settings import KafkaSettings, Settings
from genrec.infra.topics import KafkaTopicsError, create_topics, subscribe_when_ready, topic_specs
from tests.helpers import fresh_kafka, unique_kafka

# --- helpers ----------------------------------------------------------------------------


def produce(kafka: KafkaSettings, topic: str, count: int, tag: str) -> set[bytes]:
    producer = KafkaProducer(**kafka.client_config(), acks="all")
    values = {f"{tag}-{i}".encode() for i in range(count)}
    for value in sorted(values):
        producer.send(topic, key=value, value=value)
    producer.flush()
    producer.close()
    return values


def read_all(kafka: KafkaSettings, topic: str) -> set[bytes]:
    """Every message of ``topic``, read from the start up to its end offsets (no group)."""
    consumer = KafkaConsumer(**kafka.client_config(), enable_auto_commit=False)
    try:
        partitions = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic)]
        consumer.assign(partitions)
        consumer.seek_to_beginning(*partitions)
        end_offsets = consumer.end_offsets(partitions)
        values: set[bytes] = set()
        give_up = time.monotonic() + 60  # a safety net against hanging, not an assertion
        while any(consumer.position(tp) < end_offsets[tp] for tp in partitions):
            assert time.monotonic() < give_up, "consumer stopped making progress"
            for records in consumer.poll(timeout_ms=1000).values():
                values.update(record.value for record in records)
        return values
    finally:
        consumer.close()


def cluster_topics(kafka: KafkaSettings) -> dict[str, int]:
    """Topic name -> partition count, as the broker sees it."""
    admin = KafkaAdminClient(**kafka.client_config())
    try:
        return {t["name"]: len(t["partitions"]) for t in admin.describe_topics()}
    finally:
        admin.close()


def run_cli(broker: KafkaBroker, *args: str) -> subprocess.CompletedProcess[str]:
    """``genrec ARGS`` in a subprocess whose settings point at ``broker``."""
    env = {
        **os.environ,
        "GENREC_DATA_DIR": str(broker.data_dir.parent),
        "GENREC_KAFKA__BOOTSTRAP": broker.bootstrap,
        "GENREC_KAFKA_BROKER__CONTROLLER_PORT": str(broker.controller_port),
    }
    command = [sys.executable, "-m", "genrec.app.cli", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


# --- without a broker ---------------------------------------------------------------------


def test_server_properties_single_node(tmp_path: Path) -> None:
    text = server_properties("127.0.0.1", 19092, 19093, tmp_path / "kraft-logs", 6)
    properties = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
    assert properties["process.roles"] == "broker,controller"
    assert properties["controller.quorum.voters"] == "1@127.0.0.1:19093"
    assert properties["advertised.listeners"] == (
        "PLAINTEXT://127.0.0.1:19092,CONTROLLER://127.0.0.1:19093"
    )
    assert properties["log.dirs"] == str(tmp_path / "kraft-logs")
    assert properties["num.partitions"] == "6"
    assert properties["offsets.topic.num.partitions"] == "1"
    assert properties["group.initial.rebalance.delay.ms"] == "0"
    assert properties["auto.create.topics.enable"] == "false"


def test_cluster_id_is_kafka_shaped() -> None:
    ids = {new_cluster_id() for _ in range(200)}
    assert len(ids) == 200
    assert all(len(i) == 22 and not i.startswith("-") and "=" not in i for i in ids)


def test_bootstrap_must_be_one_concrete_address(tmp_path: Path) -> None:
    assert parse_bootstrap("127.0.0.1:9092") == ("127.0.0.1", 9092)
    for bad in ("a:1,b:2", "127.0.0.1", "0.0.0.0:9092", "host:port", "h:70000"):
        with pytest.raises(KafkaBrokerError):
            KafkaBroker(tmp_path, bootstrap=bad)
    with pytest.raises(KafkaBrokerError):
        KafkaBroker(tmp_path, heap="lots")


def test_broker_from_settings(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, kafka={"bootstrap": "127.0.0.1:29092"})
    broker = KafkaBroker.from_settings(settings)
    assert broker.data_dir == tmp_path.resolve() / "kafka"
    assert (broker.port, broker.controller_port) == (29092, 29093)  # default: beside it
    settings = Settings(data_dir=tmp_path, kafka_broker={"controller_port": 30000})
    assert KafkaBroker.from_settings(settings).controller_port == 30000


def test_stale_pid_file_reads_as_stopped(tmp_path: Path) -> None:
    finished = subprocess.Popen(["true"])
    finished.wait()
    broker = KafkaBroker(tmp_path, bootstrap="127.0.0.1:1")
    broker.pid_file.write_text(f"{finished.pid}\n")  # the kill -9 case: nobody runs it
    assert not broker.status().running
    broker.pid_file.write_text(f"{os.getpid()}\n")  # alive, but not a Kafka broker
    assert not broker.status().running
    broker.pid_file.write_text("not-a-pid\n")
    assert not broker.status().running
    broker.down()  # stopping a stopped broker is fine and clears the pid file
    assert not broker.pid_file.exists()


def test_topic_specs_follow_settings() -> None:
    kafka = KafkaSettings(events_partitions=3, recommendations_partitions=2, replication_factor=3)
    specs = topic_specs(kafka)
    assert specs[kafka.topic_events] == {
        "num_partitions": 3, "replication_factor": 3, "configs": {"min.insync.replicas": "2"},
    }  # fmt: skip
    assert specs[kafka.topic_recommendations]["num_partitions"] == 2
    assert specs[kafka.topic_dlq]["num_partitions"] == 3


def test_replication_defaults_to_the_cluster_size_up_to_three() -> None:
    kafka = KafkaSettings()
    for brokers, replicas, in_sync in ((1, 1, "1"), (2, 2, "1"), (3, 3, "2"), (5, 3, "2")):
        spec = topic_specs(kafka, brokers=brokers)[kafka.topic_events]
        assert (spec["replication_factor"], spec["configs"]["min.insync.replicas"]) == (
            replicas, in_sync,
        )  # fmt: skip
    with pytest.raises(KafkaTopicsError, match="min_insync_replicas 3 is more than"):
        topic_specs(KafkaSettings(replication_factor=2, min_insync_replicas=3))


# --- against the real broker ----------------------------------------------------------------


@pytest.mark.integration
def test_up_is_idempotent(kafka_broker: KafkaBroker) -> None:
    before = kafka_broker.status()
    assert before.running
    assert kafka_broker.up() == kafka_broker.bootstrap
    assert kafka_broker.status() == before  # same process, nothing restarted
    # A second object on the same data dir (another CLI call) sees the same broker.
    twin = KafkaBroker(kafka_broker.data_dir, kafka_broker.bootstrap, kafka_broker.controller_port)
    assert twin.status() == before
    assert twin.up() == kafka_broker.bootstrap
    assert (kafka_broker.data_dir / "cluster.id").exists()


@pytest.mark.integration
def test_topics_create_twice(kafka_settings: KafkaSettings) -> None:
    assert create_topics(kafka_settings) == []  # the fixture created them already
    topics = cluster_topics(kafka_settings)
    for name, spec in topic_specs(kafka_settings).items():
        assert topics[name] == spec["num_partitions"]
    assert topics[kafka_settings.topic_events] == 6


@pytest.mark.integration
def test_a_group_consumer_started_before_its_topic_gets_every_partition(
    kafka_broker: KafkaBroker, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker started before `genrec topics create` waits, then joins with a real assignment."""
    kafka = unique_kafka(kafka_broker)
    consumer = KafkaConsumer(**kafka.client_config(), group_id=f"late-{uuid.uuid4().hex[:8]}")
    creator = threading.Timer(2.0, create_topics, args=(kafka,))
    creator.start()
    try:
        with caplog.at_level(logging.WARNING):
            partitions = subscribe_when_ready(consumer, kafka.topic_events, timeout_s=60)
            assert partitions == set(range(kafka.events_partitions))
            deadline = time.monotonic() + 30
            while not consumer.assignment() and time.monotonic() < deadline:
                consumer.poll(timeout_ms=200)
        assert {tp.partition for tp in consumer.assignment()} == partitions
        # The first assignment was the real one: no empty join, no second rebalance.
        assert "No partition metadata" not in caplog.text
    finally:
        creator.join()
        consumer.close()


@pytest.mark.integration
def test_a_missing_topic_is_a_clear_error(kafka_broker: KafkaBroker) -> None:
    kafka = KafkaSettings(bootstrap=kafka_broker.bootstrap)
    consumer = KafkaConsumer(**kafka.client_config(), group_id="never-joins")
    topic = f"no.such.topic.{uuid.uuid4().hex[:8]}"
    with pytest.raises(KafkaTopicsError, match=f"{topic} has no partitions after 2s"):
        subscribe_when_ready(consumer, topic, timeout_s=2)
    assert not consumer.subscription()
    assert consumer._closed  # closed by the failed subscription


@pytest.mark.integration
def test_restart_keeps_messages_and_topics(stoppable_kafka_broker: KafkaBroker) -> None:
    broker, kafka = stoppable_kafka_broker, fresh_kafka(stoppable_kafka_broker)
    sent = produce(kafka, kafka.topic_events, 20, "before-restart")
    pid_before = broker.status().pid
    broker.down()
    assert not broker.status().running
    assert not broker.pid_file.exists()
    assert broker.up() == broker.bootstrap
    assert broker.status().pid != pid_before
    wait_for_kafka(kafka, timeout=60)
    assert read_all(kafka, kafka.topic_events) == sent
    assert set(topic_specs(kafka)) <= set(cluster_topics(kafka))


@pytest.mark.integration
def test_kill9_reads_stopped_and_up_recovers(stoppable_kafka_broker: KafkaBroker) -> None:
    broker, kafka = stoppable_kafka_broker, fresh_kafka(stoppable_kafka_broker)
    sent = produce(kafka, kafka.topic_events, 10, "before-kill")
    broker.kill()
    assert broker.pid_file.exists()  # left behind, as after a crash
    assert not broker.status().running
    stopped = run_cli(broker, "kafka", "status")
    assert stopped.returncode == 3 and stopped.stdout.startswith("stopped"), stopped
    broker.up()
    assert broker.status().running
    assert read_all(kafka, kafka.topic_events) == sent


@pytest.mark.integration
def test_cli_up_status_and_topics_create(kafka_broker: KafkaBroker) -> None:
    up = run_cli(kafka_broker, "kafka", "up")
    assert up.returncode == 0 and up.stdout.strip() == kafka_broker.bootstrap, up
    status = run_cli(kafka_broker, "kafka", "status")
    assert status.returncode == 0, status
    assert f"pid={kafka_broker.status().pid} bootstrap={kafka_broker.bootstrap}" in status.stdout
    created = run_cli(kafka_broker, "topics", "create")  # the default genrec.* topics
    again = run_cli(kafka_broker, "topics", "create")
    assert created.returncode == 0 and again.returncode == 0, (created, again)
    assert again.stdout.split() == [
        "exists", "genrec.user-events",
        "exists", "genrec.recommendations",
        "exists", "genrec.user-events.dlq",
    ]  # fmt: skip


@pytest.mark.integration
def test_up_refuses_a_busy_port(tmp_path: Path) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        broker = KafkaBroker(tmp_path, bootstrap=f"127.0.0.1:{port}")
        with pytest.raises(KafkaBrokerError, match="in use"):
            broker.up()
    assert not broker.pid_file.exists()


@pytest.mark.integration
def test_up_reports_a_broker_that_dies(tmp_path: Path) -> None:
    (port, controller_port) = pick_free_ports(2)
    broker = KafkaBroker(tmp_path, f"127.0.0.1:{port}", controller_port, heap="1k")
    with pytest.raises(KafkaBrokerError, match="exited during start-up") as error:
        broker.up()
    assert "heap" in str(error.value).lower()  # the JVM's own complaint, from broker.log
    assert not broker.status().running and not broker.pid_file.exists()


def test_a_cluster_signals_every_node_before_waiting_for_any(tmp_path: Path) -> None:
    """One node at a time, the last one's controlled shutdown waits for a quorum that has
    gone (and is killed after the timeout): all nodes get SIGTERM first."""
    cluster = KafkaCluster(tmp_path, [(19092, 19093), (19094, 19095), (19096, 19097)])
    calls: list[str] = []

    class Node:
        def __init__(self, name: str) -> None:
            self.name = name

        def terminate(self) -> None:
            calls.append(f"term {self.name}")

        def down(self, timeout: float) -> None:
            calls.append(f"wait {self.name}")

    cluster.nodes = [Node("1"), Node("2"), Node("3")]
    cluster.down()
    assert calls == ["term 1", "term 2", "term 3", "wait 1", "wait 2", "wait 3"]
