"""A named lock shared by processes through the database (offline refresh: one run at a time).

A row of ``job_locks`` holds the owner and a lease expiry. Acquiring is one
conditional UPDATE ("take it if free or expired"), which is atomic on SQLite
(one writer at a time) and on PostgreSQL (the row lock makes a concurrent
UPDATE re-check the condition). A heartbeat thread extends the lease while
the holder lives; a killed holder stops extending it and the lease expires.
Expiry uses the holders' clocks, so hosts must agree on time to well within
the lease (NTP is plenty for the default 120 s).

Example::

    >>> from genrec.infra.database import make_engine
    >>> engine = make_engine("sqlite:///:memory:")
    >>> with RunLock(engine, "demo", lease_s=30) as lock:
    ...     lock.held
    True
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid

from sqlalchemy import Engine, and_, insert, or_, select, update
from sqlalchemy.exc import IntegrityError

from genrec.schemas.tables import job_locks

log = logging.getLogger(__name__)


class LockBusy(RuntimeError):
    """Another live process holds the lock."""


def _now_ms() -> int:
    return int(time.time() * 1000)


def make_owner_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class RunLock:
    """A lease-based lock named ``name``; ``with RunLock(...)`` raises LockBusy when taken."""

    def __init__(self, engine: Engine, name: str, *, lease_s: float = 120.0) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s must be positive, got {lease_s}")
        self.engine = engine
        self.name = name
        self.lease_ms = int(lease_s * 1000)
        self.owner = make_owner_id()
        self.held = False
        self.lost = threading.Event()  # set when the lease was taken over while we ran
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    def try_acquire(self) -> bool:
        """Take the lock if it is free or its lease expired; start the heartbeat. No waiting."""
        self._ensure_row()
        now = _now_ms()
        statement = (
            update(job_locks)
            .where(
                and_(
                    job_locks.c.name == self.name,
                    or_(job_locks.c.owner.is_(None), job_locks.c.expires_ms < now),
                )
            )
            .values(owner=self.owner, acquired_ms=now, expires_ms=now + self.lease_ms)
        )
        with self.engine.begin() as connection:
            taken = connection.execute(statement).rowcount == 1
        if taken:
            self.held = True
            self.lost.clear()
            self._stop.clear()
            self._heartbeat = threading.Thread(
                target=self._beat, name=f"lock-{self.name}", daemon=True
            )
            self._heartbeat.start()
        return taken

    def acquire(self, wait_s: float = 0.0, poll_s: float = 1.0) -> None:
        """Take the lock, waiting up to ``wait_s``; raise LockBusy naming the holder otherwise."""
        deadline = time.monotonic() + wait_s
        while not self.try_acquire():
            if time.monotonic() >= deadline:
                holder, expires_ms = self.holder()
                raise LockBusy(
                    f"lock {self.name!r} is held by {holder} "
                    f"(lease ends in {max(0, expires_ms - _now_ms()) / 1000:.0f} s)"
                )
            time.sleep(poll_s)

    def still_held(self, connection) -> bool:
        """Extend the lease inside ``connection``'s transaction; False if someone took it over.

        Call it in the transaction that publishes results, so a holder whose lease
        lapsed can never publish (a fencing check).
        """
        now = _now_ms()
        statement = (
            update(job_locks)
            .where(and_(job_locks.c.name == self.name, job_locks.c.owner == self.owner))
            .values(expires_ms=now + self.lease_ms)
        )
        return connection.execute(statement).rowcount == 1

    def release(self) -> None:
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
            self._heartbeat = None
        if self.held:
            statement = (
                update(job_locks)
                .where(and_(job_locks.c.name == self.name, job_locks.c.owner == self.owner))
                .values(owner=None, expires_ms=0)
            )
            with self.engine.begin() as connection:
                connection.execute(statement)
        self.held = False

    def holder(self) -> tuple[str | None, int]:
        """The current owner id and lease expiry (ms since the epoch)."""
        query = select(job_locks.c.owner, job_locks.c.expires_ms).where(
            job_locks.c.name == self.name
        )
        with self.engine.connect() as connection:
            row = connection.execute(query).first()
        return (row[0], int(row[1])) if row else (None, 0)

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *_exc) -> None:
        self.release()

    def _ensure_row(self) -> None:
        with self.engine.connect() as connection:
            exists = connection.execute(
                select(job_locks.c.name).where(job_locks.c.name == self.name)
            ).first()
        if exists:
            return
        try:
            with self.engine.begin() as connection:
                connection.execute(insert(job_locks).values(name=self.name, expires_ms=0))
        except IntegrityError:
            pass  # another process created it first

    def _beat(self) -> None:
        interval_s = self.lease_ms / 1000 / 4
        while not self._stop.wait(interval_s):
            try:
                with self.engine.begin() as connection:
                    if not self.still_held(connection):
                        log.error("lock %r was taken over; this run will not publish", self.name)
                        self.lost.set()
                        return
            except Exception:  # a DB hiccup: keep trying until the lease runs out
                log.warning("lock %r heartbeat failed", self.name, exc_info=True)
