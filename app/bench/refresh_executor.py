"""``genrec bench refresh-executor``: the refresh's prefix-KV step on ``local`` vs ``ray`` (app layer).

Side by side in one run, for the same store, users, model and batches: the refresh's own
prefix-KV step (``precompute_prefix_kv``, every cache computed, nothing reused) with
``offline.executor = "local"`` and with ``"ray"``, alternating (local, ray, local, ray,
...) ``--repeats`` times, each into a scratch KV store of its own (a temporary folder
and index database, removed afterwards; the store is only read). It prints each run's
seconds, the part of them spent starting its workers (Ray actors loading the target) and
users/s, then the medians and the ratio ray / local, of the whole step and of what
follows the start. On one machine that ratio is the cost of the fan-out (actors started,
each batch's caches carried back through Ray's object store, the driver writing them)
against the work it spreads; on a cluster with more CPUs or GPUs it can fall below 1.
It also checks that both executors wrote the same caches: the same metadata and tensor
bytes in every file (not the file bytes: safetensors orders its header freely).

Ray is connected (or a local Ray started, ``offline.local_cpus``) once before the runs,
and that time is reported apart; each ray run includes starting its actors, as a
refresh does. The actors' torch threads default to the local run's threads divided by
the actors (``--actor-threads``), so both sides use the same cores.

Cost: each run computes every active user's cache (O(users x prompt length)); disk
holds one run's caches at a time.

Example::

    $ genrec bench refresh-executor --ml100k --max-users 300 --preset small
    $ genrec bench refresh-executor --data-dir var/demo --repeats 3
"""

from __future__ import annotations

import hashlib
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, func, select

from genrec.infra.database import make_engine
from genrec.infra.progress import progress_bar
from genrec.ingest.store import write_events
from genrec.offline.ray_cluster import connect_ray
from genrec.offline.refresh import precompute_prefix_kv
from genrec.online.prefix_kv_store import LocalDirKVStore
from genrec.schemas.tables import events

EXECUTORS = ("local", "ray")


