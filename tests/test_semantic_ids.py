"""Semantic IDs on real ML-100K: full build, quality bounds, refresh, crash, no-text catalog, CLI.

One full build (real MiniLM embeddings + RQ-VAE training, ~1 min on 2 busy cores)
is shared by the tests of this module; each test that writes works on its own
copy of the store.
"""

import json
import shutil
import sqlite3
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import insert, select, update

from genrec.infra.database import make_engine
from genrec.infra.settings import Settings
from genrec.offline.semantic_ids import build as sid
from genrec.offline.semantic_ids.build import (
    NoActiveSemanticIds,
    build_semantic_ids,
    load_active_semantic_ids,
    load_item_embeddings,
    open_item_index,
)
from genrec.schemas.tables import events, items, semantic_id_versions

pytestmark = pytest.mark.slow


def copy_store(engine, target: Path):
    """A private copy of a SQLite store (the backup API also copies what is still in the WAL)."""
    source = sqlite3.connect(engine.url.database)
    destination = sqlite3.connect(target)
    source.backup(destination)
    source.close()
    destination.close()
    return make_engine(f"sqlite:///{target}")


def copy_data_dir(settings: Settings, target: Path) -> Settings:
    """Settings for a copy of ``settings``' data directory (its artifacts: a store's copy
    needs its folders, which its rows name relative to the data directory)."""
    shutil.copytree(settings.data_dir / "artifacts", target / "artifacts")
    return settings.model_copy(update={"data_dir": target})


def settings_for(home: Path, cache: Path, **semantic_ids) -> Settings:
    return Settings(home=home, semantic_ids={"embedding_cache_dir": str(cache), **semantic_ids})


@pytest.fixture(scope="module")
def built(ml100k_engine, tmp_path_factory):
    """ML-100K with one full build active: (settings, engine, report, embedding cache dir)."""
    root = tmp_path_factory.mktemp("semantic_ids")
    cache = tmp_path_factory.getbasetemp() / "embedding-cache"  # shared by this module's builds
    engine = copy_store(ml100k_engine, root / "store.db")
    settings = settings_for(root / "home", cache)
    report = build_semantic_ids(settings, engine, full=True, progress=False)
    return settings, engine, report, cache


def test_every_ml100k_item_gets_a_unique_valid_id(built):
    _, engine, report, _ = built
    ids = load_active_semantic_ids(engine)
    assert ids.version == report.version
    assert len(ids.item_ids) == 1682 == report.n_items == report.n_unique_ids
    assert ids.codes.shape == (1682, 4) and ids.codes.dtype == np.int64
    assert len({tuple(row) for row in ids.codes.tolist()}) == 1682
    assert ids.layout.codes_per_level == (256, 256, 256, 32)
    tokens = ids.tokens()
    assert tokens.shape == (1682, 4) and tokens.dtype == np.int64
    assert ids.layout.decode(tokens) == ids.codes.tolist()  # every token in its level's range
    assert ids.item_ids[ids.index_of("50")] == "50"
    with pytest.raises(KeyError, match="no semantic ID"):
        ids.index_of("no-such-item")


def test_quality_report_within_bounds(built):
    _, _, report, _ = built
    metrics = report.metrics
    usage = metrics["codebook_usage"]
    # 1,682 items over 256 first-level codes is 6.6 items a code. k-means init and
    # dead-code resets keep (nearly) all codes in use (256/256 observed); a collapsed
    # codebook uses a handful. Half the codebook is the floor we accept.
    assert usage[0]["used"] >= 128
    assert usage[0]["perplexity"] >= 64
    # 19 pairs of ML-100K items have identical title, year and genres, so identical
    # text and embeddings: their nearest codes collide (~1.1%). Beyond those, 3 levels of
    # 256 codes leave 16.7M cells for 1,682 items, so few other collisions are expected.
    assert metrics["nearest_code_collision_rate"] <= 0.03
    assert 2 <= metrics["nearest_code_largest_group"] <= 4
    # The balanced last level gives each of them a free last-level code of its own.
    assert metrics["collision_rate_before_dedup"] == 0.0
    assert metrics["largest_collision_group"] == 1
    # every item beyond the first of a nearest-code group moved to another last code
    nearest_collisions = round(metrics["nearest_code_collision_rate"] * metrics["n_items"])
    assert metrics["moved_to_free_slot"] >= nearest_collisions
    similarity = metrics["prefix_similarity"]
    assert similarity["same_first_code"] > similarity["random_pairs"] + 0.05
    assert similarity["same_first_two_codes"] > similarity["same_first_code"]
    # item 267 has no title or genres: its vector comes from its interactions
    assert metrics["embedding_sources"] == {"text": 1681, "behavior": 1, "hash": 0}
    assert metrics["reconstruction_mse"] < 1.0 / 384  # below predicting all zeros
    folder = Path(report.artifact_dir)
    assert metrics["cooccurrence_weight"] == 0.5
    for name in ("rqvae.safetensors", "item_embeddings.safetensors", "items.faiss",
                 "report.json", "codebook_usage.png", "layout.json",
                 "cooccurrence_mix.safetensors"):  # fmt: skip
        assert (folder / name).exists(), name
    assert not list(folder.parent.glob(".v*"))  # no temporary folder left


