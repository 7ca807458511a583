"""``genrec bench scale``: every pipeline stage at growing sizes, each in a fresh store (app layer).

For each size (users x items x events) the bench makes a scratch data folder with its own
store (SQLite in the folder; with a PostgreSQL ``database_url``, a fresh database on that
server), generates the workload with ``genrec synthetic --out``, and runs each stage as its
own ``python -m genrec.app.cli ...`` process: the same commands an operator runs, so the
harness keeps measuring whatever those commands do as their internals change. Where no
command exists (the FAISS build alone, the trie and its tables, one serving batch) a small
entry point of this bench runs instead (``genrec.app.bench.scale_stages``).

Per stage it records wall time, CPU time, the peak RSS of every process the stage started
(the child's ``ru_maxrss`` from ``os.wait4``; its own children's ``VmHWM`` sampled from
``/proc`` every half second), the bytes under the data folder afterwards, and what the
stage reports about itself (collision rate before dedup, trie bytes, HR@10, ...). Between
consecutive sizes it computes each stage's growth exponent ``log(t2/t1) / log(n2/n1)``
against the stage's own input: events for ingest, recall, training and evaluation; items
for embedding, RQ-VAE, FAISS, the trie and one serving batch; users for the prefix KV.
A stage that fails or passes ``stage_timeout_s`` is recorded as such with the tail of its
log, the stages that need it are skipped, and the run goes on with the next size.

Ingest is the real path: ``genrec replay`` produces the Parquet log to a topic of the size's
own (on a private local broker started for the run unless ``kafka='configured'``), then
``genrec ingest --exit-when-idle`` consumes it into the store; the stage checks that the
store holds every produced event.

With ``keep_stores`` each size's folder also holds ``stages.json``, its rows so far, written
after every stage; ``resume`` (``--resume``) runs a size on that kept store again and skips
the stages that were ok there, unless a stage they need runs again now (a stage that
failed, timed out or was not asked for then). Replay is re-run with ingest, whose topic
lived on the earlier run's broker. The resumed rows keep their earlier figures and say so
(``resumed``); the flags the figures depend on (text, seed, preset, ...) must match.

Cost: the bench itself holds one size's figures; the stages cost what they cost, which is
what it measures. Disk: one size's store and Parquet at a time (removed after the size
unless ``keep_stores``), plus the broker's log of every size's topic.

Example::

    $ genrec bench scale --sizes 2k:5k:50k,20k:50k:500k --no-text --preset tiny
    $ genrec bench scale --stages synthetic,ingest,semantic-ids --sizes 10k:10k:200k
    $ genrec bench scale --sizes 1M:1M:20M --keep-stores --resume   # again after a failure
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from genrec.infra.progress import progress_bar

log = logging.getLogger(__name__)

DEFAULT_SIZES = "10k:10k:200k,100k:100k:2M,1M:1M:20M"
RSS_LIMIT_BYTES = 12 * 2**30  # the aim: no process above 12 GiB at the largest size
SERVING_GROWTH_LIMIT = 1.5  # per-request latency, largest catalog / smallest
COLLISION_LIMIT = 0.05  # collision rate before dedup
SAMPLE_S = 0.5  # how often the processes of a running stage are sampled
LOG_TAIL_CHARS = 2000
_SUFFIXES = {"": 1, "k": 1_000, "m": 1_000_000}


# --- sizes and growth (pure) -------------------------------------------------------------


@dataclass(frozen=True)
class Size:
    """One workload: ``users:items:events``."""

    users: int
    items: int
    events: int

    @property
    def label(self) -> str:
        return ":".join(format_count(n) for n in (self.users, self.items, self.events))

    def of(self, kind: str) -> int:
        """The stage input of this size: ``users``, ``items`` or ``events``."""
        return {"users": self.users, "items": self.items, "events": self.events}[kind]


def parse_count(text: str) -> int:
    """``500``, ``10k``, ``2M``, ``1.5k`` -> an integer (k = 1,000, M = 1,000,000)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*", text)
    if match is None:
        raise ValueError(f"not a count: {text!r} (e.g. 500, 10k, 2M)")
    value = float(match.group(1)) * _SUFFIXES[match.group(2).lower()]
    if value < 1 or value != int(value):
        raise ValueError(f"not a positive whole count: {text!r}")
    return int(value)


def format_count(n: int) -> str:
    """The shortest of ``n``, ``nk``, ``nM`` that is exact."""
    for suffix, factor in (("M", 1_000_000), ("k", 1_000)):
        if n >= factor and n % factor == 0:
            return f"{n // factor}{suffix}"
    return str(n)


def parse_sizes(text: str) -> list[Size]:
    """``USERS:ITEMS:EVENTS[,...]`` -> sizes, smallest first as given; each must grow."""
    sizes = []
    for part in (p for p in text.split(",") if p.strip()):
        fields = part.strip().split(":")
        if len(fields) != 3:
            raise ValueError(f"a size is USERS:ITEMS:EVENTS, e.g. 10k:10k:200k; got {part!r}")
        sizes.append(Size(*(parse_count(f) for f in fields)))
    if not sizes:
        raise ValueError("no size given")
    if len(set(sizes)) != len(sizes):
        raise ValueError("a size is given twice")
    return sizes


def growth_exponent(t1: float, t2: float, n1: int, n2: int) -> float | None:
    """``log(t2/t1) / log(n2/n1)``: 1 for linear growth; None without two positive times or
    two different inputs."""
    if t1 is None or t2 is None or t1 <= 0 or t2 <= 0 or n1 <= 0 or n2 <= 0 or n1 == n2:
        return None
    return math.log(t2 / t1) / math.log(n2 / n1)


