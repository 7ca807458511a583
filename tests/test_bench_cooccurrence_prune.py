"""``python -m genrec.app.bench.cooccurrence_prune`` on a small matrix: the current prune and
an ``--old`` module (here the same file) give the same matrix, and the report has both."""

import json
from pathlib import Path

import genrec.online.branches as branches
from genrec.app.bench.cooccurrence_prune import main


def test_prune_bench_compares_old_and_new(tmp_path, monkeypatch):
    monkeypatch.setenv("GENREC_RECALL__COOCCURRENCE_MAX_ENTRIES", "4000")
    from genrec.infra.settings import get_settings

    get_settings.cache_clear()
    out = tmp_path / "prune.json"
    try:  # the lowered bound must not outlive this test, whatever main does
        main(["--items", "500", "--pairs", "6k", "--rounds", "1", "--old", branches.__file__,
              "--json", str(out)])  # fmt: skip
    finally:
        get_settings.cache_clear()
    report = json.loads(out.read_text())
    assert report["identical"] is True and report["kept"] <= report["budget"] == 2000
    assert report["pairs"] > 4000 and report["old_over_new"] > 0
    assert Path(branches.__file__).exists()
