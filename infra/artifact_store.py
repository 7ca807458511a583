"""Published artifacts (core service): a version's files, reachable from any host by version.

With ``artifacts.store = database`` the offline refresh publishes each serving version's
files (model, semantic IDs, recall branches) into the behavior store's database before it
activates the version, and every ``genrec serve`` fetches them from there into a cache
under its own ``GENREC_HOME``: workers need no shared filesystem. Files are stored by
content: a blob is identified by its SHA-256 and cut into chunks of ``artifacts.chunk_mb``
(``artifact_chunks``), so a file that did not change between versions (a model that was
not retrained) is stored once; ``artifact_files`` lists each version's paths.

The worker's ``ArtifactCache``::

    cache_dir/blobs/3f/3fa2...e1            verified contents, by SHA-256
    cache_dir/blobs/.partial/...            downloads in flight (discarded unless verified)
    cache_dir/v000007/model/target/...      one tree per version: hard links to the blobs

A download is streamed chunk by chunk (one chunk in memory), hashed as it is written and
renamed into ``blobs/`` only when its size and SHA-256 match; otherwise it is discarded
and fetched again (``artifacts.fetch_attempts``). A version's tree is built beside its
final name and renamed into place, so a tree that exists is complete. The cache keeps the
``artifacts.cache_versions`` most recently used trees and the blobs they link to.

``ArtifactStore`` is what a backend implements (``DatabaseArtifactStore`` here; an S3
backend would keep the chunks as objects named by SHA-256 and reuse ``ArtifactCache``).
``local`` (the default) has no store: files are read where the database names them, on
one volume shared by every role.

Example::

    >>> from genrec.infra.database import make_engine
    >>> store = DatabaseArtifactStore(make_engine("sqlite:///:memory:"),
    ...                               ArtifactCache("/tmp/genrec-cache-doc"))
    >>> store.published_versions()
    []
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Protocol

from sqlalchemy import Engine, delete, func, insert, select
from sqlalchemy.exc import IntegrityError, OperationalError

from genrec.infra.progress import progress_bar
from genrec.schemas.tables import artifact_blobs, artifact_chunks, artifact_files, serving_versions

log = logging.getLogger(__name__)

HASH_BLOCK = 1 << 20  # bytes read at a time while hashing a local file
PARTIAL_MAX_AGE_S = 3600.0  # a partial download older than this was left by a dead process


class ArtifactCorrupt(RuntimeError):
    """A fetched file's size or SHA-256 is not what was published."""


class ArtifactMissing(LookupError):
    """The version (or one of its blobs) was never published, or was collected."""


@dataclass(frozen=True)
class PublishedFile:
    path: str  # inside the version, '/'-separated: model/target/config.json
    sha256: str
    size: int


class ArtifactStore(Protocol):
    """Publishes a version's files by path and hands any process a local copy of them."""

    def publish(self, version: int, files: Mapping[str, Path]) -> dict[str, int]:
        """Store ``files`` (path inside the version -> local file) as ``version``."""
        ...

    def fetch(self, version: int) -> Path:
        """A local folder holding ``version``'s files at their published paths."""
        ...

    def collect(self, keep_versions: Iterable[int]) -> dict[str, int]:
        """Forget the versions not kept and delete what only they used."""
        ...


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def checked_path(path: str) -> PurePosixPath:
    """``path`` as a relative path that stays inside the folder it is joined to."""
    pure = PurePosixPath(path)
    if pure.is_absolute() or not pure.parts or any(p in ("..", ".", "") for p in pure.parts):
        raise ValueError(f"not a relative artifact path: {path!r}")
    return pure


def folder_files(folder: Path, prefix: str) -> dict[str, Path]:
    """Every file under ``folder`` keyed ``prefix/relative/path`` (hidden files skipped)."""
    files = {}
    for path in sorted(Path(folder).rglob("*")):
        relative = path.relative_to(folder)
        if path.is_file() and not any(part.startswith(".") for part in relative.parts):
            files[f"{prefix}/{relative.as_posix()}"] = path
    return files


# --- the worker's local cache ---------------------------------------------------------