def n_log_n_exponent(n1: int, n2: int) -> float:
    """The exponent n log n itself shows from ``n1`` to ``n2`` (a bit above 1)."""
    n1, n2 = max(n1, 2), max(n2, 2)
    return math.log((n2 * math.log(n2)) / (n1 * math.log(n1))) / math.log(n2 / n1)


# --- stages ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stage:
    """One process of the pipeline; ``parts`` are rows read from its own timings."""

    name: str
    input_kind: str  # users | items | events: what its exponent is taken against
    needs: tuple[str, ...]
    what: str
    parts: tuple[tuple[str, str], ...] = ()  # (row name, input kind)


STAGES: tuple[Stage, ...] = (
    Stage("synthetic", "events", (), "genrec synthetic --out: the Parquet workload"),
    Stage("replay", "events", ("synthetic",), "genrec replay: the log produced to Kafka"),
    Stage("ingest", "events", ("replay",), "genrec ingest until the store holds every event"),
    Stage(
        "semantic-ids",
        "items",
        ("ingest",),
        "genrec offline semantic-ids --full: embedding, RQ-VAE, dedup, FAISS, report",
        (("embedding", "items"), ("rqvae+dedup", "items")),
    ),  # fmt: skip
    Stage("faiss", "items", ("semantic-ids",), "the FAISS item index built alone"),
    Stage("trie", "items", ("semantic-ids",), "the valid-ID trie and its batched tables"),
    Stage("recall", "events", ("ingest",), "genrec offline fit-recall: popularity, item-CF, ANN"),
    Stage("train", "events", ("semantic-ids",), "genrec offline train: target and drafts"),
    Stage(
        "refresh",
        "users",
        ("train", "recall"),
        "genrec offline refresh --no-semantic-ids: load, prefix KV, recall, activation",
        (("prefix-kv", "users"), ("activation", "users")),
    ),  # fmt: skip
    Stage("serve", "items", ("refresh",), "one serving batch through the recommender"),
    Stage("eval", "events", ("train", "recall"), "genrec eval: every ranker, leave-one-out"),
)
STAGE_NAMES = tuple(stage.name for stage in STAGES)
_BY_NAME = {stage.name: stage for stage in STAGES}


def select_stages(names: Sequence[str] | None) -> list[Stage]:
    """The stages asked for plus every stage they need (a fresh store per size), in order."""
    if not names:
        return list(STAGES)
    unknown = sorted(set(names) - set(STAGE_NAMES))
    if unknown:
        raise ValueError(f"unknown stages {unknown}; known: {', '.join(STAGE_NAMES)}")
    wanted: set[str] = set()
    pending = list(names)
    while pending:
        name = pending.pop()
        if name not in wanted:
            wanted.add(name)
            pending.extend(_BY_NAME[name].needs)
    return [stage for stage in STAGES if stage.name in wanted]


@dataclass(frozen=True)
class ScaleConfig:
    """What one ``bench scale`` run does."""

    sizes: tuple[Size, ...]
    stages: tuple[str, ...] = ()  # empty: all
    text: bool = True
    preset: str | None = None  # training preset; None: model.preset
    train_max_steps: int | None = None
    eval_users: int | None = 2000  # genrec eval --max-users (None: every test user)
    serve_batch: int = 32
    serve_batches: int = 3  # timed batches after one warm-up batch
    stage_timeout_s: float = 3600.0
    ingest_idle_s: float = 10.0
    seed: int = 0
    kafka: str = "local"  # local: a private broker for the run; configured: settings.kafka
    keep_stores: bool = False
    resume: bool = False  # a size's kept store: its stages that were ok are not run again


@dataclass
class StageResult:
    """One stage at one size."""

    stage: str
    size: str
    input_kind: str
    n: int
    status: str  # ok | failed | timeout | skipped
    seconds: float | None = None  # wall seconds the stage's work took (see ``note``)
    # the stage's own timing of its work, without the process start (imports, loading)
    work_s: float | None = None
    wall_s: float | None = None
    cpu_s: float | None = None
    peak_rss_bytes: int | None = None  # the largest of its processes
    processes: dict[str, int] = field(default_factory=dict)  # "pid name" -> peak RSS bytes
    disk_bytes: int | None = None
    figures: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    note: str | None = None
    part_of: str | None = None  # a row read from another stage's timings
    resumed: bool = False  # measured by an earlier run on the same kept store (``resume``)


# --- running one process -----------------------------------------------------------------


@dataclass
class ProcessRun:
    returncode: int | None  # None: killed at the timeout
    wall_s: float
    cpu_s: float
    peak_rss_bytes: int
    processes: dict[str, int]


