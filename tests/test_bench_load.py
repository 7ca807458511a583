"""`genrec bench load`: the schedule, the step figures and the verdicts with fakes, then one
run through the real broker against `genrec serve` subprocesses on a tiny trained store."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import psutil
import pytest
from sqlalchemy import func, select

from genrec.app.bench import load
from genrec.app.bench.load import (
    AnswerBook,
    Answers,
    CpuMeter,
    EventPicker,
    LoadConfig,
    StepResult,
    assigned_members,
    covered_ids,
    doubling_rates,
    held_rate,
    is_overloaded,
    latency_figures,
    merge_reports,
    process_cpu_s,
    run_load_bench,
    send_offsets,
    settings_environment,
    step_line,
    summarize_step,
    users_by_partition,
    worker_ratio,
    write_report,
)
from genrec.infra.database import make_engine
from genrec.infra.errors import UserFacingError
from genrec.infra.settings import Settings
from genrec.ingest.store import write_events
from genrec.schemas.tables import events, users

# --- the schedule -----------------------------------------------------------------------


def test_default_rates_double_from_25_to_3200() -> None:
    assert doubling_rates() == [25, 50, 100, 200, 400, 800, 1600, 3200]
    assert LoadConfig().step_rates() == tuple(doubling_rates())
    assert LoadConfig(rates=(4.0, 8.0)).step_rates() == (4.0, 8.0)
    with pytest.raises(ValueError):
        doubling_rates(0, 10)
    # finer steps keep every doubling exact and round the ones between
    assert doubling_rates(25, 400, 2) == [25, 35, 50, 71, 100, 141, 200, 283, 400]
    assert doubling_rates(25, 100, 3) == [25, 31, 40, 50, 63, 79, 100]
    assert LoadConfig(steps_per_doubling=2).step_rates()[:3] == (25, 35, 50)
    with pytest.raises(ValueError):
        doubling_rates(25, 100, 0)
    # a config that cannot run is refused before any service starts
    with pytest.raises(ValueError, match="steps_per_doubling"):
        LoadConfig(steps_per_doubling=0)
    with pytest.raises(ValueError, match="start=False"):
        LoadConfig(refresh=True, start=False)


def test_send_offsets_are_evenly_spaced_and_fixed_by_the_rate() -> None:
    offsets = send_offsets(25.0, 2.0)
    assert len(offsets) == 50
    assert offsets[0] == 0.0
    assert np.allclose(np.diff(offsets), 0.04)
    assert len(send_offsets(0.1, 1.0)) == 1  # a step always offers something
    with pytest.raises(ValueError):
        send_offsets(10.0, 0.0)


def test_phase_workers_started_or_already_running() -> None:
    assert LoadConfig().phase_workers() == (1, 2)
    assert LoadConfig(start=False).phase_workers() == (1,)
    assert LoadConfig(start=False, worker_pids=(11, 12)).phase_workers() == (2,)


def test_picker_sends_store_users_items_they_have_not_seen() -> None:
    seen = {"1": {"a", "b"}, "2": {"c"}}
    picker = EventPicker(seen, ["a", "b", "c", "d", "e"], prefix="load-x", seed=3)
    events = [picker.event("1w-25") for _ in range(6)]
    assert {e.user_id for e in events} <= {"1", "2"}
    for event in events:
        assert event.item_id not in seen[event.user_id]
    assert len({e.event_id for e in events}) == 6
    assert all(e.event_id.startswith("load-x-1w-25-") for e in events)
    again = EventPicker(seen, ["a", "b", "c", "d", "e"], prefix="load-x", seed=3)
    assert [(e.user_id, e.item_id) for e in events] == [
        (e.user_id, e.item_id) for e in (again.event("1w-25") for _ in range(6))
    ]
    with pytest.raises(ValueError):
        EventPicker({}, ["a"], prefix="p")


def test_users_by_partition_reaches_every_partition() -> None:
    users = [str(u) for u in range(1, 200)]
    chosen = users_by_partition(users, 6)
    assert sorted(chosen) == list(range(6))
    assert len(set(chosen.values())) == 6


# --- answers and figures ------------------------------------------------------------------


def test_covered_ids_prefers_covered_event_ids_then_the_trigger() -> None:
    assert covered_ids({"covered_event_ids": ["e1", "e2"], "request_id": "e2"}) == ["e1", "e2"]
    assert covered_ids({"decoding": {"covered_event_ids": ["e3"]}}) == ["e3"]
    assert covered_ids({"request_id": "e4", "covered_event_ids": []}) == ["e4"]
    assert covered_ids({"event_id": "e5"}) == ["e5"]
    assert covered_ids({}) == []


def test_latency_figures_percentiles_and_max() -> None:
    figures = latency_figures(list(range(1, 101)))
    assert figures["p50_ms"] == pytest.approx(50.5)
    assert figures["p95_ms"] == pytest.approx(95.05)
    assert figures["p99_ms"] == pytest.approx(99.01)
    assert figures["max_ms"] == 100
    assert latency_figures([]) == {"p50_ms": None, "p95_ms": None, "p99_ms": None, "max_ms": None}


def test_summarize_step_counts_coalesced_unanswered_and_twice() -> None:
    # 10 events due 0.1 s apart: e0..e7 answered 20 ms after they were due, e8 never, e9
    # after 50 ms and then again (a redelivery); 8 messages were triggered by these events.
    scheduled = {f"e{i}": 100.0 + 0.1 * i for i in range(10)}
    first_at = {f"e{i}": 100.0 + 0.1 * i + 0.020 for i in range(8)}
    first_at["e9"] = 100.9 + 0.050
    times = {e: 1 for e in first_at} | {"e9": 2}
    step = summarize_step(
        1, 10.0, scheduled, Answers(first_at, times, requests=8),
        p99_limit_ms=100.0, cpu_pct=42.04, send_lags_s=[0.0] * 9 + [0.01], host_load=3.141,
    )  # fmt: skip
    assert (step.events, step.answered, step.unanswered, step.answered_twice) == (10, 9, 1, 1)
    assert step.p50_ms == pytest.approx(20.0)
    assert step.max_ms == pytest.approx(50.0)
    assert step.answered_eps == pytest.approx(9 / 0.95, rel=1e-3)
    assert step.requests_ps == pytest.approx(8 / 0.95, rel=1e-3)
    assert step.worker_cpu_pct == 42.0
    assert step.send_lag_p99_ms == pytest.approx(9.1, abs=0.1)
    assert step.host_load_1m == 3.14
    assert step.overloaded  # e8 was never answered
    assert step.worker_p50_ms is None  # no message said how long its worker took


def test_summarize_step_reports_the_workers_share_from_the_messages() -> None:
    scheduled = {f"e{i}": 10.0 + i for i in range(4)}
    first_at = {e: due + 0.040 for e, due in scheduled.items()}
    worker_ms = {"e0": 10.0, "e1": 12.0, "e2": 14.0, "e3": 30.0, "other": 500.0}
    answers = Answers(first_at, dict.fromkeys(first_at, 1), requests=4, worker_ms=worker_ms)
    step = summarize_step(1, 1.0, scheduled, answers, p99_limit_ms=100.0)
    assert step.p50_ms == pytest.approx(40.0)
    assert step.worker_p50_ms == pytest.approx(13.0)  # only this step's triggers
    assert step.worker_p99_ms == pytest.approx(29.52)
    assert "in the worker p50/p99 13/30 ms" in step_line(step)


def test_summarize_step_reports_batches_suffixes_and_the_rest_of_the_path() -> None:
    scheduled = {f"e{i}": 10.0 + i for i in range(4)}
    first_at = {e: due + 0.040 for e, due in scheduled.items()}
    answers = Answers(
        first_at, dict.fromkeys(first_at, 1), requests=4,
        batch_users={"e0": 1, "e1": 3, "e2": 3, "e3": 5, "other": 64},
        suffix_tokens={"e0": 4, "e1": 4, "e2": 8},
    )  # fmt: skip
    step = summarize_step(
        1, 1.0, scheduled, answers, p99_limit_ms=100.0,
        others_cpu_pct={"ingest": 12.34, "broker": 30.0, "bench": None},
    )  # fmt: skip
    assert step.batch_users_mean == 3.0  # this step's triggers only
    assert step.suffix_tokens_p50 == 4.0
    assert (step.ingest_cpu_pct, step.broker_cpu_pct, step.bench_cpu_pct) == (12.3, 30.0, None)
    line = step_line(step)
    assert "ingest 12% broker 30% bench -" in line and "users/call 3.0, suffix 4 tokens" in line


def test_answer_book_keeps_the_first_messages_decoding_figures() -> None:
    book = AnswerBook()
    decoding = {"batch_users": 7, "suffix_tokens": 4}
    book.record([{"event_id": "e1", "latency_ms": 3.0, "decoding": decoding}], 1.0)
    book.record([{"event_id": "e1", "decoding": {"batch_users": 9}}], 2.0)  # a redelivery
    book.record([{"event_id": "e2", "decoding": {"batch_users": True, "suffix_tokens": "x"}}], 3.0)
    book.record(
        [{"event_id": "e4", "decoding": {"path": "full_prompt", "prompt_tokens": 201}}], 4.0
    )
    answers = book.lookup(["e1", "e2", "e3", "e4"])
    assert answers.batch_users == {"e1": 7}
    assert answers.suffix_tokens == {"e1": 4, "e4": 201}  # a full prompt is prefilled whole
    assert answers.times == {"e1": 2, "e2": 1, "e4": 1}
    assert answers.first_at == {"e1": 1.0, "e2": 3.0, "e4": 4.0}
    assert answers.worker_ms == {"e1": 3.0} and answers.requests == 4
    assert book.missing(["e1", "e3"]) == 1


def test_path_pids_name_this_bench_and_no_broker_that_is_not_running(tmp_path) -> None:
    pids = load.path_pids(Settings(home=tmp_path), ingest_pid=41)
    assert pids == {"bench": os.getpid(), "ingest": 41}


def test_overload_detection() -> None:
    assert not is_overloaded(99.0, 0, 100.0)
    assert not is_overloaded(100.0, 0, 100.0)
    assert is_overloaded(100.5, 0, 100.0)
    assert is_overloaded(10.0, 1, 100.0)
    assert is_overloaded(None, 0, 100.0)  # nothing answered


def fake_step(rate: float, overloaded: bool, workers: int = 1) -> StepResult:
    return StepResult(
        workers=workers, offered_eps=rate, events=10, answered=10, answered_eps=rate,
        requests=10, requests_ps=rate, p50_ms=1.0, p95_ms=2.0, p99_ms=3.0, max_ms=4.0,
        unanswered=0, answered_twice=0, worker_cpu_pct=None, send_lag_p99_ms=0.0,
        overloaded=overloaded,
    )  # fmt: skip


def test_held_rate_is_the_highest_step_that_did_not_overload() -> None:
    assert held_rate([fake_step(25, False), fake_step(50, False), fake_step(100, True)]) == 50
    assert held_rate([fake_step(25, True)]) is None
    assert held_rate([]) is None


def test_worker_ratio_and_merged_reports() -> None:
    assert worker_ratio({1: 100.0, 2: 160.0}) == 1.6
    assert worker_ratio({1: None, 2: 160.0}) is None
    assert worker_ratio({1: 100.0}) is None
    one = {"workers": 1, "held_eps": 100.0, "peak_answered_eps": 180.0, "steps": []}
    two = {"workers": 2, "held_eps": 200.0, "peak_answered_eps": 300.0, "steps": []}
    old_two = {**two, "held_eps": 1.0}
    merged = merge_reports({"phases": [old_two]}, {"phases": [one, two]})
    assert [p["held_eps"] for p in merged["phases"]] == [100.0, 200.0]
    merged = merge_reports({"phases": [one]}, {"phases": [two]})
    assert merged["held_ratio_2_over_1"] == 2.0
    assert merged["peak_ratio_2_over_1"] == pytest.approx(300 / 180, rel=1e-3)


class FakeAdmin:
    """``describe_groups`` as kafka-python 3 answers it, for one group."""

    def __init__(self, state: str, assignments: list[list[int]]) -> None:
        self.state, self.assignments = state, assignments

    def describe_groups(self, groups: list[str]) -> dict:
        members = [
            {"member_assignment": {"assigned_partitions": [{"topic": "t", "partitions": parts}]}}
            for parts in self.assignments
        ]
        return {groups[0]: {"group_state": self.state, "members": members}}


def test_ready_workers_are_stable_members_holding_partitions() -> None:
    assert assigned_members(FakeAdmin("Stable", [[0, 1, 2], [3, 4, 5]]), "g") == 2
    assert assigned_members(FakeAdmin("Stable", [[0, 1, 2, 3, 4, 5], []]), "g") == 1
    assert assigned_members(FakeAdmin("PreparingRebalance", [[0, 1, 2], [3, 4, 5]]), "g") == 0


def test_started_workers_that_never_join_are_restarted_once(monkeypatch, tmp_path) -> None:
    started: list[str] = []

    class FakeServices:
        def __init__(self, run_id: str) -> None:
            self.run_id = run_id

        def log_path(self, name: str) -> str:
            return f"{self.run_id}-{name}.log"

        def wait_ready(self, timeout_s: float) -> None:
            if len(started) <= stalls:  # the first `stalls` starts never join
                raise TimeoutError("did not join")

        def worker_pids(self) -> list[int]:
            return [42]

        def ingest_pid(self) -> int:
            return 41

        def check_alive(self) -> None:
            pass

    @contextlib.contextmanager
    def fake_started(_settings, _workers, run_id, _guarantee):
        started.append(run_id)
        yield FakeServices(run_id)

    monkeypatch.setattr(load, "started_services", fake_started)
    answer_stalls: list[str] = []  # starts whose workers joined but never answered

    def fake_warm_up(_traffic, _workers, _check, _timeout_s) -> None:
        if started[-1] in answer_stalls:
            raise TimeoutError("no answer")

    monkeypatch.setattr(load, "warm_up", fake_warm_up)
    monkeypatch.setattr(
        load,
        "run_steps",
        lambda _t, workers, pids, _c, others: {"w": workers, "p": pids, "i": others["ingest"]},
    )
    traffic = load._Traffic(None, None, None, LoadConfig())
    settings = Settings(home=tmp_path)  # no local broker runs there: no broker pid
    stalls = 1
    expected = {"w": 2, "p": [42], "i": 41}
    assert load.run_started_phase(traffic, settings, 2, "r", "at_least_once") == expected
    assert started == ["r-a1", "r-a2"]
    started.clear()
    stalls = 2
    with pytest.raises(TimeoutError):
        load.run_started_phase(traffic, settings, 1, "r", "at_least_once")
    assert started == ["r-a1", "r-a2"]
    started.clear()
    stalls, answer_stalls[:] = 0, ["r-a1"]  # joined, then stalled: as seen on a loaded host
    expected = {"w": 1, "p": [42], "i": 41}
    assert load.run_started_phase(traffic, settings, 1, "r", "at_least_once") == expected
    assert started == ["r-a1", "r-a2"]


def test_cpu_of_this_process_from_proc() -> None:
    assert process_cpu_s(os.getpid()) > 0
    meter = CpuMeter([os.getpid()])
    meter.start()
    sum(i * i for i in range(300_000))  # burn a little CPU
    assert meter.percent() > 0
    assert CpuMeter([]).percent() is None


def test_cpu_meter_counts_children() -> None:
    child = subprocess.Popen(
        # some CPU of its own first: /proc counts in 10 ms ticks, and a warm interpreter
        # can start in fewer (the test read 0.0 s for it once)
        [sys.executable, "-c",
         "import time; sum(range(3_000_000)); print('up', flush=True); time.sleep(30)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert child.stdout.readline() == "up\n"  # started: its CPU time no longer grows
        assert child.pid in load.descendants(os.getpid())
        assert load.descendants(child.pid) == []
        own = CpuMeter([os.getpid()], children=False)._total()
        with_child = CpuMeter([os.getpid()])._total()
        child_cpu = process_cpu_s(child.pid)
        assert child_cpu > 0 and with_child >= own + child_cpu
    finally:
        child.kill()
        child.wait()


def test_children_get_this_process_store_and_topics(tmp_path: Path, monkeypatch) -> None:
    settings = Settings(
        home=tmp_path, data_dir=tmp_path / "data",
        kafka={"topic_events": "ev.x", "topic_recommendations": "rec.x",
               "bootstrap": "127.0.0.1:1"},
    )  # fmt: skip
    for name, value in settings_environment(settings).items():
        monkeypatch.setenv(name, value)
    child = Settings()  # what `genrec serve` builds from its environment
    assert (child.home, child.data_dir, child.database_url) == (
        settings.home,
        settings.data_dir,
        settings.database_url,
    )
    assert child.kafka == settings.kafka


# --- through the real broker ----------------------------------------------------------------


def genrec_children() -> list[psutil.Process]:
    """This process's `genrec ...` subprocesses still alive (the test broker's JVM is not one)."""
    alive = []
    for child in psutil.Process().children(recursive=True):
        try:
            if "genrec.app.cli" in " ".join(child.cmdline()) and child.status() != "zombie":
                alive.append(child)
        except psutil.NoSuchProcess:
            continue
    return alive


def _store_figures(settings: Settings) -> tuple:
    """The behavior store's event count, bench events and users' spans."""
    engine = make_engine(str(settings.database_url))
    try:
        with engine.connect() as connection:
            count = connection.execute(select(func.count()).select_from(events)).scalar_one()
            bench = connection.execute(
                select(func.count()).where(events.c.event_id.like("load-%"))
            ).scalar_one()
            spans = connection.execute(select(users).order_by(users.c.user_id)).all()
    finally:
        engine.dispose()
    return count, bench, [tuple(row) for row in spans]


def _event_spans(settings: Settings, rows: list[tuple]) -> list[tuple]:
    """(user_id, first ts, last ts) of these users' events."""
    engine = make_engine(str(settings.database_url))
    try:
        with engine.connect() as connection:
            spans = connection.execute(
                select(events.c.user_id, func.min(events.c.ts_ms), func.max(events.c.ts_ms))
                .where(events.c.user_id.in_([row[0] for row in rows]))
                .group_by(events.c.user_id)
                .order_by(events.c.user_id)
            ).all()
    finally:
        engine.dispose()
    return [tuple(row) for row in spans]


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(600)  # ~2 min; a stalled group join restarts a phase's workers once
def test_load_bench_through_the_broker(serving_home, kafka_settings, tmp_path, capsys) -> None:
    home = tmp_path / "home"
    shutil.copytree(serving_home, home)  # ingest writes the bench's events into its store
    settings = Settings(home=home, kafka=kafka_settings)
    before = _store_figures(settings)
    config = LoadConfig(
        rates=(3.0, 6.0), step_s=2.0, drain_s=60.0, p99_ms=60_000.0, workers=(1, 2),
        warmup_events=3, ready_timeout_s=120.0, join_timeout_s=90.0, progress=False,
        refresh=True,
    )  # fmt: skip
    report = run_load_bench(settings, config)
    json_path, png_path = tmp_path / "load.json", tmp_path / "load.png"
    write_report(report, json_path, png_path)

    assert not genrec_children(), "the bench left genrec processes behind"
    assert [p["workers"] for p in report["phases"]] == [1, 2]
    # a refresh before each phase, each activating a version of its own
    versions = [p["serving_version"] for p in report["phases"]]
    assert None not in versions and versions[0] != versions[1]
    assert all(p["refresh_s"] > 0 for p in report["phases"])
    # each phase's events (warm-up included) left the store after it; the users' spans are
    # their events' again (the fixture's store has events only: ingest added the rows)
    count, bench, spans = _store_figures(settings)
    assert (count, bench) == before[:2] and spans and spans == _event_spans(settings, spans)
    for phase in report["phases"]:
        assert phase["events_removed"] == phase["events_sent"]
        assert phase["events_sent"] >= sum(step["events"] for step in phase["steps"])
        assert len(phase["worker_pids"]) == phase["workers"]
        assert [s["offered_eps"] for s in phase["steps"]] == [3.0, 6.0]
        for step in phase["steps"]:
            assert step["events"] == round(step["offered_eps"] * 2.0)
            assert step["answered"] == step["events"] and step["unanswered"] == 0
            assert step["answered_twice"] == 0
            assert 0 < step["requests"] <= step["events"]
            assert step["p50_ms"] <= step["p99_ms"] <= step["max_ms"]
            assert step["worker_cpu_pct"] is not None and step["worker_cpu_pct"] > 0
            assert step["ingest_cpu_pct"] is not None and step["bench_cpu_pct"] > 0
            assert step["batch_users_mean"] >= 1  # every message says its decoding call's size
            assert not step["overloaded"]
        assert phase["held_eps"] == 6.0
    assert report["held_ratio_2_over_1"] == 1.0
    assert json.loads(json_path.read_text())["phases"][0]["steps"][0]["events"] == 6
    assert png_path.stat().st_size > 1000
    printed = capsys.readouterr().out
    assert printed.count("load 1w") == 2 and printed.count("load 2w") == 2


