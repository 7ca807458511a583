"""Per-user prefix KV caches: computed offline, loaded online, extended by the real-time suffix.

A ``PrefixKV`` is one user's prompt (BOS + history item tokens) run through the
model once. It keeps the keys/values of every prompt token but the LAST one:
decoding needs the hidden state of the last prompt token, which a cache does not
hold, so the last token is fed again together with the suffix (the tokens of
events newer than the cache). Per layer, keys and values are
``[num_kv_heads, len(prompt_ids) - 1, head_dim]`` (RoPE already applied, at
positions 0 .. n-2).

On disk (one safetensors file per user, or the same bytes as one Redis value): tensors ``prompt_ids``,
``keys.{layer}``, ``values.{layer}``; string metadata ``format``,
``model_version``, ``length`` (cached tokens), ``num_layers``. A file written
under another ``model_version`` is refused on load.

Example::

    prefix = compute_prefix_kv(target, [[1, 7, 260]], model_version="v3")[0]
    save_prefix_kv("u42.safetensors", prefix)
    batch = PrefixBatch([load_prefix_kv("u42.safetensors", "v3")], suffixes=[[9, 270]])
    result = batched_beam_search(target, batch, trie, layout, k=10)  # engine.py
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

FORMAT = "genrec-prefix-kv/1"


class ModelVersionMismatch(ValueError):
    """A prefix cache was computed by another model version than the one serving."""


@functools.cache
def cache_argument(model_class: type) -> str:
    """The KV-cache keyword of ``model_class.forward``: ``cache`` or ``past_key_values``.

    transformers renamed ``past_key_values`` to ``cache`` during 5.x (5.17 still has the old
    name, 5.24 the new one); an unknown keyword is swallowed by ``**kwargs``, so pick by name.
    """
    parameters = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def output_cache(output: Any):
    """The KV cache a forward returned, under either name (see ``cache_argument``)."""
    if hasattr(output, "cache"):  # newer outputs: reading ``past_key_values`` there warns
        return output.cache
    return getattr(output, "past_key_values", None)


@dataclass
class PrefixKV:
    """One user's cached prompt: keys/values of ``prompt_ids[:-1]`` for every layer."""

    prompt_ids: list[int]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    model_version: str
    # Prefix KVs of other models over the same prompt (a worker keeps the draft's here, computed
    # on first use): they live and die with this one in the worker's LRU. Never saved.
    companions: dict[str, PrefixKV] = field(default_factory=dict, repr=False, compare=False)

    @property
    def length(self) -> int:
        """Number of cached tokens (``len(prompt_ids) - 1``)."""
        return len(self.prompt_ids) - 1

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> PrefixKV:
        move = lambda t: t.to(device=device, dtype=dtype or t.dtype)  # noqa: E731
        keys = [move(k) for k in self.keys]
        return PrefixKV(self.prompt_ids, keys, [move(v) for v in self.values], self.model_version)


@dataclass
class PrefixBatch:
    """Users to decode from cached prefixes; ``suffixes[i]`` are user i's tokens newer than its cache."""

    prefixes: list[PrefixKV]
    suffixes: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.prefixes:
            raise ValueError("a PrefixBatch needs at least one prefix")
        if not self.suffixes:
            self.suffixes = [[] for _ in self.prefixes]
        if len(self.suffixes) != len(self.prefixes):
            raise ValueError("one suffix per prefix")
        versions = {p.model_version for p in self.prefixes}
        if len(versions) > 1:
            raise ModelVersionMismatch(
                f"prefix caches of several model versions in one batch: {versions}"
            )

    def __len__(self) -> int:
        return len(self.prefixes)


@torch.no_grad()
def compute_prefix_kv(
    model, prompts: list[list[int]], model_version: str, batch_size: int = 16
) -> list[PrefixKV]:
    """Prefill ``prompts`` (left-padded, in batches) and keep each user's cache of ``prompt[:-1]``."""
    if any(len(p) < 1 for p in prompts):
        raise ValueError("every prompt needs at least one token (BOS)")
    device = next(model.parameters()).device
    base = model.get_decoder()
    out: list[PrefixKV] = []
    for start in range(0, len(prompts), batch_size):
        chunk = [p[:-1] for p in prompts[start : start + batch_size]]
        width = max(len(p) for p in chunk)
        if width == 0:
            empty = empty_kv(model)
            out += [
                PrefixKV(list(p), *empty, model_version)
                for p in prompts[start : start + batch_size]
            ]
            continue
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for row, tokens in enumerate(chunk):
            if tokens:
                ids[row, width - len(tokens) :] = torch.tensor(tokens)
                mask[row, width - len(tokens) :] = 1
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        output = base(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            position_ids=positions.to(device),
            use_cache=True,
        )
        layers = output_cache(output).layers
        for row, prompt in enumerate(prompts[start : start + batch_size]):
            n = len(prompt) - 1
            keys = [layer.keys[row, :, width - n :].clone() for layer in layers]
            values = [layer.values[row, :, width - n :].clone() for layer in layers]
            out.append(PrefixKV(list(prompt), keys, values, model_version))
    return out


