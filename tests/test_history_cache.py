"""The online history cache (online/history_cache.py): what it returns always equals a full
read of the store, while it reads only the rows stored since a user's last read."""

from __future__ import annotations

import itertools
import random

import pytest
from sqlalchemy import Engine, insert, select, text

from genrec.infra.database import make_engine
from genrec.ingest import history as history_module
from genrec.ingest.history import HistoryEvent, load_histories_of
from genrec.online.history_cache import HistoryCache, UnstoredEvents
from genrec.schemas.tables import events

NEWEST = 5
EVENT_IDS = itertools.count(1)


def add(engine: Engine, rows: list[tuple[str, str, int]]) -> None:
    """``(user_id, item_id, ts_ms)`` rows, inserted in the given order (ids made unique)."""
    values = [
        {"event_id": f"e{next(EVENT_IDS)}", "user_id": user, "item_id": item,
         "event_type": "view", "ts_ms": ts}
        for user, item, ts in rows
    ]  # fmt: skip
    with engine.begin() as connection:
        connection.execute(insert(events), values)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def engine(database_url: str) -> Engine:
    return make_engine(database_url)


def spying(monkeypatch) -> list[dict]:
    """The calls the cache makes to ``load_histories_of``: users and ``after_row``."""
    import genrec.online.history_cache as module

    calls: list[dict] = []
    real = module.load_histories_of

    def spy(engine, users, **kwargs):
        calls.append({"users": sorted(users), "after_row": kwargs.get("after_row")})
        return real(engine, users, **kwargs)

    monkeypatch.setattr(module, "load_histories_of", spy)
    return calls


def test_a_user_met_again_is_read_from_its_watermark_on(engine, monkeypatch) -> None:
    add(engine, [("u1", "a", 1000), ("u2", "b", 1000), ("u1", "c", 2000)])
    calls = spying(monkeypatch)
    clock = Clock()
    cache = HistoryCache(max_events=100, max_age_s=60.0, newest=NEWEST, clock=clock)
    first = cache.histories(engine, ["u1", "u2", "nobody"])
    assert first == load_histories_of(engine, ["u1", "u2"], newest=NEWEST)
    assert calls == [{"users": ["nobody", "u1", "u2"], "after_row": None}]

    add(engine, [("u1", "d", 3000), ("u3", "x", 3000)])  # u3: not in the next batch
    clock.now = 10.0
    again = cache.histories(engine, ["u1", "u2", "nobody"])
    assert again == load_histories_of(engine, ["u1", "u2"], newest=NEWEST)
    assert [e.item_id for e in again["u1"]] == ["a", "c", "d"]
    assert calls[1] == {"users": ["nobody", "u1", "u2"], "after_row": 3}  # new rows only

    add(engine, [("nobody", "n", 4000)])  # a user without events gets their first
    assert cache.histories(engine, ["nobody"])["nobody"][0].item_id == "n"


def test_late_events_sort_in_and_histories_keep_the_newest(engine) -> None:
    add(engine, [("u1", str(i), 1000 * i) for i in range(1, 5)])
    cache = HistoryCache(max_events=100, max_age_s=60.0, newest=NEWEST, clock=Clock())
    cache.histories(engine, ["u1"])
    add(engine, [("u1", "late", 1500), ("u1", "new", 9000), ("u1", "newer", 9500)])
    got = cache.histories(engine, ["u1"])["u1"]
    assert got == load_histories_of(engine, ["u1"], newest=NEWEST)["u1"]
    assert [e.item_id for e in got] == ["2", "3", "4", "new", "newer"]


def test_old_entries_are_read_in_full_and_the_budget_evicts_the_least_recent(
    engine, monkeypatch
) -> None:
    add(engine, [("u1", "a", 1), ("u2", "b", 1), ("u2", "c", 2), ("u3", "d", 1)])
    calls = spying(monkeypatch)
    clock = Clock()
    cache = HistoryCache(max_events=3, max_age_s=30.0, newest=NEWEST, clock=clock)
    cache.histories(engine, ["u1", "u2"])  # 3 events: at the budget
    cache.histories(engine, ["u3"])  # u1 (least recently used) goes
    assert len(cache) == 2
    cache.histories(engine, ["u1"])
    assert calls[-1]["after_row"] is None  # evicted: read in full
    clock.now = 31.0
    cache.histories(engine, ["u3"])
    assert calls[-1]["after_row"] is None  # too old: read in full
    assert HistoryCache(0, 1.0, NEWEST).histories(engine, ["u2"]) == load_histories_of(
        engine, ["u2"], newest=NEWEST
    )
    with pytest.raises(ValueError):
        HistoryCache(-1, 1.0, NEWEST)


