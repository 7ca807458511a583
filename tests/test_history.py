"""The one reader of stored histories (ingest/history.py): order, cuts, pages and user sets."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import Engine, func, insert, select

from genrec.infra.database import make_engine
from genrec.ingest.history import (
    History,
    HistoryEvent,
    history_pages,
    load_histories_of,
    load_item_ids,
    load_user_histories,
)
from genrec.schemas.tables import events

DAY_MS = 86_400_000


def add_events(engine: Engine, rows: list[tuple[str, str, str, int]]) -> None:
    """``(event_id, user_id, item_id, ts_ms)`` rows, inserted in the given order."""
    with engine.begin() as connection:
        connection.execute(
            insert(events),
            [
                {"event_id": e, "user_id": u, "item_id": i, "event_type": "view", "ts_ms": t}
                for e, u, i, t in rows
            ],
        )


def newest_row(engine: Engine) -> int:
    with engine.connect() as connection:
        return int(connection.execute(select(func.max(events.c.id))).scalar_one())


@pytest.fixture
def engine(tmp_path: Path) -> Engine:
    return make_engine(f"sqlite:///{tmp_path / 'store.db'}")


def test_ml100k_histories_are_stably_time_ordered(ml100k_engine):
    histories = load_user_histories(ml100k_engine)
    assert len(histories) == 943
    assert sum(len(h) for h in histories.values()) == 100_000
    assert len(load_item_ids(ml100k_engine)) == 1682
    for history in histories.values():
        stamps = [event.ts_ms for event in history]
        assert stamps == sorted(stamps)
        # ties keep file order: event ids carry the source file row
        for a, b in zip(history, history[1:], strict=False):
            if a.ts_ms == b.ts_ms:
                assert int(a.event_id.rsplit("-", 1)[1]) < int(b.event_id.rsplit("-", 1)[1])


def test_every_reader_gives_the_same_events_with_their_rows(engine) -> None:
    # inserted out of time order; the same-second pair keeps insertion order
    add_events(engine, [("a3", "u1", "9", 3000), ("a1", "u1", "7", 1000), ("b1", "u2", "5", 500),
                        ("a2", "u1", "8", 3000)])  # fmt: skip
    expected = [HistoryEvent("7", 1000, "a1", 2), HistoryEvent("9", 3000, "a3", 1),
                HistoryEvent("8", 3000, "a2", 4)]  # fmt: skip
    assert load_user_histories(engine)["u1"] == expected
    assert load_histories_of(engine, ["u1", "u1"]) == {"u1": expected}
    [page] = history_pages(engine, until_row=newest_row(engine), users_per_page=10)
    assert page == {"u1": expected, "u2": [HistoryEvent("5", 500, "b1", 3)]}


def test_histories_up_to_a_time(engine) -> None:
    add_events(engine, [("a1", "u1", "7", 1000), ("a2", "u1", "8", 2000), ("b1", "u2", "5", 3000)])
    histories = load_user_histories(engine, until_ts_ms=2000)
    assert {u: [e.item_id for e in h] for u, h in histories.items()} == {"u1": ["7", "8"]}
    assert load_item_ids(engine) == ["5", "7", "8"]  # items of every event, whatever the time


def test_histories_within_the_newest_events(engine) -> None:
    """``newest_events`` keeps the store's newest rows (by events.id), whatever their time;
    a window at least the store's size keeps everything, and pages cut by time match."""
    add_events(engine, [("a1", "u1", "7", 1000), ("b1", "u2", "5", 900), ("a2", "u1", "8", 2000),
                        ("c1", "u3", "6", 800)])  # fmt: skip
    window = load_user_histories(engine, newest_events=2)
    assert {u: [e.item_id for e in h] for u, h in window.items()} == {"u1": ["8"], "u3": ["6"]}
    assert load_user_histories(engine, newest_events=4) == load_user_histories(engine)
    assert load_user_histories(engine, newest_events=10**6) == load_user_histories(engine)
    with pytest.raises(ValueError):
        load_user_histories(engine, newest_events=0)
    pages = list(history_pages(engine, until_ts_ms=900, users_per_page=1))
    assert pages == [{"u2": load_user_histories(engine)["u2"]}, {"u3": window["u3"]}]


