"""Traditional recall branches (online step): the fitted branches, queried when serving.

Fitting them on the behavior store is the offline step (``genrec.offline.recall``).

Three branches, each fitted on users' time-ordered item sequences and then asked
for one user's top-k items given that user's history:

- ``PopularityBranch``: recency-weighted item counts (exponential decay with a
  half-life measured back from the latest fitted event; ``half_life_days=None``
  gives plain counts).
- ``ItemCFBranch``: item-item co-occurrence within a window of consecutive items
  of each sequence (weighted by distance), cosine normalized; a user's score is a
  recency-weighted sum over the similarity rows of the last ``last_m`` items.
- ``AnnBranch``: user vector = decayed mean of the history's item embeddings,
  searched in a FAISS inner-product index over normalized item embeddings.

Serving (``recommend_batch``) never builds a row over the whole catalog: popularity
reads the head of a list ranked once at load, item-CF sums the neighbour lists of each
user's last items and ranks only the items they touch, ANN asks FAISS for k + seen items.
Every branch breaks ties by catalog position.

Fitted state is a versioned artifact without pickle: ``manifest.json`` (kind,
format, parameters, item ids) plus ``arrays.npz`` read with
``allow_pickle=False``. ``load_branch(folder)`` reopens any of them.

Example::

    >>> sequences = {"u1": ["a", "b", "c"], "u2": ["a", "b", "d"], "u3": ["b", "c"]}
    >>> branch = ItemCFBranch.fit(sequences, item_ids=["a", "b", "c", "d"], window=2)
    >>> [item for item, _ in branch.recommend(["a"], k=2, exclude={"a"})]
    ['b', 'd']
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from scipy import sparse

FORMAT = "genrec.recall/1"
MS_PER_DAY = 86_400_000
Recommendation = tuple[str, float]


class RecallBranch:
    """What every branch shares: the item vocabulary, top-k selection, save and load."""

    kind: ClassVar[str] = ""

    def __init__(self, item_ids: Sequence[str], params: dict[str, Any]) -> None:
        self.item_ids = list(item_ids)
        self.item_index = {item_id: i for i, item_id in enumerate(self.item_ids)}
        if len(self.item_index) != len(self.item_ids):
            raise ValueError(f"{self.kind}: item ids must be unique")
        self.params = dict(params)

    # --- to override -------------------------------------------------------

    def rank_batch(
        self,
        histories: Sequence[Sequence[str]],
        k: int,
        excludes: Sequence[Iterable[str] | None],
        timestamps_ms: Sequence[Sequence[int] | None],
    ) -> list[list[Recommendation]]:
        """Each user's top-k with a positive score, best first, ties by catalog position,
        ``excludes`` left out; the work grows with what the users touch, not the catalog."""
        raise NotImplementedError

    def arrays(self) -> dict[str, np.ndarray]:
        raise NotImplementedError

    @classmethod
    def from_arrays(
        cls, item_ids: list[str], params: dict[str, Any], arrays: Mapping[str, np.ndarray]
    ) -> RecallBranch:
        raise NotImplementedError

    # --- shared ------------------------------------------------------------

    def recommend(
        self,
        history: Sequence[str],
        k: int,
        exclude: Iterable[str] | None = None,
        timestamps_ms: Sequence[int] | None = None,
    ) -> list[Recommendation]:
        """Top-k (item_id, score) for one user, best first, ``exclude`` left out."""
        return self.recommend_batch([history], k, [exclude], [timestamps_ms])[0]

    def recommend_batch(
        self,
        histories: Sequence[Sequence[str]],
        k: int,
        excludes: Sequence[Iterable[str] | None] | None = None,
        timestamps_ms: Sequence[Sequence[int] | None] | None = None,
        chunk_size: int = 1024,
    ) -> list[list[Recommendation]]:
        """``recommend`` for many users at once; only items with a positive score come back."""
        if k <= 0:
            raise ValueError(f"k must be positive, got {k}")
        excludes = excludes if excludes is not None else [None] * len(histories)
        timestamps_ms = timestamps_ms if timestamps_ms is not None else [None] * len(histories)
        if not len(excludes) == len(timestamps_ms) == len(histories):
            raise ValueError("histories, excludes and timestamps_ms must have the same length")
        results: list[list[Recommendation]] = []
        for start in range(0, len(histories), chunk_size):
            stop = start + chunk_size
            results += self.rank_batch(
                histories[start:stop], k, excludes[start:stop], timestamps_ms[start:stop]
            )
        return results

    def indices(self, history: Iterable[str]) -> np.ndarray:
        """Catalog positions of the history's known items, in its order (unknown ones are
        skipped): one dict lookup an item (23 against 33 us for a 500-item exclusion set)."""
        positions = list(map(self.item_index.get, history))
        if None in positions:
            positions = [p for p in positions if p is not None]
        return np.array(positions, dtype=np.int64)

    def recent_known(self, history: Sequence[str], m: int) -> list[int]:
        """Where in ``history`` its last ``m`` known items are, oldest first: a walk back from
        the end that stops at ``m``, so its cost does not grow with the history (served
        histories run to ``online.max_history_events``, branches read 10-20 of them)."""
        found, index = [], self.item_index
        for i in range(len(history) - 1, -1, -1):
            if history[i] in index:
                found.append(i)
                if len(found) == m:
                    break
        found.reverse()
        return found

    def save(self, folder: str | Path) -> Path:
        """Write ``arrays.npz`` then ``manifest.json`` (last, so a complete folder has one)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        np.savez(folder / "arrays.npz", **self.arrays())
        manifest = {
            "format": FORMAT,
            "kind": self.kind,
            "params": self.params,
            "item_ids": self.item_ids,
            "saved_at": datetime.now(UTC).isoformat(timespec="seconds"),
        }
        tmp = folder / "manifest.json.tmp"
        tmp.write_text(json.dumps(manifest))
        tmp.replace(folder / "manifest.json")
        return folder

    @classmethod
    def load(cls, folder: str | Path) -> RecallBranch:
        branch = load_branch(folder)
        if not isinstance(branch, cls):
            raise ValueError(f"{folder} holds a {branch.kind!r} branch, not {cls.kind!r}")
        return branch