def run_measured(
    command: Sequence[str],
    env: dict[str, str],
    log_path: Path,
    *,
    timeout_s: float,
    desc: str,
    stdout_path: Path | None = None,
) -> ProcessRun:
    """Run ``command`` to its end (or ``timeout_s``), sampling the peak RSS of it and of
    every process below it; stderr (and stdout unless ``stdout_path``) to ``log_path``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as files:
        err = files.enter_context(log_path.open("ab"))
        out = files.enter_context(stdout_path.open("wb")) if stdout_path else err
        started = time.monotonic()
        # a session of its own: at the timeout the whole group (its children too) is stopped
        process = subprocess.Popen(command, env=env, stdout=out, stderr=err,
                                   start_new_session=True)  # fmt: skip
        peaks: dict[int, tuple[str, int]] = {}
        timed_out = False
        try:
            with progress_bar(desc=desc, unit="s", total=None) as bar:
                while True:
                    pid, status, usage = os.wait4(process.pid, os.WNOHANG)
                    if pid:
                        break
                    _sample_tree(process.pid, peaks)
                    elapsed = time.monotonic() - started
                    bar.update(SAMPLE_S)
                    if elapsed > timeout_s and not timed_out:
                        timed_out = True
                        _stop_group(process.pid)
                    time.sleep(SAMPLE_S)
        except BaseException:
            # the bench is stopped (SIGTERM, Ctrl-C): its own session does not get the signal
            _stop_group(process.pid)
            raise
        wall = time.monotonic() - started
    process.returncode = os.waitstatus_to_exitcode(status)  # Popen must not wait again
    name = " ".join(Path(part).name for part in command[:5])
    peaks[process.pid] = (name, max(usage.ru_maxrss * 1024, peaks.get(process.pid, ("", 0))[1]))
    processes = {f"{pid} {label}": peak for pid, (label, peak) in peaks.items()}
    return ProcessRun(
        None if timed_out else process.returncode, wall,
        usage.ru_utime + usage.ru_stime, max(processes.values()), processes,
    )  # fmt: skip


def _stop_group(pid: int, grace_s: float = 20.0) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            return
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def _sample_tree(root: int, peaks: dict[int, tuple[str, int]]) -> None:
    """Record the high-water RSS (VmHWM) of ``root`` and of every process below it."""
    parents: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = Path(entry.path, "stat").read_text()
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    tree, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent and pid not in tree]
        tree.update(children)
        frontier.extend(children)
    for pid in tree:
        with contextlib.suppress(OSError, ValueError):
            status = Path(f"/proc/{pid}/status").read_text()
            hwm = re.search(r"VmHWM:\s+(\d+) kB", status)
            if hwm is None:
                continue
            if pid not in peaks:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                label = " ".join(Path(p.decode(errors="replace")).name for p in cmdline[:5] if p)
                peaks[pid] = (label[:80], 0)
            label, peak = peaks[pid]
            peaks[pid] = (label, max(peak, int(hwm.group(1)) * 1024))


def disk_bytes(folder: Path) -> int:
    """Bytes of the files under ``folder`` (a hard-linked file counted once)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for root, _dirs, files in os.walk(folder):
        for name in files:
            with contextlib.suppress(OSError):
                stat = os.lstat(os.path.join(root, name))
                if (stat.st_dev, stat.st_ino) not in seen:
                    seen.add((stat.st_dev, stat.st_ino))
                    total += stat.st_size
    return total


def log_tail(path: Path, chars: int = LOG_TAIL_CHARS) -> str:
    with contextlib.suppress(OSError):
        with path.open("rb") as handle:
            handle.seek(max(0, path.stat().st_size - chars))
            return handle.read().decode(errors="replace")
    return ""


# --- one size ----------------------------------------------------------------------------


@dataclass
class SizeRun:
    """The folders and environment of one size's fresh store."""

    size: Size
    index: int
    root: Path
    env: dict[str, str]
    config: ScaleConfig
    database_url: str
    drop_database: Callable[[], None] | None = None
    produced: int | None = None
    earlier: list[StageResult] = field(default_factory=list)  # the kept store's record

    @property
    def data_dir(self) -> Path:
        return self.root / "data"

    @property
    def parquet_dir(self) -> Path:
        return self.root / "parquet"

    @property
    def logs(self) -> Path:
        return self.root / "logs"


def _genrec(*args: str) -> list[str]:
    return [sys.executable, "-m", "genrec.app.cli", *args]


def _stage_entry(*args: str) -> list[str]:
    return [sys.executable, "-m", "genrec.app.bench.scale_stages", *args]


def stage_command(stage: str, run: SizeRun) -> list[str]:
    """The process that runs ``stage`` for ``run``'s size."""
    size, config, figures = run.size, run.config, run.logs / f"{stage}.json"
    if stage == "synthetic":
        return _genrec("synthetic", "--users", str(size.users), "--items", str(size.items),
                       "--events", str(size.events), "--seed", str(config.seed),
                       *(() if config.text else ("--no-text",)), "--out", str(run.parquet_dir))  # fmt: skip
    if stage == "replay":
        return _genrec("replay", "--events", str(run.parquet_dir / "events.parquet"),
                       "--items", str(run.parquet_dir / "items.parquet"))  # fmt: skip
    if stage == "ingest":
        return _genrec("ingest", "--exit-when-idle", f"{config.ingest_idle_s:g}")
    if stage == "semantic-ids":
        return _genrec("offline", "semantic-ids", "--full", "--json", str(figures))
    if stage in ("faiss", "trie"):
        return _stage_entry(stage, "--json", str(figures))
    if stage == "serve":
        return _stage_entry("serve", "--json", str(figures), "--batch", str(config.serve_batch),
                            "--batches", str(config.serve_batches))  # fmt: skip
    if stage == "recall":
        return _genrec("offline", "fit-recall")
    if stage == "train":
        preset = ("--preset", config.preset) if config.preset else ()
        steps = ("--max-steps", str(config.train_max_steps)) if config.train_max_steps else ()
        return _genrec("offline", "train", *preset, *steps)
    if stage == "refresh":
        return _genrec("offline", "refresh", "--no-semantic-ids")
    if stage == "eval":
        users = ("--max-users", str(config.eval_users)) if config.eval_users else ()
        return _genrec("eval", "--json", str(figures), *users)
    raise ValueError(f"unknown stage {stage!r}")


