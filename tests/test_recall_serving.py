"""Serving the recall branches without a row over the whole catalog (issue #19) gives the
results of the dense computation they replaced: same items, order, scores and ties; the
ANN fit's in-place normalization gives the floats of the products it replaced."""

import numpy as np
import pytest
from scipy import sparse

from genrec.online.branches import (
    AnnBranch,
    ItemCFBranch,
    PopularityBranch,
    RecallBranch,
    cooccurrence_matrix,
    embeddings_of_cooccurrence,
    symmetric_normalized,
)


def dense_top_k(branch: RecallBranch, scores: np.ndarray, k: int, exclude) -> list:
    """The reference definition (the code served before): one score per catalog item, the
    excluded set to -inf, best first with ties by catalog position, positive scores only.
    (The old code picked the k best with ``argpartition``, which chose among items tied at
    the k-th score arbitrarily; a full sort is the tie rule it documented.)"""
    scores = np.asarray(scores, dtype=np.float64).copy()
    if exclude:
        scores[[branch.item_index[i] for i in exclude if i in branch.item_index]] = -np.inf
    order = np.lexsort((np.arange(len(scores)), -scores))[:k]
    return [(branch.item_ids[i], float(scores[i])) for i in order if scores[i] > 0]


def random_requests(rng, items: list[str], users: int, with_excludes: bool):
    """Histories with repeats, unknown items and empty ones; excludes = history (or None)."""
    histories = []
    for _ in range(users):
        length = int(rng.integers(0, 30))
        history = [items[i] for i in rng.integers(0, len(items), size=length)]
        if rng.random() < 0.2:
            history.append("unknown-item")
        histories.append(history)
    excludes = [set(h) if rng.random() < 0.8 else None for h in histories]
    return histories, (excludes if with_excludes else None)


@pytest.mark.parametrize("seed", range(4))
def test_popularity_matches_dense_ranking(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(5, 300))
    items = [f"i{n}" for n in range(n)]
    # integer counts: many ties, some items never seen (score 0)
    scores = rng.integers(0, 6, size=n).astype(np.float64)
    if seed % 2:
        scores = scores * rng.random(n)
    branch = PopularityBranch(items, {}, scores)
    for k in (1, 7, 50, n + 5):
        histories, excludes = random_requests(rng, items, 20, with_excludes=True)
        got = branch.recommend_batch(histories, k, excludes)
        for row, exclude in zip(got, excludes, strict=True):
            assert row == dense_top_k(branch, scores, k, exclude)


def random_itemcf(rng, n: int, ties: bool) -> ItemCFBranch:
    """A fitted item-CF state: random sparse neighbour lists (values rounded: ties)."""
    density = min(1.0, float(rng.integers(2, 40)) / n)
    similarity = sparse.random(n, n, density=density, format="csr", random_state=rng)
    if ties:
        similarity.data = np.round(similarity.data * 4) / 4
    similarity.setdiag(0)
    similarity.eliminate_zeros()
    params = {"last_m": int(rng.integers(1, 25)), "recency_decay": float(rng.uniform(0.3, 1.0))}
    return ItemCFBranch([f"i{n}" for n in range(n)], params, similarity)


@pytest.mark.parametrize("sums", ["dense", "sorted"])
@pytest.mark.parametrize("seed", range(6))
def test_itemcf_matches_dense_scores_bit_for_bit(seed: int, sums: str, monkeypatch) -> None:
    """Both ways of summing the neighbour products (a users x items accumulator for small
    batches and catalogs, sorted keys above) give the sparse product's scores bit for bit."""
    if sums == "sorted":
        monkeypatch.setattr("genrec.online.branches.DENSE_SUMS_PER_PRODUCT", 0)
        monkeypatch.setattr("genrec.online.branches.DENSE_SUMS_MIN", 0)
    rng = np.random.default_rng(100 + seed)
    branch = random_itemcf(rng, int(rng.integers(3, 400)), ties=seed % 2 == 0)
    for k in (1, 10, 50, 1000):
        histories, excludes = random_requests(rng, branch.item_ids, 33, with_excludes=k != 10)
        dense = (branch.user_weights(histories) @ branch.similarity).toarray()
        got = branch.recommend_batch(histories, k, excludes, chunk_size=int(rng.integers(1, 40)))
        for user, row in enumerate(got):
            exclude = excludes[user] if excludes is not None else None
            assert row == dense_top_k(branch, dense[user], k, exclude), (k, user)


