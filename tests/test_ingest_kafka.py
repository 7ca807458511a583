"""Ingest against the real Kafka broker, on SQLite and PostgreSQL: exactly-once storage under failures."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from kafka import KafkaConsumer, KafkaProducer
from sqlalchemy import select

from genrec.app.bench.ingest import run_bench, synthetic_events
from genrec.infra.database import make_engine
from genrec.infra.settings import IngestSettings, Settings
from genrec.infra.topics import KafkaTopicsError
from genrec.ingest.consumer import Ingestor
from genrec.ingest.replay import replay_events
from genrec.schemas.events import DeadLetter
from genrec.schemas.tables import events
from tests.helpers import count_rows, fresh_kafka, unique_kafka, wait_for

pytestmark = pytest.mark.integration

GENREC = Path(sys.executable).parent / "genrec"


def make_settings(kafka_settings, database_url: str, tmp_path: Path, **ingest) -> Settings:
    return Settings(
        home=tmp_path,
        database_url=database_url,
        kafka=kafka_settings,
        ingest=IngestSettings(**ingest),
    )


def produce_range(settings: Settings, start: int, stop: int) -> None:
    """Events bench-{start}..bench-{stop-1}, 200 users, keyed by user, in id order."""
    frame = synthetic_events(stop, users=200).iloc[start:stop]
    replay_events(settings, frame, progress=False)


def stored_ids(database_url: str) -> list[str]:
    engine = make_engine(database_url)
    try:
        with engine.connect() as connection:
            return list(
                connection.execute(select(events.c.event_id).order_by(events.c.id)).scalars()
            )
    finally:
        engine.dispose()


def assert_exactly(database_url: str, n: int) -> None:
    ids = stored_ids(database_url)
    assert len(ids) == n and set(ids) == {f"bench-{i}" for i in range(n)}


def test_round_trip_exact_counts_and_order(kafka_settings, database_url, tmp_path):
    settings = make_settings(kafka_settings, database_url, tmp_path, batch_size=2000)
    produce_range(settings, 0, 10_000)
    stats = Ingestor(settings).run(exit_when_idle_s=3)
    assert (stats.events_stored, stats.events_rejected, stats.events_duplicate) == (10_000, 0, 0)
    assert stats.lag == 0
    assert_exactly(database_url, 10_000)
    engine = make_engine(database_url)
    with engine.connect() as connection:
        rows = connection.execute(
            select(events.c.user_id, events.c.event_id).order_by(
                events.c.user_id, events.c.ts_ms, events.c.id
            )
        ).all()
    engine.dispose()
    # Per user, the store keeps the produced order (ids grow with time here).
    last: dict[str, int] = {}
    for user_id, event_id in rows:
        number = int(event_id.split("-")[1])
        assert number > last.get(user_id, -1)
        last[user_id] = number


BAD = {
    "not_utf8": b"\xff\xfe\x00 not text",
    "not_json": b"{'event_id': 1}",
    "schema_violation": b'{"event_id": "x1", "user_id": "u", "item_id": "i", "event_type": "view", "ts": 1, "value": "high"}',
    "unknown_event_type": b'{"event_id": "x2", "user_id": "u", "item_id": "i", "event_type": "like", "ts": 1}',
    "missing_id": b'{"user_id": "u", "item_id": "i", "event_type": "view", "ts": 1}',
    "too_large": json.dumps(
        {
            "event_id": "x3",
            "user_id": "u",
            "item_id": "i",
            "event_type": "view",
            "ts": 1,
            "context": {"blob": "x" * 3000},
        }
    ).encode(),
    "bad_timestamp": b'{"event_id": "x4", "user_id": "u", "item_id": "i", "event_type": "view", "ts": "soon"}',
}


def test_ingest_without_its_topic_stops_with_a_clear_error(kafka_broker, tmp_path):
    kafka = unique_kafka(kafka_broker).model_copy(update={"topic_wait_s": 2.0})
    settings = make_settings(kafka, f"sqlite:///{tmp_path / 'store.db'}", tmp_path)
    before = set(multiprocessing.active_children())
    with pytest.raises(KafkaTopicsError, match=f"{kafka.topic_events} has no partitions"):
        Ingestor(settings)
    assert set(multiprocessing.active_children()) == before  # the writer child is gone


def test_bad_input_goes_to_the_dead_letter_topic(kafka_settings, database_url, tmp_path):
    settings = make_settings(kafka_settings, database_url, tmp_path, max_message_bytes=2048)
    producer = KafkaProducer(**kafka_settings.client_config())
    sent = []
    for i, (reason, raw) in enumerate(BAD.items()):
        good = json.dumps(
            {"event_id": f"g{i}", "user_id": "u", "item_id": "i", "event_type": "view", "ts": 1}
        ).encode()
        for value in (good, raw):
            meta = producer.send(kafka_settings.topic_events, key=b"u", value=value).get(timeout=30)
            sent.append((reason if value is raw else None, meta.partition, meta.offset, value))
    producer.close()
    stats = Ingestor(settings).run(exit_when_idle_s=3)
    assert stats.events_stored == len(BAD) and stats.events_rejected == len(BAD)
    assert sorted(stored_ids(database_url)) == sorted(f"g{i}" for i in range(len(BAD)))

    consumer = KafkaConsumer(
        kafka_settings.topic_dlq,
        **kafka_settings.client_config(),
        auto_offset_reset="earliest",
        consumer_timeout_ms=5000,
    )
    letters = [(DeadLetter.model_validate_json(m.value), dict(m.headers)) for m in consumer]
    consumer.close()
    expected = {
        (reason, partition, offset, value) for reason, partition, offset, value in sent if reason
    }
    got = {
        (letter.reason, letter.source_partition, letter.source_offset, letter.original())
        for letter, _ in letters
    }
    assert got == expected
    assert all(
        headers["reason"] == letter.reason.encode() and letter.key == "u"
        for letter, headers in letters
    )
    assert all(
        letter.source_topic == kafka_settings.topic_events and letter.detail
        for letter, _ in letters
    )


def test_redelivery_after_a_crash_before_the_commit_stores_nothing_twice(kafka_settings, tmp_path):
    url = f"sqlite:///{tmp_path / 'crash.db'}"
    settings = make_settings(kafka_settings, url, tmp_path)
    produce_range(settings, 0, 3000)
    crashed = Ingestor(settings)
    crashed._commit_with_retry = lambda offsets: None  # the process dies right after the DB commit
    assert crashed.run(exit_when_idle_s=3).events_stored == 3000
    again = Ingestor(settings).run(exit_when_idle_s=3)
    assert (again.events_stored, again.events_duplicate) == (0, 3000)
    assert_exactly(url, 3000)


def ingest_process(settings: Settings, log_path: Path, *extra: str) -> subprocess.Popen:
    env = {
        **os.environ,
        "GENREC_HOME": str(settings.home),
        "GENREC_DATABASE_URL": str(settings.database_url),
        "GENREC_KAFKA__BOOTSTRAP": settings.kafka.bootstrap,
        "GENREC_KAFKA__TOPIC_EVENTS": settings.kafka.topic_events,
        "GENREC_KAFKA__TOPIC_DLQ": settings.kafka.topic_dlq,
        "GENREC_INGEST__BATCH_SIZE": str(settings.ingest.batch_size),
        "GENREC_INGEST__PROGRESS_EVERY_S": "1",
    }
    handle = log_path.open("ab")
    return subprocess.Popen(
        [str(GENREC), "ingest", *extra], env=env, stdout=handle, stderr=subprocess.STDOUT
    )


def test_kill_9_mid_stream_then_restart_stores_each_event_once(
    kafka_settings, database_url, tmp_path
):
    settings = make_settings(kafka_settings, database_url, tmp_path, batch_size=200)
    log_path = tmp_path / "ingest.log"
    produce_range(settings, 0, 6000)
    first = ingest_process(settings, log_path, "--exit-when-idle", "120")
    try:
        wait_for(lambda: count_rows(database_url) >= 600, 120, "the first process to store events")
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
    assert first.returncode == -signal.SIGKILL
    produce_range(settings, 6000, 10_000)
    second = ingest_process(settings, log_path, "--exit-when-idle", "5")
    assert second.wait(timeout=240) == 0, log_path.read_text()[-3000:]
    assert_exactly(database_url, 10_000)


def test_sigterm_drains_and_exits_zero_and_metrics_answer(kafka_settings, tmp_path):
    import urllib.request

    from genrec.app.kafka_broker import pick_free_ports

    url = f"sqlite:///{tmp_path / 'term.db'}"
    settings = make_settings(kafka_settings, url, tmp_path, batch_size=500)
    log_path = tmp_path / "ingest.log"
    produce_range(settings, 0, 2000)
    port = pick_free_ports(1)[0]
    process = ingest_process(settings, log_path, "--metrics-port", str(port))

    def get(path: str) -> tuple[int, str]:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read().decode()

    def stored_metric() -> float:
        lines = get("/metrics")[1].splitlines()
        return sum(
            float(line.rsplit(" ", 1)[1]) for line in lines
            if line.startswith("genrec_events_total{")
            and 'component="ingest"' in line and 'outcome="stored"' in line
        )  # fmt: skip

    try:
        wait_for(lambda: count_rows(url) == 2000, 120, "all events stored")
        wait_for(lambda: stored_metric() == 2000, 30, "the stored-events metric")
        status, body = get("/healthz")
        health = json.loads(body)
        assert status == 200 and health["ok"] and health["role"] == "ingest"
        assert health["stored"] == 2000 and health["writer"] == "process"
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0, log_path.read_text()[-3000:]
    assert "(done)" in log_path.read_text()


def committed_total(settings: Settings) -> int:
    """Sum of the ingest group's committed offsets on the events topic (-1: not known yet)."""
    from kafka import KafkaAdminClient
    from kafka.errors import KafkaError

    admin = KafkaAdminClient(bootstrap_servers=settings.kafka.bootstrap, request_timeout_ms=10_000)
    try:
        offsets = admin.list_group_offsets(settings.ingest.group_id)[settings.ingest.group_id]
    except KafkaError:  # e.g. NotCoordinator while a restarted broker loads its groups
        return -1
    finally:
        admin.close()
    return sum(
        meta.offset for tp, meta in offsets.items() if tp.topic == settings.kafka.topic_events
    )