def empty_kv(model) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer, ``model``'s keys and values of no token (the cache of a BOS-only prompt)."""
    config = model.config.get_text_config(decoder=True)
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    param = next(model.parameters())
    empty = lambda: torch.zeros(heads, 0, head_dim, dtype=param.dtype, device=param.device)  # noqa: E731
    n = config.num_hidden_layers
    return [empty() for _ in range(n)], [empty() for _ in range(n)]


def save_prefix_kv(path: str | Path, prefix_kv: PrefixKV) -> None:
    """Write one user's prefix cache as a safetensors file."""
    tensors, metadata = _tensors_and_metadata(prefix_kv)
    save_file(tensors, str(path), metadata=metadata)


def prefix_kv_to_bytes(prefix_kv: PrefixKV) -> bytes:
    """One user's prefix cache as safetensors bytes (the file's content; the Redis value)."""
    from safetensors.torch import save

    tensors, metadata = _tensors_and_metadata(prefix_kv)
    return save(tensors, metadata=metadata)


def prefix_kv_from_bytes(
    data: bytes, expected_model_version: str, source: str = "prefix KV", device: str = "cpu"
) -> PrefixKV:
    """Parse ``prefix_kv_to_bytes``'s output (safetensors: no code runs); raises like
    ``load_prefix_kv``. ``source`` names the value in errors (a Redis key, say)."""
    from safetensors.torch import load

    metadata = _safetensors_metadata(data)
    _check_metadata(metadata, expected_model_version, source)
    tensors = {name: t.to(device) for name, t in load(data).items()}
    return _from_tensors(tensors, metadata, source)


def _safetensors_metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of safetensors bytes: an 8-byte little-endian length, then JSON."""
    import json

    if len(data) < 8:
        raise ValueError("not a safetensors value (too short)")
    length = int.from_bytes(data[:8], "little")
    if length > len(data) - 8:
        raise ValueError("not a safetensors value (header past the end)")
    return json.loads(data[8 : 8 + length]).get("__metadata__") or {}


def _tensors_and_metadata(prefix_kv: PrefixKV) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    tensors = {"prompt_ids": torch.tensor(prefix_kv.prompt_ids, dtype=torch.long)}
    for layer, (k, v) in enumerate(zip(prefix_kv.keys, prefix_kv.values, strict=True)):
        tensors[f"keys.{layer}"] = k.detach().contiguous().cpu()
        tensors[f"values.{layer}"] = v.detach().contiguous().cpu()
    metadata = {
        "format": FORMAT,
        "model_version": prefix_kv.model_version,
        "length": str(prefix_kv.length),
        "num_layers": str(len(prefix_kv.keys)),
    }
    return tensors, metadata


def load_prefix_kv(
    path: str | Path, expected_model_version: str, device: torch.device | str = "cpu"
) -> PrefixKV:
    """Read a prefix cache; raises ``ModelVersionMismatch`` if another model version wrote it."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata() or {}
    _check_metadata(metadata, expected_model_version, str(path))
    return _from_tensors(load_file(str(path), device=str(device)), metadata, str(path))


def _check_metadata(metadata: dict[str, str], expected_model_version: str, source: str) -> None:
    if metadata.get("format") != FORMAT:
        raise ValueError(
            f"{source}: not a genrec prefix KV file (format {metadata.get('format')!r})"
        )
    version = metadata.get("model_version")
    if version != expected_model_version:
        raise ModelVersionMismatch(
            f"{source}: prefix KV computed by model version {version!r}, "
            f"but model version {expected_model_version!r} is serving; recompute it"
        )


def _from_tensors(tensors: dict[str, torch.Tensor], metadata: dict[str, str], source: str):
    n_layers = int(metadata["num_layers"])
    prompt_ids = tensors["prompt_ids"].tolist()
    keys = [tensors[f"keys.{layer}"] for layer in range(n_layers)]
    values = [tensors[f"values.{layer}"] for layer in range(n_layers)]
    if any(k.shape[1] != len(prompt_ids) - 1 for k in keys):
        raise ValueError(f"{source}: cached length does not match its prompt")
    return PrefixKV(prompt_ids, keys, values, metadata["model_version"])
