"""Item text rendering, the embedding cache and behavior embeddings (fast, no text model)."""

import numpy as np
import pytest
from sqlalchemy import insert

from genrec.infra.database import make_engine
from genrec.offline.semantic_ids.embeddings import (
    EmbeddingCache,
    behavior_vectors,
    fit_behavior,
    hash_vector,
    load_interactions,
    render_item_text,
)
from genrec.schemas.tables import events

TEMPLATE = "{title} ({year}). Genres: {genres}"


def test_template_rendering_and_missing_text():
    row = {"item_id": "1", "title": "Toy Story", "year": 1995, "genres": "Animation Comedy"}
    assert render_item_text(row, TEMPLATE) == "Toy Story (1995). Genres: Animation Comedy"
    assert (
        render_item_text({**row, "year": None}, TEMPLATE) == "Toy Story . Genres: Animation Comedy"
    )
    # a bare year or id is not text
    assert render_item_text({"item_id": "9", "year": 1990, "title": " "}, TEMPLATE) is None
    custom = "{title} by {director}"
    with_attributes = {"item_id": "2", "title": "Heat", "attributes": {"director": "Mann"}}
    assert render_item_text(with_attributes, custom) == "Heat by Mann"
    assert render_item_text({"item_id": "3", "attributes": {"director": "Lee"}}, custom) == "by Lee"


def test_embedding_cache_is_keyed_by_model_and_text(tmp_path):
    cache = EmbeddingCache(tmp_path, "model-a")
    cache.add([cache.key("hello")], np.ones((1, 4), np.float32))
    cache.save()
    again = EmbeddingCache(tmp_path, "model-a")
    assert np.array_equal(again.vectors_of([again.key("hello")]), np.ones((1, 4), np.float32))
    assert again.key("hello") != EmbeddingCache(tmp_path, "model-b").key("hello")
    assert not EmbeddingCache(tmp_path, "model-b").rows  # another model: its own file
    # one block: rows appended in order, read back in any order, keys only once
    again.add([again.key("a"), again.key("b")], np.array([[2.0] * 4, [3.0] * 4], np.float32))
    keys = [again.key(t) for t in ("b", "hello", "a", "b")]
    assert again.vectors_of(keys)[:, 0].tolist() == [3.0, 1.0, 2.0, 3.0]
    assert again.block.shape == (3, 4)
    with pytest.raises(ValueError, match="new and distinct"):
        again.add([again.key("a")], np.zeros((1, 4), np.float32))
    again.save()
    reloaded = EmbeddingCache(tmp_path, "model-a")
    assert reloaded.vectors_of(keys)[:, 0].tolist() == [3.0, 1.0, 2.0, 3.0]


def test_embed_texts_fills_the_cache_once_in_text_order(tmp_path, monkeypatch):
    """Embedded shortest first, returned in the caller's order; a second call embeds nothing."""
    from genrec.offline.semantic_ids import embeddings

    seen: list[list[str]] = []

    def encode(model, texts):
        seen.append(list(texts))
        return np.array([[len(t), ord(t[0])] for t in texts], np.float32)

    monkeypatch.setattr(embeddings, "load_text_encoder", lambda name: None)
    monkeypatch.setattr(embeddings, "encode_text_batch", encode)
    texts = ["ccc", "a", "bb", "a", "dddd"]
    vectors, new = embeddings.embed_texts(texts, "m", tmp_path, batch_size=2, progress=False)
    assert new == 4 and seen == [["a", "bb"], ["ccc", "dddd"]]
    assert vectors[:, 0].tolist() == [3, 1, 2, 1, 4] and vectors.dtype == np.float32
    again, new = embeddings.embed_texts(texts[::-1], "m", tmp_path, progress=False)
    assert new == 0 and len(seen) == 2
    assert np.array_equal(again, vectors[::-1])


def test_behavior_embeddings_fold_in_and_hash_fallback(tmp_path):
    engine = make_engine(f"sqlite:///{tmp_path / 's.db'}")
    rows = []
    for user in range(30):  # two taste groups: items a* and b*
        group = "a" if user < 15 else "b"
        for item in range(4):
            rows.append({"event_id": f"{user}-{item}", "user_id": f"u{user}", "item_id": f"{group}{item}",
                         "event_type": "view", "ts_ms": user * 10 + item})  # fmt: skip
    with engine.begin() as connection:
        connection.execute(insert(events), rows)
    model = fit_behavior(engine, dim=4, seed=0)
    vectors = behavior_vectors(engine, model, ["a0", "a1", "b0", "missing"])
    unit = vectors[:3] / np.linalg.norm(vectors[:3], axis=1, keepdims=True)
    assert unit[0] @ unit[1] > 0.9 and unit[0] @ unit[2] < 0.5
    assert not vectors[3].any()  # no interactions: the caller falls back to hash_vector
    assert np.array_equal(hash_vector("x", 8), hash_vector("x", 8))


def test_interactions_read_in_pages_equal_one_read(tmp_path):
    """Distinct pairs, sorted ids and rows in query order, whatever the page size."""
    engine = make_engine(f"sqlite:///{tmp_path / 's.db'}")
    generator = np.random.default_rng(0)
    rows = [{"event_id": f"e{n}", "user_id": f"u{generator.integers(40)}",
             "item_id": f"i{generator.integers(60)}", "event_type": "view", "ts_ms": n}
            for n in range(500)]  # fmt: skip
    with engine.begin() as connection:
        connection.execute(insert(events), rows)
    distinct = list(dict.fromkeys((r["item_id"], r["user_id"]) for r in rows))
    item_ids, user_ids, pairs = load_interactions(engine)
    assert item_ids == sorted({i for i, _ in distinct})
    assert user_ids == sorted({u for _, u in distinct})
    assert sorted((item_ids[i], user_ids[u]) for i, u in pairs) == sorted(distinct)
    for page_rows in (1, 7, 1000):
        paged = load_interactions(engine, page_rows)
        assert paged[0] == item_ids and paged[1] == user_ids
        assert np.array_equal(paged[2], pairs)  # same order: the fold-in sums in it
    empty = make_engine(f"sqlite:///{tmp_path / 'empty.db'}")
    assert load_interactions(empty)[2].shape == (0, 2)