def test_a_set_of_users_keeps_only_their_newest_events(engine) -> None:
    add_events(engine, [(f"a{n}", "u1", str(n), n * 1000) for n in range(9)])
    add_events(engine, [("b1", "u2", "5", 500), ("c1", "u3", "6", 600)])
    histories = load_histories_of(engine, ["u1", "u2", "nobody"], newest=3)
    assert sorted(histories) == ["u1", "u2"]
    assert [e.item_id for e in histories["u1"]] == ["6", "7", "8"]
    assert [e.item_id for e in histories["u2"]] == ["5"]
    for newest in (1, 2, 4, 5, 9, 10):  # below, at and above the trimming points
        kept = load_histories_of(engine, ["u1"], newest=newest)["u1"]
        assert [e.item_id for e in kept] == [str(n) for n in range(9)][-newest:]
    assert load_histories_of(engine, []) == {}
    with pytest.raises(ValueError, match="newest"):
        load_histories_of(engine, ["u1"], newest=0)


def test_pages_of_users_below_a_row_cutoff_skip_inactive_ones(engine) -> None:
    users = [f"u{n:02d}" for n in range(12)]
    add_events(engine, [(f"{u}-{n}", u, str(n), n * 1000) for u in users for n in range(3)])
    add_events(engine, [(f"{u}-late-{n}", u, str(n), 10 * DAY_MS + n) for u in users[::2]
                        for n in range(2)])  # fmt: skip
    cutoff = newest_row(engine)
    pages = list(history_pages(engine, until_row=cutoff, users_per_page=5))
    assert [len(page) for page in pages] == [5, 5, 2]
    assert [user for page in pages for user in page] == users  # user-id order
    assert all(len(page[u]) in (3, 5) for page in pages for u in page)
    # the last day only: inactive users inside a page's id range are left out
    active = history_pages(engine, until_row=cutoff, users_per_page=4, active_days=1.0)
    assert [user for page in active for user in page] == users[::2]
    # events above the cutoff row are not read
    [first] = history_pages(engine, until_row=3, users_per_page=5)
    assert first == {"u00": load_user_histories(engine)["u00"][:3]}
    assert list(history_pages(engine, until_row=0, users_per_page=4, active_days=1.0)) == []


def test_a_history_holds_columns_and_reads_as_events() -> None:
    events_in = [HistoryEvent("i1", 20, "e1", 1), HistoryEvent("i2", 10, "e2", None),
                 HistoryEvent("i3", 20, "e3", 3)]  # fmt: skip
    history = History.of(events_in)
    assert history == events_in and list(history) == events_in and len(history) == 3
    assert history.item_ids == ("i1", "i2", "i3") and history.rows == (1, None, 3)
    assert history[1] == events_in[1] and history[-1].event_id == "e3"
    assert history[1:] == events_in[1:] and isinstance(history[1:], History)
    assert history + [HistoryEvent("i4", 5, "e4", None)] == [*events_in, ("i4", 5, "e4", None)]
    # stable: the two events at 20 keep their order
    assert history.in_time_order().event_ids == ("e2", "e1", "e3")
    in_order = history.in_time_order().in_time_order()
    assert in_order.in_time_order() is in_order and History.of(in_order) is in_order
    assert History.of([]) == [] and not History()
    with pytest.raises(ValueError, match="same length"):
        History(("i1",), (1,), (), ())


def test_stored_histories_are_columns_the_garbage_collector_lets_go(engine) -> None:
    """A user's history is one tracked object: its columns are plain tuples of strings and
    ints, which the cyclic collector untracks (a list of named tuples stays tracked)."""
    import gc

    add_events(engine, [(f"e{i}", "u1", f"i{i}", 1000 + i) for i in range(50)])
    history = load_histories_of(engine, ["u1"])["u1"]
    gc.collect()
    columns = (history.item_ids, history.ts_ms, history.event_ids, history.rows)
    assert not any(gc.is_tracked(column) for column in columns)
    assert [e.event_id for e in history] == [f"e{i}" for i in range(50)]