def run_executor_bench(
    settings, engine: Engine, models, *, repeats: int = 2, actor_threads: int | None = None,
    source: str = "",
) -> dict[str, Any]:  # fmt: skip
    """Time the prefix-KV step on both executors, alternating; the report ``print_report``
    shows. ``settings.offline`` gives the Ray side's address, actors and in-flight pages."""
    with engine.connect() as connection:
        cutoff_row = int(connection.execute(select(func.max(events.c.id))).scalar() or 0)
    if cutoff_row == 0:
        raise ValueError("the store holds no events")
    threads = settings.refresh.torch_threads
    offline = settings.offline.model_copy(update={"executor": "ray"})
    started = time.perf_counter()
    ray = connect_ray(offline)
    connect_seconds = time.perf_counter() - started
    actors = offline.actors or max(1, int(ray.cluster_resources().get("CPU", 1)))
    offline = offline.model_copy(update={
        "actors": actors, "actor_torch_threads": actor_threads or max(1, threads // actors)})  # fmt: skip
    runs = []
    plan = [name for _ in range(repeats) for name in EXECUTORS]
    for name in progress_bar(plan, desc="refresh executors", unit="run"):
        run_settings = settings.model_copy(update={
            "offline": offline.model_copy(update={"executor": name})})  # fmt: skip
        runs.append(_timed_run(run_settings, engine, models, cutoff_row, name))
    return _report(settings, offline, models, runs, connect_seconds, cutoff_row, source)


def _timed_run(settings, engine: Engine, models, cutoff_row: int, name: str) -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp(prefix=f"genrec-executor-{name}-"))
    index_engine = make_engine(f"sqlite:///{folder / 'kv-index.db'}")
    try:
        store = LocalDirKVStore(folder / "kv", index_engine)
        started = time.perf_counter()
        kv = precompute_prefix_kv(settings, engine, store, models, kv_version=1,
                                  cutoff_row=cutoff_row)  # fmt: skip
        seconds = time.perf_counter() - started
        digest = _files_digest(folder / "kv")
    finally:
        index_engine.dispose()
        shutil.rmtree(folder, ignore_errors=True)
    users, start = int(kv["users"]), float(kv.get("workers_start_seconds") or 0.0)
    return {"executor": name, "seconds": round(seconds, 3), "start_seconds": round(start, 3),
            "compute_seconds": round(seconds - start, 3), "users": users,
            "users_per_s": round(users / seconds, 1) if seconds else None,
            "total_bytes": int(kv["total_bytes"]), "files_sha256": digest}  # fmt: skip


def _files_digest(root: Path) -> str:
    """One sha256 over every cache file's relative path, metadata and tensors (names,
    dtypes, shapes, bytes), in path and name order. Not the file bytes: safetensors
    writes the header's keys in no fixed order."""
    import json

    import torch
    from safetensors import safe_open

    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*.safetensors") if p.is_file()):
        with safe_open(str(path), framework="pt") as handle:
            header = {"path": str(path.relative_to(root)), "metadata": handle.metadata()}
            digest.update(json.dumps(header, sort_keys=True).encode())
            for name in sorted(handle.keys()):
                tensor = handle.get_tensor(name).contiguous()
                digest.update(f"{name}:{tensor.dtype}:{list(tensor.shape)}".encode())
                digest.update(tensor.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _report(settings, offline, models, runs, connect_seconds, cutoff_row, source) -> dict:
    medians = {
        name: statistics.median(r["seconds"] for r in runs if r["executor"] == name)
        for name in EXECUTORS
    }
    after_start = {
        name: statistics.median(r["compute_seconds"] for r in runs if r["executor"] == name)
        for name in EXECUTORS
    }
    digests = {r["files_sha256"] for r in runs}
    return {
        "models": source or f"preset {models.preset}",
        "cutoff_row": cutoff_row,
        "users": runs[0]["users"],
        "kv_batch_size": settings.refresh.kv_batch_size,
        "kv_dtype": settings.refresh.kv_dtype,
        "local_torch_threads": settings.refresh.torch_threads,
        "ray": {
            "address": offline.ray_address or "local Ray started in this process",
            "actors": offline.actors,
            "actor_torch_threads": offline.actor_torch_threads,
            "connect_seconds": round(connect_seconds, 3),
        },
        "runs": runs,
        "median_seconds": medians,
        "ratio_ray_over_local": medians["ray"] / medians["local"] if medians["local"] else None,
        "median_seconds_after_start": after_start,
        "ratio_after_start": (
            after_start["ray"] / after_start["local"] if after_start["local"] else None
        ),
        "same_caches": len(digests) == 1,
    }


def print_report(report: dict[str, Any]) -> None:
    ray = report["ray"]
    print(f"refresh-executor: {report['models']}; {report['users']} users, batches of "
          f"{report['kv_batch_size']}, {report['kv_dtype']}; local: "
          f"{report['local_torch_threads']} torch threads; ray: {ray['actors']} actors x "
          f"{ray['actor_torch_threads']} threads ({ray['address']}, connected in "
          f"{ray['connect_seconds']:.1f} s)")  # fmt: skip
    print(f"{'run':>4} {'executor':>8} {'seconds':>8} {'start':>7} {'after':>7} {'users/s':>8}")
    for number, run in enumerate(report["runs"], start=1):
        print(f"{number:>4} {run['executor']:>8} {run['seconds']:8.2f} {run['start_seconds']:7.2f} "
              f"{run['compute_seconds']:7.2f} {run['users_per_s']:8.1f}")  # fmt: skip
    for label, key, ratio_key in (("step", "median_seconds", "ratio_ray_over_local"),
                                  ("after start", "median_seconds_after_start",
                                   "ratio_after_start")):  # fmt: skip
        medians, ratio = report[key], report[ratio_key]
        print(f"median {label}: local {medians['local']:.2f} s, ray {medians['ray']:.2f} s; "
              f"ray / local {'-' if ratio is None else f'{ratio:.2f}'}")  # fmt: skip
    print(f"same caches: {report['same_caches']}")


def ml100k_users_store(folder: Path, max_users: int | None) -> Engine:
    """A fresh SQLite store in ``folder`` with MovieLens-100K's events of its first
    ``max_users`` users (all without), in time order through the ingest writer."""
    from genrec.ingest.replay import ml100k_events, prepare_events

    engine = make_engine(f"sqlite:///{folder / 'genrec.db'}")
    frame = ml100k_events()
    if max_users is not None:
        frame = frame[frame.user_id.astype(int) <= max_users]
    rows = prepare_events(frame, event_id_prefix="ml-100k").to_dict("records")
    for start in range(0, len(rows), 10_000):
        write_events(engine, rows[start : start + 10_000])
    return engine
