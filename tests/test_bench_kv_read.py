"""``genrec bench prefix-kv-read`` (app/bench/kv_read.py): both stores read, figures sane,
the configured Redis left as it was found."""

from __future__ import annotations

import json

import pytest

from genrec.app.bench.kv_read import measure_preset, preset_shape
from genrec.app.redis_server import LocalRedis
from genrec.infra.settings import RedisSettings

pytestmark = pytest.mark.integration


def test_reads_both_stores_and_cleans_up(redis_server: LocalRedis) -> None:
    settings = RedisSettings(**redis_server.settings(key_prefix="benchtest"))
    figures = measure_preset("tiny", users=4, batches=2, repeats=2, tokens=9, dtype="float16",
                             redis_settings=settings)  # fmt: skip
    shape = preset_shape("tiny")
    assert figures.local_ms > 0 and figures.redis_ms > 0 and figures.ratio > 0
    assert figures.mb_per_batch * 2**20 > 4 * shape.tensor_bytes(9, 2)
    assert json.loads(json.dumps(figures.to_dict()))["redis_over_local"] > 0
    assert not list(redis_server.client().scan_iter("benchtest:*"))


def test_cli_starts_its_own_redis(capsys) -> None:
    from genrec.app.cli import main

    code = main(["bench", "prefix-kv-read", "--presets", "tiny", "--users", "2", "--batches",
                 "1", "--repeats", "1", "--tokens", "5"])  # fmt: skip
    assert code == 0 and "redis/local" in capsys.readouterr().out
