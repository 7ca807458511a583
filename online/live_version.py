"""Which version the online worker serves, and switching to a new one without a restart.

A *serving version* is everything one request needs that the offline step
publishes atomically: the target and draft models with their semantic IDs, the
prefix-KV version, and the fitted recall branches. ``ServingVersions`` loads the
active one at start, then a background thread probes for a newly activated
version every ``online.version_poll_s`` seconds and loads it *beside* the
current one; the worker picks it up between micro-batches (``current()``), so
no request is served half by one version and half by the other, and none waits
for the load.

Example::

    >>> versions = ServingVersions(probe=lambda: "v1", load=lambda key: ServingBundle(key))
    >>> versions.start(background=False).current().key
    'v1'
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import Engine, select

from genrec.infra import metrics
from genrec.infra.serving_versions import ServingVersion, active_serving_version
from genrec.online.branches import RecallBranch, load_branch
from genrec.online.prefix_kv_store import open_kv_store
from genrec.online.recommender import ModelDecoder
from genrec.online.serving_artifacts import resolve_serving_artifacts
from genrec.schemas.tables import serving_versions

if TYPE_CHECKING:
    from genrec.online.prefix_kv_store import KVStore
    from genrec.online.recommender import GenerativeDecoder

log = logging.getLogger(__name__)


@dataclass
class ServingBundle:
    """One loaded serving version. ``decoder`` None -> traditional branches only."""

    key: str
    decoder: GenerativeDecoder | None = None
    kv_store: KVStore | None = None
    kv_version: Any = None  # as the KV store keys it (an int)
    branches: dict[str, RecallBranch] = field(default_factory=dict)
    model_version: Any = None
    semantic_id_version: Any = None

    def describe(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "model_version": self.model_version,
            "semantic_id_version": self.semantic_id_version,
            "kv_version": self.kv_version,
            "branches": sorted(self.branches),
            "generative": self.decoder is not None,
            "decoding": self.decoder.describe() if hasattr(self.decoder, "describe") else None,
        }


class ServingVersions:
    """Holds the current ``ServingBundle`` and prepares the next one in the background."""

    def __init__(
        self,
        probe: Callable[[], str | None],
        load: Callable[[str], ServingBundle],
        poll_s: float = 5.0,
        retry_failed_s: float = 60.0,
        freeze_gc: bool = False,
    ) -> None:
        """``retry_failed_s``: how long a version whose load failed is left alone before it
        is tried again (a fetch of its artifacts may have failed for a passing reason).
        ``freeze_gc``: after each install, move every object alive (the libraries, the
        models, the branches) out of the cyclic garbage collector's reach (``gc.freeze``):
        a worker allocates many short-lived objects per batch, and each full collection
        walked the ~500k long-lived ones, 0.3-0.6 s a time (on the demo's store about
        1.8 ms of every request's 7 ms went to collections). Objects a later version drops
        are unfrozen and collected at the next install."""
        self.probe, self.load, self.poll_s = probe, load, poll_s
        self.retry_failed_s = retry_failed_s
        self.freeze_gc = freeze_gc
        self._current: ServingBundle | None = None
        self._pending: ServingBundle | None = None
        self._failed_key: str | None = None
        self._failed_at = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, background: bool = True) -> ServingVersions:
        """Load the active version now (``ServingBundle("none")`` if nothing is active yet)."""
        key = self.probe()
        bundle = self.load(key) if key is not None else ServingBundle("none")
        if key is None:
            log.warning("no serving version is active yet: serving empty lists until one is")
        self._install(bundle)
        if background:
            self._thread = threading.Thread(target=self._watch, name="genrec-versions", daemon=True)
            self._thread.start()
        return self

    def current(self) -> ServingBundle:
        """The bundle for the next micro-batch; swaps in a freshly loaded version."""
        with self._lock:
            if self._pending is not None:
                self._install(self._pending)
                self._pending = None
                metrics.VERSION_SWITCHES.inc()
            assert self._current is not None, "call start() first"
            return self._current

    def check_now(self) -> bool:
        """Probe once and, if a new version is active, load it as pending. True if one was."""
        key = self.probe()
        with self._lock:
            known = {self._current.key if self._current else None}
            if time.monotonic() - self._failed_at < self.retry_failed_s:
                known.add(self._failed_key)
            if self._pending is not None:
                known.add(self._pending.key)
        if key is None or key in known:
            return False
        log.info("new serving version %s is active; loading it", key)
        try:
            bundle = self.load(key)
        except Exception:
            log.exception("loading serving version %s failed; keeping the current one", key)
            metrics.ERRORS.labels(component="online", kind="version_load").inc()
            self._failed_key, self._failed_at = key, time.monotonic()
            return False
        with self._lock:
            self._pending = bundle
        return True

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.poll_s + 5)

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.check_now()
            except Exception:  # the probe's database may be briefly away: try again later
                log.exception("probing for a new serving version failed")
                metrics.ERRORS.labels(component="online", kind="version_probe").inc()

    def _install(self, bundle: ServingBundle) -> None:
        if self._current is not None:
            old = self._current.describe()
            metrics.SERVING_VERSION.labels(*_version_labels(old)).set(0)
        self._current = bundle
        metrics.SERVING_VERSION.labels(*_version_labels(bundle.describe())).set(1)
        log.info("serving version %s", bundle.key, extra={"fields": bundle.describe()})
        if self.freeze_gc:
            # once per version (a full collection, a fraction of a second): what the
            # previous install froze and is garbage now is collected, the rest frozen again
            gc.unfreeze()
            gc.collect()
            gc.freeze()


def _version_labels(described: dict[str, Any]) -> tuple[str, str, str]:
    return tuple(str(described[k]) for k in ("model_version", "semantic_id_version", "kv_version"))


# --- the production probe and loader -------------------------------------------------------


def active_serving_key(engine: Engine) -> str | None:
    """The active row of ``serving_versions`` (see ``genrec.infra.serving_versions``) as a key."""
    active = active_serving_version(engine)
    return None if active is None else str(active.version)


def serving_version_row(engine: Engine, key: str):
    """Row ``key`` of ``serving_versions`` (a ``ServingVersion``), whether or not still active.

    The worker loads exactly what this row pins: by the time a load finishes another
    version may be active, and the next probe picks that one up.
    """
    with engine.connect() as connection:
        row = connection.execute(
            select(serving_versions).where(serving_versions.c.version == int(key))
        ).mappings().first()  # fmt: skip
    if row is None or row["status"] not in ("active", "retired"):
        state = "missing" if row is None else row["status"]
        raise RuntimeError(f"serving version {key} is {state}, not one that was activated")
    return ServingVersion(**{name: row[name] for name in ServingVersion.__dataclass_fields__})


def load_serving_bundle(settings, engine: Engine, key: str) -> ServingBundle:
    """Load serving version ``key``: the model version it pins (target, drafts and the
    semantic IDs they were trained on), its prefix-KV version and the recall branches,
    read from this worker's fetched copy where ``artifacts.store`` publishes them.

    The model is loaded BY VERSION, not as "the active model": training activates a new
    model version before the refresh activates the serving version that pins it.
    """
    # Lazy: torch and transformers load only in a process that loads a model.
    from genrec.online.models.runtime import apply_runtime
    from genrec.online.models.store import load_model_version

    pinned = serving_version_row(engine, key)
    if pinned.model_version is None:
        raise RuntimeError(f"serving version {key} pins no model version")
    artifacts = resolve_serving_artifacts(settings, engine, pinned)  # fetched if published
    models = load_model_version(
        settings, engine, version=int(pinned.model_version), folder=artifacts.model_dir
    )
    models.target.eval()
    for draft in models.drafts.values():
        draft.eval()
    apply_runtime(models, settings.decode.dtype, settings.decode.compile)
    return ServingBundle(
        key=key,
        decoder=ModelDecoder(models, settings.online),
        kv_store=open_kv_store(settings, engine) if pinned.kv_version is not None else None,
        kv_version=pinned.kv_version,
        branches=load_branches(settings, settings.online.branches, artifacts.recall_root),
        model_version=str(models.version),
        semantic_id_version=pinned.semantic_id_version or models.semantic_id_version,
    )


def load_branches(
    settings, names: tuple[str, ...], root: Path | None = None
) -> dict[str, RecallBranch]:
    """Fitted recall branches, one folder each under ``recall.artifacts_dir`` (default
    ``data_dir/recall``); a branch without an artifact is skipped with a warning."""
    if root is None:
        root = settings.recall.artifacts_dir or settings.path("recall", "x").parent
    branches = {}
    for name in names:
        folder = Path(root) / name
        if not (folder / "manifest.json").exists():
            log.warning("recall branch %s has no artifact in %s; serving without it", name, folder)
            continue
        branches[name] = load_branch(folder)
    return branches
