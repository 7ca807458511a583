"""A user page's content: the history, what of it the model sees, and every list served.

The lists come from the serving code itself (``Recommender.recommend`` on the
active ``ServingBundle``), so they are what a worker would publish for the
user's latest event. ``at`` recommends as of an earlier point: the first
``at`` events of the history (decoded from the full prompt, since the cached
prefix may cover later events), and the items of the events after it are
marked on every list as "later": did the lists see them coming?

Each history event is labelled with its part of the prompt:

- ``prefix KV``: in the user's cached prefix (up to its cutoff, within the
  model's history window);
- ``live suffix``: after the cutoff, prefilled per request;
- ``prompt``: in the prompt of a user decoded without a cached prefix;
- ``outside window``: older than the model's last ``history_items`` items, or an
  item without a semantic ID (in neither the prompt nor the cache);
- ``later``: after ``at``;
- ``history``: read by the branches alone (a version without a generative model).

Example::

    >>> view = user_view(live, settings, "42", at=None)        # doctest: +SKIP
    >>> [row.item_id for row in view.lists["merged"]]
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from genrec.app.ui.serving import LiveVersion
from genrec.app.ui.titles import item_titles
from genrec.infra.settings import Settings
from genrec.ingest.history import HistoryEvent, load_histories_of
from genrec.online.recommender import Request
from genrec.schemas.events import UserEvent
from genrec.schemas.recommendations import RecommendationMessage


@dataclass
class HistoryRow:
    position: int  # 1-based, oldest first, over the history read
    item_id: str
    title: str | None
    when: str  # UTC, to the second
    part: str  # prefix KV | live suffix | prompt | outside window | later


@dataclass
class ListRow:
    rank: int  # 1-based
    item_id: str
    title: str | None
    score: float
    semantic_id: str | None = None  # "12-3-40-0" on generative items
    branch: str | None = None  # on the merged list: the list that ranked it best
    later: bool = False  # the user interacted with it after ``at``
    seen: bool = False  # already in the history used (re-consumption)


@dataclass
class UserView:
    user_id: str
    events: int  # events read for the user (at most online.max_history_events)
    at: int  # events the lists were computed from
    history: list[HistoryRow]  # the newest ui.history_rows of them, newest first
    lists: dict[str, list[ListRow]] = field(default_factory=dict)  # generative, branches, merged
    decoding: dict[str, Any] = field(default_factory=dict)
    version: str | None = None
    note: str | None = None  # why there are no lists, when there are none


def user_view(
    live: LiveVersion, settings: Settings, user_id: str, at: int | None
) -> UserView | None:
    """The page of ``user_id`` (None: no stored event), its lists as of event ``at``."""
    history = load_histories_of(
        live.engine, [user_id], newest=settings.online.max_history_events
    ).get(user_id, [])
    if not history:
        return None
    at = len(history) if at is None else max(1, min(at, len(history)))
    used, later = history[:at], {e.item_id for e in history[at:]}
    bundle = live.bundle()
    view = UserView(user_id, len(history), at, [], version=bundle.key if bundle else None)
    message = None
    if bundle is None:
        view.note = live.error
    else:
        message = _recommend(live, bundle, user_id, used, as_of=at < len(history))
        view.decoding = dict(message.decoding)
    titles = item_titles(live.engine, _shown_ids(history, message, settings.ui.history_rows))
    parts = _parts(live, bundle, user_id, history, at, view.decoding.get("path"))
    view.history = [
        HistoryRow(i + 1, e.item_id, titles.get(e.item_id), _when(e.ts_ms), parts[i])
        for i, e in reversed(list(enumerate(history)))
    ][: settings.ui.history_rows]
    if message is not None:
        seen = {e.item_id for e in used}
        view.lists = _lists(message, titles, later, seen)
    return view


def _recommend(live: LiveVersion, bundle, user_id: str, used: list[HistoryEvent], as_of: bool):
    """The message serving would publish for the last event of ``used``."""
    last = used[-1]
    event = UserEvent(
        event_id=last.event_id, user_id=user_id, item_id=last.item_id, event_type="view",
        ts=last.ts_ms,
    )  # fmt: skip
    if as_of:  # the cached prefix may hold events after ``at``: decode the whole prompt
        bundle = dataclasses.replace(bundle, kv_store=None, kv_version=None)
    with live.lock:
        (message,) = live.recommender.recommend([Request.of([event])], bundle, [used])
    return message


def _parts(live, bundle, user_id, history, at: int, path: str | None) -> list[str]:
    """Each history event's part of the prompt (module docstring)."""
    window = bundle.decoder.history_items if bundle and bundle.decoder else 0
    known = bundle.decoder.item_tokens if bundle and bundle.decoder else None
    cutoff = None
    if path == "prefix_kv" and at == len(history):
        entry = bundle.kv_store.lookup(bundle.kv_version, user_id)
        cutoff = entry.cutoff_event_row if entry is not None else None
    parts = ["later"] * len(history)
    if known is None:  # no generative model: only the branches read the history
        return ["history"] * at + parts[at:]
    in_prefix = [i for i in range(at) if _cached(history[i], cutoff)]
    suffix = [i for i in range(at) if not _cached(history[i], cutoff)]
    label = "prompt" if cutoff is None else "prefix KV"
    for indices, name in ((in_prefix, label), (suffix, "live suffix")):
        inside = [i for i in indices if known is not None and history[i].item_id in known]
        inside = set(inside[-window:] if window else [])
        for i in indices:
            parts[i] = name if i in inside else "outside window"
    return parts


def _cached(event: HistoryEvent, cutoff: int | None) -> bool:
    return cutoff is None or (event.row is not None and event.row <= cutoff)


def _lists(message: RecommendationMessage, titles, later: set[str], seen: set[str]) -> dict:
    def rows(scored, with_branch: bool = False) -> list[ListRow]:
        return [
            ListRow(
                item.rank + 1,
                item.item_id,
                titles.get(item.item_id),
                item.score,
                "-".join(map(str, item.semantic_id)) if item.semantic_id else None,
                item.branch if with_branch else None,
                item.item_id in later,
                item.item_id in seen,
            )  # fmt: skip
            for item in scored
        ]

    lists = {name: rows(scored) for name, scored in message.branches.items()}
    lists["merged"] = rows(message.items, with_branch=True)
    return lists


def _shown_ids(history, message, history_rows: int) -> set[str]:
    shown = {e.item_id for e in history[-history_rows:]}
    if message is not None:
        shown |= {i.item_id for i in message.items}
        shown |= {i.item_id for scored in message.branches.values() for i in scored}
    return shown


def _when(ts_ms: int) -> str:
    return datetime.fromtimestamp(ts_ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S")
