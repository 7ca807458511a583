"""Collaborative signal in semantic IDs (offline step: item tokenization).

Text alone places an item next to items that *read* alike; the target model has
to predict what users *watch* together. A full semantic-ID build therefore feeds
the RQ-VAE, for every item,

    [sqrt(1 - w) * text_vector, sqrt(w) * cooccurrence_vector]     (both unit rows)

so items consumed together share ID prefixes (w = ``semantic_ids.cooccurrence_weight``;
0 keeps text-only IDs). ``text_vector`` is whatever ``genrec.offline.semantic_ids.embeddings``
gives (text, or interaction SVD for items without text).

- ``cooccurrence_vector``: the top eigenvectors of the cosine-normalized windowed
  co-occurrence (``genrec.offline.recall.cooccurrence_embeddings``, the ANN
  branch's embedding), fitted on every user's events **except the last one**:
  that event is the user's test case in ``genrec eval``, and the target model's
  final fit leaves it out too, so the evaluation stays honest.
- Items without co-occurrence (unseen, or new since the fit): a ridge map from
  the text vector, fitted on the items that have both, stands in.
- A refresh keeps every existing item's vector (and ID) and gives new items their
  text vector plus the mapped co-occurrence part. The map is saved with the version.

Example::

    >>> import numpy as np
    >>> text = np.eye(3, dtype=np.float32)
    >>> sequences = {"u1": ["a", "b", "x"], "u2": ["a", "b", "y"], "u3": ["c", "a", "z"]}
    >>> vectors, mix = mix_cooccurrence(["a", "b", "c"], text, sequences, weight=0.5, dim=2)
    >>> vectors.shape, round(float(np.linalg.norm(vectors[0])), 3)
    ((3, 4), 1.0)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from genrec.offline.semantic_ids.embeddings import fit_projection
from genrec.online.branches import cooccurrence_embeddings, normalize_rows

MIX_FILE = "cooccurrence_mix.safetensors"
MIX_BLOCK_ROWS = 65_536  # rows mixed at a time (``CooccurrenceMix.vectors``)


@dataclass
class CooccurrenceMix:
    """What a refresh needs to place new items in a mixed build's space."""

    weight: float
    projection: np.ndarray  # float32 [text_dim, cooccurrence_dim]: text -> co-occurrence part

    def save(self, folder: Path) -> None:
        save_file(
            {"projection": self.projection, "weight": np.array([self.weight], np.float32)},
            str(folder / MIX_FILE),
        )

    @classmethod
    def load(cls, folder: Path) -> CooccurrenceMix | None:
        if not (folder / MIX_FILE).exists():
            return None
        tensors = load_file(str(folder / MIX_FILE))
        return cls(float(tensors["weight"][0]), tensors["projection"])

    def vectors(self, text: np.ndarray, cooccurrence: np.ndarray | None = None) -> np.ndarray:
        """Mixed unit rows; rows of ``cooccurrence`` that are zero (or all, if None) are mapped.

        Every step is row by row, so the rows are mixed a block at a time into the output
        (the same floats as whole arrays; at 1M x 384 the whole-array temporaries were
        four copies of the output)."""
        mapped = text @ self.projection
        if cooccurrence is not None:
            seen = np.linalg.norm(cooccurrence, axis=1) > 1e-8
            mapped[seen] = cooccurrence[seen]
        width = text.shape[1]
        out = np.empty((len(text), width + mapped.shape[1]), dtype=np.float32)
        for start in range(0, len(text), MIX_BLOCK_ROWS):
            block = slice(start, start + MIX_BLOCK_ROWS)
            out[block, :width] = np.sqrt(1 - self.weight) * normalize_rows(text[block])
            out[block, width:] = np.sqrt(self.weight) * _unit_or_zero(mapped[block])
            out[block] = normalize_rows(out[block])
        return out


def mix_cooccurrence(
    item_ids: Sequence[str],
    text: np.ndarray,
    sequences: Mapping[str, Sequence[str]],
    *,
    weight: float,
    dim: int,
    window: int = 20,
    fit_max_items: int | None = None,
) -> tuple[np.ndarray, CooccurrenceMix | None]:
    """Mixed vectors of ``item_ids`` (rows of ``text``) and the map; unchanged text and None
    when no item co-occurs with another (nothing to learn from).

    ``sequences`` should already leave the test items out (``Split.before_test``).
    ``fit_max_items``: above it, landmark embeddings (``cooccurrence_embeddings``).
    """
    if not 0.0 < weight < 1.0 + 1e-9:
        raise ValueError(f"cooccurrence weight must be in (0, 1], got {weight}")
    dim = max(1, min(dim, len(item_ids) - 2))
    cooccurrence = cooccurrence_embeddings(
        sequences, item_ids, dim=dim, window=window, fit_max_items=fit_max_items
    )
    seen = np.linalg.norm(cooccurrence, axis=1) > 1e-8
    if seen.sum() < 2:
        return normalize_rows(text), None
    target = np.zeros_like(cooccurrence)  # items x dim: small beside text's items x 384
    target[seen] = normalize_rows(cooccurrence[seen])
    projection = fit_projection(text, target, rows=np.flatnonzero(seen), dtype=np.float64)
    del target
    mix = CooccurrenceMix(float(weight), projection.astype(np.float32))
    # normalized again over the whole array, not reused from above: np.linalg.norm's rounding
    # depends on the array's shape, and these are the floats earlier builds mixed
    return mix.vectors(text, normalize_rows(cooccurrence) * seen[:, None]), mix


def _unit_or_zero(vectors: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return np.where(norms > 1e-8, vectors / np.maximum(norms, 1e-12), 0.0).astype(np.float32)
