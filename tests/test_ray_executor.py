"""``offline.executor = "ray"`` on a real local Ray cluster (the session's ``ray_cluster``).

The executor itself (page order, bounded pages in flight, errors), then each step that
fans out, item for item against ``local``: the refresh's prefix KV (actors loading a
saved version's target from its folder, and a target that was never saved), item text
embeddings, teacher data for draft alignment and ``genrec eval``'s generative lists.
Faults: an actor killed with SIGKILL mid-precompute is restarted and its pages retried
(the same caches); with no retries the refresh fails cleanly and the old version serves.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from genrec.infra.database import make_engine
from genrec.infra.errors import UserFacingError
from genrec.infra.serving_versions import active_serving_version
from genrec.offline.evaluation import generative_lists
from genrec.offline.executor import LocalExecutor, make_executor, model_artifact_dir
from genrec.offline.ray_cluster import import_ray
from genrec.offline.ray_executor import RayExecutor, named_actor_pids
from genrec.offline.refresh import run_refresh
from genrec.offline.semantic_ids.embeddings import embed_texts
from genrec.offline.splits import Case
from genrec.offline.training.draft import make_teacher_data
from genrec.online.decoding.trie import ItemTrie
from genrec.online.models.presets import PRESETS, build_draft, build_target, scratch_tokenizer
from genrec.online.models.store import ModelBundle, load_model_version, save_model_version
from genrec.online.prefix_kv_store import open_kv_store
from genrec.online.prompts import history_prompt
from tests.helpers import random_items
from tests.ray_pages import add_slowly, double, fail_at_three, slow_compute_prefix_kv
from tests.refresh_fakes import (
    ITEMS,
    USERS,
    FakeSteps,
    add_events,
    make_settings,
    runs,
    tiny_models,
)

pytestmark = pytest.mark.integration


# --- the executor ---------------------------------------------------------------------


def test_ray_map_and_pool_keep_page_order_bound_pages_in_flight_and_raise(ray_cluster):
    executor = RayExecutor(ray_cluster.model_copy(update={"actors": None, "max_in_flight": 2}))
    pulled: list[int] = []

    def pages():
        for page in range(8):
            pulled.append(page)
            yield page

    results = executor.map(double, pages(), desc="double")
    assert next(results) == 0
    assert len(pulled) <= 3  # two pages out, the third waits for the first result
    assert list(results) == [2 * page for page in range(1, 8)]
    with executor.pool("adder", int, "100", pages_hint=6) as pool:
        assert len(set(pool.worker_pids())) == 2  # 2 CPUs, 1 per actor
        assert list(pool.map(add_slowly, range(6), desc="add")) == list(range(100, 106))
        with pytest.raises(ValueError, match="page 3 is bad"):
            list(pool.map(fail_at_three, range(6), desc="fail"))


def test_local_needs_no_ray_and_ray_without_it_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    assert make_executor(make_settings(tmp_path, "sqlite://")).name == "local"
    with pytest.raises(UserFacingError, match=r"pip install 'genrec\[ray\]'"):
        import_ray()


# --- prefix KV ------------------------------------------------------------------------


def _store_with_events(tmp_path: Path, name: str, offline=None, **refresh):
    home = tmp_path / name
    home.mkdir()
    settings = make_settings(home, f"sqlite:///{home / 'genrec.db'}", **refresh)
    if offline is not None:
        settings = settings.model_copy(update={"offline": offline})
    engine = make_engine(settings.database_url)
    add_events(engine, range(USERS), per_user=8)
    return settings, engine


def _saved_tiny_version(settings, engine):
    """``tiny_models(1)`` with an SFT draft saved as a real model version, loaded back."""
    models = tiny_models(1)
    draft = build_draft(PRESETS["tiny"], models.layout).eval()
    bundle = ModelBundle(models.target, {"sft": draft}, scratch_tokenizer(models.layout),
                         models.item_tokens, "tiny", models.history_items, 1)  # fmt: skip
    version = save_model_version(settings, engine, bundle)
    return load_model_version(settings, engine, version=version)


def _caches(settings, engine, kv_version: int) -> dict:
    store = open_kv_store(settings, engine)
    out = {}
    for user in range(USERS):
        entry = store.lookup(kv_version, f"u{user}")
        loaded = store.load(entry, expected_model_version=entry.model_version)
        out[f"u{user}"] = (entry.cutoff_event_row, entry.prompt_sha1, loaded)
    return out


def assert_same_caches(mine: dict, theirs: dict) -> None:
    assert mine.keys() == theirs.keys()
    for user, (row, sha1, kv) in mine.items():
        other_row, other_sha1, other = theirs[user]
        assert (row, sha1, kv.prompt_ids) == (other_row, other_sha1, other.prompt_ids)
        for a, b in zip(kv.keys + kv.values, other.keys + other.values, strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b), user


def _refresh(settings, engine, steps=None):
    report = run_refresh(settings, engine, steps=steps or FakeSteps())
    return report, _caches(settings, engine, report.kv_version)


def test_prefix_kv_on_ray_actors_loading_the_version_folder_equals_local(tmp_path, ray_cluster):
    both = {}
    for name, offline in (("local", None), ("ray", ray_cluster)):
        settings, engine = _store_with_events(tmp_path, name, offline, kv_batch_size=5)
        models = _saved_tiny_version(settings, engine)
        assert model_artifact_dir(settings, engine, models.version) is not None
        steps = FakeSteps()
        steps.load_models = lambda _s, _e, models=models: models
        report, caches = _refresh(settings, engine, steps)
        both[name] = caches
        assert report.counts["kv"]["computed"] == USERS
    assert_same_caches(both["ray"], both["local"])


def test_killed_actor_mid_precompute_is_restarted_and_its_pages_retried(tmp_path, ray_cluster):
    refresh = {"kv_batch_size": 1}  # 12 pages, 0.2 s each: the kill lands while pages run
    _, local = _refresh(*_store_with_events(tmp_path, "local", None, **refresh))
    offline = ray_cluster.model_copy(update={"max_retries": 2})
    settings, engine = _store_with_events(tmp_path, "ray", offline, **refresh)
    killed: list[int] = []
    steps = FakeSteps()
    steps.compute_prefix_kv = slow_compute_prefix_kv

    def kill_one_actor(name: str) -> None:
        if name == "prefix_kv_batch" and not killed:
            killed.append(min(named_actor_pids("prefix-kv").values()))
            os.kill(killed[0], signal.SIGKILL)

    steps.checkpoint = kill_one_actor
    report, caches = _refresh(settings, engine, steps)
    assert killed and runs(engine)[-1]["status"] == "succeeded"
    assert report.counts["kv"]["computed"] == USERS
    assert_same_caches(caches, local)


def test_killed_actor_without_retries_fails_the_refresh_and_the_old_version_serves(
    tmp_path, ray_cluster
):
    settings, engine = _store_with_events(tmp_path, "store", None, kv_batch_size=1)
    first = run_refresh(settings, engine, steps=FakeSteps())
    offline = ray_cluster.model_copy(update={"max_retries": 0})
    ray_settings = settings.model_copy(update={
        "offline": offline,
        "refresh": settings.refresh.model_copy(update={"reuse_unchanged_kv": False}),
    })  # fmt: skip
    steps = FakeSteps()
    steps.compute_prefix_kv = slow_compute_prefix_kv
    steps.checkpoint = lambda name: (
        os.kill(min(named_actor_pids("prefix-kv").values()), signal.SIGKILL)
        if name == "prefix_kv_batch" else None
    )  # fmt: skip
    import ray.exceptions

    with pytest.raises((ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError)):
        run_refresh(ray_settings, engine, steps=steps)
    assert active_serving_version(engine).version == first.serving_version
    failed = runs(engine)[-1]
    assert failed["status"] == "failed" and "Actor" in failed["error"]
    store = open_kv_store(settings, engine)
    assert store.lookup(first.kv_version, "u0") is not None  # the old caches still serve
    assert store.lookup(first.kv_version + 1, "u0") is None  # the half-built ones were discarded


# --- the other steps ------------------------------------------------------------------


def test_item_text_embeddings_on_ray_equal_local(tmp_path, ray_cluster):
    texts = [f"Film number {n} ({1950 + n}). Genres: Drama Comedy" for n in range(20)]
    local, new = embed_texts(texts, "all-MiniLM-L6-v2", tmp_path / "local", batch_size=6,
                             progress=False)  # fmt: skip
    executor = RayExecutor(ray_cluster)
    remote, new_remote = embed_texts(texts, "all-MiniLM-L6-v2", tmp_path / "ray", batch_size=6,
                                     progress=False, executor=executor)  # fmt: skip
    assert new == new_remote == 20 and local.dtype == remote.dtype == np.float32
    assert np.array_equal(local, remote)


def test_teacher_data_on_ray_equals_local(ray_cluster):
    torch.manual_seed(0)
    items = random_items(60, (8, 8, 4))
    tree = ItemTrie.from_item_tokens(items)
    target = build_target(PRESETS["tiny"], items.layout).eval()
    rng = np.random.default_rng(0)
    prompts = [history_prompt([f"i{k}" for k in rng.integers(0, 60, rng.integers(1, 9))],
                              items, 50) for _ in range(30)]  # fmt: skip
    truths = [f"i{k}" for k in rng.integers(0, 60, 30)]
    options = {"k": 5, "batch_size": 8, "progress": False}
    local = make_teacher_data(target, items, tree, prompts, truths, **options)
    remote = make_teacher_data(target, items, tree, prompts, truths, **options,
                               executor=RayExecutor(ray_cluster))  # fmt: skip
    assert torch.equal(local.beams, remote.beams) and torch.equal(local.truth, remote.truth)
    assert torch.equal(local.target_log_probs, remote.target_log_probs)


def test_generative_ranking_of_eval_on_ray_equals_local(tmp_path, ray_cluster):
    settings, engine = _store_with_events(tmp_path, "store")
    models = _saved_tiny_version(settings, engine)
    rng = np.random.default_rng(1)
    cases = [Case(f"u{n}", [ITEMS[k] for k in rng.integers(0, 40, rng.integers(1, 7))],
                  ITEMS[n % 40]) for n in range(25)]  # fmt: skip
    options = {"which": ["target", "sft"], "batch_size": 7}
    local = generative_lists(models, cases, 5, **options, executor=LocalExecutor())
    remote = generative_lists(models, cases, 5, **options, executor=RayExecutor(ray_cluster),
                              folder=model_artifact_dir(settings, engine, models.version))  # fmt: skip
    assert local == remote and len(local["target"]) == 25 and len(local["target"][0]) == 5
