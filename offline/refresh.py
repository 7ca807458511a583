"""One offline refresh run (offline step): new events in, a new serving version out.

A run, under the cross-process lock ``offline-refresh``:

1. reads the behavior store up to a fixed cutoff (``max(events.id)`` at start),
2. refreshes semantic IDs (incremental by default, ``refresh.full_semantic_ids``
   for a full rebuild),
3. retrains the target and/or re-aligns the drafts when configured (a new
   target always re-aligns the drafts: alignment is tied to one target),
4. precomputes every active user's long-history prefix KV (batched, on the GPU
   when present, stored in ``refresh.kv_dtype``) into the KV store under a new KV
   version, reusing last version's file where model and prompt are unchanged; under
   ``refresh.kv_budget_mb`` users are taken newest first until the next one would not
   fit (``KVBudget``); the batches run where ``offline.executor`` says: in this
   process, or on Ray actors that load the model version's target (the same batches,
   the same caches; the store is written here, through the ``KVStore`` interface),
5. with ``artifacts.store = database``, publishes the version's model and recall files
   into the database (``genrec.online.serving_artifacts``) for workers on other hosts,
6. activates the new serving version (semantic-ID, model, KV versions) in one
   database transaction, then garbage-collects old KV versions (and published files).

Failure at any point (exception, SIGTERM, kill -9) leaves the previous version
serving: the new KV version is only reachable through the serving version,
which is activated last. An exception discards the half-built KV version at
once; a killed run's leftovers are marked and collected by the next run. Every
run is a ``job_runs`` row (start, end, status, counts, error).

Example::

    >>> from genrec.infra.settings import get_settings
    >>> from genrec.infra.database import make_engine
    >>> settings = get_settings()
    >>> report = run_refresh(settings, make_engine(settings.database_url))  # doctest: +SKIP
    >>> report.serving_version  # doctest: +SKIP
    3
"""

from __future__ import annotations

import datetime as dt
import hashlib
import logging
import os
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import Engine, func, insert, select, update

from genrec.infra.serving_versions import (
    activate,
    active_serving_version,
    create_candidate,
    mark_failed,
    recent_activated_versions,
)
from genrec.ingest.history import (
    count_inactive_users,
    history_pages,
    load_histories_until,
    users_newest_first,
)
from genrec.offline.artifact_gc import collect_old_versions, collect_published_artifacts
from genrec.offline.executor import (
    load_version_target,
    make_executor,
    model_artifact_dir,
    placed_model,
    sendable_model,
)
from genrec.offline.recall import fit_store_branches, save_branches
from genrec.offline.run_lock import RunLock
from genrec.online.prefix_kv_store import (
    KVShape,
    PrefixKVEntry,
    kv_file_nbytes_bound,
    open_kv_store,
)
from genrec.online.prompts import history_prompt
from genrec.online.serving_artifacts import publish_serving_version
from genrec.schemas.tables import events, items, job_runs, serving_versions

if TYPE_CHECKING:
    from genrec.ingest.history import HistoryEvent

log = logging.getLogger(__name__)

LOCK_NAME = "offline-refresh"
JOB_NAME = "refresh"


class RefreshCancelled(RuntimeError):
    """The run was asked to stop (SIGTERM) or lost its lock; nothing was activated."""


# --- the real steps (tests swap single ones for fakes or failures) --------------------


def refresh_semantic_ids(settings, engine: Engine, full: bool) -> tuple[Any, dict[str, Any]]:
    """New items get semantic IDs; returns (semantic-ID version, summary)."""
    from genrec.offline.semantic_ids.build import build_semantic_ids  # torch, faiss: slow import

    report = build_semantic_ids(settings, engine, full=full)
    return getattr(report, "version", None), _scalars(report)


def train_models(settings, engine: Engine, retrain_target: bool) -> None:
    """Retrain the target (and so the drafts), or re-align only the drafts to it.

    Both end with a new active model version (``model_versions``), which the
    next step loads.
    """
    # torch and transformers load only when a run retrains (slow imports)
    from genrec.offline.training.run import train_for_refresh

    train_for_refresh(settings, engine, preset=settings.refresh.train_preset, target=retrain_target)