def test_itemcf_fitted_on_sequences_matches_dense_scores() -> None:
    rng = np.random.default_rng(7)
    items = [f"i{n}" for n in range(120)]
    sequences = {
        f"u{u}": [items[i] for i in rng.integers(0, 120, size=int(rng.integers(2, 40)))]
        for u in range(80)
    }
    branch = ItemCFBranch.fit(sequences, items, window=5, last_m=8, top_neighbors=15)
    histories, excludes = random_requests(rng, items, 50, with_excludes=True)
    dense = (branch.user_weights(histories) @ branch.similarity).toarray()
    got = branch.recommend_batch(histories, 20, excludes)
    assert [len(r) for r in got] != [0] * len(got)
    for user, row in enumerate(got):
        assert row == dense_top_k(branch, dense[user], 20, excludes[user])


def test_empty_batches_and_histories() -> None:
    branch = random_itemcf(np.random.default_rng(3), 50, ties=False)
    assert branch.recommend_batch([], 5) == []
    assert branch.recommend_batch([[], ["unknown"]], 5, [None, {"unknown"}]) == [[], []]
    popularity = PopularityBranch(["a", "b"], {}, np.array([0.0, 2.0]))
    assert popularity.recommend_batch([[], ["b"]], 5, [None, {"b", "zzz"}]) == [[("b", 2.0)], []]


@pytest.mark.parametrize("excluded_nearest", [0, 5, 20, 21, 40, 299])
def test_ann_searches_deeper_only_where_exclusions_ate_the_first_search(excluded_nearest) -> None:
    """Users whose nearest items are excluded (more than ``ANN_FIRST_MARGIN * k``) get
    the same k items as a search ``k + |exclude|`` deep; the others are not searched again."""
    from genrec.online.branches import ANN_FIRST_MARGIN

    rng = np.random.default_rng(11)
    items = [f"i{n}" for n in range(300)]
    vectors = rng.normal(size=(300, 8)).astype(np.float32)
    branch = AnnBranch.fit(items, vectors, last_m=3, half_life_items=None, half_life_days=None)
    unit = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    histories = [[items[i]] for i in rng.integers(0, 300, size=12)]
    dense = branch.user_vectors(histories, [None] * len(histories)) @ unit.T
    nearest = np.argsort(-dense, axis=1, kind="stable")
    # half the users exclude their nearest items, the others only their own history
    excludes = [
        {items[i] for i in nearest[u, :excluded_nearest]} | set(h) if u % 2 else set(h)
        for u, h in enumerate(histories)
    ]
    searched = []
    search = branch.index.search
    branch.index.search = lambda x, depth: searched.append((len(x), depth)) or search(x, depth)
    got = branch.recommend_batch(histories, 10, excludes)
    for user, row in enumerate(got):
        expected = dense_top_k(branch, dense[user], 10, excludes[user])
        assert [i for i, _ in row] == [i for i, _ in expected]
        assert [s for _, s in row] == pytest.approx([s for _, s in expected], abs=1e-5)
    assert searched[0] == (12, 10 + min(ANN_FIRST_MARGIN * 10, max(map(len, excludes))))
    if excluded_nearest <= ANN_FIRST_MARGIN * 10:  # (the history item is the nearest one)
        assert len(searched) == 1
    else:  # the excluding half again, as deep as their exclusions
        assert searched[1:] == [(6, min(300, 10 + max(map(len, excludes[1::2]))))]


