"""``genrec bench scale``: size parsing, growth exponents, the report and its verdicts (with
fake stage results), the measured child process (real subprocesses), and one run of the real
commands at a tiny size against the shared broker."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from genrec.app.bench.scale import (
    ScaleConfig,
    Size,
    StageResult,
    build_report,
    exponents,
    format_count,
    growth_exponent,
    hr_at_10,
    markdown_table,
    merge_reports,
    n_log_n_exponent,
    parse_count,
    parse_sizes,
    plot_report,
    run_measured,
    run_scale_bench,
    select_stages,
    verdicts,
)
from genrec.infra.settings import Settings

MiB = 2**20


def test_counts_and_sizes_parse_with_suffixes() -> None:
    assert [parse_count(t) for t in ("500", "10k", "2M", "1.5k", " 3K ")] == [
        500, 10_000, 2_000_000, 1_500, 3_000,
    ]  # fmt: skip
    for bad in ("", "k", "-5", "0", "1.5", "2G", "1e3"):
        with pytest.raises(ValueError):
            parse_count(bad)
    sizes = parse_sizes("10k:10k:200k, 1M:1M:20M")
    assert sizes == [Size(10_000, 10_000, 200_000), Size(1_000_000, 1_000_000, 20_000_000)]
    assert [s.label for s in sizes] == ["10k:10k:200k", "1M:1M:20M"]
    assert format_count(1_500) == "1500" and format_count(2_000_000) == "2M"
    assert Size(1, 2, 3).of("items") == 2
    for bad in ("10k:10k", "a:b:c", "", "1k:1k:1k,1k:1k:1k"):
        with pytest.raises(ValueError):
            parse_sizes(bad)


def test_growth_exponent_is_the_log_log_slope() -> None:
    assert growth_exponent(1.0, 10.0, 100, 1000) == pytest.approx(1.0)
    assert growth_exponent(1.0, 100.0, 100, 1000) == pytest.approx(2.0)
    assert growth_exponent(2.0, 2.0, 10, 1000) == pytest.approx(0.0)
    assert growth_exponent(1.0, math.sqrt(10), 1, 10) == pytest.approx(0.5)
    assert growth_exponent(0.0, 1.0, 1, 10) is None
    assert growth_exponent(1.0, 2.0, 10, 10) is None
    assert growth_exponent(None, 2.0, 1, 10) is None
    # n log n from 10k to 1M: a bit above linear
    bound = n_log_n_exponent(10_000, 1_000_000)
    assert bound == pytest.approx(math.log(100 * math.log(1e6) / math.log(1e4)) / math.log(100))
    assert 1.0 < bound < 1.1


def test_stages_bring_what_they_need_in_pipeline_order() -> None:
    names = [s.name for s in select_stages(["trie"])]
    assert names == ["synthetic", "replay", "ingest", "semantic-ids", "trie"]
    assert [s.name for s in select_stages(["serve"])][-3:] == ["train", "refresh", "serve"]
    assert len(select_stages(None)) == len(select_stages([]))
    with pytest.raises(ValueError, match="unknown stages"):
        select_stages(["nope"])


def _row(stage, size, n, seconds, rss_mib=100, status="ok", kind="events", **figures):
    return StageResult(stage, size.label, kind, n, status, seconds=seconds, wall_s=seconds,
                       peak_rss_bytes=int(rss_mib * MiB), disk_bytes=10 * MiB,
                       figures=figures)  # fmt: skip


def _fake_results(large_serve_ms: float = 6.0, collision: float = 0.01):
    small, large = Size(1_000, 1_000, 10_000), Size(10_000, 10_000, 100_000)
    rows = [
        _row("ingest", small, 10_000, 2.0), _row("ingest", large, 100_000, 20.0, rss_mib=200),
        # training 10x the events, 1000x the time: faster than n log n
        _row("train", small, 10_000, 1.0), _row("train", large, 100_000, 1000.0, rss_mib=900),
        _row("semantic-ids", small, 1_000, 5.0, kind="items", collision_rate_before_dedup=0.0),
        _row("semantic-ids", large, 10_000, 40.0, kind="items",
             collision_rate_before_dedup=collision, largest_collision_group=3),
        _row("serve", small, 1_000, 0.2, kind="items", ms_per_request=5.0, ms_per_batch=160,
             batch_users=32),
        _row("serve", large, 10_000, 0.3, kind="items", ms_per_request=large_serve_ms,
             ms_per_batch=190, batch_users=32),
        _row("eval", small, 10_000, 3.0, hr10_itemcf=0.2),
        StageResult("eval", large.label, "events", 100_000, "timeout", wall_s=50.0,
                    peak_rss_bytes=300 * MiB, error="...", note="stopped after 50 s"),
    ]  # fmt: skip
    return [small, large], rows


def test_report_exponents_and_verdicts_from_fake_results(tmp_path: Path) -> None:
    sizes, rows = _fake_results()
    found = {e["stage"]: e for e in exponents(rows, sizes)}
    assert found["ingest"]["exponent"] == pytest.approx(1.0)
    assert found["train"]["exponent"] == pytest.approx(3.0)
    assert "eval" not in found  # timed out at the larger size: no exponent
    assert found["ingest"]["rss_exponent"] == pytest.approx(math.log10(2), abs=1e-3)
    held = {v["aim"].split(" ")[1]: v for v in verdicts(rows, sizes)}
    assert held["largest"]["holds"] is False  # eval timed out there
    assert held["stage's"]["holds"] is False and "train" in held["stage's"]["detail"]
    assert held["serving"]["holds"] is True and "1.20x" in held["serving"]["detail"]
    assert held["rate"]["holds"] is True
    _sizes, worse = _fake_results(large_serve_ms=9.0, collision=0.08)
    held = {v["aim"].split(" ")[1]: v for v in verdicts(worse, sizes)}
    assert held["serving"]["holds"] is False and held["rate"]["holds"] is False

    config = ScaleConfig(sizes=tuple(sizes))
    report = build_report(config, select_stages(None), rows)
    json.dumps(report)  # every figure is JSON
    table = markdown_table(report)
    assert "| train | 10k:10k:100k | 100,000 events | 1000.0 |" in table
    assert "3.00 (1.10)" in table  # train's exponent beside n log n's (10k -> 100k)
    assert "collisions 1.00%, largest group 3" in table
    assert "timeout (stopped after 50 s)" in table
    assert "HR@10 itemcf 0.200" in table
    later = build_report(ScaleConfig(sizes=(Size(100_000, 100_000, 1_000_000),)), [],
                         [_row("ingest", Size(100_000, 100_000, 1_000_000), 1_000_000, 200.0)])  # fmt: skip
    merged = merge_reports(report, later)
    assert merged["config"]["sizes"] == ["1k:1k:10k", "10k:10k:100k", "100k:100k:1M"]
    assert [e["to"] for e in merged["exponents"] if e["stage"] == "ingest"] == [
        "10k:10k:100k", "100k:100k:1M",
    ]  # fmt: skip
    assert len(merged["runs"]) == 2 and len(merged["rows"]) == len(rows) + 1
    plot_report(merged, tmp_path / "scale.png")
    assert (tmp_path / "scale.png").stat().st_size > 10_000


def test_hr_at_10_of_each_ranker_from_an_eval_report() -> None:
    report = {"protocol": {"users": 9}, "paired": {"a - b": {"HR@10": {"diff": 0.1}}},
              "results": {"popularity": {"HR@10": 0.07}, "itemcf": {"HR@10": 0.2, "HR@5": 0.1},
                          "merged": {"users": 3}}}  # fmt: skip
    assert hr_at_10(report) == {"hr10_popularity": 0.07, "hr10_itemcf": 0.2}
    assert hr_at_10({}) == {}


def test_run_measured_sees_the_peak_of_the_child_and_of_its_child(tmp_path: Path) -> None:
    # the child holds 60 MiB; its own child holds 150 MiB for a second (sampled from /proc)
    script = ("import subprocess, sys, time; a = bytearray(60 * 2**20); "
              "subprocess.run([sys.executable, '-c', "
              "'import time; b = bytearray(150 * 2**20); time.sleep(1.5)'])")  # fmt: skip
    run = run_measured([sys.executable, "-c", script], {}, tmp_path / "a.log",
                       timeout_s=60, desc="test")  # fmt: skip
    assert run.returncode == 0 and run.wall_s > 1.0
    assert len(run.processes) == 2
    child, grandchild = sorted(run.processes.values())
    assert child >= 60 * MiB and grandchild >= 150 * MiB
    assert run.peak_rss_bytes == grandchild


def test_run_measured_stops_a_stage_at_its_timeout(tmp_path: Path) -> None:
    log = tmp_path / "b.log"
    run = run_measured([sys.executable, "-c", "import time; print('working'); time.sleep(60)"],
                       {"PYTHONUNBUFFERED": "1"}, log, timeout_s=1.0, desc="test")  # fmt: skip
    assert run.returncode is None and run.wall_s < 30
    assert "working" in log.read_text()
    failed = run_measured([sys.executable, "-c", "raise SystemExit(3)"], {}, log,
                          timeout_s=30, desc="test")  # fmt: skip
    assert failed.returncode == 3


@pytest.mark.slow
def test_a_tiny_size_through_the_real_commands(kafka_broker, tmp_path: Path) -> None:
    """300 users x 500 items x 5k events: synthetic, replay, ingest and the recall fit as
    their own processes against the shared broker (topics of the run's own)."""
    settings = Settings(home=tmp_path, data_dir=tmp_path / "var", database_url=None)
    settings.kafka.bootstrap = kafka_broker.bootstrap
    config = ScaleConfig(sizes=(Size(300, 500, 5_000),), stages=("recall",), text=False,
                         kafka="configured", stage_timeout_s=300, ingest_idle_s=5)  # fmt: skip
    report = run_scale_bench(settings, config, tmp_path / "out")
    rows = {r["stage"]: r for r in report["rows"]}
    assert list(rows) == ["synthetic", "replay", "ingest", "recall"]
    for row in rows.values():
        assert row["status"] == "ok", row["error"]
        assert row["peak_rss_bytes"] > 20 * MiB and row["wall_s"] > 0
    assert rows["replay"]["figures"]["produced"] == rows["ingest"]["figures"]["stored_events"]
    assert rows["ingest"]["figures"]["stored_events"] > 4_000
    assert rows["recall"]["disk_bytes"] > rows["synthetic"]["disk_bytes"]
    assert not (tmp_path / "out" / "runs" / "300x500x5k" / "data").exists()  # not kept
    assert not (tmp_path / "out" / "runs" / "300x500x5k" / "stages.json").exists()
    assert (tmp_path / "out" / "runs" / "300x500x5k" / "logs" / "ingest.log").exists()


def test_each_size_gets_a_fresh_store_of_the_configured_kind(database_url, tmp_path: Path) -> None:
    """SQLite: a file in the size's folder; PostgreSQL: a new database on that server,
    dropped afterwards; the caller's own store is never the one the stages write."""
    from genrec.app.bench.scale import _store_bytes, size_run
    from genrec.infra.database import make_engine

    settings = Settings(home=tmp_path, database_url=database_url)
    run = size_run(settings, ScaleConfig(sizes=(Size(1, 1, 1),)), Size(1, 1, 1), 0,
                   tmp_path / "runs" / "1x1x1", "127.0.0.1:1")  # fmt: skip
    assert run.database_url != database_url
    assert run.env["GENREC_DATABASE_URL"] == run.database_url
    assert run.env["GENREC_DATA_DIR"] == str(tmp_path / "runs" / "1x1x1" / "data")
    assert run.env["GENREC_KAFKA__TOPIC_EVENTS"].startswith("genrec.scale-")
    make_engine(run.database_url).dispose()  # creates the tables
    assert _store_bytes(run) > 0
    if database_url.startswith("postgresql"):
        assert run.drop_database is not None
        run.drop_database()
    else:
        assert run.database_url.startswith(f"sqlite:///{tmp_path}")


def test_sigterm_stops_the_running_stage_with_the_bench(tmp_path: Path) -> None:
    """A stage runs in a session of its own, so the bench's SIGTERM does not reach it: the
    bench stops its process group on the way out (it used to leave it running)."""
    pid_file = tmp_path / "stage.pid"
    stage = (
        f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    )
    bench = (
        "import sys\n"
        "from pathlib import Path\n"
        "from genrec.app.bench.scale import run_measured, stopped_by_sigterm\n"
        "with stopped_by_sigterm():\n"
        f"    run_measured([sys.executable, '-c', {stage!r}], {{}}, Path({str(tmp_path / 'c.log')!r}),"
        " timeout_s=120, desc='test')\n"
    )
    process = subprocess.Popen([sys.executable, "-c", bench])
    deadline = time.monotonic() + 60
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline and process.poll() is None
        time.sleep(0.1)
    stage_pid = int(pid_file.read_text())
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 128 + signal.SIGTERM
    deadline = time.monotonic() + 30  # stopped with it, not left running (and then reaped)
    while _alive(stage_pid):
        assert time.monotonic() < deadline, "the stage outlived the bench"
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _fake_stages(monkeypatch, failing: set[str]) -> list[str]:
    """``_run_stage`` replaced by a recorder (stages in ``failing`` fail); no broker."""
    import contextlib

    import genrec.app.bench.scale as scale

    calls: list[str] = []

    def run_stage(stage, run, n):
        calls.append(stage.name)
        figures = {"produced": 7} if stage.name == "replay" else {}
        return StageResult(stage.name, run.size.label, stage.input_kind, n,
                           "failed" if stage.name in failing else "ok", seconds=1.0,
                           figures=figures)  # fmt: skip

    monkeypatch.setattr(scale, "_run_stage", run_stage)
    monkeypatch.setattr(scale, "kafka_bootstrap",
                        lambda *_: contextlib.nullcontext("127.0.0.1:1"))  # fmt: skip
    return calls


def test_resume_runs_only_what_failed_and_what_needs_it(monkeypatch, tmp_path: Path) -> None:
    """--resume on a kept store: stages that were ok are not run again (their rows come back
    marked resumed), a failed one and its dependants are; the record keeps other stages."""
    settings = Settings(home=tmp_path, database_url=None)
    out = tmp_path / "out"
    size = Size(1, 1, 1)
    calls = _fake_stages(monkeypatch, failing={"recall"})
    config = ScaleConfig(sizes=(size,), stages=("eval", "faiss"), keep_stores=True)
    first = run_scale_bench(settings, config, out)
    assert calls == ["synthetic", "replay", "ingest", "semantic-ids", "faiss", "recall", "train"]
    assert {r["stage"]: r["status"] for r in first["rows"]}["eval"] == "skipped"
    (out / "runs" / "1x1x1" / "data" / "kept").write_text("the store")

    calls = _fake_stages(monkeypatch, failing=set())
    resumed = run_scale_bench(settings, replace(config, resume=True), out)
    assert calls == ["recall", "eval"]
    assert (out / "runs" / "1x1x1" / "data" / "kept").exists()  # the store was not wiped
    rows = {r["stage"]: r for r in resumed["rows"] if r["part_of"] is None}
    assert [s for s, r in rows.items() if r["resumed"]] == [
        "synthetic", "replay", "ingest", "semantic-ids", "faiss", "train"]  # fmt: skip
    assert all(r["status"] == "ok" for r in rows.values())

    calls = _fake_stages(monkeypatch, failing=set())
    trie_only = ScaleConfig(sizes=(size,), stages=("trie",), keep_stores=True, resume=True)
    run_scale_bench(settings, trie_only, out)
    assert calls == ["trie"]
    record = json.loads((out / "runs" / "1x1x1" / "stages.json").read_text())
    assert {"eval", "recall", "faiss", "trie"} <= {r["stage"] for r in record["rows"]}

    calls = _fake_stages(monkeypatch, failing=set())
    run_scale_bench(settings, ScaleConfig(sizes=(size,), stages=("trie",), keep_stores=True), out)
    assert calls == ["synthetic", "replay", "ingest", "semantic-ids", "trie"]  # fresh: all


def test_resume_replays_with_ingest_and_refuses_other_flags(monkeypatch, tmp_path: Path) -> None:
    """Replay is reused only with ingest (its topic was on the earlier run's broker); a store
    made with other flags is not resumed; without a kept store a resume starts fresh."""
    from genrec.app.bench.scale import ResumeMismatch

    settings = Settings(home=tmp_path, database_url=None)
    out = tmp_path / "out"
    config = ScaleConfig(sizes=(Size(1, 1, 1),), stages=("semantic-ids",), keep_stores=True,
                         resume=True)  # fmt: skip
    calls = _fake_stages(monkeypatch, failing={"ingest"})
    run_scale_bench(settings, config, out)  # nothing kept yet: a fresh store
    assert calls == ["synthetic", "replay", "ingest"]
    calls = _fake_stages(monkeypatch, failing=set())
    run_scale_bench(settings, config, out)
    assert calls == ["replay", "ingest", "semantic-ids"]
    with pytest.raises(ResumeMismatch, match="text True there, False now"):
        run_scale_bench(settings, replace(config, text=False), out)
    (out / "runs" / "1x1x1" / "stages.json").unlink()  # a store kept before records were
    (out / "runs" / "1x1x1" / "data" / "genrec.db").write_text("the store")
    with pytest.raises(ResumeMismatch, match="without a record"):
        run_scale_bench(settings, config, out)
    assert (out / "runs" / "1x1x1" / "data").exists()  # and it is left as it was
