"""``genrec bench sessions``: users who keep sending events between two refreshes, served
with and without kept prompts, side by side in one run (app layer; times
``genrec.online.recommender`` and ``genrec.online.served_prompts``).

Between refreshes each event makes a user's prompt longer: the refresh's prefix plus
every newer item, or the user's last decoded prompt plus its new items, up to
``online.max_prompt_items``, then the window of the last H items again. This bench
serves the same sessions three ways, one ``Recommender`` each, on the active serving
version:

- ``kept``: the settings as they are (kept prompts, the limit as set: 1.5H by default);
- ``kept, limit H``: kept prompts with ``max_prompt_items = H``, so a user past H items
  starts again from the window on every request;
- ``none``: no kept prompts (``reuse_prompt_kv`` off): only the refresh's prefix.

Sessions: ``--users`` store users (a seeded sample), ``--events`` new events each, sent
in rounds (every user once a round, in a shuffled order) in batches of ``--batch-users``.
Histories are held in memory (the store's events + the session's so far) and handed to
``Recommender.prepare``: the store is not written, and every side sees the same
histories. The sides take turns batch by batch (the order rotating), so a busy machine
slows all alike. Per side: ms per request (the whole of ``recommend``: histories in
hand, branches, decoding, messages), the tokens the target prefilled per request
(mean and p99) and the requests decoded from a kept prompt or rebased at the limit;
then each side's time over ``kept``'s.

Memory: the store's user ids and item ids (to sample from), the chosen users' histories
(at most ``online.max_history_events`` stored events each, plus the session's); each
side keeps at most one prompt KV per user.

Example::

    $ genrec bench sessions --users 40 --events 40
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select

from genrec.app.bench.load import EventPicker
from genrec.infra.progress import progress_bar
from genrec.infra.settings import Settings
from genrec.ingest.history import History, HistoryEvent, load_histories_of, load_item_ids
from genrec.online.live_version import active_serving_key, load_serving_bundle
from genrec.online.recommender import Recommender, Request
from genrec.schemas.tables import events as events_table


@dataclass
class SideFigures:
    """One way of serving the sessions: its settings and what it cost."""

    name: str
    online: dict[str, Any]  # the online settings it changed
    requests: int = 0
    seconds: float = 0.0
    prefilled: list[int] = field(default_factory=list, repr=False)
    served: int = 0  # decoded from a kept prompt
    rebased: int = 0  # started again from the window at the limit

    @property
    def ms_per_request(self) -> float:
        return 1000.0 * self.seconds / self.requests if self.requests else 0.0

    def summary(self) -> dict[str, Any]:
        prefilled = sorted(self.prefilled) or [0]
        return {
            "name": self.name, "online": self.online, "requests": self.requests,
            "ms_per_request": round(self.ms_per_request, 3),
            "prefilled_tokens_mean": round(statistics.fmean(prefilled), 1),
            "prefilled_tokens_p99": prefilled[int(0.99 * (len(prefilled) - 1))],
            "served": self.served, "rebased": self.rebased,
        }  # fmt: skip


def run_sessions_bench(
    settings: Settings, engine, bundle, *, users: int = 40, events: int = 40,
    batch_users: int = 4, seed: int = 0,
) -> dict[str, Any]:  # fmt: skip
    """Serve ``users`` x ``events`` session events three ways (module docstring) with
    ``bundle`` (the serving version to decode with); the figures."""
    if users < 1 or events < 1 or batch_users < 1:
        raise ValueError("--users, --events and --batch-users must be >= 1")
    if bundle.decoder is None:
        raise ValueError("the active serving version has no generative decoder to measure")
    window = bundle.decoder.history_items
    rng = random.Random(seed)
    stored = _sampled_histories(settings, engine, users, rng)
    picker = EventPicker(
        {u: set(h.item_ids) for u, h in stored.items()}, load_item_ids(engine),
        prefix=f"sessions-{seed}", seed=seed,
    )  # fmt: skip
    sides = [
        SideFigures("kept", {}),
        SideFigures("kept, limit H", {"max_prompt_items": window}),
        SideFigures("none", {"reuse_prompt_kv": False}),
    ]
    recommenders = [Recommender(_with_online(settings, side.online), engine) for side in sides]
    sessions = {u: list(h) for u, h in stored.items()}
    batches = _batches(sorted(stored), events, batch_users, rng)
    for n, batch in enumerate(progress_bar(batches, desc="sessions", unit="batch")):
        requests, histories = [], []
        for user in batch:
            new = picker.event("s", user)
            sessions[user].append(HistoryEvent(new.item_id, new.ts, new.event_id, None))
            requests.append(Request.of([new]))
            histories.append(History.of(sessions[user]))
        for i in range(len(sides)):  # the order rotates batch by batch
            k = (n + i) % len(sides)
            _serve(sides[k], recommenders[k], requests, histories, bundle)
    figures = [side.summary() for side in sides]
    base = sides[0].ms_per_request
    for row, side in zip(figures, sides, strict=True):
        row["time_vs_kept"] = round(side.ms_per_request / base, 3) if base else None
    return {
        "serving_version": bundle.key, "history_items": window,
        "max_prompt_items": settings.online.prompt_items_limit(window), "users": len(stored),
        "events_per_user": events, "batch_users": batch_users, "seed": seed, "sides": figures,
    }  # fmt: skip


def print_report(report: dict[str, Any]) -> None:
    print(
        f"sessions: {report['users']} users x {report['events_per_user']} events in batches of "
        f"{report['batch_users']}, H = {report['history_items']}, limit "
        f"{report['max_prompt_items']} items, serving version {report['serving_version']}"
    )
    for row in report["sides"]:
        print(
            f"  {row['name']:<14} {row['ms_per_request']:7.2f} ms/request "
            f"({row['time_vs_kept']:.2f}x kept), prefilled tokens mean "
            f"{row['prefilled_tokens_mean']:.1f} p99 {row['prefilled_tokens_p99']}, "
            f"from a kept prompt {row['served']}, rebased {row['rebased']} of {row['requests']}"
        )


def _serve(side: SideFigures, recommender, requests, histories, bundle) -> None:
    started = time.perf_counter()
    messages = recommender.recommend(requests, bundle, histories)
    side.seconds += time.perf_counter() - started
    side.requests += len(messages)
    for message in messages:
        decoding = message.decoding
        side.prefilled.append(int(decoding.get("suffix_tokens", decoding.get("prompt_tokens", 0))))
        side.served += decoding.get("prefix_source") == "served"
        side.rebased += bool(decoding.get("prompt_rebased"))


def _batches(users: list[str], events: int, batch_users: int, rng) -> list[list[str]]:
    """``events`` rounds of every user once, shuffled, cut into batches (a user at most once
    a batch: a round's batches hold distinct users)."""
    batches = []
    for _round in range(events):
        order = users[:]
        rng.shuffle(order)
        batches.extend(order[i : i + batch_users] for i in range(0, len(order), batch_users))
    return batches


def _sampled_histories(settings: Settings, engine, users: int, rng) -> dict[str, History]:
    with engine.connect() as connection:
        query = select(events_table.c.user_id).distinct().order_by(events_table.c.user_id)
        every = list(connection.execute(query).scalars())
    if not every:
        raise ValueError("the behavior store has no users: ingest events first")
    chosen = rng.sample(every, min(users, len(every)))
    return load_histories_of(engine, chosen, newest=settings.online.max_history_events)


def serving_bundle(settings: Settings, engine):
    """The active serving version, loaded once (no watching for the next)."""
    key = active_serving_key(engine)
    if key is None:
        raise ValueError("no serving version is active: run `genrec offline refresh` first")
    return load_serving_bundle(settings, engine, key)


def _with_online(settings: Settings, changes: dict[str, Any]) -> Settings:
    return settings.model_copy(update={"online": settings.online.model_copy(update=changes)})
