"""Merging ranked lists from several recall branches (and the generative list) into one.

Two methods, both deduplicating by item id:

- ``"rrf"`` (default): weighted reciprocal-rank fusion; an item's fused score is
  ``sum_b weight_b / (rrf_k + rank_b)`` over the lists b that hold it (rank from 1);
  a list of weight 0 only fills the slots the weighted lists leave empty.
  Scores of different branches are not comparable; ranks are.
- ``"quota"``: take lists in the given order, round-robin, each giving at most
  ``quota_b`` items, until k items are chosen; leftover slots are filled from the
  lists' remaining items in the same round-robin order.

Used offline by ``genrec eval`` (``merged``) and online next to the generative list.

Example::

    >>> merged = merge_lists({"a": [("x", 1.0), ("y", 0.5)], "b": [("y", 9.0), ("z", 1.0)]}, k=3)
    >>> [item_id for item_id, _ in merged]
    ['y', 'x', 'z']
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

Recommendation = tuple[str, float]
METHODS = ("rrf", "quota")


def merge_lists(
    lists: Mapping[str, Sequence[Recommendation]],
    k: int,
    method: str = "rrf",
    weights: Mapping[str, float] | None = None,
    quotas: Mapping[str, int] | None = None,
    rrf_k: float = 60.0,
) -> list[Recommendation]:
    """One ranked, deduplicated list of at most ``k`` items from the named ``lists``.

    ``weights`` (rrf) default to 1 for lists not named; ``quotas`` (quota) default to
    an even share of k. Lists named in weights/quotas but absent are simply skipped,
    so one configuration works whether or not the generative list is present.
    """
    if k <= 0:
        raise ValueError(f"k must be positive, got {k}")
    if method == "rrf":
        return _reciprocal_rank_fusion(lists, k, weights or {}, rrf_k)
    if method == "quota":
        return _quota_merge(lists, k, quotas or {})
    raise ValueError(f"unknown merge method {method!r}; expected one of {METHODS}")


def _reciprocal_rank_fusion(
    lists: Mapping[str, Sequence[Recommendation]],
    k: int,
    weights: Mapping[str, float],
    rrf_k: float,
) -> list[Recommendation]:
    if rrf_k < 0:
        raise ValueError(f"rrf_k must be >= 0, got {rrf_k}")
    fused: dict[str, float] = {}
    first_seen: dict[str, tuple[int, int]] = {}
    for list_position, (name, ranked) in enumerate(lists.items()):
        weight = float(weights.get(name, 1.0))
        if weight <= 0:
            continue
        seen_here: set[str] = set()
        for rank, (item_id, _score) in enumerate(ranked, start=1):
            if item_id in seen_here:  # a list repeating an item gets credit once
                continue
            seen_here.add(item_id)
            fused[item_id] = fused.get(item_id, 0.0) + weight / (rrf_k + rank)
            first_seen.setdefault(item_id, (rank, list_position))
    # ties: better best rank first, then earlier list, so the result is deterministic
    order = sorted(fused, key=lambda item: (-fused[item], first_seen[item]))
    merged = [(item_id, fused[item_id]) for item_id in order[:k]]
    # Zero-weight lists only fill what the weighted ones leave empty (a new user may
    # have nothing but popularity): the list is never shorter than what is available.
    backfill = [ranked for name, ranked in lists.items() if float(weights.get(name, 1.0)) <= 0]
    chosen = {item_id for item_id, _ in merged}
    for rank in range(max((len(ranked) for ranked in backfill), default=0)):
        for ranked in backfill:
            if len(merged) >= k:
                return merged
            if rank < len(ranked) and ranked[rank][0] not in chosen:
                chosen.add(ranked[rank][0])
                merged.append((ranked[rank][0], 0.0))
    return merged


def _quota_merge(
    lists: Mapping[str, Sequence[Recommendation]], k: int, quotas: Mapping[str, int]
) -> list[Recommendation]:
    names = [name for name in lists if quotas.get(name, 1) > 0] or list(lists)
    if not names:
        return []
    even_share = -(-k // len(names))
    limit = {name: int(quotas.get(name, even_share)) for name in names}
    cursor = dict.fromkeys(names, 0)
    chosen: dict[str, float] = {}

    def take(name: str) -> bool:
        ranked = lists[name]
        while cursor[name] < len(ranked):
            item_id, _score = ranked[cursor[name]]
            cursor[name] += 1
            if item_id not in chosen:
                chosen[item_id] = float(k - len(chosen))  # descending pseudo-score
                return True
        return False

    for respect_quota in (True, False):
        taken = dict.fromkeys(names, 0)
        progress = True
        while len(chosen) < k and progress:
            progress = False
            for name in names:
                if len(chosen) >= k or (respect_quota and taken[name] >= limit[name]):
                    continue
                if take(name):
                    taken[name] += 1
                    progress = True
    return list(chosen.items())
