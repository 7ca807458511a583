"""Scheduled refreshes (offline step): ``genrec offline schedule`` runs APScheduler 3.

The schedule lives in the genrec database (APScheduler's ``apscheduler_jobs``
table), so it survives a restart: the stored job keeps its next run time, and
runs missed while nothing was running are coalesced into one (if missed by
less than ``refresh.misfire_grace_s``). The job id is fixed; a restart with the
same settings keeps the stored job, changed settings replace it. Job state is
stored as JSON, not pickle, so nothing is unpickled from the database.

At most one refresh runs at a time: ``max_instances=1`` within a process, and
the database lock of ``run_refresh`` across processes (a second scheduler on
the same database skips the run and logs that another holds the lock).
SIGTERM/SIGINT stop the scheduler; a refresh in progress is cancelled at its
next batch and leaves the previous version serving.

Example::

    $ GENREC_REFRESH__CRON="0 3 * * *" genrec offline schedule
    $ genrec offline schedule --interval-minutes 60 --run-now
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import signal
import threading
from typing import Any

from apscheduler.job import Job
from apscheduler.jobstores.base import ConflictingIdError, JobLookupError
from apscheduler.jobstores.sqlalchemy import SQLAlchemyJobStore
from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.triggers.cron import CronTrigger
from apscheduler.triggers.interval import IntervalTrigger
from apscheduler.util import datetime_to_utc_timestamp, ref_to_obj

from genrec.infra.database import make_engine
from genrec.infra.settings import get_settings
from genrec.offline.refresh import run_refresh
from genrec.offline.run_lock import LockBusy

log = logging.getLogger(__name__)

JOB_ID = "genrec-offline-refresh"
JOB_FUNC = "genrec.offline.schedule:scheduled_refresh"
JOBS_TABLE = "apscheduler_jobs"

# Set by SIGTERM: the refresh in progress stops at its next batch.
_cancel = threading.Event()


# --- JSON job store -------------------------------------------------------------------


class JsonSQLAlchemyJobStore(SQLAlchemyJobStore):
    """APScheduler's SQLAlchemy job store with JSON job state instead of pickle."""

    def add_job(self, job: Job) -> None:
        row = {
            "id": job.id,
            "next_run_time": datetime_to_utc_timestamp(job.next_run_time),
            "job_state": encode_job(job),
        }
        from sqlalchemy.exc import IntegrityError

        with self.engine.begin() as connection:
            try:
                connection.execute(self.jobs_t.insert().values(**row))
            except IntegrityError as exc:
                raise ConflictingIdError(job.id) from exc

    def update_job(self, job: Job) -> None:
        statement = (
            self.jobs_t.update()
            .values(
                next_run_time=datetime_to_utc_timestamp(job.next_run_time),
                job_state=encode_job(job),
            )
            .where(self.jobs_t.c.id == job.id)
        )
        with self.engine.begin() as connection:
            if connection.execute(statement).rowcount == 0:
                raise JobLookupError(job.id)

    def _reconstitute_job(self, job_state: bytes) -> Job:
        state = decode_job_state(job_state)
        state["jobstore"] = self
        job = Job.__new__(Job)
        job.__setstate__(state)
        job._scheduler = self._scheduler
        job._jobstore_alias = self._alias
        return job


def encode_job(job: Job) -> bytes:
    """A job's state as JSON bytes; its args and kwargs must be JSON values."""
    state = job.__getstate__()
    state["trigger"] = trigger_to_json(state["trigger"])
    state["next_run_time"] = _iso(state["next_run_time"])
    state["args"] = list(state["args"])
    try:
        return json.dumps(state, sort_keys=True).encode("utf-8")
    except TypeError as exc:
        raise ValueError(f"job {job.id!r}: arguments must be JSON values ({exc})") from exc


def decode_job_state(job_state: bytes) -> dict[str, Any]:
    state = json.loads(bytes(job_state).decode("utf-8"))
    state["trigger"] = trigger_from_json(state["trigger"])
    state["next_run_time"] = _from_iso(state["next_run_time"])
    state["args"] = tuple(state["args"])
    return state


def trigger_to_json(trigger) -> dict[str, Any]:
    common = {
        "timezone": str(trigger.timezone),
        "start_date": _iso(trigger.start_date),
        "end_date": _iso(trigger.end_date),
        "jitter": trigger.jitter,
    }
    if isinstance(trigger, IntervalTrigger):
        return {"type": "interval", "seconds": trigger.interval.total_seconds(), **common}
    if isinstance(trigger, CronTrigger):
        fields = {f.name: str(f) for f in trigger.fields if not f.is_default}
        return {"type": "cron", "fields": fields, **common}
    raise ValueError(f"cannot store trigger {trigger!r}: only interval and cron triggers")


