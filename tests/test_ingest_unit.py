"""Ingest without Kafka: the batch protocol with fakes, the store on SQLite and PostgreSQL, replay framing."""

from __future__ import annotations

import json
from collections import namedtuple

import pandas as pd
import pytest
from kafka.structs import TopicPartition
from sqlalchemy import func, select
from sqlalchemy.schema import CreateTable

from genrec.infra.database import make_engine
from genrec.infra.settings import Settings
from genrec.ingest import consumer as consumer_module
from genrec.ingest import replay
from genrec.ingest import store as store_module
from genrec.ingest.consumer import Ingestor
from genrec.ingest.store import delete_events, upsert_items, write_events
from genrec.schemas.tables import events, items, users

Record = namedtuple("Record", "topic partition offset key value timestamp")


def event_bytes(i: int, user: str = "u1", ts: int | None = None) -> bytes:
    return json.dumps(
        {
            "event_id": f"e{i}",
            "user_id": user,
            "item_id": f"i{i % 7}",
            "event_type": "click",
            "ts": ts if ts is not None else 1_000 + i,
        }
    ).encode()


class FakeConsumer:
    def __init__(self, batches, journal):
        self.batches, self.journal, self.committed = list(batches), journal, {}
        self.owned = set()
        self.commit_errors: list[Exception] = []  # raised by the next commits, in order

    def poll(self, timeout_ms=0):
        batch = self.batches.pop(0) if self.batches else {}
        if isinstance(batch, Exception):
            raise batch
        self.owned.update(batch)
        return batch

    def commit(self, offsets, timeout_ms=None):
        if self.commit_errors:
            self.journal.append("commit refused")
            raise self.commit_errors.pop(0)
        self.journal.append("commit")
        self.committed.update({tp: meta.offset for tp, meta in offsets.items()})

    def assignment(self):
        return self.owned

    def close(self, autocommit=True):
        self.journal.append("close")


class FakeDeadLetters:
    def __init__(self, journal):
        self.journal, self.letters = journal, []

    def publish(self, letters, stop=None):
        self.journal.append("dlq")
        self.letters.extend(letters)

    def close(self):
        pass


def make_ingestor(tmp_path, batches, **ingest):
    journal: list[str] = []
    settings = Settings(home=tmp_path, ingest=ingest)
    engine = make_engine(str(settings.database_url))
    consumer = FakeConsumer(batches, journal)
    dead = FakeDeadLetters(journal)
    ingestor = Ingestor(settings, engine=engine, consumer=consumer, dead_letters=dead)
    return ingestor, consumer, dead, journal, engine


def test_batch_stores_rejects_then_commits(tmp_path):
    tp0, tp1 = TopicPartition("t", 0), TopicPartition("t", 1)
    batch = {
        tp0: [
            Record("t", 0, 10, b"u1", event_bytes(1), 0),
            Record("t", 0, 11, b"u1", b"garbage", 0),
        ],
        tp1: [Record("t", 1, 5, b"u2", event_bytes(2, "u2"), 0)],
    }
    ingestor, consumer, dead, journal, engine = make_ingestor(tmp_path, [batch, batch])
    stats = ingestor.run(exit_when_idle_s=0.0)
    assert journal == ["dlq", "commit", "dlq", "commit", "close"]
    assert consumer.committed == {tp0: 12, tp1: 6}  # next offset to read, per partition
    assert (stats.events_stored, stats.events_duplicate, stats.events_rejected) == (2, 2, 2)
    assert [letter.reason for letter in dead.letters] == ["not_json", "not_json"]
    assert dead.letters[0].source_offset == 11 and dead.letters[0].original() == b"garbage"
    with engine.connect() as connection:
        stored = connection.execute(select(events.c.event_id, events.c.kafka_offset)).all()
    assert sorted(stored) == [("e1", 10), ("e2", 5)]


