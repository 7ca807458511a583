"""Exactly-once publishing: a batch's recommendations and its consumed offsets in one Kafka
transaction (online step, ``online.processing_guarantee = "exactly_once"``).

A transaction holds every message of one batch and the batch's next offsets on the
events topic (``send_offsets_to_transaction`` with the consumer's group metadata,
KIP-447). Either both become visible or neither does: a ``read_committed``
consumer of ``genrec.recommendations`` sees each event answered exactly once,
whatever crashes between the publish and the commit. Fencing, two ways:

- the producer's ``transactional.id`` is stable per worker
  (``OnlineSettings.transactional_id``): a restarted worker's
  ``init_transactions`` aborts what its previous self left open and fences it;
- the offsets carry the consumer's group generation: a worker that was paused past
  its session timeout (its partitions now another's) has its commit refused by
  the group coordinator, so its transaction aborts and nothing it sent is seen.
  That holds only while the snapshot names a member: a consumer that learned it fell
  out of the group (kafka-python resets its generation to -1 and its member id to
  "") still hands out a snapshot, and the coordinator accepts a TxnOffsetCommit
  without a generation unchecked, as it would from a consumer outside any group. So
  ``publish`` refuses offsets whose snapshot names no member (``TransactionAborted``,
  nothing begun): the batch is served again once the consumer has rejoined. (A CI run
  saw a paused, resumed worker answer ~500 events twice, records it had fetched before
  rejoining; with this check the same test, run beside a CPU hog, refused such a batch.)

``publish`` raises ``TransactionAborted`` when the batch must be served again
(the transaction was aborted: the broker refused the offsets, a send failed, a
timeout) and ``ProducerFenced`` when another instance with this
``transactional.id`` took over: then this worker must stop.

A transaction that fails once its offsets were sent (or tried), or whose wait timed
out, is not aborted on its producer: the producer is closed and a new one started,
whose ``init_transactions`` bumps the epoch (aborting the open transaction on the
broker, fencing anything the old one still had queued). kafka-python 3.0 keeps a
transaction's offsets in one dict per producer until the group coordinator accepts
them (``TransactionManager._pending_txn_offset_commits``), clears it neither on abort
nor on the next ``begin_transaction``, and sends all of it with every later
TxnOffsetCommit: a commit refused under a rebalance would otherwise resurface in the
producer's next transaction and set the partition's committed offset back behind what
its new owner had committed (``tests/test_transactions.py``). A transaction that
failed before its offsets is aborted on the same producer (cheaper, and it leaves
nothing behind). ``committed`` holds, per partition, the next offset of the last
transaction this publisher committed: offsets behind it are refused (their events
were answered in that transaction).

Example::

    publisher = TransactionalPublisher(lambda: KafkaProducer(transactional_id="genrec-online.w1", ...))
    publisher.publish("genrec.recommendations", [(b"7", b"{...}")], {tp: 42}, consumer.group_metadata())
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kafka import errors as kafka_errors
from kafka.structs import ConsumerGroupMetadata, OffsetAndMetadata

log = logging.getLogger(__name__)

FENCED = (
    kafka_errors.ProducerFencedError,
    kafka_errors.InvalidProducerEpochError,
    kafka_errors.TransactionalIdAuthorizationFailedError,
)


CLOSE_TIMEOUT_S = 5.0  # a closing producer's wait for its queued sends (its default: forever)


class TransactionAborted(RuntimeError):
    """The batch's transaction was aborted; nothing of it is visible. Serve it again."""


class TransactionTimeout(TimeoutError):
    """A transactional request got no answer in time (its coordinator died, say)."""


class ProducerFenced(RuntimeError):
    """Another worker with this ``transactional.id`` took over: this one must stop."""


