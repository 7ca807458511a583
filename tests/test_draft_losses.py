"""AtSpeed alignment losses and teacher data of the draft models."""

from __future__ import annotations

import copy

import numpy as np
import torch

from genrec.offline.training.draft import (
    align_draft,
    atspeed_r_loss,
    atspeed_s_loss,
    beam_logits,
    make_teacher_data,
)
from genrec.online.decoding.trie import ItemTrie
from genrec.online.models.generative import decode_batched
from genrec.online.models.presets import PRESETS, build_draft, build_target
from genrec.online.prompts import history_prompt
from tests.helpers import random_items


def _log_probs(shape, seed, invalid_last=2):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(shape, generator=generator)
    logits[..., -invalid_last:] = float("-inf")  # invalid children
    return torch.log_softmax(logits, dim=-1)


def test_atspeed_s_is_finite_and_kl_vanishes_when_aligned():
    target = _log_probs((3, 4, 2, 12), 0)
    draft = target.clone().requires_grad_(True)
    loss = atspeed_s_loss(draft, target, k=5)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(draft.grad).all()
    # Equal distributions: only the density regularizer (boundary mass x entropy) remains.
    top = target.topk(5, dim=-1)
    q = torch.log_softmax(top.values, -1)
    entropy = -(q.exp() * q).sum(-1)
    boundary = target.gather(-1, top.indices[..., -1:]).squeeze(-1).exp()
    assert torch.allclose(loss, (boundary * entropy).mean(), atol=1e-5)
    other = _log_probs((3, 4, 2, 12), 1)
    assert atspeed_s_loss(other, target, k=5) > loss


def test_atspeed_r_zero_iff_aligned():
    target = _log_probs((2, 3, 2, 10), 0)
    codes = target.argmax(-1)
    assert atspeed_r_loss(target, target, codes).item() < 1e-6
    draft = _log_probs((2, 3, 2, 10), 5).requires_grad_(True)
    loss = atspeed_r_loss(draft, target, codes)
    loss.backward()
    assert loss > 0 and torch.isfinite(draft.grad).all()


def test_beam_logits_match_plain_forward():
    torch.manual_seed(0)
    items = random_items(25)
    model = build_target(PRESETS["tiny"], items.layout).eval()
    prompts = [history_prompt(["i1", "i2", "i3"], items, 50), history_prompt(["i4"], items, 50)]
    suffixes = torch.as_tensor(items.table[[[0, 5], [7, 9]]])
    with torch.no_grad():
        logits = beam_logits(model, items.layout, prompts, suffixes)
        for b, prompt in enumerate(prompts):
            for r in range(2):
                ids = torch.as_tensor([prompt + suffixes[b, r].tolist()])
                plain = model(ids).logits[0, len(prompt) - 1 : len(prompt) + 2]
                plain = plain[:, items.layout.item_token_start :]
                assert torch.allclose(logits[b, r], plain, atol=1e-4)


def test_aligned_draft_agrees_more_with_target_than_before():
    torch.manual_seed(0)
    items = random_items(60, (8, 8, 4))
    tree = ItemTrie.from_item_tokens(items)
    preset = PRESETS["tiny"].with_overrides(draft_epochs=15, draft_lr=1e-2)
    target = build_target(preset, items.layout).eval()
    draft = build_draft(preset, items.layout).eval()
    rng = np.random.default_rng(0)
    prompts = [
        history_prompt([f"i{k}" for k in rng.integers(0, 60, 3)], items, 50) for _ in range(48)
    ]
    teacher = make_teacher_data(target, items, tree, prompts, ["i0"] * 48, k=5, progress=False)
    assert teacher.beams.shape == (48, 5, 3) and teacher.target_log_probs.shape == (48, 5, 3, 8)

    def overlap(model) -> float:
        mine = decode_batched(model, tree, prompts, 5).item_index
        theirs = decode_batched(target, tree, prompts, 5).item_index
        return np.mean(
            [len(set(a) & set(b)) / 5 for a, b in zip(mine.tolist(), theirs.tolist(), strict=False)]
        )

    before = overlap(draft)
    for variant in ("atspeed_s", "atspeed_r"):
        aligned = align_draft(copy.deepcopy(draft), teacher, variant, tree, preset, 0.9,
                              progress=False).model  # fmt: skip
        assert overlap(aligned) > before
