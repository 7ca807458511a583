"""A user's history as a token sequence: the one prompt builder of training, of the
refresh's prefix-KV precompute and of serving (online step, models).

The contract (see ``genrec.schemas.token_layout``): an item is its semantic ID,
``depth`` tokens, one per level. A prompt is::

    [BOS] + tokens(item_1) + tokens(item_2) + ... + tokens(item_n)

for the last ``H`` items of the history in time order (``H`` =
``settings.model.history_items``, default 50). The generation target is the next
item's tokens followed by EOS. Pretrained presets may add each item's title as
text *after* its ID tokens, so a prompt still ends where the next ID begins.

Prefix rule: ``prompt(history + new_events)`` is ``prompt(history)`` followed by
the suffix ``history_tokens(new_events)`` as long as the combined history has at
most ``H`` items, so the online path can keep the KV cache of the long history and
prefill only the new suffix. Once a user has more than ``H`` items the window
slides and the prefix changes: the online path then keeps using the cached prefix
(the window computed at the last offline refresh, or the user's last decoded
prompt) extended by every new event, up to ``online.max_prompt_items`` items (1.5H
by default), and starts again from the last ``H`` items past that; every refresh
recomputes the cache from the latest window. Serving prompts thus hold up to 1.5H
items where training windows hold H + 1: positions past a training window are
rotary ones training never saw, and the generative hit rate drops a little with
them (settings.py has the figures; the path before this limit decoded up to 2H
items, H cached and H of suffix); ``max_prompt_items = H`` keeps serving within the
training length, at one full prefill per request for users past H items.

Training uses the same layout on whole windows of a user's sequence: one causal
pass predicts every item of the window from the items before it
(``training_example``). EOS ends a target but is not trained there: at an item
boundary the next item's first token and EOS would compete for the same
position, and the decoder stops after ``depth`` tokens anyway.

Example::

    >>> import numpy as np
    >>> from genrec.schemas.token_layout import TokenLayout
    >>> layout = TokenLayout.for_scratch_model((4, 4))
    >>> table = ItemTokens(["a", "b"], np.array([[0, 1], [2, 3]]), layout)
    >>> history_prompt(["a", "b"], table, max_items=50)
    [1, 4, 9, 6, 11]
    >>> history_prompt(["a"], table, max_items=50) + history_tokens(["b"], table, max_items=50)
    [1, 4, 9, 6, 11]
    >>> target_tokens("b", table)
    [6, 11, 2]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from genrec.schemas.token_layout import TokenLayout

IGNORE_INDEX = -100  # label value that the loss skips


class ItemTokens:
    """Item id -> its semantic-ID tokens under one model's token layout."""

    def __init__(self, item_ids: Sequence[str], codes, layout: TokenLayout) -> None:
        codes = np.asarray(codes, dtype=np.int64)
        if codes.ndim != 2 or codes.shape != (len(item_ids), layout.depth):
            raise ValueError(f"codes must be [n_items, {layout.depth}], got {codes.shape}")
        if len({tuple(row) for row in codes.tolist()}) != len(item_ids):
            raise ValueError("semantic IDs must be unique per item")
        self.layout = layout
        self.item_ids = list(item_ids)
        self.index = {item_id: i for i, item_id in enumerate(self.item_ids)}
        self.table = np.asarray(layout.encode(codes), dtype=np.int64).reshape(codes.shape)

    @classmethod
    def from_semantic_ids(cls, semantic_ids, layout: TokenLayout | None = None) -> ItemTokens:
        """From a ``SemanticIdSet`` (item_ids, codes, layout); ``layout`` overrides its layout."""
        return cls(semantic_ids.item_ids, semantic_ids.codes, layout or semantic_ids.layout)

    def __len__(self) -> int:
        return len(self.item_ids)

    def __contains__(self, item_id: str) -> bool:
        return item_id in self.index

    def tokens_of(self, item_id: str) -> list[int]:
        return self.table[self.index[item_id]].tolist()

    def known(self, item_ids: Sequence[str]) -> list[str]:
        """The items that have a semantic ID, order kept (new items wait for the next refresh)."""
        return [item_id for item_id in item_ids if item_id in self.index]

    def last_known(self, item_ids: Sequence[str], count: int) -> list[str]:
        """``known(item_ids)[-count:]``, walking back from the end: a prompt's window costs
        its ``count`` items, not the whole history (served ones run to 1,000 events)."""
        found, index = [], self.index
        for i in range(len(item_ids) - 1, -1, -1):
            if item_ids[i] in index:
                found.append(item_ids[i])
                if len(found) == count:
                    break
        found.reverse()
        return found


def history_prompt(
    history: Sequence[str],
    item_tokens: ItemTokens,
    max_items: int,
    title_tokens: Mapping[str, Sequence[int]] | None = None,
) -> list[int]:
    """BOS + the tokens of the last ``max_items`` known items of ``history``, oldest first.

    The one prompt builder: training, the refresh's prefix-KV precompute and the online
    recommender all build their prompts here (see the prefix rule above).
    """
    tokens = history_tokens(history, item_tokens, max_items, title_tokens)
    return [item_tokens.layout.bos_token_id, *tokens]


def history_tokens(
    history: Sequence[str],
    item_tokens: ItemTokens,
    max_items: int,
    title_tokens: Mapping[str, Sequence[int]] | None = None,
) -> list[int]:
    """``history_prompt`` without its BOS: the tokens of the last ``max_items`` known items.

    Also what the online path appends to a cached prefix for the events after its cutoff,
    so that ``history_prompt(older) + history_tokens(newer)`` is ``history_prompt(older +
    newer)`` while the combined window holds at most ``max_items`` known items.
    """
    if max_items < 1:
        raise ValueError("max_items must be >= 1")
    tokens: list[int] = []
    for item_id in item_tokens.last_known(history, max_items):
        tokens.extend(item_tokens.tokens_of(item_id))
        if title_tokens is not None:
            tokens.extend(title_tokens.get(item_id, ()))
    return tokens


def target_tokens(item_id: str, item_tokens: ItemTokens) -> list[int]:
    """The next item's ID tokens followed by EOS."""
    if item_id not in item_tokens:
        raise KeyError(f"item {item_id!r} has no semantic ID")
    return item_tokens.tokens_of(item_id) + [item_tokens.layout.eos_token_id]


def training_example(
    items: Sequence[str],
    item_tokens: ItemTokens,
    title_tokens: Mapping[str, Sequence[int]] | None = None,
) -> tuple[list[int], list[int]]:
    """``(input_ids, labels)`` for one window: every item's ID tokens are predicted.

    ``labels[i]`` is the token that follows position ``i`` (already shifted), or
    ``IGNORE_INDEX`` where nothing is trained (title text, the window's end).
    """
    input_ids = [item_tokens.layout.bos_token_id]
    trained = [False]
    for item_id in items:
        codes = item_tokens.tokens_of(item_id)
        input_ids.extend(codes)
        trained.extend([True] * len(codes))
        extra = list(title_tokens.get(item_id, ())) if title_tokens is not None else []
        input_ids.extend(extra)
        trained.extend([False] * len(extra))
    labels = [
        input_ids[i + 1] if trained[i + 1] else IGNORE_INDEX for i in range(len(input_ids) - 1)
    ]
    return input_ids[:-1], labels
