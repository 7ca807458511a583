"""Reads users' ordered histories back out of the behavior store (ingest step, the store's owner).

The one reader of stored histories, with one history type (``History``: a user's events
as columns, read one by one as ``HistoryEvent``), for every step that needs them:

- ``load_user_histories``: every user, optionally up to a time and within the newest N
  stored events (splits, evaluation, training on a bounded window);
- ``history_pages``: a page of users at a time up to an ``events.id`` cutoff and/or a time,
  optionally only recently active users (the refresh's prefix-KV precompute, fitting the
  recall branches; memory stays bounded); ``newest_event_ts``: the newest event's time;
- ``users_newest_first`` and ``load_histories_until``: the same users in pages ordered by
  their newest event up to the cutoff, newest first, and a page's histories (the
  refresh's prefix-KV precompute under a byte budget); ``count_inactive_users``: those
  the window leaves out;
- ``load_histories_of``: a given set of users in one query, each cut to their newest N
  events, optionally only the events stored after a row (the online recommender and its
  history cache);
- ``load_item_ids``: the catalog plus every item seen in events.

Order is by event time, ties broken by insertion order (``events.id``), which is the
order the events were produced in: the stable sort every evaluation uses, and the order
a cached prefix was built in.

Example::

    >>> from genrec.infra.database import make_engine
    >>> engine = make_engine("sqlite:///:memory:")
    >>> load_user_histories(engine), load_histories_of(engine, ["7"], newest=10)
    ({}, {})
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, overload

from sqlalchemy import (
    ColumnElement,
    Connection,
    Engine,
    Select,
    and_,
    bindparam,
    func,
    or_,
    select,
    true,
)

from genrec.schemas.tables import events, items, users

IN_CHUNK = 500  # user ids per IN (...) list: far below every database's parameter limit


# A named tuple, not a dataclass: ``History`` hands one out per event its readers iterate
# over, and a tuple is built in a fifth of the time of a frozen slotted dataclass (0.4 vs
# 1.9 us here). It is the view of one event; a user's events are held by ``History``.
class HistoryEvent(NamedTuple):
    """One event of a user's history: a stored one, or (online) one only held from Kafka."""

    item_id: str
    ts_ms: int
    event_id: str
    row: int | None  # events.id in the store; None for an event not stored yet


