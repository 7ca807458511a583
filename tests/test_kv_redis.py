"""The Redis prefix-KV backend (online/prefix_kv_redis.py): key layout and settings (unit),
then against a real redis-server: the refresh's writes and a batch read equal to the local
backend's, reuse, garbage collection after activation, a one-node Redis Cluster, AUTH,
and Redis going away mid-serving and coming back."""

from __future__ import annotations

import logging
import os
import signal
import time
import uuid
from pathlib import Path

import pytest
import torch
from redis.crc import key_slot

from genrec.app.redis_server import LocalRedis
from genrec.infra.database import make_engine
from genrec.infra.settings import RedisSettings, Settings
from genrec.online.decoding.prefix_kv import (
    ModelVersionMismatch,
    PrefixKV,
    prefix_kv_from_bytes,
    prefix_kv_to_bytes,
)
from genrec.online.prefix_kv_redis import RedisKeys, RedisKVStore, make_client
from genrec.online.prefix_kv_store import (
    KVStoreUnavailable,
    LocalDirKVStore,
    open_kv_store,
)
from tests.helpers import kv_entry, random_prefix_kv


def _same(a: PrefixKV, b: PrefixKV) -> bool:
    tensors = zip(a.keys + a.values, b.keys + b.values, strict=True)
    return a.prompt_ids == b.prompt_ids and all(torch.equal(x, y) for x, y in tensors)


def _store(server: LocalRedis, tmp_path: Path, **redis_settings) -> RedisKVStore:
    """A Redis store on ``server`` with a prefix of its own (tests share the server)."""
    prefix = f"test:{uuid.uuid4().hex[:8]}"
    settings = Settings(
        home=tmp_path, online={"kv_store": "redis"},
        redis=server.settings(key_prefix=prefix, **redis_settings),
    )  # fmt: skip
    store = open_kv_store(settings, make_engine(settings.database_url))
    assert isinstance(store, RedisKVStore)
    return store


def _keys(server: LocalRedis, store: RedisKVStore) -> set[str]:
    return {k.decode() for k in server.client().scan_iter(f"{store.keys.prefix}:*")}


# --- unit: key layout, settings, values ------------------------------------------------


def test_keys_spread_users_over_slots_and_keep_a_users_versions_together() -> None:
    keys = RedisKeys("genrec:pkv")
    key = keys.user(7, "user-1")
    digest = RedisKeys.digest("user-1")
    assert key == f"genrec:pkv:{{{digest}}}:v000007"
    # COPY from the previous version (reuse) is legal in a Cluster: same slot
    assert key_slot(key.encode()) == key_slot(keys.user(8, "user-1").encode())
    slots = {key_slot(keys.user(7, f"u{n}").encode()) for n in range(200)}
    assert len(slots) > 190  # spread, not one hot slot
    odd = keys.user(1, "a{b}c:d")  # user ids never shape the hash tag
    assert odd.count("{") == 1 and keys.version_users(7) == "genrec:pkv:v000007:users"


def test_settings_from_the_environment_and_secrets_stay_masked(monkeypatch) -> None:
    monkeypatch.setenv("GENREC_ONLINE__KV_STORE", "redis")
    monkeypatch.setenv("GENREC_REDIS__HOST", "cache.internal")
    monkeypatch.setenv("GENREC_REDIS__PASSWORD", "hunter2-secret")
    monkeypatch.setenv("GENREC_REDIS__TLS", "true")
    settings = Settings()
    assert settings.online.kv_store == "redis" and settings.redis.tls
    assert settings.redis.password.get_secret_value() == "hunter2-secret"
    assert "hunter2-secret" not in repr(settings) + str(settings.redacted())
    assert RedisSettings().socket_timeout_s <= 0.5  # serving fails over fast by default


def test_client_and_store_never_show_the_password() -> None:
    settings = RedisSettings(port=1, password="hunter2-secret", username="genrec")
    client = make_client(settings, timeout_s=0.1)  # connects only on first use
    store = RedisKVStore(client, client, make_engine("sqlite://"), where="127.0.0.1:1/0")
    assert "hunter2-secret" not in repr(client) + repr(store) + repr(client.connection_pool)


