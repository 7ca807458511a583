"""A lean decoder stack for Llama-architecture models over the slot KV (online, decoding).

One job: given a call's token ids (or input embeddings), positions and additive mask,
run a ``LlamaModel``'s layers with its own weights, write the call's keys and values
into the preallocated slot tensors of ``slot_cache.SlotModel`` at ``[start, start + Q)``
and return the last hidden state. The ops, their order and their dtypes are those of
transformers' Llama modules on the ``sdpa`` path (RMSNorm in float32, RoPE from the
rotary embedding's ``inv_freq`` and ``attention_scaling``, transformers' own
``sdpa_attention_forward`` for the attention, so GQA dispatches as there), so the
hidden states are those of ``base(..., past_key_values=SlotKV)``; what goes is
transformers' per-call Python work (kwargs merging, output recording, mask
preparation, cache bookkeeping, module dispatch per layer), ~2 ms a call on the
2-core CPU (docs/decoding.md).

Whether a model can run lean is decided once per model (``lean_decoder``): a
``LlamaModel`` in eval mode with sdpa attention, no attention or MLP bias, a rope
type whose frequencies are fixed at init (default, linear, llama3), no hooks and no
compiled forward. Anything else gets ``None`` and runs through transformers.
``set_lean_forward`` overrides ``decode.lean_forward`` for one model.

Example::

    lean = lean_decoder(model.get_decoder())    # LeanLlama, or None: use transformers
    hidden = lean(ids, None, positions, mask, keys, values, start)   # [B, Q, H]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from genrec.infra.settings import get_settings

# Rope types whose inv_freq is computed once at init (dynamic / longrope change it per call)
STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3"})
_PLAN = "_genrec_lean_plan"  # the decision, cached on the base model
_OVERRIDE = "_genrec_lean_forward"  # set_lean_forward's value, on the base model


class LeanLlama:
    """The decoder stack of one ``LlamaModel``, bound to its modules (weights read per call,
    so a later cast or weight load is seen; nothing is copied)."""

    def __init__(self, base: torch.nn.Module) -> None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        self.base, self.attention = base, sdpa_attention_forward
        config = base.config
        self.layers = list(base.layers[: config.num_hidden_layers])
        attn = self.layers[0].self_attn
        self.head_dim, self.scaling = attn.head_dim, attn.scaling
        self.rotary = base.rotary_emb

    def __call__(
        self,
        input_ids: torch.Tensor | None,
        inputs_embeds: torch.Tensor | None,
        positions: torch.Tensor,
        mask: torch.Tensor,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        start: int,
    ) -> torch.Tensor:
        """Last hidden states [B, Q, H] of a call at slots ``[start, start + Q)``; ``mask`` is
        additive [B, Q, start + Q] in the model's dtype; ``keys`` / ``values`` per layer
        [B, kv_heads, capacity, head_dim] (written in place)."""
        hidden = self.base.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        cos, sin = self._rope(positions, hidden.dtype)
        mask = mask[:, None]
        stop = start + hidden.shape[1]
        for i, layer in enumerate(self.layers):
            residual = hidden
            hidden = _rms_norm(hidden, layer.input_layernorm)
            hidden = self._attend(layer.self_attn, hidden, cos, sin, mask, keys[i], values[i],
                                  start, stop)  # fmt: skip
            hidden = residual + hidden
            residual = hidden
            hidden = _rms_norm(hidden, layer.post_attention_layernorm)
            mlp = layer.mlp
            gate = mlp.act_fn(F.linear(hidden, mlp.gate_proj.weight))
            hidden = F.linear(gate * F.linear(hidden, mlp.up_proj.weight), mlp.down_proj.weight)
            hidden = residual + hidden
        return _rms_norm(hidden, self.base.norm)

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos and the half-negated sin [B, 1, Q, head_dim]: cos and sin as
        ``LlamaRotaryEmbedding.forward`` computes them, then ``sin`` with its first half
        negated, so that ``rotate_half(x) * sin == x.roll(half, -1) * signed_sin`` exactly
        (a negation is exact: one op per rotation where ``rotate_half`` takes four)."""
        rotary = self.rotary
        inv_freq = rotary.inv_freq.to(device=positions.device, dtype=torch.float)
        freqs = positions[..., None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if rotary.attention_scaling != 1.0:  # (x * 1.0 is x: skipped, as a no-op cast is)
            cos, sin = cos * rotary.attention_scaling, sin * rotary.attention_scaling
        if dtype != torch.float32:
            cos, sin = cos.to(dtype=dtype), sin.to(dtype=dtype)
        half = sin.shape[-1] // 2
        signed_sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        return cos[:, None], signed_sin[:, None]

    def _attend(self, attn, hidden, cos, sin, mask, keys, values, start: int, stop: int):
        """One attention block: projections, RoPE, the slot write, sdpa, ``o_proj``."""
        shape = (*hidden.shape[:-1], -1, self.head_dim)
        query = F.linear(hidden, attn.q_proj.weight).view(shape).transpose(1, 2)
        key = F.linear(hidden, attn.k_proj.weight).view(shape).transpose(1, 2)
        value = F.linear(hidden, attn.v_proj.weight).view(shape).transpose(1, 2)
        half = self.head_dim // 2
        query = (query * cos) + (query.roll(half, -1) * sin)  # sin: half-negated (_rope)
        key = (key * cos) + (key.roll(half, -1) * sin)
        keys[:, :, start:stop] = key
        values[:, :, start:stop] = value
        out, _ = self.attention(attn, query, keys[:, :, :stop], values[:, :, :stop], mask,
                                dropout=0.0, scaling=self.scaling)  # fmt: skip
        out = out.reshape(*hidden.shape[:-1], -1).contiguous()
        return F.linear(out, attn.o_proj.weight)


def _rms_norm(hidden: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    """``LlamaRMSNorm.forward``: the variance in float32, then the weight in the input's dtype."""
    dtype = hidden.dtype
    if dtype != torch.float32:  # (a cast to the same dtype returns its input: skipped)
        hidden = hidden.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + norm.variance_epsilon)
    return norm.weight * (hidden if dtype == torch.float32 else hidden.to(dtype))


def set_lean_forward(base: torch.nn.Module, enabled: bool | None) -> None:
    """Run ``base`` lean (True), through transformers (False) or as ``decode.lean_forward``
    says (None), for every later ``SlotModel``."""
    setattr(base, _OVERRIDE, enabled)


def lean_decoder(base: torch.nn.Module) -> LeanLlama | None:
    """``base``'s lean stack, or None when it runs through transformers (the setting is off,
    the model is not supported, or it is training: dropout)."""
    enabled = getattr(base, _OVERRIDE, None)
    if enabled is None:
        enabled = get_settings().decode.lean_forward
    # (compiled after a first decode: prepare_model replaced the forward; training: dropout)
    if not enabled or base.training or getattr(base.forward, "_genrec_compiled", False):
        return None
    plan = base.__dict__.get(_PLAN)
    if plan is None:
        plan = LeanLlama(base) if supported(base) else False
        base.__dict__[_PLAN] = plan  # not an nn.Module attribute: no state_dict entry
    return plan or None


def supported(base: torch.nn.Module) -> bool:
    """Whether ``base`` is a Llama stack that ``LeanLlama`` computes exactly as transformers."""
    try:
        from transformers.models.llama import modeling_llama as llama
    except ImportError:  # pragma: no cover - transformers always ships Llama
        return False
    if type(base) is not llama.LlamaModel:
        return False
    config = base.config
    rope = getattr(config, "rope_parameters", None) or {}
    if (
        config._attn_implementation != "sdpa"
        or getattr(config, "attention_bias", False)
        or getattr(config, "mlp_bias", False)
        or rope.get("rope_type", "default") not in STATIC_ROPE_TYPES
        or type(base.rotary_emb) is not llama.LlamaRotaryEmbedding
        or type(base.norm) is not llama.LlamaRMSNorm
    ):
        return False
    layers = list(base.layers[: config.num_hidden_layers])
    if not layers or any(type(layer) is not llama.LlamaDecoderLayer for layer in layers):
        return False
    expected = {
        "self_attn": llama.LlamaAttention,
        "mlp": llama.LlamaMLP,
        "input_layernorm": llama.LlamaRMSNorm,
        "post_attention_layernorm": llama.LlamaRMSNorm,
    }
    for layer in layers:
        if any(type(getattr(layer, name)) is not kind for name, kind in expected.items()):
            return False
    return not _has_hooks(base)


def _has_hooks(base: torch.nn.Module) -> bool:
    """Hooks on any module but the input embedding (which the lean stack calls as a module)."""
    skipped = {id(m) for m in base.embed_tokens.modules()}
    return any(
        module._forward_hooks or module._forward_pre_hooks
        for module in base.modules()
        if id(module) not in skipped
    )
