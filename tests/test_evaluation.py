import json
import math
import sys
import types

import pytest

from genrec.infra.database import make_engine
from genrec.infra.settings import Settings
from genrec.ingest.store import write_events
from genrec.offline.evaluation import (
    ProtocolData,
    branch_ranker,
    evaluate_ranker,
    evaluate_rankings,
    format_table,
    paired_difference,
    plot_report,
    run_protocol,
    target_rank,
)
from genrec.offline.splits import Case
from genrec.online.branches import PopularityBranch


def test_known_hr_and_ndcg_on_hand_made_rankings():
    cases = [
        Case("u1", ["a"], "t"),  # rank 1
        Case("u2", ["a"], "t"),  # rank 3
        Case("u3", ["a"], "t"),  # rank 7
        Case("u4", ["a"], "t"),  # missing
    ]
    rankings = [
        [("t", 0.9)],
        [("x", 3), ("y", 2), ("t", 1)],
        [(f"i{n}", 1) for n in range(6)] + [("t", 0)],
        [("x", 1)],
    ]
    m = evaluate_rankings(rankings, cases, ks=(1, 5, 10))
    assert m["users"] == 4
    assert m["HR@1"] == 0.25
    assert m["HR@5"] == 0.5
    assert m["HR@10"] == 0.75
    assert m["NDCG@1"] == 0.25
    assert m["NDCG@5"] == pytest.approx((1 + 1 / math.log2(4)) / 4)
    assert m["NDCG@10"] == pytest.approx((1 + 0.5 + 1 / math.log2(8)) / 4)


def test_history_items_and_repeats_do_not_take_slots():
    case = Case("u", ["seen1", "seen2"], "t")
    ranked = [("seen1", 9), ("x", 8), ("x", 7), ("seen2", 6), ("t", 5)]
    assert target_rank(ranked, case, depth=10) == 2
    assert target_rank(ranked, case, depth=1) is None
    assert target_rank([], case, depth=10) is None
    # a target already in the history never counts (it is excluded)
    assert target_rank([("t", 1)], Case("u", ["t"], "t"), depth=10) is None


def test_a_repeated_target_is_a_hit_when_seen_items_are_allowed():
    repeat = Case("u", ["t", "x"], "t")  # the held-out item re-consumes one the user had
    ranked = [("x", 3), ("x", 2), ("t", 1)]
    assert target_rank(ranked, repeat, depth=10) is None
    assert target_rank(ranked, repeat, depth=10, exclude_seen=False) == 2  # only repeats drop
    cases = [repeat, Case("v", ["a"], "b")]
    rankings = [ranked, [("a", 2), ("b", 1)]]
    assert evaluate_rankings(rankings, cases, ks=(1, 2))["HR@2"] == 0.5  # b at rank 1
    allowed = evaluate_rankings(rankings, cases, ks=(1, 2), exclude_seen=False)
    assert allowed["HR@1"] == 0.0 and allowed["HR@2"] == 1.0


def test_protocol_keeps_repeat_targets_and_reports_the_setting(tmp_path):
    """The split keeps a case whose test item is a repeat; excluded it is a miss for every
    ranker, allowed popularity (which ranks it first) hits it; the report says which."""
    engine = make_engine(f"sqlite:///{tmp_path / 'genrec.db'}")
    histories = {"u1": ["p", "a", "b", "p"], "u2": ["p", "c", "p", "d"], "u3": ["p", "e", "f"]}
    rows = [
        {"event_id": f"{user}-{n}", "user_id": user, "item_id": item, "event_type": "view",
         "ts_ms": 1000 * n}
        for user, items in histories.items() for n, item in enumerate(items)
    ]  # fmt: skip
    write_events(engine, rows)
    data = ProtocolData(engine)
    assert data.split.test["u1"] == Case("u1", ["p", "a", "b"], "p")
    recall = {"popularity_half_life_days": None, "eval_ks": (1, 5)}
    settings = Settings(home=tmp_path, recall=recall)
    excluded = run_protocol(settings, engine, generative=False, progress=False)
    allowed = run_protocol(settings, engine, generative=False, progress=False, exclude_seen=False)
    assert excluded["protocol"]["exclude_history"] is True
    assert allowed["protocol"]["exclude_history"] is False
    assert excluded["protocol"]["repeat_targets"] == allowed["protocol"]["repeat_targets"] == 1
    assert excluded["results"]["popularity"]["users"] == 3
    # popularity ranks "p" first for everyone; u2's "d" and u3's "f" were never seen before
    assert allowed["results"]["popularity"]["HR@1"] == pytest.approx(1 / 3)  # u1's "p"
    assert excluded["results"]["popularity"]["HR@5"] == 0.0  # u1's "p" can never be hit
    assert any("count as hits" in note for note in allowed["notes"])
    assert any("count as misses" in note for note in excluded["notes"])
    # the settings' counterpart, as genrec eval reads it without a flag
    by_setting = run_protocol(
        Settings(home=tmp_path, recall={**recall, "eval_exclude_seen": False}),
        engine, generative=False, progress=False,
    )  # fmt: skip
    assert by_setting["results"] == allowed["results"]