def trigger_from_json(spec: dict[str, Any]):
    common = {
        "timezone": spec["timezone"],
        "start_date": _from_iso(spec["start_date"]),
        "end_date": _from_iso(spec["end_date"]),
        "jitter": spec["jitter"],
    }
    if spec["type"] == "interval":
        return IntervalTrigger(seconds=spec["seconds"], **common)
    if spec["type"] == "cron":
        return CronTrigger(**spec["fields"], **common)
    raise ValueError(f"unknown stored trigger type {spec['type']!r}")


def _iso(value: dt.datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def _from_iso(value: str | None) -> dt.datetime | None:
    return dt.datetime.fromisoformat(value) if value is not None else None


# --- the scheduler --------------------------------------------------------------------


def refresh_trigger(refresh_settings):
    """Cron if ``refresh.cron`` is set, else every ``refresh.interval_minutes``."""
    if refresh_settings.cron:
        try:
            return CronTrigger.from_crontab(
                refresh_settings.cron, timezone=refresh_settings.timezone
            )
        except ValueError as exc:
            raise ValueError(f"refresh.cron {refresh_settings.cron!r} is invalid: {exc}") from exc
    if refresh_settings.interval_minutes <= 0:
        raise ValueError("refresh.interval_minutes must be positive")
    return IntervalTrigger(
        seconds=refresh_settings.interval_minutes * 60, timezone=refresh_settings.timezone
    )


def build_scheduler(settings) -> BackgroundScheduler:
    """A scheduler with the persistent JSON job store in the genrec database."""
    # genrec's engine: creates the SQLite directory, WAL and a busy timeout for shared use.
    engine = make_engine(settings.database_url, create_tables=False)
    store = JsonSQLAlchemyJobStore(engine=engine, tablename=JOBS_TABLE)
    return BackgroundScheduler(
        jobstores={"default": store},
        job_defaults={
            "coalesce": True,
            "max_instances": 1,
            "misfire_grace_time": settings.refresh.misfire_grace_s,
        },
        timezone=settings.refresh.timezone,
    )


def _signature(spec: dict[str, Any], func_ref: str, misfire_grace_s: int) -> tuple:
    """What makes two schedules the same (the start date only sets the phase)."""
    rule = spec.get("seconds") if spec["type"] == "interval" else spec.get("fields")
    return (func_ref, spec["type"], json.dumps(rule, sort_keys=True), spec["timezone"],
            misfire_grace_s)  # fmt: skip


def ensure_refresh_job(scheduler, settings, func_ref: str = JOB_FUNC) -> Job:
    """Keep the stored refresh job if it matches the settings, else (re)place it.

    Call after ``scheduler.start(paused=True)``, so that a kept job's stored next
    run time (possibly missed while down) survives and is coalesced on resume.
    """
    trigger = refresh_trigger(settings.refresh)
    grace = settings.refresh.misfire_grace_s
    wanted = _signature(trigger_to_json(trigger), func_ref, grace)
    existing = scheduler.get_job(JOB_ID)
    if existing is not None:
        stored = _signature(
            trigger_to_json(existing.trigger), existing.func_ref, existing.misfire_grace_time
        )
        if stored == wanted:
            log.info("schedule: kept stored job, next run %s", existing.next_run_time)
            return existing
        log.info("schedule: settings changed; replacing the stored job")
    job = scheduler.add_job(
        func_ref,
        trigger=trigger,
        id=JOB_ID,
        name="genrec offline refresh",
        replace_existing=True,
        coalesce=True,
        max_instances=1,
        misfire_grace_time=grace,
    )
    log.info("schedule: refresh %s, next run %s", trigger, job.next_run_time)
    return job


def scheduled_refresh() -> str:
    """The scheduled job: one refresh with the process settings; never raises."""
    settings = get_settings()
    engine = make_engine(settings.database_url)
    try:
        report = run_refresh(settings, engine, trigger="schedule", cancel=_cancel)
    except LockBusy as exc:
        log.warning("scheduled refresh skipped: %s", exc)
        return "skipped"
    except Exception:
        log.exception("scheduled refresh failed; the previous version keeps serving")
        return "failed"
    finally:
        engine.dispose()
    log.info("scheduled refresh done: serving version %d", report.serving_version)
    return "succeeded"


def run_schedule(settings, *, run_now: bool = False, func_ref: str = JOB_FUNC) -> int:
    """Run the scheduler in the foreground until SIGTERM or SIGINT."""
    ref_to_obj(func_ref)  # fail early on a bad reference
    _cancel.clear()
    stop = threading.Event()

    def _stop(signum, _frame) -> None:
        log.info("schedule: signal %d, shutting down", signum)
        _cancel.set()
        stop.set()

    previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    scheduler = build_scheduler(settings)
    scheduler.start(paused=True)
    try:
        job = ensure_refresh_job(scheduler, settings, func_ref)
        if run_now:
            job.modify(next_run_time=dt.datetime.now(dt.UTC))
        scheduler.resume()
        while not stop.wait(1.0):
            pass
    finally:
        scheduler.pause()  # no new submissions while the executors stop
        scheduler.shutdown(wait=True)  # waits for a cancelled refresh to record itself
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
