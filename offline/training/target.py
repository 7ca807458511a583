"""Training the target model (offline step, models): every next-item position, early stopping.

Each epoch cuts every user's training sequence (``Split.train``) into windows
of up to ``H + 1`` items at a random offset, so every item is a target once per
epoch and sees up to ``H`` items of context. One causal pass over a window
trains all its items at once; the loss is cross-entropy over the tokens of the
level being predicted (the decoder never picks a token of another level). A
preset's ``reverse_windows`` share of the windows is fed back to front
(``reverse_some``), and with ``shuffle_ties`` the items of events that share
their time are permuted before cutting (``tie_groups``, ``shuffle_ties``);
prompts at inference are always in stored time order.
Every ``eval_every`` epochs the model decodes the validation cases
(``Split.valid``) and training stops when validation HR@10 has not improved
``patience`` times; the best weights are kept. With ``preset.ema_decay`` the
weights validated and kept are an exponential moving average of every step's
(``WeightAverage``), not the last step's. With ``preset.item_vector_dim`` the
target also gets each history item's co-occurrence vector in its input, fitted
on the very sequences it trains on (``genrec.online.models.item_vectors``).

A final fit (``preset.fit_on_valid``) adds every user's validation item to the
training sequences (so each sequence is its user's test history), runs the
whole schedule chosen beforehand on validation, never evaluates and keeps the
last weights (or their average). Its validation figures are not meaningful (it saw those items).

Data-parallel (``shard``, ``train.workers > 1``; ``genrec.offline.training.parallel``):
every worker cuts the same windows into the same global batches and trains on its rows of
each, DDP averaging the gradients; validation is split between the workers and summed,
and the time budget is the slowest worker's, so all of them stop at the same step.

Example::

    >>> result = train_target(item_tokens, split, PRESETS["tiny"], history_items=50)  # doctest: +SKIP
    >>> result.metrics["valid_hr@10"]  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from genrec.infra.progress import progress_bar
from genrec.offline.splits import Case, Split
from genrec.offline.training.parallel import SINGLE, DataShard, step_loss
from genrec.online.decoding.trie import ItemTrie
from genrec.online.models.generative import decode_batched
from genrec.online.models.item_vectors import (
    attach_item_vectors,
    fit_item_vectors,
    item_vector_embedding,
)
from genrec.online.models.presets import ModelPreset, build_target, level_masks, pick_device
from genrec.online.prompts import IGNORE_INDEX, ItemTokens, history_prompt, training_example


@dataclass
class TrainResult:
    model: Any
    curves: dict[str, list[float]] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0


# --- data -----------------------------------------------------------------------


def epoch_windows(
    sequences: Sequence[Sequence[str]], max_items: int, rng: np.random.Generator
) -> list[list[str]]:
    """Every sequence cut into windows of ``max_items + 1`` items at a random offset."""
    size = max_items + 1
    windows = []
    for items in sequences:
        if len(items) < 1:
            continue
        offset = int(rng.integers(0, size)) if len(items) > size else 0
        cuts = [0, *range(offset or size, len(items), size)]
        windows.extend(
            list(items[a:b]) for a, b in zip(cuts, [*cuts[1:], len(items)], strict=False) if b > a
        )
    return windows


def reverse_some(
    windows: list[list[str]], share: float, rng: np.random.Generator
) -> list[list[str]]:
    """About ``share`` of the windows back to front; the rest as they are.

    Augmentation: the model also learns which items come *before* an item, the
    backward pairs item-CF counts too. Much of the order is noise anyway: ML-100K
    users rate batches of films within the same second, in file order.
    """
    if share <= 0:
        return windows
    return [window[::-1] if rng.random() < share else window for window in windows]


def shuffle_ties(
    sequences: Sequence[Sequence[str]], groups: Sequence[np.ndarray], rng: np.random.Generator
) -> list[list[str]]:
    """Each sequence with the items of every tie group in a random order; groups stay in place.

    Augmentation: events stamped with the same time are stored in the order they were
    written, which says nothing about the order they happened in (on ML-100K half of
    all consecutive ratings share their second), so the model sees that order as the
    noise it is. ``groups`` numbers each item's tie group (``tie_groups``).
    """
    shuffled = []
    for items, group in zip(sequences, groups, strict=True):
        order = np.lexsort((rng.random(len(items)), group))  # by group, then at random
        shuffled.append([items[i] for i in order])
    return shuffled


def epoch_batches(
    sequences: Sequence[Sequence[str]],
    preset: ModelPreset,
    history_items: int,
    rng: np.random.Generator,
    ties: Sequence[np.ndarray] | None = None,
) -> list[list[list[str]]]:
    """One epoch's windows (``reverse_windows`` of them back to front), shuffled into batches.

    With ``ties`` (``tie_groups``; ``train_target`` passes them when ``preset.shuffle_ties``),
    items with the same event time are permuted first.
    """
    if ties is not None:
        sequences = shuffle_ties(sequences, ties, rng)
    windows = reverse_some(
        epoch_windows(sequences, history_items, rng), preset.reverse_windows, rng
    )
    order = rng.permutation(len(windows))
    chunks = np.array_split(order, math.ceil(len(windows) / preset.batch_size))
    return [[windows[i] for i in chunk] for chunk in chunks]


def collate(
    examples: Sequence[tuple[list[int], list[int]]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``input_ids``, ``labels`` and ``attention_mask``."""
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, (ids, labs) in enumerate(examples):
        input_ids[row, : len(ids)] = torch.as_tensor(ids)
        labels[row, : len(labs)] = torch.as_tensor(labs)
        mask[row, : len(ids)] = 1
    return input_ids, labels, mask


