"""Scheduling: a persistent job store that survives restarts, coalesced missed runs,
JSON (not pickle) job state, SIGTERM, and the cross-process single-run lock."""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from apscheduler.triggers.cron import CronTrigger
from apscheduler.triggers.interval import IntervalTrigger
from sqlalchemy import create_engine, text

from genrec.infra.database import make_engine
from genrec.infra.settings import Settings, get_settings
from genrec.offline.refresh import LOCK_NAME, run_refresh
from genrec.offline.run_lock import LockBusy, RunLock
from genrec.offline.schedule import (
    JOB_ID,
    JOBS_TABLE,
    JsonSQLAlchemyJobStore,
    build_scheduler,
    ensure_refresh_job,
    scheduled_refresh,
)

FUNC = f"{__name__}:record_run"  # the scheduler imports the job by module path
CALLS: list[float] = []
RAN = threading.Event()


def record_run() -> None:
    CALLS.append(time.time())
    RAN.set()


def _settings(tmp_path: Path, **refresh) -> Settings:
    return Settings(home=tmp_path, refresh={"interval_minutes": 60, **refresh})


def _started(settings: Settings):
    scheduler = build_scheduler(settings)
    scheduler.start(paused=True)
    return scheduler


def _stored_then_down(settings: Settings, missed: dt.timedelta) -> None:
    """Store the job, stop the scheduler, then move its next run into the past (downtime)."""
    scheduler = _started(settings)
    ensure_refresh_job(scheduler, settings, FUNC)
    scheduler.shutdown()
    store = JsonSQLAlchemyJobStore(engine=make_engine(settings.database_url), tablename=JOBS_TABLE)
    store.start(None, "default")
    job = store.lookup_job(JOB_ID)
    job.next_run_time = dt.datetime.now(dt.UTC) - missed
    store.update_job(job)
    store.shutdown()


def _wait_until(condition, limit_s: float = 120.0) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.1)


