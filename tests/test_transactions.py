"""TransactionalPublisher (online/transactions.py) driven through kafka-python's own
TransactionManager, with a scripted broker in place of the network: what each
transactional request carries, and what the group's committed offsets become."""

from __future__ import annotations

import contextlib
import uuid
from types import SimpleNamespace

import pytest
from kafka import KafkaConsumer, KafkaProducer
from kafka.producer.transaction_manager import (
    AddOffsetsToTxnHandler,
    EndTxnHandler,
    InitProducerIdHandler,
    TransactionManager,
    TxnOffsetCommitHandler,
)
from kafka.structs import ConsumerGroupMetadata, OffsetAndMetadata, TopicPartition

from genrec.infra.kafka_clients import open_client
from genrec.online.transactions import TransactionAborted, TransactionalPublisher
from tests.helpers import fresh_kafka, wait_for

TOPIC = "genrec.user-events"
P1, P2 = TopicPartition(TOPIC, 1), TopicPartition(TOPIC, 2)
GROUP = ConsumerGroupMetadata("genrec-online", 3, "member-a", None)
NO_ERROR, ILLEGAL_GENERATION = 0, 22


class ScriptedBroker:
    """The transaction and group coordinators of one ``transactional.id``: answers each
    request a TransactionManager dequeues, keeps the group's committed offsets (a
    transaction's offsets count once its EndTxn commits), and records every
    TxnOffsetCommit's offsets. ``refuse_offsets`` answers that many TxnOffsetCommits with
    ILLEGAL_GENERATION (the group rebalanced under the transaction)."""

    def __init__(self) -> None:
        self.epoch = -1
        self.refuse_offsets = 0
        self.committed: dict[TopicPartition, int] = {}
        self.offset_commits: list[dict[TopicPartition, int]] = []  # every TxnOffsetCommit sent
        self.end_txns: list[bool] = []  # each EndTxn: True commit, False abort
        self._in_txn: dict[TopicPartition, int] = {}

    def answer(self, manager: TransactionManager) -> None:
        while (handler := manager.next_request_handler(False)) is not None:
            correlation_id = manager.next_in_flight_request_correlation_id()
            handler.on_complete(correlation_id, self._response(handler))

    def _response(self, handler) -> SimpleNamespace:
        if isinstance(handler, InitProducerIdHandler):
            self.epoch += 1  # bumps the epoch: fences, and aborts what the last one left open
            self._in_txn = {}
            return SimpleNamespace(error_code=NO_ERROR, producer_id=7, producer_epoch=self.epoch)
        if isinstance(handler, AddOffsetsToTxnHandler):
            return SimpleNamespace(error_code=NO_ERROR)
        if isinstance(handler, TxnOffsetCommitHandler):
            request = handler.request
            assert request.producer_epoch == self.epoch  # an older epoch would be fenced
            sent = {
                TopicPartition(topic.name, p.partition_index): p.committed_offset
                for topic in request.topics
                for p in topic.partitions
            }
            self.offset_commits.append(sent)
            code = NO_ERROR
            if self.refuse_offsets:
                self.refuse_offsets -= 1
                code = ILLEGAL_GENERATION
            else:
                self._in_txn.update(sent)
            by_topic: dict[str, list] = {}
            for tp in sent:
                by_topic.setdefault(tp.topic, []).append((tp.partition, code))
            return SimpleNamespace(topics=list(by_topic.items()))
        if isinstance(handler, EndTxnHandler):
            committed = handler.request.committed
            self.end_txns.append(committed)
            if committed:
                self.committed.update(self._in_txn)
            self._in_txn = {}
            return SimpleNamespace(error_code=NO_ERROR)
        raise AssertionError(f"unexpected request {handler.request}")


