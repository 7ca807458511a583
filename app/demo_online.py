"""The online half of ``genrec demo``: serve the replayed last 20% and measure it.

Starts ``genrec ingest`` and ``genrec serve`` as their own processes, replays
the events after the 80% split at a steady rate, reads both the events topic
(for each event's produce timestamp) and the recommendations topic, waits
until every replayed event is covered by a published recommendation (or the
wait times out), stops both services with SIGTERM and scores the run with
``genrec.app.prequential``.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from genrec.app.prequential import Published, ReplayedEvent, prequential_figures
from genrec.app.services import skip_group_to_end, start_service, stop_service
from genrec.infra.kafka_clients import open_client
from genrec.infra.settings import Settings
from genrec.ingest.replay import replay_ml100k

log = logging.getLogger("genrec.demo")

READY_TIMEOUT_S = 300.0
DRAIN_TIMEOUT_S = 120.0  # after the replay: wait this long without progress at most


class TopicTail:
    """Reads a topic from its current end on, without a consumer group."""

    def __init__(self, settings: Settings, topic: str) -> None:
        from kafka import KafkaConsumer, TopicPartition

        self.consumer = open_client(
            KafkaConsumer,
            settings.kafka,
            group_id=None,
            enable_auto_commit=False,
            isolation_level="read_committed",  # exactly-once workers: only committed answers
        )
        partitions = [TopicPartition(topic, p) for p in self.consumer.partitions_for_topic(topic)]
        self.consumer.assign(partitions)
        self.consumer.seek_to_end(*partitions)
        for partition in partitions:  # resolve the end offsets now, before anything is produced
            self.consumer.position(partition)

    def poll(self) -> list[Any]:
        batches = self.consumer.poll(timeout_ms=200, max_records=5000)
        return [record for records in batches.values() for record in records]

    def close(self) -> None:
        self.consumer.close()


def wait_for_log(path: Path, needles: tuple[str, ...], timeout: float, process) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = path.read_text(errors="replace") if path.exists() else ""
        if all(needle in text for needle in needles):
            return
        if process.poll() is not None:
            raise RuntimeError(f"{path.name}: the process exited early; see {path}")
        time.sleep(0.5)
    raise TimeoutError(f"{path.name}: not ready after {timeout:.0f} s; see {path}")


def serve_and_measure(settings: Settings, rate: float, start: float) -> dict[str, Any]:
    """Start ingest and serve, replay ML-100K from ``start`` (a fraction) at ``rate``, measure."""
    logs = settings.data_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    skip_group_to_end(settings, settings.online.group_id, settings.kafka.topic_events)
    events_tail = TopicTail(settings, settings.kafka.topic_events)
    recs_tail = TopicTail(settings, settings.kafka.topic_recommendations)
    ingest = start_service(settings, ["ingest"], logs / "ingest.log")
    serve = start_service(settings, ["serve", "--metrics-port", "0"], logs / "serve.log")
    try:
        wait_for_log(logs / "serve.log", ("serving version", "partitions assigned"),
                     READY_TIMEOUT_S, serve)  # fmt: skip
        print(f"online: ingest and serve running (logs in {logs}); replaying the last "
              f"{1 - start:.0%} at {rate:g} events/s")  # fmt: skip
        produced = replay_ml100k(settings, start=start, rate=rate)
        events, published = collect(events_tail, recs_tail, produced)
    finally:
        for name, process in (("serve", serve), ("ingest", ingest)):
            code = stop_service(process)
            if code != 0:
                log.warning("%s exited with %s; see %s", name, code, logs / f"{name}.log")
        events_tail.close()
        recs_tail.close()
    return prequential_figures(events, published, k=10)


def collect(
    events_tail: TopicTail, recs_tail: TopicTail, expected: int
) -> tuple[list[ReplayedEvent], list[Published]]:
    """Read until every replayed event is answered, or nothing new comes for a while."""
    events: list[ReplayedEvent] = []
    published: list[Published] = []
    covered: set[str] = set()
    last_progress = time.monotonic()
    while time.monotonic() - last_progress < DRAIN_TIMEOUT_S:
        new_events = [_event(record) for record in events_tail.poll()]
        new_recs = [_published(record) for record in recs_tail.poll()]
        events += new_events
        published += new_recs
        for message in new_recs:
            covered.update(message.covered_event_ids)
        if new_events or new_recs:
            last_progress = time.monotonic()
        if len(events) >= expected and all(e.event_id in covered for e in events):
            break
    missing = sum(e.event_id not in covered for e in events)
    if missing:
        log.warning("%d of %d replayed events got no recommendation in time", missing, len(events))
    return events, published


def _event(record) -> ReplayedEvent:
    payload = json.loads(record.value)
    return ReplayedEvent(
        str(payload["event_id"]), str(payload["user_id"]), str(payload["item_id"]), record.timestamp
    )


def _published(record) -> Published:
    payload = json.loads(record.value)
    lists = {"merged": [item["item_id"] for item in payload["items"]]}
    for name, items in payload.get("branches", {}).items():
        lists[name] = [item["item_id"] for item in items]
    covered = payload.get("covered_event_ids") or [payload.get("event_id")]
    return Published(covered, lists, int(payload["produced_at"]), payload.get("event_id"))