def test_random_traffic_always_equals_a_full_read(engine) -> None:
    rng = random.Random(7)
    users = [f"u{n}" for n in range(12)]
    clock = Clock()
    cache = HistoryCache(max_events=40, max_age_s=5.0, newest=NEWEST, clock=clock)
    for step in range(40):
        add(engine, [(rng.choice(users), f"i{step}", rng.randrange(10_000)) for _ in range(3)])
        batch = rng.sample(users, rng.randint(1, 6))
        clock.now += rng.random() * 2
        assert cache.histories(engine, batch) == load_histories_of(engine, batch, newest=NEWEST)


def served(*event_ids: str) -> list[HistoryEvent]:
    return [HistoryEvent("item", 1000, event_id, None) for event_id in event_ids]


def test_unstored_events_wait_for_the_store_or_age_out() -> None:
    clock = Clock()
    unstored = UnstoredEvents(max_age_s=10.0, clock=clock)
    unstored.add("u1", served("a", "b"))
    unstored.add("u1", served("b", "c"))  # b again (a retried batch): kept once
    assert [e.event_id for e in unstored.pending("u1", set())] == ["a", "b", "c"]
    assert [e.event_id for e in unstored.pending("u1", {"a"})] == ["b", "c"]  # a is stored
    assert unstored.pending("u1", set()) == served("b", "c")  # a is forgotten for good
    assert unstored.pending("u2", set()) == [] and len(unstored) == 2
    clock.now = 10.5
    assert unstored.pending("u1", set()) == [] and len(unstored) == 0  # too old


def test_unstored_events_keep_the_most_recently_served_users_within_the_budget() -> None:
    unstored = UnstoredEvents(max_age_s=10.0, max_events=3, clock=Clock())
    unstored.add("u1", served("a", "b"))
    unstored.add("u2", served("c"))
    unstored.add("u3", served("d"))  # 4 events: u1, served least recently, goes
    assert unstored.pending("u1", set()) == [] and len(unstored) == 2
    assert [e.event_id for e in unstored.pending("u3", set())] == ["d"]
    UnstoredEvents(max_age_s=1.0, max_events=0).add("u1", served("a"))  # 0: keeps nothing
    with pytest.raises(ValueError):
        UnstoredEvents(max_age_s=0.0)


def test_histories_read_through_the_driver_equal_sqlalchemy_rows(engine) -> None:
    rng = random.Random(3)
    add(engine, [(f"u{rng.randrange(6)}", f"i{n}", rng.randrange(50)) for n in range(60)])
    columns = (events.c.user_id, events.c.item_id, events.c.ts_ms, events.c.event_id, events.c.id)
    query = select(*columns).order_by(events.c.user_id, events.c.ts_ms, events.c.id)
    expected: dict[str, list] = {}
    with engine.connect() as connection:
        for user, *fields in connection.execute(query.where(events.c.user_id.in_(["u1", "u4"]))):
            expected.setdefault(user, []).append(HistoryEvent(*fields))
    assert load_histories_of(engine, ["u4", "u1", "nobody"]) == expected
    floor = expected["u1"][2].row
    newer = {u: [e for e in h if e.row > floor] for u, h in expected.items()}
    assert load_histories_of(engine, ["u1", "u4"], after_row=floor) == {
        u: h for u, h in newer.items() if h
    }
    # compiled once per statement and dialect, whatever the number of users read
    compiled = {key for key in history_module._COMPILED if key[1] == engine.dialect.name}
    assert load_histories_of(engine, ["u1"]) == {"u1": expected["u1"]}
    assert load_histories_of(engine, ["u0", "u1", "u2", "u4"], after_row=floor)["u1"] == newer["u1"]
    assert {k for k in history_module._COMPILED if k[1] == engine.dialect.name} == compiled
    assert len(compiled) == 2


def test_a_history_read_is_an_index_only_scan_on_sqlite(tmp_path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'store.db'}")
    with engine.connect() as connection:
        plan = connection.execute(
            text(
                "EXPLAIN QUERY PLAN SELECT user_id, item_id, ts_ms, event_id, id FROM events"
                " WHERE user_id IN ('1', '2') ORDER BY user_id, ts_ms, id"
            )
        ).all()
    assert any("COVERING INDEX ix_events_user_history" in row[-1] for row in plan), plan