def test_broker_restart_mid_stream_loses_nothing(stoppable_kafka_broker, tmp_path, monkeypatch):
    import genrec.ingest.consumer as consumer_module

    url = f"sqlite:///{tmp_path / 'outage.db'}"
    kafka = fresh_kafka(stoppable_kafka_broker)
    settings = make_settings(kafka, url, tmp_path, batch_size=500)
    produce_range(settings, 0, 5000)
    # With (almost) no reconnect back-off every connection attempt in the outage is
    # refused at once, which makes kafka-python 3.0 raise KafkaConnectionError from
    # poll() every time (a coordinator lookup, then a metadata refresh, both refused),
    # not only when the timing happens to line up as in the CI run that found it.
    real_config = consumer_module.consumer_config
    monkeypatch.setattr(
        consumer_module,
        "consumer_config",
        lambda *a, **k: {
            **real_config(*a, **k),
            "reconnect_backoff_ms": 1,
            "reconnect_backoff_max_ms": 1,
        },  # fmt: skip
    )
    ingestor = Ingestor(settings)
    died: list[BaseException] = []

    def run() -> None:
        try:
            ingestor.run()
        except BaseException as exc:  # reported by resumed() at once, not after its timeout
            died.append(exc)

    def stored(expected: int) -> Callable[[], bool]:
        def check() -> bool:
            assert not died, f"the ingest loop died in the outage: {died[0]!r}"
            return count_rows(url) == expected

        return check

    def outage(seconds: float) -> None:
        stoppable_kafka_broker.down()
        time.sleep(seconds)  # the consumer polls, commits and looks for its coordinator
        stoppable_kafka_broker.up(timeout=180)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: ingestor.stats.events_stored >= 500, 120, "ingest to start storing")
        # Mid-stream, and longer than the 10 s session: commits fail until the broker
        # is back, then the group must rebalance (this member's session expired) and
        # refuses commits until a poll() completes it.
        outage(12)
        wait_for(stored(5000), 180, "ingest to resume after the first outage")
        committed = [-1]

        def all_committed() -> bool:
            committed[0] = committed_total(settings)
            return committed[0] == 5000

        try:
            wait_for(all_committed, 120, "the last commit")
        except AssertionError as exc:
            raise AssertionError(f"{exc}: committed {committed[0]} of 5000") from None
        outage(5)  # idle: the loop sits in poll(), which raises as described above
        produce_range(settings, 5000, 8000)
        wait_for(stored(8000), 180, "ingest to resume after the second outage")
    finally:
        ingestor.stop()
        thread.join(timeout=60)
    assert not thread.is_alive()
    assert_exactly(url, 8000)
    assert ingestor.loop.outage.errors > 0  # the outage did reach poll(), and was ridden out