def test_item_embeddings_and_index_for_ann_recall(built):
    settings, engine, _, _ = built
    item_ids, vectors = load_item_embeddings(settings, engine)
    # 384 MiniLM dims + 64 co-occurrence dims (semantic_ids.cooccurrence_dim)
    assert len(item_ids) == 1682 and vectors.shape == (1682, 384 + 64)
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    index = open_item_index(settings, engine)
    row = item_ids.index("1")  # Toy Story
    assert index.search_item_ids(vectors[row], 5)[0][0] == "1"


def add_new_items(engine, count: int) -> list[str]:
    """``count`` new items with a few events each; every 10th has no text (folded in from events)."""
    genres = ["Comedy", "Drama", "Action Thriller", "Animation Children's", "Horror", "Romance"]
    rows, event_rows = [], []
    for n in range(count):
        item_id = str(2000 + n)
        has_text = n % 10 != 9
        rows.append(
            {
                "item_id": item_id,
                "title": f"Brand New Film Number {n}" if has_text else None,
                "genres": genres[n % len(genres)] if has_text else None,
            }
        )
        for user in range(1 + n % 7, 200, 7):  # a few real ML-100K users each
            event_rows.append(
                {
                    "event_id": f"new-{n}-{user}",
                    "user_id": str(user),
                    "item_id": item_id,
                    "event_type": "rate",
                    "ts_ms": 900_000_000_000 + n,
                    "value": 4.0,
                }
            )
    with engine.begin() as connection:
        connection.execute(insert(items), rows)
        connection.execute(insert(events), event_rows)
    return [row["item_id"] for row in rows]


def test_refresh_keeps_old_ids_and_gives_new_items_unique_ids(built, tmp_path):
    settings, engine, report, cache = built
    old = load_active_semantic_ids(engine)
    engine = copy_store(engine, tmp_path / "store.db")
    settings = copy_data_dir(settings, tmp_path / "var")  # one per store
    new_ids = add_new_items(engine, 50)
    refreshed = build_semantic_ids(settings, engine, progress=False)
    assert refreshed.kind == "refresh" and refreshed.version == report.version + 1
    assert refreshed.new_items == 50 and refreshed.stability >= 0.99
    assert refreshed.metrics["texts_newly_embedded"] == 45  # the rest came from the cache
    assert refreshed.metrics["embedding_sources"] == {"text": 1726, "behavior": 6, "hash": 0}
    ids = load_active_semantic_ids(engine)
    assert ids.layout == old.layout
    kept = sum(
        np.array_equal(ids.codes[ids.index_of(i)], old.codes[r]) for r, i in enumerate(old.item_ids)
    )
    assert kept / len(old.item_ids) >= 0.99
    assert len({tuple(row) for row in ids.codes.tolist()}) == 1732
    new_rows = [ids.index_of(item) for item in new_ids]
    ids.layout.decode(ids.tokens()[new_rows])  # valid tokens at every level
    assert (ids.codes[new_rows, -1] < 32).all()
    # existing items keep their mixed vectors; new ones are placed in the same space
    old_folder, new_folder = Path(report.artifact_dir), Path(refreshed.artifact_dir)
    old_vectors = sid.load_numpy(str(old_folder / "item_embeddings.safetensors"))["vectors"]
    new_vectors = sid.load_numpy(str(new_folder / "item_embeddings.safetensors"))["vectors"]
    assert np.array_equal(new_vectors[: len(old.item_ids)], old_vectors)
    assert np.allclose(np.linalg.norm(new_vectors[new_rows], axis=1), 1.0, atol=1e-5)
    assert (new_folder / "cooccurrence_mix.safetensors").exists()


