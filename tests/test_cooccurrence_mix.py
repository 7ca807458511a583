"""Co-occurrence mixed into the semantic-ID input: held-out rule (``Split.before_test``), geometry,
cold items, save/load."""

import numpy as np
import pytest

from genrec.offline.semantic_ids.cooccurrence_mix import CooccurrenceMix, mix_cooccurrence
from genrec.offline.splits import leave_one_out


def random_text(n: int, dim: int = 16, seed: int = 0) -> np.ndarray:
    vectors = np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


def test_before_test_drops_each_users_test_item_only():
    sequences = {"long": ["a", "b", "c", "d"], "three": ["a", "b", "c"], "short": ["a", "b"]}
    assert leave_one_out(sequences).before_test() == {
        "long": ["a", "b", "c"],
        "three": ["a", "b"],
        "short": ["a", "b"],  # no test case: every event is training data
    }


def test_items_watched_together_move_closer_and_rows_are_unit():
    item_ids = [f"i{n}" for n in range(12)]
    # Two groups that users always watch together, whatever their text says.
    sequences = {f"u{n}": ["i0", "i1", "i2", "i3"] if n % 2 else ["i4", "i5", "i6", "i7"]
                 for n in range(40)}  # fmt: skip
    text = random_text(len(item_ids))
    vectors, mix = mix_cooccurrence(item_ids, text, sequences, weight=0.5, dim=4, window=5)
    assert mix is not None and mix.weight == 0.5
    assert vectors.shape == (12, 16 + 4)
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    together = float(vectors[0] @ vectors[1])
    apart = float(vectors[0] @ vectors[4])
    assert together > float(text[0] @ text[1]) and together > apart
    # i8..i11 never co-occur: their co-occurrence part comes from the text map, not zeros
    assert np.linalg.norm(vectors[8, 16:]) > 0


def test_weight_one_is_cooccurrence_only_and_bad_weights_fail():
    item_ids = ["a", "b", "c", "d"]
    sequences = {"u1": ["a", "b"], "u2": ["c", "d"], "u3": ["a", "b"]}
    vectors, _ = mix_cooccurrence(item_ids, random_text(4), sequences, weight=1.0, dim=2)
    assert np.allclose(vectors[:, :16], 0.0)
    for weight in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="cooccurrence weight"):
            mix_cooccurrence(item_ids, random_text(4), sequences, weight=weight, dim=2)


def test_without_any_cooccurrence_the_text_vectors_stay():
    text = random_text(3)
    vectors, mix = mix_cooccurrence(["a", "b", "c"], text, {"u": ["a"]}, weight=0.5, dim=2)
    assert mix is None
    assert np.allclose(vectors, text, atol=1e-6)


def test_mix_saves_and_places_new_items_like_the_build(tmp_path):
    item_ids = [f"i{n}" for n in range(10)]
    sequences = {f"u{n}": [f"i{n % 5}", f"i{(n + 1) % 5}", f"i{5 + n % 5}"] for n in range(30)}
    text = random_text(10)
    _, mix = mix_cooccurrence(item_ids, text, sequences, weight=0.3, dim=3)
    mix.save(tmp_path)
    loaded = CooccurrenceMix.load(tmp_path)
    assert loaded.weight == pytest.approx(0.3)
    assert np.array_equal(loaded.projection, mix.projection)
    new_text = random_text(2, seed=7)
    placed = loaded.vectors(new_text)
    assert placed.shape == (2, 16 + 3)
    # both parts are unit rows, so the text part is exactly sqrt(1 - w) * text
    assert np.allclose(placed[:, :16], np.sqrt(0.7) * new_text, atol=1e-5)
    assert np.allclose(np.linalg.norm(placed[:, 16:], axis=1), np.sqrt(0.3), atol=1e-5)
    assert CooccurrenceMix.load(tmp_path / "missing") is None


def test_the_cooccurrence_part_above_fit_max_items_is_the_landmark_fit():
    from genrec.online.branches import cooccurrence_embeddings

    rng = np.random.default_rng(4)
    item_ids = [f"i{n}" for n in range(50)]
    sequences = {f"u{n}": [item_ids[i] for i in rng.zipf(1.5, size=10) % 50] for n in range(60)}
    text = random_text(len(item_ids))
    bounded, _ = mix_cooccurrence(item_ids, text, sequences, weight=1.0, dim=3, fit_max_items=15)
    landmarks = cooccurrence_embeddings(sequences, item_ids, dim=3, fit_max_items=15)
    seen = np.linalg.norm(landmarks, axis=1) > 1e-8
    unit = landmarks[seen] / np.linalg.norm(landmarks[seen], axis=1, keepdims=True)
    part = bounded[seen][:, -3:]  # weight 1: the rows are the co-occurrence part alone
    np.testing.assert_allclose(part @ part.T, unit @ unit.T, atol=1e-5)


def test_blocks_and_pages_give_the_one_shot_vectors(monkeypatch):
    """Issue #19 (memory at 1M items): the co-occurrence summed in pages of users, the ridge
    map's normal equations in blocks of rows and the mix in blocks of rows give the vectors
    of doing each at once (pages and row-wise blocks bit for bit; the map to rounding)."""
    from genrec.offline.semantic_ids import cooccurrence_mix, embeddings
    from genrec.online import branches

    rng = np.random.default_rng(3)
    items = [f"i{k}" for k in range(300)]
    sequences = {f"u{u}": [items[j] for j in rng.zipf(1.3, rng.integers(2, 30)) % 300]
                 for u in range(400)}  # fmt: skip
    text = rng.standard_normal((300, 24)).astype(np.float32)
    once, once_mix = mix_cooccurrence(items, text, sequences, weight=0.4, dim=8)
    monkeypatch.setattr(branches, "COOCCURRENCE_PAGE_EVENTS", 50)
    monkeypatch.setattr(embeddings, "PROJECTION_BLOCK_ROWS", 7)
    monkeypatch.setattr(cooccurrence_mix, "MIX_BLOCK_ROWS", 11)
    paged, paged_mix = mix_cooccurrence(items, text, sequences, weight=0.4, dim=8)
    assert np.allclose(paged_mix.projection, once_mix.projection, atol=1e-5)
    assert np.allclose(paged, once, atol=1e-5)
    mix = CooccurrenceMix(0.4, once_mix.projection)
    in_blocks = mix.vectors(text)  # 11 rows at a time
    monkeypatch.setattr(cooccurrence_mix, "MIX_BLOCK_ROWS", 1 << 16)
    assert np.array_equal(in_blocks, mix.vectors(text))  # row by row: exact


def test_pages_of_sequences_keep_users_whole():
    from genrec.online.branches import pages_of_sequences

    pages = list(pages_of_sequences([[1, 2], [3], [4, 5, 6, 7], [8]], page_events=3))
    assert pages == [[[1, 2], [3]], [[4, 5, 6, 7]], [[8]]]
    assert list(pages_of_sequences([], page_events=3)) == []
