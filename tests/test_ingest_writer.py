"""The ingest writer process: codec, round trip, child death, error replies, shutdown, no zombies."""

from __future__ import annotations

import math
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from collections import namedtuple
from pathlib import Path

import pytest
from kafka.structs import TopicPartition

from genrec.infra.database import make_engine
from genrec.infra.settings import Settings
from genrec.ingest.consumer import Ingestor, uses_writer_process
from genrec.ingest.writer import WriteFailed, WriterProcess, decode_batch, encode_batch
from genrec.schemas.tables import users
from tests.helpers import count_rows

Record = namedtuple("Record", "topic partition offset key value timestamp")


def rows(n: int, start: int = 0, user: str = "u1") -> list[tuple]:
    return [
        (f"e{i}", user, f"i{i}", "view", 1_000 + i, None, None, "t", 0, i)
        for i in range(start, start + n)
    ]


def gone(pid: int) -> bool:
    """The process has exited (and, unless init is slow to reap it, left no zombie)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def wait_until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.fixture
def writer(tmp_path):
    url = f"sqlite:///{tmp_path / 'w.db'}"
    make_engine(url).dispose()  # tables first, as the Ingestor does
    writer = WriterProcess(url)
    yield writer, url
    writer.close()


def test_codec_round_trips_exact_values():
    batch = [
        (
            "e1",
            "u",
            "i",
            "view",
            1,
            -0.0,
            {"x": float("nan"), "big": 10**30, "s": "é😀"},
            "t",
            0,
            7,
        ),
        ("e2", "u", "i", "view", 2, 1.0, None, "t", 0, 8),
        ("e3", "u", "i", "rate", 3, 0.0, {"x": 1}, "t", 1, 9),
    ]
    seq, decoded = decode_batch(encode_batch(42, batch))
    assert seq == 42 and repr(decoded) == repr(batch)  # repr: nan, -0.0 and 1 vs 1.0
    assert decode_batch(encode_batch(1, [])) == (1, [])
    one = [("e1", "u", "i", "view", 1, None, None, "t", 0, 0)]
    assert decode_batch(encode_batch(2, one)) == (2, one)
    assert math.isnan(decoded[0][6]["x"])


def test_round_trip_is_idempotent_and_closes_cleanly(writer):
    writer, url = writer
    pid = writer.pid
    writer.send(writer.encode(rows(300)))
    assert writer.wait() == 300
    writer.send(writer.encode(rows(300, start=200)))
    assert writer.wait() == 200  # e200..e299 were stored already
    assert count_rows(url) == 500 and count_rows(url, users) == 1
    writer.close()
    assert gone(pid) and not multiprocessing.active_children()
    writer.close()  # idempotent


def test_child_ignores_sigterm_and_sigint(writer):
    writer, url = writer
    for signum in (signal.SIGTERM, signal.SIGINT):
        os.kill(writer.pid, signum)
    time.sleep(0.5)
    assert not gone(writer.pid)
    writer.send(writer.encode(rows(10)))
    assert writer.wait() == 10 and writer.restarts == 0


def test_a_dead_child_is_replaced_and_the_batch_sent_again(writer):
    writer, url = writer
    first = writer.pid
    os.kill(first, signal.SIGKILL)
    wait_until(lambda: gone(first), 30, "the child to die")
    writer.send(writer.encode(rows(50)))
    assert writer.wait() == 50
    assert writer.restarts == 1 and writer.pid != first and gone(first)
    assert count_rows(url) == 50


def test_database_errors_are_retried_until_stop(writer, caplog):
    writer, url = writer
    stop = threading.Event()
    bad = [("e1", None, "i", "view", 1, None, None, "t", 0, 0)]  # user_id NOT NULL
    outcome: list = []

    def wait_for_it():
        try:
            outcome.append(writer.wait(stop=stop))
        except WriteFailed as exc:
            outcome.append(exc)

    writer.send(writer.encode(bad))
    thread = threading.Thread(target=wait_for_it)
    thread.start()
    wait_until(lambda: "retrying the batch" in caplog.text, 30, "a retry")
    stop.set()
    thread.join(timeout=60)
    assert isinstance(outcome[0], WriteFailed) and "IntegrityError" in str(outcome[0])
    writer.send(writer.encode(rows(5)))  # the same child goes on
    assert writer.wait() == 5 and writer.restarts == 0


def test_errors_that_are_not_the_databases_are_raised_at_once(writer):
    writer, url = writer
    # SQLite stores text in an integer column; the users span then compares text with int.
    bad = [
        ("e1", "u", "i", "view", "soon", None, None, "t", 0, 0),
        ("e2", "u", "i", "view", 5, None, None, "t", 0, 1),
    ]
    writer.send(writer.encode(bad))
    with pytest.raises(WriteFailed, match="TypeError"):
        writer.wait()
    assert count_rows(url) == 0  # one transaction: nothing of the batch stayed


def test_a_child_that_keeps_dying_is_given_up_on(writer, monkeypatch):
    import genrec.ingest.writer as writer_module

    writer, url = writer
    monkeypatch.setattr(writer_module, "MAX_CONSECUTIVE_DEATHS", 2)
    monkeypatch.setattr(writer_module.time, "sleep", lambda s: None)
    original = writer._replace_child

    def replace_then_kill():
        original()
        os.kill(writer.pid, signal.SIGKILL)

    monkeypatch.setattr(writer, "_replace_child", replace_then_kill)
    os.kill(writer.pid, signal.SIGKILL)
    writer.send(writer.encode(rows(1)))
    with pytest.raises(WriteFailed, match="killed by signal 9"):
        writer.wait()


CHILD_OF_A_KILLED_PARENT = """
import sys, time
from genrec.ingest.writer import WriterProcess
if __name__ == "__main__":
    writer = WriterProcess(sys.argv[1])
    print(writer.pid, flush=True)
    time.sleep(600)
