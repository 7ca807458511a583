"""The Redis prefix-KV tier end to end with a real redis-server: the refresh writes into it
(equal to the local backend's caches, old versions deleted after activation, nothing
activated when Redis fails mid-write), and workers serve from it, fall back to the prompt
while it is gone, and hit again once it is back."""

from __future__ import annotations

import logging
import time
import uuid
from pathlib import Path

import pytest
import torch
from prometheus_client import REGISTRY

from genrec.app.redis_server import LocalRedis
from genrec.infra.database import make_engine
from genrec.infra.serving_versions import active_serving_version
from genrec.infra.settings import Settings
from genrec.offline.refresh import run_refresh
from genrec.online.live_version import ServingBundle
from genrec.online.prefix_kv_store import open_kv_store
from genrec.online.recommender import GenerativeBatch, Recommender, Request
from genrec.schemas.events import UserEvent
from tests.refresh_fakes import USERS, FakeSteps, add_events, tiny_models

pytestmark = pytest.mark.integration


def _settings(home: Path, server: LocalRedis | None, **online) -> Settings:
    refresh = {"kv_batch_size": 4, "kv_users_per_read": 5, "keep_versions": 2,
               "lock_lease_s": 30.0}  # fmt: skip
    if server is None:
        return Settings(home=home, refresh=refresh, online=online)
    redis = server.settings(key_prefix=f"test:{uuid.uuid4().hex[:8]}")
    return Settings(home=home, refresh=refresh, online={"kv_store": "redis", **online},
                    redis=redis)  # fmt: skip


def _engine(settings: Settings):
    engine = make_engine(settings.database_url)
    add_events(engine, range(USERS), per_user=5)
    return engine


def _redis_keys(server: LocalRedis, settings: Settings) -> set[str]:
    return {k.decode() for k in server.client().scan_iter(f"{settings.redis.key_prefix}:*")}


def test_refresh_into_redis_equals_local_and_collects_old_versions(
    redis_server: LocalRedis, tmp_path: Path
) -> None:
    redis_settings = _settings(tmp_path / "redis", redis_server)
    local_settings = _settings(tmp_path / "local", None)
    redis_engine, local_engine = _engine(redis_settings), _engine(local_settings)
    for settings, engine in ((redis_settings, redis_engine), (local_settings, local_engine)):
        run_refresh(settings, engine, steps=FakeSteps())
    users = [f"u{n}" for n in range(USERS)]
    from_redis = open_kv_store(redis_settings, redis_engine).load_many(1, users, "1")
    from_files = open_kv_store(local_settings, local_engine).load_many(1, users, "1")
    assert set(from_redis) == set(from_files) == set(users)
    for user in users:
        (entry, kv), (local_entry, local_kv) = from_redis[user], from_files[user]
        assert entry.cutoff_event_row == local_entry.cutoff_event_row
        assert kv.prompt_ids == local_kv.prompt_ids
        assert all(
            torch.equal(a, b)
            for a, b in zip(kv.keys + kv.values, local_kv.keys + local_kv.values, strict=True)
        )
    # two more runs (u0 gets new events): version 1 is deleted after version 3 activates
    add_events(redis_engine, range(1), per_user=2, start_ts=10_000)
    second = run_refresh(redis_settings, redis_engine, steps=FakeSteps())
    assert second.counts["kv"]["reused"] == USERS - 1 and second.counts["kv"]["computed"] == 1
    third = run_refresh(redis_settings, redis_engine, steps=FakeSteps())
    assert third.counts["kv_versions_removed"] == 1
    store = open_kv_store(redis_settings, redis_engine)
    keys = store.keys
    assert _redis_keys(redis_server, redis_settings) == {keys.versions} | {
        key for v in (2, 3) for key in [keys.version_users(v), *(keys.user(v, u) for u in users)]
    }
    assert len(store.load_many(3, users, "1")) == USERS


def test_redis_failing_mid_refresh_activates_nothing(tmp_path: Path) -> None:
    with LocalRedis.start() as server:
        settings = _settings(tmp_path, server)
        engine = _engine(settings)
        run_refresh(settings, engine, steps=FakeSteps())
        steps = FakeSteps(model_version=2)  # another model: every cache is written anew
        steps.checkpoint = lambda name: (
            server.halt(save=True) if name == "prefix_kv_batch" else None
        )
        with pytest.raises(Exception, match="(?i)connect|closed|refused"):
            run_refresh(settings, engine, steps=steps)
        assert active_serving_version(engine).version == 1  # the previous version serves on
        server.resume()
        run_refresh(settings, engine, steps=FakeSteps(model_version=2))  # collects run 2's keys
        versions = {
            int(v) for v in server.client().smembers(settings.redis.key_prefix + ":versions")
        }
        assert versions == {1, 3}


class RecordingDecoder:
    """Ranks items by catalog order; records which requests came with a prefix KV."""

    def __init__(self) -> None:
        models = tiny_models(1)
        self.item_tokens, self.history_items = models.item_tokens, models.history_items
        self.with_prefix: list[list[bool]] = []

    def decode(self, requests, beam_width):
        self.with_prefix.append([r.prefix_kv is not None for r in requests])
        items = [[(row, -float(row)) for row in range(beam_width)] for _ in requests]
        return GenerativeBatch(items, [{"mode": "target"} for _ in requests])


def _fallbacks() -> float:
    value = REGISTRY.get_sample_value("genrec_fallbacks_total", {"reason": "kv_store_unavailable"})
    return value or 0.0


def test_workers_serve_from_the_prompt_while_redis_is_gone(tmp_path: Path, caplog) -> None:
    with LocalRedis.start() as server:
        settings = _settings(tmp_path, server, prefix_kv_lru_size=0, k=3)  # every batch asks Redis
        settings.redis.retry_after_s = 0.3
        engine = _engine(settings)
        run_refresh(settings, engine, steps=FakeSteps())
        decoder = RecordingDecoder()
        bundle = ServingBundle("v1", decoder=decoder, kv_store=open_kv_store(settings, engine),
                               kv_version=1, model_version="1")  # fmt: skip
        recommender = Recommender(settings, engine)
        users = [f"u{n}" for n in range(6)]

        def serve(tag: str) -> list[str]:
            requests = [Request.of([UserEvent(event_id=f"{tag}-{u}", user_id=u, item_id="3",
                                              event_type="view", ts=99_000)]) for u in users]  # fmt: skip
            messages = recommender.recommend(requests, bundle)
            assert [m.event_id for m in messages] == [f"{tag}-{u}" for u in users]  # none lost
            assert all(len(m.items) == 3 for m in messages)
            return [m.decoding["path"] for m in messages]

        assert serve("before") == ["prefix_kv"] * 6
        server.halt(save=True)  # Redis goes away mid-serving
        caplog.set_level(logging.WARNING, logger="genrec.online.recommender")
        before = _fallbacks()
        started = time.monotonic()
        assert serve("down") == ["full_prompt"] * 6
        assert serve("still-down") == ["full_prompt"] * 6
        assert time.monotonic() - started < 2.0  # fast failures, not a hang per batch
        assert _fallbacks() - before == 12
        assert len([r for r in caplog.records if "unreachable" in r.getMessage()]) == 1
        server.resume()  # back, with its data
        time.sleep(0.35)  # past redis.retry_after_s
        assert serve("after") == ["prefix_kv"] * 6
        assert decoder.with_prefix == [[True] * 6, [False] * 6, [False] * 6, [True] * 6]
