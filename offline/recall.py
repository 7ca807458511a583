"""Fitting the traditional recall branches on the behavior store (offline step).

The branch classes, their artifact format and their queries live with serving
(``genrec.online.branches``); this module chooses what they are fitted on.

Example::

    >>> from genrec.infra.database import make_engine
    >>> from genrec.infra.settings import get_settings
    >>> settings = get_settings()
    >>> branches = fit_store_branches(settings, make_engine(settings.database))  # doctest: +SKIP
    >>> save_branches(branches, "var/recall")  # doctest: +SKIP
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from genrec.ingest.history import load_item_ids, load_user_histories
from genrec.online.branches import (
    AnnBranch,
    ItemCFBranch,
    PopularityBranch,
    RecallBranch,
    cooccurrence_embeddings,
)

# --- fitting all branches ---------------------------------------------------------

BRANCHES = ("popularity", "itemcf", "ann")


def fit_itemcf(
    sequences: Mapping[str, Sequence[str]], item_ids: Sequence[str], recall
) -> ItemCFBranch:
    """The item-CF branch fitted on ``sequences`` with ``recall``'s (``RecallSettings``) item-CF
    settings."""
    return ItemCFBranch.fit(
        sequences,
        item_ids,
        window=recall.itemcf_window,
        distance_decay=recall.itemcf_distance_decay,
        backward_weight=recall.itemcf_backward_weight,
        last_m=recall.itemcf_last_m,
        recency_decay=recall.itemcf_recency_decay,
        top_neighbors=recall.itemcf_top_neighbors,
    )


def fit_branches(
    sequences: Mapping[str, Sequence[str]],
    item_ids: Sequence[str],
    recall,
    timestamps_ms: Mapping[str, Sequence[int]] | None = None,
    item_embeddings: np.ndarray | None = None,
) -> dict[str, RecallBranch]:
    """The three branches fitted on ``sequences`` with ``recall`` (``RecallSettings``).

    ANN uses ``item_embeddings`` (rows aligned with ``item_ids``) when given, else the
    SVD of the co-occurrence of ``sequences``.
    """
    popularity = PopularityBranch.fit(
        sequences,
        item_ids,
        timestamps_ms if recall.popularity_half_life_days is not None else None,
        half_life_days=recall.popularity_half_life_days,
    )
    itemcf = fit_itemcf(sequences, item_ids, recall)
    source = "given"
    if item_embeddings is None:
        item_embeddings = cooccurrence_embeddings(
            sequences, item_ids, dim=recall.ann_dim, window=recall.ann_window
        )
        source = "cooccurrence"
    ann = AnnBranch.fit(
        item_ids,
        item_embeddings,
        last_m=recall.ann_last_m,
        half_life_items=recall.ann_half_life_items,
        half_life_days=recall.ann_half_life_days,
        source=source,
    )
    return {"popularity": popularity, "itemcf": itemcf, "ann": ann}


def semantic_id_embeddings(settings, engine, item_ids: Sequence[str]) -> np.ndarray:
    """Text embeddings of the semantic-ID build, rows aligned with ``item_ids`` (missing: zeros)."""
    try:
        # lazy: the semantic-ID build loads torch, which fitting recall never needs otherwise
        from genrec.offline.semantic_ids.build import load_item_embeddings
    except ImportError as exc:
        raise FileNotFoundError(
            "recall.ann_embeddings='semantic_ids' needs genrec.offline.semantic_ids.build; "
            "use 'cooccurrence' or build semantic IDs first"
        ) from exc
    their_ids, vectors = load_item_embeddings(settings, engine)
    position = {item: i for i, item in enumerate(their_ids)}
    aligned = np.zeros((len(item_ids), vectors.shape[1]), dtype=np.float32)
    for row, item in enumerate(item_ids):
        if item in position:
            aligned[row] = vectors[position[item]]
    return aligned


def fit_store_branches(settings, engine, until_ts_ms: int | None = None) -> dict[str, RecallBranch]:
    """Branches fitted on every stored event up to ``until_ts_ms`` (what serving uses)."""
    histories = load_user_histories(engine, until_ts_ms=until_ts_ms)
    if not histories:
        raise ValueError("the behavior store has no events to fit recall branches on")
    item_ids = load_item_ids(engine)
    sequences = {user: [e.item_id for e in events] for user, events in histories.items()}
    stamps = {user: [e.ts_ms for e in events] for user, events in histories.items()}
    embeddings = None
    if settings.recall.ann_embeddings == "semantic_ids":
        embeddings = semantic_id_embeddings(settings, engine, item_ids)
    return fit_branches(sequences, item_ids, settings.recall, stamps, embeddings)


def save_branches(branches: Mapping[str, RecallBranch], root: str | Path) -> Path:
    """Each branch into ``root/<name>``, swapped in by rename so readers see old or new."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for name, branch in branches.items():
        staging, final, old = root / f".{name}.new", root / name, root / f".{name}.old"
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
        branch.save(staging)
        if final.exists():
            final.rename(old)
        staging.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    return root