def test_metrics_count_each_outcome_and_health_follows_the_loop(tmp_path):
    from genrec.infra import metrics

    def count(outcome: str) -> float:
        return metrics.EVENTS.labels(component="ingest", outcome=outcome)._value.get()

    before = {o: count(o) for o in ("stored", "duplicate", "dead_lettered")}
    tp0 = TopicPartition("t", 0)
    batch = {tp0: [Record("t", 0, 1, b"u1", event_bytes(1), 0), Record("t", 0, 2, b"u", b"x", 0)]}
    ingestor, *_ = make_ingestor(tmp_path, [batch, batch])
    ok, details = ingestor.health()
    assert ok and details["role"] == "ingest" and details["writer"] == "thread"
    ingestor.run(exit_when_idle_s=0.0)
    after = {o: count(o) - before[o] for o in before}
    assert after == {"stored": 1, "duplicate": 1, "dead_lettered": 2}
    ingestor.stop()
    assert ingestor.health()[0] is False  # stopping: take it out of rotation


def test_stop_finishes_the_batch_in_hand(tmp_path):
    tp = TopicPartition("t", 0)
    batches = [{tp: [Record("t", 0, i, b"u1", event_bytes(i), 0)]} for i in range(5)]
    ingestor, consumer, _, journal, _ = make_ingestor(tmp_path, batches)
    original = ingestor._write_with_retry

    def write_then_stop(rows):
        ingestor.stop()  # as the SIGTERM handler does, mid-batch
        return original(rows)

    ingestor._write_with_retry = write_then_stop
    stats = ingestor.run()
    assert stats.batches == 1 and consumer.committed == {tp: 1} and journal[-1] == "close"


def test_offsets_a_rebalance_left_behind_are_committed_while_idle(tmp_path):
    tp = TopicPartition("t", 0)
    batch = {tp: [Record("t", 0, 7, b"u1", event_bytes(7), 0)]}
    ingestor, consumer, _, journal, _ = make_ingestor(tmp_path, [])
    consumer.owned.add(tp)  # assigned back to this consumer by the same rebalance
    ingestor._in_flight = ingestor._start_store(ingestor.prepare(batch))
    ingestor.drain(commit=False)  # what on_partitions_revoked does
    assert consumer.committed == {}
    ingestor.run(exit_when_idle_s=0.0)  # no batch comes: the idle loop commits them
    assert consumer.committed == {tp: 8}


def test_a_commit_refused_by_a_rebalance_waits_for_the_next_poll_instead_of_spinning(
    tmp_path, monkeypatch
):
    from kafka.errors import CommitFailedError, RebalanceInProgressError

    tp = TopicPartition("t", 0)
    first, second = ({tp: [Record("t", 0, i, b"u1", event_bytes(i), 0)]} for i in (1, 2))
    ingestor, consumer, _, journal, _ = make_ingestor(tmp_path, [first, second])
    # kafka-python: "You can try completing the rebalance by calling poll()". Retrying the
    # commit without a poll in between would never succeed (a CI run spun for 2 minutes).
    consumer.commit_errors = [RebalanceInProgressError("rebalancing"), CommitFailedError("gone")]
    fail = lambda _seconds: pytest.fail("the commit retried in place")  # noqa: E731
    monkeypatch.setattr(consumer_module.time, "sleep", fail)
    stats = ingestor.run(until=lambda _: consumer.committed.get(tp) == 3 or len(journal) > 20)
    assert stats.events_stored == 2 and consumer.committed == {tp: 3}
    # refused with batch 2 in flight, refused again when idle, then committed when idle
    assert journal[:3] == ["commit refused", "commit refused", "commit"]


