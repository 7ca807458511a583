"""Progress reporting (infra/progress.py): a bar on a terminal, rate-limited log lines elsewhere."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import sys
from pathlib import Path

import pytest
from tqdm import tqdm

from genrec.infra.logs import configure_logging
from genrec.infra.progress import (
    ProgressLog,
    format_duration,
    format_rate,
    progress_bar,
    quiet_library_bars,
    stderr_is_terminal,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "genrec.progress"]


@pytest.fixture(autouse=True)
def _info(caplog):
    caplog.set_level(logging.INFO, logger="genrec.progress")


def test_a_terminal_gets_a_tqdm_bar_and_anything_else_log_lines(monkeypatch) -> None:
    monkeypatch.setattr(sys, "stderr", Terminal())
    assert stderr_is_terminal()
    bar = progress_bar(range(3), desc="embed", unit="batch")
    assert isinstance(bar, tqdm)
    assert list(bar) == [0, 1, 2]
    assert "embed" in sys.stderr.getvalue()  # tqdm drew on the terminal

    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert not stderr_is_terminal()
    assert isinstance(progress_bar(range(3), desc="embed"), ProgressLog)
    monkeypatch.setattr(sys, "stderr", None)  # pythonw, a daemon without stderr
    assert not stderr_is_terminal()
    closed = io.StringIO()
    closed.close()
    monkeypatch.setattr(sys, "stderr", closed)
    assert not stderr_is_terminal()


def test_lines_at_most_every_n_seconds_and_always_a_final_one(caplog) -> None:
    clock = FakeClock()
    bar = ProgressLog(desc="embed items", total=16_384, unit="ev", every_s=5.0, clock=clock)
    for _ in range(40):  # 40 updates over 10 s: lines at 5 s and 10 s only
        clock.now += 0.25
        bar.update(256)
    assert lines(caplog) == [
        "embed items: 5,120/16,384 ev (31%), 1,024 ev/s, eta 11 s",
        "embed items: 10,240/16,384 ev (62%), 1,024 ev/s, eta 6.0 s",
    ]
    clock.now += 1.0
    bar.update(6_144)
    bar.close()
    bar.close()  # once
    assert lines(caplog)[2:] == ["embed items: 16,384/16,384 ev (100%) in 11 s, 1,489 ev/s"]


def test_a_short_loop_logs_only_its_final_line(caplog, monkeypatch) -> None:
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert list(progress_bar(range(5), desc="prefix KV", unit="batch")) == [0, 1, 2, 3, 4]
    [line] = lines(caplog)
    assert line.startswith("prefix KV: 5/5 batch (100%) in ")
    assert "\r" not in sys.stderr.getvalue()


def test_iteration_closes_on_break_and_on_error(caplog) -> None:
    clock = FakeClock()
    for i in ProgressLog(range(10), desc="replay", unit="ev", clock=clock):
        clock.now += 1.0
        if i == 3:
            break
    with pytest.raises(RuntimeError):
        for _ in ProgressLog(iter(range(10)), desc="stream", clock=clock):  # no len: no total
            clock.now += 1.0
            raise RuntimeError("boom")
    assert lines(caplog) == [
        "replay: 3/10 ev (30%) in 4.0 s, 1.33 s/ev",  # the item in hand when it broke is not done
        "stream: 0 it in 1.0 s",
    ]


def test_postfix_write_disable_and_context_manager(caplog) -> None:
    clock = FakeClock()
    with ProgressLog(desc="train RQ-VAE", total=50, unit="epoch", clock=clock) as bar:
        clock.now += 84.0
        bar.set_postfix(loss=0.0123456, dead=3)
        bar.update(2)
        bar.write("epoch 2: valid HR@10 0.1800\n")
    assert lines(caplog) == [
        "train RQ-VAE: 2/50 epoch (4%), 42 s/epoch, eta 33 min 36 s, loss=0.01235, dead=3",
        "epoch 2: valid HR@10 0.1800",
        "train RQ-VAE: 2/50 epoch (4%) in 1 min 24 s, 42 s/epoch, loss=0.01235, dead=3",
    ]
    caplog.clear()
    quiet = ProgressLog(range(3), desc="quiet", disable=True, every_s=0, clock=clock)
    assert list(quiet) == [0, 1, 2]
    assert lines(caplog) == []
    with pytest.raises(TypeError, match="nothing to iterate"):
        list(ProgressLog(desc="no iterable"))
    with pytest.raises(ValueError, match="every_s"):
        ProgressLog(desc="x", every_s=-1)


def test_json_lines_carry_the_figures(monkeypatch) -> None:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    out = io.StringIO()
    monkeypatch.setattr(sys, "stderr", out)
    try:
        configure_logging("INFO", "json")
        clock = FakeClock()
        bar = ProgressLog(desc="draft sft", total=10, clock=clock)
        clock.now += 2.0
        bar.update(10)
        bar.close()
    finally:
        root.handlers[:], root.level = handlers, level
    [record] = [json.loads(line) for line in out.getvalue().splitlines()]
    assert record["logger"] == "genrec.progress" and record["progress"] == "draft sft"
    assert (record["n"], record["total"], record["rate_per_s"], record["final"]) == (
        10, 10, 5.0, True,
    )  # fmt: skip


def test_formats() -> None:
    assert format_duration(0.42) == "0.4 s"
    assert format_duration(59.6) == "1 min 00 s"
    assert format_duration(7_620) == "2 h 07 min"
    assert format_rate(1_234.5, "ev") == "1,234 ev/s"
    assert format_rate(3.456, "it") == "3.46 it/s"
    assert format_rate(0.5, "epoch") == "2 s/epoch"


def test_library_bars_are_switched_off_off_a_terminal(monkeypatch) -> None:
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    monkeypatch.setattr(sys, "stderr", Terminal())
    quiet_library_bars()
    assert "HF_HUB_DISABLE_PROGRESS_BARS" not in os.environ
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    quiet_library_bars()
    assert os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "0")  # the operator's choice wins
    quiet_library_bars()
    assert os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "0"


def test_no_module_but_this_one_draws_tqdm_bars() -> None:
    root = Path(__file__).resolve().parents[1]
    importers = [
        path.relative_to(root).as_posix()
        for folder in ("schemas", "infra", "ingest", "online", "offline", "app")
        for path in (root / folder).rglob("*.py")
        if re.search(r"^\s*(from tqdm\b|import tqdm\b)", path.read_text(), re.M)
    ]
    assert importers == ["infra/progress.py"]