def test_protocol_reads_the_training_window_only(tmp_path):
    """``genrec eval`` evaluates on the store's newest ``train.max_events`` events, the
    window the target trains on (bounded however large the store grows), and says so."""
    engine = make_engine(f"sqlite:///{tmp_path / 'genrec.db'}")
    rows = [
        {"event_id": f"{user}-{n}", "user_id": user, "item_id": f"i{(n + ord(user[-1])) % 7}",
         "event_type": "view", "ts_ms": 1000 * n}
        for user in ("u1", "u2", "u3") for n in range(5)
    ]  # fmt: skip
    write_events(engine, rows)  # stored user after user: u3's five events are the newest
    window = ProtocolData(engine, newest_events=5)
    assert window.events == 5 and set(window.split.test) == {"u3"}
    assert ProtocolData(engine).events == 15
    settings = Settings(home=tmp_path, train={"max_events": 5}, recall={"eval_ks": (1, 5)})
    report = run_protocol(settings, engine, generative=False, progress=False)
    assert report["protocol"]["events"] == 5 and "newest 5 events" in report["protocol"]["window"]
    assert report["results"]["popularity"]["users"] == 1
    whole = run_protocol(Settings(home=tmp_path, train={"max_events": None}), engine,
                         generative=False, progress=False)  # fmt: skip
    assert whole["protocol"]["window"] == "every stored event"
    assert whole["results"]["popularity"]["users"] == 3


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="rankings for"):
        evaluate_rankings([[]], [], ks=(5,))
    with pytest.raises(ValueError, match="positive cutoffs"):
        evaluate_rankings([], [], ks=(0,))


def test_ranker_protocol_asks_for_the_largest_k():
    asked = []

    def ranker(cases, k):
        asked.append(k)
        return [[(case.target, 1.0)] for case in cases]

    metrics, rankings = evaluate_ranker(ranker, [Case("u", [], "t")], ks=(5, 20, 10))
    assert asked == [20] and metrics["HR@5"] == 1.0 and rankings == [[("t", 1.0)]]


def test_popularity_on_ml100k_matches_the_reference(ml100k_engine):
    """Plain counts reproduce the reference 0.0859 HR@10 / 0.0450 NDCG@10 exactly (the
    protocol is deterministic), so the band only absorbs float rounding. The recency-
    weighted default (half-life 90 days) must stay within one standard error of it
    (sqrt(0.086 * 0.914 / 943) = 0.009): weighting by recency is a choice, not a fix."""
    data = ProtocolData(ml100k_engine)
    cases = data.cases("test")
    assert len(cases) == 943 and len(data.item_ids) == 1682
    sequences, stamps = data.fit_data("test")
    plain = PopularityBranch.fit(sequences, data.item_ids, half_life_days=None)
    metrics = evaluate_rankings(branch_ranker(plain, stamps)(cases, 20), cases)
    assert metrics["HR@10"] == pytest.approx(0.0859, abs=0.001)
    assert metrics["NDCG@10"] == pytest.approx(0.0450, abs=0.001)
    weighted = PopularityBranch.fit(sequences, data.item_ids, stamps, half_life_days=90)
    metrics = evaluate_rankings(branch_ranker(weighted, stamps)(cases, 20), cases)
    assert 0.0859 - 0.009 <= metrics["HR@10"] <= 0.0859 + 0.009


def test_fit_data_holds_back_the_predicted_items(ml100k_engine):
    data = ProtocolData(ml100k_engine)
    valid, _ = data.fit_data("valid")
    test, test_stamps = data.fit_data("test")
    for user, full in data.sequences.items():
        assert valid[user] == full[:-2] and test[user] == full[:-1]
        assert len(test_stamps[user]) == len(test[user])


