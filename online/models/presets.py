"""Model presets and construction for the generative recommender (offline step, models).

A preset names the target model (transformers causal LM), its draft (same
tokenizer, far fewer layers) and their training schedules:

- ``tiny``: a few thousand parameters, for tests (seconds).
- ``small``: a Llama-style model trained from scratch on semantic-ID tokens,
  sized for ML-100K on a 2-core CPU. Its schedule (cosine), the share of windows
  trained back to front (``reverse_windows`` 0.5), the moving average of its
  weights (``ema_decay`` 0.995), the epochs (24: more kept paying, the
  15-minute budget for target and drafts stops there; ``time_budget_s`` caps a
  slower machine) and the 256-dimensional co-occurrence item vectors in its
  input (``item_vector_dim``, ``genrec.online.models.item_vectors``) were each chosen
  on validation over three seeds of a train-only fit (see docs/evaluation.md);
  the shipped model is then fitted on
  train + validation items (``fit_on_valid``: the test items are never seen) with
  the same schedule.
- ``smollm2-135m``: the pretrained SmolLM2-135M-Instruct (see
  ``genrec.online.models.smollm2``) with the item tokens added to its tokenizer.

Only the item-token rows of the output projection are ever computed
(``item_logits``): decoding and training never need the text vocabulary.

Example::

    >>> from genrec.schemas.token_layout import TokenLayout
    >>> layout = TokenLayout.for_scratch_model((8, 8, 4))
    >>> target = build_target(PRESETS["tiny"], layout)
    >>> target.config.vocab_size
    24
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from genrec.online.decoding.prefix_kv import cache_argument, output_cache
from genrec.online.models.smollm2 import load_pretrained_with_items
from genrec.schemas.token_layout import SCRATCH_SPECIAL_TOKENS, TokenLayout


@dataclass(frozen=True)
class ModelPreset:
    """Architecture and schedule of one target + draft pair."""

    name: str
    pretrained: str | None  # None: from scratch; else a key known to genrec.online.models.smollm2
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    dropout: float
    draft_hidden: int
    draft_layers: int
    draft_heads: int
    draft_intermediate: int
    epochs: int  # upper bound; early stopping on validation HR@10 usually ends sooner
    batch_size: int
    lr: float
    weight_decay: float
    eval_every: int  # epochs between validation evaluations
    patience: int  # validation evaluations without improvement before stopping
    draft_epochs: int
    draft_lr: float
    teacher_prompts: int  # sample of training prompts the target decodes for the drafts
    teacher_beams: int  # K_t: target beams kept per teacher prompt
    max_steps: int | None = None  # cap on optimizer steps (short CPU schedules)
    time_budget_s: float | None = None  # target training stops (and evaluates) after this
    draft_time_budget_s: float | None = None  # same for the SFT draft
    eval_users: int | None = None  # validation/test cases decoded per evaluation (None: all)
    # Final fit: train on every user's training + validation items for the fixed schedule
    # (epochs / time budget chosen on validation beforehand); no validation, last weights kept.
    fit_on_valid: bool = False
    label_smoothing: float = 0.0  # within each level's codes
    reverse_windows: float = 0.0  # share of each epoch's windows trained back to front
    shuffle_ties: bool = False  # permute each epoch the items of events with the same time
    ema_decay: float = 0.0  # > 0: validate and keep a moving average of the target's weights
    item_vector_dim: int = 0  # > 0: co-occurrence item vectors in the target's input (item_vectors)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def with_overrides(self, **overrides: Any) -> ModelPreset:
        """A copy with the given fields changed (``None`` values are ignored)."""
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})


PRESETS: dict[str, ModelPreset] = {
    "tiny": ModelPreset(
        name="tiny", pretrained=None, hidden=32, layers=1, heads=2, kv_heads=2,
        intermediate=64, dropout=0.0, draft_hidden=16, draft_layers=1, draft_heads=2,
        draft_intermediate=32, epochs=2, batch_size=32, lr=3e-3, weight_decay=0.0,
        eval_every=1, patience=2, draft_epochs=1, draft_lr=3e-3, teacher_prompts=32,
        teacher_beams=5, item_vector_dim=8,
    ),
    "small": ModelPreset(
        name="small", pretrained=None, hidden=96, layers=2, heads=4, kv_heads=4,
        intermediate=256, dropout=0.25, draft_hidden=64, draft_layers=1, draft_heads=2,
        draft_intermediate=192, epochs=24, batch_size=32, lr=4e-3, weight_decay=0.1,
        eval_every=24, patience=1, draft_epochs=4, draft_lr=2e-3, teacher_prompts=3000,
        teacher_beams=10, time_budget_s=630.0, draft_time_budget_s=120.0, fit_on_valid=True,
        label_smoothing=0.1, reverse_windows=0.5, shuffle_ties=True, ema_decay=0.995,
        item_vector_dim=256,
    ),
    "smollm2-135m": ModelPreset(
        name="smollm2-135m", pretrained="smollm2-135m", hidden=576, layers=30, heads=9,
        kv_heads=3, intermediate=1536, dropout=0.0, draft_hidden=256, draft_layers=2,
        draft_heads=4, draft_intermediate=768, epochs=6, batch_size=16, lr=3e-4,
        weight_decay=0.01, eval_every=1, patience=2, draft_epochs=4, draft_lr=2e-3,
        teacher_prompts=500, teacher_beams=10, eval_users=64,
    ),
}  # fmt: skip


def get_preset(name: str) -> ModelPreset:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose from {sorted(PRESETS)}")
    return PRESETS[name]


def pick_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


# --- tokenizer and layout -----------------------------------------------------


def scratch_tokenizer(layout: TokenLayout) -> PreTrainedTokenizerFast:
    """A word-level tokenizer: the four special tokens, then one token per semantic-ID code."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    vocab = {token: i for i, token in enumerate(SCRATCH_SPECIAL_TOKENS)}
    for offset, token in enumerate(layout.token_strings()):
        vocab[token] = layout.item_token_start + offset
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = WhitespaceSplit()
    pad, bos, eos, unk = SCRATCH_SPECIAL_TOKENS
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=pad, bos_token=bos, eos_token=eos, unk_token=unk
    )


