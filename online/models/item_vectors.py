"""Collaborative item vectors in the target's input (offline step, models; read when decoding).

A semantic ID says what an item is like; which items are watched together the
target has to learn from its training windows alone, one pair at a time.
Item-CF and the ANN branch count those pairs over all users at once. So the
target also gets each history item's co-occurrence embedding
(``recall.cooccurrence_embeddings`` of the very sequences it is trained on, unit
length): a learned projection of it is added to the input embedding at the
item's **last** code, the position from which the next item is predicted. Only
there: the item is known once all its codes are in, and the positions before
predict the item's own later codes, which its vector would give away.

Nothing in the token contract changes: prompts are the same tokens, and the
vector is found from the codes themselves (the item whose semantic ID the
``depth`` tokens ending at a position spell). A model call that starts inside an
item (a cached prefix ends one token before its prompt) passes the tokens before
its first one as ``context``. Items without a vector (added to the catalog after
training) get none. The vectors and projection are saved next to the target as
``item_vectors.safetensors``; the target itself stays a plain transformers
checkpoint.

Example::

    >>> import numpy as np, torch
    >>> from genrec.online.decoding.trie import ItemTrie
    >>> from genrec.online.models.presets import PRESETS, build_target
    >>> from genrec.online.prompts import ItemTokens
    >>> from genrec.schemas.token_layout import TokenLayout
    >>> layout = TokenLayout.for_scratch_model((4, 4, 2))
    >>> items = ItemTokens(["a", "b"], np.array([[0, 1, 0], [3, 1, 1]]), layout)
    >>> target = build_target(PRESETS["tiny"], layout)
    >>> trie = ItemTrie.from_item_tokens(items)
    >>> embedding = attach_item_vectors(target, trie, torch.ones(2, 8))
    >>> embedding.item_rows(torch.tensor([items.tokens_of("b")])).tolist()
    [[-1, -1, 1]]
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from genrec.online.decoding.trie import ItemTrie
from genrec.online.prompts import ItemTokens

FILE_NAME = "item_vectors.safetensors"
NO_TOKEN = -1  # context filler: never part of an item


class ItemVectorEmbedding(nn.Module):
    """Token embedding plus ``projection(vectors[item])`` at the last code of every complete item."""

    def __init__(
        self, token_embedding: nn.Embedding, trie: ItemTrie, vectors: torch.Tensor
    ) -> None:
        super().__init__()
        if vectors.ndim != 2 or vectors.shape[0] != trie.n_items:
            raise ValueError(
                f"need one vector per catalog item ({trie.n_items}), got {tuple(vectors.shape)}"
            )
        self.token_embedding = token_embedding
        self.trie = trie  # finds the item a window of codes spells (ItemTrie.item_index)
        device, dtype = token_embedding.weight.device, token_embedding.weight.dtype
        self.register_buffer("vectors", vectors.to(device, dtype), persistent=False)
        hidden = token_embedding.weight.shape[1]
        self.projection = nn.Linear(
            vectors.shape[1], hidden, bias=False, device=device, dtype=dtype
        )
        # the size of a token embedding at initialization (the models' initializer_range)
        nn.init.normal_(self.projection.weight, std=0.02)

    @property
    def weight(self) -> nn.Parameter:
        """The token embedding's weight (tied to the output layer; transformers looks here)."""
        return self.token_embedding.weight

    @property
    def context_width(self) -> int:
        """Tokens before a call's first one that ``forward(..., context=)`` can use."""
        return self.trie.layout.depth - 1

    def item_rows(
        self, input_ids: torch.Tensor, context: torch.Tensor | None = None
    ) -> torch.Tensor:
        """LongTensor like ``input_ids``: the catalog row of the item whose last code is there, else -1.

        ``context[b]``: the ``depth - 1`` tokens before ``input_ids[b, 0]`` (``NO_TOKEN`` if none).
        """
        if context is None:
            context = torch.full(
                (input_ids.shape[0], self.context_width), NO_TOKEN, dtype=torch.long,
                device=input_ids.device,
            )  # fmt: skip
        self.trie = self.trie.to(input_ids.device)  # follows the model (itself if already there)
        ids = torch.cat([context.to(input_ids), input_ids], 1)
        # windows[b, t]: the depth tokens ending at input position t
        return self.trie.item_index(ids.unfold(1, self.trie.layout.depth, 1))

    def forward(
        self, input_ids: torch.Tensor, context: torch.Tensor | None = None, find_items: bool = True
    ) -> torch.Tensor:
        """``find_items=False``: token embeddings only, for calls known to hold no history item."""
        embeddings = self.token_embedding(input_ids)
        if not find_items:
            return embeddings
        rows = self.item_rows(input_ids, context)
        at = rows >= 0
        added = self.projection(self.vectors[rows[at]]).to(embeddings.dtype)
        return embeddings.index_put((*at.nonzero(as_tuple=True),), added, accumulate=True)