def load_models(settings, engine: Engine):
    """The active model version (``GenerativeModels``), its target on the GPU when present."""
    # torch and transformers load only when a run gets this far (slow imports)
    import torch

    from genrec.online.models.store import load_active_models

    torch.set_num_threads(step_threads(settings.refresh.torch_threads))
    models = load_active_models(settings, engine)
    if torch.cuda.is_available():
        models.target.to("cuda")
    models.target.eval()
    return models


def step_threads(configured: int, cpus: int | None = None) -> int:
    """Intra-op torch threads of the refresh's model steps: ``refresh.torch_threads``, but
    never every CPU this process may use (``cpus``; default its affinity set).

    Each torch op ends at a barrier of all its threads, which spin while they wait. With
    every CPU claimed, any other runnable process (ingest, serving, the store's writes)
    deschedules one of them and the op waits a time slice: on a 2-core host under load the
    prefix-KV step ran 6x slower with 2 threads than with 1, at any catalog size
    (docs/scale.md). One CPU is left to the rest of the host.
    """
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(int(configured), (cpus or 1) - 1))


def has_active_model(engine: Engine) -> bool:
    from genrec.online.models.store import active_model_row  # loads torch, transformers

    return active_model_row(engine) is not None


def fit_recall(settings, engine: Engine) -> None:
    """Refit the traditional branches on the store and swap them in where serving reads them."""
    root = settings.recall.artifacts_dir or settings.path("recall", "x").parent
    save_branches(fit_store_branches(settings, engine), root)


def compute_prefix_kv(model, prompts: list[list[int]], model_version: str) -> list:
    from genrec.online.decoding.prefix_kv import compute_prefix_kv as compute  # loads torch

    return compute(model, prompts, model_version, batch_size=max(1, len(prompts)))


DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def prefix_kv_batch(target, task: tuple) -> list:
    """One batch of the prefix-KV step, a page of the executor's pool (here or on a Ray
    actor): ``task`` is (prompts, model version, dtype, compute, to_cpu); returns the
    caches in ``dtype``, None where float16 cannot hold one (``cast_prefix_kvs``)."""
    prompts, model_version, dtype, compute, to_cpu = task
    cast = cast_prefix_kvs(compute(target, prompts, model_version), dtype)
    if to_cpu:  # results travel back to the driver: never as GPU tensors
        cast = [None if kv is None else kv.to("cpu") for kv in cast]
    return cast


def cast_prefix_kvs(prefix_kvs: list, dtype: str) -> list:
    """``prefix_kvs`` in ``dtype`` (``refresh.kv_dtype``), where they were computed; None for
    a cache that float16 cannot hold (a value beyond +-65504 would become inf)."""
    import torch  # the refresh only imports torch once it computes

    target = getattr(torch, dtype)
    out = []
    for prefix_kv in prefix_kvs:
        tensors = prefix_kv.keys + prefix_kv.values
        if target == torch.float16 and any(
            t.numel() and t.abs().max() > torch.finfo(torch.float16).max for t in tensors
        ):
            out.append(None)
            continue
        device = tensors[0].device if tensors else "cpu"
        out.append(prefix_kv if tensors[0].dtype == target else prefix_kv.to(device, target))
    return out


@dataclass
class KVBudget:
    """The byte budget of one KV version (``refresh.kv_budget_mb``; None: no limit).

    Users are offered newest first; the first whose cache would not fit closes the
    budget, and every later user is skipped (newest first, strictly: no smaller cache of
    an older user fills the gap). A user is admitted by the bytes its file will take at
    most (``kv_file_nbytes_bound``; a reused file: its recorded size); once a page is
    written, ``settle`` replaces those bounds by the sizes the store recorded.
    """

    limit_bytes: int | None
    used_bytes: int = 0
    full: bool = False

    @classmethod
    def from_mb(cls, budget_mb: float | None) -> KVBudget:
        return cls(None if budget_mb is None else int(budget_mb * 2**20))

    def admit(self, nbytes: int) -> bool:
        """Count ``nbytes`` in if they fit; else close the budget for good."""
        if self.full or (
            self.limit_bytes is not None and self.used_bytes + nbytes > self.limit_bytes
        ):
            self.full = True
            return False
        self.used_bytes += nbytes
        return True

    def settle(self, admitted_bytes: int, stored_bytes: int) -> None:
        self.used_bytes += stored_bytes - admitted_bytes