def test_a_commit_error_that_waiting_cannot_fix_stops_ingest_with_that_error(tmp_path, monkeypatch):
    from kafka.errors import GroupAuthorizationFailedError, KafkaConnectionError

    tp = TopicPartition("t", 0)
    first, second = ({tp: [Record("t", 0, i, b"u1", event_bytes(i), 0)]} for i in (1, 2))
    ingestor, consumer, _, journal, _ = make_ingestor(tmp_path, [first, second])
    consumer.commit_errors = [KafkaConnectionError("refused"), GroupAuthorizationFailedError()]
    monkeypatch.setattr(consumer_module.time, "sleep", lambda _seconds: None)  # retry at once
    with pytest.raises(GroupAuthorizationFailedError):
        ingestor.run(exit_when_idle_s=0.0)
    # the broker error was retried, the authorization error was not; the consumer closed
    assert journal.count("commit refused") == 2 and journal[-1] == "close"
    assert ingestor.stats.events_stored >= 1 and consumer.committed == {}


def test_a_broker_outage_in_poll_is_ridden_out_without_an_idle_exit(tmp_path):
    from kafka.errors import KafkaConnectionError, NodeNotReadyError

    tp = TopicPartition("t", 0)
    first, second = ({tp: [Record("t", 0, i, b"u1", event_bytes(i), 0)]} for i in (1, 2))
    outage = [KafkaConnectionError("111 ECONNREFUSED"), NodeNotReadyError("metadata")]
    ingestor, consumer, _, journal, engine = make_ingestor(tmp_path, [first, *outage, second])
    ingestor.loop.outage.first_backoff_s = ingestor.loop.outage.max_backoff_s = 0.01
    # exit_when_idle_s=0 ends the run at the first empty poll: the outage's must not count.
    stats = ingestor.run(exit_when_idle_s=0.0)
    assert stats.events_stored == 2 and consumer.committed == {tp: 3}
    assert ingestor.loop.outage.errors == 2 and ingestor.health()[1]["kafka_unreachable_s"] == 0
    with engine.connect() as connection:
        assert connection.execute(select(func.count()).select_from(events)).scalar() == 2


def test_ingest_health_turns_red_after_two_minutes_without_kafka(tmp_path):
    import time

    ingestor, *_ = make_ingestor(tmp_path, [])
    assert ingestor.health()[0]
    ingestor.loop.outage._since = time.monotonic() - 130  # an outage that began 130 s ago
    ok, details = ingestor.health()
    assert not ok and details["kafka_unreachable_s"] >= 130
    # a deployment that tolerates longer outages
    tolerant, *_ = make_ingestor(tmp_path, [], health_stall_s=300.0)
    tolerant.loop.outage._since = time.monotonic() - 130
    assert tolerant.health()[0]


def test_a_non_retriable_poll_error_is_raised_and_the_consumer_closed(tmp_path):
    from kafka.errors import KafkaConfigurationError

    ingestor, _, _, journal, _ = make_ingestor(tmp_path, [KafkaConfigurationError("bad sasl")])
    with pytest.raises(KafkaConfigurationError):
        ingestor.run(exit_when_idle_s=0.0)
    assert journal[-1] == "close"


def rows(n: int, user: str = "u1", start: int = 0) -> list[dict]:
    return [
        {
            "event_id": f"e{i}",
            "user_id": user,
            "item_id": f"i{i}",
            "event_type": "view",
            "ts_ms": 5_000 - i if i % 2 else 5_000,
            "value": float(i),
            "context": {"i": i},
            "kafka_topic": "t",
            "kafka_partition": 0,
            "kafka_offset": i,
        }
        for i in range(start, start + n)
    ]


def test_store_is_idempotent_and_keeps_order(database_url):
    engine = make_engine(database_url)
    assert write_events(engine, rows(300)) == 300
    assert write_events(engine, rows(300, start=200)) == 200  # 100 already there
    assert write_events(engine, []) == 0
    with engine.connect() as connection:
        stored = connection.execute(
            select(events.c.event_id, events.c.context).order_by(events.c.id)
        ).all()
        span = connection.execute(select(users.c.first_ts_ms, users.c.last_ts_ms)).one()
    assert [r.event_id for r in stored] == [f"e{i}" for i in range(500)]
    assert stored[3].context == {"i": 3}
    assert tuple(span) == (5_000 - 499, 5_000)
    engine.dispose()