def run_size(run: SizeRun, stages: Sequence[Stage]) -> list[StageResult]:
    """Every stage at one size, in order; a failed stage's dependants are skipped. On a
    resumed store, a stage that was ok before is not run again unless one it needs ran now.
    The size's record (``stages.json``) is rewritten after every stage."""
    results: list[StageResult] = []
    done: set[str] = set()
    ran: set[str] = set()
    for stage in stages:
        missing = [need for need in stage.needs if need not in done]
        n = run.size.of(stage.input_kind)
        if missing:
            results.append(StageResult(stage.name, run.size.label, stage.input_kind, n,
                                       "skipped", note=f"needs {', '.join(missing)}"))  # fmt: skip
            print(f"scale {run.size.label}: {stage.name} skipped (needs {', '.join(missing)})",
                  flush=True)  # fmt: skip
            continue
        earlier = reusable_rows(stage, run.earlier, ran)
        if earlier:
            results.extend(earlier)
            done.add(stage.name)
            if stage.name == "replay":
                run.produced = earlier[0].figures.get("produced")
            print(f"scale {run.size.label}: {stage.name} ok in an earlier run "
                  f"({earlier[0].seconds or 0:.1f} s), not run again (--resume)", flush=True)  # fmt: skip
            continue
        result = _run_stage(stage, run, n)
        ran.add(stage.name)
        results.append(result)
        results.extend(_part_rows(stage, run, result))
        if result.status == "ok":
            done.add(stage.name)
        save_size_record(run, results, ran)
    return results


# --- resuming a kept store ---------------------------------------------------------------

RECORD_NAME = "stages.json"
# The flags a kept store's results depend on: resuming under other values would mix runs.
RESUME_FLAGS = ("text", "seed", "preset", "train_max_steps", "eval_users", "serve_batch",
                "serve_batches")  # fmt: skip


class ResumeMismatch(ValueError):
    """A kept store was made with other flags than the run that would resume it."""


def reusable_rows(stage: Stage, earlier: Sequence[StageResult], ran: set[str]) -> list[StageResult]:
    """``stage``'s rows (its own and its parts) from the kept store's record, marked
    resumed, when it was ok there and nothing it needs ran again now; else none. Replay
    counts as ok only with ingest: its topic lived on the earlier run's broker."""
    if any(need in ran for need in stage.needs):
        return []
    ok = {row.stage for row in earlier if row.status == "ok" and row.part_of is None}
    if stage.name not in ok or (stage.name == "replay" and "ingest" not in ok):
        return []
    rows = [row for row in earlier if stage.name in (row.stage, row.part_of)]
    return [StageResult(**{**asdict(row), "resumed": True}) for row in rows]


def save_size_record(run: SizeRun, results: Sequence[StageResult], ran: set[str]) -> None:
    """The size's rows so far, plus the earlier record's rows of stages this run has not
    reached that nothing run now invalidates, written atomically beside the store."""
    now = {row.stage for row in results} | {row.part_of for row in results if row.part_of}
    stale = _dependants(ran)
    kept = [row for row in run.earlier
            if (row.part_of or row.stage) not in now and (row.part_of or row.stage) not in stale]  # fmt: skip
    record = {
        "size": run.size.label,
        "flags": {name: getattr(run.config, name) for name in RESUME_FLAGS},
        "postgres_database": _postgres_name(run.database_url),
        "rows": [asdict(row) for row in [*kept, *results]],
    }
    path = run.root / RECORD_NAME
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(record, indent=1, default=str))
    os.replace(temporary, path)


def _postgres_name(url: str) -> str | None:
    """The database of a PostgreSQL URL (the record names it, never the URL's credentials)."""
    if not url.startswith("postgresql"):
        return None
    from sqlalchemy.engine import make_url

    return make_url(url).database


def _dependants(names: set[str]) -> set[str]:
    """Every stage that needs one of ``names``, directly or through others."""
    found = set(names)
    for stage in STAGES:  # pipeline order: a stage's needs come before it
        if found.intersection(stage.needs):
            found.add(stage.name)
    return found


def load_size_record(root: Path, config: ScaleConfig) -> dict[str, Any] | None:
    """The kept store's record at ``root`` (None when there is no kept store to resume);
    ``ResumeMismatch`` when it was made with other flags."""
    path, data = root / RECORD_NAME, root / "data"
    if not path.exists():
        if data.exists() and any(data.iterdir()):  # a store from before records were kept
            raise ResumeMismatch(f"{root}: a store without a record of its stages "
                                 f"({RECORD_NAME}) cannot be resumed; move it away, or run "
                                 "without --resume to start this size afresh")  # fmt: skip
        return None
    if not data.exists():
        return None
    record = json.loads(path.read_text())
    flags = {name: getattr(config, name) for name in RESUME_FLAGS}
    kept = record.get("flags", {})
    differ = {k: (kept.get(k), v) for k, v in flags.items() if kept.get(k) != v}
    if differ:
        detail = ", ".join(f"{k} {old!r} there, {new!r} now" for k, (old, new) in differ.items())
        raise ResumeMismatch(f"{root}: the kept store was made with other flags ({detail}); "
                             "run with the same flags, or without --resume for a fresh store")  # fmt: skip
    return record


def _run_stage(stage: Stage, run: SizeRun, n: int) -> StageResult:
    label = run.size.label
    if stage.name == "replay":
        _create_topics(run)
    print(f"scale {label}: {stage.name} started ({stage.what})", flush=True)
    log_path = run.logs / f"{stage.name}.log"
    stdout_path = run.logs / f"{stage.name}.out" if stage.name in ("refresh", "replay") else None
    measured = run_measured(
        stage_command(stage.name, run), run.env, log_path,
        timeout_s=run.config.stage_timeout_s, desc=f"scale {label} {stage.name}",
        stdout_path=stdout_path,
    )  # fmt: skip
    result = StageResult(
        stage.name, label, stage.input_kind, n, "ok", seconds=measured.wall_s,
        wall_s=measured.wall_s, cpu_s=measured.cpu_s, peak_rss_bytes=measured.peak_rss_bytes,
        processes=measured.processes, disk_bytes=_store_bytes(run),
    )  # fmt: skip
    if measured.returncode is None:
        result.status, result.error = "timeout", log_tail(log_path)
        result.note = f"stopped after {run.config.stage_timeout_s:g} s"
    elif measured.returncode != 0:
        result.status, result.error = "failed", log_tail(log_path)
        result.note = f"exit code {measured.returncode}"
    else:
        try:
            _read_figures(stage.name, run, result)
        except (OSError, ValueError, KeyError) as exc:  # the stage ran; its report did not parse
            result.figures["unreadable_report"] = f"{type(exc).__name__}: {exc}"
    print(f"scale {label}: {stage.name} {result.status} in {measured.wall_s:.1f} s, peak RSS "
          f"{measured.peak_rss_bytes / 2**20:.0f} MiB, store {(result.disk_bytes or 0) / 2**20:.1f}"
          f" MiB{'' if result.note is None else ' (' + result.note + ')'}", flush=True)  # fmt: skip
    return result