class ManagedProducer:
    """The parts of KafkaProducer the publisher uses, over a real TransactionManager; its
    sender answers through the broker at once (no payloads: offsets only)."""

    def __init__(self, broker: ScriptedBroker) -> None:
        self._transaction_manager = TransactionManager(
            transactional_id="genrec-online.w1", transaction_timeout_ms=60000
        )
        self._sender = SimpleNamespace(
            wakeup=lambda: broker.answer(self._transaction_manager),
            force_close=self._stop_sender,
            join=lambda timeout=None: None,
        )
        self.closed = self.sender_stopped = False

    def _stop_sender(self) -> None:  # its queued requests are dropped, never sent
        self.sender_stopped = True

    def init_transactions(self) -> None:
        result = self._transaction_manager.initialize_transactions()
        self._sender.wakeup()
        assert result.wait(timeout_ms=1000)

    def begin_transaction(self) -> None:
        self._transaction_manager.begin_transaction()

    def close(self, timeout=None) -> None:
        self.closed = True


def publisher_on(broker: ScriptedBroker) -> tuple[TransactionalPublisher, list[ManagedProducer]]:
    made: list[ManagedProducer] = []

    def factory() -> ManagedProducer:
        made.append(ManagedProducer(broker))
        return made[-1]

    return TransactionalPublisher(factory, timeout_s=1.0), made


def test_a_refused_offset_commit_never_surfaces_in_a_later_transaction() -> None:
    """kafka-python keeps a transaction's offsets in one dict per producer
    (``_pending_txn_offset_commits``) until the group coordinator accepts them, and
    neither an abort nor the next transaction clears it: each later TxnOffsetCommit
    names every offset still in it. A refused commit (a rebalance under the
    transaction) whose transaction was aborted would commit its stale offsets with the
    producer's next transaction, after the partition's new owner had moved on (the
    broker-kill test's duplicates). The publisher replaces the producer instead."""
    broker = ScriptedBroker()
    publisher, made = publisher_on(broker)
    broker.committed[P1] = 36  # P1's new owner committed 36 meanwhile
    broker.refuse_offsets = 1
    with pytest.raises(TransactionAborted, match="new producer"):
        publisher.publish(TOPIC, [], {P1: 8, P2: 20}, GROUP)
    publisher.publish(TOPIC, [], {P2: 20}, GROUP)  # P1 is another worker's now
    assert broker.offset_commits == [{P1: 8, P2: 20}, {P2: 20}]
    assert broker.committed == {P1: 36, P2: 20}
    assert len(made) == 2 and made[0].sender_stopped and made[0].closed
    assert publisher.producer is made[1] and not made[1].closed
    assert broker.end_txns == [True]  # the new producer's init aborted the first one
    assert publisher.aborted == 1 and publisher.transactions == 1


def test_a_committed_transaction_leaves_no_offsets_behind() -> None:
    """The same producer serves the next transaction when the last one committed."""
    broker = ScriptedBroker()
    publisher, made = publisher_on(broker)
    publisher.publish(TOPIC, [], {P1: 8}, GROUP)
    publisher.publish(TOPIC, [], {P2: 3}, GROUP)
    assert broker.offset_commits == [{P1: 8}, {P2: 3}] and len(made) == 1
    assert publisher.committed == {P1: 8, P2: 3}
    assert not made[0]._transaction_manager._test_has_pending_offset_commits()