def test_deleted_events_narrow_their_users_spans_to_the_events_left(database_url, monkeypatch):
    monkeypatch.setattr(store_module, "DELETE_CHUNK", 2)  # several statements per step
    engine = make_engine(database_url)

    def event(event_id, user, ts_ms):
        return {"event_id": event_id, "user_id": user, "item_id": "i", "event_type": "view",
                "ts_ms": ts_ms}  # fmt: skip

    write_events(engine, [event("a1", "a", 10), event("a2", "a", 20), event("b1", "b", 5)])
    write_events(engine, [event("bench-1", "a", 1), event("bench-2", "a", 99),
                          event("bench-3", "b", 50), event("bench-4", "c", 70)])  # fmt: skip
    assert delete_events(engine, ["bench-1", "bench-2", "bench-3", "bench-4", "never"]) == 4
    assert delete_events(engine, []) == 0
    with engine.connect() as connection:
        left = connection.execute(select(events.c.event_id).order_by(events.c.id)).scalars()
        spans = connection.execute(
            select(users.c.user_id, users.c.first_ts_ms, users.c.last_ts_ms).order_by(
                users.c.user_id
            )
        ).all()
    assert list(left) == ["a1", "a2", "b1"]
    assert [tuple(s) for s in spans] == [("a", 10, 20), ("b", 5, 5)]  # "c" had only bench-4
    # the next event's id is past the deleted ones (readers keep "everything up to an id")
    write_events(engine, [event("next", "a", 30)])
    with engine.connect() as connection:
        ids = dict(connection.execute(select(events.c.event_id, events.c.id)).all())
    assert ids["next"] == 8  # seven written before it, not 4 (the id after "b1")
    engine.dispose()


def test_a_sqlite_store_that_would_reuse_deleted_ids_refuses_to_delete(tmp_path):
    url = f"sqlite:///{tmp_path / 'old.db'}"
    old = make_engine(url, create_tables=False)
    with old.begin() as connection:  # the events table as stores made before AUTOINCREMENT
        connection.exec_driver_sql(str(CreateTable(events).compile(old)).replace(
            " AUTOINCREMENT", ""))  # fmt: skip
    old.dispose()
    engine = make_engine(url)
    write_events(engine, rows(3))
    assert store_module.reuses_event_ids(engine)
    assert not store_module.reuses_event_ids(make_engine(f"sqlite:///{tmp_path / 'new.db'}"))
    with pytest.raises(ValueError, match="predates AUTOINCREMENT"):
        delete_events(engine, ["e0"])
    with engine.connect() as connection:
        assert connection.execute(select(func.count()).select_from(events)).scalar_one() == 3
    engine.dispose()


def test_items_upsert(database_url):
    engine = make_engine(database_url)
    upsert_items(engine, [{"item_id": "1", "title": "Old"}, {"item_id": "2"}])
    upsert_items(
        engine, [{"item_id": "1", "title": "New", "year": 1999, "attributes": {"brand": "x"}}]
    )
    with engine.connect() as connection:
        got = connection.execute(
            select(items.c.item_id, items.c.title, items.c.year, items.c.attributes).order_by(
                items.c.item_id
            )
        ).all()
        assert connection.execute(select(func.count()).select_from(items)).scalar_one() == 2
    assert tuple(got[0]) == ("1", "New", 1999, {"brand": "x"}) and tuple(got[1]) == (
        "2",
        None,
        None,
        None,
    )
    engine.dispose()


