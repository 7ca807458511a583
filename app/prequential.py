"""Online prequential figures for the demo: score each event against the list shown before it.

For every replayed event ``e`` of a user, take the recommendation that was
published for that user's previous event and ask whether it contained
``e.item_id`` in its top 10 (for the merged list and for each branch). When a
worker coalesced the previous event and ``e`` into one request, that answer
already saw ``e``; the figure then uses the newest earlier answer that did not,
so no answer is ever scored on an event it had seen. Latency is measured from
the event's Kafka timestamp (set when it was produced) to the recommendation's
``produced_at``.

Example::

    >>> from genrec.app.prequential import ReplayedEvent, Published, prequential_figures
    >>> events = [ReplayedEvent("e1", "u", "a", 0), ReplayedEvent("e2", "u", "b", 5)]
    >>> recs = [Published(["e1"], {"merged": ["b", "c"]}, produced_ms=20)]
    >>> prequential_figures(events, recs, k=10)["hit_rate_at_10"]["merged"]
    1.0
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ReplayedEvent:
    event_id: str
    user_id: str
    item_id: str
    produced_ms: int  # Kafka timestamp of the event message


@dataclass(frozen=True)
class Published:
    """One recommendation message as the demo consumed it."""

    covered_event_ids: list[str]  # the triggering event and any coalesced with it
    lists: dict[str, list[str]]  # "merged" plus each branch, best first
    produced_ms: int
    trigger_event_id: str | None = None


def prequential_figures(
    events: Sequence[ReplayedEvent], published: Sequence[Published], k: int = 10
) -> dict:
    """Hit rate @k per list, latency percentiles and throughput; events in stream order."""
    answer_of: dict[str, Published] = {}
    for message in published:
        for event_id in message.covered_event_ids:
            answer_of.setdefault(event_id, message)
    by_user: dict[str, list[ReplayedEvent]] = defaultdict(list)
    for event in events:
        by_user[event.user_id].append(event)

    hits: dict[str, int] = defaultdict(int)
    evaluated = 0
    for user_events in by_user.values():
        for position in range(1, len(user_events)):
            answer = _answer_before(user_events, position, answer_of)
            if answer is None:
                continue
            evaluated += 1
            target = user_events[position].item_id
            for name, ranked in answer.lists.items():
                hits[name] += target in ranked[:k]
    names = sorted({name for message in published for name in message.lists})
    return {
        f"hit_rate_at_{k}": {name: hits[name] / evaluated if evaluated else 0.0 for name in names},
        "events_evaluated": evaluated,
        "events_replayed": len(events),
        "recommendations": len(published),
        "latency_ms": _latency(events, published),
        "recs_per_s": _throughput(published),
    }


def _answer_before(
    user_events: list[ReplayedEvent], position: int, answer_of: dict[str, Published]
) -> Published | None:
    """The newest answer for an earlier event of this user that had not seen this event."""
    current = user_events[position].event_id
    for earlier in reversed(user_events[:position]):
        answer = answer_of.get(earlier.event_id)
        if answer is not None and current not in answer.covered_event_ids:
            return answer
    return None


def _latency(events: Sequence[ReplayedEvent], published: Sequence[Published]) -> dict:
    produced = {event.event_id: event.produced_ms for event in events}
    samples = [
        message.produced_ms - produced[message.trigger_event_id]
        for message in published
        if message.trigger_event_id in produced
    ]
    if not samples:
        return {"p50": None, "p99": None, "samples": 0}
    values = np.asarray(samples, dtype=float)
    return {
        "p50": float(np.percentile(values, 50)),
        "p99": float(np.percentile(values, 99)),
        "samples": len(samples),
    }


def _throughput(published: Sequence[Published]) -> float:
    if len(published) < 2:
        return 0.0
    stamps = sorted(message.produced_ms for message in published)
    span_s = (stamps[-1] - stamps[0]) / 1000
    return (len(stamps) - 1) / span_s if span_s > 0 else 0.0
