"""Logging set-up (infra/logs.py): the current stderr, per-logger levels, JSON lines."""

from __future__ import annotations

import io
import json
import logging
import sys

import pytest

from genrec.infra.logs import configure_logging, parse_log_levels
from genrec.infra.settings import Settings


@pytest.fixture(autouse=True)
def _restore_logging():
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:], root.level = handlers, level
    logging.getLogger("kafka.coordinator").setLevel(logging.NOTSET)


def test_records_follow_sys_stderr_when_it_is_swapped(monkeypatch) -> None:
    first, second = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    configure_logging("INFO")
    logging.getLogger("genrec.test").info("one")
    first.close()  # e.g. a harness that captured one test's output and moved on
    monkeypatch.setattr(sys, "stderr", second)
    logging.getLogger("genrec.test").info("two")
    assert "genrec.test: two" in second.getvalue()


def test_json_lines_and_per_logger_levels(monkeypatch) -> None:
    out = io.StringIO()
    monkeypatch.setattr(sys, "stderr", out)
    configure_logging("WARNING", "json", "kafka.coordinator=DEBUG")
    logging.getLogger("kafka.coordinator").debug("joining")
    logging.getLogger("genrec.test").info("hidden")
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [(r["logger"], r["msg"]) for r in lines] == [("kafka.coordinator", "joining")]


def test_log_levels_are_checked_when_settings_load() -> None:
    assert parse_log_levels(" kafka=debug , genrec.online=WARNING ") == {
        "kafka": "DEBUG", "genrec.online": "WARNING",
    }  # fmt: skip
    assert parse_log_levels("") == {}
    for bad in ("kafka", "kafka=LOUD", "=DEBUG"):
        with pytest.raises(ValueError, match="logger=LEVEL"):
            parse_log_levels(bad)
    with pytest.raises(ValueError, match="log_levels"):
        Settings(log_levels="kafka=LOUD")