def test_prepare_events_is_a_stable_time_sort_with_file_row_ids():
    frame = pd.DataFrame(
        {
            "user_id": ["a", "b", "a", "c"],
            "item_id": [1, 2, 3, 4],
            "timestamp": ["20", "10", "10", "30"],
            "value": ["5", "", "3", "1"],
        }
    )
    out = replay.prepare_events(frame, event_id_prefix="log")
    assert list(out["event_id"]) == ["log-1", "log-2", "log-0", "log-3"]  # ties keep file order
    assert list(out["ts_ms"]) == [10_000, 10_000, 20_000, 30_000]  # seconds -> ms
    assert list(out["item_id"]) == ["2", "3", "1", "4"] and set(out["event_type"]) == {"rate"}
    assert list(replay.prepare_events(frame, end="0.5")["event_id"]) == ["replay-1", "replay-2"]
    assert list(replay.prepare_events(frame, start="15", end="30")["event_id"]) == ["replay-0"]
    assert list(replay.prepare_events(frame, start="0.5", limit=1)["event_id"]) == ["replay-0"]
    iso = frame.assign(
        timestamp=[
            "1970-01-01T00:00:20Z",
            "1970-01-01T00:00:10Z",
            "1970-01-01T00:00:10Z",
            "1970-01-01T00:00:30Z",
        ]
    )
    assert list(replay.prepare_events(iso)["ts_ms"]) == [10_000, 10_000, 20_000, 30_000]


def test_prepare_events_rejects_bad_files():
    from genrec.infra.errors import UserFacingError

    with pytest.raises(UserFacingError, match="missing"):
        replay.prepare_events(pd.DataFrame({"user_id": [1], "item_id": [2]}))
    with pytest.raises(UserFacingError, match="event_type"):
        replay.prepare_events(
            pd.DataFrame({"user_id": [1], "item_id": [2], "timestamp": [3], "event_type": ["like"]})
        )


def test_ml100k_replay_ids_match_the_store_fixture(ml100k_engine):
    frame = replay.prepare_events(replay.ml100k_events(), event_id_prefix="ml-100k")
    with ml100k_engine.connect() as connection:
        stored = connection.execute(
            select(events.c.event_id, events.c.ts_ms).order_by(events.c.id)
        ).all()
    assert list(frame["event_id"]) == [r.event_id for r in stored]
    assert list(frame["ts_ms"]) == [r.ts_ms for r in stored]
    messages = replay.event_messages(frame.head(1))
    assert (
        json.loads(messages[0][1])["event_type"] == "rate"
        and messages[0][0] == frame["user_id"][0].encode()
    )


def test_item_rows_from_any_columns():
    frame = pd.DataFrame({"item_id": [1, 2], "title": ["A", ""], "brand": ["x", None]})
    assert replay.item_rows(frame) == [
        {"item_id": "1", "title": "A", "genres": None, "year": None, "attributes": {"brand": "x"}},
        {"item_id": "2", "title": None, "genres": None, "year": None, "attributes": None},
    ]
    assert replay.item_rows(pd.DataFrame({"item_id": ["a"]}))[0]["attributes"] is None


# --- validation fast path ------------------------------------------------------

