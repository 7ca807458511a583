"""``genrec bench prompt-limits`` (app/bench/prompt_limits.py) on the small real serving
version: the events stored after the refresh replayed once per limit, scored
prequentially, with the store left as it was."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from genrec.app.bench.prompt_limits import print_report, run_prompt_limits_bench
from genrec.app.bench.sessions import serving_bundle
from genrec.infra.database import make_engine
from genrec.infra.settings import Settings
from genrec.ingest.history import load_item_ids
from genrec.ingest.store import write_events
from tests.helpers import count_rows


@pytest.mark.slow
def test_prompt_limits_replays_the_events_since_the_refresh(serving_home: Path, tmp_path, capsys):
    home = tmp_path / "home"
    shutil.copytree(serving_home, home)
    settings = Settings(home=home)
    engine = make_engine(settings.database_url)
    bundle = serving_bundle(settings, engine)
    with pytest.raises(ValueError, match="nothing to replay"):  # the refresh saw every event
        run_prompt_limits_bench(settings, engine, bundle, [20, 30])
    # three users send 15 events each after the refresh (H = 20 in the small version)
    catalog = load_item_ids(engine)
    rows = [{"event_id": f"after-{u}-{n}", "user_id": u, "item_id": catalog[(7 * n + int(u)) % 300],
             "event_type": "view", "ts_ms": 10**13 + 1000 * n} for n in range(15) for u in "123"]  # fmt: skip
    write_events(engine, rows)

    before = count_rows(settings.database_url)
    report = run_prompt_limits_bench(settings, engine, bundle, [20, 30])
    assert count_rows(settings.database_url) == before
    assert report["events"] == 45 and report["scored"] == 42  # each user's first is not scored
    tight, wide = report["limits"]
    assert (tight["limit"], wide["limit"]) == (20, 30)
    assert tight["prompt_items_mean"] <= 20 and wide["prompt_items_mean"] <= 30
    assert tight["rebased"] > wide["rebased"]  # at the window itself every new item rebases
    assert all(
        0.0 <= row[k] <= 1.0 for row in (tight, wide) for k in ("hr_generative", "hr_merged")
    )
    assert tight["time_vs_first"] == 1.0
    print_report(report)
    assert "limit   30 items" in capsys.readouterr().out
    json.dumps(report)
    engine.dispose()
