"""Data parallelism inside the training loops (offline step, models): rows, weights, gradients.

With ``train.workers = N`` the same loops (``train_target``, ``align_draft``) run in N
processes at once (``genrec.offline.training.ray_train`` starts them under Ray Train).
Every worker draws the same epoch order and the same global batches from the same seed,
and trains on its share of each batch: the rows ``rank, rank + N, ...``
(``DataShard.take_weighted``). Its mean loss is weighted by its share of the batch's
trained tokens (or rows), so the average over workers that DDP takes of the gradients is
the gradient of the whole batch's mean loss: N workers take the same steps, on the same
global batch, as one (up to the order floating-point sums are taken in). A worker left
without rows of a short batch still runs a step on one row with weight 0, because every
worker's backward pass must take part in the gradient average.

Outside ``ray_train`` every loop gets ``SINGLE`` (rank 0 of 1): no process group, no
collective, the rows and losses exactly as before.

Example::

    >>> SINGLE.take_weighted(["a", "b", "c"])
    (['a', 'b', 'c'], 1.0)
    >>> DataShard(rank=1, world=2).take_weighted(["a", "b", "c"])
    (['b'], 0.6666666666666666)
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class DataShard:
    """This worker's place among ``world`` data-parallel workers.

    ``device``: where collectives run (the GPU under NCCL; gloo works on CPU tensors).
    """

    rank: int = 0
    world: int = 1
    device: str = "cpu"

    @property
    def parallel(self) -> bool:
        return self.world > 1

    def take(self, rows: Sequence[Any]) -> Sequence[Any]:
        """This worker's rows of ``rows`` (every ``world``-th from ``rank``)."""
        return rows[self.rank :: self.world]

    def take_weighted(
        self, rows: Sequence[Any], size: Callable[[Any], float] = lambda _: 1.0
    ) -> tuple[Sequence[Any], float]:
        """This worker's rows of a global batch and the weight of their mean loss.

        ``size(row)``: what the loss averages over in a row (trained tokens, or 1 per row).
        The weights are ``world * mine / total``, so the workers' average of weighted mean
        losses is the mean over the whole batch.
        """
        if not self.parallel:
            return rows, 1.0
        mine = self.take(rows)
        total = sum(size(row) for row in rows)
        if len(mine) == 0 or total == 0:
            return rows[:1], 0.0
        return mine, self.world * sum(size(row) for row in mine) / total

    def sum(self, values: Sequence[float]) -> list[float]:
        """Each value summed over the workers."""
        if not self.parallel:
            return [float(v) for v in values]
        tensor = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor)
        return tensor.tolist()

    def max(self, value: float) -> float:
        """The largest of every worker's ``value`` (e.g. elapsed time: all stop together)."""
        if not self.parallel:
            return value
        tensor = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return float(tensor.item())

    def gather_rows(self, tensor: torch.Tensor, total: int) -> torch.Tensor:
        """The rows every worker computed for its ``take`` of ``total`` rows, in global order."""
        if not self.parallel:
            return tensor
        per_worker = -(-total // self.world)
        padded = tensor.new_zeros((per_worker, *tensor.shape[1:]))
        padded[: len(tensor)] = tensor
        padded = padded.to(self.device)
        parts = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(parts, padded)
        # parts[r][j] is global row j * world + r: interleave back, padding falls at the end
        return torch.stack(parts, dim=1).reshape(-1, *tensor.shape[1:])[:total].to(tensor.device)


SINGLE = DataShard()


class _StepLoss(nn.Module):
    """``loss(model, *batch)`` as a module's forward, so DDP can wrap the whole step."""

    def __init__(self, model: nn.Module, loss: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.model = model
        self.loss = loss

    def forward(self, *batch: Any) -> torch.Tensor:
        return self.loss(self.model, *batch)


def step_loss(
    model: nn.Module, loss: Callable[..., torch.Tensor], shard: DataShard
) -> Callable[..., torch.Tensor]:
    """``(*batch) -> loss(model, *batch)``; across workers, DDP averages its gradients.

    The loops compute their losses from the model's parts (``model.model``,
    ``lm_head``), not its ``forward``, so DDP wraps a module whose forward is the loss.
    Buffers are not broadcast at each step: they are fixed during training (the item
    vectors) and DDP copies rank 0's parameters and buffers once when it wraps.
    """
    if not shard.parallel:
        return lambda *batch: loss(model, *batch)
    from torch.nn.parallel import DistributedDataParallel

    # torch 2.15 split broadcast_buffers: forward_sync_buffers=False keeps the sync at init
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters:
        options = {"forward_sync_buffers": False}
    else:
        options = {"broadcast_buffers": False}  # before 2.15 it also synced them at init
    return DistributedDataParallel(_StepLoss(model, loss), **options)
