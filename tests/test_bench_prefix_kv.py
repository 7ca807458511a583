"""``genrec bench prefix-kv`` on a synthetic store: coverage newest first vs by user id, and
the store's serving version, KV index and KV files untouched.

The store gets its events through ``write_events`` (the ingest path, which keeps ``users``
for the newest-first reader) and one real refresh with the refresh fakes' untrained
``tiny`` target (``tests/refresh_fakes.py``), so it has an active serving version and KV
files the bench must leave alone.
"""

from __future__ import annotations

import json
from pathlib import Path

from sqlalchemy import func, select

from genrec.app.bench.prefix_kv import choose_cutoff, run_prefix_kv_bench
from genrec.infra.database import make_engine
from genrec.infra.serving_versions import active_serving_version
from genrec.ingest.store import write_events
from genrec.offline.refresh import run_refresh
from genrec.online.prefix_kv_store import kv_root
from genrec.schemas.tables import prefix_kv_index
from tests.refresh_fakes import ITEMS, FakeSteps, make_settings, tiny_models

DAY = 86_400_000
CUTOFF_DAY = 20


def _views(user: str, days: list[float]) -> list[dict]:
    return [{"event_id": f"{user}-{day}", "user_id": user, "event_type": "view",
             "item_id": ITEMS[(len(user) * 5 + i * 3) % len(ITEMS)], "ts_ms": int(day * DAY)}
            for i, day in enumerate(days)]  # fmt: skip


def _store(tmp_path: Path):
    """u0 .. u11, u{n} last seen on day n + 8 (u11 newest, but u0, u1, u10 first by id);
    after day 20 the recent users u8 .. u11 come back, and a new user arrives."""
    settings = make_settings(tmp_path, f"sqlite:///{tmp_path / 'genrec.db'}")
    engine = make_engine(settings.database_url)
    for n in range(12):
        write_events(engine, _views(f"u{n}", [n + 8 - k * 0.1 for k in range(3 + n % 3, 0, -1)]))
    after = [(f"u{n}", CUTOFF_DAY + 1 + n * 0.01) for n in (11, 10, 9, 8)] + [("new", 22.0)]
    for user, day in after:  # one write each, in time order, as ingest would store them
        write_events(engine, _views(user, [day, day + 0.001]))
    return settings, engine


def _store_state(settings, engine) -> tuple:
    with engine.connect() as connection:
        index = connection.execute(select(func.count()).select_from(prefix_kv_index)).scalar_one()
    files = sorted(str(p) for p in kv_root(settings).rglob("*") if p.is_file())
    return active_serving_version(engine), index, files


def test_bench_prefix_kv_measures_coverage_and_leaves_the_store_alone(tmp_path: Path) -> None:
    settings, engine = _store(tmp_path)
    run_refresh(settings, engine, steps=FakeSteps())
    before = _store_state(settings, engine)
    assert before[0] is not None and before[1] > 0 and before[2]
    cutoff = choose_cutoff(engine, next_days=1.5)
    assert len(cutoff.replay_users) == 10 and cutoff.late_events == 0
    report = run_prefix_kv_bench(settings, engine, tiny_models(1), next_days=1.5,
                                 budget_fractions=(0.5, 0.25), scratch=tmp_path)  # fmt: skip
    assert _store_state(settings, engine) == before  # serving version, index and files
    assert not [p for p in tmp_path.glob("genrec-prefix-kv-*")]  # the scratch store is gone
    pairs = {(p["budget"], p["dtype"]): p for p in report["pairs"]}
    assert list(pairs) == [("unlimited", "float32"), ("unlimited", "float16"),
                           ("50%", "float16"), ("25%", "float16")]  # fmt: skip
    assert report["replay_events"] == 10 and report["replay_users"] == 5
    unlimited = pairs["unlimited", "float16"]
    assert unlimited["users_newest_first"] == 12 and unlimited["coverage_newest_first"] == 0.8
    f32 = pairs["unlimited", "float32"]["bytes_newest_first"]
    assert 0.4 * f32 < unlimited["bytes_newest_first"] < 0.6 * f32
    for budget in ("50%", "25%"):
        pair = pairs[budget, "float16"]
        assert pair["bytes_newest_first"] <= pair["budget_bytes"]
        assert 0 < pair["users_newest_first"] < 12 and 0 < pair["users_user_id"] < 12
        assert pair["coverage_newest_first"] >= pair["coverage_user_id"]
    # u8 .. u11 fit in half the bytes newest first; by id the first half is u0, u1, u10, ...
    assert pairs["50%", "float16"]["coverage_newest_first"] == 0.8
    assert pairs["50%", "float16"]["coverage_user_id"] < 0.8
    by_row = {(r["label"], r["order"]): r for r in report["rows"]}
    assert by_row["50%", "user_id"]["counts"]["reused"] == by_row["50%", "user_id"]["users_cached"]


def test_bench_prefix_kv_command_writes_table_json_and_plot(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    from genrec.app.cli import main
    from genrec.infra.settings import get_settings

    store = tmp_path / "store"
    store.mkdir()
    _store(store)[1].dispose()
    monkeypatch.setenv("GENREC_HOME", str(tmp_path / "home"))
    get_settings.cache_clear()
    try:
        code = main(["bench", "prefix-kv", "--data-dir", str(store), "--random", "--preset",
                     "tiny", "--history-items", "4", "--next-days", "1.5", "--budgets", "0.5",
                     "--out", str(tmp_path / "out")])  # fmt: skip
    finally:
        get_settings.cache_clear()
    assert code == 0
    table = capsys.readouterr().out
    assert "newest-first" in table and "unlimited float16" in table
    report = json.loads((tmp_path / "out" / "prefix_kv.json").read_text())
    assert [p["budget"] for p in report["pairs"]] == ["unlimited", "unlimited", "50%"]
    assert report["models"].startswith("random 'tiny'")
    assert (tmp_path / "out" / "prefix_kv.png").stat().st_size > 0


def test_bench_prefix_kv_uses_the_stores_trained_model(serving_home: Path, tmp_path: Path) -> None:
    """The serving version's pinned model is the one measured (a copy of the shared store)."""
    import shutil

    from genrec.app.bench.prefix_kv import bench_models
    from genrec.infra.settings import Settings

    home = tmp_path / "home"
    shutil.copytree(serving_home, home)
    settings = Settings(home=home)
    engine = make_engine(settings.database_url)
    before = _store_state(settings, engine)
    models, source = bench_models(settings, engine, "small", 50, random=False)
    assert source.startswith(f"trained model version {before[0].model_version} ")
    report = run_prefix_kv_bench(settings, engine, models, next_days=7.0,
                                 budget_fractions=(0.5,), source=source)  # fmt: skip
    assert _store_state(settings, engine) == before
    unlimited = report["pairs"][1]
    assert unlimited["users_newest_first"] > 0 and unlimited["coverage_newest_first"] > 0
    assert report["history_items"] == models.history_items == 20