class History(Sequence[HistoryEvent]):
    """One user's events in store order, held as four columns (plain tuples).

    Why columns: the cyclic garbage collector untracks a plain tuple of strings and ints
    the first time it meets one, but never an instance of a named tuple or a class, and a
    full collection walks every tracked object. An online worker holds up to
    ``online.history_cache_events`` events (500,000 by default); as ``HistoryEvent``
    objects they were most of what a full collection walked once the worker had frozen its
    libraries and models (420,000 objects on the demo's store, 74 ms a collection on the
    2-core CPU with the serving thread stopped; as columns 23,000 and 7 ms). It also saves
    ~55 bytes an event (220 against 275 with the strings). Readers that want
    the events one by one iterate (or index) and get ``HistoryEvent`` objects, built then; hot
    paths read the columns (``item_ids``, ``ts_ms``, ``event_ids``, ``rows``).

    Example::

        >>> h = History.of([HistoryEvent("i1", 10, "e1", 1), HistoryEvent("i2", 20, "e2", 2)])
        >>> h.item_ids, h[-1].event_id, len(h), list(h[:1]) == [HistoryEvent("i1", 10, "e1", 1)]
        (('i1', 'i2'), 'e2', 2, True)
    """

    __slots__ = ("item_ids", "ts_ms", "event_ids", "rows")

    def __init__(
        self,
        item_ids: Iterable[str] = (),
        ts_ms: Iterable[int] = (),
        event_ids: Iterable[str] = (),
        rows: Iterable[int | None] = (),
    ) -> None:
        self.item_ids: tuple[str, ...] = tuple(item_ids)
        self.ts_ms: tuple[int, ...] = tuple(ts_ms)
        self.event_ids: tuple[str, ...] = tuple(event_ids)
        self.rows: tuple[int | None, ...] = tuple(rows)
        n = len(self.item_ids)
        if not len(self.ts_ms) == len(self.event_ids) == len(self.rows) == n:
            raise ValueError("a History's four columns must have the same length")

    @classmethod
    def of(cls, events: Iterable[HistoryEvent]) -> History:
        """The history of ``events`` (in the order given); a ``History`` is returned as is."""
        if isinstance(events, History):
            return events
        columns = tuple(zip(*events, strict=True))
        return cls(*columns) if columns else cls()

    def __len__(self) -> int:
        return len(self.item_ids)

    def __iter__(self) -> Iterator[HistoryEvent]:
        return map(HistoryEvent._make, zip(*self._columns(), strict=True))

    @overload
    def __getitem__(self, index: int) -> HistoryEvent: ...
    @overload
    def __getitem__(self, index: slice) -> History: ...
    def __getitem__(self, index):
        if isinstance(index, slice):
            return History(self.item_ids[index], self.ts_ms[index], self.event_ids[index],
                           self.rows[index])  # fmt: skip
        return HistoryEvent(
            self.item_ids[index], self.ts_ms[index], self.event_ids[index], self.rows[index]
        )

    def __add__(self, other: Iterable[HistoryEvent]) -> History:
        """The events of ``self`` then those of ``other`` (no re-sorting)."""
        other = History.of(other)
        return History(self.item_ids + other.item_ids, self.ts_ms + other.ts_ms,
                       self.event_ids + other.event_ids, self.rows + other.rows)  # fmt: skip

    def take(self, positions: Iterable[int]) -> History:
        """The events at ``positions``, in that order."""
        positions = list(positions)
        return History(*([column[i] for i in positions] for column in self._columns()))

    def in_time_order(self) -> History:
        """The same events sorted by time, stably (events of one time keep their order)."""
        order = sorted(range(len(self)), key=self.ts_ms.__getitem__)
        return self if all(i == j for i, j in enumerate(order)) else self.take(order)

    def _columns(self) -> tuple[tuple, ...]:
        return self.item_ids, self.ts_ms, self.event_ids, self.rows

    def __eq__(self, other: object) -> bool:
        if isinstance(other, History):
            return self._columns() == other._columns()
        if isinstance(other, Sequence) and not isinstance(other, str | bytes):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # equal to lists, which do not hash

    def __repr__(self) -> str:
        return f"History({list(self)!r})"


def load_user_histories(
    engine: Engine, *, until_ts_ms: int | None = None, newest_events: int | None = None
) -> dict[str, History]:
    """Every user's events in time order (stable), optionally only those up to ``until_ts_ms``
    and only among the store's newest ``newest_events`` rows (highest ``events.id``: the
    order ingest stored them), a window that keeps the read bounded however large the
    store grows."""
    conditions = [] if until_ts_ms is None else [events.c.ts_ms <= until_ts_ms]
    if newest_events is not None:
        first = first_of_newest_rows(engine, newest_events)
        if first is not None:
            conditions.append(events.c.id >= first)
    return _grouped(engine, _history_query(*conditions))


def first_of_newest_rows(engine: Engine, count: int) -> int | None:
    """The lowest ``events.id`` among the newest ``count`` rows; None when the store holds
    fewer (every row is in). One walk of ``count`` entries of the primary key."""
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    query = select(events.c.id).order_by(events.c.id.desc()).offset(count - 1).limit(1)
    with engine.connect() as connection:
        first = connection.execute(query).scalar()
    return None if first is None else int(first)


def load_histories_of(
    engine: Engine,
    user_ids: Iterable[str],
    *,
    newest: int | None = None,
    after_row: int | None = None,
) -> dict[str, History]:
    """The events of ``user_ids`` in time order, in one query; with ``newest``, only each
    user's newest ``newest`` events (older ones are dropped while reading); with
    ``after_row``, only those stored after that ``events.id`` (for a reader that holds the
    rest: the online worker's history cache)."""
    if newest is not None and newest < 1:
        raise ValueError(f"newest must be >= 1, got {newest}")
    wanted = sorted(set(user_ids))
    if not wanted:
        return {}
    if after_row is None:
        return _grouped(engine, _OF_USERS, {"users": wanted}, newest=newest)
    return _grouped(engine, _OF_USERS_AFTER, {"users": wanted, "after": after_row}, newest=newest)


