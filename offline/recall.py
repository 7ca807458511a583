"""Fitting the traditional recall branches on the behavior store (offline step).

The branch classes, their artifact format and their queries live with serving
(``genrec.online.branches``); this module chooses what they are fitted on.

Example::

    >>> from genrec.infra.database import make_engine
    >>> from genrec.infra.settings import get_settings
    >>> settings = get_settings()
    >>> branches = fit_store_branches(settings, make_engine(settings.database_url))  # doctest: +SKIP
    >>> save_branches(branches, "var/recall")  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from genrec.infra.progress import progress_bar
from genrec.ingest.history import history_pages, load_item_ids, newest_event_ts
from genrec.online.branches import (
    AnnBranch,
    CooccurrenceSum,
    ItemCFBranch,
    PopularityBranch,
    PopularitySum,
    RecallBranch,
    embeddings_of_cooccurrence,
)

logger = logging.getLogger(__name__)

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
        **_itemcf_ranking(recall),
    )


def _itemcf_ranking(recall) -> dict[str, float | int]:
    """``RecallSettings``' item-CF parameters applied after the co-occurrence is summed
    (what the in-memory and the paged fits share)."""
    return {
        "last_m": recall.itemcf_last_m,
        "recency_decay": recall.itemcf_recency_decay,
        "top_neighbors": recall.itemcf_top_neighbors,
    }


def fit_branches(
    sequences: Mapping[str, Sequence[str]],
    item_ids: Sequence[str],
    recall,
    timestamps_ms: Mapping[str, Sequence[int]] | None = None,
    item_embeddings: np.ndarray | None = None,
) -> dict[str, RecallBranch]:
    """The three branches fitted on ``sequences`` with ``recall`` (``RecallSettings``).

    ANN uses ``item_embeddings`` (rows aligned with ``item_ids``) when given, else the
    eigenvectors of the co-occurrence of ``sequences``. The co-occurrences are summed
    ``recall.fit_users_per_read`` users at a time under the store fit's bounds
    (``fit_store_branches``), so memory is those sums plus one page's pairs, not every
    pair of ``sequences`` at once; up to a page of users (ML-100K) it is the one-shot fit.
    """
    popularity = PopularityBranch.fit(
        sequences,
        item_ids,
        timestamps_ms if recall.popularity_half_life_days is not None else None,
        half_life_days=recall.popularity_half_life_days,
    )
    itemcf, ann = cooccurrence_sums(len(item_ids), recall, ann=item_embeddings is None)
    index = {item: i for i, item in enumerate(item_ids)}
    users = list(sequences.values())
    for start in range(0, len(users), recall.fit_users_per_read):
        page = users[start : start + recall.fit_users_per_read]
        encoded = [[index[i] for i in sequence if i in index] for sequence in page]
        itemcf.add(encoded)
        if ann is not None:
            ann.add(encoded)
    source = "given"
    if ann is not None:
        item_embeddings = embeddings_of_cooccurrence(
            ann.matrix(), dim=recall.ann_dim, fit_max_items=recall.ann_fit_max_items
        )
        source = "cooccurrence"
    return {
        "popularity": popularity,
        "itemcf": ItemCFBranch.from_cooccurrence(item_ids, itemcf, **_itemcf_ranking(recall)),
        "ann": _ann_branch(item_ids, item_embeddings, recall, source),
    }


def cooccurrence_sums(
    n_items: int, recall, ann: bool = True
) -> tuple[CooccurrenceSum, CooccurrenceSum | None]:
    """Empty running sums of the item-CF and (``ann``) ANN co-occurrences, bounded by
    ``recall.cooccurrence_max_entries`` / ``cooccurrence_prune_to``."""
    bound = {
        "max_entries": recall.cooccurrence_max_entries,
        "prune_to": recall.cooccurrence_prune_to,
    }
    itemcf = CooccurrenceSum(
        n_items, recall.itemcf_window, recall.itemcf_distance_decay,
        recall.itemcf_backward_weight, **bound,
    )  # fmt: skip
    return itemcf, CooccurrenceSum(n_items, recall.ann_window, **bound) if ann else None


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
    """Branches fitted on every stored event up to ``until_ts_ms`` (what serving uses).

    Users are read ``recall.fit_users_per_read`` at a time and each page is counted into
    running sums (popularity scores, the item-CF and ANN co-occurrences), so memory is
    those sums plus one page, not the store's histories or all their item pairs. With
    fewer users than a page (ML-100K) this is the one-shot fit of ``fit_branches``.
    """
    recall = settings.recall
    latest = newest_event_ts(engine, until_ts_ms=until_ts_ms)
    if latest is None:
        raise ValueError("the behavior store has no events to fit recall branches on")
    item_ids = load_item_ids(engine)
    index = {item: i for i, item in enumerate(item_ids)}
    popularity = PopularitySum(len(item_ids), recall.popularity_half_life_days, latest)
    itemcf, ann = cooccurrence_sums(
        len(item_ids), recall, ann=recall.ann_embeddings != "semantic_ids"
    )
    pages = history_pages(engine, until_ts_ms=until_ts_ms, users_per_page=recall.fit_users_per_read)
    for page in progress_bar(pages, desc="fit recall", unit="page"):
        # an item first seen after ``load_item_ids`` (ingest runs on) waits for the next fit
        known = [[e for e in events if e.item_id in index] for events in page.values()]
        encoded = [[index[e.item_id] for e in events] for events in known]
        popularity.add([p for seq in encoded for p in seq], [e.ts_ms for h in known for e in h])
        itemcf.add(encoded)
        if ann is not None:
            ann.add(encoded)
    logger.info(
        "fit recall: %d events, %d pages; item-CF %d pairs (%d prunes)%s",
        popularity.events, itemcf.pages, itemcf.total.nnz, itemcf.prunes,
        "" if ann is None else f", ANN {ann.total.nnz} pairs ({ann.prunes} prunes)",
    )  # fmt: skip
    if ann is None:
        embeddings, source = semantic_id_embeddings(settings, engine, item_ids), "given"
    else:
        embeddings = embeddings_of_cooccurrence(
            ann.matrix(), dim=recall.ann_dim, fit_max_items=recall.ann_fit_max_items
        )
        source = "cooccurrence"
    return {
        "popularity": popularity.branch(item_ids),
        "itemcf": ItemCFBranch.from_cooccurrence(item_ids, itemcf, **_itemcf_ranking(recall)),
        "ann": _ann_branch(item_ids, embeddings, recall, source),
    }


def _ann_branch(item_ids: Sequence[str], embeddings: np.ndarray, recall, source: str) -> AnnBranch:
    return AnnBranch.fit(
        item_ids,
        embeddings,
        last_m=recall.ann_last_m,
        half_life_items=recall.ann_half_life_items,
        half_life_days=recall.ann_half_life_days,
        source=source,
        exact_max_items=recall.ann_exact_max_items,
        nprobe=recall.ann_nprobe,
    )


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
