"""RQ-VAE: item embedding -> L residual codes, plus the dedup level (offline step: item tokenization).

An MLP encoder maps an embedding to a latent; L codebooks quantize it residually
(level l quantizes what levels < l left over); an MLP decoder reconstructs the
embedding from the sum of the chosen codewords. Loss = reconstruction MSE + per
level ``|sg(r) - e|^2 + beta |r - sg(e)|^2`` (codebook + commitment), with the
straight-through estimator carrying the decoder's gradient to the encoder.

Against codebook collapse (the classic failure): every codebook is initialized by
k-means on the residuals it will quantize, and codes unused during an epoch are
reset to randomly drawn residuals. Training is deterministic for a given seed.

Items that end up on the same L codes get one extra dedup code (0, 1, 2, ...);
``assign_unique_ids`` does that and, when a group would overflow the fixed dedup
level, moves the item to its next-nearest last-level code. ``assign_balanced_ids``
(the build's default) first moves an item to the nearest last-level code that no
other item holds under its prefix, so near-identical vectors still get distinct
L codes and dedup codes are needed only when a prefix's last level is full.

Example::

    >>> import numpy as np
    >>> from genrec.offline.semantic_ids.rqvae import RQVAEConfig, train_rqvae
    >>> x = np.random.default_rng(0).standard_normal((200, 16)).astype("float32")
    >>> model, stats = train_rqvae(x, RQVAEConfig(input_dim=16, codes_per_level=8, epochs=5),
    ...                            progress=False)
    >>> model.codes(torch.from_numpy(x)).shape
    torch.Size([200, 3])
"""

from __future__ import annotations

import logging
import math
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from genrec.infra.progress import progress_bar

logger = logging.getLogger(__name__)

# Rows one inference pass takes at a time: at 1M items one pass over all rows held
# ~2.3 GiB of activations (the build's highest point); a block of 65,536 holds ~150 MB.
INFERENCE_BLOCK_ROWS = 65_536


@dataclass(frozen=True)
class RQVAEConfig:
    input_dim: int
    latent_dim: int = 32
    hidden_dims: tuple[int, ...] = (256, 128)
    levels: int = 3
    codes_per_level: int = 256
    commitment_weight: float = 0.25
    epochs: int = 150
    batch_size: int = 256
    learning_rate: float = 1e-3
    kmeans_iters: int = 25
    seed: int = 0
    # Budgets (None: none): optimizer steps in all (the last epoch may stop early), and
    # the items k-means initializes the codebooks on (a seeded sample of the rows).
    max_train_steps: int | None = None
    kmeans_sample: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict) -> RQVAEConfig:
        known = {name: raw[name] for name in cls.__dataclass_fields__ if name in raw}
        return cls(**{**known, "hidden_dims": tuple(known["hidden_dims"])})


@dataclass
class TrainingStats:
    loss_history: list[float] = field(default_factory=list)
    dead_code_resets: list[int] = field(default_factory=list)  # per level, summed over epochs
    seconds: float = 0.0
    steps: int = 0  # optimizer steps taken
    epochs: int = 0  # epochs begun (the last one cut short when the step budget ran out)
    kmeans_items: int = 0  # rows the codebooks were initialized on


def mlp(sizes: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:], strict=False)):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(nn.SiLU())
    return nn.Sequential(*layers)