FAST_PATH_CORPUS = [
    # (message, whether the fast path may take it alone)
    (b'{"event_id":"e1","user_id":"u","item_id":"i","event_type":"view","ts":1}', True),
    (b'{"schema_version":1,"event_id":"e1","user_id":7,"item_id":-3,"event_type":"rate",'
     b'"ts":0,"value":4}', True),
    (b'{"event_id":"e1","user_id":"u","item_id":"i","event_type":"cart","ts":253402300799999,'
     b'"value":-0.0,"context":{"page":"home","n":[1,2.5,null],"big":123456789012345678901234}}',
     True),
    (b'{"event_id":"\xc3\xa9v\xe2\x82\xac","user_id":"\xf0\x9f\x98\x80","item_id":"i",'
     b'"event_type":"view","ts":5,"extra":{"x":1},"value":null,"context":null}', True),
    (b'{"event_id":"' + b"x" * 128 + b'","user_id":"u","item_id":"i","event_type":"view","ts":1}',
     True),
    (b'{"event_id":" e1 ","user_id":"u\\t","item_id":"\\u00a0i","event_type":"view","ts":1}', False),
    (b'{"event_id":"\\u001ce1","user_id":"u","item_id":"i","event_type":"view","ts":1}', False),
    (b'{"event_id":"   ","user_id":"u","item_id":"i","event_type":"view","ts":1}', False),
    (b'{"event_id":"","user_id":"u","item_id":"i","event_type":"view","ts":1}', False),
    (b'{"event_id":"' + b"x" * 129 + b'","user_id":"u","item_id":"i","event_type":"view","ts":1}',
     False),
    (b'{"event_id":" ' + b"x" * 128 + b' ","user_id":"u","item_id":"i","event_type":"view",'
     b'"ts":1}', False),
    (b'{"event_id":true,"user_id":"u","item_id":"i","event_type":"view","ts":1}', False),
    (b'{"event_id":1.0,"user_id":"u","item_id":"i","event_type":"view","ts":1}', False),
    (b'{"event_id":123456789012345678901234567890,"user_id":"u","item_id":"i",'
     b'"event_type":"view","ts":1}', False),
    (b'{"event_id":null,"user_id":"u","item_id":"i","event_type":"view","ts":1}', False),
    (b'{"user_id":"u","item_id":"i","event_type":"view","ts":1}', False),
    (b'{"event_id":"e","user_id":"u","item_id":"i","event_type":"View","ts":1}', False),
    (b'{"event_id":"e","user_id":"u","item_id":"i","event_type":["view"],"ts":1}', False),
    (b'{"event_id":"e","user_id":"u","item_id":"i","event_type":"view","ts":true}', False),
    (b'{"event_id":"e","user_id":"u","item_id":"i","event_type":"view","ts":1.0}', False),
    (b'{"event_id":"e","user_id":"u","item_id":"i","event_type":"view","ts":1.5}', False),
    (b'{"event_id":"e","user_id":"u","item_id":"i","event_type":"view","ts":"1700000000000"}',
     False),
    (b'{"event_id":"e","user_id":"u","item_id":"i","event_type":"view",'
     b'"ts":"2024-01-01T00:00:00+02:00"}', False),
    (b'{"event_id":"e","user_id":"u","item_id":"i","event_type":"view","ts":-1}', False),
    (b'{"event_id":"e","user_id":"u","item_id":"i","event_type":"view","ts":253402300800000}',
     False),
    (b'{"event_id":"e","user_id":"u","item_id":"i","event_type":"view","ts":1e400}', False),
    (b'{"event_id":"e","user_id":"u","item_id":"i","event_type":"view","ts":1,'
     b'"schema_version":2}', False),
    (b'{"event_id":"e","user_id":"u","item_id":"i","event_type":"view","ts":1,'
     b'"schema_version":1.0}', False),
    (b'{"event_id":"e","user_id":"u","item_id":"i","event_type":"view","ts":1,'
     b'"schema_version":null}', False),
    (b'{"event_id":"e","user_id":"u","item_id":"i","event_type":"view","ts":1,"value":NaN}', False),
    (b'{"event_id":"e","user_id":"u","item_id":"i","event_type":"view","ts":1,"value":true}',
     False),
    (b'{"event_id":"e","user_id":"u","item_id":"i","event_type":"view","ts":1,"value":"4.5"}',
     False),
    (b'{"event_id":"e","user_id":"u","item_id":"i","event_type":"view","ts":1,'
     b'"value":9007199254740993}', False),
    (b'{"event_id":"e","user_id":"u","item_id":"i","event_type":"view","ts":1,"context":[1]}',
     False),
    (b'{"event_id":"e","user_id":"u","item_id":"i","event_type":"view","ts":1,'
     b'"context":{"x":NaN}}', True),
    (b'{"event_id":"a","event_id":"b","user_id":"u","item_id":"i","event_type":"view","ts":1}',
     True),
    (b'[1, 2]', False),
    (b'"just text"', False),
    (b'{"event_id":"e1"', False),
    (b'{"event_id":"\\ud800","user_id":"u","item_id":"i","event_type":"view","ts":1}', False),
]  # fmt: skip


