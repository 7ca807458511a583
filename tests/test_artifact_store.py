"""Published artifacts (``artifacts.store = database``): publish, fetch, verify, corruption,
the worker's cache and garbage collection; the refresh publishes before it activates.

Unit tests on SQLite; the round trip also runs on the real PostgreSQL (``database_url``).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import os
import time
from pathlib import Path

import pytest
from sqlalchemy import func, insert, select, update

from genrec.infra.artifact_store import (
    PARTIAL_MAX_AGE_S,
    ArtifactCache,
    ArtifactCorrupt,
    ArtifactMissing,
    DatabaseArtifactStore,
    PublishedFile,
    collect_published,
    folder_files,
    open_artifact_store,
)
from genrec.infra.database import make_engine
from genrec.infra.serving_versions import active_serving_version
from genrec.infra.settings import Settings
from genrec.offline.refresh import run_refresh
from genrec.online.serving_artifacts import MODEL, RECALL, resolve_serving_artifacts
from genrec.schemas.tables import (
    artifact_blobs,
    artifact_chunks,
    artifact_files,
    model_versions,
    serving_versions,
)
from tests.refresh_fakes import USERS, FakeSteps, add_events, make_settings

CHUNK = 1000  # bytes: small chunks so that a few KiB make a many-chunk blob


def write_tree(root: Path, files: dict[str, bytes]) -> Path:
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


def sample_files(seed: int = 0) -> dict[str, bytes]:
    big = hashlib.sha256(str(seed).encode()).digest() * 200  # 6,400 bytes: 7 chunks
    return {"target/model.safetensors": big, "target/config.json": b'{"a": 1}',
            "manifest.json": b"{}", "empty.txt": b""}  # fmt: skip


def store_at(engine, root: Path, **kwargs) -> DatabaseArtifactStore:
    defaults = {"chunk_bytes": CHUNK, "retry_wait_s": 0.0}
    return DatabaseArtifactStore(engine, ArtifactCache(root), **{**defaults, **kwargs})


def count(engine, table) -> int:
    with engine.connect() as connection:
        return connection.execute(select(func.count()).select_from(table)).scalar_one()


def test_published_files_come_back_byte_for_byte(tmp_path: Path, database_url: str) -> None:
    """Publisher and fetcher share nothing but the database (here: SQLite and PostgreSQL)."""
    engine = make_engine(database_url)
    source = write_tree(tmp_path / "refresh-host", sample_files())
    report = store_at(engine, tmp_path / "unused").publish(3, folder_files(source, MODEL))
    assert report["files"] == 4 and report["new_blobs"] == 4
    assert report["bytes"] == sum(len(d) for d in sample_files().values())
    with engine.connect() as connection:  # the big file is stored in chunks of CHUNK
        sizes = connection.execute(
            select(func.length(artifact_chunks.c.data)).order_by(artifact_chunks.c.seq)
        ).scalars().all()  # fmt: skip
    assert max(sizes) == CHUNK and sum(sizes) == report["bytes"]
    tree = store_at(engine, tmp_path / "worker-cache").fetch(3)
    for name, data in sample_files().items():
        assert (tree / MODEL / name).read_bytes() == data
    assert not list((tmp_path / "worker-cache" / "blobs" / ".partial").glob("*"))
    engine.dispose()


def test_unchanged_files_are_stored_and_fetched_once(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'genrec.db'}")
    publisher = store_at(engine, tmp_path / "unused")
    first = sample_files(0)
    second = {**first, "manifest.json": b'{"v": 2}'}  # one file changed
    publisher.publish(1, folder_files(write_tree(tmp_path / "v1", first), MODEL))
    report = publisher.publish(2, folder_files(write_tree(tmp_path / "v2", second), MODEL))
    assert (report["new_blobs"], report["new_bytes"]) == (1, len(b'{"v": 2}'))
    assert count(engine, artifact_blobs) == 5 and count(engine, artifact_files) == 8
    worker = store_at(engine, tmp_path / "cache")
    fetched = []
    real_chunks = worker._chunks
    worker._chunks = lambda sha: (fetched.append(sha), real_chunks(sha))[1]
    worker.fetch(1)
    assert len(fetched) == 4
    tree = worker.fetch(2)
    assert len(fetched) == 5  # only the changed file
    assert (tree / MODEL / "manifest.json").read_bytes() == b'{"v": 2}'
    # A version's tree links the cached blobs: equal files share one copy on disk.
    big = "target/model.safetensors"
    assert os.stat(tree / MODEL / big).st_ino == os.stat(worker.cache.tree(1) / MODEL / big).st_ino


def test_a_corrupt_download_is_discarded_and_fetched_again(tmp_path: Path, caplog) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'genrec.db'}")
    store_at(engine, tmp_path / "unused").publish(1, folder_files(
        write_tree(tmp_path / "src", sample_files()), MODEL))  # fmt: skip
    worker = store_at(engine, tmp_path / "cache")
    real_chunks, calls = worker._chunks, []
    big = hashlib.sha256(sample_files()["target/model.safetensors"]).hexdigest()

    def flaky(sha256: str):
        calls.append(sha256)
        chunks = real_chunks(sha256)
        attempt = calls.count(big)
        if sha256 == big and attempt == 1:  # the first download is cut short
            yield next(chunks)
            return
        if sha256 == big and attempt == 2:  # the second has a flipped bit
            first = next(chunks)
            yield bytes([first[0] ^ 1]) + first[1:]
        yield from chunks

    worker._chunks = flaky
    tree = worker.fetch(1)
    for name, data in sample_files().items():
        assert (tree / MODEL / name).read_bytes() == data
    assert len(calls) == 4 + 2  # two bad attempts at the first file, then one per file
    assert sum("fetching again" in r.message for r in caplog.records) == 2
    assert not list(worker.cache.partial.glob("*"))  # nothing half-written was kept


def test_corruption_in_the_database_fails_the_fetch_and_caches_nothing(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'genrec.db'}")
    store_at(engine, tmp_path / "unused").publish(1, folder_files(
        write_tree(tmp_path / "src", sample_files()), MODEL))  # fmt: skip
    with engine.begin() as connection:
        connection.execute(
            update(artifact_chunks).where(artifact_chunks.c.seq == 3).values(data=b"\0" * CHUNK)
        )
    worker = store_at(engine, tmp_path / "cache", fetch_attempts=2)
    with pytest.raises(ArtifactCorrupt, match="model.safetensors"):
        worker.fetch(1)
    assert not worker.cache.tree(1).exists()
    assert not [p for p in worker.cache.blobs.rglob("*") if p.is_file()
                and p.stat().st_size == 6400]  # fmt: skip
    with pytest.raises(ArtifactMissing):
        worker.fetch(99)


def test_a_file_that_changes_while_published_is_refused(tmp_path: Path, monkeypatch) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'genrec.db'}")
    source = write_tree(tmp_path / "src", {"a.bin": b"a" * 5000})
    import genrec.infra.artifact_store as module

    monkeypatch.setattr(module, "sha256_of", lambda _path: "0" * 64)  # hashed before a change
    with pytest.raises(ArtifactCorrupt, match="changed while"):
        store_at(engine, tmp_path / "unused").publish(1, folder_files(source, MODEL))
    # The blob's transaction rolled back: no chunk, no blob, no listed version.
    assert [count(engine, t) for t in (artifact_chunks, artifact_blobs, artifact_files)] == [
        0,
        0,
        0,
    ]


def test_paths_must_stay_inside_the_version(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'genrec.db'}")
    store = store_at(engine, tmp_path / "cache")
    with pytest.raises(ValueError, match="relative artifact path"):
        store.publish(1, {"../escape": write_tree(tmp_path, {"x": b"x"}) / "x"})
    sha = hashlib.sha256(b"x").hexdigest()
    store.cache.write_blob(PublishedFile("x", sha, 1), [b"x"])
    for path in ("/etc/passwd", "a/../../b"):
        with pytest.raises(ValueError):
            store.cache.build_tree(7, [PublishedFile(path, sha, 1)])
    assert not store.cache.tree(7).exists()


def test_the_cache_keeps_the_newest_versions_and_their_blobs(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'genrec.db'}")
    publisher = store_at(engine, tmp_path / "unused")
    for version in (1, 2, 3):
        files = {"shared.bin": b"same in every version", "own.bin": f"v{version}".encode()}
        publisher.publish(version, folder_files(write_tree(tmp_path / f"v{version}", files), MODEL))
    worker = store_at(engine, tmp_path / "cache")
    stale = worker.cache.partial / "dead-process.partial"
    for version in (1, 2):
        worker.fetch(version)
        time.sleep(0.02)  # distinct modification times
    stale.write_bytes(b"left by a killed worker")
    os.utime(stale, (time.time() - PARTIAL_MAX_AGE_S - 1,) * 2)
    worker.fetch(3)  # keeps 3 (in use) and 2 (the previous one): 1 goes
    trees = sorted(p.name for p in worker.cache.root.glob("v*"))
    assert trees == ["v000002", "v000003"]
    blobs = sorted(p.read_bytes() for p in worker.cache.blobs.glob("??/*"))
    assert blobs == [b"same in every version", b"v2", b"v3"]
    assert not stale.exists()
    assert (worker.fetch(2) / MODEL / "own.bin").read_bytes() == b"v2"  # a hit: no download


def test_garbage_collection_deletes_what_only_old_versions_used(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'genrec.db'}")
    publisher = store_at(engine, tmp_path / "unused")
    for version in (1, 2, 3, 4):
        files = {"shared.bin": b"s" * 2500, "own.bin": f"v{version}".encode() * 400}
        publisher.publish(version, folder_files(write_tree(tmp_path / f"v{version}", files), MODEL))
    with engine.begin() as connection:  # version 4 is a run still building: never collected
        connection.execute(insert(serving_versions), [
            {"version": v, "status": s, "active": s == "active", "created_at": dt.datetime.now()}
            for v, s in ((1, "retired"), (2, "retired"), (3, "active"), (4, "building"))
        ])  # fmt: skip
    counts = collect_published(engine, keep_versions=[3, 2])
    assert counts == {"artifact_versions_collected": 1, "artifact_blobs_collected": 1}
    assert publisher.published_versions() == [2, 3, 4]
    assert count(engine, artifact_blobs) == 4  # shared + three own
    with engine.connect() as connection:
        stored = connection.execute(select(func.sum(func.length(artifact_chunks.c.data)))).scalar()
    assert stored == 2500 + 3 * 800
    assert collect_published(engine, keep_versions=[]) == {
        "artifact_versions_collected": 0, "artifact_blobs_collected": 0}  # fmt: skip


def test_the_refresh_publishes_before_it_activates_and_collects_after(tmp_path: Path) -> None:
    """Refresh with fake steps: every version's model and recall files are listed before
    its activation; after the third, the first's list is collected (keep_versions = 2)."""
    settings = make_settings(tmp_path, f"sqlite:///{tmp_path / 'genrec.db'}")
    settings = settings.model_copy(update={"artifacts": settings.artifacts.model_copy(
        update={"store": "database", "chunk_mb": 0.001})})  # fmt: skip
    engine = make_engine(settings.database_url)
    add_events(engine, range(USERS), per_user=8)
    model_dir = write_tree(tmp_path / "models" / "v1", sample_files())
    write_tree(settings.path("recall", "itemcf"), {"manifest.json": b"{}", "arrays.npz": b"z"})
    with engine.begin() as connection:
        connection.execute(insert(model_versions).values(
            version=1, preset="tiny", status="active", artifact_dir=str(model_dir)))  # fmt: skip
    seen_at_publish = []

    def checkpoint(name: str) -> None:
        if name == "publish":
            versions = open_artifact_store(settings, engine).published_versions()
            seen_at_publish.append((versions, active_serving_version(engine)))

    reports = []
    for _ in range(3):
        steps = FakeSteps()
        steps.checkpoint = checkpoint
        reports.append(run_refresh(settings, engine, steps=steps, trigger="test"))
    for steps_report in reports:
        assert steps_report.counts["artifacts"]["files"] == 6
    versions, active = seen_at_publish[0]
    assert versions == [reports[0].serving_version] and active is None  # listed, not active
    store = open_artifact_store(settings, engine)
    assert store.published_versions() == [r.serving_version for r in reports[1:]]
    assert reports[-1].counts["artifact_versions_collected"] == 1
    assert reports[1].counts["artifacts"]["new_blobs"] == 0  # nothing changed: stored once
    # A worker on another host (its own home, the same database) reads its fetched copy.
    worker = Settings(home=tmp_path / "worker", database_url=settings.database_url,
                      artifacts={"store": "database"})  # fmt: skip
    artifacts = resolve_serving_artifacts(worker, engine, active_serving_version(engine))
    assert artifacts.model_dir.is_relative_to(tmp_path / "worker")
    assert (artifacts.model_dir / "target" / "config.json").read_bytes() == b'{"a": 1}'
    assert (artifacts.recall_root / "itemcf" / "arrays.npz").read_bytes() == b"z"
    assert artifacts.recall_root.name == RECALL


def test_a_version_whose_load_failed_is_tried_again_later() -> None:
    """A failed fetch (the database briefly away) does not skip the version for good."""
    from genrec.online.live_version import ServingBundle, ServingVersions

    attempts = []

    def load(key: str) -> ServingBundle:
        attempts.append(key)
        if key == "2" and attempts.count("2") == 1:
            raise OSError("connection reset while fetching artifacts")
        return ServingBundle(key)

    active = {"key": "1"}
    versions = ServingVersions(lambda: active["key"], load, retry_failed_s=0.2)
    versions.start(background=False)
    active["key"] = "2"
    assert not versions.check_now() and not versions.check_now()  # failed, then left alone
    time.sleep(0.25)
    assert versions.check_now() and versions.current().key == "2"
    assert attempts == ["1", "2", "2"]
