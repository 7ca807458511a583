"""The consumer loop shared by ingest and the online worker (infra): poll, hand over, stop, idle, health.

Both services run the same loop around their own step:

* poll, through a broker outage (``OutagePoll``): a *retriable* Kafka error
  becomes an empty poll after a back-off, logged when the outage starts, every
  ``log_every_s`` while it lasts and when it ends; errors that retrying cannot
  fix are raised;
* gather a batch: the records of one poll, or, with a batch window, of every
  poll until the window closes after the batch's first records (or the step
  says the batch is full, or a stop is requested). A step with work in flight
  (the online worker's engine) decides when its batch is handed over
  (``hand_over_in_s``: at once while its engine is idle, later while it is
  busy) and how long a poll may wait (``poll_timeout_s``), and is called after
  every poll (``after_poll``) to commit what finished meanwhile;
* hand the batch to the step (``BatchHandler.handle_batch``), which does its
  work, or starts it, and decides what to commit: nothing is committed here;
* stop: ``request_stop`` (signal-safe) lets the batch in hand finish, then the
  step drains the work in flight (``drain``) and the loop returns;
* idle exit: ``exit_when_idle_s`` without a batch ends the run, but a broker
  outage or a group still being joined is not idleness;
* health: ``/healthz`` is red while stopping, when the loop has not turned, or
  Kafka has not answered, for ``health_stall_s``, or when the step says it is
  failing;
* close: the step's own clients first, then the consumer (which leaves the
  group), whether the run ended well or with an error.

kafka-python 3.0 lets some connection errors out of ``KafkaConsumer.poll`` while
the broker is away: a group-coordinator lookup that fails to connect is followed
by a metadata refresh, and when that refresh cannot connect either its error
is raised to the caller. The consumer itself is fine and reconnects once the
broker is back, so a service must neither die on such an error (a restart of
the whole process would not bring the broker back sooner) nor spin on it.

kafka-python 3.0.12 can also lose a group join (``rejoin_lost_join``): when the
group leader rejoins because its topics' metadata changed (partitions added, or
metadata that arrived after the first assignment) and a poll's timeout ends
while JoinGroup/SyncGroup is on the wire, the next poll no longer sees a rejoin
as needed, the join's answer is never applied, and the member holds no partitions
(with its heartbeat off) until something else rebalances the group, minutes
later. The worker's short polls while a batch is in flight hit it after a
restart; after every poll the join is asked for again when that state shows.
And since kafka-python completes a join only within one poll (a shorter poll
leaves it, the next sends a fresh JoinGroup), a poll while the group is being
joined waits at least ``JOIN_POLL_MS``.

Example::

    >>> loop = ConsumerLoop("ingest", handler, health_stall_s=120, idle_poll_ms=1000)  # doctest: +SKIP
    >>> loop.run(consumer, exit_when_idle_s=10)                                      # doctest: +SKIP
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from kafka.errors import KafkaError

from genrec.infra import metrics

log = logging.getLogger(__name__)
kafka_log = logging.getLogger("genrec.kafka")  # outage lines, of either service


class OutagePoll:
    """Wraps ``consumer.poll`` for one service loop; not thread-safe (neither is the consumer)."""

    def __init__(
        self,
        component: str,
        *,
        stop: threading.Event | None = None,
        first_backoff_s: float = 0.5,
        max_backoff_s: float = 5.0,
        log_every_s: float = 30.0,
    ) -> None:
        self.component = component
        self._stop = stop or threading.Event()
        self.first_backoff_s = first_backoff_s
        self.max_backoff_s = max_backoff_s
        self.log_every_s = log_every_s
        self.errors = 0  # retriable poll errors since the process started
        self.lost_joins = 0  # joins kafka-python dropped and that were asked for again
        self._since: float | None = None  # when the current outage began
        self._backoff_s = first_backoff_s
        self._logged_at = 0.0

    def poll(self, consumer: Any, **poll_kwargs: Any) -> dict[Any, list[Any]]:
        """``consumer.poll(**poll_kwargs)``; ``{}`` after a back-off if the broker is away."""
        try:
            batch = poll_group(consumer, self.component, self._count_lost_join, **poll_kwargs)
        except KafkaError as exc:
            if not getattr(exc, "retriable", False):
                raise
            self._on_error(exc)
            return {}
        if self._since is not None:
            kafka_log.info("%s: Kafka answers again after %.0f s", self.component, self.outage_s())
            self._since = None
            self._backoff_s = self.first_backoff_s
        return batch

    def _count_lost_join(self) -> None:
        self.lost_joins += 1

    def outage_s(self) -> float:
        """Seconds since the first failed poll of the current outage (0.0 when none)."""
        return 0.0 if self._since is None else time.monotonic() - self._since

    def _on_error(self, exc: KafkaError) -> None:
        now = time.monotonic()
        self.errors += 1
        metrics.ERRORS.labels(component=self.component, kind="kafka_poll").inc()
        if self._since is None:
            self._since = self._logged_at = now
            kafka_log.warning(
                "%s: Kafka poll failed (%s); retrying until the broker is back",
                self.component, exc,
            )  # fmt: skip
        elif now - self._logged_at >= self.log_every_s:
            self._logged_at = now
            kafka_log.warning(
                "%s: Kafka unreachable for %.0f s (%s); still retrying",
                self.component, now - self._since, type(exc).__name__,
            )  # fmt: skip
        # An Event wait, not sleep: SIGTERM (which sets ``stop``) ends the back-off at once.
        self._stop.wait(self._backoff_s)
        self._backoff_s = min(self._backoff_s * 2, self.max_backoff_s)


JOIN_POLL_MS = 500  # the shortest poll while the group is being joined


def poll_group(
    consumer: Any, component: str, on_lost_join: Callable[[], Any] | None = None, **poll_kwargs: Any
) -> dict[Any, list[Any]]:
    """``consumer.poll(**poll_kwargs)`` with the two guards against kafka-python's join bugs
    (module docstring): at least ``JOIN_POLL_MS`` while the group is being joined, and a
    dropped join asked for again after the poll (then ``on_lost_join()``). Every group
    consumer of genrec polls through it (``OutagePoll`` for the services)."""
    if group_joining(consumer):
        # kafka-python completes a join only inside one poll: a shorter one gives up
        # and the next sends a fresh JoinGroup, so tiny polls would never join.
        poll_kwargs["timeout_ms"] = max(poll_kwargs.get("timeout_ms") or 0, JOIN_POLL_MS)
    try:
        return consumer.poll(**poll_kwargs)
    finally:
        if rejoin_lost_join(consumer, component) and on_lost_join is not None:
            on_lost_join()


def group_joining(consumer: Any) -> bool:
    """Whether ``consumer``'s group join is pending or in flight (kafka-python internals;
    False for anything else)."""
    coordinator = getattr(consumer, "_coordinator", None)
    if coordinator is None or getattr(coordinator, "group_id", None) is None:
        return False
    try:
        return getattr(coordinator, "_join_task", None) is not None or bool(
            coordinator.need_rejoin()
        )
    except Exception:  # noqa: BLE001 - a guard for a client bug must never break a poll
        return False


def rejoin_lost_join(consumer: Any, component: str = "kafka") -> bool:
    """Ask for the group join again if kafka-python finished one without applying it.

    The state (see the module docstring): a join task that is done, left behind by
    a poll that timed out while waiting for it, and a coordinator that no longer
    thinks a rejoin is needed, so no later poll collects the join's assignment.
    Requesting a rejoin makes the next poll send a fresh JoinGroup, which the
    coordinator answers at once. Returns whether it had to. It reads kafka-python
    internals, so anything unexpected (another version, another client) is left alone.
    """
    coordinator = getattr(consumer, "_coordinator", None)
    join_task = getattr(coordinator, "_join_task", None)
    if join_task is None or not getattr(join_task, "is_done", False):
        return False
    try:
        if coordinator.need_rejoin():
            return False  # the next poll collects or redoes the join itself
        coordinator.request_rejoin()
    except Exception:  # noqa: BLE001 - a guard for a client bug must never break a poll
        log.debug("could not check the group join", exc_info=True)
        return False
    kafka_log.warning("%s: the Kafka client dropped a group join; joining again", component)
    metrics.ERRORS.labels(component=component, kind="lost_join").inc()
    return True


class BatchHandler(ABC):
    """What one step adds to the loop: its open batch, its work on it, its own health and clients.

    All hooks run on the loop's thread (the consumer's), as do the rebalance
    callbacks kafka-python calls inside ``poll``.
    """

    @abstractmethod
    def take_records(self, polled: dict[Any, list[Any]], received_at: float) -> None:
        """Add one non-empty poll's records (by partition) to the open batch."""

    @abstractmethod
    def has_batch(self) -> bool:
        """Whether the open batch holds records (a rebalance may have emptied it)."""

    def batch_full(self) -> bool:
        """Whether the open batch should be handed over before its window closes."""
        return False

    def hand_over_in_s(self, window_left_s: float) -> float:
        """Seconds the open batch should still gather (0 or less: hand it over now).

        ``window_left_s`` is what is left of the batch window; a step whose work is
        still busy with an earlier batch may keep gathering longer, or stop sooner.
        """
        return window_left_s

    def poll_timeout_s(self, timeout_s: float) -> float:
        """The next poll's timeout, given the loop's own (the idle poll, or the wait above).

        A step with work in flight shortens it to look back sooner: a poll cannot be
        woken before its timeout when no record comes.
        """
        return timeout_s

    def after_poll(self) -> None:
        """After every poll, with records or not: e.g. commit what finished meanwhile."""
        return None

    @abstractmethod
    def handle_batch(self) -> None:
        """Do the step's work on the open batch, commit what is safe, and start a new batch."""

    def settle(self) -> None:
        """A turn without a batch, and the end of a run: finish and commit work in flight."""
        return None

    def drain(self) -> None:
        """The end of a run (stop, idle, ``until``): finish and commit everything in hand."""
        self.settle()

    def log_progress(self) -> None:
        """The periodic progress line, every ``progress_every_s`` of ``ConsumerLoop.run``."""
        return None

    def health_details(self) -> dict[str, Any]:
        """The step's own fields of the ``/healthz`` body."""
        return {}

    def failing(self) -> bool:
        """Whether the step's own failures should turn ``/healthz`` red."""
        return False

    def release(self) -> None:
        """Close the step's own clients; the loop closes the consumer afterwards."""
        return None