@dataclass
class RefreshSteps:
    """The functions one run calls; ``checkpoint(name)`` runs after each step (test hook)."""

    refresh_semantic_ids: Callable[..., tuple[Any, dict[str, Any]]] = refresh_semantic_ids
    train_models: Callable[..., None] = train_models
    load_models: Callable[..., Any] = load_models
    compute_prefix_kv: Callable[..., list] = compute_prefix_kv
    has_active_model: Callable[[Engine], bool] = has_active_model
    fit_recall: Callable[..., None] = fit_recall
    checkpoint: Callable[[str], None] = lambda _name: None


@dataclass
class RefreshReport:
    job_run_id: int
    serving_version: int
    semantic_id_version: Any
    model_version: str | None
    kv_version: int
    event_cutoff_row: int
    counts: dict[str, Any] = field(default_factory=dict)


# --- one run ---------------------------------------------------------------------------


def run_refresh(
    settings,
    engine: Engine,
    *,
    trigger: str = "cli",
    store=None,
    steps: RefreshSteps | None = None,
    lock_wait_s: float = 0.0,
    cancel: threading.Event | None = None,
) -> RefreshReport:
    """Run one refresh now; raises ``LockBusy`` if another run holds the lock.

    On failure the exception propagates after the run is recorded as failed and
    its half-built KV version is discarded; the previous version keeps serving.
    """
    lock = RunLock(engine, LOCK_NAME, lease_s=settings.refresh.lock_lease_s)
    lock.acquire(wait_s=lock_wait_s)
    try:
        run = _Run(settings, engine, store or open_kv_store(settings, engine), steps, lock)
        return run.execute(trigger, cancel or threading.Event())
    finally:
        lock.release()


def precompute_prefix_kv(
    settings,
    engine: Engine,
    store,
    models,
    *,
    kv_version: int,
    cutoff_row: int,
    reuse_from: int | None = None,
    budget_order: str = "newest_first",
) -> dict[str, Any]:
    """The refresh's prefix-KV step alone, into ``store`` (``genrec bench prefix-kv``): the
    users ``settings.refresh`` chooses up to ``cutoff_row``, computed or linked from
    ``reuse_from``; returns the run's ``kv`` counts. Takes no lock and activates nothing.
    ``budget_order="user_id"`` fills a budget in user-id order instead of newest first
    (the bench's baseline; the refresh itself always goes newest first)."""
    if budget_order not in ("newest_first", "user_id"):
        raise ValueError(f"budget_order: newest_first or user_id, got {budget_order!r}")
    run = _Run(settings, engine, store, None, _NoLock())
    run.budget_order = budget_order
    run._precompute_kv(models, kv_version, cutoff_row, reuse_from)
    return run.counts["kv"]


class _NoLock:
    lost = threading.Event()  # never set: nothing can take over a run that holds no lock


