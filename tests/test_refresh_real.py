"""The refresh with the real steps on ML-100K: semantic IDs, tiny-preset training, prefix KV.

Skipped until the model store and the training entry point exist
(``genrec.online.models.store``, ``genrec.offline.training.run.train_for_refresh``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from sqlalchemy import insert, select

from genrec.infra.database import make_engine
from genrec.infra.serving_versions import active_serving_version
from genrec.infra.settings import Settings
from genrec.ingest.movielens import store_ml100k
from genrec.offline.refresh import run_refresh
from genrec.online.prefix_kv_store import open_kv_store
from genrec.schemas.tables import events, job_runs


def _has(module: str, name: str | None = None) -> bool:
    if importlib.util.find_spec(module) is None:
        return False
    return name is None or hasattr(importlib.import_module(module), name)


pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (_has("genrec.online.models.store") and _has("genrec.offline.training.run", "train_for_refresh")),
        reason="model store / training entry point not available yet",
    ),
]  # fmt: skip


def test_real_refresh_on_ml100k(tmp_path: Path) -> None:
    settings = Settings(
        home=tmp_path,
        semantic_ids={"epochs": 20, "codes_per_level": 32},
        refresh={"retrain_target": True, "train_preset": "tiny", "kv_batch_size": 64},
    )
    engine = make_engine(settings.database_url)
    store_ml100k(engine)
    first = run_refresh(settings, engine)
    active = active_serving_version(engine)
    assert active.version == first.serving_version and active.model_version is not None
    store = open_kv_store(settings, engine)
    assert store.sizes(active.kv_version)["users"] == 943
    entry = store.lookup(active.kv_version, "1")
    assert len(store.load(entry, active.model_version).prompt_ids) == entry.n_tokens

    with engine.begin() as connection:  # five users come back with one new event each
        connection.execute(insert(events), [
            {"event_id": f"new-{u}", "user_id": str(u), "item_id": "50", "event_type": "view",
             "ts_ms": 10**13 + u} for u in range(1, 6)
        ])  # fmt: skip
    incremental = settings.model_copy(
        update={"refresh": settings.refresh.model_copy(update={"retrain_target": False})}
    )
    second = run_refresh(incremental, engine)
    assert active_serving_version(engine).version == second.serving_version
    with engine.connect() as connection:
        counts = connection.execute(select(job_runs.c.counts).order_by(job_runs.c.id.desc())).first()[0]  # fmt: skip
    assert counts["events_new"] == 5
    assert (
        counts["kv"]["computed"] >= 5 and counts["kv"]["computed"] + counts["kv"]["reused"] == 943
    )
    entry = store.lookup(second.kv_version, "3")
    assert entry.cutoff_event_id == "new-3"