def _create_topics(run: SizeRun) -> None:
    """The size's own events topic (not timed: a few admin calls)."""
    completed = subprocess.run(_genrec("topics", "create"), env=run.env, capture_output=True,
                               text=True, timeout=180)  # fmt: skip
    if completed.returncode != 0:
        log.warning("topics create failed: %s", completed.stderr[-500:])


def _store_bytes(run: SizeRun) -> int:
    total = disk_bytes(run.data_dir) if run.data_dir.exists() else 0
    if run.database_url.startswith("postgresql"):
        total += _postgres_bytes(run.database_url)
    return total


def _read_figures(stage: str, run: SizeRun, result: StageResult) -> None:
    """What the stage says about itself, into ``result.figures`` (and ingest's check)."""
    figures_path = run.logs / f"{stage}.json"
    if stage == "replay":
        found = re.search(r"events: ([\d,]+) produced", (run.logs / "replay.out").read_text())
        run.produced = int(found.group(1).replace(",", "")) if found else None
        result.figures["produced"] = run.produced
    elif stage == "ingest":
        stored = _stored_events(run.database_url)
        result.figures.update(stored_events=stored, idle_wait_s=run.config.ingest_idle_s)
        result.seconds = max(0.0, (result.wall_s or 0.0) - run.config.ingest_idle_s)
        result.note = f"time less the {run.config.ingest_idle_s:g} s idle wait before exit"
        if run.produced is not None and stored != run.produced:
            result.status = "failed"
            result.note = f"the store holds {stored:,} of {run.produced:,} produced events"
    elif stage == "semantic-ids":
        summary = json.loads(figures_path.read_text())
        result.figures.update({key: summary.get(key) for key in (
            "n_items", "n_unique_ids", "collision_rate_before_dedup",
            "largest_collision_group", "embedding_sources", "timings")})  # fmt: skip
        result.work_s = sum(v for v in (summary.get("timings") or {}).values()) or None
    elif stage in ("faiss", "trie", "serve"):
        figures = json.loads(figures_path.read_text())
        result.figures.update(figures)
        result.work_s = (figures.get("build_s") if stage == "faiss" else
                         figures.get("ms_per_batch", 0) / 1000 if stage == "serve" else
                         figures.get("trie_build_s", 0) + figures.get("tables_build_s", 0))  # fmt: skip
    elif stage == "refresh":
        report = json.loads((run.logs / "refresh.out").read_text())
        counts = report.get("counts", {})
        kv = counts.get("kv") or {}
        result.figures.update(step_seconds=counts.get("step_seconds"), kv_users=kv.get("users"),
                              kv_total_bytes=kv.get("total_bytes"))  # fmt: skip
        result.work_s = sum((counts.get("step_seconds") or {}).values()) or None
    elif stage == "eval":
        result.figures.update(hr_at_10(json.loads(figures_path.read_text())))


def hr_at_10(report: dict[str, Any]) -> dict[str, float]:
    """``{hr10_<ranker>: HR@10}`` from a ``genrec eval`` report's ``results``."""
    return {
        f"hr10_{name}": round(float(metrics["HR@10"]), 4)
        for name, metrics in (report.get("results") or {}).items()
        if isinstance(metrics, dict) and isinstance(metrics.get("HR@10"), int | float)
    }


def _part_rows(stage: Stage, run: SizeRun, parent: StageResult) -> list[StageResult]:
    """Rows for the steps a stage times itself (same process: its RSS is the process's)."""
    if not stage.parts:
        return []
    seconds: dict[str, float | None] = {}
    if stage.name == "semantic-ids":
        timings = parent.figures.get("timings") or {}
        seconds["embedding"] = timings.get("embed_s")
        train, assign = timings.get("train_s"), timings.get("assign_s")
        seconds["rqvae+dedup"] = None if train is None or assign is None else train + assign
    elif stage.name == "refresh":
        steps = parent.figures.get("step_seconds") or {}
        seconds["prefix-kv"] = steps.get("prefix_kv")
        seconds["activation"] = steps.get("activate")
    rows = []
    for name, kind in stage.parts:
        value = seconds.get(name)
        ok = parent.status == "ok" and value is not None
        rows.append(StageResult(
            name, run.size.label, kind, run.size.of(kind), "ok" if ok else parent.status,
            seconds=value, work_s=value, peak_rss_bytes=parent.peak_rss_bytes, disk_bytes=parent.disk_bytes,
            part_of=stage.name, note=f"timed inside {stage.name}; RSS is that process's",
        ))  # fmt: skip
    return rows


# --- stores ------------------------------------------------------------------------------