def pydantic_only(raw: bytes):
    """What the authoritative pydantic path alone makes of ``raw`` (fields or reason)."""
    from pydantic import ValidationError

    from genrec.schemas.events import UserEvent, classify_errors

    try:
        event = UserEvent.model_validate_json(raw)
    except ValidationError as exc:
        return classify_errors(exc).reason
    return (event.event_id, event.user_id, event.item_id, event.event_type, event.ts,
            event.value, event.context)  # fmt: skip


@pytest.mark.parametrize("raw, fast", FAST_PATH_CORPUS)
def test_fast_path_agrees_with_pydantic(raw, fast):
    from genrec.schemas.events import (
        Rejection,
        UserEvent,
        fast_event_fields,
        validate_event,
        validate_event_fields,
    )

    expected = pydantic_only(raw)
    assert (fast_event_fields(raw) is not None) == fast
    fields = validate_event_fields(raw)
    got = fields.reason if isinstance(fields, Rejection) else fields
    # repr tells 1 from 1.0, -0.0 from 0.0 and shows nan: equality alone would not.
    assert repr(got) == repr(expected)
    event = validate_event(raw)
    if isinstance(event, UserEvent):  # (repr again: nan != nan)
        assert repr(event) == repr(UserEvent.model_validate_json(raw))
    else:
        assert event.reason == expected


def test_fast_path_is_not_the_authority_for_rejections():
    from genrec.schemas.events import validate_event_fields

    assert validate_event_fields(None).reason == "not_json"
    assert validate_event_fields(b"\xff{}").reason == "not_utf8"
    assert validate_event_fields(b"{}" + b" " * 100, max_bytes=10).reason == "too_large"
    assert validate_event_fields(b'{"user_id":"u","item_id":"i","event_type":"view","ts":1}')\
        .reason == "missing_id"  # fmt: skip


def test_replay_items_alone_loads_the_catalog_and_produces_nothing(tmp_path, monkeypatch, capsys):
    """A catalog update (new or changed items) without events; no Kafka is needed."""
    from genrec.app.cli import main
    from genrec.infra.settings import get_settings

    url = f"sqlite:///{tmp_path / 'store.db'}"
    monkeypatch.setenv("GENREC_HOME", str(tmp_path))
    monkeypatch.setenv("GENREC_DATABASE_URL", url)
    monkeypatch.setenv("GENREC_KAFKA__BOOTSTRAP", "127.0.0.1:1")  # nothing listens: never used
    get_settings.cache_clear()
    catalog = tmp_path / "items.csv"
    pd.DataFrame({"item_id": ["x", "y"], "title": ["X", "Y"], "brand": ["acme", ""]}).to_csv(
        catalog, index=False
    )
    try:
        assert main(["replay", "--items", str(catalog)]) == 0
        assert "items: 2 upserted into the store (no events replayed)" in capsys.readouterr().out
        engine = make_engine(url)
        with engine.connect() as connection:
            stored = dict(connection.execute(select(items.c.item_id, items.c.title)).all())
            assert connection.execute(select(func.count()).select_from(events)).scalar() == 0
        engine.dispose()
        assert stored == {"x": "X", "y": "Y"}
        assert main(["replay"]) == 2  # nothing to replay or load: a clear error
        assert "give --dataset or --events to replay, or --items" in capsys.readouterr().err
    finally:
        get_settings.cache_clear()


def test_count_events_counts_the_stored_ids_in_chunks(database_url, monkeypatch):
    monkeypatch.setattr(store_module, "DELETE_CHUNK", 2)
    engine = make_engine(database_url)
    write_events(engine, rows(5))
    assert store_module.count_events(engine, ["e0", "e1", "e2", "e4", "never"]) == 4
    assert store_module.count_events(engine, []) == 0
    engine.dispose()
