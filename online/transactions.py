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

``publish`` raises ``TransactionAborted`` when the batch must be served again
(the transaction was aborted: the broker refused the offsets, a send failed, a
timeout) and ``ProducerFenced`` when another instance with this
``transactional.id`` took over: then this worker must stop.

Example::

    publisher = TransactionalPublisher(lambda: KafkaProducer(transactional_id="genrec-online.w1", ...))
    publisher.publish("genrec.recommendations", [(b"7", b"{...}")], {tp: 42}, consumer.group_metadata())
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kafka import errors as kafka_errors
from kafka.structs import OffsetAndMetadata

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
            self._replace(TransactionAborted("no producer"))
        producer = self.producer
        try:
            producer.begin_transaction()
            for key, value in payloads:
                producer.send(topic, key=key, value=value)
            if offsets:
                committed = {
                    tp: OffsetAndMetadata(offset, "", -1) for tp, offset in offsets.items()
                }
                self._bounded("sending the offsets", "send_offsets_to_transaction",
                              committed, group_metadata)  # fmt: skip
            self._bounded("committing", "begin_commit")  # flushes the sends first
        except FENCED as exc:
            raise ProducerFenced(str(exc)) from exc
        except TransactionTimeout as exc:
            # Its state is unknown: a new producer's init_transactions settles it (aborts
            # or completes it on the broker) before anything else is sent.
            self.aborted += 1
            self._replace(exc)
            raise TransactionAborted(str(exc)) from exc
        except Exception as exc:
            self.aborted += 1
            self._abort()
            raise TransactionAborted(f"{type(exc).__name__}: {exc}") from exc
        self.transactions += 1
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

    def _abort(self) -> None:
        """Abort the open transaction; a producer that cannot (its state is fatal) is replaced:
        the new one's ``init_transactions`` aborts it on the broker instead."""
        try:
            self._bounded("aborting", "begin_abort")
            return
        except FENCED as exc:
            raise ProducerFenced(str(exc)) from exc
        except Exception as exc:
            self._replace(exc)

    def _replace(self, cause: BaseException) -> None:
        """Close this producer and start another with the same ``transactional.id``."""
        log.warning("transaction failed (%s); starting a new producer", cause)
        if self.producer is not None:
            try:
                self.producer.close(timeout=CLOSE_TIMEOUT_S)
            except Exception:
                log.exception("closing the failed transactional producer failed")
            self.producer = None
        try:
            self.producer = self._start()
        except ProducerFenced:
            raise
        except Exception as exc:  # no coordinator yet, say: the batch is retried, and so is this
            raise TransactionAborted(f"no new producer yet: {type(exc).__name__}: {exc}") from exc

    def close(self) -> None:
        if self.producer is not None:
            self.producer.close(timeout=CLOSE_TIMEOUT_S)