# --- models -------------------------------------------------------------------


def _llama(
    layout: TokenLayout, hidden: int, layers: int, heads: int, kv_heads: int,
    intermediate: int, max_positions: int,
) -> LlamaForCausalLM:  # fmt: skip
    config = LlamaConfig(
        vocab_size=layout.vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=intermediate,
        max_position_embeddings=max_positions,
        attention_dropout=0.0,  # costly on CPU; embedding dropout regularizes instead
        # Tied item embeddings: an item token's input and output vectors are one
        # parameter, which helps the many rarely seen codes.
        tie_word_embeddings=True,
        pad_token_id=layout.pad_token_id,
        bos_token_id=layout.bos_token_id,
        eos_token_id=layout.eos_token_id,
        rope_theta=10000.0,
    )
    return LlamaForCausalLM(config)


def build_target(preset: ModelPreset, layout: TokenLayout, max_positions: int = 1024):
    """A fresh target model; pretrained presets load their checkpoint and resize embeddings."""
    if preset.pretrained is not None:
        model, _tokenizer = load_pretrained_with_items(layout)
        return model
    return _llama(
        layout, preset.hidden, preset.layers, preset.heads, preset.kv_heads,
        preset.intermediate, max_positions,
    )  # fmt: skip


def build_draft(preset: ModelPreset, layout: TokenLayout, max_positions: int = 1024):
    """A small draft model on the same token layout as the target."""
    heads = preset.draft_heads
    return _llama(
        layout, preset.draft_hidden, preset.draft_layers, heads, heads,
        preset.draft_intermediate, max_positions,
    )  # fmt: skip


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def item_logits(
    model,
    layout: TokenLayout,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    past_key_values=None,
    use_cache: bool = False,
) -> tuple[torch.Tensor, Any]:
    """Logits over the item tokens only, ``[..., layout.num_item_tokens]``, and the KV cache.

    Index ``j`` of the last axis is token ``layout.item_token_start + j``.
    """
    cache_kwarg = {cache_argument(type(model.model)): past_key_values}
    outputs = model.model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=use_cache,
        **cache_kwarg,
    )
    rows = model.lm_head.weight[layout.item_token_start : layout.item_token_end]
    logits = outputs.last_hidden_state @ rows.T
    bias = getattr(model.lm_head, "bias", None)
    if bias is not None:
        logits = logits + bias[layout.item_token_start : layout.item_token_end]
    return logits, output_cache(outputs)


def level_masks(layout: TokenLayout, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[depth, num_item_tokens]`` bool: which item tokens belong to each level."""
    masks = torch.zeros(layout.depth, layout.num_item_tokens, dtype=torch.bool, device=device)
    for level in range(layout.depth):
        start = layout.level_start(level) - layout.item_token_start
        masks[level, start : start + layout.codes_per_level[level]] = True
    return masks