def history_pages(
    engine: Engine,
    *,
    until_row: int | None = None,
    until_ts_ms: int | None = None,
    users_per_page: int,
    active_days: float | None = None,
) -> Iterator[dict[str, History]]:
    """Pages of up to ``users_per_page`` users (in user-id order), each user's events with
    ``events.id <= until_row`` and ``ts_ms <= until_ts_ms`` (each when given) in time order.

    With ``active_days``, only users with an event that recent (counted back from the
    newest event below the cutoff). Each page is two short queries (the next user ids,
    then their events), so no read transaction stays open between pages. The pages
    together hold what ``load_user_histories`` returns, in the same order.
    """
    below_cutoff = _below(until_row, until_ts_ms)
    active_since = _active_since(engine, below_cutoff, active_days)
    if active_since == _NO_EVENTS:
        return
    after = None
    while True:
        users = _next_users(engine, below_cutoff, active_since, after, users_per_page)
        if not users:
            return
        # A range, not IN: a page can hold tens of thousands of users (more than a
        # statement takes parameters); inactive users inside the range are skipped.
        in_range = (events.c.user_id >= users[0], events.c.user_id <= users[-1])
        yield _grouped(engine, _history_query(below_cutoff, *in_range), wanted=set(users))
        after = users[-1]


def newest_event_ts(engine: Engine, *, until_ts_ms: int | None = None) -> int | None:
    """The newest stored ``ts_ms`` (up to ``until_ts_ms`` when given); None without events."""
    query = select(func.max(events.c.ts_ms))
    if until_ts_ms is not None:
        query = query.where(events.c.ts_ms <= until_ts_ms)
    with engine.connect() as connection:
        newest = connection.execute(query).scalar()
    return None if newest is None else int(newest)


def _below(until_row: int | None, until_ts_ms: int | None) -> ColumnElement[bool]:
    """The cutoff condition of a paged read (true when neither bound is given)."""
    conditions = []
    if until_row is not None:
        conditions.append(events.c.id <= until_row)
    if until_ts_ms is not None:
        conditions.append(events.c.ts_ms <= until_ts_ms)
    return and_(true(), *conditions)


def users_newest_first(
    engine: Engine, *, until_row: int, users_per_page: int, active_days: float | None = None
) -> Iterator[list[str]]:
    """Pages of up to ``users_per_page`` user ids, ordered by each user's newest event with
    ``events.id <= until_row`` (``ts_ms``, newest first; ties by user id), with
    ``active_days`` only users with an event that recent (as in ``history_pages``).

    Users come from ``users``, which ingest keeps in the same transaction as their events
    (``genrec.ingest.store``): a user whose events were written without it is never read.
    ``users.last_ts_ms`` covers every stored event, also those after the cutoff, so it
    is only an upper bound of the order's key: users are read in ``last_ts_ms`` order, their
    key is computed from the events up to the cutoff, and a user is handed out once no
    unread user can have a newer key. Memory: one page, plus a (key, id) pair for each
    user waiting because events after the cutoff raised its ``last_ts_ms`` (typically the
    few users active while the refresh runs).
    """
    below_cutoff = events.c.id <= until_row
    active_since = _active_since(engine, below_cutoff, active_days)
    if active_since == _NO_EVENTS:
        return
    waiting: list[tuple[int, str]] = []  # heap of (-newest event up to the cutoff, user id)
    ready: list[str] = []
    after: tuple[int, str] | None = None
    while True:
        rows = _users_by_last_ts(engine, active_since, after, users_per_page)
        for user_id, newest in _newest_up_to(engine, [r[0] for r in rows], below_cutoff).items():
            if active_since is None or newest >= active_since:
                heapq.heappush(waiting, (-newest, user_id))
        # No unread user has a key above ``bound`` (its last_ts_ms is at most that)
        bound = rows[-1][1] if len(rows) == users_per_page else None
        while waiting and (bound is None or -waiting[0][0] > bound):
            ready.append(heapq.heappop(waiting)[1])
            if len(ready) == users_per_page:
                yield ready
                ready = []
        if bound is None:
            break
        after = (rows[-1][1], rows[-1][0])
    if ready:
        yield ready