class TransactionalPublisher:
    """Owns the transactional producer: ``init_transactions`` once, one transaction a batch."""

    def __init__(self, producer_factory: Callable[[], Any], timeout_s: float = 30.0) -> None:
        self._factory = producer_factory
        self.timeout_s = timeout_s
        self.producer = self._start()
        self.transactions = 0
        self.aborted = 0
        self.committed: dict[Any, int] = {}  # next offset per partition, as last committed

    def _start(self) -> Any:
        producer = self._factory()
        try:
            # Fences our previous self and settles its open transaction; kafka-python bounds
            # this wait by max_block_ms.
            producer.init_transactions()
        except FENCED as exc:
            producer.close(timeout=CLOSE_TIMEOUT_S)
            raise ProducerFenced(f"fenced at start: {exc}") from exc
        except BaseException:
            producer.close(timeout=CLOSE_TIMEOUT_S)
            raise
        return producer

    def publish(
        self,
        topic: str,
        payloads: Sequence[tuple[bytes, bytes]],
        offsets: Mapping[Any, int],
        group_metadata: Any,
    ) -> None:
        """One transaction: ``payloads`` (key, value) to ``topic`` and ``offsets`` (next
        offset per consumed partition) for the group; committed when this returns."""
        if self.producer is None:  # the last replacement could not start: try again now
            self._replace("no producer")
        if offsets and not is_group_member(group_metadata):
            raise TransactionAborted(
                f"the consumer is out of its group ({_describe_member(group_metadata)}): "
                "offsets sent now would not be fenced; served again once it rejoins"
            )
        behind = {tp: o for tp, o in offsets.items() if o <= self.committed.get(tp, -1)}
        if behind:  # a committed transaction of ours answered these events already
            raise TransactionAborted(
                f"offsets {_describe(behind)} are not past those this worker committed "
                f"({_describe({tp: self.committed[tp] for tp in behind})})"
            )
        producer, offsets_tried = self.producer, False
        try:
            producer.begin_transaction()
            for key, value in payloads:
                producer.send(topic, key=key, value=value)
            if offsets:
                committed = {
                    tp: OffsetAndMetadata(offset, "", -1) for tp, offset in offsets.items()
                }
                offsets_tried = True
                self._bounded("sending the offsets", "send_offsets_to_transaction",
                              committed, group_metadata)  # fmt: skip
            self._bounded("committing", "begin_commit")  # flushes the sends first
        except FENCED as exc:
            raise ProducerFenced(str(exc)) from exc
        except Exception as exc:
            self.aborted += 1
            cause = str(exc) if isinstance(exc, TransactionTimeout) else _name(exc)
            if offsets_tried or isinstance(exc, TransactionTimeout):
                # Its state (and kafka-python's pending offsets) unknown or stale: a new
                # producer's init_transactions settles it on the broker first.
                self._replace(cause)
                raise TransactionAborted(f"{cause}; a new producer took over") from exc
            raise TransactionAborted(f"{cause}; {self._abort(cause)}") from exc
        self.transactions += 1
        for tp, offset in offsets.items():
            self.committed[tp] = max(offset, self.committed.get(tp, -1))
        log.debug("committed transaction %d: %d messages, offsets %s",
                  self.transactions, len(payloads), offsets)  # fmt: skip

    def _bounded(self, what: str, step: str, *args: Any) -> None:
        """A transactional step, waited for at most ``timeout_s``.

        kafka-python's ``commit_transaction``, ``abort_transaction`` and
        ``send_offsets_to_transaction`` wait without a limit; with a coordinator killed
        mid-commit we saw workers wait forever. So this calls the transaction manager as
        those methods do (kafka-python 3.0 internals) and bounds the wait.
        """
        result = getattr(self.producer._transaction_manager, step)(*args)
        self.producer._sender.wakeup()
        if not result.wait(timeout_ms=self.timeout_s * 1000):
            raise TransactionTimeout(f"{what} got no answer within {self.timeout_s:g} s")

    def _abort(self, cause: str) -> str:
        """Abort the open transaction; a producer that cannot (its state is fatal, or no
        answer) is replaced: the new one's ``init_transactions`` aborts it on the broker
        instead. Returns what was done, for the caller's one log line."""
        try:
            self._bounded("aborting", "begin_abort")
            return "aborted"
        except FENCED as exc:
            raise ProducerFenced(str(exc)) from exc
        except Exception as exc:
            self._replace(f"{cause}; aborting failed: {_name(exc)}")
            return f"aborting failed ({_name(exc)}), a new producer took over"

    def _replace(self, cause: str) -> None:
        """Close this producer and start another with the same ``transactional.id``.

        Logged at debug level: the caller's ``TransactionAborted`` says it, once."""
        log.debug("starting a new transactional producer (%s)", cause)
        if self.producer is not None:
            _abandon(self.producer)
            self.producer = None
        try:
            self.producer = self._start()
        except ProducerFenced:
            raise
        except Exception as exc:  # no coordinator yet, say: the batch is retried, and so is this
            raise TransactionAborted(f"{cause}; no new producer yet: {_name(exc)}") from exc

    def close(self) -> None:
        if self.producer is not None:
            self.producer.close(timeout=CLOSE_TIMEOUT_S)


def is_group_member(group_metadata: Any) -> bool:
    """Whether a consumer's group snapshot names a member and generation the coordinator
    will check (a plain group id, or generation -1 / member "", is never fenced)."""
    if not isinstance(group_metadata, ConsumerGroupMetadata):
        return False
    return group_metadata.generation_id >= 0 and bool(group_metadata.member_id)


def _describe_member(group_metadata: Any) -> str:
    if not isinstance(group_metadata, ConsumerGroupMetadata):
        return f"no group snapshot: {type(group_metadata).__name__}"
    return f"generation {group_metadata.generation_id}, member {group_metadata.member_id!r}"


def _abandon(producer: Any) -> None:
    """Stop a failed producer's I/O thread at once, its queued requests unsent.

    Not ``close(timeout)``: kafka-python's close first flushes, and when that times out
    (a partition leader gone) it raises before stopping the I/O thread, which then goes
    on retrying the old transaction's requests beside the new producer (a broker-kill
    run showed it). What it had queued is void anyway: the new producer's
    ``init_transactions`` aborts that transaction and fences its epoch.
    """
    try:
        producer._sender.force_close()  # kafka-python 3.0 internals, as in _bounded
        producer._sender.join(CLOSE_TIMEOUT_S)
        producer.close(timeout=0)  # its futures failed by now: releases the rest
    except Exception:
        log.exception("closing the failed transactional producer failed")


def _name(exc: BaseException) -> str:
    text, kind = str(exc), type(exc).__name__
    return text if text.startswith(kind) else f"{kind}: {text}"  # kafka errors name themselves


def _describe(offsets: Mapping[Any, int]) -> str:
    return ", ".join(f"{tp.topic}:{tp.partition}@{o}" for tp, o in sorted(offsets.items()))
