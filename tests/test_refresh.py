"""The offline refresh run: activation, reuse, failures between steps, locking, recovery.

Semantic-ID building and training are replaced by recording fakes
(``tests/refresh_fakes.py``); the models are a real (untrained) ``tiny`` preset
target and the prefix KV is computed and stored for real. ``test_refresh_kill.py``
kills a real refresh process.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
from sqlalchemy import insert, select, update

from genrec.infra.database import make_engine
from genrec.infra.serving_versions import active_serving_version
from genrec.offline.refresh import RefreshCancelled, run_refresh
from genrec.offline.run_lock import LockBusy, RunLock
from genrec.online.prefix_kv_store import kv_root, open_kv_store
from genrec.schemas.tables import events, job_locks, job_runs, serving_versions
from tests.refresh_fakes import (
    LAYOUT,
    USERS,
    FakeSteps,
    InjectedFailure,
    add_events,
    assert_serves,
    make_settings,
    runs,
)


@pytest.fixture
def sqlite_setup(tmp_path: Path):
    settings = make_settings(tmp_path, f"sqlite:///{tmp_path / 'genrec.db'}")
    engine = make_engine(settings.database_url)
    add_events(engine, range(USERS), per_user=8)
    return settings, engine


def test_refresh_builds_activates_and_records(tmp_path: Path, database_url: str) -> None:
    settings = make_settings(tmp_path, database_url)
    engine = make_engine(database_url)
    add_events(engine, range(USERS), per_user=8)
    steps = FakeSteps()
    report = run_refresh(settings, engine, steps=steps, trigger="test")
    # incremental IDs, no training by default, recall branches refitted
    assert steps.calls == [("semantic_ids", False), ("recall",)]
    assert_serves(settings, engine, report.serving_version, "1")
    assert report.semantic_id_version == 5
    (run,) = runs(engine)
    assert run["status"] == "succeeded" and run["error"] is None
    assert run["started_at"] is not None and run["finished_at"] is not None
    assert run["counts"]["events_total"] == USERS * 8
    assert run["counts"]["kv"]["users"] == USERS and run["counts"]["kv"]["computed"] == USERS
    assert run["counts"]["kv"]["total_bytes"] > 0
    assert Path(run["counts"]["kv_size_plot"]).exists()
    # The cutoff is each user's newest stored event; the prompt is its last H items.
    store = open_kv_store(settings, engine)
    entry = store.lookup(report.kv_version, "u3")
    with engine.connect() as connection:
        newest = connection.execute(
            select(events.c.id, events.c.event_id)
            .where(events.c.user_id == "u3")
            .order_by(events.c.id.desc())
            .limit(1)  # fmt: skip
        ).one()
    assert (entry.cutoff_event_row, entry.cutoff_event_id) == (newest.id, newest.event_id)
    assert entry.n_tokens == 1 + 6 * LAYOUT.depth


def test_next_refresh_reuses_unchanged_users_and_collects_old_versions(sqlite_setup) -> None:
    settings, engine = sqlite_setup
    first = run_refresh(settings, engine, steps=FakeSteps())
    add_events(engine, range(3), per_user=2, start_ts=100_000)  # three users act again
    second = run_refresh(settings, engine, steps=FakeSteps())
    kv = runs(engine)[-1]["counts"]["kv"]
    assert (kv["computed"], kv["reused"]) == (3, USERS - 3)
    assert runs(engine)[-1]["counts"]["events_new"] == 6
    assert_serves(settings, engine, second.serving_version, "1")
    entry = open_kv_store(settings, engine).lookup(second.kv_version, "u0")
    assert entry.cutoff_ts_ms == 101_000
    root = kv_root(settings)
    assert (root / f"v{first.kv_version:06d}").exists()  # keep_versions=2: previous kept
    third = run_refresh(settings, engine, steps=FakeSteps())
    assert not (root / f"v{first.kv_version:06d}").exists()
    assert open_kv_store(settings, engine).lookup(first.kv_version, "u0") is None
    assert sorted(p.name for p in root.iterdir()) == [
        f"v{second.kv_version:06d}", f"v{third.kv_version:06d}"
    ]  # fmt: skip


def test_retraining_realigns_drafts_and_recomputes_every_user(sqlite_setup) -> None:
    settings, engine = sqlite_setup
    run_refresh(settings, engine, steps=FakeSteps())
    steps = FakeSteps()
    retrain = settings.model_copy(
        update={"refresh": settings.refresh.model_copy(update={"retrain_target": True})}
    )
    report = run_refresh(retrain, engine, steps=steps)
    assert steps.calls == [("semantic_ids", False), ("train", True), ("recall",)]
    assert runs(engine)[-1]["counts"]["trained"] == "target+drafts"
    assert runs(engine)[-1]["counts"]["kv"]["computed"] == USERS  # new model: nothing reused
    assert_serves(settings, engine, report.serving_version, "2")
    full = retrain.model_copy(update={"refresh": retrain.refresh.model_copy(
        update={"retrain_target": False, "full_semantic_ids": True})})  # fmt: skip
    steps = FakeSteps()
    run_refresh(full, engine, steps=steps)
    # new IDs: a new target
    assert steps.calls == [("semantic_ids", True), ("train", True), ("recall",)]
    # The fake steps write no model rows: collection runs and finds nothing (test_artifact_gc)
    assert runs(engine)[-1]["counts"]["model_versions_collected"] == 0


@pytest.mark.parametrize(
    "fail_at", ["read", "semantic_ids", "load_models", "prefix_kv_batch", "prefix_kv"]
)
def test_failure_between_steps_keeps_the_previous_version(sqlite_setup, fail_at: str) -> None:
    settings, engine = sqlite_setup
    good = run_refresh(settings, engine, steps=FakeSteps())
    add_events(engine, range(USERS), per_user=1, start_ts=500_000)
    with pytest.raises(InjectedFailure):
        run_refresh(settings, engine, steps=FakeSteps(fail_at=fail_at, model_version=2))
    assert_serves(settings, engine, good.serving_version, "1")
    failed = runs(engine)[-1]
    assert failed["status"] == "failed" and "injected after" in failed["error"]
    assert failed["finished_at"] is not None
    with engine.connect() as connection:
        statuses = connection.execute(
            select(serving_versions.c.status).order_by(serving_versions.c.version)
        ).scalars().all()  # fmt: skip
    assert statuses == ["active", "failed"]
    store = open_kv_store(settings, engine)
    assert store.sizes(good.serving_version + 1)["users"] == 0  # nothing half-written left
    assert sorted(p.name for p in kv_root(settings).iterdir()) == [f"v{good.kv_version:06d}"]
    after = run_refresh(settings, engine, steps=FakeSteps(model_version=2))  # and it recovers
    assert_serves(settings, engine, after.serving_version, "2")


def test_failure_keeps_the_previous_version_on_both_databases(
    tmp_path: Path, database_url: str
) -> None:
    settings = make_settings(tmp_path, database_url)
    engine = make_engine(database_url)
    add_events(engine, range(USERS), per_user=8)
    good = run_refresh(settings, engine, steps=FakeSteps())
    with pytest.raises(InjectedFailure):
        run_refresh(settings, engine, steps=FakeSteps(fail_at="prefix_kv_batch", model_version=2))
    assert_serves(settings, engine, good.serving_version, "1")
    assert [r["status"] for r in runs(engine)] == ["succeeded", "failed"]


def test_a_run_that_lost_its_lock_never_activates(sqlite_setup) -> None:
    settings, engine = sqlite_setup
    good = run_refresh(settings, engine, steps=FakeSteps())
    steps = FakeSteps(model_version=2)

    def steal_lock(name: str) -> None:
        if name == "prefix_kv":  # as if our lease had expired and another run took over
            with engine.begin() as connection:
                connection.execute(update(job_locks).values(owner="thief", expires_ms=2**62))

    steps.checkpoint = steal_lock
    with pytest.raises(RefreshCancelled, match="lost its lock"):
        run_refresh(settings, engine, steps=steps)
    assert_serves(settings, engine, good.serving_version, "1")
    assert runs(engine)[-1]["status"] == "failed"


def test_cancel_stops_at_the_next_batch(sqlite_setup) -> None:
    settings, engine = sqlite_setup
    good = run_refresh(settings, engine, steps=FakeSteps())
    cancel = __import__("threading").Event()
    steps = FakeSteps(model_version=2)
    steps.checkpoint = lambda name: cancel.set() if name == "prefix_kv_batch" else None
    with pytest.raises(RefreshCancelled):
        run_refresh(settings, engine, steps=steps, cancel=cancel)
    assert_serves(settings, engine, good.serving_version, "1")


def test_a_second_run_is_refused_while_one_holds_the_lock(sqlite_setup) -> None:
    settings, engine = sqlite_setup
    with RunLock(engine, "offline-refresh", lease_s=30):
        with pytest.raises(LockBusy, match="held by"):
            run_refresh(settings, engine, steps=FakeSteps())
    assert runs(engine) == []
    run_refresh(settings, engine, steps=FakeSteps())


def test_leftovers_of_a_dead_run_are_marked_and_collected(sqlite_setup) -> None:
    settings, engine = sqlite_setup
    now = dt.datetime.now(dt.UTC)
    with engine.begin() as connection:
        connection.execute(insert(job_runs).values(job="refresh", status="running", started_at=now))
        connection.execute(insert(serving_versions).values(status="building", created_at=now))
    orphan = kv_root(settings) / "v000001" / "ab"
    orphan.mkdir(parents=True)
    (orphan / ".x.safetensors.1.partial").write_bytes(b"half")
    report = run_refresh(settings, engine, steps=FakeSteps())
    assert [r["status"] for r in runs(engine)] == ["abandoned", "succeeded"]
    assert report.serving_version == 2
    assert sorted(p.name for p in kv_root(settings).iterdir()) == ["v000002"]


def test_refresh_without_kv_step_activates_models_only(sqlite_setup) -> None:
    settings, engine = sqlite_setup
    no_kv = settings.model_copy(
        update={"refresh": settings.refresh.model_copy(update={"precompute_kv": False})}
    )
    report = run_refresh(no_kv, engine, steps=FakeSteps())
    active = active_serving_version(engine)
    assert active.version == report.serving_version and active.kv_version is None


def test_cli_status_lists_runs(sqlite_setup, monkeypatch, capsys) -> None:
    settings, engine = sqlite_setup
    run_refresh(settings, engine, steps=FakeSteps())
    from genrec.app import cli
    from genrec.infra.settings import get_settings

    monkeypatch.setenv("GENREC_HOME", str(settings.home))
    monkeypatch.setenv("GENREC_DATABASE_URL", settings.database_url)
    get_settings.cache_clear()
    try:
        assert cli.main(["offline", "refresh", "--status"]) == 0
    finally:
        get_settings.cache_clear()
    out = capsys.readouterr().out
    assert '"status": "succeeded"' in out and '"kv_version": 1' in out


def test_first_refresh_of_a_store_without_models_trains_them(sqlite_setup) -> None:
    settings, engine = sqlite_setup
    steps = FakeSteps(has_model=False)
    run_refresh(settings, engine, steps=steps)
    assert ("train", True) in steps.calls and ("recall",) in steps.calls
