"""The prefix-KV budget: users newest first (up to the cutoff), the byte-budget cut, the
window's count, half-precision files, reuse under a budget.

Events go in through ``write_events`` (the ingest path), which keeps ``users`` as ingest
does: the newest-first reader reads it. The models are the refresh fakes' untrained
``tiny`` target (``tests/refresh_fakes.py``), so caches are computed and stored for real.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from sqlalchemy import func, select

from genrec.infra.database import make_engine
from genrec.ingest.history import count_inactive_users, load_histories_until, users_newest_first
from genrec.ingest.store import write_events
from genrec.offline.refresh import KVBudget, run_refresh
from genrec.online.prefix_kv_store import KVShape, kv_file_nbytes_bound, open_kv_store
from genrec.schemas.tables import events
from tests.refresh_fakes import ITEMS, FakeSteps, make_settings, tiny_models

DAY = 86_400_000


def _write(engine, user: str, timestamps: list[int]) -> None:
    rows = [{"event_id": f"{user}-{ts}", "user_id": user, "item_id": ITEMS[(i * 7) % len(ITEMS)],
             "event_type": "view", "ts_ms": ts} for i, ts in enumerate(timestamps)]  # fmt: skip
    write_events(engine, rows)


def _cutoff(engine) -> int:
    with engine.connect() as connection:
        return int(connection.execute(select(func.max(events.c.id))).scalar_one())


def _flat(pages) -> list[str]:
    return [user for page in pages for user in page]


def test_users_come_newest_first_by_their_events_up_to_the_cutoff(database_url: str) -> None:
    engine = make_engine(database_url)
    newest = {"a": 5, "b": 9, "c": 1, "d": 7, "e": 9, "f": 3, "g": 8}  # day of the newest event
    for user, day in newest.items():
        _write(engine, user, [0, day * DAY])
    cutoff = _cutoff(engine)
    # After the cutoff: "c" and "a" come back (their users.last_ts_ms jumps past everyone's),
    # and "late" has no event up to the cutoff at all.
    _write(engine, "c", [20 * DAY])
    _write(engine, "a", [21 * DAY])
    _write(engine, "late", [22 * DAY])
    expected = ["b", "e", "g", "d", "a", "f", "c"]  # ties (b, e at day 9) by user id
    for page_size in (1, 2, 3, 100):
        pages = list(users_newest_first(engine, until_row=cutoff, users_per_page=page_size))
        assert _flat(pages) == expected
        assert all(0 < len(page) <= page_size for page in pages)
    window = users_newest_first(engine, until_row=cutoff, users_per_page=2, active_days=2.0)
    assert _flat(window) == ["b", "e", "g", "d"]  # newest below the cutoff: day 9
    assert count_inactive_users(engine, until_row=cutoff, active_days=2.0) == 3
    histories = load_histories_until(engine, ["g", "c", "late"], until_row=cutoff)
    assert list(histories) == ["g", "c"]  # in the order asked; "late" has nothing yet
    assert [e.ts_ms for e in histories["c"]] == [0, DAY]  # the event after the cutoff is not read
    assert list(users_newest_first(engine, until_row=0, users_per_page=5, active_days=1.0)) == []


def test_budget_admits_until_the_first_user_that_does_not_fit() -> None:
    budget = KVBudget.from_mb(100 / 2**20)  # 100 bytes
    assert budget.admit(60) and budget.admit(40)
    assert not budget.admit(1) and budget.full
    assert not budget.admit(0)  # closed for good: newest first, no gap filling
    budget = KVBudget(limit_bytes=100)
    assert budget.admit(70)
    budget.settle(admitted_bytes=70, stored_bytes=50)  # the store's size replaces the bound
    assert budget.used_bytes == 50 and budget.admit(50) and not budget.admit(1)
    assert KVBudget.from_mb(None).admit(10**15)


N_USERS = 12


def _store_of_12_users(tmp_path: Path, **refresh):
    """u0 .. u11, u{n}'s newest event on day n (u11 newest); 3 + n % 4 events each."""
    settings = make_settings(tmp_path, f"sqlite:///{tmp_path / 'genrec.db'}", **refresh)
    engine = make_engine(settings.database_url)
    for n in range(N_USERS):
        _write(engine, f"u{n}", [n * DAY - k * 1000 for k in range(3 + n % 4, 0, -1)])
    return settings, engine


def _cached(settings, engine, version: int) -> dict[str, int]:
    return open_kv_store(settings, engine).user_sizes(version)