def test_run_protocol_without_generative(ml100k_engine, tmp_path):
    # The default merge weights are tuned with the generative list present; these are the
    # weights tuned on validation for the traditional branches alone.
    branch_weights = {"itemcf": 1.0, "ann": 0.25, "popularity": 0.1}
    settings = Settings(home=tmp_path, recall={"merge_weights": branch_weights})
    report = run_protocol(settings, ml100k_engine, generative=False, progress=False)
    results = report["results"]
    assert list(results) == ["popularity", "itemcf", "ann", "merged"]
    for metrics in results.values():
        assert metrics["users"] == 943
        assert set(metrics) == {f"{m}@{k}" for m in ("HR", "NDCG") for k in (5, 10, 20)} | {"users"}
    assert results["itemcf"]["HR@10"] > 2 * results["popularity"]["HR@10"]
    best_single = max(results[n]["HR@10"] for n in ("popularity", "itemcf", "ann"))
    assert results["merged"]["HR@10"] >= best_single  # measured 0.2248 vs 0.2216
    assert report["drafts"] == {} and report["agreement"] == {}
    assert any("skipped" in note for note in report["notes"])
    assert set(report["paired"]) == {"merged - popularity", "merged - itemcf", "merged - ann"}
    json.dumps(report)  # the report is plain JSON
    table = format_table(report)
    assert "merged" in table and "NDCG@20" in table
    plot_report(report, tmp_path / "eval.png")
    assert (tmp_path / "eval.png").stat().st_size > 0


class FakeModels:
    drafts = {"sft": object(), "atspeed_s": object()}


def test_generative_rankers_plug_in(ml100k_engine, tmp_path, monkeypatch):
    """Stand-in generative and store modules: an oracle target and a draft that is always wrong."""
    fake = types.ModuleType("genrec.online.models.generative")
    store = types.ModuleType("genrec.online.models.store")
    calls = []

    def recommend_generative(models, cases, k, which="target", **kwargs):
        calls.append((which, k))
        if which == "target":
            return [[(case.target, 0.0)] for case in cases]
        return [[("no-such-item", 0.0)] for _ in cases]

    store.load_active_models = lambda settings, engine: FakeModels()
    fake.recommend_generative = recommend_generative
    fake.draft_agreement = lambda models, cases, k, **kw: {
        v: {"topk_overlap": 0.5, "strict_acceptance_per_step": [1.0, 0.5, 0.25]}
        for v in models.drafts
    }
    monkeypatch.setitem(sys.modules, "genrec.online.models.generative", fake)
    monkeypatch.setitem(sys.modules, "genrec.online.models.store", store)
    report = run_protocol(Settings(home=tmp_path), ml100k_engine, max_users=50, progress=False)
    results = report["results"]
    assert list(results) == ["popularity", "itemcf", "ann", "generative", "merged"]
    assert results["generative"]["HR@5"] == 1.0 and results["generative"]["users"] == 50
    assert results["merged"]["HR@10"] >= results["itemcf"]["HR@10"]
    assert set(report["drafts"]) == {"sft", "atspeed_s"}
    assert report["drafts"]["sft"]["HR@20"] == 0.0
    assert report["agreement"]["sft"]["topk_overlap"] == 0.5
    assert report["protocol"]["merge"]["lists"][0] == "generative"
    assert ("target", 20) in calls
    assert "agreement sft" in format_table(report)
    # the oracle beats every branch, and the paired interval says so
    paired = report["paired"]["generative - itemcf"]["HR@10"]
    assert paired["diff"] == pytest.approx(1.0 - results["itemcf"]["HR@10"])
    assert 0 < paired["ci95_low"] < paired["diff"] < paired["ci95_high"]
    assert set(report["paired"]) == {
        f"{a} - {b}" for a in ("generative", "merged") for b in ("popularity", "itemcf", "ann")
    }
    assert "paired generative - ann" in format_table(report)


def test_paired_difference_interval():
    same = paired_difference([1, 0, 1], [1, 0, 1])
    assert same == {"diff": 0.0, "ci95_low": 0.0, "ci95_high": 0.0}
    # 100 cases, a wins 30, b wins 10: diff 0.2, sd 0.603, half-width 1.96 * 0.0603 = 0.118
    a = [1.0] * 30 + [0.0] * 10 + [0.0] * 60
    b = [0.0] * 30 + [1.0] * 10 + [0.0] * 60
    result = paired_difference(a, b)
    assert result["diff"] == pytest.approx(0.2)
    assert result["ci95_low"] == pytest.approx(0.2 - 0.118, abs=0.002)
    with pytest.raises(ValueError, match="equal, non-empty"):
        paired_difference([1.0], [])
