"""``genrec bench prefix-kv``: how many requests a prefix-KV budget serves from a prefix (app layer).

The refresh gives every active user a cached prefix, or under ``refresh.kv_budget_mb``
the newest users first until the budget is full (``genrec.offline.refresh``). This bench
measures what a budget keeps: it takes a cutoff ``--next-days`` before the store's newest
event, runs the refresh's own prefix-KV step (``precompute_prefix_kv``) up to that cutoff
for unlimited float32, unlimited float16 and budgets of a share of the float16 bytes,
then replays the events after the cutoff in time order and counts the share whose user
has a cache (served from a prefix; the rest are served from their prompt). Each budget
also runs filled in user-id order, so the value of newest first is measured beside it.

The cutoff is a row, as a refresh's is (``max(events.id)`` when it starts): the last row
before the first event newer than the cutoff time. The replay is every event after it;
``late_events`` counts those with an older time (ingested late).

Nothing is written into the store: the caches go to a temporary folder with its own
temporary index database, removed afterwards; the store is only read, so its serving
version and KV versions stay as they were. Models: the store's serving (or active)
model version, else (or with ``--random``) random ``--preset`` models over random
semantic IDs: coverage does not depend on the weights, bytes per user depend only on
the model's shape and H. ``--ml100k`` ingests MovieLens-100K into a temporary store
(in time order, through the ingest writer) instead of reading one.

Cost: each unlimited run computes every active user's cache (O(users x prompt length));
the budget runs link the unlimited float16 files (``reuse_unchanged_kv``), so they cost
O(users) reads and links; the replay is one read of the events after the cutoff. Disk:
the float32 and float16 versions side by side (about 3x the float16 bytes).

Example::

    $ genrec bench prefix-kv --next-days 7 --budgets 0.5,0.25,0.1
    $ genrec bench prefix-kv --ml100k --preset small
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, func, select

from genrec.infra.database import make_engine
from genrec.infra.progress import progress_bar
from genrec.infra.serving_versions import active_serving_version
from genrec.ingest.store import write_events
from genrec.offline.refresh import precompute_prefix_kv
from genrec.online.prefix_kv_store import LocalDirKVStore
from genrec.schemas.tables import events

DAY_MS = 86_400_000
ORDERS = ("newest_first", "user_id")


@dataclass(frozen=True)
class Cutoff:
    """Where the precompute stops and the replay starts."""

    newest_ts_ms: int
    cutoff_ts_ms: int
    cutoff_row: int  # events.id <= cutoff_row: what the precompute reads
    replay_users: list[str]  # the user of each event after cutoff_row, in (ts_ms, id) order
    late_events: int  # replayed events with ts_ms <= cutoff_ts_ms (stored after newer ones)


@dataclass
class BudgetRow:
    """One precompute (a budget, a dtype, an order) and the coverage of the replay."""

    label: str
    dtype: str
    order: str
    budget_fraction: float | None  # of the unlimited float16 bytes; None: unlimited
    budget_bytes: int | None
    total_bytes: int
    users_cached: int
    served_events: int
    coverage: float
    seconds: float
    counts: dict[str, Any] = field(default_factory=dict)


def choose_cutoff(engine: Engine, next_days: float) -> Cutoff:
    """The cutoff ``next_days`` before the newest event, and the events after it."""
    with engine.connect() as connection:
        newest = connection.execute(select(func.max(events.c.ts_ms))).scalar()
        if newest is None:
            raise ValueError("the store holds no events")
        cutoff_ts = int(newest) - int(next_days * DAY_MS)
        first_after = connection.execute(
            select(func.min(events.c.id)).where(events.c.ts_ms > cutoff_ts)
        ).scalar()
        if first_after is None:
            raise ValueError(f"no event in the last {next_days} days")
        cutoff_row = int(first_after) - 1
        replay = connection.execute(
            select(events.c.user_id, events.c.ts_ms)
            .where(events.c.id > cutoff_row)
            .order_by(events.c.ts_ms, events.c.id)
        ).all()
    if cutoff_row < 1:
        raise ValueError(f"no event is older than {next_days} days before the newest")
    late = sum(1 for _user, ts in replay if ts <= cutoff_ts)
    return Cutoff(int(newest), cutoff_ts, cutoff_row, [u for u, _ts in replay], late)


def coverage_of(replay_users: Sequence[str], cached: set[str]) -> tuple[int, float]:
    """Replayed events whose user has a cache, and their share."""
    served = sum(1 for user in replay_users if user in cached)
    return served, served / len(replay_users) if replay_users else 0.0


def run_prefix_kv_bench(
    settings,
    engine: Engine,
    models,
    *,
    next_days: float = 7.0,
    budget_fractions: Sequence[float] = (0.5, 0.25, 0.1),
    scratch: Path | None = None,
    source: str = "",
) -> dict[str, Any]:
    """Precompute up to the cutoff for each budget into a scratch KV store, replay, report.

    ``engine`` (the store) is only read; the KV files and their index live in ``scratch``
    (default: a temporary folder), which is removed at the end.
    """
    cutoff = choose_cutoff(engine, next_days)
    folder = Path(tempfile.mkdtemp(prefix="genrec-prefix-kv-", dir=scratch))
    index_engine = make_engine(f"sqlite:///{folder / 'kv-index.db'}")
    try:
        store = LocalDirKVStore(folder / "kv", index_engine)
        rows = _run_budgets(settings, engine, store, models, cutoff, budget_fractions)
    finally:
        index_engine.dispose()
        shutil.rmtree(folder, ignore_errors=True)
    report = _report(settings, models, cutoff, next_days, rows)
    return {"models": source or f"preset {models.preset}", **report}


def _run_budgets(settings, engine, store, models, cutoff: Cutoff, fractions) -> list[BudgetRow]:
    """Unlimited float32 and float16 computed, then each budget linked from float16's files,
    newest first and in user-id order."""
    plans: list[tuple[str, str, float | None, str]] = [
        ("unlimited", "float32", None, "newest_first"),
        ("unlimited", "float16", None, "newest_first"),
    ]
    plans += [(f"{f:.0%}", "float16", f, order) for f in fractions for order in ORDERS]
    rows: list[BudgetRow] = []
    float16_bytes = 0
    for version, (label, dtype, fraction, order) in enumerate(
        progress_bar(plans, desc="prefix-KV budgets", unit="run"), start=1
    ):
        budget_bytes = None if fraction is None else int(fraction * float16_bytes)
        refresh = settings.refresh.model_copy(update={
            "kv_dtype": dtype, "reuse_unchanged_kv": True,
            "kv_budget_mb": None if budget_bytes is None else max(budget_bytes, 1) / 2**20,
        })  # fmt: skip
        run_settings = settings.model_copy(update={"refresh": refresh})
        started = time.perf_counter()
        kv = precompute_prefix_kv(
            run_settings, engine, store, models, kv_version=version,
            cutoff_row=cutoff.cutoff_row, reuse_from=2 if fraction is not None else None,
            budget_order=order,
        )  # fmt: skip
        seconds = time.perf_counter() - started
        served, coverage = coverage_of(cutoff.replay_users, set(store.user_sizes(version)))
        rows.append(BudgetRow(
            label, dtype, order, fraction, kv["budget_bytes"], int(kv["total_bytes"]),
            int(kv["users"]), served, coverage, round(seconds, 3), _jsonable_counts(kv),
        ))  # fmt: skip
        if fraction is None and dtype == "float16":
            float16_bytes = int(kv["total_bytes"])
    return rows


def _jsonable_counts(kv: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in kv.items() if v is None or isinstance(v, str | int | float)}


def _report(settings, models, cutoff: Cutoff, next_days: float, rows: list[BudgetRow]) -> dict:
    replay = cutoff.replay_users
    return {
        "model_version": None if models.version is None else str(models.version),
        "history_items": models.history_items,
        "active_days": settings.refresh.active_days,
        "next_days": next_days,
        "newest_ts_ms": cutoff.newest_ts_ms,
        "cutoff_ts_ms": cutoff.cutoff_ts_ms,
        "cutoff_row": cutoff.cutoff_row,
        "replay_events": len(replay),
        "replay_users": len(set(replay)),
        "late_events": cutoff.late_events,
        "rows": [asdict(row) for row in rows],
        "pairs": _pairs(rows),
    }


def _pairs(rows: list[BudgetRow]) -> list[dict[str, Any]]:
    """Per budget: newest-first vs user-id coverage and their ratio (unlimited: the same)."""
    by_key = {(r.label, r.dtype, r.order): r for r in rows}
    pairs = []
    for row in rows:
        if row.order != "newest_first":
            continue
        baseline = by_key.get((row.label, row.dtype, "user_id"), row)
        ratio = row.coverage / baseline.coverage if baseline.coverage else None
        pairs.append({
            "budget": row.label, "dtype": row.dtype, "budget_fraction": row.budget_fraction,
            "budget_bytes": row.budget_bytes, "bytes_newest_first": row.total_bytes,
            "users_newest_first": row.users_cached, "users_user_id": baseline.users_cached,
            "coverage_newest_first": row.coverage, "coverage_user_id": baseline.coverage,
            "ratio": ratio,
        })  # fmt: skip
    return pairs


def print_report(report: dict[str, Any]) -> None:
    """One table: budget, dtype, bytes, users cached, coverage both ways, ratio."""
    print(f"prefix-kv: {report['models']}; cutoff row {report['cutoff_row']}, replay of the "
          f"next {report['next_days']:g} days: {report['replay_events']} events of "
          f"{report['replay_users']} users ({report['late_events']} late)")  # fmt: skip
    header = (f"{'budget':>9} {'dtype':>7} {'MiB':>8} {'B/user':>8} {'users':>6} "
              f"{'users(id)':>9} {'newest-first':>12} {'user-id':>8} {'ratio':>6}")  # fmt: skip
    print(header)
    for pair in report["pairs"]:
        users = pair["users_newest_first"]
        per_user = pair["bytes_newest_first"] / users if users else 0
        ratio = "-" if pair["ratio"] is None else f"{pair['ratio']:.2f}"
        print(f"{pair['budget']:>9} {pair['dtype']:>7} {pair['bytes_newest_first'] / 2**20:8.2f} "
              f"{per_user:8.0f} {users:6d} {pair['users_user_id']:9d} "
              f"{pair['coverage_newest_first']:12.1%} {pair['coverage_user_id']:8.1%} "
              f"{ratio:>6}")  # fmt: skip


def write_outputs(report: dict[str, Any], out_dir: Path) -> tuple[Path, Path]:
    """``prefix_kv.json`` and ``prefix_kv.png`` (coverage vs budget) under ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out_dir / "prefix_kv.json", out_dir / "prefix_kv.png"
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    _plot(report, png_path)
    return json_path, png_path