def test_on_the_broker_a_refused_offset_commit_does_not_set_a_partition_back(
    kafka_broker,
) -> None:
    """The same on the real broker: a transaction whose TxnOffsetCommit carries a stale
    group generation is refused and aborted; the next transaction (P2 only) must leave
    P1 where its new owner committed it (36), not at the refused transaction's 8."""
    kafka = fresh_kafka(kafka_broker)
    group = f"genrec-txn-test-{uuid.uuid4().hex[:6]}"
    p1, p2 = (TopicPartition(kafka.topic_events, n) for n in (1, 2))
    member = open_client(
        KafkaConsumer, kafka, group_id=group, enable_auto_commit=False,
        isolation_level="read_committed", session_timeout_ms=6000, heartbeat_interval_ms=500,
    )  # fmt: skip
    publisher = None
    try:
        member.subscribe([kafka.topic_events])
        # 120 s: a first join waited past 60 s once on a loaded 2-core CI host
        wait_for(lambda: member.poll(timeout_ms=200) is not None and member.assignment(), 120,
                 "the group member's assignment")  # fmt: skip
        member.commit({p1: OffsetAndMetadata(36, "", -1)})  # P1's other owner moved on
        current = member.group_metadata()
        stale = current._replace(generation_id=current.generation_id + 1)  # a namedtuple
        publisher = TransactionalPublisher(
            lambda: open_client(
                KafkaProducer,
                kafka,
                transactional_id=f"{group}.w1",
                acks="all",
                enable_idempotence=True,
                linger_ms=0,
            ),  # fmt: skip
            timeout_s=30.0,
        )
        value = b'{"request_id": "x"}'
        with pytest.raises(TransactionAborted, match="a new producer took over"):
            publisher.publish(kafka.topic_recommendations, [(b"k", value)], {p1: 8, p2: 20},
                              stale)  # fmt: skip
        publisher.publish(kafka.topic_recommendations, [(b"k", value)], {p2: 21}, current)
        assert member.committed(p1) == 36
        assert member.committed(p2) == 21
    finally:
        if publisher is not None:
            publisher.close()
        with contextlib.suppress(Exception):
            member.close()


def test_on_the_broker_offsets_that_name_no_member_are_unfenced_so_they_are_never_sent(
    kafka_broker,
) -> None:
    """Why ``publish`` checks the group snapshot: the coordinator takes a TxnOffsetCommit
    naming no member and no generation (what kafka-python's snapshot says once the
    consumer learned it fell out of the group) unchecked, even with the group's member
    live: a raw transactional producer sets P1 back from 36 to 8. The publisher refuses
    the same offsets, nothing begun, and P1 stays where its owner committed it."""
    kafka = fresh_kafka(kafka_broker)
    group = f"genrec-txn-test-{uuid.uuid4().hex[:6]}"
    p1 = TopicPartition(kafka.topic_events, 1)
    member = open_client(
        KafkaConsumer, kafka, group_id=group, enable_auto_commit=False,
        isolation_level="read_committed", session_timeout_ms=6000, heartbeat_interval_ms=500,
    )  # fmt: skip
    clients = []

    def transactional(name: str):
        clients.append(open_client(
            KafkaProducer, kafka, transactional_id=f"{group}.{name}", acks="all",
            enable_idempotence=True, linger_ms=0,
        ))  # fmt: skip
        return clients[-1]

    try:
        member.subscribe([kafka.topic_events])
        # 120 s: a first join waited past 60 s once on a loaded 2-core CI host
        wait_for(lambda: member.poll(timeout_ms=200) is not None and member.assignment(), 120,
                 "the group member's assignment")  # fmt: skip
        member.commit({p1: OffsetAndMetadata(36, "", -1)})
        out = member.group_metadata()._replace(generation_id=-1, member_id="")
        publisher = TransactionalPublisher(lambda: transactional("w1"), timeout_s=30.0)
        with pytest.raises(TransactionAborted, match="out of its group"):
            publisher.publish(kafka.topic_recommendations, [(b"k", b"{}")], {p1: 8}, out)
        assert member.committed(p1) == 36
        raw = transactional("raw")
        raw.init_transactions()
        raw.begin_transaction()
        raw.send_offsets_to_transaction({p1: OffsetAndMetadata(8, "", -1)}, out)
        raw.commit_transaction()
        assert member.committed(p1) == 8  # accepted: nothing fenced it
    finally:
        for client in clients:
            with contextlib.suppress(Exception):
                client.close(timeout=5)
        with contextlib.suppress(Exception):
            member.close()
