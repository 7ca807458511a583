"""The online worker's pipeline (online step): batches in flight and the stage that decodes them.

The consumer's thread polls, groups and prepares a batch (``Recommender.prepare``:
histories, prefix KVs, branch lists) and hands it to the ``DecodeStage``, which
decodes it, builds and serialises its messages and hands them to the producer.
Kafka acknowledges them on the producer's own I/O thread; the consumer's thread
commits each batch's offsets once all its messages are acknowledged, in
hand-over order, while it goes on with the next batch.

An ``InFlightBatch`` carries one batch through all of that and says where it
stands (``pending``, ``done``, ``failed``). The ``DecodeStage`` serves batches
inline, on the consumer's thread (``online.decode_thread`` off, the default), or
on a thread of its own that holds at most one batch waiting beside the one it
serves, so that the consumer's thread prepares the next batch while this one
decodes; it then predicts when it will be free (``busy_for_s``, from a
``BatchTimer``), so that the next batch can be prepared just in time.

Example::

    >>> served = []
    >>> stage = DecodeStage(lambda batch: served.append(batch.epoch) or True, threaded=True)
    >>> stage.start().hand_over(InFlightBatch(polled=[], requests=[], epoch=7))
    >>> stage.stop()
    >>> served
    [7]
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from genrec.online.recommender import PreparedBatch, Request

log = logging.getLogger(__name__)

State = Literal["pending", "done", "failed"]
FORGET = 0.9  # weight of a batch in the time fit, relative to the one after it


class BatchTimer:
    """Predicts how long a batch of ``users`` takes: ``fixed + per_user * users``, fitted
    by least squares over recent batches (each weighs ``forget`` times the next one).

    A decoding call has a large fixed part (the engine's per-call work) beside its cost
    per user, so a time per user alone would overrate a large batch. Until batches of
    different sizes were seen, the prediction is their mean time, whatever ``users``.
    """

    def __init__(self, forget: float = FORGET) -> None:
        self.forget = forget
        self._sums = [0.0] * 5  # weight, users, seconds, users^2, users * seconds

    def record(self, users: int, seconds: float) -> None:
        point = (1.0, users, seconds, users * users, users * seconds)
        self._sums = [
            self.forget * total + value for total, value in zip(self._sums, point, strict=True)
        ]

    def predict(self, users: int) -> float | None:
        """Seconds for a batch of ``users`` (None before the first batch)."""
        weight, x, y, xx, xy = self._sums
        if weight == 0:
            return None
        mean_x, mean_y = x / weight, y / weight
        spread = xx / weight - mean_x * mean_x
        if spread < 1e-6:
            return mean_y
        per_user = max(0.0, (xy / weight - mean_x * mean_y) / spread)
        fixed = max(0.0, mean_y - per_user * mean_x)
        return fixed + per_user * users


@dataclass(eq=False)
class InFlightBatch:
    """One gathered batch from its hand-over to its commit.

    The decode thread sets ``sent_at`` once every message is with the producer (or
    ``error``); the producer's acknowledgements count down to ``acked_at``. The
    consumer's thread reads ``state``.
    """

    polled: list[Any]  # the worker's polled records, in poll order: their offsets
    requests: list[Request]
    epoch: int  # the worker's rewind count when gathered: a later rewind voids the batch
    gathered_at: float = field(default_factory=time.monotonic)
    handed_at: float = 0.0  # when the decode thread was handed the prepared batch
    prepared: PreparedBatch | None = None
    paths: list[str] = field(default_factory=list)  # each message's decoding path
    send_started: float | None = None
    sent_at: float | None = None
    acked_at: float | None = None
    error: BaseException | None = None
    failed_in: str = ""  # "recommend" or "publish", for the error counters
    _unacked: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def users(self) -> int:
        return len(self.requests)

    def expect_acks(self, count: int) -> None:
        """Before the first send: how many acknowledgements complete the batch."""
        self._unacked = count
        self.send_started = time.monotonic()

    def acked(self, _metadata: Any = None) -> None:
        """A producer callback (its I/O thread): one message acknowledged."""
        with self._lock:
            self._unacked -= 1
            if self._unacked == 0:
                self.acked_at = time.monotonic()

    def failed(self, error: BaseException, where: str = "publish") -> None:
        """A send or an acknowledgement failed (any thread); the first error counts."""
        with self._lock:
            if self.error is None:
                self.error, self.failed_in = error, where

    def mark_sent(self) -> None:
        """Every message is with the producer (a batch without messages is done now)."""
        with self._lock:
            if self._unacked == 0 and self.acked_at is None:
                self.acked_at = time.monotonic()
            self.sent_at = time.monotonic()

    def state(self, now: float, ack_timeout_s: float) -> State:
        """``done`` once every message is acknowledged, ``failed`` on an error or when the
        acknowledgements take longer than ``ack_timeout_s`` after the last send."""
        with self._lock:
            if self.error is not None:
                return "failed"
            if self.sent_at is None:
                return "pending"
            if self.acked_at is not None:
                return "done"
            if now - self.sent_at <= ack_timeout_s:
                return "pending"
            self.error = TimeoutError(f"no acknowledgement within {ack_timeout_s:g} s")
            self.failed_in = "publish"
            return "failed"


class DecodeStage:
    """Serves handed-over batches one at a time, in hand-over order.

    Inline (``threaded`` False) ``hand_over`` serves the batch on the caller's
    thread; threaded, a thread of its own serves them and ``hand_over`` blocks while
    another batch already waits. ``serve`` returns False for a batch it skipped
    (voided by a rewind meanwhile) and should not raise (the worker records a
    batch's failure on the batch). While it serves a batch it predicts when it will
    be free from the time of the batches it served (``timer``); before the first
    one it counts as free now.
    """

    def __init__(
        self,
        serve: Callable[[InFlightBatch], bool],
        threaded: bool = False,
        name: str = "genrec-decode",
    ) -> None:
        self._serve = serve
        self.threaded = threaded
        self._waiting: queue.Queue[InFlightBatch | None] = queue.Queue(maxsize=1)
        self._lock = threading.Lock()
        self._current: tuple[float, int] | None = None  # (started, users) being served
        self.timer = BatchTimer()
        self.progress = threading.Event()  # set after every batch, for waiters to look again
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> DecodeStage:
        if self.threaded:
            self._thread.start()
        return self

    def hand_over(self, batch: InFlightBatch) -> None:
        """Serve ``batch`` now (inline), or queue it (threaded; blocks while one waits)."""
        if self.threaded:
            self._waiting.put(batch)
        else:
            self._serve_one(batch)

    def has_waiting(self) -> bool:
        """Whether a handed-over batch waits for the thread (the next one must wait too)."""
        return not self._waiting.empty()

    def busy_for_s(self, now: float) -> float:
        """Predicted seconds until the batch being served is done (0: idle, or no estimate)."""
        with self._lock:
            current = self._current
            expected = None if current is None else self.timer.predict(current[1])
        if current is None or expected is None:
            return 0.0
        return max(0.0, current[0] + expected - now)

    def busy_s(self, now: float) -> float:
        """How long the batch being served has taken so far (0 when idle)."""
        with self._lock:
            current = self._current
        return 0.0 if current is None else now - current[0]

    def stop(self, timeout_s: float | None = None) -> None:
        """Serve what was handed over, then end the thread (if any)."""
        if self._thread.is_alive():
            self._waiting.put(None)
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while (batch := self._waiting.get()) is not None:
            self._serve_one(batch)

    def _serve_one(self, batch: InFlightBatch) -> None:
        started = time.monotonic()
        with self._lock:
            self._current = (started, max(1, batch.users))
        served = False
        try:
            served = self._serve(batch)
        except Exception as exc:  # serve records its own failures; this is a last guard
            log.exception("serving a batch failed unexpectedly")
            batch.failed(exc, "recommend")
        finally:
            self._finished(started, batch.users if served else 0)
            self.progress.set()

    def _finished(self, started: float, users: int) -> None:
        """The batch is done; a served one (``users`` > 0) goes into the timer."""
        with self._lock:
            self._current = None
            if users:
                self.timer.record(users, time.monotonic() - started)