class LevelLoss:
    """Cross-entropy of item tokens, each over its own level's tokens only.

    Each trained position's logits are computed for its level's codes alone (one
    matmul per level), not for every item token and then masked: the loss is the
    same, and the output layer and softmax cost 1/depth as much, which is most of a
    small target's step.
    """

    def __init__(
        self, item_tokens: ItemTokens, device: torch.device, label_smoothing: float = 0.0
    ) -> None:
        layout = item_tokens.layout
        self.layout = layout
        self.label_smoothing = label_smoothing
        self.level_of = level_masks(layout, device).float().argmax(0)  # item token -> level
        self.level_tokens = [layout.level_range(level) for level in range(layout.depth)]

    def __call__(self, model, input_ids, labels, mask, smoothing: bool = True) -> torch.Tensor:
        outputs = model.model(input_ids=input_ids, attention_mask=mask, use_cache=False)
        trained = labels != IGNORE_INDEX
        hidden, tokens = outputs.last_hidden_state[trained], labels[trained]
        level_of = self.level_of[tokens - self.layout.item_token_start]
        share = self.label_smoothing if smoothing else 0.0
        bias = getattr(model.lm_head, "bias", None)
        total = hidden.new_zeros((), dtype=torch.float32)
        for level, vocab in enumerate(self.level_tokens):
            rows = level_of == level
            weight = model.lm_head.weight[vocab.start : vocab.stop]
            level_bias = None if bias is None else bias[vocab.start : vocab.stop]
            log_probs = F.linear(hidden[rows], weight, level_bias).float().log_softmax(-1)
            nll = -log_probs.gather(1, (tokens[rows] - vocab.start)[:, None]).squeeze(1)
            # Smoothing spreads its mass uniformly over this level's codes.
            total = total + ((1 - share) * nll - share * log_probs.mean(-1)).sum()
        return total / max(len(tokens), 1)


def add_embedding_dropout(model, p: float):
    """Dropout on the token embeddings during training (a hook, so checkpoints stay plain)."""

    def hook(module, _inputs, output):
        return F.dropout(output, p, training=module.training)

    return model.model.embed_tokens.register_forward_hook(hook)


# --- evaluation -------------------------------------------------------------------


def evaluate_cases(
    model,
    item_tokens: ItemTokens,
    tree: ItemTrie,
    cases: Sequence[Case],
    history_items: int,
    k: int = 10,
    beam_width: int = 20,
    batch_size: int = 64,
) -> dict[str, float]:
    """HR@k and NDCG@k of constrained beam search, history items excluded."""
    model.eval()
    prompts = [history_prompt(case.history, item_tokens, history_items) for case in cases]
    index = item_tokens.index
    exclude = [[index[i] for i in set(case.history) if i in index] for case in cases]
    result = decode_batched(model, tree, prompts, max(k, beam_width), exclude, batch_size)
    hits, gains = 0.0, 0.0
    for case, row in zip(cases, result.item_index.tolist(), strict=True):
        ranked = [item_tokens.item_ids[i] for i in row if i >= 0][:k]
        if case.target in ranked:
            hits += 1
            gains += 1.0 / math.log2(ranked.index(case.target) + 2)
    n = max(len(cases), 1)
    return {f"hr@{k}": hits / n, f"ndcg@{k}": gains / n}