class RQVAE(nn.Module):
    def __init__(self, config: RQVAEConfig) -> None:
        super().__init__()
        self.config = config
        dims = [config.input_dim, *config.hidden_dims, config.latent_dim]
        self.encoder = mlp(dims)
        self.decoder = mlp(dims[::-1])
        shape = (config.levels, config.codes_per_level, config.latent_dim)
        self.codebooks = nn.Parameter(torch.zeros(shape))

    def quantize(self, latent: torch.Tensor):
        """Residual quantization: (sum of codewords, codes [n, L], residuals per level, loss)."""
        residual, quantized = latent, torch.zeros_like(latent)
        codes, residuals, loss = [], [], latent.new_zeros(())
        for codebook in self.codebooks:
            code = torch.cdist(residual, codebook).argmin(dim=1)
            codeword = codebook[code]
            loss = loss + F.mse_loss(codeword, residual.detach())
            loss = loss + self.config.commitment_weight * F.mse_loss(residual, codeword.detach())
            codes.append(code)
            residuals.append(residual)
            quantized = quantized + codeword
            residual = residual - codeword.detach()
        return quantized, torch.stack(codes, dim=1), residuals, loss

    def forward(self, x: torch.Tensor):
        latent = self.encoder(x)
        quantized, codes, residuals, quant_loss = self.quantize(latent)
        straight_through = latent + (quantized - latent).detach()
        reconstruction = self.decoder(straight_through)
        recon_loss = F.mse_loss(reconstruction, x)
        return reconstruction, codes, residuals, recon_loss, quant_loss

    @torch.no_grad()
    def codes(self, x: torch.Tensor) -> torch.Tensor:
        return self.quantize(self.encoder(x))[1]

    @torch.no_grad()
    def latents(self, x: torch.Tensor) -> torch.Tensor:
        """The encoder's output for every row, ``INFERENCE_BLOCK_ROWS`` rows at a time."""
        out = x.new_empty((len(x), self.config.latent_dim))
        for start in range(0, len(x), INFERENCE_BLOCK_ROWS):
            out[start : start + INFERENCE_BLOCK_ROWS] = self.encoder(
                x[start : start + INFERENCE_BLOCK_ROWS]
            )
        return out

    @torch.no_grad()
    def reconstruction_loss(self, x: torch.Tensor) -> float:
        """Mean squared reconstruction error over every row, a block of rows at a time."""
        if len(x) <= INFERENCE_BLOCK_ROWS:  # one block: the same float as one pass
            return float(self(x)[3])
        squared = 0.0
        for start in range(0, len(x), INFERENCE_BLOCK_ROWS):
            block = x[start : start + INFERENCE_BLOCK_ROWS]
            squared += float(self(block)[3]) * block.numel()
        return squared / x.numel()


def kmeans(points: torch.Tensor, k: int, iters: int, generator: torch.Generator) -> torch.Tensor:
    """k-means++ seeding then Lloyd iterations; empty clusters take a random point."""
    n = points.shape[0]
    if n <= k:  # fewer points than codes: every point is a code, the rest jittered copies
        extra = points[torch.randint(n, (k - n,), generator=generator)]
        noise = torch.randn(extra.shape, generator=generator) * 1e-3
        return torch.cat([points, extra + noise.to(points.device)])
    centroids = points[torch.randint(n, (1,), generator=generator)]
    nearest = torch.cdist(points, centroids).squeeze(1) ** 2
    for _ in range(1, k):
        weights = nearest.clamp_min(1e-12).cpu()
        choice = torch.multinomial(weights / weights.sum(), 1, generator=generator)
        centroids = torch.cat([centroids, points[choice]])
        nearest = torch.minimum(nearest, (torch.cdist(points, points[choice]).squeeze(1)) ** 2)
    for _ in range(iters):
        assignment = torch.cdist(points, centroids).argmin(dim=1)
        sums = torch.zeros_like(centroids).index_add_(0, assignment, points)
        counts = torch.bincount(assignment, minlength=k).unsqueeze(1).to(points.dtype)
        empty = counts.squeeze(1) == 0
        centroids = torch.where(empty.unsqueeze(1), centroids, sums / counts.clamp_min(1))
        if empty.any():
            refill = torch.randint(n, (int(empty.sum()),), generator=generator)
            centroids[empty] = points[refill.to(points.device)]
    return centroids