def test_guarantees_are_compared_per_worker_count() -> None:
    phase = {"peak_answered_eps": 1.0, "steps": []}
    phases = [
        {**phase, "guarantee": "at_least_once", "workers": 1, "held_eps": 100.0},
        {**phase, "guarantee": "exactly_once", "workers": 1, "held_eps": 50.0},
    ]
    assert load.ratios(phases)["held_ratio_exactly_once_over_at_least_once"] == {"1": 0.5}
    merged = load.merge_reports({"phases": phases[:1]}, {"phases": phases[1:]})
    assert [p["guarantee"] for p in merged["phases"]] == ["at_least_once", "exactly_once"]


def test_refresh_before_a_phase_runs_the_offline_refresh_and_says_why_it_failed(
    monkeypatch, tmp_path
) -> None:
    settings = Settings(home=tmp_path)
    assert load.refresh_prefix_kv(settings, LoadConfig(), "r", 1) == {}  # not asked for
    commands: list[list[str]] = []

    def fake_run(command, env, stdout, stderr, timeout):
        commands.append(command)
        assert env["GENREC_HOME"] == str(settings.home)
        return subprocess.CompletedProcess(command, returncode=3)

    monkeypatch.setattr(load.subprocess, "run", fake_run)
    with pytest.raises(UserFacingError, match="exited with 3; see .*load-r-2w-refresh.log"):
        load.refresh_prefix_kv(settings, LoadConfig(refresh=True), "r", 2)
    assert commands[0][-5:-2] == ["offline", "refresh", "--no-semantic-ids"]