def load_branch(folder: str | Path) -> RecallBranch:
    """Reopen a branch saved by ``save``; arrays are read without pickle."""
    folder = Path(folder)
    manifest_path = folder / "manifest.json"
    if not manifest_path.exists():
        raise FileNotFoundError(f"no recall branch in {folder} (manifest.json missing)")
    manifest = json.loads(manifest_path.read_text())
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{folder}: unknown recall format {manifest.get('format')!r}")
    kinds = {c.kind: c for c in (PopularityBranch, ItemCFBranch, AnnBranch)}
    if manifest.get("kind") not in kinds:
        raise ValueError(f"{folder}: unknown recall branch kind {manifest.get('kind')!r}")
    with np.load(folder / "arrays.npz", allow_pickle=False) as npz:
        arrays = {name: npz[name] for name in npz.files}
    return kinds[manifest["kind"]].from_arrays(manifest["item_ids"], manifest["params"], arrays)


def _vocabulary(
    sequences: Mapping[str, Sequence[str]], item_ids: Sequence[str] | None
) -> list[str]:
    if item_ids is not None:
        return list(item_ids)
    return sorted({item for sequence in sequences.values() for item in sequence})


# --- popularity ---------------------------------------------------------------


class PopularityBranch(RecallBranch):
    """The same recency-weighted popular items for everyone (minus what they have seen)."""

    kind = "popularity"

    def __init__(self, item_ids: Sequence[str], params: dict[str, Any], scores: np.ndarray) -> None:
        super().__init__(item_ids, params)
        self.scores = np.asarray(scores, dtype=np.float64)
        # every positive-score item once, best first, ties by catalog position (serving
        # reads its head instead of ranking the whole catalog per user)
        positive = np.flatnonzero(self.scores > 0)
        self.ranked = positive[np.lexsort((positive, -self.scores[positive]))]

    @classmethod
    def fit(
        cls,
        sequences: Mapping[str, Sequence[str]],
        item_ids: Sequence[str] | None = None,
        timestamps_ms: Mapping[str, Sequence[int]] | None = None,
        half_life_days: float | None = 30.0,
    ) -> PopularityBranch:
        """Counts each event with weight 0.5 ** (age / half-life), age from the latest event."""
        if half_life_days is not None and (half_life_days <= 0 or timestamps_ms is None):
            raise ValueError("recency weighting needs timestamps_ms and half_life_days > 0")
        vocabulary = _vocabulary(sequences, item_ids)
        index = {item: i for i, item in enumerate(vocabulary)}
        positions: list[int] = []
        stamps: list[int] = []
        for user, sequence in sequences.items():
            user_stamps = timestamps_ms[user] if timestamps_ms is not None else [0] * len(sequence)
            if len(user_stamps) != len(sequence):
                raise ValueError(
                    f"user {user}: {len(sequence)} items but {len(user_stamps)} timestamps"
                )
            for item, ts in zip(sequence, user_stamps, strict=True):
                if item in index:
                    positions.append(index[item])
                    stamps.append(ts)
        latest = max(stamps) if stamps else 0
        counts = PopularitySum(len(vocabulary), half_life_days, latest)
        counts.add(positions, stamps)
        return counts.branch(vocabulary)

    def rank_batch(self, histories, k, excludes, timestamps_ms) -> list[list[Recommendation]]:
        """The ranked list, skipping each user's excluded items: O(k + excluded) per user."""
        results, item_ids = [], self.item_ids
        for exclude in excludes:
            exclude = exclude if isinstance(exclude, set | frozenset) else set(exclude or ())
            # the head holds k items that are not excluded; they are found checking ids
            # against the exclusion, not mapping every excluded id to a position
            head = self.ranked[: k + len(exclude)].tolist()
            kept = []
            for i in head:
                if item_ids[i] not in exclude:
                    kept.append(i)
                    if len(kept) == k:
                        break
            scores = self.scores[kept].tolist()
            results.append([(item_ids[i], s) for i, s in zip(kept, scores, strict=True)])
        return results

    def arrays(self) -> dict[str, np.ndarray]:
        return {"scores": self.scores}

    @classmethod
    def from_arrays(cls, item_ids, params, arrays) -> PopularityBranch:
        return cls(item_ids, params, arrays["scores"])


class PopularitySum:
    """Popularity scores summed over pages of events (``PopularityBranch.fit``'s counting).

    The reference time (the latest event) must be known before the first page, e.g. from
    one aggregate query (``genrec.ingest.history.newest_event_ts``), so that each event's
    weight is final when it is counted. Memory O(items); time O(events).
    """

    def __init__(self, n_items: int, half_life_days: float | None, reference_ts_ms: int) -> None:
        if half_life_days is not None and half_life_days <= 0:
            raise ValueError("recency weighting needs half_life_days > 0")
        self.half_life_days = half_life_days
        self.reference_ts_ms = int(reference_ts_ms)
        self.scores = np.zeros(n_items, dtype=np.float64)
        self.events = 0

    def add(self, positions: Sequence[int], stamps: Sequence[int]) -> None:
        """Count one page: catalog positions of its events and their times (ms)."""
        ts = np.asarray(stamps, dtype=np.float64)
        if self.half_life_days is None:
            weights = np.ones_like(ts)
        else:
            age = float(self.reference_ts_ms) - ts
            weights = 0.5 ** (age / (self.half_life_days * MS_PER_DAY))
        page = np.bincount(
            np.asarray(positions, dtype=np.int64), weights, minlength=len(self.scores)
        )
        # the first page is taken as it is: a single-page fit is the one-shot count exactly
        self.scores = page if self.events == 0 else self.scores + page
        self.events += len(ts)

    def branch(self, item_ids: Sequence[str]) -> PopularityBranch:
        params = {
            "half_life_days": self.half_life_days,
            "reference_ts_ms": self.reference_ts_ms,
            "events": self.events,
        }
        return PopularityBranch(item_ids, params, self.scores)


