"""``genrec bench prompt-limits``: the store's events since the refresh replayed through one
``Recommender`` per ``online.max_prompt_items``, side by side in one run: hit rate and time
(app layer; times ``genrec.online.recommender``).

A prompt grows from the refresh's prefix (or the user's kept prompt) by every newer item
up to ``max_prompt_items``, then starts again from the last H items. Longer prompts mean
fewer full prefills but more positions than the target was trained on (windows of H + 1
items). This bench measures both sides of that trade on real traffic: the events stored
after the active prefix-KV version's cutoff (for ``make demo``'s store, the replayed 20%),
in store order, each served by every limit in turn, one event a call, from in-memory
histories (the events up to the cutoff + those replayed so far; the store is not
written). Each event is scored prequentially: a hit when its item is in the top-k list
produced at that user's previous event (generative and merged). Per limit: HR@k, ms per
request (all of ``recommend``), mean prompt items, requests rebased; then each limit's
time over the first's.

Memory: the replayed events (``--max-events`` at most, read in one query) and their users'
histories up to the cutoff; each side keeps at most one prompt KV per user.

Example::

    $ genrec bench prompt-limits --limits 50,75,100 --max-events 5000
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import func, select

from genrec.infra.progress import progress_bar
from genrec.infra.settings import Settings
from genrec.ingest.history import History, HistoryEvent, load_histories_of
from genrec.online.recommender import Recommender, Request
from genrec.schemas.events import UserEvent
from genrec.schemas.tables import events, prefix_kv_index


@dataclass
class LimitFigures:
    """One prompt limit's running totals."""

    limit: int
    hits: dict[str, int] = field(default_factory=lambda: {"generative": 0, "merged": 0})
    seconds: float = 0.0
    requests: int = 0
    prompt_items: int = 0
    rebased: int = 0
    shown: dict[str, dict[str, set[str]]] = field(default_factory=dict, repr=False)


def run_prompt_limits_bench(
    settings: Settings, engine, bundle, limits: list[int], max_events: int = 20_000
) -> dict[str, Any]:
    """Replay and score (module docstring); ``bundle``: the serving version to decode with."""
    if not limits or min(limits) < 1 or max_events < 1:
        raise ValueError("--limits must be positive items and --max-events >= 1")
    if bundle.decoder is None:
        raise ValueError("the active serving version has no generative decoder to measure")
    cutoff, replayed = _replayed_events(engine, bundle.kv_version, max_events)
    if not replayed:
        raise ValueError("no events stored after the prefix-KV cutoff: nothing to replay")
    stored = load_histories_of(
        engine, sorted({r.user_id for r in replayed}), newest=settings.online.max_history_events
    )
    histories = {
        user: [e for e in history if e.row is not None and e.row <= cutoff]
        for user, history in stored.items()
    }
    sides = [LimitFigures(limit) for limit in limits]
    recommenders = [Recommender(_limited(settings, s.limit), engine) for s in sides]
    scored = 0
    for n, row in enumerate(progress_bar(replayed, desc="prompt limits", unit="ev")):
        history = histories.setdefault(row.user_id, [])
        history.append(HistoryEvent(row.item_id, row.ts_ms, row.event_id, row.id))
        request = Request.of([UserEvent(event_id=row.event_id, user_id=row.user_id,
                                        item_id=row.item_id, event_type="view", ts=row.ts_ms)])  # fmt: skip
        scored += row.user_id in sides[0].shown
        for i in range(len(sides)):  # the order rotates event by event
            k = (n + i) % len(sides)
            _serve(sides[k], recommenders[k], request, History.of(history), row, bundle)
    return _report(settings, bundle, sides, len(replayed), scored)


def print_report(report: dict[str, Any]) -> None:
    print(
        f"prompt limits: {report['events']:,} events replayed since the refresh, "
        f"{report['scored']:,} scored (HR@{report['k']}), H = {report['history_items']}, "
        f"serving version {report['serving_version']}"
    )
    for row in report["limits"]:
        print(
            f"  limit {row['limit']:>4} items: HR@{report['k']} generative "
            f"{row['hr_generative']:.4f} merged {row['hr_merged']:.4f}, "
            f"{row['ms_per_request']:6.2f} ms/request ({row['time_vs_first']:.2f}x), "
            f"prompt items {row['prompt_items_mean']:.1f}, rebased {row['rebased']:,}"
        )


def _serve(side: LimitFigures, recommender, request, history, row, bundle) -> None:
    shown = side.shown.get(row.user_id)
    if shown is not None:
        for branch in side.hits:
            side.hits[branch] += row.item_id in shown[branch]
    started = time.perf_counter()
    [message] = recommender.recommend([request], bundle, [history])
    side.seconds += time.perf_counter() - started
    side.requests += 1
    side.prompt_items += int(message.decoding.get("prompt_items", 0))
    side.rebased += bool(message.decoding.get("prompt_rebased"))
    side.shown[row.user_id] = {
        "generative": {item.item_id for item in message.branches.get("generative", [])},
        "merged": {item.item_id for item in message.items},
    }


def _report(settings, bundle, sides: list[LimitFigures], replayed: int, scored: int) -> dict:
    first = sides[0].seconds / max(sides[0].requests, 1)
    rows = []
    for side in sides:
        per_request = side.seconds / max(side.requests, 1)
        rows.append({
            "limit": side.limit,
            "hr_generative": round(side.hits["generative"] / max(scored, 1), 4),
            "hr_merged": round(side.hits["merged"] / max(scored, 1), 4),
            "ms_per_request": round(1000.0 * per_request, 3),
            "time_vs_first": round(per_request / first, 3) if first else None,
            "prompt_items_mean": round(side.prompt_items / max(side.requests, 1), 1),
            "rebased": side.rebased,
        })  # fmt: skip
    return {
        "serving_version": bundle.key, "history_items": bundle.decoder.history_items,
        "k": settings.online.k, "events": replayed, "scored": scored, "limits": rows,
    }  # fmt: skip


def _replayed_events(engine, kv_version, max_events: int) -> tuple[int, list]:
    """The serving prefix-KV version's newest cutoff row (0 without one), and the first
    ``max_events`` events stored after it, in store order."""
    newest = select(func.max(prefix_kv_index.c.cutoff_event_row)).where(
        prefix_kv_index.c.kv_version == kv_version
    )
    with engine.connect() as connection:
        cutoff = (connection.execute(newest).scalar_one() or 0) if kv_version is not None else 0
        columns = (events.c.id, events.c.event_id, events.c.user_id, events.c.item_id,
                   events.c.ts_ms)  # fmt: skip
        query = select(*columns).where(events.c.id > cutoff).order_by(events.c.id)
        return cutoff, list(connection.execute(query.limit(max_events)))


def _limited(settings: Settings, limit: int) -> Settings:
    online = settings.online.model_copy(update={"max_prompt_items": limit})
    return settings.model_copy(update={"online": online})