@torch.no_grad()
def init_codebooks(model: RQVAE, x: torch.Tensor, generator: torch.Generator) -> int:
    """k-means on level l's residuals gives codebook l (levels initialized in order).

    With ``kmeans_sample`` and more rows than that, on a seeded sample of that many rows
    (k-means costs O(rows x codes x iterations) per level). Returns the rows used.
    """
    sample = model.config.kmeans_sample
    if sample is not None and len(x) > sample:
        rows = torch.randperm(len(x), generator=generator)[:sample].sort().values
        x = x[rows.to(x.device)]
    residual = model.encoder(x)
    for level in range(model.config.levels):
        centroids = kmeans(
            residual, model.config.codes_per_level, model.config.kmeans_iters, generator
        )
        model.codebooks[level] = centroids
        residual = residual - centroids[torch.cdist(residual, centroids).argmin(dim=1)]
    return len(x)


@torch.no_grad()
def reset_dead_codes(
    model: RQVAE, usage: torch.Tensor, residuals: list[torch.Tensor], generator: torch.Generator
) -> list[int]:
    """Codes no item chose this epoch move onto random residuals of their level."""
    resets = []
    for level, level_residuals in enumerate(residuals):
        dead = torch.nonzero(usage[level] == 0).squeeze(1)
        if len(dead):
            pick = torch.randint(len(level_residuals), (len(dead),), generator=generator)
            model.codebooks[level, dead] = level_residuals[pick.to(level_residuals.device)]
        resets.append(len(dead))
    return resets


def train_rqvae(
    embeddings: np.ndarray, config: RQVAEConfig, *, device: str | None = None, progress: bool = True
) -> tuple[RQVAE, TrainingStats]:
    """Train an RQ-VAE on ``embeddings`` (float32 [n, input_dim]); deterministic for ``config.seed``."""
    if embeddings.ndim != 2 or embeddings.shape[1] != config.input_dim or len(embeddings) == 0:
        raise ValueError(f"embeddings must be [n>0, {config.input_dim}], got {embeddings.shape}")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(config.seed)
    generator = torch.Generator().manual_seed(config.seed)
    model = RQVAE(config).to(device)
    x = torch.from_numpy(np.ascontiguousarray(embeddings, dtype=np.float32)).to(device)
    stats = TrainingStats(dead_code_resets=[0] * config.levels)
    stats.kmeans_items = init_codebooks(model, x, generator)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.learning_rate)
    batches_per_epoch = math.ceil(len(x) / config.batch_size)
    epochs = config.epochs
    if config.max_train_steps is not None:
        # ``chunk`` may make fewer, equal batches than asked: count what an epoch runs
        chunk = math.ceil(len(x) / batches_per_epoch)
        steps_per_epoch = math.ceil(len(x) / chunk)
        epochs = min(epochs, math.ceil(config.max_train_steps / steps_per_epoch))
    bar = progress_bar(range(epochs), desc="train RQ-VAE", unit="epoch", disable=not progress)
    for _ in bar:
        steps_left = (
            None if config.max_train_steps is None else config.max_train_steps - stats.steps
        )
        epoch_loss = _train_epoch(
            model, optimizer, x, batches_per_epoch, steps_left, stats, generator
        )
        stats.loss_history.append(epoch_loss)
        bar.set_postfix(loss=f"{epoch_loss:.5f}", steps=stats.steps)
    logger.info(
        "RQ-VAE: %d steps in %d epochs of %d batches (budget %s), k-means on %d of %d items",
        stats.steps, stats.epochs, batches_per_epoch, config.max_train_steps,
        stats.kmeans_items, len(x),
    )  # fmt: skip
    model.eval()
    return model, stats


