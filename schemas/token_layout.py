"""The token layout shared by the semantic-ID builder, the models and the decoder.

An item's semantic ID is ``depth`` codes (L RQ-VAE levels plus one dedup
level). Each level owns its own contiguous token range, placed after the
model's base vocabulary (special tokens for a from-scratch model, the text
vocabulary for a pretrained one)::

    [0, base_vocab_size)                     base vocabulary (pad/bos/eos ...)
    [level_start(0), level_start(0)+C_0)     level-0 codes  <a_0> ... <a_255>
    [level_start(1), level_start(1)+C_1)     level-1 codes  <b_0> ...
    ...
    [item_token_start, item_token_end)       all item tokens, level after level

Example::

    >>> layout = TokenLayout.for_scratch_model((256, 256, 256, 8))
    >>> layout.encode([[3, 0, 1, 0]])
    [[7, 260, 517, 772]]
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from string import ascii_lowercase

import numpy as np

SCRATCH_SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")


@dataclass(frozen=True)
class TokenLayout:
    codes_per_level: tuple[int, ...]
    base_vocab_size: int
    pad_token_id: int
    bos_token_id: int
    eos_token_id: int

    @classmethod
    def for_scratch_model(cls, codes_per_level: tuple[int, ...]) -> TokenLayout:
        """A layout whose base vocabulary is only the four special tokens."""
        return cls(tuple(int(c) for c in codes_per_level), len(SCRATCH_SPECIAL_TOKENS), 0, 1, 2)

    @property
    def depth(self) -> int:
        """Tokens per item: RQ-VAE levels plus the dedup level."""
        return len(self.codes_per_level)

    @property
    def item_token_start(self) -> int:
        return self.base_vocab_size

    @property
    def item_token_end(self) -> int:
        return self.base_vocab_size + sum(self.codes_per_level)

    @property
    def num_item_tokens(self) -> int:
        return sum(self.codes_per_level)

    @property
    def vocab_size(self) -> int:
        return self.item_token_end

    def level_start(self, level: int) -> int:
        return self.base_vocab_size + sum(self.codes_per_level[:level])

    def level_range(self, level: int) -> range:
        start = self.level_start(level)
        return range(start, start + self.codes_per_level[level])

    def encode(self, codes) -> list[list[int]]:
        """Semantic IDs (codes per level) -> model token ids."""
        array = np.asarray(codes, dtype=np.int64)
        return (array + self._offsets()).tolist()

    def decode(self, tokens) -> list[list[int]]:
        """Model token ids -> semantic IDs; raises on a token of the wrong level."""
        array = np.asarray(tokens, dtype=np.int64)
        codes = array - self._offsets()
        limits = np.asarray(self.codes_per_level)
        if (codes < 0).any() or (codes >= limits).any():
            raise ValueError("token outside its level's range")
        return codes.tolist()

    def token_strings(self) -> list[str]:
        """Names of the item tokens in id order, e.g. ``<a_0>``; for adding to a tokenizer."""
        return [
            f"<{ascii_lowercase[level]}_{code}>"
            for level, size in enumerate(self.codes_per_level)
            for code in range(size)
        ]

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> TokenLayout:
        raw = json.loads(text)
        raw["codes_per_level"] = tuple(raw["codes_per_level"])
        return cls(**raw)

    def _offsets(self) -> np.ndarray:
        return np.asarray([self.level_start(level) for level in range(self.depth)], dtype=np.int64)
