import pytest

from genrec.online.merge import merge_lists


def ids(rows):
    return [item_id for item_id, _ in rows]


def test_rrf_sums_reciprocal_ranks_and_dedupes():
    lists = {"a": [("x", 9.0), ("y", 1.0)], "b": [("y", 0.3), ("z", 0.2), ("y", 0.1)]}
    merged = merge_lists(lists, k=5, rrf_k=0)
    assert ids(merged) == ["y", "x", "z"]  # y: 1/2 + 1/1, x: 1/1, z: 1/2 (y repeated: once)
    assert merged[0][1] == pytest.approx(1.5)
    assert merged[1][1] == pytest.approx(1.0)
    assert merged[2][1] == pytest.approx(0.5)


def test_rrf_weights_and_absent_lists():
    lists = {"a": [("x", 1.0)], "b": [("y", 1.0)]}
    assert ids(merge_lists(lists, k=2, weights={"b": 2.0, "generative": 5.0})) == ["y", "x"]
    # weight 0: the list only fills slots the weighted lists leave empty
    assert ids(merge_lists(lists, k=2, weights={"a": 0.0})) == ["y", "x"]
    assert ids(merge_lists(lists, k=1, weights={"a": 0.0})) == ["y"]
    # equal fused scores: the earlier list wins, deterministically
    assert ids(merge_lists(lists, k=2)) == ["x", "y"]
    assert ids(merge_lists(lists, k=1)) == ["x"]


def test_quota_round_robin_then_fill():
    lists = {
        "g": [("g1", 0), ("g2", 0), ("g3", 0), ("s1", 0)],
        "s": [("s1", 0), ("g1", 0), ("s2", 0)],
    }
    merged = merge_lists(lists, k=5, method="quota", quotas={"g": 3, "s": 1})
    assert ids(merged) == ["g1", "s1", "g2", "g3", "s2"]
    scores = [score for _, score in merged]
    assert scores == sorted(scores, reverse=True)
    # default quotas: even shares
    assert ids(merge_lists(lists, k=2, method="quota")) == ["g1", "s1"]


def test_bad_arguments():
    with pytest.raises(ValueError, match="k must be positive"):
        merge_lists({"a": []}, k=0)
    with pytest.raises(ValueError, match="unknown merge method"):
        merge_lists({"a": []}, k=3, method="borda")
    assert merge_lists({}, k=3) == []
    assert merge_lists({}, k=3, method="quota") == []


def test_zero_weight_lists_only_fill_the_remaining_slots():
    lists = {"generative": [("a", 1.0)], "popularity": [("p", 9.0), ("a", 8.0), ("q", 7.0)]}
    merged = merge_lists(lists, k=3, weights={"generative": 1.0, "popularity": 0.0})
    assert [item for item, _ in merged] == ["a", "p", "q"]
    only_zero = merge_lists({"popularity": [("p", 1.0)]}, k=2, weights={"popularity": 0.0})
    assert [item for item, _ in only_zero] == ["p"]


def test_the_merge_never_filters_by_history():
    """Seen items are left out (or not) by the lists themselves (online.exclude_seen): an item
    every list ranks, a re-consumption included, is merged like any other, by both methods."""
    lists = {"generative": [("seen", 1.0), ("x", 0.5)], "itemcf": [("seen", 2.0), ("y", 1.0)]}
    assert ids(merge_lists(lists, k=3))[0] == "seen"
    assert "seen" in ids(merge_lists(lists, k=3, method="quota"))