def test_schedule_survives_a_restart_without_duplicates(tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    first = _started(settings)
    next_run = ensure_refresh_job(first, settings, FUNC).next_run_time
    first.shutdown()

    second = _started(settings)  # a restart: same database, same settings
    (stored,) = second.get_jobs()
    assert stored.id == JOB_ID and stored.next_run_time == next_run
    assert isinstance(stored.trigger, IntervalTrigger) and stored.coalesce
    assert stored.max_instances == 1
    assert ensure_refresh_job(second, settings, FUNC).next_run_time == next_run  # kept
    second.shutdown()

    changed = _settings(tmp_path, cron="0 3 * * *")
    third = _started(changed)
    job = ensure_refresh_job(third, changed, FUNC)
    assert isinstance(job.trigger, CronTrigger) and (job.next_run_time.hour, job.next_run_time.minute) == (3, 0)  # fmt: skip
    assert [j.id for j in third.get_jobs()] == [JOB_ID]
    third.shutdown()


def test_job_state_is_json_not_pickle(tmp_path: Path) -> None:
    settings = _settings(tmp_path, cron="15 */6 * * mon-fri")
    scheduler = _started(settings)
    ensure_refresh_job(scheduler, settings, FUNC)
    scheduler.shutdown()
    engine = create_engine(settings.database_url)
    with engine.connect() as connection:
        (raw,) = connection.execute(text(f"select job_state from {JOBS_TABLE}")).one()
    state = json.loads(bytes(raw))
    assert state["func"] == FUNC and state["coalesce"] is True
    assert state["trigger"]["type"] == "cron"
    assert state["trigger"]["fields"]["day_of_week"] == "mon-fri"


def test_missed_runs_are_coalesced_into_one(tmp_path: Path) -> None:
    settings = _settings(tmp_path)  # hourly, grace 6 h
    _stored_then_down(settings, missed=dt.timedelta(hours=5))  # 5 hourly runs missed
    CALLS.clear()
    RAN.clear()
    up = _started(settings)
    ensure_refresh_job(up, settings, FUNC)
    up.resume()
    assert RAN.wait(120)
    now = dt.datetime.now(dt.UTC)
    _wait_until(lambda: up.get_job(JOB_ID).next_run_time > now)
    up.shutdown(wait=True)
    assert len(CALLS) == 1


def test_runs_missed_beyond_the_grace_time_are_skipped(tmp_path: Path) -> None:
    settings = _settings(tmp_path, misfire_grace_s=60)
    _stored_then_down(settings, missed=dt.timedelta(minutes=150))  # last one 30 min late
    CALLS.clear()
    up = _started(settings)
    ensure_refresh_job(up, settings, FUNC)
    up.resume()
    now = dt.datetime.now(dt.UTC)
    _wait_until(lambda: up.get_job(JOB_ID).next_run_time > now)
    up.shutdown(wait=True)
    assert CALLS == []


def test_bad_schedule_settings_are_refused(tmp_path: Path) -> None:
    settings = _settings(tmp_path, cron="every day")
    scheduler = _started(settings)
    with pytest.raises(ValueError, match="refresh.cron"):
        ensure_refresh_job(scheduler, settings, FUNC)
    scheduler.shutdown()


# --- the cross-process lock -------------------------------------------------------------

HOLDER = """
import sys, time
from genrec.infra.database import make_engine
from genrec.offline.run_lock import RunLock
lock = RunLock(make_engine(sys.argv[1]), sys.argv[2], lease_s=float(sys.argv[3]))
lock.acquire()
print("held", flush=True)
time.sleep(3600)
"""


def _hold_in_child(database_url: str, lease_s: float) -> subprocess.Popen:
    child = subprocess.Popen(
        [sys.executable, "-c", HOLDER, database_url, LOCK_NAME, str(lease_s)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout.readline().strip() == "held"
    return child


def test_only_one_refresh_runs_across_processes(tmp_path: Path, database_url: str) -> None:
    engine = make_engine(database_url)
    child = _hold_in_child(database_url, lease_s=5.0)
    try:
        time.sleep(6.0)  # longer than the lease: the live holder's heartbeat keeps it
        assert not RunLock(engine, LOCK_NAME, lease_s=5).try_acquire()
        settings = Settings(home=tmp_path, database_url=database_url)
        with pytest.raises(LockBusy, match="held by"):
            run_refresh(settings, engine)
    finally:
        os.kill(child.pid, signal.SIGKILL)  # a killed holder: its lease simply runs out
        child.wait()
    lock = RunLock(engine, LOCK_NAME, lease_s=5)
    lock.acquire(wait_s=60, poll_s=0.2)
    assert lock.holder()[0] == lock.owner
    lock.release()
    assert lock.holder()[0] is None


def test_scheduled_run_skips_while_another_process_refreshes(tmp_path: Path, monkeypatch) -> None:
    database_url = f"sqlite:///{tmp_path / 'genrec.db'}"
    make_engine(database_url)
    child = _hold_in_child(database_url, lease_s=30.0)
    monkeypatch.setenv("GENREC_HOME", str(tmp_path))
    monkeypatch.setenv("GENREC_DATABASE_URL", database_url)
    get_settings.cache_clear()
    try:
        assert scheduled_refresh() == "skipped"
    finally:
        get_settings.cache_clear()
        os.kill(child.pid, signal.SIGKILL)
        child.wait()


def test_schedule_command_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    database_url = f"sqlite:///{tmp_path / 'genrec.db'}"
    env = {**os.environ, "GENREC_HOME": str(tmp_path), "GENREC_DATABASE_URL": database_url}
    genrec = Path(sys.executable).with_name("genrec")
    command = [str(genrec), "offline", "schedule", "--interval-minutes", "30"]
    process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    engine = create_engine(database_url)

    def job_stored() -> bool:
        assert process.poll() is None, process.stderr.read()
        with engine.connect() as connection:
            tables = connection.execute(text("select name from sqlite_master")).scalars().all()
            if JOBS_TABLE not in tables:
                return False
            return connection.execute(text(f"select id from {JOBS_TABLE}")).first() is not None

    _wait_until(job_stored)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=120) == 0
    with engine.connect() as connection:
        assert connection.execute(text(f"select id from {JOBS_TABLE}")).scalars().all() == [JOB_ID]