def size_run(settings, config: ScaleConfig, size: Size, index: int, root: Path,
             bootstrap: str) -> SizeRun:  # fmt: skip
    """A fresh folder (and database) for one size, and the environment its stages run in;
    with ``config.resume``, the size's kept store and its record where there is one."""
    record = load_size_record(root, config) if config.resume else None
    if record is None and root.exists():
        shutil.rmtree(root)
    (root / "data").mkdir(parents=True, exist_ok=True)
    configured = str(settings.database_url)
    drop = None
    if configured.startswith("postgresql"):
        name = (record or {}).get("postgres_database")
        url, drop = _postgres_database(configured, name or f"genrec_scale_{index}_{os.getpid()}",
                                       create=name is None)  # fmt: skip
    else:
        url = f"sqlite:///{root / 'data' / 'genrec.db'}"
    tag = f"scale-{os.getpid()}-{index}"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("GENREC_")},
        **_passed_settings(),
        "GENREC_DATA_DIR": str(root / "data"),
        "GENREC_DATABASE_URL": url,
        "GENREC_KAFKA__BOOTSTRAP": bootstrap,
        "GENREC_KAFKA__TOPIC_EVENTS": f"genrec.{tag}.user-events",
        "GENREC_KAFKA__TOPIC_RECOMMENDATIONS": f"genrec.{tag}.recommendations",
        "GENREC_KAFKA__TOPIC_DLQ": f"genrec.{tag}.user-events.dlq",
        "PYTHONUNBUFFERED": "1",
    }
    earlier = [StageResult(**row) for row in (record or {}).get("rows", [])]
    return SizeRun(size, index, root, env, config, url, drop, earlier=earlier)


def _passed_settings() -> dict[str, str]:
    """The caller's GENREC_ settings, except where each size's store and topics live."""
    own = ("GENREC_DATA_DIR", "GENREC_DATABASE_URL", "GENREC_HOME", "GENREC_KAFKA__BOOTSTRAP",
           "GENREC_KAFKA__TOPIC_")  # fmt: skip
    return {k: v for k, v in os.environ.items()
            if k.startswith("GENREC_") and not k.startswith(own)}  # fmt: skip


def _postgres_database(url: str, name: str, create: bool = True) -> tuple[str, Callable[[], None]]:
    """Database ``name`` on the configured server (a new empty one when ``create``; else a
    kept one), and how to drop it."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    server = create_engine(make_url(url), isolation_level="AUTOCOMMIT")
    if create:
        with server.connect() as connection:
            connection.execute(text(f'CREATE DATABASE "{name}"'))

    def drop() -> None:
        with server.connect() as connection:
            connection.execute(text(f'DROP DATABASE IF EXISTS "{name}"'))
        server.dispose()

    return make_url(url).set(database=name).render_as_string(hide_password=False), drop


def _postgres_bytes(url: str) -> int:
    from sqlalchemy import create_engine, text

    engine = create_engine(url)
    try:
        with engine.connect() as connection:
            return int(connection.execute(text("SELECT pg_database_size(current_database())"))
                       .scalar())  # fmt: skip
    finally:
        engine.dispose()


def _stored_events(url: str) -> int:
    from sqlalchemy import create_engine, func, select

    from genrec.schemas.tables import events

    engine = create_engine(url)
    try:
        with engine.connect() as connection:
            return int(connection.execute(select(func.count()).select_from(events)).scalar())
    finally:
        engine.dispose()


@contextlib.contextmanager
def kafka_bootstrap(settings, config: ScaleConfig, folder: Path) -> Iterator[str]:
    """The bootstrap the stages use: a private local broker for the run, or the configured."""
    if config.kafka == "configured":
        yield settings.kafka.bootstrap
        return
    from genrec.app.kafka_broker import KafkaBroker, pick_free_ports

    port, controller = pick_free_ports(2)
    broker = KafkaBroker(folder / "kafka", bootstrap=f"127.0.0.1:{port}",
                         controller_port=controller)  # fmt: skip
    print(f"scale: starting a private Kafka broker on 127.0.0.1:{port}", flush=True)
    broker.up(timeout=180.0)
    try:
        yield broker.bootstrap
    finally:
        broker.down()
        shutil.rmtree(folder / "kafka", ignore_errors=True)


# --- the whole run -----------------------------------------------------------------------


@contextlib.contextmanager
def stopped_by_sigterm() -> Iterator[None]:
    """SIGTERM raises SystemExit inside the block (as Ctrl-C raises KeyboardInterrupt), so
    that the running stage's process group, the private broker and the stores are cleaned
    up on the way out instead of being left behind."""

    def stop(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_scale_bench(settings, config: ScaleConfig, out_dir: Path) -> dict[str, Any]:
    """Every size in a fresh store, every stage as its own process; the report. SIGTERM
    stops the running stage and the private broker (``stopped_by_sigterm``)."""
    with stopped_by_sigterm():
        return _run_sizes(settings, config, out_dir)


def _run_sizes(settings, config: ScaleConfig, out_dir: Path) -> dict[str, Any]:
    stages = select_stages(config.stages)
    started = datetime.now(UTC)
    results: list[StageResult] = []
    with kafka_bootstrap(settings, config, out_dir) as bootstrap:
        for index, size in enumerate(config.sizes):
            root = out_dir / "runs" / size.label.replace(":", "x")
            run = size_run(settings, config, size, index, root, bootstrap)
            print(f"scale: size {size.label} ({size.users:,} users, {size.items:,} items, "
                  f"{size.events:,} events) in {root}", flush=True)  # fmt: skip
            try:
                results.extend(run_size(run, stages))
            finally:
                if not config.keep_stores:
                    shutil.rmtree(run.data_dir, ignore_errors=True)
                    shutil.rmtree(run.parquet_dir, ignore_errors=True)
                    (root / RECORD_NAME).unlink(missing_ok=True)  # nothing left to resume
                if run.drop_database is not None and not config.keep_stores:
                    run.drop_database()
    return build_report(config, stages, results, started)


def build_report(config: ScaleConfig, stages: Sequence[Stage], results: Sequence[StageResult],
                 started: datetime | None = None) -> dict[str, Any]:  # fmt: skip
    """The figures, the exponents between consecutive sizes and the verdicts on the aims."""
    rows = [asdict(r) for r in results]
    return {
        "started_at": (started or datetime.now(UTC)).isoformat(timespec="seconds"),
        "host": {
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "load_1m": round(os.getloadavg()[0], 2),
        },  # fmt: skip
        "config": {**asdict(config), "sizes": [s.label for s in config.sizes]},
        "stages": [s.name for s in stages],
        "rows": rows,
        "exponents": exponents(results, config.sizes),
        "verdicts": verdicts(results, config.sizes),
    }


def merge_reports(earlier: dict[str, Any], report: dict[str, Any]) -> dict[str, Any]:
    """``report`` plus the rows of ``earlier``'s other sizes (a size measured again replaces
    its old rows), sizes ordered by events, exponents and verdicts over them all."""
    new_sizes = set(report["config"]["sizes"])
    kept = [r for r in earlier["rows"] if r["size"] not in new_sizes]
    results = [StageResult(**row) for row in [*kept, *report["rows"]]]
    labels = dict.fromkeys([*earlier["config"]["sizes"], *report["config"]["sizes"]])
    sizes = sorted((parse_sizes(label)[0] for label in labels), key=lambda s: (s.events, s.items))
    merged = dict(report)
    merged["config"] = {**report["config"], "sizes": [s.label for s in sizes]}
    merged["runs"] = [*earlier.get("runs", [_run_summary(earlier)]), _run_summary(report)]
    merged["rows"] = [asdict(r) for r in results]
    merged["exponents"] = exponents(results, sizes)
    merged["verdicts"] = verdicts(results, sizes)
    return merged


def _run_summary(report: dict[str, Any]) -> dict[str, Any]:
    return {"started_at": report["started_at"], "host": report["host"],
            "sizes": report["config"]["sizes"], "stages": report["stages"]}  # fmt: skip


def row_names(results: Sequence[StageResult]) -> list[str]:
    return list(dict.fromkeys(r.stage for r in results))


def exponents(results: Sequence[StageResult], sizes: Sequence[Size]) -> list[dict[str, Any]]:
    """Per stage and consecutive pair of sizes: the growth exponent and n log n's."""
    by_key = {(r.stage, r.size): r for r in results}
    out = []
    for name in row_names(results):
        for small, large in zip(sizes, sizes[1:], strict=False):
            a, b = by_key.get((name, small.label)), by_key.get((name, large.label))
            if a is None or b is None or a.status != "ok" or b.status != "ok":
                continue
            out.append({
                "stage": name, "from": small.label, "to": large.label, "input": a.input_kind,
                "n_from": a.n, "n_to": b.n,
                "exponent": _round(growth_exponent(_timed(a), _timed(b), a.n, b.n)),
                "wall_exponent": _round(growth_exponent(a.seconds, b.seconds, a.n, b.n)),
                "rss_exponent": _round(growth_exponent(a.peak_rss_bytes, b.peak_rss_bytes,
                                                       a.n, b.n)),  # fmt: skip
                "n_log_n": _round(n_log_n_exponent(a.n, b.n)),
            })  # fmt: skip
    return out