def test_values_are_the_safetensors_files(tmp_path: Path) -> None:
    prefix = random_prefix_kv(6)
    data = prefix_kv_to_bytes(prefix)
    assert _same(prefix_kv_from_bytes(data, "m1"), prefix)
    with pytest.raises(ModelVersionMismatch):
        prefix_kv_from_bytes(data, "m2")
    with pytest.raises(ValueError):
        prefix_kv_from_bytes(b"\x00" * 4, "m1")
    local = LocalDirKVStore(tmp_path / "kv", make_engine("sqlite://"))
    local.put_many(1, [(kv_entry("u", 1, 6), prefix)])
    on_disk = (local.root / local.lookup(1, "u").path).read_bytes()
    # the same bytes but for the header's key order: the same size (the budget's bound)
    assert len(on_disk) == len(data) and _same(prefix_kv_from_bytes(on_disk, "m1"), prefix)


# --- the real redis-server ---------------------------------------------------------------


def test_batch_load_equals_the_local_backend(redis_server: LocalRedis, tmp_path: Path) -> None:
    store = _store(redis_server, tmp_path)
    local = LocalDirKVStore(tmp_path / "kv", make_engine("sqlite://"))
    written = {f"user-{n}": random_prefix_kv(3 + n) for n in range(8)}
    pairs = [(kv_entry(u, 5, len(p.prompt_ids)), p) for u, p in written.items()]
    store.put_many(5, pairs)
    local.put_many(5, pairs)
    users = [*written, "nobody"]
    from_redis = store.load_many(5, users, expected_model_version="m1")
    from_files = local.load_many(5, users, expected_model_version="m1")
    assert set(from_redis) == set(from_files) == set(written)
    for user_id, (entry, prefix) in from_redis.items():
        local_entry, local_prefix = from_files[user_id]
        assert _same(prefix, local_prefix) and _same(prefix, written[user_id])
        assert (entry.cutoff_event_row, entry.n_tokens, entry.nbytes) == (
            local_entry.cutoff_event_row, local_entry.n_tokens, local_entry.nbytes,
        )  # fmt: skip
    assert set(store.lookup_many(5, users)) == set(written)
    assert store.lookup(6, "user-1") is None  # other versions never leak
    # the refresh's reads (reuse, budget, sizes) come from the same index rows
    assert store.sizes(5)["users"] == 8 == len(store.entries(5, user_ids=list(written)))
    stale = store.load_many(5, ["user-1"], expected_model_version="m2")["user-1"]
    assert isinstance(stale, ModelVersionMismatch)
    # a damaged key is that user's error; the rest of the batch loads
    redis_server.client().set(store.keys.user(5, "user-2"), b"not a hash")
    damaged = store.load_many(5, ["user-1", "user-2"], expected_model_version="m1")
    assert isinstance(damaged["user-2"], Exception) and _same(
        damaged["user-1"][1], written["user-1"]
    )


def test_one_round_trip_per_batch(redis_server: LocalRedis, tmp_path: Path) -> None:
    store = _store(redis_server, tmp_path)
    store.put_many(1, [(kv_entry(f"u{n}", 1, 4), random_prefix_kv(4)) for n in range(32)])
    store.load_many(1, ["u0"], "m1")  # the connection's own set-up (CLIENT SETINFO) is done
    client = redis_server.client()
    before = int(client.info("stats")["total_commands_processed"])
    loaded = store.load_many(1, [f"u{n}" for n in range(32)], expected_model_version="m1")
    after = int(client.info("stats")["total_commands_processed"])
    assert len(loaded) == 32
    assert after - before == 32 + 1  # 32 HMGETs in one pipeline, plus our INFO