# --- item-CF --------------------------------------------------------------------


def cooccurrence_matrix(
    sequences: Iterable[Sequence[int]],
    n_items: int,
    window: int,
    distance_decay: float = 1.0,
    backward_weight: float = 1.0,
) -> sparse.csr_matrix:
    """C[i, j] = sum over pairs (i before j, at most ``window`` apart) of decay ** (distance - 1).

    Pairs where j came before i get ``backward_weight`` times that. Repeated pairs count
    once per occurrence.
    """
    rows: list[np.ndarray] = []
    cols: list[np.ndarray] = []
    vals: list[np.ndarray] = []
    for sequence in sequences:
        seq = np.asarray(sequence, dtype=np.int64)
        for distance in range(1, min(window, len(seq) - 1) + 1):
            earlier, later = seq[:-distance], seq[distance:]
            weight = np.full(len(earlier), distance_decay ** (distance - 1))
            rows += [earlier, later]
            cols += [later, earlier]
            vals += [weight, weight * backward_weight]
    if not rows:
        return sparse.csr_matrix((n_items, n_items))
    matrix = sparse.coo_matrix(
        (np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))),
        shape=(n_items, n_items),
    ).tocsr()
    matrix.setdiag(0)
    matrix.eliminate_zeros()
    return matrix


def _keep_top_per_row(matrix: sparse.csr_matrix, top: int) -> sparse.csr_matrix:
    """Only the ``top`` largest entries of each row (bounds size and online latency)."""
    matrix = matrix.tocsr()
    keep = np.zeros(matrix.nnz, dtype=bool)
    for row in range(matrix.shape[0]):
        start, stop = matrix.indptr[row], matrix.indptr[row + 1]
        if stop - start <= top:
            keep[start:stop] = True
        else:
            best = np.argpartition(-matrix.data[start:stop], top - 1)[:top]
            keep[start + best] = True
    matrix.data = np.where(keep, matrix.data, 0.0)
    matrix.eliminate_zeros()
    return matrix


