"""The evaluation protocol's data split: leave-one-out by time, fixed for every model.

Each user's events are in stable time order (ties keep source order, see
``genrec.ingest.history``). The last item is the test target, the one before
it the validation target; training sees everything before the validation item.
Evaluating the test target uses the full history up to (and including) the
validation item. Every user with 3 events has a case, also when the held-out item
is one already in the history (a re-consumption): with seen items excluded such a
case is a miss for every ranker, with them allowed (``genrec eval --allow-seen``)
it can be hit; either way it stays in the average.

Example::

    >>> split = leave_one_out({"u1": ["a", "b", "c", "d"]})
    >>> split.train["u1"], split.valid["u1"].target, split.test["u1"].history
    (['a', 'b'], 'c', ['a', 'b', 'c'])
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from sqlalchemy import Engine

from genrec.ingest.history import load_user_histories

MIN_EVENTS = 3  # a user needs a training item, a validation item and a test item


@dataclass(frozen=True)
class Case:
    """One prediction to make: the items seen so far and the item that came next."""

    user_id: str
    history: list[str]
    target: str


@dataclass(frozen=True)
class Split:
    train: dict[str, list[str]]
    valid: dict[str, Case]
    test: dict[str, Case]
    # Each user's event times (ms), aligned with their whole time-ordered sequence, so any
    # prefix of it (training items, test history) has its times too. Empty when unknown.
    times: dict[str, list[int]] = field(default_factory=dict)

    def before_test(self) -> dict[str, list[str]]:
        """Every user's items before their test item (all of them for users without one):
        what a final fit may see without touching the test cases."""
        return {
            user: self.test[user].history if user in self.test else items
            for user, items in self.train.items()
        }


def leave_one_out(
    sequences: Mapping[str, Sequence[str]], times: Mapping[str, Sequence[int]] | None = None
) -> Split:
    """Split each user's time-ordered item sequence; users with < 3 events train only.

    ``times`` (optional): each sequence's event times, kept with the split.
    """
    if times is not None and any(
        len(times.get(u, ())) != len(items) for u, items in sequences.items()
    ):
        raise ValueError("times must give one time per item of every sequence")
    train: dict[str, list[str]] = {}
    valid: dict[str, Case] = {}
    test: dict[str, Case] = {}
    for user_id, sequence in sequences.items():
        items = list(sequence)
        if len(items) < MIN_EVENTS:
            train[user_id] = items
            continue
        train[user_id] = items[:-2]
        valid[user_id] = Case(user_id, items[:-2], items[-2])
        test[user_id] = Case(user_id, items[:-1], items[-1])
    kept_times = {user: list(times[user]) for user in sequences} if times is not None else {}
    return Split(train, valid, test, kept_times)


def load_split(engine: Engine, *, max_events: int | None = None) -> Split:
    """The leave-one-out split of every user in the behavior store; with ``max_events``,
    of the store's newest ``max_events`` events only (``train.max_events``): each user's
    history is what they did in that window."""
    histories = load_user_histories(engine, newest_events=max_events)
    return leave_one_out(
        {user: [e.item_id for e in events] for user, events in histories.items()},
        {user: [e.ts_ms for e in events] for user, events in histories.items()},
    )