def test_reuse_and_collection_after_activation(redis_server: LocalRedis, tmp_path: Path) -> None:
    store = _store(redis_server, tmp_path, write_batch=3)  # several UNLINK pipelines per version
    first = {f"u{n}": random_prefix_kv(4 + n) for n in range(7)}
    store.put_many(1, [(kv_entry(u, 1, len(p.prompt_ids)), p) for u, p in first.items()])
    old = store.entries(1)
    # version 2: six users unchanged (copied, with a later cutoff), one recomputed
    store.reuse_many(2, [(kv_entry(u, 2, len(first[u].prompt_ids), row=20), old[u])
                         for u in list(first)[:6]])  # fmt: skip
    store.put_many(2, [(kv_entry("u6", 2, 11, row=20), random_prefix_kv(11))])
    loaded = store.load_many(2, list(first), expected_model_version="m1")
    assert all(_same(loaded[u][1], first[u]) for u in list(first)[:6])
    assert loaded["u0"][0].cutoff_event_row == 20 and loaded["u0"][0].kv_version == 2
    # a killed run left version 3 half-written (no index rows for part of it)
    store.put_many(3, [(kv_entry("u0", 3, 4), random_prefix_kv(4))])
    assert store.garbage_collect(keep_versions=[2]) == 2
    left = _keys(redis_server, store)
    assert left == {store.keys.versions, store.keys.version_users(2)} | {
        store.keys.user(2, u) for u in first
    }
    assert store.load_many(1, ["u0"], "m1") == {} and store.entries(1) == {}
    store.discard(2)
    assert _keys(redis_server, store) == set()


def test_a_vanished_value_is_not_reused(redis_server: LocalRedis, tmp_path: Path) -> None:
    store = _store(redis_server, tmp_path)
    store.put_many(1, [(kv_entry(u, 1, 4), random_prefix_kv(4)) for u in ("a", "b")])
    old = store.entries(1)
    redis_server.client().unlink(store.keys.user(1, "a"))  # e.g. someone flushed it
    store.reuse_many(2, [(kv_entry(u, 2, 4), old[u]) for u in ("a", "b")])
    assert set(store.entries(2)) == {"b"} and set(store.load_many(2, ["a", "b"], "m1")) == {"b"}


@pytest.mark.integration  # starts a redis-server of its own
def test_failed_writes_fail_the_batch(tmp_path: Path) -> None:
    with LocalRedis.start() as server:
        store = _store(server, tmp_path)
        server.client().config_set("maxmemory", "1mb")  # noeviction: writes past it fail
        big = random_prefix_kv(4000)  # ~256 KB each
        with pytest.raises(Exception, match="maxmemory"):
            store.put_many(1, [(kv_entry(f"u{n}", 1, 4000), big) for n in range(8)])
        assert store.entries(1) == {}  # nothing indexed: the refresh fails, nothing activates


@pytest.mark.integration  # starts a redis-server of its own
def test_a_one_node_cluster_takes_every_command(tmp_path: Path) -> None:
    with LocalRedis.start(cluster=True) as server:
        store = _store(server, tmp_path, write_batch=2)
        assert hasattr(store.reader, "get_nodes")  # the cluster client
        store.put_many(1, [(kv_entry(f"u{n}", 1, 4), random_prefix_kv(4)) for n in range(5)])
        old = store.entries(1)
        store.reuse_many(2, [(kv_entry(u, 2, 4), old[u]) for u in old])  # COPY within a slot
        assert set(store.load_many(2, list(old), "m1")) == set(old)
        assert store.garbage_collect([2]) == 1 and store.load_many(1, ["u0"], "m1") == {}


@pytest.mark.integration  # starts a redis-server of its own
def test_auth_is_required_and_never_logged(tmp_path: Path, caplog) -> None:
    secret = "s3cret-" + uuid.uuid4().hex
    with LocalRedis.start(password=secret) as server:
        caplog.set_level(logging.DEBUG)
        store = _store(server, tmp_path)
        store.put_many(1, [(kv_entry("u", 1, 4), random_prefix_kv(4))])
        assert set(store.load_many(1, ["u"], "m1")) == {"u"}
        wrong = _store(server, tmp_path, password="wrong")
        with pytest.raises(Exception, match="(?i)auth|password|WRONGPASS"):
            wrong.put_many(1, [(kv_entry("v", 1, 4), random_prefix_kv(4))])
        server.halt()
        with pytest.raises(KVStoreUnavailable) as failure:
            store.load_many(1, ["u"], "m1")
    assert secret not in caplog.text + str(failure.value) + repr(store)