class ConsumerLoop:
    """One service's consumer loop around ``handler``; ``run`` until stopped, idle or ``until``.

    ``idle_poll_ms`` is the poll timeout while no batch is open (it bounds how soon a
    stop request is seen); ``batch_window_s`` keeps a batch open for that long after
    its first records; ``max_records`` goes to every poll when set; ``join_grace_s``
    is how long a consumer without partitions counts as joining, not idle.
    """

    def __init__(
        self,
        component: str,
        handler: BatchHandler,
        *,
        health_stall_s: float,
        idle_poll_ms: int,
        batch_window_s: float = 0.0,
        max_records: int | None = None,
        join_grace_s: float | None = None,
    ) -> None:
        self.component = component
        self.handler = handler
        self.health_stall_s = health_stall_s
        self.idle_poll_ms = idle_poll_ms
        self.batch_window_s = batch_window_s
        self.join_grace_s = join_grace_s
        self._poll_kwargs = {} if max_records is None else {"max_records": max_records}
        self.stop_requested = threading.Event()
        self.outage = OutagePoll(component, stop=self.stop_requested)
        self.consumer: Any = None
        # When a turn last began (the /healthz stall clock), and when a batch last came or
        # partitions were assigned (the idle clock).
        self.last_turn_at = self.last_activity = time.monotonic()

    def request_stop(self) -> None:
        """Let the batch in hand finish, then return from ``run`` (safe from a signal handler)."""
        self.stop_requested.set()

    def restart_idle_clock(self) -> None:
        """Count from now for ``exit_when_idle_s`` (e.g. partitions were just assigned)."""
        self.last_activity = time.monotonic()

    def run(
        self,
        consumer: Any,
        *,
        exit_when_idle_s: float | None = None,
        until: Callable[[], bool] | None = None,
        progress_every_s: float | None = None,
    ) -> None:
        """Turn until ``request_stop``, ``until()``, or ``exit_when_idle_s`` without a batch.

        The consumer is closed at the end, after the step's own clients, also when a
        step or a poll raises (the error goes on to the caller).
        """
        self.consumer = consumer
        started = last_progress = self.last_activity = time.monotonic()
        try:
            while not self.stop_requested.is_set() and not (until and until()):
                self.last_turn_at = time.monotonic()
                got_batch = self._gather()
                now = time.monotonic()
                if got_batch:
                    self.last_activity = now
                    self.handler.handle_batch()
                else:
                    self.handler.settle()
                if progress_every_s is not None and now - last_progress >= progress_every_s:
                    self.handler.log_progress()
                    last_progress = now
                if not got_batch and self._idle_long_enough(exit_when_idle_s, started, now):
                    log.info(
                        "%s: no new events for %g s, exiting", self.component, exit_when_idle_s
                    )
                    break
            self.handler.drain()
        finally:
            self._close()

    def health(self) -> tuple[bool, dict[str, Any]]:
        """Healthy while the loop turns and Kafka answers, the step is not failing, no stop."""
        stalled_s = time.monotonic() - self.last_turn_at
        outage_s = self.outage.outage_s()
        stopping = self.stop_requested.is_set()
        details = {
            "role": self.component,
            "stopping": stopping,
            "loop_stalled_s": round(stalled_s, 1),
            "kafka_unreachable_s": round(outage_s, 1),
            **self.handler.health_details(),
        }
        stuck = max(stalled_s, outage_s) >= self.health_stall_s
        return not stopping and not stuck and not self.handler.failing(), details

    def _gather(self) -> bool:
        """Poll until the step takes the open batch (by default: its window closed); False
        if no record came."""
        opened_at: float | None = None
        while True:
            if opened_at is None:
                wait_s = self.idle_poll_ms / 1000.0
            else:
                wait_s = max(0.0, self._hand_over_in_s(opened_at))
            timeout_ms = max(0, int(self.handler.poll_timeout_s(wait_s) * 1000))
            polled = self.outage.poll(self.consumer, timeout_ms=timeout_ms, **self._poll_kwargs)
            received_at = time.monotonic()
            if polled:
                self.handler.take_records(polled, received_at)
            self.handler.after_poll()
            if not self.handler.has_batch():
                return False
            if opened_at is None:
                opened_at = received_at
            if (
                self._hand_over_in_s(opened_at) <= 0
                or self.handler.batch_full()
                or self.stop_requested.is_set()
            ):
                return True

    def _hand_over_in_s(self, opened_at: float) -> float:
        window_left_s = opened_at + self.batch_window_s - time.monotonic()
        return self.handler.hand_over_in_s(window_left_s)

    def _idle_long_enough(self, exit_when_idle_s: float | None, started: float, now: float) -> bool:
        if exit_when_idle_s is None:
            return False
        # A broker outage is not idleness: events may be waiting behind it.
        if self.outage.outage_s() > 0 or self._joining(started, now):
            return False
        return now - self.last_activity >= exit_when_idle_s

    def _joining(self, started: float, now: float) -> bool:
        """No partitions yet, within ``join_grace_s`` of the start.

        After a crash the group waits for the old member's session to time out
        before it assigns anything: that wait is not idleness.
        """
        if self.join_grace_s is None or now - started >= self.join_grace_s:
            return False
        return not self.consumer.assignment()

    def _close(self) -> None:
        try:
            self.handler.release()
        finally:
            try:
                try:
                    self.consumer.close(autocommit=False)
                except TypeError:  # fakes and older clients take no argument
                    self.consumer.close()
            except Exception:
                # Closing must not hide the error that ended the run, if any.
                log.exception("%s: closing the Kafka consumer failed", self.component)