def _plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    float16 = [p for p in report["pairs"] if p["dtype"] == "float16"]
    shares = [1.0 if p["budget_fraction"] is None else p["budget_fraction"] for p in float16]
    figure, axis = plt.subplots(figsize=(6, 3.8))
    axis.plot(shares, [p["coverage_newest_first"] for p in float16], "o-", label="newest first")
    axis.plot(shares, [p["coverage_user_id"] for p in float16], "s--", label="by user id")
    axis.set_xlabel("KV budget (share of the unlimited float16 bytes)")
    axis.set_ylabel("requests served from a prefix")
    axis.set_xlim(0, 1.05)
    axis.set_ylim(0, 1.02)
    axis.set_title(f"replay of the next {report['next_days']:g} days "
                   f"({report['replay_events']} events)")  # fmt: skip
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


# --- the store and the models ------------------------------------------------------------


def ml100k_store(folder: Path) -> Engine:
    """A fresh SQLite store in ``folder`` holding MovieLens-100K's events, written in time
    order through the ingest writer (``users`` kept as ingest keeps it)."""
    from genrec.ingest.replay import ml100k_events, prepare_events  # lazy: pandas, --ml100k only

    engine = make_engine(f"sqlite:///{folder / 'genrec.db'}")
    frame = prepare_events(ml100k_events(), event_id_prefix="ml-100k")
    rows = frame.to_dict("records")
    chunk = 10_000
    for start in progress_bar(range(0, len(rows), chunk), desc="ML-100K into a store",
                              unit="chunk"):  # fmt: skip
        write_events(engine, rows[start : start + chunk])
    return engine


def bench_models(
    settings, engine: Engine, preset: str, history_items: int, random: bool
) -> tuple[Any, str]:
    """The store's serving (else active) model version; random ``preset`` models without one
    (or with ``random``) over the store's items; and what was loaded, in words."""
    # lazy: the model store loads torch; the bench's table and CLI parsing do not need it
    from genrec.app.bench.serve import _random_models
    from genrec.online.models.store import NoActiveModels, load_model_version

    if not random:
        active = active_serving_version(engine)
        pinned = None if active is None or active.model_version is None else active.model_version
        try:
            models = load_model_version(settings, engine,
                                        version=None if pinned is None else int(pinned))  # fmt: skip
            return models, (f"trained model version {models.version} (preset "
                            f"{models.preset}, H = {models.history_items} items)")  # fmt: skip
        except NoActiveModels:
            print("prefix-kv: no trained model version in this store: random models instead")
    with engine.connect() as connection:
        item_ids = sorted(r[0] for r in connection.execute(select(events.c.item_id).distinct()))
    models = _random_models(preset, item_ids, history_items)
    return models, f"random {preset!r} models, H = {history_items} items"
