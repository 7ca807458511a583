"""``genrec bench sessions`` (app/bench/sessions.py) on the small real serving version: the
three ways serve the same sessions, the kept prompts grow to the limit and start again,
and the store is left as it was."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from genrec.app.bench.sessions import _batches, print_report, run_sessions_bench, serving_bundle
from genrec.infra.database import make_engine
from genrec.infra.settings import Settings
from tests.helpers import count_rows


def test_every_round_sends_every_user_once_in_batches_of_distinct_users() -> None:
    import random

    batches = _batches(["a", "b", "c", "d", "e"], 3, 2, random.Random(0))
    assert [len(b) for b in batches] == [2, 2, 1] * 3
    assert all(len(set(b)) == len(b) for b in batches)
    for round_start in (0, 3, 6):
        assert sorted(sum(batches[round_start : round_start + 3], [])) == list("abcde")


@pytest.mark.slow
def test_sessions_bench_grows_kept_prompts_to_the_limit(serving_home: Path, tmp_path, capsys):
    home = tmp_path / "home"
    shutil.copytree(serving_home, home)
    settings = Settings(home=home)
    engine = make_engine(settings.database_url)
    bundle = serving_bundle(settings, engine)
    before = count_rows(settings.database_url)
    # H = 20 in the small version: 30 new events take most users past 1.5H = 30 items
    report = run_sessions_bench(settings, engine, bundle, users=6, events=30, batch_users=3, seed=1)
    assert count_rows(settings.database_url) == before  # histories in memory: nothing written
    assert report["history_items"] == 20 and report["max_prompt_items"] == 30
    kept, limit_h, none = report["sides"]
    assert [s["name"] for s in report["sides"]] == ["kept", "kept, limit H", "none"]
    assert all(s["requests"] == 6 * 30 for s in report["sides"])
    assert kept["served"] > limit_h["served"] and none["served"] == 0
    assert kept["rebased"] > 0  # some user's kept prompt reached 30 items and started again
    assert kept["prefilled_tokens_mean"] < limit_h["prefilled_tokens_mean"]
    assert kept["prefilled_tokens_mean"] < none["prefilled_tokens_mean"]
    assert kept["time_vs_kept"] == 1.0
    print_report(report)
    out = capsys.readouterr().out
    assert "kept, limit H" in out and "x kept" in out
    json.dumps(report)  # the CLI writes it as JSON
    engine.dispose()
