"""``genrec bench serve`` end to end on tiny random models (a smoke test: figures, not speed)."""

from __future__ import annotations

import json

import pytest

from genrec.app.bench.serve import run_serve_bench


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["target", "strict"])
def test_bench_serve_reports_both_sides_and_agreement(tmp_path, monkeypatch, mode) -> None:
    from genrec.infra.settings import get_settings

    monkeypatch.setenv("GENREC_HOME", str(tmp_path))
    get_settings.cache_clear()
    try:
        figures = run_serve_bench(
            users=3, batch_sizes=(1, 3), json_path=tmp_path / "serve.json", preset="tiny",
            mode=mode, repeats=1, threads=1, random_models=True, history_items=20,
        )  # fmt: skip
    finally:
        get_settings.cache_clear()
    assert figures["beam_width"] == 20  # the worker's: 2 x online.k
    for row in figures["batches"].values():
        assert row["full_prompt_ms"] > 0 and row["prefix_kv_ms"] > 0
        assert row["same_items_users"] == row["same_scores_users"] == 3
        assert row["max_rank_score_gap"] < 1e-4
        assert row["prefix_kv_with_load_ms"] >= row["prefix_kv_ms"]
    assert (figures["draft_prefill_ms_per_user"] > 0) == (mode == "strict")
    assert json.loads((tmp_path / "serve.json").read_text())["mode"] == mode
    assert (tmp_path / "var" / "reports" / "bench_serve.png").exists()