"""


def test_the_child_exits_when_its_parent_is_killed(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(CHILD_OF_A_KILLED_PARENT)
    url = f"sqlite:///{tmp_path / 'k.db'}"
    parent = subprocess.Popen([sys.executable, str(script), url], stdout=subprocess.PIPE)
    try:
        child = int(parent.stdout.readline())
        assert not gone(child)
    finally:
        parent.kill()
        parent.wait(timeout=30)
    wait_until(lambda: gone(child), 30, "the orphaned child to see EOF and exit")


def test_the_writer_choice():
    assert uses_writer_process(Settings(database_url="sqlite:////tmp/x.db"))
    assert uses_writer_process(Settings(database_url="postgresql+psycopg://u@h/db"))
    assert not uses_writer_process(Settings(database_url="sqlite://"))
    assert not uses_writer_process(Settings(database_url="sqlite:///:memory:"))
    assert not uses_writer_process(
        Settings(database_url="sqlite:///file:x?mode=memory&cache=shared&uri=true")
    )
    assert not uses_writer_process(
        Settings(database_url="sqlite:////tmp/x.db", ingest={"writer": "thread"})
    )


class FakeConsumer:
    def __init__(self, batches):
        self.batches, self.committed, self.owned = list(batches), {}, set()

    def poll(self, timeout_ms=0):
        batch = self.batches.pop(0) if self.batches else {}
        self.owned.update(batch)
        return batch

    def commit(self, offsets, timeout_ms=None):
        self.committed.update({tp: meta.offset for tp, meta in offsets.items()})

    def assignment(self):
        return self.owned

    def close(self, autocommit=True):
        pass


class FakeDeadLetters:
    def __init__(self):
        self.letters = []

    def publish(self, letters, stop=None):
        self.letters.extend(letters)

    def close(self):
        pass


def test_ingestor_stores_through_the_writer_process(tmp_path):
    tp = TopicPartition("t", 0)
    good = b'{"event_id":"e%d","user_id":"u","item_id":"i","event_type":"view","ts":%d}'
    batches = [
        {tp: [Record("t", 0, i, b"u", good % (i, i), 0) for i in range(start, start + 100)]}
        for start in (0, 100, 200)
    ]
    batches[1][tp][5] = Record("t", 0, 105, b"u", b"nope", 0)
    settings = Settings(home=tmp_path)
    dead = FakeDeadLetters()
    ingestor = Ingestor(settings, consumer=FakeConsumer(batches), dead_letters=dead)
    assert ingestor.writer_process is not None
    pid = ingestor.writer_process.pid
    stats = ingestor.run(exit_when_idle_s=0.0)
    assert (stats.events_stored, stats.events_rejected, stats.batches) == (299, 1, 3)
    assert ingestor.consumer.committed == {tp: 300} and len(dead.letters) == 1
    assert count_rows(str(settings.database_url)) == 299
    assert gone(pid) and not multiprocessing.active_children()