class _Run:
    def __init__(self, settings, engine: Engine, store, steps: RefreshSteps | None, lock) -> None:
        self.settings, self.engine, self.store, self.lock = settings, engine, store, lock
        self.steps = steps or RefreshSteps()
        self.counts: dict[str, Any] = {"step_seconds": {}}
        self.cancel = threading.Event()
        self.activated = False
        self._kv_pool = None  # the prefix-KV step's workers, started at its first batch
        self._kv_pool_remote = False
        self._kv_pool_start_s = 0.0  # starting the pool (Ray: actors loading the target)
        self.budget_order = "newest_first"  # "user_id": only the bench's baseline

    def execute(self, trigger: str, cancel: threading.Event) -> RefreshReport:
        self.cancel = cancel
        _recover_abandoned(self.engine)
        previous = active_serving_version(self.engine)
        cutoff_row = _event_cutoff_row(self.engine)
        job_run_id = _start_job_run(self.engine, trigger, self.lock.owner, cutoff_row)
        version = create_candidate(self.engine, job_run_id, cutoff_row)
        log.info("refresh run %d: building serving version %d (events up to row %d)",
                 job_run_id, version, cutoff_row)  # fmt: skip
        try:
            report = self._build_and_activate(job_run_id, version, cutoff_row, previous)
        except BaseException as exc:
            if not self.activated:  # after activation the run has succeeded; just report
                self._fail(job_run_id, version, exc)
            raise
        self._collect_garbage(report)
        return report

    def _build_and_activate(self, job_run_id, version, cutoff_row, previous) -> RefreshReport:
        refresh = self.settings.refresh
        self._step("read", lambda: self._count_inputs(cutoff_row, previous))
        semantic_id_version = None
        if refresh.semantic_ids:
            semantic_id_version, summary = self._step(
                "semantic_ids",
                lambda: self.steps.refresh_semantic_ids(
                    self.settings, self.engine, refresh.full_semantic_ids
                ),
            )
            self.counts["semantic_ids"] = summary
        # The first refresh of a fresh store has no model yet: it must train one.
        first_model = not self.steps.has_active_model(self.engine)
        if (
            first_model
            or refresh.retrain_target
            or refresh.realign_drafts
            or refresh.full_semantic_ids
        ):
            retrain_target = first_model or refresh.retrain_target or refresh.full_semantic_ids
            self._step(
                "train",
                lambda: self.steps.train_models(self.settings, self.engine, retrain_target),
            )
            self.counts["trained"] = "target+drafts" if retrain_target else "drafts"
        models = self._step(
            "load_models", lambda: self.steps.load_models(self.settings, self.engine)
        )
        model_version = None if models.version is None else str(models.version)
        if semantic_id_version is None:
            semantic_id_version = getattr(models, "semantic_id_version", None)
        if refresh.precompute_kv:
            reuse_from = self._reuse_from(previous)
            self._step(
                "prefix_kv", lambda: self._precompute_kv(models, version, cutoff_row, reuse_from)
            )
        if refresh.recall:
            self._step("recall", lambda: self.steps.fit_recall(self.settings, self.engine))
        if self.settings.artifacts.store != "local":  # workers without the data directory
            self.counts["artifacts"] = self._step("publish", lambda: publish_serving_version(
                self.settings, self.engine, version, model_version))  # fmt: skip
        self._step("activate", lambda: self._activate(
            job_run_id, version, semantic_id_version, model_version))  # fmt: skip
        return RefreshReport(job_run_id, version, semantic_id_version, model_version, version,
                             cutoff_row, self.counts)  # fmt: skip

    def _step(self, name: str, action: Callable[[], Any]) -> Any:
        self._check_cancel()
        log.info("refresh step %s", name)
        started = time.perf_counter()
        result = action()
        self.counts["step_seconds"][name] = round(time.perf_counter() - started, 3)
        self.steps.checkpoint(name)
        return result

    def _check_cancel(self) -> None:
        if self.cancel.is_set():
            raise RefreshCancelled("refresh cancelled (shutdown requested)")
        if self.lock.lost.is_set():
            raise RefreshCancelled("refresh lost its lock lease; another run took over")

    def _count_inputs(self, cutoff_row: int, previous) -> None:
        since = previous.event_cutoff_row if previous and previous.event_cutoff_row else 0
        with self.engine.connect() as connection:
            total = connection.execute(select(func.count()).where(events.c.id <= cutoff_row))
            new = connection.execute(
                select(func.count()).where(events.c.id > since, events.c.id <= cutoff_row)
            )
            catalog = connection.execute(select(func.count()).select_from(items))
            self.counts.update(
                events_total=int(total.scalar_one()),
                events_new=int(new.scalar_one()),
                items_total=int(catalog.scalar_one()),
            )

    def _reuse_from(self, previous) -> int | None:
        """The KV version whose unchanged files this run links instead of recomputing."""
        if previous and previous.kv_version is not None and hasattr(self.store, "reuse_many"):
            return previous.kv_version if self.settings.refresh.reuse_unchanged_kv else None
        return None

    def _precompute_kv(self, models, kv_version: int, cutoff_row: int, reuse_from) -> None:
        config = self.settings.refresh
        budget = KVBudget.from_mb(config.kv_budget_mb)
        totals = {"users": 0, "computed": 0, "reused": 0, "skipped_budget": 0,
                  "skipped_dtype": 0}  # fmt: skip
        try:
            for histories in self._kv_pages(cutoff_row, budget, totals):
                self._check_cancel()
                old = {}
                if reuse_from is not None:
                    old = self.store.entries(reuse_from, user_ids=list(histories))
                self._precompute_page(models, kv_version, histories, old, budget, totals)
        finally:
            if self._kv_pool is not None:
                self._kv_pool.close()
                self._kv_pool = None
        skipped_window = 0
        if config.active_days is not None:
            skipped_window = count_inactive_users(
                self.engine, until_row=cutoff_row, active_days=config.active_days
            )
        self.counts["kv"] = {
            **totals, "skipped_window": skipped_window, "dtype": config.kv_dtype,
            "budget_bytes": budget.limit_bytes, **self.store.sizes(kv_version),
            "executor": self.settings.offline.executor,
            "workers_start_seconds": round(self._kv_pool_start_s, 3),
        }  # fmt: skip

    def _kv_pages(self, cutoff_row: int, budget: KVBudget, totals) -> Iterator[dict]:
        """Pages of active users' histories: in database order without a budget (range reads:
        everyone gets a cache, the order does not matter), else newest first, and once the
        budget is full only the remaining users' count (their histories are not read)."""
        config = self.settings.refresh
        pages = dict(until_row=cutoff_row, users_per_page=config.kv_users_per_read,
                     active_days=config.active_days)  # fmt: skip
        if budget.limit_bytes is None or self.budget_order == "user_id":
            yield from history_pages(self.engine, **pages)
            return
        for user_ids in users_newest_first(self.engine, **pages):
            if budget.full:
                totals["skipped_budget"] += len(user_ids)
                continue
            yield load_histories_until(self.engine, user_ids, until_row=cutoff_row)

    def _precompute_page(self, models, kv_version: int, histories, old, budget, totals) -> None:
        """Reuse or compute the prefix KV of one page of users, in page order until the
        budget is full; adds to ``totals``."""
        model_version, dtype = str(models.version), self.settings.refresh.kv_dtype
        shape = KVShape.of(models.target)
        todo: list[tuple[PrefixKVEntry, list[int]]] = []
        reuse: list[tuple[PrefixKVEntry, PrefixKVEntry]] = []
        admitted = 0
        for user_id, history in histories.items():
            item_ids = [e.item_id for e in history]
            prompt = history_prompt(item_ids, models.item_tokens, models.history_items)
            entry = _entry(user_id, kv_version, model_version, history, prompt, dtype)
            before = old.get(user_id)
            same = before is not None and (before.model_version, before.prompt_sha1) == (
                model_version,
                entry.prompt_sha1,
            )
            nbytes = before.nbytes if same else kv_file_nbytes_bound(
                shape, len(prompt), DTYPE_BYTES[dtype], model_version)  # fmt: skip
            if not budget.admit(nbytes):
                totals["skipped_budget"] += len(histories) - len(todo) - len(reuse)
                break
            admitted += nbytes
            if same:
                reuse.append((entry, before))
            else:
                todo.append((entry, prompt))
        if reuse:
            self.store.reuse_many(kv_version, reuse)
        unstorable = self._compute_batches(models, kv_version, model_version, todo)
        totals["skipped_dtype"] += unstorable
        totals["users"] += len(todo) - unstorable + len(reuse)
        totals["computed"] += len(todo) - unstorable
        totals["reused"] += len(reuse)
        if budget.limit_bytes is not None and hasattr(self.store, "entries"):
            written = [e.user_id for e, _ in todo] + [e.user_id for e, _ in reuse]
            stored = self.store.entries(kv_version, user_ids=written).values()
            budget.settle(admitted, sum(e.nbytes for e in stored))

    def _compute_batches(self, models, kv_version, model_version, todo) -> int:
        """Compute, cast and store ``todo``'s caches; returns how many float16 could not hold."""
        todo = sorted(todo, key=lambda pair: len(pair[1]))  # similar lengths: less padding
        batch_size, dtype = self.settings.refresh.kv_batch_size, self.settings.refresh.kv_dtype
        batches = [todo[i : i + batch_size] for i in range(0, len(todo), batch_size)]
        unstorable = 0
        if not batches:
            return 0
        pool = self._kv_workers(models)
        compute, to_cpu = self.steps.compute_prefix_kv, self._kv_pool_remote
        tasks = (([p for _e, p in b], model_version, dtype, compute, to_cpu) for b in batches)
        results = pool.map(prefix_kv_batch, tasks, desc="prefix KV", unit="batch",
                           total=len(batches))  # fmt: skip
        for batch, cast in zip(batches, results, strict=True):
            self._check_cancel()
            pairs = [(e, kv) for (e, _p), kv in zip(batch, cast, strict=True) if kv is not None]
            unstorable += len(batch) - len(pairs)
            self.store.put_many(kv_version, pairs)
            self.steps.checkpoint("prefix_kv_batch")
        if unstorable:
            log.warning("refresh: %d prefix KV caches hold values beyond float16's range; "
                        "those users are served from the prompt (refresh.kv_dtype = "
                        "bfloat16 keeps them)", unstorable)  # fmt: skip
        return unstorable

    def _kv_workers(self, models):
        """The executor's pool for the prefix-KV batches, started once per run: this process
        with the loaded target, or Ray actors that load the version's target from its
        artifact folder (a model never saved travels to them instead)."""
        if self._kv_pool is None:
            started = time.perf_counter()
            executor = make_executor(self.settings)
            self._kv_pool_remote = executor.remote
            build, args = load_version_target, ()
            if executor.remote:
                folder = model_artifact_dir(self.settings, self.engine, models.version)
                if folder is not None:
                    args = (folder,)
                else:
                    build, args = placed_model, (sendable_model(models.target),)
            self._kv_pool = executor.pool("prefix-kv", build, *args, local=models.target,
                                          threads=self.settings.refresh.torch_threads)  # fmt: skip
            self._kv_pool_start_s = time.perf_counter() - started
        return self._kv_pool

    def _activate(self, job_run_id, version, semantic_id_version, model_version) -> None:
        """The one transaction that makes the new version visible (and checks we still own it)."""
        with self.engine.begin() as connection:
            if not self.lock.still_held(connection):
                raise RefreshCancelled("refresh lost its lock lease before activation")
            kv_version = version if self.settings.refresh.precompute_kv else None
            activate(connection, version, semantic_id_version, model_version, kv_version)
            connection.execute(
                update(job_runs)
                .where(job_runs.c.id == job_run_id)
                .values(status="succeeded", finished_at=_utcnow(), counts=_jsonable(self.counts))
            )
        self.activated = True
        log.info("refresh: serving version %d is active (model %s, semantic IDs %s)",
                 version, model_version, semantic_id_version)  # fmt: skip

    def _collect_garbage(self, report: RefreshReport) -> None:
        """After activation: drop KV, model and semantic-ID versions that the ``keep_versions``
        most recent serving versions do not need; plot KV sizes (best effort)."""
        try:
            keep = recent_activated_versions(self.engine, self.settings.refresh.keep_versions)
            report.counts["kv_versions_removed"] = self.store.garbage_collect(keep)
            report.counts.update(collect_old_versions(self.settings, self.engine, keep))
            if self.settings.artifacts.store != "local":
                report.counts.update(collect_published_artifacts(self.engine, keep))
            if "kv" in report.counts and hasattr(self.store, "user_sizes"):
                plot = _plot_kv_sizes(self.store, report.kv_version, self.settings)
                report.counts["kv_size_plot"] = str(plot)
            with self.engine.begin() as connection:
                connection.execute(
                    update(job_runs)
                    .where(job_runs.c.id == report.job_run_id)
                    .values(counts=_jsonable(report.counts))
                )
        except Exception:
            log.exception("refresh: garbage collection after activation failed (harmless)")

    def _fail(self, job_run_id: int, version: int, exc: BaseException) -> None:
        log.error("refresh run %d failed: %s", job_run_id, exc)
        error = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        try:
            mark_failed(self.engine, version)
            if hasattr(self.store, "discard"):
                self.store.discard(version)
            with self.engine.begin() as connection:
                connection.execute(
                    update(job_runs)
                    .where(job_runs.c.id == job_run_id)
                    .values(
                        status="failed",
                        finished_at=_utcnow(),
                        counts=_jsonable(self.counts),
                        error=error[:4000],
                    )
                )
        except Exception:
            log.exception("refresh: could not record the failure; the next run will")