def _train_epoch(
    model: RQVAE,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    batches_per_epoch: int,
    steps_left: int | None,
    stats: TrainingStats,
    generator: torch.Generator,
) -> float:
    """One epoch (at most ``steps_left`` batches), then the dead-code reset; its mean loss.

    An epoch cut short by the step budget skips the reset: its usage counts only part of
    the items, and the codebooks go straight to assignment.
    """
    config = model.config
    order = torch.randperm(len(x), generator=generator).to(x.device)
    usage = torch.zeros(config.levels, config.codes_per_level, device=x.device)
    epoch_loss = 0.0
    residuals: list[list[torch.Tensor]] = [[] for _ in range(config.levels)]
    batches = order.chunk(batches_per_epoch)
    truncated = steps_left is not None and steps_left < len(batches)
    if truncated:
        batches = batches[:steps_left]
    for batch in batches:
        _, codes, level_residuals, recon_loss, quant_loss = model(x[batch])
        loss = recon_loss + quant_loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        epoch_loss += float(loss.detach()) * len(batch) / len(x)
        for level in range(config.levels):
            usage[level] += torch.bincount(codes[:, level], minlength=config.codes_per_level)
            residuals[level].append(level_residuals[level].detach())
    stats.steps += len(batches)
    stats.epochs += 1
    if truncated:  # the mean over the items this part of the epoch saw
        return epoch_loss * len(x) / max(1, sum(len(batch) for batch in batches))
    resets = reset_dead_codes(model, usage, [torch.cat(r) for r in residuals], generator)
    stats.dead_code_resets = [a + b for a, b in zip(stats.dead_code_resets, resets, strict=True)]
    return epoch_loss


class DedupOverflowError(RuntimeError):
    """An item found no free dedup slot among its candidate last-level codes."""


def assign_unique_ids(
    candidates: np.ndarray,
    prefixes: np.ndarray,
    dedup_codes: int,
    taken: set[tuple[int, ...]] | None = None,
) -> tuple[np.ndarray, int]:
    """Unique IDs of length L+1 from each item's L-1 prefix and ranked last-level candidates.

    Items are processed in row order; each takes the lowest free dedup code of its
    nearest last-level code, or, when that group already holds ``dedup_codes``
    items, of its next-nearest candidate. ``taken`` holds IDs already in use (old
    items on a refresh). Returns the IDs (int64 [n, L+1]) and how many items moved.
    """
    taken = set(taken or ())
    used_slots: dict[tuple[int, ...], set[int]] = defaultdict(set)
    for semantic_id in taken:
        used_slots[semantic_id[:-1]].add(semantic_id[-1])
    ids = np.zeros((len(candidates), prefixes.shape[1] + 2), dtype=np.int64)
    moved = 0
    for row in range(len(candidates)):
        prefix = tuple(int(c) for c in prefixes[row])
        for rank, last in enumerate(candidates[row]):
            group = (*prefix, int(last))
            free = next((d for d in range(dedup_codes) if d not in used_slots[group]), None)
            if free is not None:
                used_slots[group].add(free)
                ids[row] = (*group, free)
                moved += rank > 0
                break
        else:
            raise DedupOverflowError(
                f"item row {row}: all {len(candidates[row])} candidate codes under prefix {prefix} "
                f"already hold {dedup_codes} items; raise semantic_ids.dedup_codes and rebuild "
                "with --full"
            )
    return ids, moved


def assign_balanced_ids(
    prefixes: np.ndarray,
    candidates: np.ndarray,
    last_residuals: np.ndarray,
    last_codebook: np.ndarray,
    dedup_codes: int,
    taken: set[tuple[int, ...]] | None = None,
) -> tuple[np.ndarray, int]:
    """Unique IDs of length L+1 where each full L-code prefix holds one item when it can.

    Identical or near-identical vectors (rare items seen by the same few users) land
    on the same L codes; numbering them on the dedup level makes the model tell
    them apart by an arbitrary code. Here each item instead takes the nearest
    *unoccupied* last-level code under its L-1 prefix: first among its ranked
    ``candidates``, then over the whole ``last_codebook`` (ranked by the distance
    of its ``last_residuals`` row). Only when every last-level code under the
    prefix is occupied does it share one, taking the lowest free dedup code of the
    nearest code that has one. Items nearest to their code choose first (ties by
    row), so the order is deterministic. Time O(items x candidates), plus
    O(codes) for each item whose candidates are all occupied; memory O(items).
    Returns the IDs (int64 [n, L+1]) and how many items left their nearest code.
    """
    used_slots: dict[tuple[int, ...], set[int]] = defaultdict(set)
    for semantic_id in taken or ():
        used_slots[semantic_id[:-1]].add(semantic_id[-1])
    nearest = last_codebook[candidates[:, 0]]
    order = np.argsort(((last_residuals - nearest) ** 2).sum(axis=1), kind="stable")
    ids = np.zeros((len(candidates), prefixes.shape[1] + 2), dtype=np.int64)
    moved = 0
    for row in order.tolist():
        prefix = tuple(int(c) for c in prefixes[row])
        last = _free_last_code(prefix, candidates[row], used_slots)
        if last is None:
            ranking = np.argsort(((last_codebook - last_residuals[row]) ** 2).sum(axis=1))
            last = _free_last_code(prefix, ranking, used_slots)
        if last is None:
            last = _shared_last_code(prefix, ranking, used_slots, dedup_codes, row)
        group = (*prefix, last)
        free = next(d for d in range(dedup_codes) if d not in used_slots[group])
        used_slots[group].add(free)
        ids[row] = (*group, free)
        moved += last != int(candidates[row, 0])
    return ids, moved