def _timed(result: StageResult) -> float | None:
    """What an exponent is taken on: the stage's own timing of its work where it reports
    one (a process's start, seconds of imports on a busy host, would flatten the growth),
    else its wall time."""
    return result.work_s if result.work_s else result.seconds


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def verdicts(results: Sequence[StageResult], sizes: Sequence[Size]) -> list[dict[str, Any]]:
    """The issue's aims, each held, not held, or not measured (None), with the figures."""
    largest = sizes[-1].label
    at_largest = [r for r in results if r.size == largest and r.part_of is None]
    ran = [r for r in at_largest if r.status != "skipped"]
    peak = max((r.peak_rss_bytes or 0 for r in ran), default=0)
    all_ok = bool(at_largest) and all(r.status == "ok" for r in at_largest)
    growth = [e for e in exponents(results, sizes) if e["exponent"] is not None]
    too_fast = [e for e in growth if e["exponent"] > e["n_log_n"]]
    serve = {r.size: r.figures.get("ms_per_request") for r in results
             if r.stage == "serve" and r.status == "ok"}  # fmt: skip
    first, last = serve.get(sizes[0].label), serve.get(largest)
    serve_ratio = last / first if first and last else None
    collisions = {r.size: r.figures.get("collision_rate_before_dedup") for r in results
                  if r.stage == "semantic-ids" and r.status == "ok"}  # fmt: skip
    rates = [c for c in collisions.values() if isinstance(c, int | float)]
    return [
        {"aim": f"the largest size ({largest}) runs end to end, no process above 12 GiB",
         "holds": (all_ok and peak <= RSS_LIMIT_BYTES) if ran else None,
         "detail": f"{len(ran)} of {len(at_largest)} stages ran, "
                   f"{sum(r.status == 'ok' for r in at_largest)} ok; peak RSS "
                   f"{peak / 2**30:.2f} GiB"},
        {"aim": "no stage's time grows faster than n log n",
         "holds": (not too_fast) if growth else None,
         "detail": "; ".join(f"{e['stage']} {e['from']}->{e['to']}: {e['exponent']:.2f} > "
                             f"{e['n_log_n']:.2f}" for e in too_fast) or
                   f"{len(growth)} exponents, none above n log n"},
        {"aim": f"per-request serving latency grows at most {SERVING_GROWTH_LIMIT}x from the "
                f"smallest catalog to the largest",
         "holds": None if serve_ratio is None else serve_ratio <= SERVING_GROWTH_LIMIT,
         "detail": "not measured at both ends" if serve_ratio is None else
                   f"{first:.1f} -> {last:.1f} ms/request ({serve_ratio:.2f}x)"},
        {"aim": f"collision rate before dedup <= {COLLISION_LIMIT:.0%}",
         "holds": all(c <= COLLISION_LIMIT for c in rates) if rates else None,
         "detail": ", ".join(f"{s}: {c:.2%}" for s, c in collisions.items()
                             if isinstance(c, int | float)) or "not measured"},
    ]  # fmt: skip