class ArtifactCache:
    """Verified blobs and per-version trees of hard links under one folder (see module doc)."""

    def __init__(self, root: Path | str, keep_versions: int = 2) -> None:
        self.root = Path(root)
        self.blobs = self.root / "blobs"
        self.partial = self.blobs / ".partial"
        self.keep_versions = keep_versions

    def blob(self, sha256: str) -> Path:
        return self.blobs / sha256[:2] / sha256

    def has_blob(self, file: PublishedFile) -> bool:
        path = self.blob(file.sha256)
        return path.exists() and path.stat().st_size == file.size

    def tree(self, version: int) -> Path:
        return self.root / f"v{version:06d}"

    def write_blob(self, file: PublishedFile, chunks: Iterable[bytes]) -> Path:
        """Stream ``chunks`` into a partial file; rename it into place only if it verifies."""
        self.partial.mkdir(parents=True, exist_ok=True)
        scratch = self.partial / f"{file.sha256}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        digest, size = hashlib.sha256(), 0
        try:
            with open(scratch, "wb") as handle:
                for chunk in chunks:
                    digest.update(chunk)
                    size += len(chunk)
                    handle.write(chunk)
                handle.flush()
                os.fsync(handle.fileno())
            if size != file.size or digest.hexdigest() != file.sha256:
                raise ArtifactCorrupt(
                    f"{file.path}: got {size} bytes with sha256 {digest.hexdigest()[:12]}..., "
                    f"published {file.size} bytes with {file.sha256[:12]}..."
                )
            final = self.blob(file.sha256)
            final.parent.mkdir(parents=True, exist_ok=True)
            os.replace(scratch, final)
            return final
        finally:
            scratch.unlink(missing_ok=True)

    def build_tree(self, version: int, files: list[PublishedFile]) -> Path:
        """Link ``version``'s files from the blobs into its tree (renamed into place last)."""
        final = self.tree(version)
        if final.exists():
            os.utime(final)  # recently used: garbage collection keeps it
            return final
        scratch = self.root / f".v{version:06d}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        try:
            for file in files:
                target = scratch / checked_path(file.path)
                target.parent.mkdir(parents=True, exist_ok=True)
                try:
                    os.link(self.blob(file.sha256), target)
                except OSError:  # a file system without hard links: a copy
                    shutil.copyfile(self.blob(file.sha256), target)
            scratch.mkdir(parents=True, exist_ok=True)  # a version with no files
            try:
                os.rename(scratch, final)
            except OSError:
                if not final.exists():  # else another process sharing the cache won
                    raise
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        return final

    def collect(self, in_use: Iterable[int] = ()) -> dict[str, int]:
        """Keep the ``keep_versions`` most recently used trees (and ``in_use``); delete the
        other trees, then every blob no kept tree links to, and stale partial downloads."""
        trees = sorted(
            (p for p in self.root.glob("v[0-9]*") if p.is_dir()),
            key=lambda p: p.stat().st_mtime,
            reverse=True,
        )
        keep = {self.tree(v) for v in in_use} | set(trees[: self.keep_versions])
        removed = [tree for tree in trees if tree not in keep]
        for tree in removed:
            shutil.rmtree(tree, ignore_errors=True)
        blobs = 0
        for blob in self.blobs.glob("??/*"):
            if blob.stat().st_nlink <= 1:  # no tree links to it (a copied file has its own)
                blob.unlink(missing_ok=True)
                blobs += 1
        now = time.time()
        for partial in self.partial.glob("*") if self.partial.exists() else ():
            if now - partial.stat().st_mtime > PARTIAL_MAX_AGE_S:
                partial.unlink(missing_ok=True)
        return {"cache_versions_removed": len(removed), "cache_blobs_removed": blobs}


# --- the database backend -------------------------------------------------------------