@pytest.mark.integration  # starts a redis-server of its own
def test_unreachable_redis_fails_fast_and_recovers(tmp_path: Path) -> None:
    with LocalRedis.start() as server:
        store = _store(server, tmp_path, retry_after_s=0.5)
        store.put_many(1, [(kv_entry("u", 1, 4), random_prefix_kv(4))])
        os.kill(server.process.pid, signal.SIGSTOP)  # a stalled Redis: reads time out
        try:
            started = time.monotonic()
            with pytest.raises(KVStoreUnavailable):
                store.load_many(1, ["u"], "m1")
            assert time.monotonic() - started < 1.5  # (1 + retries) x socket_timeout_s
            started = time.monotonic()
            with pytest.raises(KVStoreUnavailable, match="moments ago"):
                store.load_many(1, ["u"], "m1")  # within retry_after_s: no wait at all
            assert time.monotonic() - started < 0.05
        finally:
            os.kill(server.process.pid, signal.SIGCONT)
        time.sleep(0.6)
        assert set(store.load_many(1, ["u"], "m1")) == {"u"}


# --- unit: the worker's LRU in front of a batch-reading store --------------------------


class BatchStore:
    """Answers ``load_many`` from a dict; ``down`` makes it unreachable."""

    def __init__(self, users: set[str]) -> None:
        self.users, self.down, self.calls = users, False, []

    def load_many(self, kv_version, user_ids, expected_model_version):
        self.calls.append(list(user_ids))
        if self.down:
            raise KVStoreUnavailable("gone")
        return {u: (f"entry-{u}", f"kv-{u}") for u in user_ids if u in self.users}


def test_lru_reads_a_batchs_misses_at_once_and_forgets_an_outage() -> None:
    from genrec.online.recommender import PrefixKVCache

    store, cache = BatchStore({"a", "b"}), PrefixKVCache(size=10)
    found, down = cache.get_many(store, 1, ["a", "b", "c", "a"], "m1")
    assert set(found) == {"a", "b"} and not down and store.calls == [["a", "b", "c"]]
    store.down = True
    found, down = cache.get_many(store, 1, ["a", "c", "d", "e"], "m1")
    assert set(found) == {"a"} and down == {"d", "e"}  # c: a remembered miss
    assert store.calls[-1] == ["d", "e"]
    store.down, store.users = False, {"a", "b", "d"}
    found, down = cache.get_many(store, 1, ["d", "e"], "m1")  # the outage was not remembered
    assert set(found) == {"d"} and not down and store.calls[-1] == ["d", "e"]


@pytest.mark.integration  # starts a redis-server of its own
def test_tls_with_the_servers_ca(tmp_path: Path) -> None:
    with LocalRedis.start(tls=True, password="tls-" + uuid.uuid4().hex) as server:
        store = _store(server, tmp_path)  # tls, tls_ca_file, hostname checked against the IP
        store.put_many(1, [(kv_entry("u", 1, 4), random_prefix_kv(4))])
        assert set(store.load_many(1, ["u"], "m1")) == {"u"}
        plain = _store(server, tmp_path, tls=False)
        with pytest.raises(KVStoreUnavailable):
            plain.load_many(1, ["u"], "m1")


def test_a_cluster_node_gets_a_port_redis_cluster_accepts() -> None:
    """Redis Cluster refuses a client port above 55,535 (its bus is 10,000 higher); the
    kernel's ephemeral ports reach 60,999, so a plain free port failed ~1 start in 5."""
    from genrec.app.redis_server import CLUSTER_BUS_OFFSET, CLUSTER_MAX_PORT, free_port

    for _ in range(20):
        port = free_port(cluster=True)
        assert port <= CLUSTER_MAX_PORT and port + CLUSTER_BUS_OFFSET <= 65_535