def load_histories_until(
    engine: Engine, user_ids: Sequence[str], *, until_row: int
) -> dict[str, History]:
    """The events with ``events.id <= until_row`` of ``user_ids`` in time order, in the
    order of ``user_ids`` (users without such events are left out); ``IN_CHUNK`` users
    per query."""
    found: dict[str, History] = {}
    below_cutoff = events.c.id <= until_row
    for start in range(0, len(user_ids), IN_CHUNK):
        chunk = list(user_ids[start : start + IN_CHUNK])
        found.update(_grouped(engine, _history_query(below_cutoff, events.c.user_id.in_(chunk))))
    return {user_id: found[user_id] for user_id in user_ids if user_id in found}


def count_inactive_users(engine: Engine, *, until_row: int, active_days: float) -> int:
    """Users with events up to ``until_row`` but none within ``active_days`` of the newest
    of them (those ``history_pages`` and ``users_newest_first`` leave out); one scan."""
    below_cutoff = events.c.id <= until_row
    active_since = _active_since(engine, below_cutoff, active_days)
    if active_since == _NO_EVENTS:
        return 0
    newest = func.max(events.c.ts_ms)
    inactive = (
        select(events.c.user_id)
        .where(below_cutoff)
        .group_by(events.c.user_id)
        .having(newest < active_since)
        .subquery()
    )
    with engine.connect() as connection:
        return int(connection.execute(select(func.count()).select_from(inactive)).scalar_one())


def load_item_ids(engine: Engine) -> list[str]:
    """All catalog item ids plus any item seen only in events, sorted for determinism."""
    with engine.connect() as connection:
        catalog = {row[0] for row in connection.execute(select(items.c.item_id))}
        seen = {row[0] for row in connection.execute(select(events.c.item_id).distinct())}
    return sorted(catalog | seen, key=_natural_key)


def _history_query(*conditions: ColumnElement[bool]) -> Select:
    """Events in (user, time, insertion) order: each user's history comes out in one run."""
    columns = (events.c.user_id, events.c.item_id, events.c.ts_ms, events.c.event_id, events.c.id)
    return (
        select(*columns).where(*conditions).order_by(events.c.user_id, events.c.ts_ms, events.c.id)
    )


# The worker's per-batch reads (``load_histories_of``), compiled once per dialect
_OF_USERS = _history_query(events.c.user_id.in_(bindparam("users", expanding=True)))
_OF_USERS_AFTER = _history_query(
    events.c.user_id.in_(bindparam("users", expanding=True)), events.c.id > bindparam("after")
)


def _grouped(
    engine: Engine,
    query: Select,
    values: Mapping[str, Any] | None = None,
    *,
    wanted: set[str] | None = None,
    newest: int | None = None,
) -> dict[str, History]:
    """The rows of a ``_history_query`` (its bound ``values`` when it has parameters) per
    user, only ``wanted`` users when given, each cut to the newest ``newest`` when given."""
    grouped: dict[str, list[tuple]] = {}
    with engine.connect() as connection:
        # rows come grouped by user: one dict lookup per user, not per row; each is the
        # driver's own (user, item, ts, event, id) tuple, turned into columns at the end
        user_id, held = None, []
        for driver_row in _driver_rows(connection, query, values):
            if driver_row[0] != user_id:
                user_id = driver_row[0]
                held = (
                    grouped.setdefault(user_id, []) if wanted is None or user_id in wanted else []
                )
            held.append(driver_row)
            if newest is not None and len(held) == 2 * newest:
                del held[:newest]  # a long history never holds more than 2 * newest
    cut = slice(None) if newest is None else slice(-newest, None)
    return {
        user: History(*list(zip(*held[cut], strict=True))[1:]) for user, held in grouped.items()
    }


def _driver_rows(
    connection: Connection, query: Select, values: Mapping[str, Any] | None = None
) -> Iterator[tuple]:
    """``query``'s rows as the database driver's own tuples.

    The history columns are strings and integers, which no SQLAlchemy result processor
    changes, so its ``Row`` objects are pure cost here: ~2.7 us a row against ~1.3 us
    from the cursor (sqlite3, the 2-core CPU), where a batch of 64 ML-100K users reads
    ~15,000 rows. The statement runs on the connection's own DBAPI connection, inside the
    same pooled connection's transaction handling (rolled back on return to the pool).
    A statement with parameters (``values``; the worker's per-batch reads) is compiled
    once per dialect and only its IN list expanded per call (10 us for one user against
    the 139 us of compiling it with the values rendered); one without is compiled as given.
    """
    if values is None:
        compiled = query.compile(
            dialect=connection.dialect, compile_kwargs={"render_postcompile": True}
        )
        sql, params, order = compiled.string, compiled.construct_params(), compiled.positiontup
    else:
        compiled = _compiled_once(query, connection.dialect)
        state = compiled.construct_expanded_state(dict(values))
        sql, params, order = state.statement, state.parameters, state.positiontup
    args: Sequence | Mapping = (
        tuple(params[name] for name in order or ()) if compiled.positional else params
    )
    cursor = connection.connection.cursor()
    try:
        cursor.execute(sql, args)
        yield from cursor
    finally:
        cursor.close()