class NewTopicConsumer:
    """A librdkafka consumer's metadata calls on a broker that has just created the topic:
    ``leaderless`` watermark queries fail with NOT_LEADER_FOR_PARTITION first."""

    def __init__(self, leaderless: int, error_code: int | None = None) -> None:
        from confluent_kafka import KafkaError

        self.leaderless = leaderless
        self.error_code = KafkaError.NOT_LEADER_FOR_PARTITION if error_code is None else error_code
        self.assigned = None

    def list_topics(self, topic, timeout):
        from types import SimpleNamespace

        partitions = {0: None, 1: None}
        return SimpleNamespace(topics={topic: SimpleNamespace(error=None, partitions=partitions)})

    def get_watermark_offsets(self, partition, timeout):
        from confluent_kafka import KafkaError, KafkaException

        if self.leaderless:
            self.leaderless -= 1
            raise KafkaException(KafkaError(self.error_code))
        return 0, 10 + partition.partition

    def assign(self, partitions):
        self.assigned = [(p.partition, p.offset) for p in partitions]


def test_answers_are_read_from_the_end_once_a_new_topic_has_leaders(monkeypatch):
    monkeypatch.setattr(load, "GROUP_POLL_S", 0.0)
    consumer = NewTopicConsumer(leaderless=3)
    load._assign_at_end(consumer, "answers", timeout_s=5.0)
    assert consumer.assigned == [(0, 10), (1, 11)]


