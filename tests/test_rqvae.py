"""RQ-VAE unit tests on small synthetic data (seconds)."""

import numpy as np
import pytest
import torch

from genrec.offline.semantic_ids import rqvae
from genrec.offline.semantic_ids.rqvae import (
    RQVAE,
    DedupOverflowError,
    RQVAEConfig,
    assign_balanced_ids,
    assign_capacity_codes,
    assign_unique_ids,
    kmeans,
    reset_dead_codes,
    train_rqvae,
)


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def clustered(n=600, dim=16, clusters=12, seed=0):
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((clusters, dim)) * 3
    x = centers[rng.integers(0, clusters, n)] + rng.standard_normal((n, dim)) * 0.3
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def test_kmeans_finds_separated_clusters_and_handles_few_points():
    x = torch.from_numpy(clustered(clusters=4, dim=8))
    generator = torch.Generator().manual_seed(0)
    centroids = kmeans(x, 4, 20, generator)
    assignment = torch.cdist(x, centroids).argmin(dim=1)
    assert len(torch.unique(assignment)) == 4
    few = kmeans(x[:3], 8, 5, generator)  # fewer points than codes
    assert few.shape == (8, 8)
    assert torch.allclose(few[:3], x[:3])


def test_training_is_deterministic_and_uses_codebooks():
    x = clustered()
    config = RQVAEConfig(
        input_dim=16, latent_dim=8, hidden_dims=(32,), codes_per_level=16, epochs=15
    )
    model_a, stats = train_rqvae(x, config, progress=False)
    model_b, _ = train_rqvae(x, config, progress=False)
    for key, value in model_a.state_dict().items():
        assert torch.equal(value, model_b.state_dict()[key]), key
    codes = model_a.codes(torch.from_numpy(x)).numpy()
    assert codes.shape == (600, 3)
    # 12 true clusters, 16 codes: a collapsed first level would use 1-2 codes
    assert len(np.unique(codes[:, 0])) >= 10
    assert stats.loss_history[-1] < stats.loss_history[0]
    different = train_rqvae(x, RQVAEConfig(**{**config.to_dict(), "seed": 1}), progress=False)[0]
    assert not torch.equal(different.codebooks, model_a.codebooks)


def test_budgets_that_do_not_bite_change_nothing_and_ones_that_do_cap_the_work():
    """A step budget above epochs x batches (ML-100K: 150 x 7 under 20,000) and a k-means
    sample above the item count train the very same model; a lower budget stops at its
    step count (mid-epoch) and k-means runs on the sample, and every item still gets codes."""
    x = clustered()  # 600 items, batch 64: 10 batches per epoch
    base = RQVAEConfig(
        input_dim=16, latent_dim=8, hidden_dims=(32,), codes_per_level=16, epochs=6,
        batch_size=64,
    )  # fmt: skip
    plain, plain_stats = train_rqvae(x, base, progress=False)
    loose = RQVAEConfig(**{**base.to_dict(), "max_train_steps": 60, "kmeans_sample": 600})
    same, same_stats = train_rqvae(x, loose, progress=False)
    for key, value in plain.state_dict().items():
        assert torch.equal(value, same.state_dict()[key]), key
    assert plain_stats.steps == same_stats.steps == 60 and same_stats.epochs == 6
    assert plain_stats.kmeans_items == same_stats.kmeans_items == 600

    tight = RQVAEConfig(**{**base.to_dict(), "max_train_steps": 25, "kmeans_sample": 300})
    model, stats = train_rqvae(x, tight, progress=False)
    assert (stats.steps, stats.epochs, stats.kmeans_items) == (25, 3, 300)
    assert len(stats.loss_history) == 3 and all(np.isfinite(stats.loss_history))
    codes = model.codes(torch.from_numpy(x)).numpy()
    assert codes.shape == (600, 3) and len(np.unique(codes[:, 0])) >= 8