class DatabaseArtifactStore:
    """Blobs as chunks in the behavior store's database; see the module docstring."""

    def __init__(
        self,
        engine: Engine,
        cache: ArtifactCache,
        chunk_bytes: int = 4 << 20,
        fetch_attempts: int = 3,
        retry_wait_s: float = 1.0,
    ) -> None:
        self.engine, self.cache = engine, cache
        self.chunk_bytes, self.fetch_attempts = int(chunk_bytes), fetch_attempts
        self.retry_wait_s = retry_wait_s

    # publishing (the offline refresh) ---------------------------------------------------

    def publish(self, version: int, files: Mapping[str, Path]) -> dict[str, int]:
        """Upload the blobs the database lacks, then list ``files`` as ``version`` in one
        transaction (a version is listed completely or not at all; listing it again
        replaces the list). Returns files, bytes and what was new."""
        listed: list[PublishedFile] = []
        new_blobs = new_bytes = 0
        for path, local in progress_bar(sorted(files.items()), desc="publish artifacts",
                                        unit="file", leave=False):  # fmt: skip
            checked_path(path)
            sha256, size = sha256_of(local), Path(local).stat().st_size
            if not self._has_blob(sha256):
                self._upload(Path(local), sha256, size)
                new_blobs, new_bytes = new_blobs + 1, new_bytes + size
            listed.append(PublishedFile(path, sha256, size))
        with self.engine.begin() as connection:
            connection.execute(delete(artifact_files).where(artifact_files.c.version == version))
            if listed:
                connection.execute(insert(artifact_files), [
                    {"version": version, "path": f.path, "sha256": f.sha256, "size": f.size}
                    for f in listed
                ])  # fmt: skip
        report = {"files": len(listed), "bytes": sum(f.size for f in listed),
                  "new_blobs": new_blobs, "new_bytes": new_bytes}  # fmt: skip
        log.info("published artifacts of version %d: %s", version, report)
        return report

    def _has_blob(self, sha256: str) -> bool:
        query = select(artifact_blobs.c.sha256).where(artifact_blobs.c.sha256 == sha256)
        with self.engine.connect() as connection:
            return connection.execute(query).first() is not None

    def _upload(self, local: Path, sha256: str, size: int) -> None:
        """The blob's chunks and its row in one transaction, read one chunk at a time and
        hashed again on the way (a file changed since it was hashed is refused)."""
        digest, seq = hashlib.sha256(), 0
        try:
            with self.engine.begin() as connection, open(local, "rb") as handle:
                while chunk := handle.read(self.chunk_bytes):
                    digest.update(chunk)
                    connection.execute(
                        insert(artifact_chunks).values(sha256=sha256, seq=seq, data=chunk)
                    )
                    seq += 1
                if digest.hexdigest() != sha256:
                    raise ArtifactCorrupt(f"{local} changed while it was being published")
                connection.execute(
                    insert(artifact_blobs).values(sha256=sha256, size=size, chunks=seq)
                )
        except IntegrityError:
            if not self._has_blob(sha256):  # else a concurrent publisher stored it first
                raise

    # fetching (every worker) ------------------------------------------------------------

    def files(self, version: int) -> list[PublishedFile]:
        query = (
            select(artifact_files.c.path, artifact_files.c.sha256, artifact_files.c.size)
            .where(artifact_files.c.version == version)
            .order_by(artifact_files.c.path)
        )
        with self.engine.connect() as connection:
            return [PublishedFile(*row) for row in connection.execute(query)]

    def published_versions(self) -> list[int]:
        query = select(artifact_files.c.version).distinct().order_by(artifact_files.c.version)
        with self.engine.connect() as connection:
            return [int(v) for (v,) in connection.execute(query)]

    def fetch(self, version: int) -> Path:
        """The cached tree of ``version``, fetching the blobs the cache lacks first."""
        files = self.files(version)
        if not files:
            raise ArtifactMissing(f"no artifacts published for version {version}")
        missing = {f.sha256: f for f in files if not self.cache.has_blob(f)}
        if missing:
            total = sum(f.size for f in missing.values())
            log.info("version %d: fetching %d of %d files (%.1f MiB)",
                     version, len(missing), len(files), total / 2**20)  # fmt: skip
        for file in progress_bar(list(missing.values()), desc=f"fetch artifacts v{version}",
                                 unit="file", leave=False):  # fmt: skip
            self._fetch_blob(file)
        tree = self.cache.build_tree(version, files)
        self.cache.collect(in_use=[version])
        return tree

    def _fetch_blob(self, file: PublishedFile) -> Path:
        for attempt in range(1, self.fetch_attempts + 1):
            try:
                return self.cache.write_blob(file, self._chunks(file.sha256))
            except (ArtifactCorrupt, OSError, OperationalError) as exc:
                if attempt == self.fetch_attempts:
                    raise
                log.warning("artifact %s: %s; discarded, fetching again (%d/%d)",
                            file.path, exc, attempt + 1, self.fetch_attempts)  # fmt: skip
                time.sleep(self.retry_wait_s * attempt)
        raise AssertionError("unreachable")

    def _chunks(self, sha256: str) -> Iterator[bytes]:
        """The blob's chunks in order, one query (one chunk in memory) at a time."""
        with self.engine.connect() as connection:
            count = connection.execute(
                select(artifact_blobs.c.chunks).where(artifact_blobs.c.sha256 == sha256)
            ).scalar()
        if count is None:
            raise ArtifactMissing(f"blob {sha256[:12]}... is not in the database")
        for seq in range(int(count)):
            with self.engine.connect() as connection:
                data = connection.execute(
                    select(artifact_chunks.c.data).where(
                        artifact_chunks.c.sha256 == sha256, artifact_chunks.c.seq == seq
                    )
                ).scalar()
            if data is None:
                raise ArtifactCorrupt(f"blob {sha256[:12]}... lacks chunk {seq}")
            yield bytes(data)

    # garbage collection (the offline refresh, after activation) -------------------------

    def collect(self, keep_versions: Iterable[int]) -> dict[str, int]:
        return collect_published(self.engine, keep_versions)

    def sizes(self) -> dict[str, int]:
        """How many blobs the database holds now, and their bytes."""
        with self.engine.connect() as connection:
            blobs, stored = connection.execute(
                select(func.count(), func.coalesce(func.sum(artifact_blobs.c.size), 0))
            ).one()
        return {"blobs": int(blobs), "stored_bytes": int(stored)}