def test_two_processes_share_partitions_and_store_each_event_once(
    kafka_settings, database_url, tmp_path
):
    """B joins while A is mid-stream (a rebalance with a write in flight); then both share."""
    settings = make_settings(kafka_settings, database_url, tmp_path, batch_size=100)
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    frame = synthetic_events(12_000, users=200)

    def b_assigned() -> bool:
        return logs[1].exists() and "partitions assigned: ['" in logs[1].read_text()

    def produce() -> None:
        replay_events(settings, frame.iloc[:6_000], rate=800, progress=False)
        # The rest once B holds partitions: on a slow host B's start-up outlasted the
        # whole stream once, A stored every event and B none.
        wait_for(b_assigned, 180, "B's partitions")
        replay_events(settings, frame.iloc[6_000:], rate=800, progress=False)

    producer = threading.Thread(target=produce)
    processes = [ingest_process(settings, logs[0], "--exit-when-idle", "8")]
    try:
        wait_for(lambda: "partitions assigned: ['" in logs[0].read_text(), 120, "A's partitions")
        producer.start()
        wait_for(lambda: count_rows(database_url) >= 2000, 120, "A to store events")
        processes.append(ingest_process(settings, logs[1], "--exit-when-idle", "8"))
        producer.join(timeout=300)
        for process, path in zip(processes, logs, strict=True):
            assert process.wait(timeout=240) == 0, path.read_text()[-3000:]
    finally:
        for process in processes:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
    stored = [
        int(re.findall(r"stored ([\d,]+),.*\(done\)", path.read_text())[-1].replace(",", ""))
        for path in logs
    ]
    assert all(count > 0 for count in stored) and sum(stored) == 12_000
    assert "partitions revoked" in logs[0].read_text()
    assert_exactly(database_url, 12_000)


def test_bench_ingest_times_every_store_on_the_same_topic(
    kafka_settings, postgres_server, tmp_path, capsys
):
    if postgres_server is None:
        pytest.skip("GENREC_TEST_SKIP_POSTGRES=1")
    settings = make_settings(kafka_settings, f"sqlite:///{tmp_path / 'unused.db'}", tmp_path)
    result = run_bench(settings, n_events=20_000, stores=("sqlite", "postgres"))
    assert result["sqlite_stored"] == result["postgres_stored"] == 20_000
    assert result["ingest_postgres_events_per_s"] > 0
    assert result["ingest_to_bare_ratio"] == result["ingest_sqlite_to_bare_ratio"] > 0
    assert "ingest (postgres" in capsys.readouterr().out
    with pytest.raises(ValueError, match="stores must be"):
        run_bench(settings, n_events=10, stores=("mysql",))