def _prune_rows(
    matrix: sparse.csr_matrix, keep: int, column_scale: np.ndarray, budget: int | None = None
) -> sparse.csr_matrix:
    """Each row's ``keep`` largest entries by value x ``column_scale`` (ties: lower column);
    vectorized (``_row_rank_order``, no global sort of the values), for the running sums of
    ``CooccurrenceSum``.

    With ``budget``, when more than that many entries are left, only ``budget`` stay: each
    row's first ``max(1, budget // (2 rows))`` (a rare item keeps its best neighbours), then
    the rest by value x scale[row] x scale[column] (the item-CF cosine, comparable across
    rows; ties: row, then column; a selection, not a sort). Without it, rows x ``keep``
    entries can outgrow any bound (1M items x 400) and every page would prune again.
    """
    matrix.sum_duplicates()
    rows = np.repeat(np.arange(matrix.shape[0]), np.diff(matrix.indptr))
    rank_key = matrix.data * column_scale[matrix.indices]
    order = _row_rank_order(rows, rank_key, matrix.shape[0])
    rank = np.arange(matrix.nnz) - matrix.indptr[rows[order]]
    within = rank < keep
    kept = order[within]
    if budget is not None and len(kept) > budget:
        floor = max(1, budget // (2 * matrix.shape[0]))
        first = rank[within] < floor
        rest = kept[~first]
        cosine = rank_key[rest] * column_scale[rows[rest]]
        room = max(0, budget - int(first.sum()))
        kept = np.concatenate([kept[first], rest[_largest_first(cosine, room)]])
    mask = np.zeros(matrix.nnz, dtype=bool)
    mask[kept] = True  # back in (row, column) order: still canonical CSR
    kept = np.flatnonzero(mask)
    indptr = np.concatenate([[0], np.cumsum(np.bincount(rows[kept], minlength=matrix.shape[0]))])
    return sparse.csr_matrix((matrix.data[kept], matrix.indices[kept], indptr), shape=matrix.shape)


def _row_rank_order(rows: np.ndarray, keys: np.ndarray, n_rows: int) -> np.ndarray:
    """The entries in order of (row, key descending, position): ``np.lexsort((positions,
    -keys, rows))`` for grouped ``rows`` and keys >= 0, in a fraction of its time.

    A non-negative float's bit pattern orders as the float does, so one int64 per entry
    holds the row in its high bits and the key's leading bits, inverted, below it. A stable
    sort of that is fast (the rows are already grouped: it only orders within them) and
    exact but where two different keys share their leading bits; those few runs are then
    sorted again on the whole key. Memory: a few int64 per entry.
    """
    if not len(keys):
        return np.zeros(0, dtype=np.int64)
    if float(keys.min()) < 0:
        return np.lexsort((np.arange(len(keys)), -keys, rows))
    # -0.0 has the sign bit set: max(., 0) gives it +0.0's pattern, as it compares equal
    bits = np.maximum(np.ascontiguousarray(keys, dtype=np.float64).view(np.int64), 0)
    key_bits = 63 - max(1, int(n_rows - 1).bit_length())
    packed = ((1 << key_bits) - 1) - (bits >> (63 - key_bits))
    packed |= rows.astype(np.int64) << key_bits
    order = np.argsort(packed, kind="stable")
    packed = packed[order]
    starts = np.flatnonzero(np.r_[True, packed[1:] != packed[:-1]])
    del packed
    sorted_bits = bits[order]
    mixed = np.minimum.reduceat(sorted_bits, starts) != np.maximum.reduceat(sorted_bits, starts)
    if mixed.any():
        lengths = np.diff(np.r_[starts, len(order)])
        slots = np.flatnonzero(np.repeat(mixed, lengths))
        run_id = np.repeat(np.flatnonzero(mixed), lengths[mixed])  # aligned with slots
        members = order[slots]
        order[slots] = members[np.lexsort((members, -bits[members], run_id))]
    return order


def _largest_first(values: np.ndarray, count: int) -> np.ndarray:
    """Positions of the ``count`` largest values, ties to the earlier position: the set of
    ``np.argsort(-values, kind="stable")[:count]``, by a selection (O(n)) instead of a sort."""
    if count <= 0:
        return np.zeros(0, dtype=np.int64)
    if count >= len(values):
        return np.arange(len(values))
    threshold = np.partition(values, len(values) - count)[len(values) - count]
    above = np.flatnonzero(values > threshold)
    tied = np.flatnonzero(values == threshold)[: count - len(above)]
    return np.concatenate([above, tied])


class CooccurrenceSum:
    """``cooccurrence_matrix`` summed over pages of sequences, plus item occurrence counts.

    A fit that reads users a page at a time adds each page's matrix to a CSR sum, so
    memory is the sum (12 bytes per distinct item pair) plus one page's pairs, never
    every pair occurrence of the store. A user's pairs lie within their own sequence,
    so pages of whole users sum to exactly the one-shot matrix (up to the order of
    floating-point additions; a single page is the one-shot matrix bit for bit).

    ``max_entries`` bounds the sum: when a page leaves it with more distinct pairs, every
    row is cut to its ``prune_to`` largest entries, ranked by C[i, j] / sqrt(n_j) over the
    counts so far (the cosine order the item-CF fit ranks by, for row i), and, where that
    still leaves more than ``max_entries / 2`` (many items: 1M x 400), the weakest pairs
    by cosine go too, down to ``max_entries / 2``, every row keeping at least its best
    ``max_entries / (4 items)`` (at least 1; ``_prune_rows``). That is an approximation: a
    pair cut early loses what it had summed, and counts again from the next page on.
    Memory then stays about ``max_entries`` entries (or one per item, if more), and a
    prune leaves room for pages to come. None: no bound (exact).
    """

    def __init__(
        self,
        n_items: int,
        window: int,
        distance_decay: float = 1.0,
        backward_weight: float = 1.0,
        *,
        max_entries: int | None = None,
        prune_to: int = 400,
    ) -> None:
        if prune_to < 1:
            raise ValueError("prune_to must be >= 1")
        self.n_items, self.window = n_items, window
        self.distance_decay, self.backward_weight = distance_decay, backward_weight
        self.max_entries, self.prune_to = max_entries, prune_to
        self.total = sparse.csr_matrix((n_items, n_items))
        self.counts = np.zeros(n_items, dtype=np.int64)
        self.pages = 0
        self.prunes = 0

    def add(self, encoded: Sequence[Sequence[int]]) -> None:
        """Add one page: sequences of catalog positions (one per user, time order)."""
        flat = [np.asarray(s, dtype=np.int64) for s in encoded]
        if flat:
            self.counts += np.bincount(np.concatenate(flat), minlength=self.n_items)
        page = cooccurrence_matrix(
            encoded, self.n_items, self.window, self.distance_decay, self.backward_weight
        )
        self.total = page if self.pages == 0 else self.total + page
        self.pages += 1
        if self.max_entries is not None and self.total.nnz > self.max_entries:
            scale = 1.0 / np.sqrt(np.maximum(self.counts, 1).astype(np.float64))
            self.total = _prune_rows(self.total, self.prune_to, scale, self.max_entries // 2)
            self.prunes += 1

    def matrix(self) -> sparse.csr_matrix:
        """The summed co-occurrence (float64 CSR, no diagonal, no explicit zeros)."""
        self.total.eliminate_zeros()
        return self.total


# ItemCFBranch.neighbor_sums sums into a dense users x items array while it has at most
# this many entries per neighbour product, plus a floor (8 MiB of float64): its cost is
# then linear, where the sparse path sorts the products' keys.
DENSE_SUMS_PER_PRODUCT = 8
DENSE_SUMS_MIN = 1 << 20


class ItemCFBranch(RecallBranch):
    """Windowed co-occurrence item-CF; a user's last ``last_m`` items vote for their neighbors."""

    kind = "itemcf"

    def __init__(self, item_ids, params, similarity: sparse.csr_matrix) -> None:
        super().__init__(item_ids, params)
        self.similarity = similarity.tocsr().astype(np.float32)

    @classmethod
    def fit(
        cls,
        sequences: Mapping[str, Sequence[str]],
        item_ids: Sequence[str] | None = None,
        window: int = 5,
        distance_decay: float = 0.8,
        backward_weight: float = 1.0,
        last_m: int = 10,
        recency_decay: float = 0.7,
        top_neighbors: int = 200,
    ) -> ItemCFBranch:
        """S[i, j] = C[i, j] / sqrt(n_i * n_j), n_i = occurrences of item i."""
        if window < 1 or last_m < 1 or top_neighbors < 1:
            raise ValueError("window, last_m and top_neighbors must be >= 1")
        vocabulary = _vocabulary(sequences, item_ids)
        index = {item: i for i, item in enumerate(vocabulary)}
        cooccurrence = CooccurrenceSum(len(vocabulary), window, distance_decay, backward_weight)
        cooccurrence.add([[index[i] for i in seq if i in index] for seq in sequences.values()])
        return cls.from_cooccurrence(
            vocabulary, cooccurrence, last_m=last_m, recency_decay=recency_decay,
            top_neighbors=top_neighbors,
        )  # fmt: skip

    @classmethod
    def from_cooccurrence(
        cls,
        item_ids: Sequence[str],
        cooccurrence: CooccurrenceSum,
        *,
        last_m: int = 10,
        recency_decay: float = 0.7,
        top_neighbors: int = 200,
    ) -> ItemCFBranch:
        """The branch of a co-occurrence summed over pages (rows aligned with ``item_ids``):
        cosine-normalized, each row cut to its ``top_neighbors`` best."""
        if last_m < 1 or top_neighbors < 1:
            raise ValueError("last_m and top_neighbors must be >= 1")
        inv_norm = 1.0 / np.sqrt(np.maximum(cooccurrence.counts, 1).astype(np.float64))
        co = cooccurrence.matrix()
        similarity = sparse.diags(inv_norm) @ co @ sparse.diags(inv_norm)
        similarity = _keep_top_per_row(similarity, top_neighbors)
        params = {
            "window": cooccurrence.window,
            "distance_decay": cooccurrence.distance_decay,
            "backward_weight": cooccurrence.backward_weight,
            "last_m": last_m,
            "recency_decay": recency_decay,
            "top_neighbors": top_neighbors,
        }
        return cls(item_ids, params, similarity)

    def user_weights(self, histories: Sequence[Sequence[str]]) -> sparse.csr_matrix:
        """(users x items): recency_decay ** (steps back) on each user's last ``last_m`` items."""
        last_m, decay = self.params["last_m"], self.params["recency_decay"]
        rows, cols, vals = [], [], []
        for row, history in enumerate(histories):
            recent = self.indices([history[i] for i in self.recent_known(history, last_m)])
            rows.append(np.full(len(recent), row))
            cols.append(recent)
            vals.append(decay ** np.arange(len(recent) - 1, -1, -1, dtype=np.float64))
        shape = (len(histories), len(self.item_ids))
        if not rows:
            return sparse.csr_matrix(shape)
        return sparse.csr_matrix(
            (np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=shape
        )

    def neighbor_sums(self, weights: sparse.csr_matrix) -> tuple[np.ndarray, np.ndarray]:
        """The nonzero entries of ``weights @ similarity``: keys user * items + item, sorted,
        and their sums. Each user's neighbour lists are gathered and summed over the items
        they touch, in the order and float64 arithmetic of scipy's sparse product (so the
        scores are its scores bit for bit), never a row over the whole catalog."""
        s, n_items = self.similarity, len(self.item_ids)
        users = np.repeat(np.arange(weights.shape[0], dtype=np.int64), np.diff(weights.indptr))
        starts = s.indptr[weights.indices].astype(np.int64)
        lengths = s.indptr[weights.indices + 1] - starts
        ends = np.cumsum(lengths)
        total = int(ends[-1]) if len(ends) else 0
        # position in s of every neighbour of every (user, history item), row after row
        entries = np.arange(total) + np.repeat(starts - ends + lengths, lengths)
        keys = np.repeat(users * n_items, lengths) + s.indices[entries]
        products = np.repeat(weights.data, lengths) * s.data[entries].astype(np.float64)
        # bincount adds in array order, as the sparse product does per output entry
        span = weights.shape[0] * n_items
        if span <= DENSE_SUMS_PER_PRODUCT * len(keys) + DENSE_SUMS_MIN:
            # a batch x catalog accumulator no larger than a few times the products: two
            # linear passes instead of sorting every product's key (1.6 vs 29 ms for 64
            # ML-100K users), the same sums bit for bit
            sums = np.bincount(keys, weights=products, minlength=span)
            touched = np.zeros(span, dtype=bool)
            touched[keys] = True
            unique = np.flatnonzero(touched)
            return unique, sums[unique]
        unique, inverse = np.unique(keys, return_inverse=True)
        sums = np.bincount(inverse.ravel(), weights=products, minlength=len(unique))
        return unique, sums

    def rank_batch(self, histories, k, excludes, timestamps_ms) -> list[list[Recommendation]]:
        """Top-k over the items the users' neighbour lists touch (history x neighbours)."""
        n_items = len(self.item_ids)
        keys, sums = self.neighbor_sums(self.user_weights(histories))
        keep = sums > 0
        excluded = [row * n_items + self.indices(e) for row, e in enumerate(excludes) if e]
        if excluded:
            keep &= ~np.isin(keys, np.concatenate(excluded))
        users, items = np.divmod(keys[keep], n_items)
        sums = sums[keep]
        bounds = np.searchsorted(users, np.arange(len(histories) + 1)).tolist()
        return [
            self._best(items[lo:hi], sums[lo:hi], k)
            for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)
        ]

    def _best(self, items: np.ndarray, sums: np.ndarray, k: int) -> list[Recommendation]:
        """The ``k`` best of one user's candidates (given in catalog order), ties by position."""
        if len(sums) > k:
            kth = np.partition(sums, len(sums) - k)[len(sums) - k]  # the k-th largest
            items, sums = items[sums >= kth], sums[sums >= kth]
        order = np.argsort(-sums, kind="stable")[:k]  # stable: tied items stay in catalog order
        picked = zip(items[order].tolist(), sums[order].tolist(), strict=True)
        return [(self.item_ids[i], score) for i, score in picked]

    def arrays(self) -> dict[str, np.ndarray]:
        s = self.similarity
        return {
            "data": s.data,
            "indices": s.indices,
            "indptr": s.indptr,
            "shape": np.asarray(s.shape),
        }

    @classmethod
    def from_arrays(cls, item_ids, params, arrays) -> ItemCFBranch:
        shape = tuple(int(n) for n in arrays["shape"])
        similarity = sparse.csr_matrix(
            (arrays["data"], arrays["indices"], arrays["indptr"]), shape=shape
        )
        return cls(item_ids, params, similarity)


# --- embedding ANN ---------------------------------------------------------------


def normalize_rows(vectors: np.ndarray) -> np.ndarray:
    vectors = np.asarray(vectors, dtype=np.float32)
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return vectors / np.maximum(norms, 1e-12)


def cooccurrence_embeddings(
    sequences: Mapping[str, Sequence[str]],
    item_ids: Sequence[str],
    dim: int = 128,
    window: int = 20,
    dense_max_items: int = 4000,
    fit_max_items: int | None = None,
) -> np.ndarray:
    """Collaborative item embeddings: the top eigenvectors of the cosine-normalized co-occurrence.

    E = V * sqrt(lambda) over the ``dim`` largest eigenvalues, so E @ E.T is the best
    rank-``dim`` positive approximation of the similarity. Dense ``eigh`` for small
    catalogs (fast, exact), sparse ``eigsh`` above ``dense_max_items``; above
    ``fit_max_items`` items the eigenvectors of the most connected ``fit_max_items`` only,
    every item placed by its co-occurrence with those (``embeddings_of_cooccurrence``).
    Items never seen get a zero row (ANN then never recalls them).
    """
    index = {item: i for i, item in enumerate(item_ids)}
    cooccurrence = CooccurrenceSum(len(item_ids), window)
    encoded = ([index[i] for i in seq if i in index] for seq in sequences.values())
    for page in pages_of_sequences(encoded, COOCCURRENCE_PAGE_EVENTS):
        cooccurrence.add(page)
    return embeddings_of_cooccurrence(cooccurrence.matrix(), dim, dense_max_items, fit_max_items)


# Events whose pairs one page of ``cooccurrence_embeddings`` builds at a time. The pairs cost
# ~1-3 KB an event while they are built (window 20, both directions, three arrays and the
# CSR conversion), so the 2M-event window of a 1M-item store, summed at once, held ~7 GB;
# pages of users sum to the same matrix (a single page, e.g. ML-100K, bit for bit).
COOCCURRENCE_PAGE_EVENTS = 250_000


def pages_of_sequences(
    sequences: Iterable[Sequence[int]], page_events: int
) -> Iterator[list[Sequence[int]]]:
    """Whole sequences in pages of about ``page_events`` events (a longer one alone)."""
    page: list[Sequence[int]] = []
    events = 0
    for sequence in sequences:
        page.append(sequence)
        events += len(sequence)
        if events >= page_events:
            yield page
            page, events = [], 0
    if page:
        yield page


def embeddings_of_cooccurrence(
    cooccurrence: sparse.csr_matrix,
    dim: int = 128,
    dense_max_items: int = 4000,
    fit_max_items: int | None = None,
) -> np.ndarray:
    """``cooccurrence_embeddings`` of an already summed co-occurrence (items x items).

    Up to ``fit_max_items`` items (None: any number) the eigenvectors of the whole
    normalized matrix; above it ``landmark_embeddings``, whose cost stops growing with the
    catalog but for one sparse product (eigsh over n items costs ~n x (2 dim)^2 per restart,
    and more restarts as n grows: an hour or more at 1M items and dim 256 on two cores).
    """
    n = cooccurrence.shape[0]
    normalized, counts = symmetric_normalized(cooccurrence)
    dim = max(1, min(dim, n - 2))
    if fit_max_items is not None and n > fit_max_items:
        return landmark_embeddings(normalized, counts, dim, fit_max_items, dense_max_items)
    values, vectors = top_eigenpairs(normalized, dim, dense_max_items)
    vectors *= np.sqrt(np.maximum(values, 0.0))  # in place: no second items x dim float64
    vectors[counts == 0] = 0.0
    return vectors.astype(np.float32)


def top_eigenpairs(
    symmetric: sparse.csr_matrix, dim: int, dense_max_items: int
) -> tuple[np.ndarray, np.ndarray]:
    """The ``dim`` largest algebraic eigenvalues (ascending) and their eigenvectors (columns):
    dense ``eigh`` up to ``dense_max_items`` rows, ``eigsh`` from a fixed start above."""
    n = symmetric.shape[0]
    if n <= dense_max_items:
        from scipy.linalg import eigh

        return eigh(symmetric.toarray(), subset_by_index=[n - dim, n - 1])
    from scipy.sparse.linalg import eigsh

    # deterministic start vector, so the same data gives the same embeddings
    v0 = np.ones(n) / math.sqrt(n)
    return eigsh(symmetric, k=dim, which="LA", v0=v0)


LANDMARK_ROWS_PER_PRODUCT = 65_536  # rows of the n x dim float64 product made at a time


def landmark_embeddings(
    normalized: sparse.csr_matrix,
    counts: np.ndarray,
    dim: int,
    landmarks: int,
    dense_max_items: int = 4000,
) -> np.ndarray:
    """Embeddings of every item from the eigenvectors of the ``landmarks`` most connected
    items only (the Nystrom extension).

    The landmarks L are the items with the largest co-occurrence sums (ties: lower
    position). With N_LL = V diag(lambda) V.T over its ``dim`` largest eigenvalues, every
    item i gets E_i = N_iL V diag(lambda)^-1/2: a landmark gets exactly V_i sqrt(lambda),
    what the whole-matrix fit gives when N_LL is the whole matrix, and E E.T = N_:L N_LL^+
    N_L: approximates N through the landmarks' columns. Only positive eigenvalues are kept
    (a negative one has no real square root; the whole-matrix fit zeroes those too); an
    item with no co-occurrence with a landmark gets a zero row, as a never-seen item does.

    Cost: the landmarks' eigenproblem (bounded by ``landmarks``, whatever the catalog),
    then one pass over the matrix's rows, LANDMARK_ROWS_PER_PRODUCT at a time: O(nnz x dim)
    time, items x dim float32 out plus one chunk's float64 product.
    """
    n = normalized.shape[0]
    chosen = np.sort(np.argsort(-counts, kind="stable")[:landmarks])
    fit_dim = max(1, min(dim, len(chosen) - 2))
    values, vectors = top_eigenpairs(normalized[chosen][:, chosen], fit_dim, dense_max_items)
    positive = values > 1e-9 * max(float(values.max()), 0.0)
    projection = vectors[:, positive] / np.sqrt(values[positive])
    width = projection.shape[1]
    embeddings = np.zeros((n, dim), dtype=np.float32)
    for start in range(0, n, LANDMARK_ROWS_PER_PRODUCT):
        rows = normalized[start : start + LANDMARK_ROWS_PER_PRODUCT][:, chosen]
        embeddings[start : start + rows.shape[0], :width] = rows @ projection
    return embeddings


def symmetric_normalized(cooccurrence: sparse.csr_matrix) -> tuple[sparse.csr_matrix, np.ndarray]:
    """D^-1/2 (C + C.T) / 2 D^-1/2 with D the row sums of (C + C.T) / 2, scaled in place on
    one symmetric copy (the same floats, in the same order, as the two diagonal products
    it replaces, which each made a copy of the matrix), and D."""
    co = cooccurrence.astype(np.float64, copy=False)
    symmetric = (co + co.T).tocsr()  # symmetric whatever the backward weight
    symmetric.data *= 0.5
    counts = np.asarray(symmetric.sum(axis=1)).ravel()
    inv_norm = 1.0 / np.sqrt(np.maximum(counts, 1e-12))
    symmetric.data *= np.repeat(inv_norm, np.diff(symmetric.indptr))
    symmetric.data *= inv_norm[symmetric.indices]
    return symmetric, counts


class _FlatIndexVectors:
    """The vectors stored in a FAISS flat index, as an array that keeps the index alive."""

    def __init__(self, index) -> None:
        self.index = index
        self.__array_interface__ = {
            "shape": (index.ntotal, index.d),
            "typestr": "<f4",
            "data": (int(index.get_xb()), True),  # True: read-only
            "version": 3,
        }


DEFAULT_ANN_NPROBE = 32  # IVF lists a search reads (RecallSettings.ann_nprobe)
# hits past k an ANN search reads first, for the exclusions, in multiples of k: on the demo's
# store (users exclude ~500 of 1,682 items) 2k left 1 user in 200 short of k, k 7, k/3 191
ANN_FIRST_MARGIN = 2


class AnnBranch(RecallBranch):
    """Nearest items to the user's decayed mean embedding (FAISS inner product on unit vectors)."""

    kind = "ann"

    def __init__(
        self, item_ids, params, embeddings: np.ndarray, ivf: np.ndarray | None = None
    ) -> None:
        """``ivf``: a FAISS IVF index over the same unit vectors, serialized (``fit`` trains
        one above ``exact_max_items``); None: an exact flat index, built here."""
        super().__init__(item_ids, params)
        import faiss

        if len(embeddings) != len(self.item_ids):
            raise ValueError(f"ann: {len(embeddings)} embeddings for {len(self.item_ids)} items")
        if ivf is not None:
            self.index = faiss.deserialize_index(np.ascontiguousarray(ivf, dtype=np.uint8))
            if self.index.ntotal != len(embeddings) or self.index.d != embeddings.shape[1]:
                raise ValueError("ann: the IVF index does not match the embeddings")
            self.index.nprobe = int(params.get("nprobe", DEFAULT_ANN_NPROBE))
            # The index is the one copy of the vectors: its lists hold them by list, and a
            # direct map (8 bytes an item) finds a row's vector there for the user vectors,
            # instead of a row-ordered copy beside it (and the serialized bytes a third).
            self.index.make_direct_map()
            self.embeddings = None
            return
        unit = normalize_rows(embeddings)
        self.index = faiss.IndexFlatIP(unit.shape[1])
        self.index.add(unit)
        # a read-only view of the index's own copy: one copy of items x dim float32, not two
        self.embeddings = np.asarray(_FlatIndexVectors(self.index)) if len(unit) else unit
        del unit

    @classmethod
    def fit(
        cls,
        item_ids: Sequence[str],
        embeddings: np.ndarray,
        last_m: int = 20,
        half_life_items: float | None = 2.0,
        half_life_days: float | None = None,
        source: str = "given",
        exact_max_items: int | None = None,
        nprobe: int = DEFAULT_ANN_NPROBE,
    ) -> AnnBranch:
        """Keeps the (normalized) embeddings and the decay settings; above
        ``exact_max_items`` items (None: never) also trains an IVF index (``ivf_index``)."""
        for name, value in (
            ("half_life_items", half_life_items),
            ("half_life_days", half_life_days),
        ):
            if value is not None and value <= 0:
                raise ValueError(f"ann: {name} must be > 0 or None, got {value}")
        params = {
            "last_m": last_m,
            "half_life_items": half_life_items,
            "half_life_days": half_life_days,
            "source": source,
        }
        if exact_max_items is None or len(item_ids) <= exact_max_items:
            return cls(item_ids, params, embeddings)
        ivf, nlist = ivf_index(normalize_rows(embeddings))
        return cls(item_ids, {**params, "nlist": nlist, "nprobe": nprobe}, embeddings, ivf)

    def history_weights(self, steps_back: np.ndarray, age_ms: np.ndarray | None) -> np.ndarray:
        """0.5 ** (steps back / half-life in items) * 0.5 ** (age / half-life in days); None disables."""
        weights = np.ones(len(steps_back))
        if self.params["half_life_items"] is not None:
            weights *= 0.5 ** (steps_back / self.params["half_life_items"])
        if age_ms is not None and self.params["half_life_days"] is not None:
            weights *= 0.5 ** (age_ms / (self.params["half_life_days"] * MS_PER_DAY))
        return weights

    def user_vectors(
        self, histories: Sequence[Sequence[str]], timestamps_ms: Sequence[Sequence[int] | None]
    ) -> np.ndarray:
        """Decayed mean of the embeddings of the last ``last_m`` known history items."""
        vectors = np.zeros((len(histories), self.index.d), dtype=np.float32)
        for row, (history, stamps) in enumerate(zip(histories, timestamps_ms, strict=True)):
            known = self.recent_known(history, self.params["last_m"])
            if not known:
                continue
            steps_back = np.asarray([len(history) - 1 - i for i in known], dtype=np.float64)
            age_ms = None
            if stamps is not None:
                if len(stamps) != len(history):
                    raise ValueError(f"{len(history)} history items but {len(stamps)} timestamps")
                age_ms = np.asarray([stamps[-1] - stamps[i] for i in known], dtype=np.float64)
            weights = self.history_weights(steps_back, age_ms)
            positions = [self.item_index[history[i]] for i in known]
            vectors[row] = weights @ self.vectors_of(positions) / weights.sum()
        return normalize_rows(vectors)

    def rank_batch(self, histories, k, excludes, timestamps_ms) -> list[list[Recommendation]]:
        """The ``k`` nearest items not excluded. A user's exclusions (their history) are few
        of their nearest items, so the search goes ``k * (1 + ANN_FIRST_MARGIN)`` deep first and
        ``k + |exclude|`` deep (where no exclusion can leave fewer than ``k``) only for the
        users whose exclusions left fewer than ``k`` there; one search ``k + |exclude|`` deep
        for all read up to ~950 results a user on the demo's store (0.09 against 0.05 ms of
        search a user at 150), and grows with the longest history of the batch.
        ``recommend_batch`` calls it ``chunk_size`` users at a time, which bounds the query
        vectors and results held at once (an offline evaluation of millions of users)."""
        excluded = [set(e) if e else set() for e in excludes]
        n_items = len(self.item_ids)
        vectors = self.user_vectors(histories, timestamps_ms)
        results: list[list[Recommendation]] = [[] for _ in histories]
        rows = list(range(len(histories)))
        longest = max(map(len, excluded), default=0)
        depth = min(n_items, k + min(ANN_FIRST_MARGIN * k, longest))
        while rows and depth:
            scores, positions = self.index.search(vectors[rows], depth)
            deeper = []
            for row, row_scores, row_positions in zip(rows, scores, positions, strict=True):
                kept, read_all = self._kept(row_scores.tolist(), row_positions.tolist(),
                                            excluded[row], k)  # fmt: skip
                results[row] = kept
                # short of k after reading every hit, and a deeper search could find more
                if read_all and len(kept) < k and depth < min(n_items, k + len(excluded[row])):
                    deeper.append(row)
            rows = deeper
            depth = min(n_items, k + max((len(excluded[row]) for row in rows), default=0))
        return results

    def _kept(self, scores: list[float], positions: list[int], exclude: set[str], k: int):
        """(the first ``k`` hits with a positive score and not excluded, and whether every hit
        was read without meeting the end of the positive ones: a deeper search may add)."""
        kept: list[Recommendation] = []
        for score, position in zip(scores, positions, strict=True):
            if position < 0 or score <= 0:  # FAISS pads a short list with -1 (and -inf / 0)
                return kept, False  # hits come best first: nothing positive lies deeper
            item_id = self.item_ids[position]
            if item_id not in exclude:
                kept.append((item_id, score))
                if len(kept) == k:
                    return kept, False
        return kept, True

    @property
    def is_ivf(self) -> bool:
        """Whether the index is an inverted file (else exact, flat)."""
        return self.embeddings is None

    def vectors_of(self, positions: Sequence[int]) -> np.ndarray:
        """The unit vectors of catalog ``positions`` (rows of a flat index, or read out of the
        IVF lists through the direct map: the same floats)."""
        if self.embeddings is not None:
            return self.embeddings[positions]
        return self.index.reconstruct_batch(np.asarray(positions, dtype=np.int64))

    def arrays(self) -> dict[str, np.ndarray]:
        """The unit vectors by row, and with an IVF index its FAISS bytes (both are written
        at save only: a loaded IVF branch keeps neither)."""
        if self.embeddings is not None:
            return {"embeddings": self.embeddings}
        import faiss

        vectors = self.index.reconstruct_n(0, self.index.ntotal)
        return {"embeddings": vectors, "ivf": faiss.serialize_index(self.index)}

    @classmethod
    def from_arrays(cls, item_ids, params, arrays) -> AnnBranch:
        return cls(item_ids, params, arrays["embeddings"], arrays.get("ivf"))


def ivf_index(unit: np.ndarray, seed: int = 0) -> tuple[np.ndarray, int]:
    """A FAISS inverted-file index (inner product) over ``unit``, serialized to bytes (FAISS's
    own format, no pickle), and its number of lists: 4 sqrt(n), trained on a seeded sample of
    64 vectors a list (k-means costs sample x lists x dim a round, so training grows as
    n^1.5 up to n = 64 nlist: 2.2 s at 50k items here, not measured at 1M). A search reads
    ``nprobe`` lists of ~n / nlist vectors instead of all n: ~sqrt(n) work."""
    import faiss

    n, dim = unit.shape
    nlist = max(1, int(4 * math.sqrt(n)))
    sample = unit[np.random.default_rng(seed).choice(n, min(n, 64 * nlist), replace=False)]
    index = faiss.IndexIVFFlat(faiss.IndexFlatIP(dim), dim, nlist, faiss.METRIC_INNER_PRODUCT)
    index.cp.seed = seed
    index.train(np.ascontiguousarray(sample, dtype=np.float32))
    index.add(np.ascontiguousarray(unit, dtype=np.float32))
    return faiss.serialize_index(index), nlist