def test_a_watermark_error_that_is_not_about_leaders_is_raised(monkeypatch):
    from confluent_kafka import KafkaError, KafkaException

    monkeypatch.setattr(load, "GROUP_POLL_S", 0.0)
    consumer = NewTopicConsumer(leaderless=1, error_code=KafkaError.TOPIC_AUTHORIZATION_FAILED)
    with pytest.raises(KafkaException):
        load._assign_at_end(consumer, "answers", timeout_s=5.0)
    consumer = NewTopicConsumer(leaderless=10**6)  # never a leader: the deadline ends it
    with pytest.raises(KafkaException):
        load._assign_at_end(consumer, "answers", timeout_s=0.05)


def test_a_phase_takes_its_stored_events_out_unless_told_to_keep_them(tmp_path, capsys) -> None:
    settings = Settings(home=tmp_path)
    engine = make_engine(str(settings.database_url))
    row = {"user_id": "u", "item_id": "i", "event_type": "view"}
    write_events(engine, [{**row, "event_id": "real", "ts_ms": 5}])
    write_events(engine, [{**row, "event_id": f"load-x-{i}", "ts_ms": 9} for i in range(3)])
    engine.dispose()
    sent = ["load-x-0", "load-x-1", "load-x-2", "load-x-3"]  # the last never stored

    assert load.remove_sent_events(settings, sent, LoadConfig(keep_events=True), 0.0) == {}
    assert _store_figures(settings)[:2] == (4, 3)
    figures = load.remove_sent_events(settings, sent, LoadConfig(), 0.0)
    assert figures == {"events_sent": 4, "events_removed": 3}
    assert "1 were not stored (yet)" in capsys.readouterr().out
    assert _store_figures(settings) == (1, 0, [("u", 5, 5)])


def test_a_store_that_would_reuse_deleted_ids_keeps_the_events(tmp_path, monkeypatch, capsys):
    settings = Settings(home=tmp_path)
    monkeypatch.setattr(load, "reuses_event_ids", lambda engine: True)
    figures = load.remove_sent_events(settings, ["load-x-0"], LoadConfig(), 0.0)
    assert figures == {"events_sent": 1, "events_removed": 0}
    assert "predates AUTOINCREMENT" in capsys.readouterr().out
