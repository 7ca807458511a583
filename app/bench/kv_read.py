"""``genrec bench prefix-kv-read``: a batch of users' prefix KVs read from local files vs
Redis, side by side in one run (app layer; times ``genrec.online.prefix_kv_store`` and
``genrec.online.prefix_kv_redis``).

What a worker does for the users of a batch its LRU does not hold: ``load_many`` on
its KV store. The local backend reads the batch's index rows (one SQLite query) and
one safetensors file per user; the Redis backend sends one pipeline of ``HMGET``s and
parses the same safetensors bytes. Both stores get the same caches: random tensors of
a preset's KV shape (layers x KV heads x head dim) and ``--tokens`` prompt tokens, in
``--dtype``. Batches alternate between the two stores (local first on even repeats),
and the report gives the median ms per batch, MB per batch and Redis / local.

The files are in the OS page cache after they are written (as a worker's hot files
would be), so "local" is the memory-speed floor of the local backend, not a disk
read. Redis is a ``LocalRedis`` on loopback unless ``--redis configured`` points at
the ``[redis]`` settings: a remote Redis adds its network round trip and bandwidth.

Example::

    $ genrec bench prefix-kv-read --users 32 --presets small,smollm2-135m
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from genrec.infra.database import make_engine
from genrec.infra.progress import progress_bar
from genrec.infra.settings import RedisSettings
from genrec.online.decoding.prefix_kv import PrefixKV
from genrec.online.models.presets import get_preset
from genrec.online.prefix_kv_redis import RedisKVStore
from genrec.online.prefix_kv_store import KVShape, LocalDirKVStore, PrefixKVEntry

MODEL_VERSION = "bench"
KV_VERSION = 1


@dataclass
class ReadFigures:
    """One preset's figures: per store the median ms per batch, and their ratio."""

    preset: str
    users_per_batch: int
    batches: int
    repeats: int
    tokens: int
    dtype: str
    mb_per_batch: float
    local_ms: float
    redis_ms: float
    redis_where: str

    @property
    def ratio(self) -> float:
        return self.redis_ms / self.local_ms if self.local_ms else float("nan")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "redis_over_local": round(self.ratio, 3)}


def preset_shape(name: str) -> KVShape:
    """The KV shape of a preset's target (no model is built)."""
    preset = get_preset(name)
    return KVShape(preset.layers, preset.kv_heads, preset.hidden // preset.heads)


def random_prefix_kv(shape: KVShape, tokens: int, dtype: torch.dtype, seed: int) -> PrefixKV:
    generator = torch.Generator().manual_seed(seed)
    size = (shape.kv_heads, tokens - 1, shape.head_dim)

    def tensor() -> torch.Tensor:
        return torch.randn(size, generator=generator).to(dtype)

    keys = [tensor() for _ in range(shape.layers)]
    return PrefixKV(list(range(tokens)), keys, [tensor() for _ in keys], MODEL_VERSION)


def _entry(user_id: str, tokens: int) -> PrefixKVEntry:
    return PrefixKVEntry(user_id=user_id, kv_version=KV_VERSION, model_version=MODEL_VERSION,
                         cutoff_event_row=1, cutoff_ts_ms=0, cutoff_event_id="e",
                         n_tokens=tokens)  # fmt: skip


@contextmanager
def redis_store(redis_settings: RedisSettings | None, engine) -> Iterator[RedisKVStore]:
    """A Redis store on the configured server, or on a ``LocalRedis`` started for the run
    (``redis_settings`` None); its keys are removed afterwards."""
    from genrec.app.redis_server import LocalRedis  # lazy: only when no server is given

    server = LocalRedis.start() if redis_settings is None else None
    if server is not None:
        redis_settings = RedisSettings(**server.settings())
    assert redis_settings is not None
    prefix = f"{redis_settings.key_prefix}:bench:{time.time_ns()}"
    # the bench's batches are large: reads get the write timeout, not the serving one
    store = RedisKVStore.from_settings(
        redis_settings.model_copy(
            update={"key_prefix": prefix, "socket_timeout_s": redis_settings.write_timeout_s}
        ),
        engine,
    )
    try:
        yield store
    finally:
        try:
            store.garbage_collect(keep_versions=[])
        finally:
            if server is not None:
                server.stop()


def measure_preset(
    preset: str,
    *,
    users: int,
    batches: int,
    repeats: int,
    tokens: int,
    dtype: str,
    redis_settings: RedisSettings | None,
) -> ReadFigures:
    """Write ``users x batches`` caches to both stores, then time ``load_many`` per batch."""
    shape, torch_dtype = preset_shape(preset), getattr(torch, dtype)
    with tempfile.TemporaryDirectory(prefix="genrec-bench-kv-") as scratch:
        engine = make_engine(f"sqlite:///{Path(scratch) / 'index.db'}")
        local = LocalDirKVStore(Path(scratch) / "kv", engine)
        redis_engine = make_engine(f"sqlite:///{Path(scratch) / 'redis-index.db'}")
        with redis_store(redis_settings, redis_engine) as redis:
            user_batches = [[f"user-{b}-{n}" for n in range(users)] for b in range(batches)]
            for b, batch in enumerate(
                progress_bar(user_batches, desc=f"{preset}: write", unit="batch")
            ):
                pairs = [(_entry(u, tokens), random_prefix_kv(shape, tokens, torch_dtype, b * users + n))
                         for n, u in enumerate(batch)]  # fmt: skip
                local.put_many(KV_VERSION, pairs)
                redis.put_many(KV_VERSION, pairs)
            bytes_per_batch = local.sizes(KV_VERSION)["total_bytes"] / batches
            times: dict[str, list[float]] = {"local": [], "redis": []}
            for repeat in progress_bar(range(repeats), desc=f"{preset}: read", unit="pass"):
                order = [("local", local), ("redis", redis)]
                for name, store in order if repeat % 2 == 0 else order[::-1]:
                    for batch in user_batches:
                        times[name].append(_time_batch(store, batch))
            where = redis.where
    return ReadFigures(
        preset, users, batches, repeats, tokens, dtype, round(bytes_per_batch / 2**20, 3),
        round(statistics.median(times["local"]), 3), round(statistics.median(times["redis"]), 3),
        where,
    )  # fmt: skip


def _time_batch(store, user_ids: list[str]) -> float:
    started = time.perf_counter()
    loaded = store.load_many(KV_VERSION, user_ids, expected_model_version=MODEL_VERSION)
    elapsed = (time.perf_counter() - started) * 1000
    if len(loaded) != len(user_ids) or any(isinstance(v, Exception) for v in loaded.values()):
        raise RuntimeError(f"{type(store).__name__}: a batch did not load completely")
    return elapsed


def print_report(figures: list[ReadFigures]) -> None:
    print("prefix-KV batch read (load_many, median ms per batch): local files vs Redis")
    print(f"{'preset':<14} {'users':>5} {'tokens':>6} {'dtype':<8} {'MB/batch':>9} "
          f"{'local ms':>9} {'redis ms':>9} {'redis/local':>11}")  # fmt: skip
    for f in figures:
        print(f"{f.preset:<14} {f.users_per_batch:>5} {f.tokens:>6} {f.dtype:<8} "
              f"{f.mb_per_batch:>9.2f} {f.local_ms:>9.2f} {f.redis_ms:>9.2f} {f.ratio:>11.2f}")  # fmt: skip
    if figures:
        print(f"(Redis at {figures[0].redis_where}; local files from the page cache)")
