"""The ingest writer process (ingest step): stores batches on its own core, off the consumer's GIL.

The consumer process polls and validates batch N+1 while a child process (a
*spawn* child: the parent runs kafka-python threads) writes batch N with
``write_event_rows``, in one transaction, with the same idempotent SQL. At most
one batch is in flight. Each batch travels as ONE bytes message we encode
ourselves (JSON of column lists; a column holding one text, or only nulls, is
sent once), never pickled; the replies are JSON too: ``{"ready"}`` once the
child is up, then per batch ``{"seq", "stored", "finished_at"}`` or ``{"seq",
"error", "retryable"}``.

The child owns its engine, ignores SIGINT/SIGTERM (the parent drains first)
and exits when its pipe reaches EOF: when the parent closes it, or when the
parent dies (kill -9: Kafka redelivers the uncommitted batch and the insert
skips what is stored). ``wait`` retries what can be retried: a child that died
is replaced and sent the batch again (up to ``MAX_CONSECUTIVE_DEATHS`` times in
a row), a database error (``DBAPIError`` in the child) is retried with backoff,
both until a ``stop`` event is set.

Example::

    >>> writer = WriterProcess("sqlite:////tmp/genrec-writer-example.db")
    >>> writer.send(writer.encode([("e1", "7", "42", "view", 1, None, None, "t", 0, 0)]))
    >>> writer.wait() in (0, 1)
    True
    >>> writer.close()
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.util
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Any

from pydantic_core import from_json, to_json

from genrec.infra import metrics
from genrec.infra.database import make_engine
from genrec.ingest.store import write_event_rows

log = logging.getLogger("genrec.ingest.writer")

CLOSE_TIMEOUT_S = 30.0
START_TIMEOUT_S = 120.0  # imports on a busy 2-core machine take seconds
# A child that dies this many times in a row without storing anything is broken
# (bad install, a crash on this batch), not unlucky: give up instead of looping.
MAX_CONSECUTIVE_DEATHS = 5


class WriteFailed(RuntimeError):
    """The writer process could not store a batch, and will not retry (or was told to stop)."""


def encode_batch(seq: int, rows: Sequence[Sequence[Any]]) -> bytes:
    """One batch as bytes: ``{"seq", "n", "columns"}``; NaN stays NaN in contexts.

    Columns, not rows: decoding 10 lists is far cheaper than decoding n small ones.
    A column whose values are all the same text or all null becomes ``{"all": value}``
    (only those: ``==`` would also merge 0.0 and -0.0, or 1 and 1.0 in a context).
    """
    columns: list[Any] = []
    for column in zip(*rows, strict=True):
        first = column[0]
        same = (first is None or type(first) is str) and column.count(first) == len(column)
        columns.append({"all": first} if same else column)
    return to_json({"seq": seq, "n": len(rows), "columns": columns}, inf_nan_mode="constants")


def decode_batch(message: bytes) -> tuple[int, list[tuple[Any, ...]]]:
    """``encode_batch`` reversed: (seq, rows as tuples, which the drivers want)."""
    batch = from_json(message)
    n = batch["n"]
    columns = [repeat(c["all"], n) if type(c) is dict else c for c in batch["columns"]]
    return batch["seq"], list(zip(*columns, strict=True))


@dataclass
class _Failure:
    text: str
    retryable: bool
    restart: bool  # the child is gone: start a new one before re-sending


class WriterProcess:
    """A child process that writes batches of event rows into ``database_url``."""

    def __init__(self, database_url: str) -> None:
        self.database_url = database_url
        self._context = multiprocessing.get_context("spawn")
        self._process: Any = None
        self._connection: Any = None
        self._seq = 0
        self._pending: bytes | None = None
        self.restarts = 0
        # When the child finished the last write (time.monotonic: one clock per machine).
        self.finished_at: float | None = None
        # Ready before the first batch: its start-up must not stall the consumer later,
        # and a child that cannot start at all (a broken install) fails here, loudly.
        if not self._start():
            why = self._exit_text()
            self.close()
            raise WriteFailed(f"writer process did not start ({why})")

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def _start(self) -> bool:
        """Start a child and wait for its ready message; False when it died instead."""
        parent_end, child_end = self._context.Pipe(duplex=True)
        process = self._context.Process(
            target=_child_main,
            args=(child_end, self.database_url),
            name="genrec-ingest-writer",
            daemon=True,
        )
        process.start()
        # Only the child may hold its end, or its death would never show up here as EOF.
        child_end.close()
        # At interpreter exit multiprocessing joins its children; this runs first and
        # closes our end, so a WriterProcess never closed still lets the process exit.
        multiprocessing.util.Finalize(self, parent_end.close, exitpriority=10)
        self._process, self._connection = process, parent_end
        try:
            if parent_end.poll(START_TIMEOUT_S):
                return "ready" in from_json(parent_end.recv_bytes())
        except (EOFError, OSError):
            pass
        return False

    def encode(self, rows: Sequence[Sequence[Any]]) -> bytes:
        """The message for the next ``send``; may be built while a batch is in flight."""
        return encode_batch(self._seq + 1, rows)

    def send(self, message: bytes) -> None:
        """Hand one ``encode``d batch to the child (returns at once); ``wait`` collects it."""
        if self._pending is not None:
            raise RuntimeError("a batch is already in flight: wait() for it first")
        self._seq += 1
        self._pending = message
        self._transmit()

    def _transmit(self) -> None:
        try:
            self._connection.send_bytes(self._pending)
        except OSError as exc:  # the child is gone; wait() sees the EOF and restarts it
            log.debug("writer process unreachable: %s", exc)

    def wait(self, *, stop: threading.Event | None = None) -> int:
        """Block until the batch in flight is stored; returns how many events were new.

        Raises ``WriteFailed`` when the error is not retryable, or when ``stop`` is
        set and the write failed (nothing is committed to Kafka: redelivery covers it).
        """
        if self._pending is None:
            raise RuntimeError("no batch in flight")
        delay, deaths = 0.5, 0
        while True:
            outcome = self._receive()
            if isinstance(outcome, int):
                self._pending = None
                return outcome
            deaths = deaths + 1 if outcome.restart else 0
            if (
                not outcome.retryable
                or (stop is not None and stop.is_set())
                or deaths >= MAX_CONSECUTIVE_DEATHS
            ):
                self._pending = None
                raise WriteFailed(outcome.text)
            log.warning("%s; retrying the batch in %.1f s", outcome.text, delay)
            kind = "writer_died" if outcome.restart else "db_write"
            metrics.ERRORS.labels(component="ingest", kind=kind).inc()
            time.sleep(delay)
            delay = min(delay * 2, 10.0)
            if outcome.restart:
                self._replace_child()
            self._transmit()

    def _receive(self) -> int | _Failure:
        try:
            reply = from_json(self._connection.recv_bytes())
        except (EOFError, OSError):
            return _Failure(f"writer process exited ({self._exit_text()})", True, True)
        if reply.get("seq") != self._seq:
            raise WriteFailed(f"writer process answered batch {reply.get('seq')}, not {self._seq}")
        if "stored" in reply:
            self.finished_at = reply["finished_at"]
            return reply["stored"]
        return _Failure(f"database write failed ({reply['error']})", reply["retryable"], False)

    def _exit_text(self) -> str:
        self._process.join(timeout=5.0)
        code = self._process.exitcode
        if code is None:
            return "still running, pipe closed"
        return f"killed by signal {-code}" if code < 0 else f"exit code {code}"

    def _replace_child(self) -> None:
        self._stop_child(timeout_s=5.0)
        self.restarts += 1
        if self._start():  # if not, sending fails and wait() counts another death
            log.info("started writer process %d", self._process.pid)

    def _stop_child(self, timeout_s: float) -> None:
        self._connection.close()  # EOF: the child finishes what it holds and exits
        self._process.join(timeout=timeout_s)
        if self._process.is_alive():  # it ignores SIGTERM, by design
            log.warning("writer process %d did not exit; killing it", self._process.pid)
            self._process.kill()
            self._process.join(timeout=5.0)
        self._process.close()

    def close(self) -> None:
        """Tell the child to exit (EOF) and reap it; idempotent."""
        if self._process is None:
            return
        self._stop_child(timeout_s=CLOSE_TIMEOUT_S)
        self._process = None


def _child_main(connection: Any, database_url: str) -> None:
    """The child's loop: batch in, ``write_event_rows``, reply out; EOF ends it."""
    # The parent handles both signals (drain, then close the pipe); a Ctrl-C sent to
    # the whole process group must not abort a write half-way.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from sqlalchemy.exc import DBAPIError

    engine = None
    try:
        with contextlib.suppress(Exception):  # if the database is down, the first write says so
            engine = make_engine(database_url)
        connection.send_bytes(to_json({"ready": True}))
        while True:
            try:
                message = connection.recv_bytes()
            except EOFError:
                return
            seq, rows = decode_batch(message)
            try:
                # Made here, not before the loop: a database that is down now is a
                # retryable reply, not a dead child.
                engine = engine or make_engine(database_url)
                stored = write_event_rows(engine, rows)
                reply: dict[str, Any] = {
                    "seq": seq,
                    "stored": stored,
                    "finished_at": time.monotonic(),
                }
            except Exception as exc:
                first_line = (str(exc).splitlines() or [""])[0][:300]
                reply = {
                    "seq": seq,
                    "error": f"{type(exc).__name__}: {first_line}",
                    "retryable": isinstance(exc, DBAPIError),
                }
            try:
                connection.send_bytes(to_json(reply))
            except OSError:
                return
    finally:
        if engine is not None:
            engine.dispose()
