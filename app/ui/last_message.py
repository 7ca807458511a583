"""The last recommendation published for a user, read from the tail of the topic.

Workers key ``genrec.recommendations`` by user id, so a user's messages all sit
in one partition (the producer's murmur2 partitioner). The explorer reads at
most ``ui.topic_scan_messages`` messages from the end of that partition, with
no consumer group (it commits nothing), and keeps the newest one for the user:
a bounded read whatever the topic holds. A broker that does not answer is a
line on the page, not an error.

Example::

    >>> found = last_message(settings, "42")          # doctest: +SKIP
    >>> found.message.decoding["target_calls"] if found.message else found.note
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

from kafka import KafkaConsumer, TopicPartition
from kafka.partitioner.default import murmur2

from genrec.infra.kafka_clients import bootstrap_listening
from genrec.infra.settings import Settings
from genrec.schemas.recommendations import RecommendationMessage

log = logging.getLogger(__name__)
READ_DEADLINE_S = 3.0  # a page waits at most this long for the topic


@dataclass
class LastMessage:
    """The newest message found for the user (None: see ``note``), and where it was."""

    message: RecommendationMessage | None
    note: str
    partition: int | None = None
    offset: int | None = None


def partition_of(user_id: str, partitions: int) -> int:
    """The partition a message keyed ``user_id`` goes to (kafka-python's default)."""
    return (murmur2(user_id.encode()) & 0x7FFFFFFF) % partitions


def last_message(settings: Settings, user_id: str) -> LastMessage:
    """The newest message for ``user_id`` among the last ``ui.topic_scan_messages`` of its
    partition of ``kafka.topic_recommendations``."""
    kafka, scan = settings.kafka, settings.ui.topic_scan_messages
    topic = kafka.topic_recommendations
    if scan == 0:
        return LastMessage(None, "reading the topic is off (ui.topic_scan_messages = 0)")
    if not bootstrap_listening(kafka, 1.0):
        return LastMessage(None, f"Kafka at {kafka.bootstrap} is not reachable")
    consumer = KafkaConsumer(
        **kafka.client_config(), group_id=None, enable_auto_commit=False,
        isolation_level="read_committed", request_timeout_ms=5000,
    )  # fmt: skip
    try:
        return _scan(consumer, topic, user_id, scan)
    except Exception as exc:  # the page says why; the explorer keeps serving
        log.warning("reading %s for user %s failed: %s", topic, user_id, exc)
        return LastMessage(None, f"reading {topic} failed: {type(exc).__name__}")
    finally:
        consumer.close()


def _scan(consumer: KafkaConsumer, topic: str, user_id: str, scan: int) -> LastMessage:
    partitions = consumer.partitions_for_topic(topic)
    if not partitions:
        return LastMessage(None, f"topic {topic} does not exist yet")
    partition = TopicPartition(topic, partition_of(user_id, len(partitions)))
    consumer.assign([partition])
    end = consumer.end_offsets([partition])[partition]
    start = max(consumer.beginning_offsets([partition])[partition], end - scan)
    consumer.seek(partition, start)
    found, deadline = None, time.monotonic() + READ_DEADLINE_S
    while consumer.position(partition) < end and time.monotonic() < deadline:
        for record in consumer.poll(timeout_ms=200).get(partition, []):
            if record.key == user_id.encode():
                found = record
    where = f"partition {partition.partition}, offsets {start}-{end}"
    if found is None:
        return LastMessage(None, f"no message for this user in the last {end - start} ({where})")
    message = RecommendationMessage.model_validate(json.loads(found.value))
    return LastMessage(message, f"found in {where}", partition.partition, found.offset)
