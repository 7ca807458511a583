"""The smollm2-135m preset: GGUF -> cached safetensors, item tokens, one training step, reload."""

from __future__ import annotations

import pytest
import torch

from genrec.offline.training.target import LevelLoss, collate
from genrec.online.models.presets import item_logits
from genrec.online.prompts import ItemTokens, training_example

pytestmark = pytest.mark.slow


def test_smollm2_loads_trains_one_step_and_reloads(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from genrec.online.models.smollm2 import load_pretrained_with_items, pretrained_item_layout

    layout = pretrained_item_layout((8, 8, 4))
    assert layout.base_vocab_size == 49152 and layout.bos_token_id != layout.eos_token_id
    model, tokenizer = load_pretrained_with_items(layout)
    assert model.get_input_embeddings().weight.shape[0] == layout.vocab_size
    assert tokenizer.convert_tokens_to_ids(["<a_0>", "<c_3>"]) == [
        layout.item_token_start,
        layout.item_token_end - 1,
    ]
    codes = [[i // 4, i % 4, i % 2] for i in range(12)]
    items = ItemTokens([str(i) for i in range(12)], codes, layout)
    batch = collate([training_example(["0", "1", "2"], items), training_example(["3", "4"], items)],
                    layout.pad_token_id)  # fmt: skip
    loss_fn = LevelLoss(items, torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    before = loss_fn(model, *batch)
    before.backward()
    optimizer.step()
    assert torch.isfinite(before)

    model.eval()
    model.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "target", dtype=torch.float32).eval()
    assert len(AutoTokenizer.from_pretrained(tmp_path / "target")) == layout.vocab_size
    ids = batch[0][:1]
    with torch.no_grad():
        expected, _ = item_logits(model, layout, ids)
        actual, _ = item_logits(reloaded, layout, ids)
    assert torch.allclose(expected, actual, atol=1e-4)
