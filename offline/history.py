"""Reads the behavior store for the offline step: each user's ordered item history.

Order is by event time, ties broken by insertion order (``events.id``), which is
the order the events were produced in: the stable sort every evaluation uses.

Example::

    >>> from genrec.infra.database import make_engine
    >>> histories = load_user_histories(make_engine("sqlite:///:memory:"))
    >>> histories
    {}
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from sqlalchemy import Engine, select

from genrec.schemas.tables import events, items


@dataclass(frozen=True)
class HistoryEvent:
    item_id: str
    ts_ms: int
    event_id: str


def load_user_histories(
    engine: Engine, *, until_ts_ms: int | None = None
) -> dict[str, list[HistoryEvent]]:
    """Every user's events in time order (stable), optionally only those up to ``until_ts_ms``."""
    query = select(events.c.user_id, events.c.item_id, events.c.ts_ms, events.c.event_id).order_by(
        events.c.user_id, events.c.ts_ms, events.c.id
    )
    if until_ts_ms is not None:
        query = query.where(events.c.ts_ms <= until_ts_ms)
    histories: dict[str, list[HistoryEvent]] = defaultdict(list)
    with engine.connect() as connection:
        for user_id, item_id, ts_ms, event_id in connection.execute(query):
            histories[user_id].append(HistoryEvent(item_id, ts_ms, event_id))
    return dict(histories)


def load_item_ids(engine: Engine) -> list[str]:
    """All catalog item ids plus any item seen only in events, sorted for determinism."""
    with engine.connect() as connection:
        catalog = {row[0] for row in connection.execute(select(items.c.item_id))}
        seen = {row[0] for row in connection.execute(select(events.c.item_id).distinct())}
    return sorted(catalog | seen, key=_natural_key)


def _natural_key(item_id: str) -> tuple[int, int | str]:
    return (0, int(item_id)) if item_id.isdigit() else (1, item_id)