def test_dead_codes_move_onto_residuals():
    model = RQVAE(
        RQVAEConfig(input_dim=4, latent_dim=2, hidden_dims=(), levels=2, codes_per_level=4)
    )
    usage = torch.tensor([[3.0, 0.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    residuals = [torch.full((5, 2), 7.0), torch.full((5, 2), 9.0)]
    resets = reset_dead_codes(model, usage, residuals, torch.Generator().manual_seed(0))
    assert resets == [2, 0]
    assert torch.equal(model.codebooks[0, 1], torch.tensor([7.0, 7.0]))
    assert torch.equal(model.codebooks[0, 3], torch.tensor([7.0, 7.0]))
    assert torch.equal(model.codebooks[0, 0], torch.zeros(2))
    assert torch.equal(model.codebooks[1], torch.zeros(4, 2))


def test_dedup_numbers_collisions_and_moves_overflow():
    prefixes = np.array([[1, 2]] * 4)
    candidates = np.array([[5, 6], [5, 6], [5, 6], [5, 6]])
    ids, moved = assign_unique_ids(candidates, prefixes, dedup_codes=3)
    assert ids.tolist() == [[1, 2, 5, 0], [1, 2, 5, 1], [1, 2, 5, 2], [1, 2, 6, 0]]
    assert moved == 1
    taken = {(1, 2, 5, 0), (1, 2, 5, 2)}
    ids, moved = assign_unique_ids(candidates[:1], prefixes[:1], dedup_codes=3, taken=taken)
    assert ids.tolist() == [[1, 2, 5, 1]] and moved == 0
    with pytest.raises(DedupOverflowError, match="dedup_codes"):
        assign_unique_ids(candidates[:, :1], prefixes, dedup_codes=3)


def crowded_catalog(n_identical=150, n_spread=850, codes=256, dim=8, seed=0):
    """One crowd of identical vectors (rare items seen by the same user) plus spread items,
    as (prefixes, ranked candidates, last-level residuals, last codebook)."""
    rng = np.random.default_rng(seed)
    codebook = rng.standard_normal((codes, dim)).astype(np.float32)
    residuals = rng.standard_normal((n_identical + n_spread, dim)).astype(np.float32)
    residuals[:n_identical] = residuals[0]
    prefixes = rng.integers(0, 16, (len(residuals), 2))
    prefixes[:n_identical] = (1, 2)
    distances = ((residuals[:, None, :] - codebook[None]) ** 2).sum(axis=2)
    candidates = np.argsort(distances, axis=1, kind="stable")[:, :16]
    return prefixes, candidates, residuals, codebook


def collision_rate(ids: np.ndarray) -> float:
    return 1.0 - len({tuple(row) for row in ids[:, :-1].tolist()}) / len(ids)


def test_balanced_assignment_splits_a_crowded_prefix():
    prefixes, candidates, residuals, codebook = crowded_catalog()
    before, _ = assign_unique_ids(candidates, prefixes, dedup_codes=32)
    assert collision_rate(before) > 0.15  # the crowd of 150 fills 5 last codes x 32 slots
    ids, moved = assign_balanced_ids(prefixes, candidates, residuals, codebook, dedup_codes=32)
    assert len({tuple(row) for row in ids.tolist()}) == len(ids)
    assert collision_rate(ids) <= 0.05
    assert (ids[:, :2] == prefixes).all()  # only the last RQ level moves
    assert len({tuple(row) for row in ids[:150, :3].tolist()}) == 150  # the crowd is split
    assert moved >= 149
    again, _ = assign_balanced_ids(prefixes, candidates, residuals, codebook, dedup_codes=32)
    assert (again == ids).all()  # deterministic


def test_balanced_assignment_nearest_first_taken_and_overflow():
    codebook = np.array([[0.0], [1.0], [2.0], [3.0]], dtype=np.float32)
    residuals = np.array([[0.4], [0.1], [0.2]], dtype=np.float32)
    candidates = np.array([[0, 1], [0, 1], [0, 1]])
    prefixes = np.array([[7], [7], [7]])
    ids, moved = assign_balanced_ids(prefixes, candidates, residuals, codebook, dedup_codes=2)
    # Row 1 is nearest to code 0 and keeps it; the others take the next free codes.
    assert ids.tolist() == [[7, 2, 0], [7, 0, 0], [7, 1, 0]] and moved == 2
    taken = {(7, 0, 0), (7, 1, 0), (7, 2, 0), (7, 3, 0)}  # a refresh: all codes held once
    ids, _ = assign_balanced_ids(prefixes[:1], candidates[:1], residuals[:1], codebook, 2, taken)
    assert ids.tolist() == [[7, 0, 1]]
    with pytest.raises(DedupOverflowError, match="dedup_codes"):
        assign_balanced_ids(prefixes, candidates, residuals, codebook, dedup_codes=1, taken=taken)


def test_capacity_codes_cap_each_prefix_nearest_first():
    codebook = np.array([[0.0], [1.0], [2.0]], dtype=np.float32)
    residuals = np.array([[0.3], [0.1], [0.2], [0.0], [1.0]], dtype=np.float32)
    prefixes = np.array([[4], [4], [4], [5], [4]])
    candidates = np.array([[0, 1, 2], [0, 1, 2], [0, 1, 2], [0, 1, 2], [1, 0, 2]])
    codes, moved = assign_capacity_codes(prefixes, candidates, residuals, codebook, capacity=2)
    # under prefix 4, code 0 keeps its two nearest (rows 1, 2); row 0 goes to code 1,
    # which row 4 (exactly on it) took first and still has room for one more
    assert codes.tolist() == [1, 0, 0, 0, 1] and moved == 1
    full, _ = assign_capacity_codes(
        prefixes[:3], candidates[:3, :1], residuals[:3], codebook[:1], 1
    )
    assert full.tolist() == [0, 0, 0]  # nowhere to go: the nearest code, shared


def test_bad_embeddings_are_refused():
    with pytest.raises(ValueError, match="embeddings must be"):
        train_rqvae(np.zeros((10, 5), np.float32), RQVAEConfig(input_dim=4), progress=False)


def test_inference_in_blocks_matches_one_pass(monkeypatch):
    """Latents and the reconstruction error over blocks of rows (the build's bounded memory
    at 1M items) equal one pass over all rows, up to float rounding of the batch shapes."""
    x = torch.from_numpy(clustered())
    torch.manual_seed(0)
    model = RQVAE(RQVAEConfig(input_dim=16, latent_dim=8, hidden_dims=(32,), codes_per_level=16))
    with torch.no_grad():
        model.codebooks.normal_()
        one_pass_latents, one_pass_mse = model.encoder(x), float(model(x)[3])
    assert torch.equal(model.latents(x), one_pass_latents)  # one block: the same floats
    assert model.reconstruction_loss(x) == one_pass_mse
    monkeypatch.setattr(rqvae, "INFERENCE_BLOCK_ROWS", 7)  # 600 rows: 86 blocks, the last short
    assert torch.allclose(model.latents(x), one_pass_latents, atol=1e-6)
    assert abs(model.reconstruction_loss(x) - one_pass_mse) <= 1e-6 * one_pass_mse