# --- store reads and records ----------------------------------------------------------


def _utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _event_cutoff_row(engine: Engine) -> int:
    with engine.connect() as connection:
        return int(connection.execute(select(func.max(events.c.id))).scalar() or 0)


def _entry(
    user_id: str,
    kv_version: int,
    model_version: str,
    history: Sequence[HistoryEvent],
    prompt,
    dtype: str = "float32",
) -> PrefixKVEntry:
    """The user's index entry; the cutoff is the newest *stored* event read (largest row).

    ``prompt_sha1`` covers what the file depends on besides the model: the prompt tokens
    and, unless float32 (files written before ``kv_dtype`` existed), the stored dtype, so
    a changed ``refresh.kv_dtype`` recomputes instead of reusing files of the old one.
    """
    cutoff = max(history, key=lambda e: e.row)
    tokens = ",".join(map(str, prompt))
    digest = hashlib.sha1((tokens if dtype == "float32" else f"{dtype}:{tokens}").encode())
    return PrefixKVEntry(
        user_id=user_id,
        kv_version=kv_version,
        model_version=model_version,
        cutoff_event_row=cutoff.row,
        cutoff_ts_ms=cutoff.ts_ms,
        cutoff_event_id=cutoff.event_id,
        n_tokens=len(prompt),
        prompt_sha1=digest.hexdigest(),
    )


