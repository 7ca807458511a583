"""The decoding runtime (online/models/runtime.py): number format and torch.compile."""

from __future__ import annotations

import copy

import pytest
import torch

from genrec.app.bench.decode import bench_models, prefix_batches
from genrec.online.decoding.engine import batched_beam_search
from genrec.online.models.runtime import apply_runtime, decode_dtype, prepare_model


@pytest.fixture(scope="module")
def small():
    models = bench_models("small", n_users=16)
    ((target_batch, _),) = prefix_batches(models, models.eval_users, [range(16)])
    reference = batched_beam_search(models.target, target_batch, models.trie, models.layout, 10)
    return models, target_batch, reference.item_index


def test_dtype_names_and_auto() -> None:
    assert decode_dtype("float32", "cpu") is torch.float32
    assert decode_dtype("bfloat16", "cpu") is torch.bfloat16
    assert decode_dtype("auto", "cpu") is torch.float32  # bf16 only where a GPU has it
    with pytest.raises(ValueError, match="decode dtype"):
        decode_dtype("int8", "cpu")
    with pytest.raises(ValueError, match="decode compile"):
        prepare_model(torch.nn.Linear(2, 2), torch.float32, "fast")


def test_bfloat16_keeps_the_float32_top_k_from_float32_prefix_kv(small) -> None:
    models, target_batch, reference = small
    target = prepare_model(copy.deepcopy(models.target), torch.bfloat16)
    assert next(target.parameters()).dtype is torch.bfloat16
    # the cached prefixes were computed in float32 (as offline): cast into the batch's slots
    items = batched_beam_search(target, target_batch, models.trie, models.layout, 10).item_index
    assert items.shape == reference.shape and bool((items >= 0).all())
    assert all(len(set(row.tolist())) == 10 for row in items)
    overlap = (
        sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(reference, items, strict=True))
        / reference.numel()
    )
    assert overlap >= 0.9, overlap  # 0.99 measured: near-ties reorder, nothing breaks


def test_a_compiled_decoder_gives_the_same_items(small) -> None:
    models, target_batch, reference = small
    target = copy.deepcopy(models.target)
    # "eager": dynamo traces the decoder as inductor would, without generating code
    prepare_model(target, torch.float32, "default", backend="eager")
    prepare_model(target, torch.float32, "default", backend="eager")  # once only
    assert getattr(target.get_decoder().forward, "_genrec_compiled", False)
    items = batched_beam_search(target, target_batch, models.trie, models.layout, 10).item_index
    assert torch.equal(items, reference)


def test_apply_runtime_covers_target_and_each_draft_once(small) -> None:
    models = copy.deepcopy(small[0])
    models.relaxed_draft = models.draft
    applied = apply_runtime(models, "bfloat16", "off")
    assert applied == {
        "dtype": "bfloat16", "compile": "off", "device": "cpu", "lean_forward": "on"
    }  # fmt: skip
    assert {next(m.parameters()).dtype for m in (models.target, models.draft)} == {torch.bfloat16}
