"""Refresh fakes shared by ``test_refresh.py`` and ``test_refresh_kill.py``.

Semantic-ID building and training are replaced by recording fakes (``FakeSteps``);
the models are a real (untrained) ``tiny`` preset target over a 40-item catalog, so
the prefix KV step computes and stores real caches.
"""

from __future__ import annotations

from pathlib import Path

import torch
from sqlalchemy import Engine, insert, select

from genrec.infra.serving_versions import active_serving_version
from genrec.infra.settings import Settings
from genrec.offline.refresh import RefreshSteps
from genrec.online.models.generative import GenerativeModels
from genrec.online.models.presets import PRESETS, build_target
from genrec.online.prefix_kv_store import open_kv_store
from genrec.online.prompts import ItemTokens
from genrec.schemas.tables import events, job_runs
from genrec.schemas.token_layout import TokenLayout

LAYOUT = TokenLayout.for_scratch_model((8, 8, 4))
ITEMS = [str(i) for i in range(40)]
USERS = 12


class InjectedFailure(RuntimeError):
    """Raised by ``FakeSteps`` after its ``fail_at`` step."""


def make_settings(home: Path, database_url: str, **refresh) -> Settings:
    """Refresh settings for the 12 fake users, with ``refresh`` overrides."""
    # 5 users per read: the 12 users come in three pages, so paging is exercised too
    defaults = {"kv_batch_size": 4, "kv_users_per_read": 5, "lock_lease_s": 30.0,
                "keep_versions": 2}  # fmt: skip
    return Settings(home=home, database_url=database_url, refresh={**defaults, **refresh})


def add_events(engine: Engine, users: range, per_user: int, start_ts: int = 0) -> None:
    """``per_user`` views each for users ``u{n}``, one second apart from ``start_ts``."""
    rows = []
    for user in users:
        for n in range(per_user):
            ts = start_ts + n * 1000
            rows.append({"event_id": f"u{user}-{ts}", "user_id": f"u{user}",
                         "item_id": ITEMS[(user * 7 + n * 3 + start_ts) % len(ITEMS)],
                         "event_type": "view", "ts_ms": ts})  # fmt: skip
    with engine.begin() as connection:
        connection.execute(insert(events), rows)


def tiny_models(version: int) -> GenerativeModels:
    """An untrained ``tiny`` target over ``ITEMS`` (no drafts), seeded by ``version``."""
    torch.manual_seed(version)
    codes = [[i % 8, i // 8, 0] for i in range(len(ITEMS))]
    target = build_target(PRESETS["tiny"], LAYOUT).eval()
    item_tokens = ItemTokens(ITEMS, codes, LAYOUT)
    return GenerativeModels(target, {}, item_tokens, history_items=6, preset="tiny",
                            version=version, semantic_id_version=1)  # fmt: skip


class FakeSteps(RefreshSteps):
    """Records what the run asked for; ``fail_at`` raises after the named step."""

    def __init__(
        self, fail_at: str | None = None, model_version: int = 1, has_model: bool = True
    ) -> None:
        self.calls: list[tuple] = []
        self.fail_at = fail_at
        self.model_version = model_version
        self.batches = 0
        super().__init__(
            refresh_semantic_ids=self._semantic_ids,
            train_models=self._train,
            load_models=lambda _s, _e: tiny_models(self.model_version),
            has_active_model=lambda _e: has_model,
            fit_recall=lambda _s, _e: self.calls.append(("recall",)),
            checkpoint=self._checkpoint,
        )

    def _semantic_ids(self, _settings, _engine, full: bool):
        self.calls.append(("semantic_ids", full))
        return 5, {"items": len(ITEMS), "kind": "full" if full else "incremental"}

    def _train(self, _settings, _engine, retrain_target: bool) -> None:
        self.calls.append(("train", retrain_target))
        self.model_version += 1

    def _checkpoint(self, name: str) -> None:
        if name == "prefix_kv_batch":
            self.batches += 1
        if name == self.fail_at:
            raise InjectedFailure(f"injected after {name}")


def runs(engine: Engine) -> list[dict]:
    """Every recorded refresh run, oldest first."""
    with engine.connect() as connection:
        return [dict(r) for r in connection.execute(select(job_runs).order_by(job_runs.c.id)).mappings()]  # fmt: skip


def assert_serves(settings: Settings, engine: Engine, version: int, model_version: str) -> None:
    """``version`` is active and every user's prefix KV of it loads under its model version."""
    active = active_serving_version(engine)
    assert active.version == version and active.kv_version == version
    assert active.model_version == model_version
    store = open_kv_store(settings, engine)
    for user in range(USERS):
        entry = store.lookup(active.kv_version, f"u{user}")
        assert entry is not None, f"u{user} has no prefix KV in the active version"
        prefix_kv = store.load(entry, expected_model_version=model_version)
        assert prefix_kv.prompt_ids[0] == LAYOUT.bos_token_id
