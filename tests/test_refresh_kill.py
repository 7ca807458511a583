"""kill -9 of a real refresh process mid-run: the previous version keeps serving.

The child process runs ``run_refresh`` (real prefix KV of a tiny model, fakes
for semantic IDs and training) and stops after its second KV batch, when part
of the new KV version is on disk and indexed; the test then kills it with
SIGKILL. Nothing of the new version may be visible, and the next run must take
over once the dead run's lease expires, and clean up.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import select

from genrec.infra.database import make_engine
from genrec.infra.serving_versions import active_serving_version
from genrec.offline.refresh import run_refresh
from genrec.online.prefix_kv_store import kv_root, open_kv_store
from genrec.schemas.tables import serving_versions
from tests.refresh_fakes import USERS, FakeSteps, add_events, assert_serves, make_settings, runs

LEASE_S = 2.0


def child_main(home: str, database_url: str, marker: str) -> None:
    """Runs in the child: a refresh that parks itself after its second KV batch."""
    settings = make_settings(Path(home), database_url, lock_lease_s=LEASE_S)
    steps = FakeSteps(model_version=2)

    def park(name: str) -> None:
        if name == "prefix_kv_batch":
            steps.batches += 1
            if steps.batches == 2:
                Path(marker).write_text("parked")
                time.sleep(3600)

    steps.checkpoint = park
    run_refresh(settings, make_engine(database_url), steps=steps, trigger="test")


def _wait_for(marker: Path, child: subprocess.Popen, limit_s: float = 600) -> None:
    deadline = time.monotonic() + limit_s
    while not marker.exists():
        if child.poll() is not None:
            raise AssertionError(f"refresh child exited early:\n{child.stderr.read()}")
        if time.monotonic() > deadline:
            child.kill()
            raise AssertionError("refresh child never reached its second KV batch")
        time.sleep(0.2)


@pytest.mark.slow  # a refresh subprocess killed -9 mid-run: ~18 s, make test only
def test_killed_refresh_leaves_previous_version_serving(tmp_path: Path) -> None:
    database_url = f"sqlite:///{tmp_path / 'genrec.db'}"
    settings = make_settings(tmp_path, database_url, lock_lease_s=LEASE_S)
    engine = make_engine(database_url)
    add_events(engine, range(USERS), per_user=8)
    good = run_refresh(settings, engine, steps=FakeSteps())
    add_events(engine, range(USERS), per_user=2, start_ts=100_000)

    marker = tmp_path / "parked"
    root = str(Path(__file__).parents[1])  # where the ``tests`` package is importable
    code = (
        f"import sys; sys.path.insert(0, {root!r}); import tests.test_refresh_kill as t; "
        f"t.child_main({str(tmp_path)!r}, {database_url!r}, {str(marker)!r})"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    _wait_for(marker, child)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()

    # The dead run wrote part of version 2, but only version 1 is reachable.
    assert_serves(settings, engine, good.serving_version, "1")
    assert runs(engine)[-1]["status"] == "running"
    with engine.connect() as connection:
        statuses = dict(connection.execute(select(serving_versions.c.version, serving_versions.c.status)).all())  # fmt: skip
    assert statuses == {1: "active", 2: "building"}
    store = open_kv_store(settings, engine)
    half = store.entries(2)
    assert 0 < len(half) < USERS
    for entry in half.values():  # whatever was indexed is a complete file
        assert store.load(entry, expected_model_version="2").prompt_ids[0] == 1

    # The next run waits out the dead run's lease, takes over and cleans up.
    after = run_refresh(settings, engine, steps=FakeSteps(model_version=2), lock_wait_s=60)
    assert after.serving_version == 3
    assert_serves(settings, engine, 3, "2")
    assert [r["status"] for r in runs(engine)] == ["succeeded", "abandoned", "succeeded"]
    with engine.connect() as connection:
        statuses = dict(connection.execute(select(serving_versions.c.version, serving_versions.c.status)).all())  # fmt: skip
    assert statuses == {1: "retired", 2: "failed", 3: "active"}
    assert sorted(p.name for p in kv_root(settings).iterdir()) == ["v000001", "v000003"]
    assert active_serving_version(engine).kv_version == 3