def test_refresh_under_a_budget_keeps_the_newest_users(tmp_path: Path) -> None:
    settings, engine = _store_of_12_users(tmp_path)
    full = run_refresh(settings, engine, steps=FakeSteps())
    sizes = _cached(settings, engine, full.kv_version)
    assert len(sizes) == N_USERS and full.counts["kv"]["skipped_budget"] == 0
    # A fresh store and a budget that holds the 5 newest users' files and part of a 6th
    newest_5 = sum(sizes[f"u{n}"] for n in range(7, 12))
    budget = newest_5 + sizes["u6"] // 2
    settings, engine = _store_of_12_users(tmp_path / "b", kv_budget_mb=budget / 2**20,
                                          kv_users_per_read=4, kv_batch_size=2)  # fmt: skip
    report = run_refresh(settings, engine, steps=FakeSteps())
    kv = report.counts["kv"]
    cached = _cached(settings, engine, report.kv_version)
    # Admitted by the bound (a few hundred bytes above each file): at least 4, at most 5
    assert set(cached) in ({f"u{n}" for n in range(7, 12)}, {f"u{n}" for n in range(8, 12)})
    assert kv["total_bytes"] == sum(cached.values()) <= kv["budget_bytes"] == budget
    assert kv["users"] == kv["computed"] == len(cached)
    assert kv["skipped_budget"] == N_USERS - len(cached) and kv["skipped_window"] == 0
    assert cached == {user: sizes[user] for user in cached}  # same files, same sizes


def test_reused_caches_count_against_the_budget(tmp_path: Path) -> None:
    settings, engine = _store_of_12_users(tmp_path)
    first = run_refresh(settings, engine, steps=FakeSteps())
    sizes = _cached(settings, engine, first.kv_version)
    budget = sum(sizes[f"u{n}"] for n in range(6, 12))  # exactly the 6 newest files
    limited = settings.model_copy(update={"refresh": settings.refresh.model_copy(
        update={"kv_budget_mb": budget / 2**20})})  # fmt: skip
    report = run_refresh(limited, engine, steps=FakeSteps())
    kv = report.counts["kv"]
    # Reused files are admitted by their recorded size: exactly the 6 newest fit
    assert set(_cached(settings, engine, report.kv_version)) == {f"u{n}" for n in range(6, 12)}
    assert kv["reused"] == 6 and kv["computed"] == 0 and kv["skipped_budget"] == 6
    assert kv["total_bytes"] == budget


def test_window_skips_are_counted(tmp_path: Path) -> None:
    settings, engine = _store_of_12_users(tmp_path, active_days=3.5, kv_budget_mb=1.0)
    kv = run_refresh(settings, engine, steps=FakeSteps()).counts["kv"]
    assert (kv["users"], kv["skipped_window"], kv["skipped_budget"]) == (4, 8, 0)  # days 8-11
    settings, engine = _store_of_12_users(tmp_path / "b", active_days=3.5)  # no budget
    kv = run_refresh(settings, engine, steps=FakeSteps()).counts["kv"]
    assert (kv["users"], kv["skipped_window"], kv["skipped_budget"]) == (4, 8, 0)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_caches_are_stored_in_kv_dtype_and_bounded(tmp_path: Path, dtype: str) -> None:
    settings, engine = _store_of_12_users(tmp_path, kv_dtype=dtype)
    report = run_refresh(settings, engine, steps=FakeSteps())
    store = open_kv_store(settings, engine)
    shape = KVShape.of(tiny_models(1).target)
    itemsize = getattr(torch, dtype).itemsize
    for user in ("u0", "u11"):
        entry = store.lookup(report.kv_version, user)
        prefix_kv = store.load(entry, expected_model_version=report.model_version)
        assert {t.dtype for t in prefix_kv.keys + prefix_kv.values} == {getattr(torch, dtype)}
        data = shape.tensor_bytes(entry.n_tokens, itemsize)
        bound = kv_file_nbytes_bound(shape, entry.n_tokens, itemsize, report.model_version)
        assert data < entry.nbytes <= bound <= entry.nbytes + 512
    assert report.counts["kv"]["dtype"] == dtype


def test_a_changed_kv_dtype_recomputes_instead_of_reusing(tmp_path: Path) -> None:
    settings, engine = _store_of_12_users(tmp_path, kv_dtype="float32")
    first = run_refresh(settings, engine, steps=FakeSteps())
    half = settings.model_copy(update={"refresh": settings.refresh.model_copy(
        update={"kv_dtype": "float16"})})  # fmt: skip
    second = run_refresh(half, engine, steps=FakeSteps())
    assert (second.counts["kv"]["reused"], second.counts["kv"]["computed"]) == (0, N_USERS)
    assert second.counts["kv"]["total_bytes"] < 0.75 * first.counts["kv"]["total_bytes"]
    third = run_refresh(half, engine, steps=FakeSteps())
    assert (third.counts["kv"]["reused"], third.counts["kv"]["computed"]) == (N_USERS, 0)