def _free_last_code(prefix: tuple[int, ...], ranked, used_slots) -> int | None:
    """The first code of ``ranked`` whose full prefix holds no item yet."""
    for code in ranked:
        group = (*prefix, int(code))
        if not used_slots.get(group):
            return int(code)
    return None


def _shared_last_code(prefix, ranked, used_slots, dedup_codes: int, row: int) -> int:
    """The first code of ``ranked`` whose group still has a free dedup code."""
    for code in ranked:
        if len(used_slots.get((*prefix, int(code)), ())) < dedup_codes:
            return int(code)
    raise DedupOverflowError(
        f"item row {row}: every last-level code under prefix {prefix} already holds "
        f"{dedup_codes} items; raise semantic_ids.dedup_codes and rebuild with --full"
    )


def assign_capacity_codes(
    prefixes: np.ndarray,
    candidates: np.ndarray,
    residuals: np.ndarray,
    codebook: np.ndarray,
    capacity: int,
) -> tuple[np.ndarray, int]:
    """One level's codes such that no (prefix, code) group holds more than ``capacity`` items.

    For the level above the last one, ``capacity`` is the size of the last level: a
    two-code prefix then never holds more items than it has distinct last codes, and
    the balanced last level can give each of them its own. Items nearest to their
    code keep it (ties by row); the rest take their next-nearest code with room
    (ranked ``candidates``, then the whole ``codebook``), or keep the nearest when
    every code under their prefix is full. Vectorized except for the items over
    capacity. Returns the codes (int64 [n]) and how many items moved.
    """
    n = len(candidates)
    order = np.argsort(((residuals - codebook[candidates[:, 0]]) ** 2).sum(axis=1), kind="stable")
    position = np.empty(n, dtype=np.int64)
    position[order] = np.arange(n)
    keys = np.concatenate([prefixes, candidates[:, :1]], axis=1)
    _, group = np.unique(keys, axis=0, return_inverse=True)
    group = group.reshape(-1)
    by_group = np.lexsort((position, group))
    starts = np.searchsorted(group[by_group], group[by_group])
    rank = np.empty(n, dtype=np.int64)
    rank[by_group] = np.arange(n) - starts
    codes = candidates[:, 0].astype(np.int64).copy()
    over = np.flatnonzero(rank >= capacity)
    if len(over) == 0:
        return codes, 0
    kept = np.flatnonzero(rank < capacity)
    counts = Counter(map(tuple, keys[kept].tolist()))
    for row in over[np.argsort(position[over])].tolist():
        prefix = tuple(int(c) for c in prefixes[row])
        code = _code_with_room(prefix, candidates[row], counts, capacity)
        if code is None:
            ranking = np.argsort(((codebook - residuals[row]) ** 2).sum(axis=1))
            code = _code_with_room(prefix, ranking, counts, capacity)
        code = int(candidates[row, 0]) if code is None else code
        counts[(*prefix, code)] += 1
        codes[row] = code
    return codes, int((codes != candidates[:, 0]).sum())


def _code_with_room(prefix: tuple[int, ...], ranked, counts: Counter, capacity: int) -> int | None:
    for code in ranked:
        if counts.get((*prefix, int(code)), 0) < capacity:
            return int(code)
    return None