def fit_item_vectors(
    sequences: Sequence[Sequence[str]],
    item_tokens: ItemTokens,
    dim: int,
    window: int = 20,
    fit_max_items: int | None = None,
) -> torch.Tensor:
    """Unit co-occurrence embeddings of the catalog (``item_tokens`` order) from ``sequences``.

    Items that never occur get a zero vector. Fit on the sequences the target is
    trained on, never on held-out items. Above ``fit_max_items`` items: landmark
    embeddings (``cooccurrence_embeddings``), so the fit stops growing with the catalog.
    """
    # lazy: genrec.online.branches pulls in scipy.sparse (~0.9 s), which only fitting needs
    from genrec.online.branches import cooccurrence_embeddings, normalize_rows

    by_row = dict(enumerate(sequences))
    vectors = cooccurrence_embeddings(
        by_row, item_tokens.item_ids, dim=dim, window=window, fit_max_items=fit_max_items
    )
    return torch.from_numpy(normalize_rows(vectors))


def attach_item_vectors(model, trie: ItemTrie, vectors: torch.Tensor) -> ItemVectorEmbedding:
    """Wrap ``model``'s input embedding so it adds the item vectors (rows in ``trie`` order)."""
    if item_vector_embedding(model) is not None:
        raise ValueError("the model already has item vectors")
    embedding = ItemVectorEmbedding(model.get_input_embeddings(), trie, vectors)
    embedding.train(model.training)
    model.set_input_embeddings(embedding)
    return embedding


def item_vector_embedding(model) -> ItemVectorEmbedding | None:
    """The model's ``ItemVectorEmbedding``, or None for a plain model."""
    embedding = model.get_input_embeddings()
    return embedding if isinstance(embedding, ItemVectorEmbedding) else None


@contextlib.contextmanager
def plain_input_embeddings(model) -> Iterator[ItemVectorEmbedding | None]:
    """Inside the block the model has its plain token embedding (e.g. for ``save_pretrained``)."""
    embedding = item_vector_embedding(model)
    if embedding is None:
        yield None
        return
    model.set_input_embeddings(embedding.token_embedding)
    try:
        yield embedding
    finally:
        model.set_input_embeddings(embedding)


def save_pretrained_with_item_vectors(model, folder: Path) -> None:
    """``save_pretrained`` of the plain model, plus ``item_vectors.safetensors`` if it has any."""
    with plain_input_embeddings(model) as embedding:
        model.save_pretrained(folder, safe_serialization=True)
    if embedding is not None:
        tensors = {
            "vectors": embedding.vectors.detach().cpu().contiguous(),
            "projection": embedding.projection.weight.detach().cpu().contiguous(),
        }
        save_file(tensors, str(Path(folder) / FILE_NAME))


def load_item_vectors(model, folder: Path, trie: ItemTrie) -> ItemVectorEmbedding | None:
    """Attach the item vectors saved in ``folder`` (if any) to a model loaded from it."""
    path = Path(folder) / FILE_NAME
    if not path.exists():
        return None
    tensors = load_file(str(path))
    embedding = attach_item_vectors(model, trie, tensors["vectors"])
    with torch.no_grad():
        embedding.projection.weight.copy_(tensors["projection"])
    return embedding
