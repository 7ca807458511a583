"""Target training pieces: the final fit on train + validation items, label smoothing."""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import pytest
import torch

from genrec.offline.splits import leave_one_out
from genrec.offline.training.target import (
    LevelLoss,
    WeightAverage,
    collate,
    reverse_some,
    shuffle_ties,
    tie_groups,
    train_target,
    training_sequences,
)
from genrec.online.models.presets import PRESETS, build_target, item_logits, level_masks
from genrec.online.prompts import IGNORE_INDEX, ItemTokens, training_example
from genrec.schemas.token_layout import TokenLayout


def toy_items(n: int = 30, codes_per_level=(6, 5, 4)) -> ItemTokens:
    rng = np.random.default_rng(0)
    chosen = rng.choice(int(np.prod(codes_per_level)), size=n, replace=False)
    codes = np.stack(np.unravel_index(chosen, codes_per_level), axis=1)
    layout = TokenLayout.for_scratch_model(codes_per_level)
    return ItemTokens([f"i{k}" for k in range(n)], codes, layout)


def toy_split(users: int = 12, length: int = 8):
    rng = np.random.default_rng(1)
    sequences = {f"u{u}": [f"i{k}" for k in rng.choice(30, size=length, replace=False)]
                 for u in range(users)}  # fmt: skip
    sequences["short"] = ["i0", "i1"]  # < 3 events: training only
    return leave_one_out(sequences)


def test_training_sequences_add_the_validation_item_never_the_test_item():
    items, split = toy_items(), toy_split()
    plain = training_sequences(split, items, with_valid=False)
    final = training_sequences(split, items, with_valid=True)
    for user, train, with_valid in zip(split.train, plain, final, strict=True):
        assert train == split.train[user]
        if user in split.valid:
            assert with_valid == [*split.train[user], split.valid[user].target]
            assert with_valid == split.test[user].history  # the test item stays out
        else:
            assert with_valid == train


def reference_level_loss(model, items, ids, labels, mask, smoothing: float) -> torch.Tensor:
    """The loss the slow way: logits over every item token, other levels masked to -inf."""
    layout = items.layout
    logits, _ = item_logits(model, layout, ids, mask)
    trained = labels != IGNORE_INDEX
    targets = labels[trained] - layout.item_token_start
    masks = level_masks(layout)
    in_level = masks[masks.float().argmax(0)[targets]]
    log_probs = logits[trained].masked_fill(~in_level, float("-inf")).log_softmax(-1)
    nll = -log_probs.gather(1, targets[:, None]).squeeze(1)
    uniform = -log_probs.masked_fill(~in_level, 0.0).sum(-1) / in_level.sum(-1)
    return ((1 - smoothing) * nll + smoothing * uniform).mean()


def test_level_loss_equals_masked_full_logits_and_smoothing_stays_within_the_level():
    items = toy_items()
    torch.manual_seed(0)
    model = build_target(PRESETS["tiny"], items.layout)
    ids, labels, mask = collate(
        [training_example(["i1", "i2", "i3"], items), training_example(["i4", "i5"], items)], 0
    )
    plain = LevelLoss(items, torch.device("cpu"))(model, ids, labels, mask)
    assert torch.allclose(plain, reference_level_loss(model, items, ids, labels, mask, 0.0))
    smoothed_fn = LevelLoss(items, torch.device("cpu"), label_smoothing=0.1)
    smoothed = smoothed_fn(model, ids, labels, mask)
    assert torch.allclose(smoothed, reference_level_loss(model, items, ids, labels, mask, 0.1))
    assert not torch.allclose(smoothed, plain)
    smoothed.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    assert torch.allclose(smoothed_fn(model, ids, labels, mask, smoothing=False), plain)


def test_final_fit_trains_without_validation_and_keeps_last_weights():
    items, split = toy_items(), toy_split()
    preset = dataclasses.replace(PRESETS["tiny"], epochs=2, fit_on_valid=True)
    result = train_target(items, split, preset, history_items=5, progress=False)
    assert result.metrics["fit"] == "train+valid" and "valid_hr@10" not in result.metrics
    assert result.metrics["epochs_run"] == 2 and result.curves["valid_hr@10"] == []
    assert len(result.curves["train_loss"]) == 2
    assert not result.model.training


def test_reverse_some_flips_about_its_share_and_keeps_every_item():
    windows = [[f"i{k}", f"i{k + 1}", f"i{k + 2}"] for k in range(400)]
    rng = np.random.default_rng(0)
    assert reverse_some(windows, 0.0, rng) == windows
    assert reverse_some(windows, 1.0, rng) == [w[::-1] for w in windows]
    half = reverse_some(windows, 0.5, rng)
    flipped = sum(h == w[::-1] for h, w in zip(half, windows, strict=True))
    assert 150 < flipped < 250
    assert all(sorted(h) == sorted(w) for h, w in zip(half, windows, strict=True))


def test_the_sft_draft_trains_in_time_order(monkeypatch):
    from genrec.offline.training import draft as train_draft

    seen = {}
    real = train_draft.train_target

    def spy(item_tokens, split, schedule, *args, **kwargs):
        seen["reverse_windows"] = schedule.reverse_windows
        seen["shuffle_ties"] = schedule.shuffle_ties
        seen["ema_decay"] = schedule.ema_decay
        seen["item_vector_dim"] = schedule.item_vector_dim
        return real(item_tokens, split, schedule, *args, **kwargs)

    monkeypatch.setattr(train_draft, "train_target", spy)
    items, split = toy_items(), toy_split()
    preset = dataclasses.replace(
        PRESETS["tiny"], reverse_windows=0.5, shuffle_ties=True, draft_epochs=1, ema_decay=0.9
    )
    train_draft.train_sft_draft(items, split, preset, history_items=5, progress=False)
    # the draft's own recipe (stored time order, no average), with the target's kind of input
    assert seen == {"reverse_windows": 0.0, "shuffle_ties": False, "ema_decay": 0.0,
                    "item_vector_dim": 8}  # fmt: skip


