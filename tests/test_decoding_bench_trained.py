"""``genrec bench decode`` on a trained model version: tiny preset trained on real ML-100K users."""

from __future__ import annotations

import pytest

from genrec.app.bench.decode import load_trained_models, run_decode_bench
from genrec.infra.settings import DecodeSettings
from genrec.offline.training.run import train_models
from genrec.online.models.store import load_model_version
from tests.helpers import tiny_settings


@pytest.mark.slow
def test_bench_runs_on_the_active_trained_version(
    ml100k_sample_store, synthetic_semantic_ids, tmp_path
):
    settings = tiny_settings(tmp_path)
    train_models(settings, ml100k_sample_store, semantic_ids=synthetic_semantic_ids, progress=False)
    with pytest.raises(ValueError, match="not 'small'"):
        load_trained_models("small", settings=settings, engine=ml100k_sample_store)
    models = load_trained_models("tiny", n_users=6, settings=settings, engine=ml100k_sample_store)
    # the bench speculates as the worker would
    version = load_model_version(settings, ml100k_sample_store)
    assert models.drafts == (version.drafts_for("strict")[0], "atspeed_r")
    assert all(u.seen and u.held_out not in u.seen for u in models.eval_users)
    report = run_decode_bench(models, ks=[5], batch_sizes=[3], n_users=6, decode=DecodeSettings())
    assert report["lossless"] and report["exclude_seen"]
    row = report["rows"][0]
    assert row["hf_equals_target_only_users"] == 1.0
    assert row["strict_equals_target_only"] and row["strict_max_rank_score_gap"] < 1e-4
    assert row["prefix_equals_full_prompt"] and row["prefix_max_rank_score_gap"] < 1e-4
    assert 0.0 <= row["strict"]["hr_at_k"] <= 1.0 and row["strict"]["acceptance"] is not None
