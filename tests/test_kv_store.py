"""The prefix-KV store: round trip, model-version check, size report, reuse and GC."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from genrec.infra.database import make_engine
from genrec.infra.settings import Settings
from genrec.online.decoding.prefix_kv import ModelVersionMismatch
from genrec.online.prefix_kv_store import LocalDirKVStore, open_kv_store
from tests.helpers import kv_entry, random_prefix_kv


@pytest.fixture
def store(tmp_path: Path) -> LocalDirKVStore:
    engine = make_engine(f"sqlite:///{tmp_path / 'genrec.db'}")
    return LocalDirKVStore(tmp_path / "kv", engine)


def test_round_trip_and_lookup(store: LocalDirKVStore) -> None:
    written = {"u1": random_prefix_kv(5), "user/with odd:chars": random_prefix_kv(9)}
    store.put_many(1, [(kv_entry(u, 1, len(p.prompt_ids)), p) for u, p in written.items()])
    for user_id, original in written.items():
        entry = store.lookup(1, user_id)
        assert entry is not None and entry.user_id == user_id
        assert entry.cutoff_event_row == 10 and entry.cutoff_event_id == "e10"
        assert entry.nbytes == (store.root / entry.path).stat().st_size > 0
        loaded = store.load(entry, expected_model_version="m1")
        assert loaded.prompt_ids == original.prompt_ids
        for a, b in zip(loaded.keys + loaded.values, original.keys + original.values, strict=True):
            assert torch.equal(a, b)
    assert store.lookup(1, "nobody") is None
    assert store.lookup(2, "u1") is None  # other versions never leak
    assert not list(store.root.rglob("*.partial"))


def test_load_refuses_another_model_version(store: LocalDirKVStore) -> None:
    store.put_many(1, [(kv_entry("u1", 1, 5), random_prefix_kv(5))])
    with pytest.raises(ModelVersionMismatch):
        store.load(store.lookup(1, "u1"), expected_model_version="m2")


def test_model_versions_compare_as_text(store: LocalDirKVStore) -> None:
    store.put_many(1, [(kv_entry("u1", 1, 5), random_prefix_kv(5, model_version="3"))])
    assert store.load(store.lookup(1, "u1"), expected_model_version=3).model_version == "3"


def test_entry_of_another_version_is_refused(store: LocalDirKVStore) -> None:
    with pytest.raises(ValueError, match="KV version"):
        store.put_many(2, [(kv_entry("u1", 1, 5), random_prefix_kv(5))])


def test_sizes_report_per_user_and_total(store: LocalDirKVStore) -> None:
    lengths = {"a": 3, "b": 10, "c": 30}
    store.put_many(1, [(kv_entry(u, 1, n), random_prefix_kv(n)) for u, n in lengths.items()])
    per_user = store.user_sizes(1)
    sizes = store.sizes(1)
    assert sizes["users"] == 3
    assert sizes["total_bytes"] == sum(per_user.values())
    assert sizes["max_bytes_per_user"] == per_user["c"] == max(per_user.values())
    assert sizes["mean_bytes_per_user"] == pytest.approx(sum(per_user.values()) / 3)
    assert sizes["mean_tokens_per_user"] == pytest.approx(43 / 3)
    assert store.sizes(9)["users"] == 0


def test_reuse_carries_a_file_into_the_next_version(store: LocalDirKVStore) -> None:
    store.put_many(1, [(kv_entry("u1", 1, 5), random_prefix_kv(5))])
    old = store.lookup(1, "u1")
    moved = kv_entry("u1", 2, 5, row=12)  # newer cutoff, same prompt
    store.reuse_many(2, [(moved, old)])
    store.garbage_collect(keep_versions=[2])
    entry = store.lookup(2, "u1")
    assert entry.cutoff_event_row == 12 and entry.nbytes == old.nbytes
    assert store.load(entry, "m1").prompt_ids == [1, 2, 3, 4, 5]


def test_garbage_collect_keeps_only_given_versions(store: LocalDirKVStore) -> None:
    for version in (1, 2, 3):
        store.put_many(version, [(kv_entry("u1", version, 4), random_prefix_kv(4))])
    orphan = store.root / "v000009" / "ab"  # what a killed run leaves: files, maybe no rows
    orphan.mkdir(parents=True)
    (orphan / "x.safetensors.partial").write_bytes(b"half")
    removed = store.garbage_collect(keep_versions=[2, 3])
    assert removed == 2
    assert store.lookup(1, "u1") is None and store.lookup(3, "u1") is not None
    assert sorted(p.name for p in store.root.iterdir()) == ["v000002", "v000003"]
    store.discard(3)
    assert store.lookup(3, "u1") is None and not (store.root / "v000003").exists()


def test_open_kv_store_uses_settings(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path)
    engine = make_engine(settings.database_url)
    store = open_kv_store(settings, engine)
    assert isinstance(store, LocalDirKVStore) and store.root == tmp_path / "var" / "prefix_kv"
    custom = Settings(home=tmp_path, refresh={"kv_dir": str(tmp_path / "elsewhere")})
    assert open_kv_store(custom, engine).root == tmp_path / "elsewhere"
