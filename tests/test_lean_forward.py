"""The lean Llama stack (online/decoding/lean_forward.py) equals transformers' call over the
slot KV: hidden states and the keys/values it writes, for random masks, several query
widths and cursor positions, GQA, item-vector inputs and the presets' shapes; models it
does not implement run through transformers."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from genrec.online.decoding.lean_forward import LeanLlama, lean_decoder, set_lean_forward
from genrec.online.decoding.slot_cache import SlotKV, SlotModel
from genrec.online.decoding.trie import ItemTrie
from genrec.online.models.item_vectors import attach_item_vectors
from genrec.online.models.presets import PRESETS, build_draft, build_target
from genrec.online.models.runtime import prepare_model
from genrec.schemas.token_layout import TokenLayout

LAYOUT = TokenLayout.for_scratch_model((8, 8, 4))


def llama(heads: int = 4, kv_heads: int = 2, layers: int = 2, hidden: int = 32, **extra):
    config = LlamaConfig(
        vocab_size=LAYOUT.vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=512, initializer_range=0.2, tie_word_embeddings=False, **extra,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def random_call(base, q: int, start: int, n: int = 3, seed: int = 0):
    """ids, positions, an additive random mask (each token sees itself) and slot tensors."""
    generator = torch.Generator().manual_seed(seed)
    config, dtype = base.config, base.norm.weight.dtype
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    shape = (n, config.num_key_value_heads, start + q + 5, head_dim)
    slots = [torch.randn(shape, generator=generator).to(dtype)
             for _ in range(2 * config.num_hidden_layers)]  # fmt: skip
    ids = torch.randint(0, config.vocab_size, (n, q), generator=generator)
    positions = torch.randint(0, 300, (n, q), generator=generator)
    visible = torch.rand(n, q, start + q, generator=generator) < 0.5
    visible[:, :, start:] |= torch.eye(q, dtype=torch.bool)
    mask = torch.where(visible, 0.0, torch.finfo(dtype).min).to(dtype)
    return ids, positions, mask, slots


def both(base, q: int, start: int, embeds: bool = False, seed: int = 0):
    """(transformers' hidden states, slots) and (the lean stack's), from the same inputs."""
    ids, positions, mask, slots = random_call(base, q, start, seed=seed)
    layers = base.config.num_hidden_layers
    theirs = [s.clone() for s in slots]
    inputs = {"inputs_embeds": base.embed_tokens(ids)} if embeds else {"input_ids": ids}
    cache = SlotKV(base.config, theirs[:layers], theirs[layers:])
    cache.start = start
    with torch.no_grad():
        reference = base(**inputs, position_ids=positions, attention_mask=mask[:, None],
                         use_cache=True, past_key_values=cache).last_hidden_state  # fmt: skip
        lean = LeanLlama(base)(inputs.get("input_ids"), inputs.get("inputs_embeds"), positions,
                               mask, slots[:layers], slots[layers:], start)  # fmt: skip
    return (reference, theirs), (lean, slots)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("q,start", [(1, 0), (1, 9), (5, 0), (6, 11), (20, 3)])
def test_lean_equals_transformers(heads, kv_heads, q, start):
    base = llama(heads, kv_heads).model
    (reference, theirs), (lean, ours) = both(base, q, start, seed=q + start)
    torch.testing.assert_close(lean, reference, rtol=0, atol=1e-5)
    for mine, other in zip(ours, theirs, strict=True):
        torch.testing.assert_close(mine, other, rtol=0, atol=1e-5)


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_lean_equals_transformers_on_presets(preset):
    for model in (build_target(PRESETS[preset], LAYOUT), build_draft(PRESETS[preset], LAYOUT)):
        base = model.eval().get_decoder()
        assert lean_decoder(base) is not None
        for q, start in [(1, 4), (7, 13)]:
            (reference, _), (lean, _) = both(base, q, start, embeds=(q == 7))
            torch.testing.assert_close(lean, reference, rtol=0, atol=1e-5)


def test_lean_in_bfloat16_and_llama3_rope():
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}  # fmt: skip
    base = llama(rope_parameters=rope).model
    assert lean_decoder(base) is not None
    (reference, _), (lean, _) = both(base, 4, 6)
    torch.testing.assert_close(lean, reference, rtol=0, atol=1e-5)
    base = llama().to(torch.bfloat16).model
    (reference, _), (lean, _) = both(base, 4, 6)
    torch.testing.assert_close(lean, reference, rtol=0, atol=0)


@pytest.mark.parametrize("long_user", [False, True])
def test_slot_model_equal_with_and_without_lean(long_user):
    """SlotModel's calls with item vectors: one padded pending call, or chunked prefills."""
    model = llama()
    items = torch.tensor(LAYOUT.encode([[a, b, c] for a in range(8) for b in range(8)
                                        for c in range(4)][:64]))  # fmt: skip
    trie = ItemTrie(items, LAYOUT)
    attach_item_vectors(model, trie, torch.randn(trie.n_items, 16))
    base = model.get_decoder()
    prompts = [items[i].tolist() * (1 + i % 2 + 150 * (long_user and i == 2)) for i in range(4)]
    hidden = {}
    for lean in (False, True):
        set_lean_forward(base, lean)
        slots = SlotModel(model, prompts, extra_slots=8)
        assert (slots.lean is not None) is lean
        assert (len(slots.chunks) > 1) is long_user
        ids = torch.tensor([[LAYOUT.bos_token_id] * 2] * 4)
        positions = slots.prompt_len[:, None] + torch.arange(2)
        used = torch.tensor([[[True, False], [True, True]]])
        paths = torch.tensor([[[0, 0], [0, 1]]] * 4) + slots.pending_width
        with torch.no_grad():
            first = slots.forward(ids, positions, torch.where(used, paths, -1), True)
            second = slots.forward(ids, positions + 2, torch.where(used, paths + 2, -1))
        hidden[lean] = (first, second, slots.layer_kv.clone())
        slots.close()
    set_lean_forward(base, None)
    for mine, other in zip(hidden[True], hidden[False], strict=True):
        torch.testing.assert_close(mine, other, rtol=0, atol=1e-5)