def collect_published(engine: Engine, keep_versions: Iterable[int]) -> dict[str, int]:
    """Drop the file lists of versions not in ``keep_versions`` (never one still being
    built), then the blobs and chunks no remaining list names. Run under the refresh lock:
    a blob uploaded by a run in flight but not listed yet would look unused."""
    keep = [int(v) for v in keep_versions]
    if not keep:
        return {"artifact_versions_collected": 0, "artifact_blobs_collected": 0}
    building = select(serving_versions.c.version).where(serving_versions.c.status == "building")
    with engine.begin() as connection:
        dropped = connection.execute(
            select(artifact_files.c.version).distinct().where(
                artifact_files.c.version.not_in(keep), artifact_files.c.version.not_in(building)
            )
        ).scalars().all()  # fmt: skip
        if dropped:
            connection.execute(delete(artifact_files).where(artifact_files.c.version.in_(dropped)))
        orphans = select(artifact_blobs.c.sha256).where(
            artifact_blobs.c.sha256.not_in(select(artifact_files.c.sha256))
        )
        orphan_ids = connection.execute(orphans).scalars().all()
        for start in range(0, len(orphan_ids), 500):
            part = orphan_ids[start : start + 500]
            connection.execute(delete(artifact_chunks).where(artifact_chunks.c.sha256.in_(part)))
            connection.execute(delete(artifact_blobs).where(artifact_blobs.c.sha256.in_(part)))
    counts = {"artifact_versions_collected": len(dropped),
              "artifact_blobs_collected": len(orphan_ids)}  # fmt: skip
    if len(dropped) or len(orphan_ids):
        log.info("collected published artifacts: %s", counts)
    return counts


def open_artifact_store(settings, engine: Engine) -> DatabaseArtifactStore | None:
    """The configured store; None for ``artifacts.store = local`` (files read in place)."""
    config = settings.artifacts
    if config.store == "local":
        return None
    root = config.cache_dir or Path(settings.data_dir) / "artifact_cache"
    cache = ArtifactCache(root, keep_versions=config.cache_versions)
    return DatabaseArtifactStore(
        engine, cache, int(config.chunk_mb * 2**20), fetch_attempts=config.fetch_attempts
    )