# --- output ------------------------------------------------------------------------------


def _fmt_s(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if value >= 10 else f"{value:.2f}" if value >= 0.1 else f"{value:.3f}"


def _fmt_mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:,.0f}"


def stage_figures_text(row: dict[str, Any]) -> str:
    """A stage's own figures in a few words."""
    f = row.get("figures") or {}
    parts = []
    if f.get("collision_rate_before_dedup") is not None:
        parts.append(f"collisions {f['collision_rate_before_dedup']:.2%}, largest group "
                     f"{f.get('largest_collision_group')}")  # fmt: skip
    if f.get("trie_bytes") is not None:
        parts.append(f"trie {f['trie_bytes'] / 2**20:.1f} MiB + tables "
                     f"{f.get('tables_bytes', 0) / 2**20:.1f} MiB")  # fmt: skip
    if f.get("index_bytes") is not None:
        parts.append(f"{f.get('kind')} index {f['index_bytes'] / 2**20:.1f} MiB")
    if f.get("ms_per_request") is not None:
        parts.append(f"{f['ms_per_request']:.1f} ms/request, {f.get('ms_per_batch', 0):.0f} "
                     f"ms/batch of {f.get('batch_users')}")  # fmt: skip
    if f.get("kv_users") is not None:
        parts.append(f"{f['kv_users']:,} caches, {(f.get('kv_total_bytes') or 0) / 2**20:.0f} MiB")
    if f.get("stored_events") is not None:
        parts.append(f"{f['stored_events']:,} events stored")
    hits = {k[5:]: v for k, v in f.items() if k.startswith("hr10_")}
    if hits:
        parts.append("HR@10 " + ", ".join(f"{k} {v:.3f}" for k, v in hits.items()))
    if row["status"] != "ok":
        parts.append(row["status"] + (f" ({row['note']})" if row.get("note") else ""))
    return "; ".join(parts)


def markdown_table(report: dict[str, Any]) -> str:
    """The measured table of ``docs/scale.md``: one row per stage and size."""
    exps = {(e["stage"], e["to"]): e for e in report["exponents"]}
    lines = ["| stage | size | input n | wall s | work s | CPU s | peak RSS MiB | store MiB | "
             "exponent (n log n) | figures |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    for name in dict.fromkeys(r["stage"] for r in report["rows"]):
        for row in (r for r in report["rows"] if r["stage"] == name):
            e = exps.get((name, row["size"]))
            exp = "" if e is None or e["exponent"] is None else (
                f"{e['exponent']:.2f} ({e['n_log_n']:.2f})")  # fmt: skip
            lines.append(
                f"| {name} | {row['size']} | {row['n']:,} {row['input_kind']} | "
                f"{_fmt_s(row['seconds'])} | {_fmt_s(row.get('work_s'))} | {_fmt_s(row['cpu_s'])} | "
                f"{_fmt_mib(row['peak_rss_bytes'])} | {_fmt_mib(row['disk_bytes'])} | {exp} | "
                f"{stage_figures_text(row)} |"
            )
    return "\n".join(lines)


def print_report(report: dict[str, Any]) -> None:
    print(markdown_table(report))
    for verdict in report["verdicts"]:
        holds = {True: "holds", False: "DOES NOT HOLD", None: "not measured"}[verdict["holds"]]
        print(f"- {verdict['aim']}: {holds} ({verdict['detail']})")


def write_outputs(report: dict[str, Any], json_path: Path, png_path: Path | None) -> None:
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    if png_path is not None:
        plot_report(report, png_path)


def plot_report(report: dict[str, Any], path: Path) -> None:
    """Log-log: each stage's time against its input size; peak RSS against events."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (times, memory) = plt.subplots(1, 2, figsize=(13, 5.5))
    for axis in (times, memory):  # more stages than the default cycle has colours
        axis.set_prop_cycle(color=plt.cm.tab20.colors)
    for name in dict.fromkeys(r["stage"] for r in report["rows"]):
        rows = [r for r in report["rows"]
                if r["stage"] == name and r["status"] == "ok" and r["seconds"]]  # fmt: skip
        if not rows:
            continue
        style = "--" if rows[0]["part_of"] else "-"
        times.plot([r["n"] for r in rows], [r.get("work_s") or r["seconds"] for r in rows], "o" + style,
                   label=f"{name} (x: {rows[0]['input_kind']})")  # fmt: skip
        if rows[0]["part_of"] is None:
            events = [parse_sizes(r["size"])[0].events for r in rows]
            memory.plot(events, [r["peak_rss_bytes"] / 2**20 for r in rows], "o-", label=name)
    memory.axhline(RSS_LIMIT_BYTES / 2**20, color="red", linestyle=":", label="12 GiB")
    for axis, ylabel, xlabel in ((times, "seconds", "stage input (users, items or events)"),
                                 (memory, "peak RSS of the stage's processes (MiB)",
                                  "events of the size")):  # fmt: skip
        axis.set_xscale("log")
        axis.set_yscale("log")
        axis.set_xlabel(xlabel)
        axis.set_ylabel(ylabel)
        axis.grid(alpha=0.3, which="both")
        axis.legend(fontsize=7)
    times.set_title("time per stage")
    memory.set_title("peak RSS per stage")
    figure.suptitle(f"genrec bench scale: {', '.join(report['config']['sizes'])}")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