@pytest.mark.parametrize("seed", range(3))
def test_ann_matches_brute_force_over_the_catalog(seed: int) -> None:
    """ANN serves through FAISS as before; its embeddings now are the index's own storage."""
    rng = np.random.default_rng(200 + seed)
    n, dim = int(rng.integers(20, 500)), int(rng.integers(2, 16))
    items = [f"i{n}" for n in range(n)]
    vectors = rng.normal(size=(n, dim)).astype(np.float32)
    branch = AnnBranch.fit(items, vectors, last_m=5, half_life_items=2.0, half_life_days=None)
    assert not branch.embeddings.flags.writeable
    unit = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    np.testing.assert_allclose(branch.embeddings, unit, rtol=1e-6)
    histories, excludes = random_requests(rng, items, 24, with_excludes=True)
    dense = branch.user_vectors(histories, [None] * len(histories)) @ unit.T
    got = branch.recommend_batch(histories, 10, excludes)
    for user, row in enumerate(got):
        expected = dense_top_k(branch, dense[user], 10, excludes[user])
        assert [i for i, _ in row] == [i for i, _ in expected]
        assert [s for _, s in row] == pytest.approx([s for _, s in expected], abs=1e-5)
    # a few users at a time (what bounds an offline evaluation's memory): the same lists
    # (FAISS scores fewer than 20 queries without BLAS: the same items, scores to rounding)
    chunked = branch.recommend_batch(histories, 10, excludes, chunk_size=5)
    assert [[i for i, _ in row] for row in chunked] == [[i for i, _ in row] for row in got]
    for row, again in zip(got, chunked, strict=True):
        assert [s for _, s in again] == pytest.approx([s for _, s in row], abs=1e-6)


def test_symmetric_normalization_in_place_equals_the_diagonal_products() -> None:
    """The ANN fit scales one symmetric copy in place; the floats are those of
    diag(1/sqrt(d)) @ (C + C.T) / 2 @ diag(1/sqrt(d)) it replaced, bit for bit."""
    rng = np.random.default_rng(11)
    sequences = [rng.integers(0, 300, size=int(rng.integers(2, 40))) for _ in range(100)]
    co = cooccurrence_matrix(sequences, 300, window=6, backward_weight=0.3)
    reference = (co.astype(np.float64) + co.T) / 2
    counts = np.asarray(reference.sum(axis=1)).ravel()
    inv = 1.0 / np.sqrt(np.maximum(counts, 1e-12))
    reference = (sparse.diags(inv) @ reference @ sparse.diags(inv)).toarray()
    normalized, got_counts = symmetric_normalized(co)
    assert np.array_equal(got_counts, counts)
    assert np.array_equal(normalized.toarray(), reference)
    embeddings = embeddings_of_cooccurrence(co, dim=8, dense_max_items=0)  # the eigsh path
    assert embeddings.dtype == np.float32 and embeddings.shape == (300, 8)


def test_ann_above_exact_max_items_searches_a_saved_ivf_index_that_finds_the_flat_top_k(
    tmp_path,
):
    """A catalog above ``exact_max_items`` gets an IVF index at fit, saved with the branch
    (FAISS bytes in the npz, no pickle) and read back; on clustered vectors (what
    co-occurrence embeddings are like) its top-k is the flat index's."""
    from genrec.online.branches import load_branch

    rng = np.random.default_rng(0)
    centers = rng.standard_normal((20, 16)).astype(np.float32)
    vectors = centers[rng.integers(0, 20, 2000)] + 0.05 * rng.standard_normal((2000, 16))
    items = [f"i{n}" for n in range(2000)]
    histories = [[items[j] for j in rng.integers(0, 2000, 5)] for _ in range(40)]
    flat = AnnBranch.fit(items, vectors.astype(np.float32))
    ivf = AnnBranch.fit(items, vectors.astype(np.float32), exact_max_items=1000, nprobe=8)
    assert not flat.is_ivf and ivf.is_ivf and ivf.params["nlist"] == int(4 * np.sqrt(2000))
    reopened = load_branch(ivf.save(tmp_path / "ann"))
    assert reopened.index.nprobe == 8 and reopened.index.ntotal == 2000
    # the index is the one copy of the vectors: read by row through its direct map
    assert reopened.embeddings is None
    positions = [5, 1999, 0]
    np.testing.assert_array_equal(reopened.vectors_of(positions), flat.vectors_of(positions))
    assert np.array_equal(reopened.user_vectors(histories, [None] * 40),
                          flat.user_vectors(histories, [None] * 40))  # fmt: skip
    expected = flat.recommend_batch(histories, 10, excludes=[h[:2] for h in histories])
    for branch in (ivf, reopened):
        got = branch.recommend_batch(histories, 10, excludes=[h[:2] for h in histories])
        found = [
            len({i for i, _ in g} & {i for i, _ in e}) for g, e in zip(got, expected, strict=True)
        ]
        assert sum(found) >= 0.95 * 10 * len(histories)
        assert all(not set(h[:2]) & {i for i, _ in g} for g, h in zip(got, histories, strict=True))