def test_unsupported_models_run_through_transformers():
    assert lean_decoder(llama(attn_implementation="eager").model) is None
    assert lean_decoder(llama(attention_bias=True).model) is None
    assert lean_decoder(llama(mlp_bias=True).model) is None
    dynamic = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    assert lean_decoder(llama(rope_parameters=dynamic).model) is None
    hooked = llama().model
    hooked.layers[0].mlp.register_forward_hook(lambda *args: None)
    assert lean_decoder(hooked) is None
    training = llama().model.train()
    assert lean_decoder(training) is None
    compiled = llama()
    assert lean_decoder(compiled.model) is not None
    prepare_model(compiled, torch.float32, "default", backend="eager")
    assert lean_decoder(compiled.model) is None  # its compiled forward runs, not the lean one
    base = llama().model
    set_lean_forward(base, False)
    assert lean_decoder(base) is None
    set_lean_forward(base, None)
    assert lean_decoder(base) is not None


def test_lean_equals_transformers_on_smollm2_shape():
    """SmolLM2-135M's own config (GQA 9 / 3 heads, head_dim 64, rope theta 1e5), 2 layers."""
    from transformers import AutoConfig

    from genrec.online.models.smollm2 import cache_dir

    if not (cache_dir() / "config.json").exists():
        pytest.skip("the SmolLM2 checkpoint was never converted here")
    config = AutoConfig.from_pretrained(cache_dir())
    config.num_hidden_layers, config.vocab_size = 2, LAYOUT.vocab_size
    torch.manual_seed(0)
    base = LlamaForCausalLM(config).eval().get_decoder()
    assert lean_decoder(base) is not None
    for q, start in [(1, 5), (6, 9)]:
        (reference, _), (lean, _) = both(base, q, start)
        torch.testing.assert_close(lean, reference, rtol=0, atol=1e-5)