def _start_job_run(engine: Engine, trigger: str, owner: str, cutoff_row: int) -> int:
    statement = insert(job_runs).values(
        job=JOB_NAME,
        status="running",
        trigger=trigger,
        owner=owner,
        started_at=_utcnow(),
        event_cutoff_row=cutoff_row,
    )
    with engine.begin() as connection:
        return int(connection.execute(statement).inserted_primary_key[0])


def _recover_abandoned(engine: Engine) -> None:
    """Runs left 'running' by a killed process (we hold the lock, so none is alive)."""
    with engine.begin() as connection:
        stale = connection.execute(
            update(job_runs)
            .where(job_runs.c.job == JOB_NAME, job_runs.c.status == "running")
            .values(status="abandoned", finished_at=_utcnow(), error="process died mid-run")
        ).rowcount
        connection.execute(
            update(serving_versions)
            .where(serving_versions.c.status == "building")
            .values(status="failed")
        )
    if stale:
        log.warning("refresh: %d earlier run(s) died mid-run; their leftovers are collected", stale)


def _plot_kv_sizes(store, kv_version: int, settings) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(store.user_sizes(kv_version).values())
    path = settings.path("reports", f"prefix_kv_sizes_v{kv_version}.png")
    figure, axis = plt.subplots(figsize=(6, 3.5))
    axis.hist([s / 1024 for s in sizes], bins=40)
    axis.set_xlabel("prefix KV per user (KiB)")
    axis.set_ylabel("users")
    axis.set_title(f"KV version {kv_version}: {len(sizes)} users, {sum(sizes) / 2**20:.1f} MiB")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def _scalars(report: Any) -> dict[str, Any]:
    """The JSON-friendly scalar fields of a step's report object."""
    fields = getattr(report, "__dict__", {}) if report is not None else {}
    return {k: v for k, v in fields.items() if isinstance(v, str | int | float | bool)}


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value)


def last_runs(engine: Engine, limit: int = 10) -> list[dict[str, Any]]:
    """The most recent refresh runs, newest first (for ``genrec offline refresh --status``)."""
    query = select(job_runs).order_by(job_runs.c.id.desc()).limit(limit)
    with engine.connect() as connection:
        return [dict(row) for row in connection.execute(query).mappings()]