def test_crash_mid_build_leaves_previous_version_active(built, tmp_path, monkeypatch):
    settings, engine, report, _ = built
    engine = copy_store(engine, tmp_path / "store.db")
    quick = settings.semantic_ids.model_copy(update={"epochs": 5})  # what is built is not the point
    settings = settings.model_copy(update={"data_dir": tmp_path / "var", "semantic_ids": quick})
    before = load_active_semantic_ids(engine)

    def crash(*_args, **_kwargs):
        raise RuntimeError("power cut")

    real_write_items = sid._write_items

    def write_then_crash(*args, **kwargs):
        real_write_items(*args, **kwargs)
        crash()

    for target in ("_write_items", "_activate"):
        monkeypatch.setattr(sid, target, write_then_crash if target == "_write_items" else crash)
        with pytest.raises(RuntimeError, match="power cut"):
            build_semantic_ids(settings, engine, full=True, progress=False)
        monkeypatch.undo()
        after = load_active_semantic_ids(engine)
        assert after.version == before.version
        assert np.array_equal(after.codes, before.codes)
    with engine.connect() as connection:
        rows = connection.execute(select(semantic_id_versions.c.version, semantic_id_versions.c.status,
                                         semantic_id_versions.c.active)).all()  # fmt: skip
    failed = [row for row in rows if row.status == "failed"]
    assert len(failed) == 2 and not any(row.active for row in failed)
    assert sum(row.active for row in rows) == 1
    folder = tmp_path / "var" / "artifacts" / "semantic_ids"
    assert not any(folder.iterdir())  # neither final nor temporary folders of failed builds


def test_catalog_without_text_builds_from_interactions(ml100k_engine, tmp_path):
    engine = copy_store(ml100k_engine, tmp_path / "store.db")
    with engine.begin() as connection:
        connection.execute(
            update(items).values(title=None, year=None, genres=None, attributes=None)
        )
        connection.execute(insert(items).values(item_id="lonely"))  # no text, no events
    settings = settings_for(tmp_path / "home", tmp_path / "cache", epochs=40)
    report = build_semantic_ids(settings, engine, progress=False)
    assert report.metrics["embedding_mode"] == "behavior"
    assert report.metrics["embedding_sources"] == {"text": 0, "behavior": 1682, "hash": 1}
    assert report.n_unique_ids == report.n_items == 1683
    assert report.metrics["collision_rate_before_dedup"] <= 0.05
    assert not (tmp_path / "cache").exists()  # the text model never ran
    ids = load_active_semantic_ids(engine)
    assert len({tuple(row) for row in ids.codes.tolist()}) == 1683
    _, vectors = load_item_embeddings(settings, engine)
    assert vectors.shape == (1683, 64 + 64)  # interaction SVD + co-occurrence


def test_no_active_version_is_a_clear_error(tmp_path):
    engine = make_engine(f"sqlite:///{tmp_path / 'empty.db'}")
    with pytest.raises(NoActiveSemanticIds, match="genrec offline semantic-ids"):
        load_active_semantic_ids(engine)
    with pytest.raises(ValueError, match="no items"):
        build_semantic_ids(settings_for(tmp_path, tmp_path / "cache"), engine, progress=False)


def test_cli_writes_json_summary(built, tmp_path, monkeypatch):
    from genrec.app.cli import main
    from genrec.infra.settings import get_settings

    settings, engine, report, cache = built
    engine = copy_store(engine, tmp_path / "store.db")
    copy_data_dir(settings, tmp_path / "var")
    monkeypatch.setenv("GENREC_HOME", str(tmp_path))
    monkeypatch.setenv("GENREC_DATA_DIR", str(tmp_path / "var"))
    monkeypatch.setenv("GENREC_DATABASE_URL", str(engine.url))
    monkeypatch.setenv("GENREC_SEMANTIC_IDS__EMBEDDING_CACHE_DIR", str(cache))
    get_settings.cache_clear()
    try:
        assert (
            main(["offline", "semantic-ids", "--no-progress", "--json", str(tmp_path / "s.json")])
            == 0
        )
    finally:
        get_settings.cache_clear()
    summary = json.loads((tmp_path / "s.json").read_text())
    for key in ("version", "n_items", "n_unique_ids", "collision_rate_before_dedup",
                "codebook_usage", "stability", "timings"):  # fmt: skip
        assert key in summary, key
    assert summary["n_items"] == summary["n_unique_ids"] == 1682
    assert summary["stability"] == 1.0 and len(summary["codebook_usage"]) == 4
    assert Path(summary["codebook_usage_png"]).exists()


def test_mean_pair_cosine_is_the_mean_over_pairs_in_a_group(monkeypatch):
    """The closed form summed a block of rows at a time equals enumerating the pairs."""
    rng = np.random.default_rng(3)
    vectors = rng.standard_normal((40, 5)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    groups = rng.integers(0, 4, 40)
    cosines = [
        float(vectors[a].astype(np.float64) @ vectors[b])
        for a in range(40)
        for b in range(40)
        if a != b and groups[a] == groups[b]
    ]
    expected = sum(cosines) / len(cosines)
    assert sid.mean_pair_cosine(vectors, groups) == pytest.approx(
        expected, abs=1e-6
    )  # float32 norms
    monkeypatch.setattr(sid, "INFERENCE_BLOCK_ROWS", 6)
    assert sid.mean_pair_cosine(vectors, groups) == pytest.approx(
        expected, abs=1e-6
    )  # float32 norms
    assert sid.mean_pair_cosine(vectors, np.arange(40)) is None  # no group holds a pair