@torch.no_grad()
def validation_loss(model, loss_fn: LevelLoss, cases, item_tokens, history_items, device) -> float:
    """Mean CE of the validation targets' tokens given their histories."""
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(cases), 64):
        examples = []
        for case in cases[start : start + 64]:
            history = item_tokens.known(case.history)[-history_items:]
            ids, labels = training_example([*history, case.target], item_tokens)
            depth = item_tokens.layout.depth
            labels = [IGNORE_INDEX] * (len(labels) - depth) + labels[-depth:]
            examples.append((ids, labels))
        ids, labels, mask = collate(examples, item_tokens.layout.pad_token_id)
        loss = loss_fn(model, ids.to(device), labels.to(device), mask.to(device), smoothing=False)
        count += len(examples)
        total += float(loss) * len(examples)
    return total / max(count, 1)


class WeightAverage:
    """Exponential moving average of a model's parameters, updated after every step.

    Why: one fit of the ``small`` target moves validation HR@10 by about +-0.007
    with the seed alone; the average of the last few hundred steps' weights is a
    flatter, steadier point than the last step's (see docs/evaluation.md for the
    three-seed comparison that shipped it).
    """

    def __init__(self, model, decay: float) -> None:
        self.decay = decay
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.shadow = [p.detach().clone() for p in self.params]

    @torch.no_grad()
    def update(self) -> None:
        for average, param in zip(self.shadow, self.params, strict=True):
            average.lerp_(param.detach(), 1.0 - self.decay)

    @torch.no_grad()
    def copy_to_model(self) -> None:
        for average, param in zip(self.shadow, self.params, strict=True):
            param.copy_(average)

    @contextlib.contextmanager
    def applied(self):
        """The averaged weights in the model inside the block, the training ones after it."""
        current = [p.detach().clone() for p in self.params]
        self.copy_to_model()
        try:
            yield
        finally:
            with torch.no_grad():
                for saved, param in zip(current, self.params, strict=True):
                    param.copy_(saved)


# --- training ---------------------------------------------------------------------


def training_sequences(split: Split, item_tokens: ItemTokens, with_valid: bool) -> list[list[str]]:
    """Each user's training items; ``with_valid`` appends the validation item (final fit).

    The test item is never included: with it, a user's sequence is exactly the
    history of their test case.
    """
    return [item_tokens.known(items) for items in _training_items(split, with_valid).values()]


def tie_groups(split: Split, item_tokens: ItemTokens, with_valid: bool) -> list[np.ndarray] | None:
    """For each of ``training_sequences``' sequences, a group number per item: consecutive
    items with the same event time share one. ``None`` when the split has no times."""
    if not split.times:
        return None
    groups = []
    for user, items in _training_items(split, with_valid).items():
        # split.times covers the user's whole sequence (zip stops at this prefix of it);
        # the filter keeps the items ItemTokens.known keeps, so groups align with them.
        times = [t for item, t in zip(items, split.times[user], strict=False)
                 if item in item_tokens.index]  # fmt: skip
        groups.append(np.cumsum(np.diff(np.asarray(times, dtype=np.int64), prepend=0) != 0))
    return groups


def _training_items(split: Split, with_valid: bool) -> dict[str, list[str]]:
    """Each user's items a target trains on: before the test item, or before validation."""
    return split.before_test() if with_valid else split.train


