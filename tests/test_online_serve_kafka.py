"""`genrec serve` as a real subprocess on the real Kafka broker, serving a real refreshed version.

The serving version (conftest ``serving_home``) is built once per run by ``run_refresh``
with the ``tiny`` preset on ML-100K users 1..100. Each test starts ``genrec serve``
with ``GENREC_*`` variables pointing at the test broker, its own topics and consumer
group, and that home.

Delivery contract asserted here: without a crash every event is answered by exactly
one message (as the triggering event, ``request_id`` = ``event_id``, or in its
``covered_event_ids``); after kill -9 it is at-least-once: every event is answered,
and a repeated answer carries the same ``request_id``, which consumers dedupe on.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections import Counter
from pathlib import Path

import pytest
from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer
from kafka.structs import TopicPartition
from sqlalchemy import insert, select

from genrec.app.kafka_broker import pick_free_ports
from genrec.infra.database import make_engine
from genrec.infra.serving_versions import active_serving_version
from genrec.infra.settings import KafkaSettings, Settings
from genrec.schemas.events import UserEvent
from genrec.schemas.recommendations import RecommendationMessage
from genrec.schemas.tables import events, items
from tests.helpers import SERVING_USERS, fresh_kafka, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(400)]

GENREC = Path(sys.executable).parent / "genrec"
EXACTLY_ONCE = {"PROCESSING_GUARANTEE": "exactly_once"}
CACHED_USERS = [str(u) for u in range(1, SERVING_USERS + 1)]  # every one has a prefix KV


# --- helpers: the worker process, events in, recommendations out ----------------------


def service_env(home: Path, kafka: KafkaSettings) -> dict[str, str]:
    """The environment of a `genrec` service on ``home``'s store and the test's events topic."""
    return {
        **os.environ,
        "GENREC_HOME": str(home),
        "GENREC_KAFKA__BOOTSTRAP": kafka.bootstrap,
        "GENREC_KAFKA__TOPIC_EVENTS": kafka.topic_events,
    }


class Worker:
    """One `genrec serve` subprocess; its log goes to ``log_path``."""

    def __init__(
        self,
        home: Path,
        kafka: KafkaSettings,
        group: str,
        log_path: Path,
        log_levels: str = "",
        **settings: str,
    ) -> None:
        """``settings``: more ``GENREC_ONLINE__*`` variables, e.g. ``PROCESSING_GUARANTEE``;
        ``log_levels``: ``GENREC_LOG_LEVELS``, e.g. to see a scenario's offsets."""
        self.port = pick_free_ports(1)[0]
        self.log_path = log_path
        env = {
            **service_env(home, kafka),
            "GENREC_KAFKA__TOPIC_RECOMMENDATIONS": kafka.topic_recommendations,
            "GENREC_ONLINE__GROUP_ID": group,
            "GENREC_ONLINE__AUTO_OFFSET_RESET": "earliest",
            "GENREC_ONLINE__VERSION_POLL_S": "0.5",
            "GENREC_ONLINE__SESSION_TIMEOUT_MS": "6000",  # the broker's minimum
            "GENREC_ONLINE__MAX_BATCH_USERS": "16",
            "GENREC_ONLINE__TORCH_THREADS": "1",
            "GENREC_LOG_LEVELS": log_levels,
            **{f"GENREC_ONLINE__{name}": value for name, value in settings.items()},
        }
        with log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [str(GENREC), "serve", "--metrics-port", str(self.port)],
                env=env, stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip

    def get(self, path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as error:
            return error.code, error.read()

    def wait_healthy(self, timeout: float = 120.0) -> dict:
        def healthy() -> bool:
            assert self.process.poll() is None, f"worker exited early:\n{self.log()}"
            with contextlib.suppress(OSError):
                return self.get("/healthz")[0] == 200
            return False

        wait_for(healthy, timeout, "the worker's /healthz")
        return json.loads(self.get("/healthz")[1])

    def stop(self, signum: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signum)
        return self.process.wait(timeout=timeout)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def stacks(self) -> str:
        """Every thread's stack (SIGUSR1, faulthandler), for a failure message."""
        if self.process.poll() is not None:
            return f"(exited {self.process.returncode})"
        start = self.log_path.stat().st_size
        self.process.send_signal(signal.SIGUSR1)
        time.sleep(1.0)
        return self.log_path.read_bytes()[start:].decode(errors="replace")[-6000:]


class Events:
    """Produces events (keyed by user) and remembers each one's partition and offset."""

    def __init__(self, kafka: KafkaSettings) -> None:
        self.topic = kafka.topic_events
        self.producer = KafkaProducer(
            bootstrap_servers=kafka.bootstrap, acks="all", linger_ms=5, enable_idempotence=True
        )
        self.sent: dict[str, UserEvent] = {}
        self.offsets: dict[str, tuple[int, int]] = {}  # event_id -> (partition, offset)
        self.prefix = uuid.uuid4().hex[:8]
        self._counter = itertools.count()

    def send(self, user_id: str, item_id: str = "50") -> UserEvent:
        event = UserEvent(
            event_id=f"{self.prefix}-{next(self._counter)}", user_id=user_id, item_id=item_id,
            event_type="view", ts=int(time.time() * 1000),
        )  # fmt: skip
        future = self.producer.send(self.topic, key=event.kafka_key(), value=event.to_json_bytes())
        future.add_callback(
            lambda meta, eid=event.event_id: self.offsets.__setitem__(
                eid, (meta.partition, meta.offset)
            )
        )
        self.sent[event.event_id] = event
        return event

    def flush(self) -> None:
        self.producer.flush(timeout=30)
        assert set(self.offsets) == set(self.sent), "some events were not acknowledged"

    def close(self) -> None:
        self.producer.close(timeout=10)


class EventStream(threading.Thread):
    """Background producer: ``rate`` events per second over the cached users until stopped."""

    def __init__(self, events: Events, rate: float = 40.0) -> None:
        super().__init__(daemon=True)
        self.events, self.rate = events, rate
        self.halt = threading.Event()
        self.lock = threading.Lock()

    def run(self) -> None:
        for n in itertools.count():
            if self.halt.wait(1.0 / self.rate):
                break
            with self.lock:
                self.events.send(CACHED_USERS[(n * 7) % len(CACHED_USERS)], str(1 + n % 300))

    def stop(self) -> None:
        self.halt.set()
        self.join(timeout=10)
        self.events.flush()


class Recommendations:
    """Reads the recommendations topic from its beginning (no group)."""

    def __init__(self, kafka: KafkaSettings) -> None:
        self.consumer = KafkaConsumer(
            bootstrap_servers=kafka.bootstrap, enable_auto_commit=False,
            isolation_level="read_committed",
        )  # fmt: skip
        partitions = self.consumer.partitions_for_topic(kafka.topic_recommendations) or set()
        topic_partitions = [TopicPartition(kafka.topic_recommendations, p) for p in partitions]
        self.consumer.assign(topic_partitions)
        self.consumer.seek_to_beginning(*topic_partitions)
        self.messages: list[RecommendationMessage] = []

    def poll(self) -> list[RecommendationMessage]:
        for records in self.consumer.poll(timeout_ms=200).values():
            self.messages.extend(
                RecommendationMessage.model_validate_json(r.value) for r in records
            )
        return self.messages

    def answers(self) -> Counter:
        """How many messages answered each event id (as trigger or as covered)."""
        return Counter(e for m in self.messages for e in m.covered_event_ids)

    def wait_answered(self, event_ids, timeout: float, worker: Worker | None = None) -> None:
        wanted = set(event_ids)

        def done() -> bool:
            if worker is not None:
                assert worker.process.poll() is None, f"worker exited:\n{worker.log()}"
            self.poll()
            return wanted <= set(self.answers())

        wait_for(done, timeout, f"answers to {len(wanted)} events")

    def close(self) -> None:
        self.consumer.close()


def fresh_stream(kafka_broker) -> tuple[KafkaSettings, str, Events, Recommendations]:
    """Own topics, a new consumer group, a producer of events and a reader of the answers."""
    kafka = fresh_kafka(kafka_broker)
    return kafka, f"genrec-online-{uuid.uuid4().hex[:6]}", Events(kafka), Recommendations(kafka)


def committed_offsets(kafka: KafkaSettings, group: str) -> dict[int, int]:
    admin = KafkaAdminClient(bootstrap_servers=kafka.bootstrap)
    try:
        offsets = admin.list_group_offsets(group)[group]
    finally:
        admin.close()
    return {
        tp.partition: meta.offset for tp, meta in offsets.items() if tp.topic == kafka.topic_events
    }


def metric_value(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line[len(name)] not in "{ ":
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def store_facts(home: Path) -> tuple[set[str], dict[str, set[str]], object]:
    """(catalog item ids, each stored user's items, the active serving version)."""
    engine = make_engine(Settings(home=home).database_url)
    with engine.connect() as connection:
        catalog = set(connection.execute(select(items.c.item_id)).scalars())
        seen: dict[str, set[str]] = {}
        for user_id, item_id in connection.execute(select(events.c.user_id, events.c.item_id)):
            seen.setdefault(user_id, set()).add(item_id)
    active = active_serving_version(engine)
    engine.dispose()
    return catalog, seen, active


# --- one worker shared by the plain serving tests ------------------------------------


@pytest.fixture(scope="module")
def served(serving_home, kafka_broker, tmp_path_factory):
    """A running worker on the shared serving version, its events and its answers."""
    kafka = fresh_kafka(kafka_broker)
    log_path = tmp_path_factory.mktemp("serve") / "worker.log"
    worker = Worker(serving_home, kafka, f"genrec-online-{uuid.uuid4().hex[:6]}", log_path)
    sent, answers = Events(kafka), Recommendations(kafka)
    try:
        worker.wait_healthy()
        yield worker, sent, answers
    finally:
        worker.stop(signal.SIGKILL)
        sent.close()
        answers.close()


def by_event(answers: Recommendations, event_ids) -> dict[str, RecommendationMessage]:
    return {m.event_id: m for m in answers.messages if m.event_id in set(event_ids)}


def test_an_event_gets_a_recommendation_that_references_it(served, serving_home) -> None:
    worker, sent, answers = served
    catalog, seen, active = store_facts(serving_home)
    users = ["1", "2", "42"]
    produced = [sent.send(user, item_id="50") for user in users]
    sent.flush()
    answers.wait_answered([e.event_id for e in produced], 120, worker)
    replies = by_event(answers, [e.event_id for e in produced])
    for event in produced:
        message = replies[event.event_id]
        assert message.request_id == event.event_id and message.user_id == event.user_id
        assert message.covered_event_ids == [event.event_id]
        assert message.decoding["path"] == "prefix_kv", message.decoding
        assert message.decoding["serving_version"] == str(active.version)
        assert message.model_version == active.model_version
        assert len(message.items) == 10 and len({i.item_id for i in message.items}) == 10
        assert {i.item_id for i in message.items} <= catalog
        assert not {i.item_id for i in message.items} & (seen[event.user_id] | {"50"})
        assert message.branches["generative"], "the generative branch answered nothing"
        assert set(message.branches) >= {"generative", "popularity", "itemcf", "ann"}


def test_a_user_without_a_cache_still_gets_valid_items(served, serving_home) -> None:
    from genrec.online.models.store import load_model_version

    worker, sent, answers = served
    catalog, _seen, active = store_facts(serving_home)
    settings = Settings(home=serving_home)
    engine = make_engine(settings.database_url)
    item_tokens = load_model_version(settings, engine, int(active.model_version)).item_tokens
    engine.dispose()
    new_user = sent.send(f"new-user-{uuid.uuid4().hex[:6]}", item_id="50")
    unknown_item = sent.send(f"new-user-{uuid.uuid4().hex[:6]}", item_id="no-such-item")
    sent.flush()
    answers.wait_answered([new_user.event_id, unknown_item.event_id], 120, worker)
    for event in (new_user, unknown_item):
        message = by_event(answers, [event.event_id])[event.event_id]
        assert message.decoding["path"] == "full_prompt", message.decoding
        assert len(message.items) == 10 and {i.item_id for i in message.items} <= catalog
        generative = message.branches["generative"]
        assert generative and event.item_id not in {i.item_id for i in generative}
        for item in generative:  # a real item whose semantic ID is the model's own mapping
            tokens = item_tokens.tokens_of(item.item_id)
            assert item.semantic_id == item_tokens.layout.decode([tokens])[0]


def test_metrics_and_healthz_answer(served) -> None:
    worker, sent, answers = served
    event = sent.send("7")
    sent.flush()
    answers.wait_answered([event.event_id], 120, worker)
    status, body = worker.get("/healthz")
    health = json.loads(body)
    assert status == 200 and health["ok"] and health["role"] == "online"
    assert health["version"]["generative"] and health["version"]["kv_version"] is not None
    assert health["version"]["decoding"]["serving"] in ("timing", "strict", "target")
    # The worker counts a batch's requests after its commit, which can land a moment after
    # the answer is readable: wait for the count rather than race it.
    wait_for(
        lambda: metric_value(worker.get("/metrics")[1].decode(), "genrec_requests_total",
                             path="prefix_kv") >= 1,
        30, "the request counted in /metrics",
    )  # fmt: skip
    status, body = worker.get("/metrics")
    text = body.decode()
    assert status == 200
    assert metric_value(text, "genrec_events_total", component="online", outcome="consumed") >= 1
    assert metric_value(text, "genrec_request_latency_seconds_count") >= 1
    assert metric_value(text, "genrec_prefix_kv_lookups_total") >= 1
    assert metric_value(text, "genrec_serving_version_info") == 1
    assert worker.get("/nope")[0] == 404


# --- failures, shutdown and version switches: each test its own worker ----------------


def test_sigterm_drains_the_batch_in_hand_and_commits(serving_home, kafka_broker, tmp_path) -> None:
    kafka, group, sent, answers = fresh_stream(kafka_broker)
    worker = Worker(serving_home, kafka, group, tmp_path / "worker.log")
    stream = EventStream(sent, rate=30)
    try:
        worker.wait_healthy()
        stream.start()
        wait_for(lambda: len(answers.poll()) >= 20, 120, "the first answers")
        assert worker.stop(signal.SIGTERM) == 0, worker.log()
        stream.stop()
    finally:
        stream.halt.set()
        worker.stop(signal.SIGKILL)
        sent.close()
    assert "worker stopped" in worker.log()
    committed = committed_offsets(kafka, group)
    below = {
        event_id
        for event_id, (partition, offset) in sent.offsets.items()
        if offset < committed.get(partition, 0)
    }
    assert below and len(below) < len(sent.sent)  # stopped mid-stream
    answers.wait_answered(below, 60)  # published and acknowledged before the commit
    for _ in range(5):
        answers.poll()
    counts = answers.answers()
    # Answered == committed: nothing answered is left uncommitted, nothing committed unanswered.
    assert set(counts) == below
    assert set(counts.values()) == {1}
    answers.close()


def _kill_a_worker_mid_stream(
    serving_home, kafka_broker, tmp_path, **options: str
) -> tuple[Recommendations, set[str]]:
    """A worker killed (-9) mid-stream while events keep coming, and a second one (same
    ``options``, so the same instance id) started in its place; returns the answers once
    every event sent is answered, read up to the end, and the event ids sent."""
    kafka, group, sent, answers = fresh_stream(kafka_broker)
    first = Worker(serving_home, kafka, group, tmp_path / "first.log", **options)
    second = None
    stream = EventStream(sent, rate=30)
    try:
        first.wait_healthy()
        stream.start()
        wait_for(lambda: len(answers.poll()) >= 20, 120, "the first answers")
        assert first.stop(signal.SIGKILL) == -signal.SIGKILL  # events keep coming meanwhile
        second = Worker(serving_home, kafka, group, tmp_path / "second.log", **options)
        second.wait_healthy()
        time.sleep(2.0)
        stream.stop()
        answers.wait_answered(list(sent.sent), 180, second)
        assert second.stop(signal.SIGTERM) == 0, second.log()
    finally:
        stream.halt.set()
        first.stop(signal.SIGKILL)
        if second is not None:
            second.stop(signal.SIGKILL)
        sent.close()
    for _ in range(5):
        answers.poll()
    answers.close()
    return answers, set(sent.sent)


def test_kill_9_loses_no_request(serving_home, kafka_broker, tmp_path) -> None:
    answers, sent = _kill_a_worker_mid_stream(serving_home, kafka_broker, tmp_path)
    counts = answers.answers()
    assert set(counts) == sent  # at-least-once: every event answered
    by_request: dict[str, set] = {}
    for message in answers.messages:  # a repeated answer is the same request again
        by_request.setdefault(message.request_id, set()).add(message.user_id)
    assert all(len(users) == 1 for users in by_request.values())
    twice = sorted(e for e, n in counts.items() if n > 1)
    print(f"{len(sent)} events, {len(answers.messages)} answers, "
          f"{len(twice)} answered twice (between the killed worker's publish and commit)")  # fmt: skip


def test_exactly_once_kill_9_answers_every_event_once(serving_home, kafka_broker, tmp_path) -> None:
    """Transactions: a worker killed mid-stream leaves nothing visible twice to a
    read_committed consumer; its restart (same instance id) fences what it left open."""
    answers, sent = _kill_a_worker_mid_stream(
        serving_home, kafka_broker, tmp_path, **EXACTLY_ONCE, INSTANCE_ID="w1"
    )
    assert answers.answers() == Counter({event_id: 1 for event_id in sent})
    assert len({m.request_id for m in answers.messages}) == len(answers.messages)


def test_a_broker_restart_loses_no_request(serving_home, stoppable_kafka_broker, tmp_path) -> None:
    kafka, group, before, answers = fresh_stream(stoppable_kafka_broker)
    worker = Worker(serving_home, kafka, group, tmp_path / "worker.log")
    after = None
    try:
        worker.wait_healthy()
        for n in range(30):
            before.send(CACHED_USERS[n % len(CACHED_USERS)])
        before.flush()
        answers.wait_answered(list(before.sent), 120, worker)
        before.close()
        answers.close()
        stoppable_kafka_broker.down()
        # The worker polls, heartbeats and looks for its coordinator into a void: it
        # must ride that out (kafka-python 3.0 raises some of it from poll()).
        time.sleep(5)
        assert worker.process.poll() is None, f"worker died in the outage:\n{worker.log()}"
        stoppable_kafka_broker.up(timeout=180)
        after, answers = Events(kafka), Recommendations(kafka)
        for n in range(30):
            after.send(CACHED_USERS[(n * 3) % len(CACHED_USERS)])
        after.flush()
        answers.wait_answered(list(after.sent), 180, worker)
        assert worker.stop(signal.SIGTERM) == 0, worker.log()
    finally:
        worker.stop(signal.SIGKILL)
        if after is not None:
            after.close()
    assert set(answers.answers()) >= set(before.sent)  # and the answers written before it
    answers.close()


def test_activating_a_new_version_switches_without_lost_or_repeated_requests(
    serving_home, kafka_broker, tmp_path
) -> None:
    from genrec.offline.refresh import run_refresh

    home = tmp_path / "home"
    shutil.copytree(serving_home, home)  # this test activates a version: its own store
    settings = Settings(home=home, refresh={"semantic_ids": False, "kv_batch_size": 64})
    engine = make_engine(settings.database_url)
    with engine.begin() as connection:  # user 5 comes back before the refresh: a new cutoff
        connection.execute(insert(events).values(
            event_id="before-refresh", user_id="5", item_id="1", event_type="view",
            ts_ms=int(time.time() * 1000)))  # fmt: skip
    kafka, group, sent, answers = fresh_stream(kafka_broker)
    worker = Worker(home, kafka, group, tmp_path / "worker.log")
    stream = EventStream(sent, rate=30)
    try:
        worker.wait_healthy()
        stream.start()
        wait_for(lambda: len(answers.poll()) >= 20, 120, "the first answers")
        report = run_refresh(settings, engine)  # activates version 2 while events flow
        new_version = str(report.serving_version)
        wait_for(
            lambda: any(m.decoding["serving_version"] == new_version for m in answers.poll()),
            120, "answers from the new version",
        )  # fmt: skip
        with stream.lock:
            returning = sent.send("5")
        time.sleep(1.0)
        stream.stop()
        answers.wait_answered(list(sent.sent), 120, worker)
        assert worker.stop(signal.SIGTERM) == 0, worker.log()
    finally:
        stream.halt.set()
        worker.stop(signal.SIGKILL)
        sent.close()
        engine.dispose()
    assert answers.answers() == Counter({event_id: 1 for event_id in sent.sent})
    old = [m.produced_at for m in answers.messages if m.decoding["serving_version"] == "1"]
    new = [m.produced_at for m in answers.messages if m.decoding["serving_version"] == new_version]
    assert old and new and max(old) <= min(new)  # one switch, between two micro-batches
    assert {m.decoding["kv_version"] for m in answers.messages} == {1, report.kv_version}
    # the message that covers it: a later event of user 5 in the same batch (the stream picks
    # users at random; on a busy host batches grow) makes that one the request's own event
    reply = next(m for m in answers.messages if returning.event_id in m.covered_event_ids)
    assert reply.decoding["serving_version"] == new_version
    assert reply.decoding["prefix_cutoff_event_id"] == "before-refresh"
    answers.close()


def test_two_workers_split_the_partitions_and_answer_each_event_once(
    serving_home, kafka_broker, tmp_path
) -> None:
    kafka, group, sent, answers = fresh_stream(kafka_broker)
    workers = [Worker(serving_home, kafka, group, tmp_path / f"worker{n}.log") for n in range(2)]
    stream = EventStream(sent, rate=30)
    try:
        for worker in workers:
            worker.wait_healthy()
        stream.start()
        # Both answer once the group has settled on one member per share of the partitions.
        wait_for(
            lambda: all(metric_value(w.get("/metrics")[1].decode(), "genrec_requests_total") > 0
                        for w in workers),
            180, "answers from both workers",
        )  # fmt: skip
        stream.stop()
        try:
            answers.wait_answered(list(sent.sent), 120)
        except AssertionError:
            missing = sorted(set(sent.sent) - set(answers.answers()))
            where = [sent.offsets.get(e) for e in missing]
            logs = "\n".join(w.log()[-3000:] for w in workers)
            raise AssertionError(
                f"unanswered {missing} at (partition, offset) {where}\n{logs}"
            ) from None
        assert [w.stop(signal.SIGTERM) for w in workers] == [0, 0], workers[0].log()
    finally:
        stream.halt.set()
        for worker in workers:
            worker.stop(signal.SIGKILL)
        sent.close()
    for _ in range(5):
        answers.poll()
    # A rebalance without a crash hands partitions over drained: exactly one answer per event.
    assert answers.answers() == Counter({event_id: 1 for event_id in sent.sent})
    answers.close()


# --- a three-node cluster (issue #21): exactly once through worker and broker failures ------


class Ingest:
    """One `genrec ingest` subprocess writing the test's events into ``home``'s store."""

    def __init__(self, home: Path, kafka: KafkaSettings, log_path: Path) -> None:
        self.log_path = log_path
        env = {
            **service_env(home, kafka),
            "GENREC_KAFKA__TOPIC_DLQ": kafka.topic_dlq,
            "GENREC_INGEST__GROUP_ID": f"genrec-ingest-{uuid.uuid4().hex[:6]}",
            "GENREC_INGEST__SESSION_TIMEOUT_MS": "6000",
        }
        with log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [str(GENREC), "ingest"], env=env, stdout=log, stderr=subprocess.STDOUT
            )

    def stop(self, signum: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        with contextlib.suppress(ProcessLookupError):
            self.process.send_signal(signum)
        return self.process.wait(timeout=timeout)


def stored(home: Path, event_ids) -> int:
    """How many of ``event_ids`` the store in ``home`` holds."""
    engine = make_engine(Settings(home=home).database_url)
    try:
        with engine.connect() as connection:
            query = select(events.c.event_id).where(events.c.event_id.in_(list(event_ids)))
            return len(connection.execute(query).all())
    finally:
        engine.dispose()


def test_cluster_exactly_once_kill_9_of_a_worker(serving_home, kafka_cluster, tmp_path) -> None:
    answers, sent = _kill_a_worker_mid_stream(
        serving_home, kafka_cluster, tmp_path, **EXACTLY_ONCE, INSTANCE_ID="w1"
    )
    assert answers.answers() == Counter({event_id: 1 for event_id in sent})


def test_cluster_a_paused_worker_is_fenced_and_nothing_is_published_twice(
    serving_home, kafka_cluster, tmp_path
) -> None:
    """SIGSTOP past the session timeout: a replacement takes the partitions; resumed, the
    paused worker's transaction carries a stale group generation and is refused."""
    kafka, group, sent, answers = fresh_stream(kafka_cluster)
    paused = Worker(
        serving_home, kafka, group, tmp_path / "paused.log", **EXACTLY_ONCE, INSTANCE_ID="a"
    )
    replacement = None
    stream = EventStream(sent, rate=30)
    try:
        paused.wait_healthy()
        stream.start()
        wait_for(lambda: len(answers.poll()) >= 20, 120, "the first answers")
        paused.process.send_signal(signal.SIGSTOP)
        replacement = Worker(
            serving_home, kafka, group, tmp_path / "replacement.log", **EXACTLY_ONCE,
            INSTANCE_ID="b",
        )  # fmt: skip
        replacement.wait_healthy()
        wait_for(
            lambda: metric_value(replacement.get("/metrics")[1].decode(), "genrec_requests_total") > 0,
            180, "the replacement to answer",
        )  # fmt: skip
        paused.process.send_signal(signal.SIGCONT)
        time.sleep(8.0)  # the resumed worker learns it left the group, and rejoins
        stream.stop()
        answers.wait_answered(list(sent.sent), 180, replacement)
        assert paused.process.poll() is None, paused.log()  # it recovered by itself
        assert [w.stop(signal.SIGTERM) for w in (paused, replacement)] == [0, 0]
    finally:
        stream.halt.set()
        with contextlib.suppress(ProcessLookupError):
            paused.process.send_signal(signal.SIGCONT)
        paused.stop(signal.SIGKILL)
        if replacement is not None:
            replacement.stop(signal.SIGKILL)
        sent.close()
    for _ in range(5):
        answers.poll()
    assert answers.answers() == Counter({event_id: 1 for event_id in sent.sent})
    answers.close()


def _kill_a_broker_mid_stream(
    serving_home, kafka_cluster, tmp_path, guarantee: str
) -> tuple[Recommendations, Events]:
    """Ingest and two workers on the cluster; the leader of events partition 0 is killed
    (-9) mid-stream. Returns the answers, read to the end once all events are answered,
    and the events sent, after checking the store holds every event and no process needed
    a restart."""
    home = tmp_path / "home"
    shutil.copytree(serving_home, home)
    kafka, group, sent, answers = fresh_stream(kafka_cluster)
    ingest = Ingest(home, kafka, tmp_path / "ingest.log")
    workers = [
        Worker(home, kafka, group, tmp_path / f"worker{n}.log", log_levels=OFFSET_LOGS,
               PROCESSING_GUARANTEE=guarantee, INSTANCE_ID=f"w{n}")
        for n in range(2)
    ]  # fmt: skip
    stream = EventStream(sent, rate=30)
    try:
        for worker in workers:
            worker.wait_healthy()
        stream.start()
        wait_for(lambda: len(answers.poll()) >= 30, 180, "the first answers")
        leader = _leader_of(kafka, kafka.topic_events, 0)
        next(node for node in kafka_cluster.nodes if node.node_id == leader).kill()
        time.sleep(10.0)  # the stream goes on with one node down
        stream.stop()
        try:
            answers.wait_answered(list(sent.sent), 240)
        except AssertionError as failure:  # a stuck worker says where it is stuck
            stacks = "\n".join(f"--- worker{n}:\n{w.stacks()}" for n, w in enumerate(workers))
            raise AssertionError(f"{failure}\n{stacks}") from None
        wait_for(lambda: stored(home, sent.sent) == len(sent.sent), 120, "every event stored")
        alive = [p.process.poll() is None for p in (ingest, *workers)]
        assert all(alive), "\n".join(w.log()[-2000:] for w in workers)
        assert [p.stop(signal.SIGTERM) for p in (ingest, *workers)] == [0, 0, 0]
    finally:
        stream.halt.set()
        for process in (ingest, *workers):
            process.stop(signal.SIGKILL)
        sent.close()
    for _ in range(5):
        answers.poll()
    answers.close()
    assert set(answers.answers()) == set(sent.sent)  # nothing lost
    return answers, sent


# Where each worker starts reading after a rebalance, and what each transaction committed:
# a duplicate can then be traced to the offsets it was read again from.
OFFSET_LOGS = (
    "kafka.coordinator.consumer=DEBUG,kafka.producer.transaction_manager=DEBUG,"
    "genrec.online.transactions=DEBUG"
)


def _duplicates(answers: Recommendations, sent: Events) -> str:
    """Each event answered more than once: its (partition, offset) and every answer's
    request id, produce time and where it sits on the recommendations topic."""
    counts = answers.answers()
    lines = []
    for event_id in sorted(e for e, n in counts.items() if n > 1):
        copies = [m for m in answers.messages if event_id in m.covered_event_ids]
        seen = ", ".join(f"{m.request_id} at {m.produced_at}" for m in copies)
        lines.append(f"{event_id} {sent.offsets.get(event_id)}: {seen}")
    return "\n".join(lines)


def _leader_of(kafka: KafkaSettings, topic: str, partition: int) -> int:
    admin = KafkaAdminClient(bootstrap_servers=kafka.bootstrap)
    try:
        (described,) = admin.describe_topics([topic])
    finally:
        admin.close()
    return next(
        p.get("leader_id", p.get("leader"))
        for p in described["partitions"]
        if p.get("partition_index", p.get("partition")) == partition
    )


def test_cluster_broker_kill_9_exactly_once_answers_every_event_once(
    serving_home, kafka_cluster, tmp_path
) -> None:
    """Once an expected failure (1 run in 14 answered a partition's events twice): a
    TxnOffsetCommit refused under the coordinators' failover kept its offsets in
    kafka-python's producer and committed them with its next transaction, setting the
    partition back; the publisher now replaces such a producer (tests/test_transactions.py)."""
    answers, sent = _kill_a_broker_mid_stream(serving_home, kafka_cluster, tmp_path, "exactly_once")
    twice = _duplicates(answers, sent)
    if twice:
        traces = "\n".join(
            f"--- worker{n}:\n" + "\n".join(
                line[:600] for line in (tmp_path / f"worker{n}.log").read_text().splitlines()
                if any(k in line for k in ("Setting offset", "committed transaction", "partitions",
                                           "transactional producer", "aborted", "retried",
                                           "Transition from", "transactional response",
                                           "skipping", "not published"))
            )
            for n in range(2)
        )  # fmt: skip
        raise AssertionError(f"answered more than once:\n{twice}\n{traces}")


def test_cluster_broker_kill_9_at_least_once_counts_its_duplicates(
    serving_home, kafka_cluster, tmp_path
) -> None:
    """The same failure at-least-once: nothing lost; the duplicates it does produce are
    counted (printed), so the difference from exactly-once is measured, not assumed."""
    answers, _sent = _kill_a_broker_mid_stream(
        serving_home, kafka_cluster, tmp_path, "at_least_once"
    )
    counts = answers.answers()
    twice = sum(1 for n in counts.values() if n > 1)
    print(f"at_least_once, broker kill -9: {len(counts)} events, {twice} answered more than once")


# --- hosts that share no files (issue #20): only PostgreSQL, Redis and Kafka --------------


def remote_worker_env(refresh_host: Settings) -> dict[str, str]:
    """What a worker on another host shares with ``refresh_host``: database, Redis, stores."""
    password = refresh_host.redis.password
    return {
        **({"GENREC_REDIS__PASSWORD": password.get_secret_value()} if password else {}),
        "GENREC_DATABASE_URL": str(refresh_host.database_url),
        "GENREC_ARTIFACTS__STORE": refresh_host.artifacts.store,
        "GENREC_ONLINE__KV_STORE": refresh_host.online.kv_store,
        "GENREC_REDIS__HOST": refresh_host.redis.host,
        "GENREC_REDIS__PORT": str(refresh_host.redis.port),
        "GENREC_REDIS__KEY_PREFIX": refresh_host.redis.key_prefix,
    }


def serving_version_of(worker: Worker) -> str:
    """The KV version label of the serving version the worker's metrics say it serves."""
    for line in worker.get("/metrics")[1].decode().splitlines():
        if line.startswith("genrec_serving_version_info{") and line.endswith(" 1.0"):
            return line.split('kv_version="', 1)[1].split('"', 1)[0]
    return ""


def test_workers_on_separate_homes_serve_prefix_kv_from_redis_and_fetched_artifacts(
    published_serving_store, redis_server, kafka_broker, tmp_path, monkeypatch
) -> None:
    """Two `genrec serve` processes, each with its own empty GENREC_HOME, no file in common:
    the store is PostgreSQL, the prefix KV in Redis, and the model and recall files come
    from the database into each home's cache (``artifacts.store = database``), at start and
    on the switch to the next refreshed version. Both answer cached users from prefix KV."""
    from genrec.offline.refresh import run_refresh

    refresh_host = published_serving_store
    for name, value in remote_worker_env(refresh_host).items():
        monkeypatch.setenv(name, value)  # Worker passes its environment on
    engine = make_engine(refresh_host.database_url)
    first = active_serving_version(engine)
    prefix = refresh_host.redis.key_prefix
    assert sum(1 for _ in redis_server.client().scan_iter(match=f"{prefix}*")) >= SERVING_USERS
    # The refresh host's volume is out of reach while the workers start: every path the
    # database names (model_versions.artifact_dir, ...) is missing.
    unmounted = refresh_host.home.with_name("refresh-host-unmounted")
    refresh_host.home.rename(unmounted)
    kafka, group, sent, answers = fresh_stream(kafka_broker)
    homes = [tmp_path / f"host-{name}" for name in "ab"]
    workers = [Worker(home, kafka, group, tmp_path / f"{home.name}.log") for home in homes]
    stream = EventStream(sent, rate=30)
    try:
        for worker in workers:
            worker.wait_healthy(timeout=180)
        stream.start()
        wait_for(
            lambda: all(metric_value(w.get("/metrics")[1].decode(), "genrec_requests_total",
                                     path="prefix_kv") > 0 for w in workers),
            180, "prefix-KV answers from both workers",
        )  # fmt: skip
        unmounted.rename(refresh_host.home)
        second = run_refresh(refresh_host.model_copy(update={
            "refresh": refresh_host.refresh.model_copy(update={"semantic_ids": False,
                                                            "retrain_target": False})}),
            engine)  # fmt: skip
        wanted = str(second.kv_version)
        wait_for(lambda: all(serving_version_of(w) == wanted for w in workers), 120,
                 "both workers on the new version")  # fmt: skip
        time.sleep(2.0)
        stream.stop()
        answers.wait_answered(list(sent.sent), 120)
        texts = [w.get("/metrics")[1].decode() for w in workers]
        assert [w.stop(signal.SIGTERM) for w in workers] == [0, 0], workers[0].log()
    finally:
        stream.halt.set()
        for worker in workers:
            worker.stop(signal.SIGKILL)
        sent.close()
        engine.dispose()
    for text in texts:  # each worker read caches from Redis, and Redis never failed it
        assert metric_value(text, "genrec_prefix_kv_lookups_total", result="store") > 0
        assert metric_value(text, "genrec_prefix_kv_lookups_total", result="unavailable") == 0
    assert answers.answers() == Counter({event_id: 1 for event_id in sent.sent})
    versions = {
        str(first.version): first.kv_version,
        str(second.serving_version): second.kv_version,
    }
    for message in answers.messages:  # every streamed user has a cache in both versions
        assert message.decoding["path"] == "prefix_kv", message.decoding
        assert versions[message.decoding["serving_version"]] == message.decoding["kv_version"]
        assert message.branches["generative"] and message.branches["itemcf"]
    assert {m.decoding["serving_version"] for m in answers.messages} == set(versions)
    for home in homes:  # the files each worker loaded: its own verified copies
        for version in (first.version, second.serving_version):
            tree = home / "var" / "artifact_cache" / f"v{version:06d}"
            assert (tree / "model" / "target" / "model.safetensors").is_file()
            assert (tree / "recall" / "itemcf" / "manifest.json").is_file()
        assert not (home / "var" / "prefix_kv").exists()  # no KV files: Redis holds them
        assert not (home / "var" / "genrec.db").exists()
    published = second.counts["artifacts"]
    print(f"version {second.serving_version} published {published}")  # the model: not again
    assert published["new_bytes"] < published["bytes"] / 2
    answers.close()