def _low_rank_cooccurrence(rng, n: int, rank: int) -> sparse.csr_matrix:
    """C = X X.T for a non-negative n x rank X: a co-occurrence whose normalized matrix is
    positive semi-definite of that rank, with heavy-tailed item degrees."""
    weights = rng.pareto(1.5, size=n)[:, None] + 0.05
    memberships = rng.random((n, rank)) ** 4 * weights
    return sparse.csr_matrix(memberships @ memberships.T)


@pytest.mark.parametrize("dense_max_items", [4000, 0])  # dense eigh, eigsh
def test_landmark_embeddings_are_exact_on_a_matrix_of_the_landmarks_rank(dense_max_items):
    """Nystrom from 60 landmarks of 400 items: when the landmarks span the matrix (rank 5 <
    dim), E E.T is the normalized co-occurrence, as the whole-catalog fit's is."""
    rng = np.random.default_rng(3)
    co = _low_rank_cooccurrence(rng, 400, 5)
    normalized, _ = symmetric_normalized(co)
    whole = embeddings_of_cooccurrence(co, dim=8, dense_max_items=dense_max_items)
    landmarks = embeddings_of_cooccurrence(
        co, dim=8, dense_max_items=dense_max_items, fit_max_items=60
    )
    assert landmarks.shape == whole.shape == (400, 8) and landmarks.dtype == np.float32
    np.testing.assert_allclose(whole @ whole.T, normalized.toarray(), atol=1e-5)
    np.testing.assert_allclose(landmarks @ landmarks.T, normalized.toarray(), atol=1e-5)


def test_landmark_embeddings_give_the_landmarks_their_own_eigenvectors():
    """The landmarks are the items of largest co-occurrence sums; their rows are
    V sqrt(lambda) of their own block of the normalized matrix; an item with no
    co-occurrence with a landmark (here: a pair of tail items, and an unseen one) gets zeros."""
    from genrec.online.branches import landmark_embeddings, top_eigenpairs

    rng = np.random.default_rng(5)
    sequences = [rng.zipf(1.3, size=int(rng.integers(2, 30))) % 500 for _ in range(400)]
    sequences += [np.array([500, 501, 500])]  # two items that only meet each other
    co = cooccurrence_matrix(sequences, 503, window=5)
    normalized, counts = symmetric_normalized(co)
    got = landmark_embeddings(normalized, counts, dim=16, landmarks=80)
    chosen = np.sort(np.argsort(-counts, kind="stable")[:80])
    assert counts[chosen].min() >= np.delete(counts, chosen).max()
    values, vectors = top_eigenpairs(normalized[chosen][:, chosen], 16, 4000)
    positive = values > 0
    own = vectors[:, positive] * np.sqrt(values[positive])
    width = int(positive.sum())
    np.testing.assert_allclose(got[chosen, :width], own, atol=1e-5)
    assert not got[chosen, width:].any()
    assert not got[[500, 501, 502]].any()


def test_embeddings_up_to_fit_max_items_are_the_whole_catalog_fit():
    rng = np.random.default_rng(7)
    co = _low_rank_cooccurrence(rng, 300, 12)
    whole = embeddings_of_cooccurrence(co, dim=8)
    assert np.array_equal(embeddings_of_cooccurrence(co, dim=8, fit_max_items=300), whole)