def train_target(
    item_tokens: ItemTokens,
    split: Split,
    preset: ModelPreset,
    history_items: int = 50,
    model=None,
    seed: int = 0,
    progress: bool = True,
    valid_limit: int | None = None,
    beam_width: int = 20,
    shard: DataShard = SINGLE,
    item_vector_fit_max_items: int | None = None,
) -> TrainResult:
    """Train a target on ``split.train`` with early stopping on ``split.valid`` HR@10.

    With ``preset.fit_on_valid`` it trains on train + validation items for the
    whole schedule instead, never evaluates and keeps the last weights. With
    ``preset.ema_decay`` the weights validated and kept are the moving average.
    ``shard``: this worker's share of a data-parallel run (every worker returns the same model).
    ``item_vector_fit_max_items``: ``fit_item_vectors``' landmark bound (``train`` settings).
    """
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    device = pick_device()
    model = (model or build_target(preset, item_tokens.layout)).to(device)
    sequences = training_sequences(split, item_tokens, preset.fit_on_valid)
    ties = tie_groups(split, item_tokens, preset.fit_on_valid) if preset.shuffle_ties else None
    tree = ItemTrie.from_item_tokens(item_tokens, device)
    if preset.item_vector_dim > 0 and item_vector_embedding(model) is None:
        vectors = fit_item_vectors(
            sequences, item_tokens, preset.item_vector_dim,
            fit_max_items=item_vector_fit_max_items,
        )  # fmt: skip
        attach_item_vectors(model, tree, vectors)
    valid = [c for c in split.valid.values() if c.target in item_tokens]
    valid = valid[: valid_limit or preset.eval_users]
    loss_fn = LevelLoss(item_tokens, device, preset.label_smoothing)
    steps_per_epoch = math.ceil(
        len(epoch_windows(sequences, history_items, rng)) / preset.batch_size
    )
    total_steps = preset.max_steps or steps_per_epoch * preset.epochs
    average = WeightAverage(model, preset.ema_decay) if preset.ema_decay > 0 else None
    run = _Run(*make_optimizer(model, preset.lr, preset.weight_decay, total_steps), total_steps,
               preset.time_budget_s, average, shard)  # fmt: skip
    hook = add_embedding_dropout(model, preset.dropout) if preset.dropout > 0 else None
    batch_loss = step_loss(model, loss_fn, shard)
    curves: dict[str, list[float]] = {"train_loss": [], "valid_loss": [], "valid_hr@10": []}
    best = {"hr": -1.0, "state": None, "epoch": 0}
    stale = 0
    bar = progress_bar(total=total_steps, desc=f"target {preset.name}", disable=not progress)
    for epoch in range(1, preset.epochs + 1):
        batches = epoch_batches(sequences, preset, history_items, rng, ties)
        epoch_losses = _train_epoch(model, batch_loss, run, batches, item_tokens, bar, epoch)
        curves["train_loss"].append(float(np.mean(epoch_losses)))
        last_epoch = run.finished() or epoch == preset.epochs
        if preset.fit_on_valid or (epoch % preset.eval_every and not last_epoch):
            if last_epoch:
                break
            continue
        # The averaged weights are the ones kept, so they are the ones validated.
        with average.applied() if average else contextlib.nullcontext():
            valid_loss, hr = _validate(model, loss_fn, tree, valid, item_tokens, history_items,
                                       beam_width, shard)  # fmt: skip
            curves["valid_loss"].append(valid_loss)
            improved = hr > best["hr"]
            if improved:
                best = {"hr": hr, "state": copy.deepcopy(model.state_dict()), "epoch": epoch}
        curves["valid_hr@10"].append(hr)
        bar.write(f"epoch {epoch}: train {curves['train_loss'][-1]:.4f} "
                  f"valid loss {curves['valid_loss'][-1]:.4f} HR@10 {hr:.4f}")  # fmt: skip
        stale = 0 if improved else stale + 1
        if stale >= preset.patience or last_epoch:
            break
    bar.close()
    if hook is not None:
        hook.remove()
    if preset.fit_on_valid:
        if average is not None:
            average.copy_to_model()
        metrics = {"fit": "train+valid", "steps": run.step, "epochs_run": epoch}
    else:
        model.load_state_dict(best["state"])
        metrics = {"valid_hr@10": best["hr"], "best_epoch": best["epoch"], "steps": run.step,
                   "epochs_run": epoch}  # fmt: skip
    model.eval()
    return TrainResult(model, curves, metrics, time.perf_counter() - run.started)


def _validate(model, loss_fn, tree, valid, item_tokens, history_items, beam_width,
              shard: DataShard) -> tuple[float, float]:  # fmt: skip
    """Validation loss and HR@10, each worker on its share of the cases, summed over all."""
    model.eval()
    mine = shard.take(valid)
    loss, hr = 0.0, 0.0
    if mine:  # fewer cases than workers leaves some with none
        device = next(model.parameters()).device
        loss = validation_loss(model, loss_fn, mine, item_tokens, history_items, device)
        hr = evaluate_cases(model, item_tokens, tree, mine, history_items,
                            beam_width=beam_width)["hr@10"]  # fmt: skip
    if not shard.parallel:
        return loss, hr
    loss_sum, hr_sum, count = shard.sum([loss * len(mine), hr * len(mine), len(mine)])
    return loss_sum / max(count, 1), hr_sum / max(count, 1)


