"""Recently served users' store histories, kept so a batch reads only their new rows (online).

A request needs the user's stored history (up to ``online.max_history_events`` newest
events): the prompt's window, the suffix past the cached prefix, the seen items, the
branches' input. Read in full, that is every stored row of every user of a batch, each
time (a batch of 64 ML-100K users: ~8,600 rows, 21-30 ms on the 2-core CPU), although an
active user's history changes by an event or two between requests. ``HistoryCache``
keeps the histories it read, each with a *watermark*: an ``events.id`` at or above every
row of the user the store held when it was read. A user met again within
``online.history_cache_s`` is read incrementally (rows above the lowest watermark of the
batch's cached users: one query for all of them, 2-7 ms for the same 64 users); anyone
else is read in full. So a batch costs at most two queries.

Why a watermark works: the store appends, ``events.id`` grows with every insert, and the
rows of one user are inserted by the one ingest consumer that owns the user's partition,
a batch at a time. Any row inserted after a read has a higher id than every row that read
returned. On PostgreSQL ids come from a sequence and a transaction that took a lower id
may commit after one that took a higher; a row that lands below a watermark like that
is missed until the entry's age passes ``online.history_cache_s`` and the user is read in
full again, which bounds how long the history can lack it (the events in hand from Kafka
are always merged on top, by ``Recommender``).

Memory: at most ``online.history_cache_events`` events (least recently used users go
first); an ML-100K event costs ~220 bytes in a ``History``'s columns with its strings
(measured with tracemalloc; 275 as a list of ``HistoryEvent``), so the default 500,000 is
~110 MB. It grows with the number of recently active users times their history length,
not with the store. Held as columns, a user's history is one object the cyclic garbage
collector walks, not one per event (``genrec.ingest.history.History``).
``online.history_cache_events = 0`` reads every history in full.

``UnstoredEvents`` covers the other side of the same gap: the events a worker has served
that the store does not return yet (ingest stores a batch after its fetch wait, up to
``ingest.batch_timeout_ms`` behind the topic). Without them a user's second event within
that lag was served from a history lacking the first one (and its prompt no longer began
with the prompt decoded just before, so the kept prompt KV did not match either). Each is
kept until a read of the store returns it, or for ``online.history_cache_s`` at most (an
event ingest never stores, e.g. one the store already held under the same id, is
forgotten then); at most ``UNSTORED_MAX_EVENTS`` in all, least recently served users
first. It grows with the events served in the last moments of ingest lag, not with users.

Example::

    cache = HistoryCache(max_events=500_000, max_age_s=60.0, newest=1000)
    histories = cache.histories(engine, ["7", "42"])    # user id -> History
    unstored = UnstoredEvents(max_age_s=60.0)
    earlier = unstored.pending("7", {e.event_id for e in histories.get("7", [])})
    unstored.add("7", served_now)                       # after serving them
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sqlalchemy import Engine

from genrec.infra import metrics
from genrec.ingest.history import History, HistoryEvent, load_histories_of

# Served events kept for the store to catch up with (``UnstoredEvents``): ingest's lag is
# ~0.1-1 s of traffic, so this bounds a burst or an ingest outage (~270 bytes an event).
UNSTORED_MAX_EVENTS = 100_000


@dataclass
class _Entry:
    history: History  # stored rows only, in store order, the newest ``newest``
    watermark: int  # >= every events.id of the user when last read
    read_at: float  # time.monotonic() of the last full read


class HistoryCache:
    """Each recently served user's stored history; ``histories`` reads only what is new."""

    def __init__(
        self,
        max_events: int,
        max_age_s: float,
        newest: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_events < 0 or max_age_s <= 0 or newest < 1:
            raise ValueError("max_events >= 0, max_age_s > 0 and newest >= 1, please")
        self.max_events, self.max_age_s, self.newest = max_events, max_age_s, newest
        self.clock = clock
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._events = 0  # held over all entries
        self._lock = threading.Lock()

    def histories(self, engine: Engine, user_ids: Sequence[str]) -> dict[str, History]:
        """Each user's stored history in store order, the newest ``newest`` events (users
        without stored events are absent), as ``load_histories_of`` returns it."""
        wanted = list(dict.fromkeys(user_ids))
        if self.max_events == 0:
            return load_histories_of(engine, wanted, newest=self.newest)
        now = self.clock()
        with self._lock:
            fresh = {
                user: entry
                for user in wanted
                if (entry := self._entries.get(user)) is not None
                and now - entry.read_at <= self.max_age_s
            }
        missing = [u for u in wanted if u not in fresh]
        found: dict[str, History] = {}
        if missing:
            found.update(self._read_in_full(engine, missing, now))
        if fresh:
            found.update(self._read_new_rows(engine, fresh))
        return found

    def _read_in_full(self, engine: Engine, users: list[str], now: float) -> dict[str, History]:
        read = load_histories_of(engine, users, newest=self.newest)
        metrics.HISTORY_READS.labels(read="full").inc(len(users))
        # Every row inserted after this read has a higher id than any row it returned; a
        # read that returned nothing gives no such bound: those users are not kept.
        rows = [row for h in read.values() for row in h.rows if row is not None]
        watermark = max(rows) if rows else None
        if watermark is not None:
            with self._lock:
                for user in users:
                    self._keep(user, _Entry(read.get(user, History()), watermark, now))
        return read

    def _read_new_rows(self, engine: Engine, cached: dict[str, _Entry]) -> dict[str, History]:
        floor = min(e.watermark for e in cached.values())
        new = load_histories_of(engine, list(cached), newest=self.newest, after_row=floor)
        metrics.HISTORY_READS.labels(read="incremental").inc(len(cached))
        top = max((r for h in new.values() for r in h.rows if r is not None), default=floor)
        found = {}
        with self._lock:
            for user, entry in cached.items():
                rows = _stored_after(new.get(user), entry.watermark)
                history = _merged(entry.history, rows, self.newest) if rows else entry.history
                self._keep(user, _Entry(history, max(entry.watermark, top), entry.read_at))
                if history:
                    found[user] = history
        return found

    def _keep(self, user: str, entry: _Entry) -> None:
        """Store ``entry`` as the most recently used; evict the least recent over budget."""
        old = self._entries.pop(user, None)
        if old is not None:
            self._events -= len(old.history)
        self._entries[user] = entry
        self._events += len(entry.history)
        while self._events > self.max_events and self._entries:
            _, evicted = self._entries.popitem(last=False)
            self._events -= len(evicted.history)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._events = 0

    def __len__(self) -> int:
        return len(self._entries)


def _stored_after(history: History | None, watermark: int) -> History | None:
    """The events of ``history`` stored after ``watermark`` (None when there are none)."""
    if history is None:
        return None
    keep = [i for i, row in enumerate(history.rows) if row is not None and row > watermark]
    if len(keep) == len(history):
        return history
    return history.take(keep) if keep else None


def _merged(history: History, rows: History, newest: int) -> History:
    """``history`` plus newer stored ``rows``, in store order, cut to the newest ``newest``."""
    merged = history + rows
    # the rows come in store order, each stored after every held one (a higher events.id):
    # only a late event (older than the newest held) re-sorts, and a stable sort by time
    # alone then leaves the store's (time, events.id) order
    if history and rows.ts_ms[0] < history.ts_ms[-1]:
        merged = merged.in_time_order()
    return merged[-newest:]


class UnstoredEvents:
    """Per user, the events served that a store read has not returned yet (module docstring).
    Thread-safe; ``clock`` is ``time.monotonic`` unless a test steps it."""

    def __init__(
        self,
        max_age_s: float,
        max_events: int = UNSTORED_MAX_EVENTS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_age_s <= 0 or max_events < 0:
            raise ValueError("max_age_s > 0 and max_events >= 0, please")
        self.max_age_s, self.max_events, self.clock = max_age_s, max_events, clock
        self._users: OrderedDict[str, list[tuple[HistoryEvent, float]]] = OrderedDict()
        self._events = 0
        self._lock = threading.Lock()

    def pending(self, user_id: str, stored_ids: set[str]) -> list[HistoryEvent]:
        """``user_id``'s served events that are not in ``stored_ids`` (the event ids of the
        store read just made) and not older than ``max_age_s``, in the order served; the
        others are forgotten."""
        with self._lock:
            kept = self._users.get(user_id)
            if not kept:
                return []
            oldest = self.clock() - self.max_age_s
            still = [(e, t) for e, t in kept if t >= oldest and e.event_id not in stored_ids]
            self._events -= len(kept) - len(still)
            if still:
                self._users[user_id] = still
            else:
                del self._users[user_id]
            return [e for e, _ in still]

    def add(self, user_id: str, events: Sequence[HistoryEvent]) -> None:
        """Keep ``events`` (just served, not stored yet) until the store returns them."""
        if not events or not self.max_events:
            return
        now = self.clock()
        with self._lock:
            kept = self._users.pop(user_id, [])
            known = {e.event_id for e, _ in kept}
            new = [(e, now) for e in events if e.event_id not in known]
            self._users[user_id] = kept + new  # the most recently served user last
            self._events += len(new)
            while self._events > self.max_events and self._users:
                _, dropped = self._users.popitem(last=False)
                self._events -= len(dropped)

    def clear(self) -> None:
        with self._lock:
            self._users.clear()
            self._events = 0

    def __len__(self) -> int:
        """Events held."""
        return self._events
