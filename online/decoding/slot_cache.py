"""One model's KV for a batched decode, in preallocated per-layer tensors addressed by slot.

The batched engine (``engine.py``) keeps, per model and per layer, keys and
values ``[B, kv_heads, capacity, head_dim]``. Row b is user b: slots
``[0, prefix_width)`` hold its cached prefix (right-aligned, ``PrefixBatch``),
the next ``pending_width`` slots its pending tokens (the prefix's last token and
the suffix, or the whole prompt; left-aligned), and every later call appends its
new tokens at the same slots for all users. Which slots a new token attends to
is a boolean visibility row (the prompt plus its own path: the slots of its
ancestors and itself), passed to the model as a 4D mask, at position
``prompt_len + level``. No per-user objects: one call costs the same number of
tensor operations whatever the batch size. A Llama-architecture model runs through
``lean_forward.LeanLlama`` (``decode.lean_forward``), any other through transformers
with a ``SlotKV`` cache over the same slot tensors.

The pending tokens of users whose suffixes differ much in length (a user back after a
long session beside users with one new event; prompts without a cached prefix) are
prefilled in row ranges of similar length (``pending_chunks``: a few calls instead of
one padded to the longest), so one long suffix does not cost every user its length.

Example::

    model_kv = SlotModel(target, [[1, 7, 260, 517, 772]], extra_slots=40)
    hidden = model_kv.forward_pending()        # [B, pending_width, H]
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from genrec.online.decoding.lean_forward import lean_decoder
from genrec.online.decoding.prefix_kv import PrefixBatch, PrefixKV, cache_argument

Prompts = list[list[int]] | PrefixBatch


class Buffers:
    """Flat storage reused from one decode to the next.

    A fresh multi-megabyte tensor is paged in by the kernel on first touch (on the
    2-core CPU about 1 GB/s: 12 ms of a 65 ms batch-64 decode); a reused one is not.
    Keeps up to ``keep`` buffers (a target's and a draft's) of at most ``max_bytes``
    each per (dtype, device, inference mode); thread-safe. A buffer made under
    ``torch.inference_mode`` (the serving worker's decodes) is an inference tensor, which
    may not be written outside that mode (an evaluation's ``no_grad`` decode in the same
    process): the two kinds never share a pool.
    """

    def __init__(self, keep: int = 2, max_bytes: int = 1 << 30) -> None:
        self.keep, self.max_bytes, self.lock = keep, max_bytes, threading.Lock()
        self.free: dict[tuple[torch.dtype, torch.device, bool], list[torch.Tensor]] = {}

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A flat tensor of at least ``numel`` elements (contents undefined)."""
        with self.lock:
            pool = self.free.setdefault((dtype, device, torch.is_inference_mode_enabled()), [])
            fitting = [i for i, b in enumerate(pool) if b.numel() >= numel]
            if fitting:
                return pool.pop(min(fitting, key=lambda i: pool[i].numel()))
        return torch.empty(numel, dtype=dtype, device=device)

    def give(self, buffer: torch.Tensor) -> None:
        """Keep ``buffer`` for a later ``take`` (the smallest goes when there are too many)."""
        if buffer.numel() * buffer.element_size() > self.max_bytes:
            return
        with self.lock:
            pool = self.free.setdefault((buffer.dtype, buffer.device, buffer.is_inference()), [])
            pool.append(buffer)
            if len(pool) > self.keep:
                pool.pop(min(range(len(pool)), key=lambda i: pool[i].numel()))


BUFFERS = Buffers()


class SlotKV(DynamicCache):
    """A transformers cache whose ``update`` writes a call's keys/values at slots ``[start, stop)``
    of preallocated tensors and hands the attention every slot before ``stop``."""

    def __init__(self, config, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        super().__init__(config=config)
        self.slot_keys, self.slot_values = keys, values
        self.start = 0

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        stop = self.start + key_states.shape[2]
        keys, values = self.slot_keys[layer_idx], self.slot_values[layer_idx]
        keys[:, :, self.start : stop] = key_states
        values[:, :, self.start : stop] = value_states
        return keys[:, :, :stop], values[:, :, :stop]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.start


class SlotModel:
    """``model``'s KV for a batch of ``prompts``, with room for ``extra_slots`` generated tokens."""

    def __init__(self, model, prompts: Prompts, extra_slots: int) -> None:
        self.base = model.get_decoder()
        self.lean = lean_decoder(self.base)  # None: calls go through transformers
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        # An input embedding that reads the codes before a token (online.models.item_vectors)
        # gets them for the pending tokens, which may start inside a cached prompt.
        self.embedding = model.get_input_embeddings()
        self.context_width = int(getattr(self.embedding, "context_width", 0))
        if isinstance(prompts, PrefixBatch):
            prefixes = prompts.prefixes
            prefix_len = [p.length for p in prefixes]
            pending = [
                p.prompt_ids[-1:] + list(s) for p, s in zip(prefixes, prompts.suffixes, strict=True)
            ]
            width = self.context_width
            before = [p.prompt_ids[max(0, p.length - width) : p.length] for p in prefixes]
        else:
            if not prompts or any(len(p) == 0 for p in prompts):
                raise ValueError("prompts must be a non-empty list of non-empty token lists")
            prefixes, prefix_len, pending = [], [0] * len(prompts), [list(p) for p in prompts]
            before = [[] for _ in prompts]
        self.n_users = len(pending)
        self.prefixes, self.prefix_len, self.pending = prefixes, prefix_len, pending
        self.prefix_width = max(prefix_len)
        self.pending_width = max(len(p) for p in pending)
        self.chunks = pending_chunks([len(p) for p in pending])
        self.capacity = self.prefix_width + self.pending_width + extra_slots
        self._allocate(model.config)
        if self.prefix_width:
            self._copy_prefixes(prefixes, prefix_len)
        self._pending(prefix_len, pending, before)
        self.cursor = self.prefix_width  # the slot the next call writes first
        self.fed_pending = False  # whether a call fed the pending tokens (their KV is in place)

    def _allocate(self, config) -> None:
        config = config.get_text_config(decoder=True)
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        # Never read before written, except the prefix region (copied in, zero-padded) and
        # the pending slots a narrower prefill range leaves (zeroed in _prefill_chunks)
        shape = (self.n_users, heads, self.capacity, head_dim)
        n_layers = config.num_hidden_layers
        self.storage = BUFFERS.take(2 * n_layers * math.prod(shape), self.dtype, self.device)
        views = self.storage[: 2 * n_layers * math.prod(shape)].view(2, n_layers, *shape)
        self.layer_kv = views.flatten(0, 1)  # [keys of every layer, then values, B, ...]
        self.slot_keys, self.slot_values = list(views[0].unbind(0)), list(views[1].unbind(0))
        # the transformers path's cache over the same tensors (~0.1 ms to make: not when lean)
        self.cache = (
            None
            if self.lean is not None
            else SlotKV(self.base.config, self.slot_keys, self.slot_values)
        )
        self.cache_kwarg = cache_argument(type(self.base))

    def prompt_kvs(self, model_version: str) -> list[PrefixKV]:
        """Each user's whole prompt as a ``PrefixKV`` (the keys and values of all its tokens
        but the last), copied out of the slots; valid once the pending tokens were fed.

        A later request whose prompt starts with these tokens prefills only the rest
        (``online.served_prompts``). One copy per user, whatever the number of layers.
        """
        if not self.fed_pending:
            raise RuntimeError("the pending tokens were never fed: no prompt KV to copy")
        start, n_layers = self.prefix_width, len(self.slot_keys)
        out = []
        for row, (pending, length) in enumerate(zip(self.pending, self.prefix_len, strict=True)):
            # the cached tokens, then the pending ones (a prefix's last token is re-fed there)
            tokens = self.prefixes[row].prompt_ids[:-1] + pending if self.prefixes else pending
            cached = len(tokens) - 1  # the prefix's slots, then the pending ones but the last
            kv = self.layer_kv[:, row, :, start - length : start - length + cached].clone()
            layers = kv.unbind(0)
            out.append(
                PrefixKV(list(tokens), list(layers[:n_layers]), list(layers[n_layers:]),
                         model_version)
            )  # fmt: skip
        return out

    def close(self) -> None:
        """Hand the KV storage back for the next decode (this object is unusable after)."""
        if self.storage is not None:
            BUFFERS.give(self.storage)
            self.storage = self.slot_keys = self.slot_values = self.cache = None

    def _copy_prefixes(self, prefixes, prefix_len: list[int]) -> None:
        """Every user's cached prefix into its row, right-aligned, zeros before it.

        ``torch.stack(out=...)`` does the block copies (and the cast to the model's dtype)
        in C++: one call per layer when every prefix has the same length, else one per
        user for all its layers, instead of four Python tensor operations per user and layer.
        """
        expected = len(self.slot_keys)
        if any(len(p.keys) != expected for p in prefixes):
            raise ValueError(f"prefix KV with the wrong number of layers (model has {expected})")
        width, slots = self.prefix_width, self.layer_kv
        per_user = [[*p.keys, *p.values] for p in prefixes]
        if all(length == width for length in prefix_len):
            for i in range(slots.shape[0]):
                _stack_into([tensors[i] for tensors in per_user], slots[i, :, :, :width])
        else:
            for row, (tensors, length) in enumerate(zip(per_user, prefix_len, strict=True)):
                if length < width:
                    slots[:, row, :, : width - length].zero_()
                _stack_into(tensors, slots[:, row, :, width - length : width])

    def _pending(
        self, prefix_len: list[int], pending: list[list[int]], before: list[list[int]]
    ) -> None:
        """The pending tokens' ids, positions and masks: a handful of tensor operations for the
        whole batch (one ``torch.tensor`` for ids and lengths; no per-user tensor work)."""
        width, device, start = self.pending_width, self.device, self.prefix_width
        rows = zip(pending, prefix_len, strict=True)
        table = torch.tensor(
            [p + [0] * (width - len(p)) + [len(p), o] for p, o in rows],
            dtype=torch.long, device=device,
        )  # fmt: skip
        self.pending_ids, lengths, offsets = table[:, :width], table[:, width], table[:, -1]
        column = torch.arange(width, device=device)
        valid = column < lengths[:, None]
        self.pending_positions = torch.where(valid, offsets[:, None] + column, 0)
        self.prompt_len = offsets + lengths  # [B]: position of the first generated token
        self.pending_tips = lengths - 1  # [B]: column of each user's last pending token
        # where forward(with_pending=True) puts the pending tokens' hidden states: all
        # pending_width columns from one padded call, or only each user's last one after a
        # chunked prefill (nothing reads the others)
        self.pending_columns, self.tip_columns = width, self.pending_tips
        if len(self.chunks) > 1:
            self.pending_columns, self.tip_columns = 1, torch.zeros_like(lengths)
        # a user's prompt is one run of slots: its prefix ends at ``start``, its pending tokens
        # begin there
        slot = torch.arange(self.capacity, device=device)
        prompt_visible = (slot >= start - offsets[:, None]) & (slot < start + lengths[:, None])
        self.hidden_value = torch.finfo(self.dtype).min  # additive mask of a slot not attended to
        self.prompt_mask = self._additive(prompt_visible)
        # pending token i sees its user's prompt up to slot start + i. A padding row sees the
        # whole prompt (never empty: no NaN); nothing reads its hidden state or its slot. The
        # minimum of two additive masks is their "and", 15x cheaper on a CPU than a where over
        # broadcast booleans.
        causal = self._additive(slot[: start + width] <= (start + column)[:, None])
        self.pending_mask = torch.minimum(self.prompt_mask[:, None, : start + width], causal)
        # [B, width, prefix + width]
        self.context = None
        if self.context_width:
            self.context = torch.tensor(
                [[-1] * (self.context_width - len(b)) + list(b) for b in before],
                dtype=torch.long, device=device,
            )  # fmt: skip

    def _additive(self, visible: torch.Tensor) -> torch.Tensor:
        zero = torch.zeros((), dtype=self.dtype, device=self.device)
        return torch.where(visible, zero, self.hidden_value)

    def attention_mask(self, paths: torch.Tensor, width: int) -> torch.Tensor:
        """Tensor[B, Q, width], additive: the prompt plus the slots in ``paths`` ([B, Q, depth],
        -1: none) are attended to."""
        n, q = paths.shape[:2]
        mask = torch.empty(n, q, width + 1, dtype=self.dtype, device=self.device)
        mask[:, :, :width] = self.prompt_mask[:, None, :width]
        mask.scatter_(2, torch.where(paths >= 0, paths, width), 0.0)
        return mask[:, :, :width]

    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        paths: torch.Tensor,
        with_pending: bool = False,
    ) -> torch.Tensor:
        """One model call; returns the last hidden states ``[B, Q, H]``.

        Row q writes slot ``cursor + q``; ``paths[:, q]`` are the generated slots it
        attends to (itself included) besides the prompt. ``with_pending``: the
        call starts with the pending tokens (``pending_width`` rows, whose own
        ``ids``, ``positions`` and ``paths`` are not passed).
        """
        self.fed_pending |= with_pending
        if with_pending and len(self.chunks) > 1:
            tips = self._prefill_chunks()
            if not ids.shape[1]:
                return tips
            return torch.cat([tips, self.forward(ids, positions, paths)], 1)
        if with_pending:
            ids = torch.cat([self.pending_ids, ids], 1)
            positions = torch.cat([self.pending_positions, positions], 1)
        width = self.cursor + ids.shape[1]
        mask = self.attention_mask(paths, width)
        if with_pending:  # (no copies when the call is the pending tokens alone)
            pad = width - self.pending_mask.shape[2]
            pending = self.pending_mask
            if pad:
                pending = F.pad(pending, (0, pad), value=self.hidden_value)
            mask = torch.cat([pending, mask], 1) if mask.shape[1] else pending
        hidden = self._call(self._inputs(ids, with_pending), positions, mask,
                            self.slot_keys, self.slot_values, self.cursor)  # fmt: skip
        self.cursor = width
        return hidden

    def _call(self, inputs: dict, positions, mask, keys, values, start: int) -> torch.Tensor:
        """The decoder stack writing slots ``[start, start + Q)`` of ``keys`` / ``values`` (per
        layer), additive ``mask`` [B, Q, start + Q]: lean (``lean_forward.py``) or through
        transformers (a ``SlotKV`` over the same tensors); the last hidden states."""
        if self.lean is not None:
            return self.lean(inputs.get("input_ids"), inputs.get("inputs_embeds"), positions,
                             mask, keys, values, start)  # fmt: skip
        cache = self.cache if keys is self.slot_keys else SlotKV(self.base.config, keys, values)
        cache.start = start
        output = self.base(
            **inputs,
            position_ids=positions,
            attention_mask=mask[:, None],
            use_cache=True,
            **{self.cache_kwarg: cache},
        )
        return output.last_hidden_state

    def _prefill_chunks(self) -> torch.Tensor:
        """The pending tokens, one call per row range of ``chunks`` (each as wide as its
        longest); returns each user's last pending hidden state [B, 1, H]."""
        start, tips = self.cursor, []
        for first, stop, width in self.chunks:
            rows = slice(first, stop)
            ids = self.pending_ids[rows, :width]
            inputs = {"input_ids": ids}
            if self.context_width:
                inputs = {"inputs_embeds": self.embedding(ids, context=self.context[rows])}
            keys = [k[rows] for k in self.slot_keys]
            values = [v[rows] for v in self.slot_values]
            mask = self.pending_mask[rows, :width, : start + width]
            hidden = self._call(inputs, self.pending_positions[rows, :width], mask, keys, values,
                                start)  # fmt: skip
            column = self.pending_tips[rows, None, None].expand(-1, 1, hidden.shape[2])
            tips.append(hidden.gather(1, column))
            if width < self.pending_width:
                # Slots past a narrower range's width are masked for its rows, but attention
                # still multiplies their zero weights by their values: left as the reused
                # storage's old contents (inf, NaN), 0 x inf would turn its users' scores
                # into NaN and lose all their beams.
                self.layer_kv[:, rows, :, start + width : start + self.pending_width].zero_()
        self.cursor = start + self.pending_width
        return torch.cat(tips, 0)

    def _inputs(self, ids: torch.Tensor, with_pending: bool) -> dict:
        if not self.context_width:
            return {"input_ids": ids}
        if not with_pending:
            # generated codes only: no complete history item in them (see docs/decoding.md)
            return {"inputs_embeds": self.embedding(ids, find_items=False)}
        width = self.pending_width
        pending = self.embedding(ids[:, :width], context=self.context)
        return {
            "inputs_embeds": torch.cat(
                [pending, self.embedding(ids[:, width:], find_items=False)], 1
            )
        }


# What one more model call costs, in pending tokens it could have computed instead (the
# 2-core CPU, `small` model, roughly: a call's fixed work ~1 ms, a token at batch 64 a few
# us). Chunks pay only where a suffix is far longer than the others'; on a GPU, where a
# call costs more and a token less, fewer chunks would be chosen with a larger value.
PENDING_CALL_TOKENS = 256


def pending_chunks(
    lengths: Sequence[int], call_tokens: int | None = None
) -> list[tuple[int, int, int]]:
    """Row ranges ``(first, stop, width)`` to prefill pending tokens of ``lengths`` in, in row
    order, minimizing calls x ``call_tokens`` + rows x the widest in their range (one range
    when padding to the longest wastes less than a call). Exact for any order, best when
    the rows are sorted by length (the recommender sorts them). ``call_tokens`` defaults
    to ``PENDING_CALL_TOKENS``."""
    call_tokens = PENDING_CALL_TOKENS if call_tokens is None else call_tokens
    n, longest = len(lengths), max(lengths)
    if n * longest - sum(lengths) <= call_tokens:
        return [(0, n, longest)]
    values = np.asarray(lengths, dtype=np.int64)
    best = np.zeros(n + 1, dtype=np.int64)  # best[b]: cost of rows [0, b)
    start_of = np.zeros(n + 1, dtype=np.int64)
    for stop in range(1, n + 1):
        # widest[a] = max(lengths[a:stop]) for every a < stop
        widest = np.maximum.accumulate(values[:stop][::-1])[::-1]
        costs = best[:stop] + call_tokens + (stop - np.arange(stop)) * widest
        start_of[stop] = int(costs.argmin())
        best[stop] = costs[start_of[stop]]
    chunks, stop = [], n
    while stop:
        first = int(start_of[stop])
        chunks.append((first, stop, int(values[first:stop].max())))
        stop = first
    return chunks[::-1]


def _stack_into(tensors: list[torch.Tensor], out: torch.Tensor) -> None:
    """``out[i] = tensors[i]`` (cast to ``out``'s dtype): in place when they share a device,
    else stacked where they are and copied over in one transfer (prefixes loaded on a CPU)."""
    if tensors[0].device == out.device:
        torch.stack(tensors, out=out)
    else:
        out.copy_(torch.stack(tensors))