_COMPILED: dict[tuple[int, str, str], Any] = {}  # (statement, dialect, paramstyle) -> compiled


def _compiled_once(query: Select, dialect: Any) -> Any:
    """``query`` compiled for ``dialect``, once (only module-level statements come here, so
    the cache holds a few entries per dialect)."""
    key = (id(query), dialect.name, dialect.paramstyle)
    compiled = _COMPILED.get(key)
    if compiled is None:
        compiled = _COMPILED[key] = query.compile(dialect=dialect)
    return compiled


def _next_users(
    engine: Engine,
    below_cutoff: ColumnElement[bool],
    active_since: int | None,
    after: str | None,
    limit: int,
) -> list[str]:
    """The next ``limit`` user ids after ``after`` (database order) with events below the
    cutoff, and one at or after ``active_since`` when given."""
    query = select(events.c.user_id).where(below_cutoff).group_by(events.c.user_id)
    if after is not None:
        query = query.where(events.c.user_id > after)
    if active_since is not None:
        query = query.having(func.max(events.c.ts_ms) >= active_since)
    with engine.connect() as connection:
        return list(connection.execute(query.order_by(events.c.user_id).limit(limit)).scalars())


_NO_EVENTS = -1  # ``_active_since``: nothing below the cutoff (timestamps are never negative)


def _active_since(
    engine: Engine, below_cutoff: ColumnElement[bool], active_days: float | None
) -> int | None:
    """The window's first ``ts_ms`` (counted back from the newest event below the cutoff),
    None without a window, ``_NO_EVENTS`` when there is nothing below the cutoff."""
    if active_days is None:
        return None
    with engine.connect() as connection:
        newest = connection.execute(select(func.max(events.c.ts_ms)).where(below_cutoff))
        newest_ts = newest.scalar()
    if newest_ts is None:
        return _NO_EVENTS
    return max(0, newest_ts - int(active_days * 86_400_000))


def _users_by_last_ts(
    engine: Engine, active_since: int | None, after: tuple[int, str] | None, limit: int
) -> list[tuple[str, int]]:
    """The next ``limit`` (user id, last_ts_ms) after ``after`` in (last_ts_ms, user id)
    descending order (both descending: the ``ix_users_last_ts`` index read backwards)."""
    last = users.c.last_ts_ms
    query = select(users.c.user_id, last)
    if active_since is not None:
        query = query.where(last >= active_since)
    if after is not None:
        ts, user_id = after
        query = query.where(or_(last < ts, and_(last == ts, users.c.user_id < user_id)))
    query = query.order_by(last.desc(), users.c.user_id.desc()).limit(limit)
    with engine.connect() as connection:
        return [(user_id, int(ts)) for user_id, ts in connection.execute(query)]


def _newest_up_to(
    engine: Engine, user_ids: list[str], below_cutoff: ColumnElement[bool]
) -> dict[str, int]:
    """Each user's newest ``ts_ms`` below the cutoff (users without such events left out)."""
    newest: dict[str, int] = {}
    with engine.connect() as connection:
        for start in range(0, len(user_ids), IN_CHUNK):
            chunk = user_ids[start : start + IN_CHUNK]
            query = (
                select(events.c.user_id, func.max(events.c.ts_ms))
                .where(below_cutoff, events.c.user_id.in_(chunk))
                .group_by(events.c.user_id)
            )
            newest.update((user_id, int(ts)) for user_id, ts in connection.execute(query))
    return newest


def _natural_key(item_id: str) -> tuple[int, int | str]:
    return (0, int(item_id)) if item_id.isdigit() else (1, item_id)