def test_item_vectors_are_fitted_on_the_training_sequences_only(monkeypatch):
    from genrec.offline.training import target as module
    from genrec.online.models.item_vectors import item_vector_embedding

    fitted = []
    real = module.fit_item_vectors

    def spy(sequences, item_tokens, dim, *args, **kwargs):
        fitted.append([list(s) for s in sequences])
        return real(sequences, item_tokens, dim, *args, **kwargs)

    monkeypatch.setattr(module, "fit_item_vectors", spy)
    items, split = toy_items(), toy_split()
    for final_fit in (False, True):
        preset = dataclasses.replace(PRESETS["tiny"], epochs=1, fit_on_valid=final_fit)
        model = train_target(items, split, preset, history_items=5, progress=False).model
        embedding = item_vector_embedding(model)
        assert embedding is not None and embedding.vectors.shape == (len(items), 8)
        assert fitted[-1] == training_sequences(split, items, with_valid=final_fit)
    plain = dataclasses.replace(PRESETS["tiny"], epochs=1, item_vector_dim=0)
    model = train_target(items, split, plain, history_items=5, progress=False).model
    assert item_vector_embedding(model) is None and len(fitted) == 2


def test_weight_average_follows_the_steps_and_swaps_back():
    layer = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        layer.weight.fill_(1.0)
    average = WeightAverage(layer, decay=0.5)
    for value in (3.0, 5.0):
        with torch.no_grad():
            layer.weight.fill_(value)
        average.update()
    # 1 -> 0.5 * 1 + 0.5 * 3 = 2 -> 0.5 * 2 + 0.5 * 5 = 3.5
    with average.applied():
        assert torch.allclose(layer.weight, torch.full((1, 2), 3.5))
    assert torch.allclose(layer.weight, torch.full((1, 2), 5.0))  # training weights back
    average.copy_to_model()
    assert torch.allclose(layer.weight, torch.full((1, 2), 3.5))


def test_the_averaged_weights_are_validated_and_kept(monkeypatch):
    import genrec.offline.training.target as train_module

    items, split = toy_items(), toy_split()
    seen = {}

    class Spy(WeightAverage):
        @contextlib.contextmanager
        def applied(self):
            with super().applied():
                seen["validated"] = [p.detach().clone() for p in self.params]
                yield

        def copy_to_model(self):
            super().copy_to_model()
            seen["copied"] = [p.detach().clone() for p in self.params]

    monkeypatch.setattr(train_module, "WeightAverage", Spy)
    preset = dataclasses.replace(PRESETS["tiny"], epochs=2, eval_every=2, ema_decay=0.9)
    result = train_target(items, split, preset, history_items=5, progress=False)
    # Early stopping: the state kept is the averaged one that was validated.
    for param, validated in zip(result.model.parameters(), seen["validated"], strict=True):
        assert torch.equal(param.detach(), validated)
    final = train_target(items, split, dataclasses.replace(preset, fit_on_valid=True),
                         history_items=5, progress=False)  # fmt: skip
    # Final fit: the last average is the model returned.
    for param, copied in zip(final.model.parameters(), seen["copied"], strict=True):
        assert torch.equal(param.detach(), copied)


def test_shuffle_ties_permutes_only_within_same_time_groups():
    items = toy_items()
    sequence = [f"i{k}" for k in range(8)]
    times = [10, 10, 10, 20, 30, 30, 40, 40]
    split = leave_one_out({"u": sequence}, {"u": times})
    assert split.times == {"u": times}
    groups = tie_groups(split, items, with_valid=True)  # the 7 items before the test item
    assert [g.tolist() for g in groups] == [[1, 1, 1, 2, 3, 3, 4]]
    rng = np.random.default_rng(0)
    seen = set()
    for _ in range(50):
        (shuffled,) = shuffle_ties([sequence[:7]], groups, rng)
        assert sorted(shuffled[:3]) == ["i0", "i1", "i2"] and shuffled[3] == "i3"
        assert sorted(shuffled[4:6]) == ["i4", "i5"] and shuffled[6] == "i6"
        seen.add(tuple(shuffled))
    assert len(seen) == 3 * 2 * 1 * 2  # every order within the groups turns up
    assert tie_groups(leave_one_out({"u": sequence}), items, with_valid=True) is None


def test_leave_one_out_rejects_misaligned_times():
    with pytest.raises(ValueError, match="one time per item"):
        leave_one_out({"u": ["i1", "i2", "i3"]}, {"u": [1, 2]})
    with pytest.raises(ValueError, match="one time per item"):
        leave_one_out({"u": ["i1", "i2", "i3"]}, {"v": [1, 2, 3]})


def test_training_with_tie_shuffling_runs():
    items = toy_items()
    rng = np.random.default_rng(1)
    sequences = {f"u{u}": [f"i{k}" for k in rng.choice(30, size=8, replace=False)]
                 for u in range(6)}  # fmt: skip
    times = {user: [k // 2 for k in range(8)] for user in sequences}
    split = leave_one_out(sequences, times)
    preset = dataclasses.replace(PRESETS["tiny"], epochs=1, shuffle_ties=True)
    result = train_target(items, split, preset, history_items=5, progress=False)
    assert result.metrics["epochs_run"] == 1
