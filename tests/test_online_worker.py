"""The online worker loop (online/worker.py) with in-memory Kafka clients and a fake recommender."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kafka.structs import TopicPartition

from genrec.infra.settings import Settings
from genrec.online.live_version import ServingBundle, ServingVersions
from genrec.online.worker import OnlineWorker
from genrec.schemas.events import UserEvent
from genrec.schemas.recommendations import RecommendationMessage

TOPIC = "genrec.user-events"


@dataclass
class Record:
    topic: str
    partition: int
    offset: int
    key: bytes
    value: bytes


class FakeConsumer:
    """Hands out queued poll results (raises a queued exception); remembers commits and seeks."""

    def __init__(self, batches: list[list[Record]]) -> None:
        self.batches = deque(batches)
        self.commits: list[dict] = []
        self.seeks: list[tuple] = []
        self.closed = False
        self.listener = None

    def poll(self, timeout_ms=0, max_records=None):
        if not self.batches:
            return {}
        records = self.batches.popleft()
        if isinstance(records, Exception):
            raise records
        by_tp: dict = {}
        for record in records:
            by_tp.setdefault(TopicPartition(record.topic, record.partition), []).append(record)
        return by_tp

    def commit(self, offsets):
        self.commits.append({tp: meta.offset for tp, meta in offsets.items()})

    def assignment(self):
        return {TopicPartition(TOPIC, p) for p in range(3)}

    def seek(self, tp, offset):
        self.seeks.append((tp.partition, offset))

    def highwater(self, tp):
        return None

    def close(self):
        self.closed = True


class Future:
    def __init__(self, error: Exception | None) -> None:
        self.error = error

    def get(self, timeout=None):
        if self.error is not None:
            raise self.error
        return "ack"


class FakeProducer:
    def __init__(self, fail_first_sends: int = 0) -> None:
        self.sent: list[tuple[bytes, RecommendationMessage]] = []
        self.fail_first_sends = fail_first_sends
        self.closed = False

    def send(self, topic, key, value):
        if self.fail_first_sends > 0:
            self.fail_first_sends -= 1
            return Future(RuntimeError("broker said no"))
        self.sent.append((key, RecommendationMessage.model_validate_json(value)))
        return Future(None)

    def flush(self, timeout=None):
        pass

    def close(self):
        self.closed = True


class EchoRecommender:
    """One message per request naming the bundle it was served with."""

    def __init__(self) -> None:
        self.batches: list[list] = []

    def recommend(self, requests, bundle):
        self.batches.append(list(requests))
        return [
            RecommendationMessage(
                request_id=r.event.event_id,
                user_id=r.user_id,
                event_id=r.event.event_id,
                items=[],
                model_version=bundle.key,
                latency_ms=0.0,
                covered_event_ids=[e.event_id for e in r.covered],
                decoding={"path": "fake"},
            )  # fmt: skip
            for r in requests
        ]


def record(partition: int, offset: int, event_id: str, user_id: str, item_id: str = "1") -> Record:
    event = UserEvent(
        event_id=event_id, user_id=user_id, item_id=item_id, event_type="view", ts=offset
    )
    return Record(TOPIC, partition, offset, user_id.encode(), event.to_json_bytes())


def make_worker(batches, producer=None, recommender=None, probe=lambda: "v1", **online):
    settings = Settings(online={"batch_window_ms": 0, **online})
    consumer = FakeConsumer(batches)
    producer = producer or FakeProducer()
    versions = ServingVersions(probe, lambda key: ServingBundle(key)).start(background=False)
    worker = OnlineWorker(
        settings, recommender or EchoRecommender(), versions,
        consumer_factory=lambda listener: consumer, producer_factory=lambda: producer,
    )  # fmt: skip
    return worker, consumer, producer, versions


def test_latest_event_per_user_is_the_request_and_offsets_commit_after_publish() -> None:
    batch = [
        record(0, 10, "a1", "alice"), record(1, 5, "b1", "bob"), record(0, 11, "a2", "alice"),
        Record(TOPIC, 1, 6, b"x", b"not json"), record(0, 12, "a3", "alice"),
    ]  # fmt: skip
    worker, consumer, producer, _ = make_worker([batch])
    report = worker.run(exit_when_idle_s=0)
    answered = {m.event_id: m for _, m in producer.sent}
    assert set(answered) == {"a3", "b1"}
    assert answered["a3"].covered_event_ids == ["a1", "a2", "a3"]
    assert [key for key, _ in producer.sent] == [b"alice", b"bob"]
    assert consumer.commits == [{TopicPartition(TOPIC, 0): 13, TopicPartition(TOPIC, 1): 7}]
    assert report.requests == 2 and report.events == 5 and report.invalid_events == 1
    assert consumer.closed and producer.closed


def test_failed_publish_is_not_committed_and_the_batch_is_retried() -> None:
    batch = [record(2, 40, "c1", "carol"), record(2, 41, "d1", "dave")]
    # the consumer re-delivers the batch after the worker seeks back
    worker, consumer, producer, _ = make_worker([batch, batch], FakeProducer(fail_first_sends=1))
    worker.loop.stop_requested.wait = lambda timeout=None: False  # no retry back-off in tests
    report = worker.run(exit_when_idle_s=0)
    assert consumer.seeks == [(2, 40)]
    assert consumer.commits == [{TopicPartition(TOPIC, 2): 42}]
    # d1 went out in the failed batch too: at-least-once, consumers dedupe on request_id
    assert {m.event_id for _, m in producer.sent} == {"c1", "d1"}
    assert report.publish_failures == 1


def test_a_failing_recommender_rewinds_the_batch_and_turns_health_red() -> None:
    class FlakyRecommender(EchoRecommender):
        def __init__(self, failures: int) -> None:
            super().__init__()
            self.failures = failures

        def recommend(self, requests, bundle):
            if self.failures > 0:
                self.failures -= 1
                raise OSError("behavior store unreachable")
            return super().recommend(requests, bundle)

    batch = [record(1, 7, "f1", "frank")]
    recommender = FlakyRecommender(failures=3)
    worker, consumer, producer, _ = make_worker([batch] * 4, recommender=recommender)
    health = []
    worker.loop.stop_requested.wait = lambda timeout=None: (
        health.append(worker.health()[0]) or False
    )
    worker.run(exit_when_idle_s=0)
    assert consumer.seeks == [(1, 7)] * 3 and health == [True, True, False]
    assert [m.event_id for _, m in producer.sent] == ["f1"]
    assert (
        consumer.commits == [{TopicPartition(TOPIC, 1): 8}]
        and worker.health()[1]["failing_batches"] == 0
    )


def test_big_batches_are_recommended_in_chunks_of_max_batch_users() -> None:
    batch = [record(0, i, f"e{i}", f"user{i}") for i in range(7)]
    recommender = EchoRecommender()
    worker, consumer, producer, _ = make_worker([batch], recommender=recommender, max_batch_users=3)
    worker.run(exit_when_idle_s=0)
    assert [len(b) for b in recommender.batches] == [3, 3, 1]
    assert len(producer.sent) == 7 and len(consumer.commits) == 1


def test_new_version_is_used_from_the_next_batch_on() -> None:
    active = {"key": "v1"}
    batches = [[record(0, 0, "e0", "u0")], [record(0, 1, "e1", "u1")]]
    recommender = EchoRecommender()
    worker, _, producer, versions = make_worker(
        batches, recommender=recommender, probe=lambda: active["key"]
    )
    original = recommender.recommend

    def switch_after_first(requests, bundle):
        messages = original(requests, bundle)
        active["key"] = "v2"
        versions.check_now()
        return messages

    recommender.recommend = switch_after_first
    report = worker.run(exit_when_idle_s=0)
    assert [(m.event_id, m.model_version) for _, m in producer.sent] == [("e0", "v1"), ("e1", "v2")]
    assert report.versions == ["v1", "v2"]


def test_stop_request_drains_the_batch_in_hand() -> None:
    batches = [[record(0, 0, "e0", "u0")], [record(0, 1, "e1", "u1")], [record(0, 2, "e2", "u2")]]
    recommender = EchoRecommender()
    worker, consumer, producer, _ = make_worker(batches, recommender=recommender)
    original = recommender.recommend

    def stop_during_first(requests, bundle):
        worker.request_stop()  # as SIGTERM would, while a batch is being served
        return original(requests, bundle)

    recommender.recommend = stop_during_first
    worker.run()
    assert [m.event_id for _, m in producer.sent] == ["e0"]
    assert consumer.commits == [{TopicPartition(TOPIC, 0): 1}] and consumer.closed


def listening_worker(consumer: FakeConsumer) -> tuple[OnlineWorker, FakeProducer]:
    """A worker with a 50 ms batch window whose rebalance listener ``consumer`` can call."""

    def factory(listener):
        consumer.listener = listener
        return consumer

    producer = FakeProducer()
    worker = OnlineWorker(
        Settings(online={"batch_window_ms": 50}), EchoRecommender(),
        ServingVersions(lambda: "v", ServingBundle).start(background=False),
        consumer_factory=factory, producer_factory=lambda: producer,
    )  # fmt: skip
    return worker, producer


def test_revoked_partitions_are_dropped_from_the_open_batch() -> None:
    class RevokingConsumer(FakeConsumer):
        def poll(self, timeout_ms=0, max_records=None):
            polled = super().poll(timeout_ms, max_records)
            if not polled and worker._pending and not self.seeks:  # a rebalance mid-window
                self.seeks.append("revoked")
                self.listener.on_partitions_revoked([TopicPartition(TOPIC, 1)])
            return polled

    consumer = RevokingConsumer([[record(0, 0, "e0", "u0"), record(1, 0, "f0", "u1")]])
    worker, producer = listening_worker(consumer)
    worker.run(exit_when_idle_s=0.3)
    assert [m.event_id for _, m in producer.sent] == ["e0"]
    assert consumer.commits == [{TopicPartition(TOPIC, 0): 1}]


def test_a_partition_assigned_back_is_read_again_from_its_first_dropped_record() -> None:
    """An eager rebalance revokes every partition, then hands some back; kafka-python keeps
    their fetch positions, so the worker must seek back to the records it dropped."""
    tp0, tp1, tp2 = (TopicPartition(TOPIC, p) for p in range(3))

    class RebalancingConsumer(FakeConsumer):
        def poll(self, timeout_ms=0, max_records=None):
            polled = super().poll(timeout_ms, max_records)
            if not polled and worker._pending and not self.seeks:  # a rebalance mid-window
                self.listener.on_partitions_revoked([tp0, tp1, tp2])
                self.listener.on_partitions_assigned([tp1, tp2])  # tp0 went to another worker
            return polled

    consumer = RebalancingConsumer(
        [[record(0, 7, "e7", "u0"), record(1, 3, "f3", "u1"), record(1, 4, "f4", "u2")]]
    )
    worker, producer = listening_worker(consumer)
    worker.run(exit_when_idle_s=0.3)
    assert consumer.seeks == [(1, 3)]  # back to f3 on tp1; tp0 is its new owner's
    assert producer.sent == [] and consumer.commits == []


def test_health_reports_the_serving_version() -> None:
    worker, *_ = make_worker([])
    ok, details = worker.health()
    assert ok and details["version"]["key"] == "v1"
    worker.request_stop()
    assert not worker.health()[0]


def test_commits_failing_in_a_row_turn_health_red_until_one_succeeds() -> None:
    from kafka.errors import CommitFailedError

    batches = [[record(0, offset, f"e{offset}", "alice")] for offset in range(4)]
    worker, consumer, producer, _ = make_worker(batches)
    outcomes = iter([CommitFailedError("rebalanced")] * 3 + [None])
    commit, answer_batch = consumer.commit, worker._commit
    health = []

    def flaky_commit(offsets):
        if (error := next(outcomes)) is not None:
            raise error
        commit(offsets)

    def commit_then_check(polled):
        answer_batch(polled)
        health.append(worker.health()[0])

    consumer.commit, worker._commit = flaky_commit, commit_then_check
    report = worker.run(exit_when_idle_s=0.3)
    assert report.requests == 4 and len(producer.sent) == 4  # answered, once each
    assert health == [True, True, False, True]  # red from the third failure in a row
    assert report.commit_failures == 3 and consumer.commits == [{TopicPartition(TOPIC, 0): 4}]


def test_health_turns_red_when_the_loop_stalls_longer_than_the_setting() -> None:
    worker, *_ = make_worker([], health_stall_s=300.0)
    worker.loop.last_turn_at -= 200  # a batch that has taken 200 s so far
    ok, details = worker.health()
    assert ok and details["loop_stalled_s"] >= 200
    worker.loop.last_turn_at -= 150
    assert not worker.health()[0]


def test_a_broker_outage_in_poll_is_ridden_out_and_shows_in_health() -> None:
    from kafka.errors import KafkaConnectionError

    outage = KafkaConnectionError("111 ECONNREFUSED")
    worker, consumer, producer, _ = make_worker(
        [[record(0, 1, "a1", "alice")], outage, outage, [record(0, 2, "a2", "alice")]]
    )
    worker.loop.stop_requested.wait = lambda timeout=None: False  # no back-off in tests
    seen_in_outage = []
    real_poll = consumer.poll

    def poll(**kwargs):
        seen_in_outage.append(worker.loop.outage.outage_s())  # what health() reports, unrounded
        return real_poll(**kwargs)

    consumer.poll = poll
    # exit_when_idle_s=0 would end the run at the first empty poll: an outage must not.
    report = worker.run(exit_when_idle_s=0)
    assert [m.event_id for _, m in producer.sent] == ["a1", "a2"]
    assert consumer.commits[-1] == {TopicPartition(TOPIC, 0): 3}
    assert report.requests == 2 and worker.loop.outage.errors == 2
    assert any(s > 0 for s in seen_in_outage) and worker.health()[1]["kafka_unreachable_s"] == 0


def test_a_non_retriable_poll_error_stops_the_worker_and_closes_the_clients() -> None:
    import pytest
    from kafka.errors import KafkaConfigurationError

    worker, consumer, producer, _ = make_worker([KafkaConfigurationError("bad sasl settings")])
    with pytest.raises(KafkaConfigurationError):
        worker.run(exit_when_idle_s=0)
    assert consumer.closed and producer.closed


def test_health_turns_red_after_two_minutes_without_kafka() -> None:
    import time

    worker, *_ = make_worker([])
    assert worker.health()[0]
    worker.loop.outage._since = time.monotonic() - 130  # an outage that began 130 s ago
    ok, details = worker.health()
    assert not ok and details["kafka_unreachable_s"] >= 130