@dataclass
class _Run:
    """Optimizer, learning-rate schedule and the step/time limits of one training run."""

    optimizer: Any
    schedule: Any
    total_steps: int
    budget_s: float | None
    average: WeightAverage | None = None  # updated after every step when the preset asks
    shard: DataShard = SINGLE
    step: int = 0
    started: float = field(default_factory=time.perf_counter)
    elapsed: float = 0.0  # seconds at the last step: the slowest worker's in a parallel run

    def finished(self) -> bool:
        return self.step >= self.total_steps or _over_budget(self.elapsed, self.budget_s)

    def stepped(self) -> None:
        """Count a step; set the learning rate for the progress made."""
        self.step += 1
        self.elapsed = time.perf_counter() - self.started
        if self.budget_s is not None:  # workers that disagreed on the time would diverge
            self.elapsed = self.shard.max(self.elapsed)
        self.schedule(_progress(self.step, self.total_steps, self.elapsed, self.budget_s))


def _trained_tokens(example: tuple[list[int], list[int]]) -> int:
    return sum(label != IGNORE_INDEX for label in example[1])


def _train_epoch(
    model, batch_loss, run: _Run, batches, item_tokens, bar, epoch: int
) -> list[float]:
    """One pass over ``batches`` of windows (stops early when the run is finished).

    Returns each step's loss on its whole batch (summed over the workers of a parallel run).
    """
    model.train()
    device = next(model.parameters()).device
    losses = []
    for windows in batches:
        examples = [training_example(window, item_tokens) for window in windows]
        mine, weight = run.shard.take_weighted(examples, _trained_tokens)
        ids, labels, mask = (t.to(device) for t in collate(mine, item_tokens.layout.pad_token_id))
        loss = batch_loss(ids, labels, mask)
        if run.shard.parallel:
            loss = loss * weight
        run.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        run.optimizer.step()
        if run.average is not None:
            run.average.update()
        run.stepped()
        losses.append(loss.item() / run.shard.world)
        bar.update(1)
        bar.set_postfix(epoch=epoch, loss=f"{np.mean(losses[-50:]) * run.shard.world:.3f}")
        if run.finished():
            break
    return run.shard.sum(losses) if run.shard.parallel else losses


def _progress(step: int, total_steps: int, elapsed: float, budget_s: float | None) -> float:
    fraction = step / max(total_steps, 1)
    if budget_s:
        fraction = max(fraction, elapsed / budget_s)
    return min(fraction, 1.0)


def _over_budget(elapsed: float, budget_s: float | None) -> bool:
    return budget_s is not None and elapsed > budget_s


def make_optimizer(model, lr: float, weight_decay: float, total_steps: int):
    """AdamW (no decay on norms and biases) and ``set_progress(fraction)``: warmup, cosine to 10%.

    Progress is a fraction of the schedule, so a time budget can drive it as well as steps.
    """
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}],
        lr=lr, betas=(0.9, 0.98),
    )  # fmt: skip
    warmup = min(0.05, 100 / max(total_steps, 1))

    def set_progress(fraction: float) -> None:
        if fraction < warmup:
            factor = (fraction + 1e-3) / (warmup + 1e-3)
        else:
            done = min(1.0, (fraction - warmup) / max(1e-9, 1 - warmup))
            factor = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * done))
        for group in optimizer.param_groups:
            group["lr"] = lr * factor

    set_progress(0.0)
    return optimizer, set_progress


def plot_curves(curves: Mapping[str, Sequence[float]], path: Path, title: str) -> Path:
    """Loss (and validation HR) curves as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [name for name, values in curves.items() if values]
    fig, axes = plt.subplots(1, len(names), figsize=(4.5 * len(names), 3.5), squeeze=False)
    for axis, name in zip(axes[0], names, strict=True):
        values = curves[name]
        axis.plot(range(1, len(values) + 1), values, marker="o" if len(values) < 40 else None)
        axis.set_title(name)
        axis.set_xlabel("evaluation" if name.startswith("valid") else "epoch")
        axis.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
