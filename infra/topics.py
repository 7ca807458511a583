"""genrec's Kafka topics, created idempotently on any cluster (infra step, ``genrec topics create``).

Everything goes through kafka-python's admin client with
``KafkaSettings.client_config()``, so SASL/TLS settings pass through and the
same code serves the local broker and a production cluster; a cluster that cannot
be reached is one ``KafkaUnreachableError`` line (``infra/kafka_clients.py``).

Example::

    >>> from genrec.infra.settings import KafkaSettings
    >>> kafka = KafkaSettings(bootstrap="127.0.0.1:9092")
    >>> create_topics(kafka)  # doctest: +SKIP
    ['genrec.user-events', 'genrec.recommendations', 'genrec.user-events.dlq']
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from kafka import KafkaAdminClient
from kafka.errors import TopicAlreadyExistsError, for_code

from genrec.infra.errors import UserFacingError
from genrec.infra.kafka_clients import open_client
from genrec.infra.settings import KafkaSettings

log = logging.getLogger(__name__)

TOPIC_WAIT_POLL_S = 1.0  # between metadata checks while a consumer waits for its topic
TOPIC_WAIT_LOG_S = 5.0  # between "waiting for topic" lines


class KafkaTopicsError(UserFacingError):
    """The cluster refused to create a topic (permissions, replication factor, policy)."""


def topic_specs(kafka: KafkaSettings, brokers: int = 1) -> dict[str, dict[str, Any]]:
    """Partitions, replication and ``min.insync.replicas`` of each genrec topic on a cluster
    of ``brokers`` brokers (``kafka.replication_factor`` / ``min_insync_replicas``, or the
    defaults: min(3, brokers) replicas, 2 in sync where there are 3 or more).

    The dead-letter topic mirrors the events topic's partitions so a bad event lands
    in the partition of its user's good ones.
    """
    replication = kafka.replication_factor or min(3, max(1, brokers))
    in_sync = kafka.min_insync_replicas or (2 if replication >= 3 else 1)
    if in_sync > replication:
        raise KafkaTopicsError(
            f"kafka.min_insync_replicas {in_sync} is more than the {replication} replicas: "
            "every acks=all write would fail"
        )
    partitions = {
        kafka.topic_events: kafka.events_partitions,
        kafka.topic_recommendations: kafka.recommendations_partitions,
        kafka.topic_dlq: kafka.events_partitions,
    }
    return {
        name: {
            "num_partitions": count,
            "replication_factor": replication,
            "configs": {"min.insync.replicas": str(in_sync)},
        }
        for name, count in partitions.items()
    }


def create_topics(kafka: KafkaSettings) -> list[str]:
    """Create the genrec topics that are missing; returns the names it created."""
    with contextlib.closing(open_client(KafkaAdminClient, kafka)) as admin:
        specs = topic_specs(kafka, brokers=len(admin.describe_cluster()["brokers"]))
        existing = set(admin.list_topics())
        missing = {name: spec for name, spec in specs.items() if name not in existing}
        created = _create_missing(admin, missing)
        if created:
            admin.wait_for_topics(created, timeout_ms=30_000)
        _warn_on_fewer_partitions(admin, specs, sorted(set(specs) - set(created)))
    for name in created:
        spec = specs[name]
        log.info(
            "created topic %s (%d partitions, %d replicas, min.insync.replicas %s)", name,
            spec["num_partitions"], spec["replication_factor"], spec["configs"]["min.insync.replicas"],
        )  # fmt: skip
    return created


def _create_missing(admin: KafkaAdminClient, missing: dict[str, dict[str, Any]]) -> list[str]:
    if not missing:
        return []
    response = admin.create_topics(missing, raise_errors=False)
    created = []
    for topic in response["topics"]:
        error = for_code(topic["error_code"])
        if topic["error_code"] == 0:
            created.append(topic["name"])
        elif error is not TopicAlreadyExistsError:  # someone else created it meanwhile: fine
            raise KafkaTopicsError(
                f"could not create topic {topic['name']}: {error.__name__}: "
                f"{topic.get('error_message') or error.description}"
            )
    return [name for name in missing if name in created]


def _warn_on_fewer_partitions(
    admin: KafkaAdminClient, specs: dict[str, dict[str, Any]], names: list[str]
) -> None:
    """Existing topics are kept as they are; fewer partitions cap ingest parallelism."""
    if not names:
        return
    for topic in admin.describe_topics(names):
        wanted = specs[topic["name"]]["num_partitions"]
        if topic["error_code"] == 0 and len(topic["partitions"]) < wanted:
            log.warning(
                "topic %s has %d partitions, settings ask for %d (Kafka never shrinks or "
                "re-keys a topic; add partitions with kafka-topics --alter if you need them)",
                topic["name"],
                len(topic["partitions"]),
                wanted,
            )


def subscribe_when_ready(
    consumer: Any,
    topic: str,
    *,
    timeout_s: float,
    listener: Any = None,
    should_stop: Callable[[], bool] = lambda: False,
) -> set[int]:
    """Subscribe ``consumer`` to ``topic`` once it sees the topic's partitions.

    A group member that joins before the topic's metadata has reached it is
    assigned no partitions, and kafka-python must notice the metadata change and
    rebalance again; we have seen that second join hang, leaving a worker started
    right after ``genrec topics create`` idle for minutes. Waiting first makes the
    first assignment the real one. Returns the partition ids; raises
    ``KafkaTopicsError`` if the topic has none after ``timeout_s``, closing the
    consumer (made for this subscription, it holds sockets); returns an empty set,
    unsubscribed, if ``should_stop`` turns true meanwhile.
    """
    started = time.monotonic()
    next_warning = started + TOPIC_WAIT_LOG_S
    while not (partitions := consumer.partitions_for_topic(topic)):
        now = time.monotonic()
        if should_stop():
            return set()
        if now - started > timeout_s:
            consumer.close()
            raise KafkaTopicsError(
                f"topic {topic} has no partitions after {timeout_s:.0f}s: create it with "
                "`genrec topics create`, or check kafka.bootstrap and the client's ACLs"
            )
        if now >= next_warning:
            log.warning("waiting for topic %s to exist (%.0fs so far)", topic, now - started)
            next_warning = now + TOPIC_WAIT_LOG_S
        time.sleep(TOPIC_WAIT_POLL_S)
    consumer.subscribe([topic], listener=listener)
    return set(partitions)
