"""How a loaded model runs when it decodes (online, models): its number format and compilation.

Training and evaluation keep float32 eager models; serving and ``genrec bench
decode`` may trade that for speed (``decode.dtype``, ``decode.compile``):

* **dtype**: ``bfloat16`` halves the weights' and the KV's memory traffic; on a
  GPU it is the format whose matrix units run fastest. ``auto`` picks it on a
  CUDA GPU that supports it and keeps float32 elsewhere (a CPU without bf16
  matrix units runs bf16 slower than float32). The engine scores in float32
  whatever the model's format, and cached prefix KV (stored float32) is cast
  when it is copied into a batch's slots. Strict speculation stays equal to
  target-only in exact arithmetic; in bf16, near-ties between beams break more
  often by the order of the arithmetic, so an equality check is float32's.
* **compile**: ``torch.compile`` of each model's decoder stack. ``reduce-overhead``
  replays CUDA graphs on a GPU, which removes the per-layer kernel-launch cost
  that bounds a small model's step there (docs/decoding.md). Shapes are
  dynamic (batch size, KV width), so a compiled graph serves many of them, but
  CUDA graphs are recorded per distinct shape and the first calls of each pay
  the compilation: warm a worker before it serves. Not measured on a GPU yet.
  A compiled model runs through transformers' forward, not the lean one.
* **lean forward** (``decode.lean_forward``, ``online/decoding/lean_forward.py``):
  Llama-architecture models decode through a lean stack of the same ops as
  transformers' sdpa path; ``apply_runtime`` reports whether the target does.

Example::

    >>> runtime = apply_runtime(models, dtype="auto", compile_mode="off")  # doctest: +SKIP
    >>> runtime
    {'dtype': 'float32', 'compile': 'off', 'device': 'cpu', 'lean_forward': 'on'}
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, get_args

import torch

from genrec.infra.settings import CompileMode
from genrec.online.decoding.lean_forward import lean_decoder

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
COMPILE_MODES = get_args(CompileMode)


def decode_dtype(name: str, device: torch.device | str) -> torch.dtype:
    """The torch dtype of setting ``name`` on ``device`` (``auto``: bf16 on a CUDA GPU with it)."""
    device = torch.device(device)
    if name == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    if name not in DTYPES:
        raise ValueError(f"decode dtype {name!r}: expected auto or one of {sorted(DTYPES)}")
    return DTYPES[name]


def prepare_model(
    model: torch.nn.Module,
    dtype: torch.dtype,
    compile_mode: str = "off",
    backend: str | None = None,
) -> torch.nn.Module:
    """Cast ``model`` to ``dtype`` and compile its decoder stack's forward; returns ``model``.

    ``backend`` is torch.compile's (default: inductor); tests use ``"eager"``, which
    traces the same graph without generating code.
    """
    if compile_mode not in COMPILE_MODES:
        raise ValueError(f"decode compile {compile_mode!r}: expected one of {COMPILE_MODES}")
    model.to(dtype=dtype)
    if compile_mode == "off":
        return model
    decoder = model.get_decoder()
    if getattr(decoder.forward, "_genrec_compiled", False):
        return model
    options: dict[str, Any] = {"dynamic": None}
    if backend is not None:
        options["backend"] = backend
    if compile_mode != "default" and backend in (None, "inductor"):
        options["mode"] = compile_mode
    compiled = torch.compile(decoder.forward, **options)
    compiled._genrec_compiled = True  # type: ignore[attr-defined]
    decoder.forward = compiled
    return model


def apply_runtime(
    models: Any, dtype: str = "float32", compile_mode: str = "off", backend: str | None = None
) -> dict[str, str]:
    """``prepare_model`` for the target and every draft of ``models`` (``GenerativeModels``);
    returns what was applied (for logs, ``/healthz`` and bench reports)."""
    device = torch.device(getattr(models, "device", None) or _device_of(models.target))
    torch_dtype = decode_dtype(dtype, device)
    for model in _models(models):
        prepare_model(model, torch_dtype, compile_mode, backend)
    applied = {
        "dtype": str(torch_dtype).removeprefix("torch."),
        "compile": compile_mode,
        "device": device.type,
        # whether SlotModel runs the target lean (off: the setting, a compiled or other model)
        "lean_forward": "on" if lean_decoder(models.target.get_decoder()) is not None else "off",
    }
    log.info("decoding runtime: %s", applied)
    return applied


def _models(models: Any) -> Iterable[torch.nn.Module]:
    """Each distinct model of a ``GenerativeModels`` or a bench's ``BenchModels``."""
    drafts = getattr(models, "drafts", None)  # GenerativeModels: name -> model
    found = [models.target, *(drafts.values() if isinstance(drafts, dict) else ())]
    found += [getattr(models, "draft", None), getattr(models, "relaxed_draft", None)]
    seen: set[int] = set()
    for model in found:
        if isinstance(model, torch.nn.Module) and id(model) not in seen:
            seen.add(id(model))
            yield model


def _device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device
