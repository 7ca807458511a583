"""The evaluation step: one fixed protocol, HR/NDCG metrics, and every ranker compared.

Protocol (docs/evaluation.md): leave-one-out by time (``genrec.offline.splits``),
ranking over the full catalog, items already in the user's history excluded
(``recall.eval_exclude_seen``; off, for re-consumption, they may be ranked and a
repeated target is a hit), HR@{5,10,20} and NDCG@{5,10,20} averaged over users
with a test case.

A *ranker* is any ``Callable[[Sequence[Case], int], list[list[(item_id, score)]]]``
returning, per case, at most k items best first. With seen items excluded, rankers
are asked to leave out the case's history themselves (so they can use all k
slots); the harness then drops any history item that slips through and cuts each
list to k, so a ranker that ignores the rule loses slots rather than gaining hits.
With seen items allowed nothing is asked or dropped but repeats within a list.

Traditional branches are fitted on everything before the predicted item: on the
training sequences for validation cases, on training + validation items for test
cases.

The generative lists (target and each draft) are decoded in batches of cases of similar
prompt length (``generative_lists``); each batch is a page of ``offline.executor``: here,
or on Ray actors that load the active version from its artifact folder. The batches are
the same either way, and so are the lists.

Example::

    >>> from genrec.offline.splits import Case
    >>> cases = [Case("u1", ["a"], "b"), Case("u2", ["a"], "c")]
    >>> evaluate_rankings([[("b", 1.0)], [("x", 1.0), ("c", 0.5)]], cases, ks=(1, 2))
    {'HR@1': 0.5, 'NDCG@1': 0.5, 'HR@2': 1.0, 'NDCG@2': 0.8154648767857288, 'users': 2}
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from genrec.infra.errors import UserFacingError
from genrec.ingest.history import load_item_ids, load_user_histories
from genrec.offline.executor import (
    Executor,
    LocalExecutor,
    batches,
    load_version_models,
    make_executor,
    model_artifact_dir,
)
from genrec.offline.recall import BRANCHES, fit_branches, semantic_id_embeddings
from genrec.offline.splits import Case, leave_one_out
from genrec.online.branches import RecallBranch
from genrec.online.merge import merge_lists

log = logging.getLogger(__name__)

Recommendation = tuple[str, float]
Ranker = Callable[[Sequence[Case], int], list[list[Recommendation]]]
DEFAULT_KS = (5, 10, 20)
MERGE_GRID = (0.0, 0.1, 0.25, 0.5, 1.0, 2.0)


# --- metrics ------------------------------------------------------------------


def evaluate_rankings(
    rankings: Sequence[Sequence[Recommendation]],
    cases: Sequence[Case],
    ks: Sequence[int] = DEFAULT_KS,
    *,
    exclude_seen: bool = True,
) -> dict[str, float | int]:
    """Mean HR@k and NDCG@k (one relevant item: 1 / log2(rank + 1), rank from 1)."""
    if not ks or min(ks) < 1:
        raise ValueError(f"ks must be positive cutoffs, got {ks}")
    ranks = case_ranks(rankings, cases, max(ks), exclude_seen=exclude_seen)
    n = max(len(cases), 1)
    metrics: dict[str, float | int] = {}
    for k in ks:
        metrics[f"HR@{k}"] = sum(hit(rank, k) for rank in ranks) / n
        metrics[f"NDCG@{k}"] = sum(gain(rank, k) for rank in ranks) / n
    metrics["users"] = len(cases)
    return metrics


def case_ranks(
    rankings: Sequence[Sequence[Recommendation]],
    cases: Sequence[Case],
    depth: int,
    *,
    exclude_seen: bool = True,
) -> list[int | None]:
    """Per case, the target's rank within ``depth`` (``target_rank``), or None."""
    if len(rankings) != len(cases):
        raise ValueError(f"{len(rankings)} rankings for {len(cases)} cases")
    return [
        target_rank(ranked, case, depth, exclude_seen=exclude_seen)
        for ranked, case in zip(rankings, cases, strict=True)
    ]


def hit(rank: int | None, k: int) -> float:
    return 1.0 if rank is not None and rank <= k else 0.0


def gain(rank: int | None, k: int) -> float:
    """NDCG term of one case with one relevant item: 1 / log2(rank + 1) within k."""
    return 1.0 / math.log2(rank + 1) if rank is not None and rank <= k else 0.0


def target_rank(
    ranked: Sequence[Recommendation], case: Case, depth: int, *, exclude_seen: bool = True
) -> int | None:
    """1-based rank of ``case.target`` after dropping repeats and (``exclude_seen``) history
    items, or None. Excluded, a target the user already had can never be hit."""
    seen = set(case.history) if exclude_seen else set()
    rank = 0
    for item_id, _score in ranked:
        if item_id in seen:
            continue
        seen.add(item_id)
        rank += 1
        if rank > depth:
            return None
        if item_id == case.target:
            return rank
    return None


def evaluate_ranker(
    ranker: Ranker, cases: Sequence[Case], ks: Sequence[int] = DEFAULT_KS, *, exclude_seen=True
) -> tuple[dict[str, float | int], list[list[Recommendation]]]:
    """Metrics of ``ranker`` on ``cases`` (asked for max(ks) items) and its rankings."""
    rankings = ranker(cases, max(ks))
    return evaluate_rankings(rankings, cases, ks, exclude_seen=exclude_seen), rankings


def repeat_targets(cases: Sequence[Case]) -> int:
    """How many cases hold out an item already in their history (a re-consumption)."""
    return sum(case.target in set(case.history) for case in cases)


def paired_difference(a: Sequence[float], b: Sequence[float]) -> dict[str, float]:
    """Mean of a - b over the same cases with a normal 95% interval (paired, so the
    users' shared difficulty cancels: tighter than comparing two separate intervals).

    >>> paired_difference([1, 0, 1, 1], [0, 0, 1, 0])
    {'diff': 0.5, 'ci95_low': -0.0658, 'ci95_high': 1.0658}
    """
    n = len(a)
    if n != len(b) or n == 0:
        raise ValueError(f"paired difference needs equal, non-empty samples ({n} vs {len(b)})")
    deltas = [x - y for x, y in zip(a, b, strict=True)]
    mean = sum(deltas) / n
    variance = sum((d - mean) ** 2 for d in deltas) / max(n - 1, 1)
    half = 1.96 * math.sqrt(variance / n)
    return {"diff": mean, "ci95_low": round(mean - half, 4), "ci95_high": round(mean + half, 4)}


def compare_to_branches(
    lists: Mapping[str, Sequence[Sequence[Recommendation]]],
    cases: Sequence[Case],
    k: int = 10,
    *,
    exclude_seen: bool = True,
) -> dict[str, dict[str, dict[str, float]]]:
    """``generative`` and ``merged`` minus each traditional branch, HR@k and NDCG@k, paired."""
    ranks = {
        name: case_ranks(rows, cases, k, exclude_seen=exclude_seen) for name, rows in lists.items()
    }
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name in ("generative", "merged"):
        if name not in ranks:
            continue
        for branch in BRANCHES:
            out[f"{name} - {branch}"] = {
                f"{metric}@{k}": paired_difference(
                    [term(r, k) for r in ranks[name]], [term(r, k) for r in ranks[branch]]
                )
                for metric, term in (("HR", hit), ("NDCG", gain))
            }
    return out


def headline_k(ks: Sequence[int]) -> int:
    """The cutoff the paired comparison and the plot use: 10 when evaluated, else the largest."""
    return 10 if 10 in ks else max(ks)


# --- the protocol's data ---------------------------------------------------------------


class ProtocolData:
    """Split, catalog and timestamps of one store, loaded once for every ranker.

    ``newest_events``: only the store's newest that many events (the window the target
    trains on, ``train.max_events``), so memory stops growing with the store; None: all.
    """

    def __init__(self, engine, newest_events: int | None = None) -> None:
        histories = load_user_histories(engine, newest_events=newest_events)
        self.newest_events = newest_events
        self.events = sum(len(events) for events in histories.values())
        self.item_ids = load_item_ids(engine)
        self.sequences = {u: [e.item_id for e in events] for u, events in histories.items()}
        self.timestamps = {u: [e.ts_ms for e in events] for u, events in histories.items()}
        self.split = leave_one_out(self.sequences)
        if not self.split.test:
            raise ValueError("no user has the 3 events the protocol needs (train, valid, test)")

    def fit_data(self, stage: str) -> tuple[dict[str, list[str]], dict[str, list[int]]]:
        """Sequences and timestamps a branch may see when predicting ``stage`` ('valid'/'test')."""
        cases = {"valid": self.split.valid, "test": self.split.test}[stage]
        sequences = {}
        for user, sequence in self.sequences.items():
            sequences[user] = cases[user].history if user in cases else sequence
        stamps = {u: self.timestamps[u][: len(s)] for u, s in sequences.items()}
        return sequences, stamps

    def cases(self, stage: str, max_users: int | None = None) -> list[Case]:
        cases = list({"valid": self.split.valid, "test": self.split.test}[stage].values())
        return cases[:max_users] if max_users else cases


def branch_ranker(
    branch: RecallBranch, timestamps: Mapping[str, Sequence[int]], exclude_seen: bool = True
) -> Ranker:
    """A ranker over a fitted branch; timestamps of each case's history come from ``timestamps``.
    ``exclude_seen`` False: the branch may return the case's history items."""

    def rank(cases: Sequence[Case], k: int) -> list[list[Recommendation]]:
        histories = [case.history for case in cases]
        excludes = [set(case.history) for case in cases] if exclude_seen else None
        stamps = [
            list(timestamps[c.user_id][: len(c.history)]) if c.user_id in timestamps else None
            for c in cases
        ]
        return branch.recommend_batch(histories, k, excludes, stamps)

    return rank


def fitted_branches(
    data: ProtocolData, stage: str, settings, engine=None
) -> dict[str, RecallBranch]:
    sequences, stamps = data.fit_data(stage)
    embeddings = None
    if settings.recall.ann_embeddings == "semantic_ids":
        embeddings = semantic_id_embeddings(settings, engine, data.item_ids)
    return fit_branches(sequences, data.item_ids, settings.recall, stamps, embeddings)


# --- merge ------------------------------------------------------------------------


def merge_rankings(
    lists: Mapping[str, Sequence[Sequence[Recommendation]]], k: int, recall, weights=None
) -> list[list[Recommendation]]:
    """Per case, ``merge_lists`` of every named list with the ``recall`` merge settings."""
    names = list(lists)
    n_cases = len(next(iter(lists.values()))) if lists else 0
    return [
        merge_lists(
            {name: lists[name][i] for name in names},
            k,
            method=recall.merge_method,
            weights=weights if weights is not None else recall.merge_weights,
            quotas=recall.merge_quotas,
            rrf_k=recall.merge_rrf_k,
        )
        for i in range(n_cases)
    ]


def tune_merge_weights(
    lists: Mapping[str, Sequence[Sequence[Recommendation]]],
    cases: Sequence[Case],
    k: int,
    recall,
    metric: str = "NDCG@10",
    exclude_seen: bool = True,
) -> tuple[dict[str, float], float]:
    """Grid search of RRF weights on (validation) ``cases``; the best single list keeps weight 1."""
    ks = tuple(sorted({k, int(metric.split("@")[1])}))
    single = {
        name: evaluate_rankings(rows, cases, ks, exclude_seen=exclude_seen)[metric]
        for name, rows in lists.items()
    }
    anchor = max(single, key=single.get)
    others = [name for name in lists if name != anchor]
    best_weights, best_value = {anchor: 1.0, **dict.fromkeys(others, 0.0)}, single[anchor]
    for combo in itertools.product(MERGE_GRID, repeat=len(others)):
        weights = {anchor: 1.0, **dict(zip(others, combo, strict=True))}
        merged = merge_rankings(
            lists, k, recall.model_copy(update={"merge_method": "rrf"}), weights
        )
        value = evaluate_rankings(merged, cases, ks, exclude_seen=exclude_seen)[metric]
        if value > best_value + 1e-12:
            best_weights, best_value = weights, value
    return best_weights, best_value


# --- the whole protocol -------------------------------------------------------------


def run_protocol(
    settings,
    engine,
    *,
    generative: bool = True,
    tune_merge: bool = False,
    max_users: int | None = None,
    progress: bool = True,
    exclude_seen: bool | None = None,
) -> dict[str, Any]:
    """Evaluate every ranker on the test cases; the JSON ``genrec eval`` writes.

    ``exclude_seen`` (default ``recall.eval_exclude_seen``): False lets every ranker, the
    generative search included, return history items, and a repeated target counts."""
    recall = settings.recall
    exclude = recall.eval_exclude_seen if exclude_seen is None else exclude_seen
    ks = tuple(sorted(recall.eval_ks))
    k = max(ks)
    data = ProtocolData(engine, newest_events=settings.train.max_events)
    test_cases = data.cases("test", max_users)
    notes = [_repeat_note(test_cases, exclude)]
    report: dict[str, Any] = {
        "protocol": protocol_description(data, ks, test_cases, recall, exclude)
    }

    _, test_stamps = data.fit_data("test")
    branches = fitted_branches(data, "test", settings, engine)
    depth = max(k, recall.merge_depth)
    lists: dict[str, list[list[Recommendation]]] = {}
    results: dict[str, Any] = {}
    for name in BRANCHES:
        lists[name] = branch_ranker(branches[name], test_stamps, exclude)(test_cases, depth)
        results[name] = evaluate_rankings(lists[name], test_cases, ks, exclude_seen=exclude)
        log.info("%s: HR@10 %.4f", name, results[name].get("HR@10", float("nan")))

    models = _active_models(settings, engine, notes) if generative else None
    if not generative:
        notes.append("generative rankers skipped (--no-generative)")
    drafts: dict[str, Any] = {}
    agreement: dict[str, Any] = {}
    if models is not None:
        lists["generative"], results["generative"], drafts, agreement = _generative_rankers(
            models, test_cases, ks, recall.eval_batch_size, exclude, progress,
            _executor_and_folder(settings, engine, models),
        )  # fmt: skip

    weights = dict(recall.merge_weights)
    if tune_merge:
        weights, value = _tuned_weights(
            data, settings, engine, models, max_users, progress, exclude
        )
        notes.append(f"merge weights tuned on validation: {weights} (NDCG@10 {value:.4f})")
    merge_order = ["generative", *BRANCHES] if "generative" in lists else list(BRANCHES)
    if "generative" not in lists:
        notes.append("merged = merge(popularity, itemcf, ann): no generative list")
    merged = merge_rankings({n: lists[n] for n in merge_order}, k, recall, weights)
    results["merged"] = evaluate_rankings(merged, test_cases, ks, exclude_seen=exclude)
    report["paired"] = compare_to_branches(
        {**lists, "merged": merged}, test_cases, headline_k(ks), exclude_seen=exclude
    )
    report["protocol"]["merge"] = {
        "method": recall.merge_method,
        "lists": merge_order,
        "weights": weights,
        "quotas": recall.merge_quotas,
        "rrf_k": recall.merge_rrf_k,
        "depth": depth,
    }
    report.update(results=results, drafts=drafts, agreement=agreement, notes=notes)
    return report


def _generative_rankers(models, cases, ks, batch_size: int, exclude_seen: bool, progress: bool,
                        where: tuple[Executor, str | None] | None = None):  # fmt: skip
    """The target's list and metrics, each draft's metrics, and the drafts' agreement.
    ``where``: the executor and the version's artifact folder its workers load."""
    # the models' module loads torch: imported only when there are models to evaluate
    from genrec.online.models.generative import draft_agreement

    k = max(ks)
    executor, folder = where or (LocalExecutor(), None)
    lists = generative_lists(models, cases, k, ["target", *models.drafts], batch_size=batch_size,
                             exclude_seen=exclude_seen, executor=executor, folder=folder,
                             progress=progress)  # fmt: skip
    rows = lists.pop("target")
    results = evaluate_rankings(rows, cases, ks, exclude_seen=exclude_seen)
    drafts = {
        variant: evaluate_rankings(variant_rows, cases, ks, exclude_seen=exclude_seen)
        for variant, variant_rows in lists.items()
    }
    agreement = draft_agreement(models, cases, k, batch_size=batch_size)
    return rows, results, drafts, agreement


def generative_lists(
    models,
    cases: Sequence[Case],
    k: int,
    which: Sequence[str] = ("target",),
    *,
    batch_size: int = 64,
    exclude_seen: bool = True,
    executor: Executor | None = None,
    folder: str | None = None,
    progress: bool = False,
) -> dict[str, list[list[Recommendation]]]:
    """Per model in ``which`` (``target``, draft names), its top-``k`` list per case.

    Here (the default executor): one ``recommend_generative`` call per model, which
    decodes the cases in batches of ``batch_size`` by prompt length. Remote: those same
    batches are the pages, each decoded by every model on a worker that loaded the version
    from ``folder`` (its artifact folder; without one the batches run here).
    """
    from genrec.online.models.generative import recommend_generative

    executor = executor or LocalExecutor()
    if executor.remote and folder is None:
        log.warning("eval: model version %s has no artifact folder for Ray workers; "
                    "decoding here", models.version)  # fmt: skip
        executor = LocalExecutor()
    if not executor.remote:  # the same batches, all in one call per model
        options = {"batch_size": batch_size, "progress": progress, "exclude_history": exclude_seen}
        return {name: recommend_generative(models, cases, k, which=name, **options)
                for name in which}  # fmt: skip
    lengths = [len(models.prompt(case.history)) for case in cases]
    order = sorted(range(len(cases)), key=lambda i: lengths[i])
    pages = batches(order, batch_size)
    plan = (list(which), k, exclude_seen, models.beam_width)
    pool = executor.pool("eval", load_version_models, folder, threads=_torch_threads(),
                         pages_hint=len(pages))  # fmt: skip
    lists: dict[str, list] = {name: [None] * len(cases) for name in which}
    with pool:
        work = (([cases[i] for i in rows], plan) for rows in pages)
        done = pool.map(_generative_page, work, desc="generative ranking", unit="batch",
                        total=len(pages), progress=progress)  # fmt: skip
        for rows, page_lists in zip(pages, done, strict=True):
            for name, page_rows in page_lists.items():
                for i, ranked in zip(rows, page_rows, strict=True):
                    lists[name][i] = ranked
    return lists


def _generative_page(models, page: tuple) -> dict[str, list[list[Recommendation]]]:
    """One batch of cases decoded by every model of the plan (a pool page)."""
    from genrec.online.models.generative import recommend_generative

    cases, (which, k, exclude_seen, beam_width) = page
    options = {"exclude_history": exclude_seen, "beam_width": beam_width, "batch_size": len(cases)}
    return {name: recommend_generative(models, cases, k, which=name, **options) for name in which}


def _executor_and_folder(settings, engine, models) -> tuple[Executor, str | None]:
    """``offline.executor``, and the version folder its remote workers load (else None)."""
    executor = make_executor(settings)
    if not executor.remote:
        return executor, None
    return executor, model_artifact_dir(settings, engine, models.version)


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def _repeat_note(cases: Sequence[Case], exclude_seen: bool) -> str:
    """What the report says about test targets the user already had."""
    repeats = repeat_targets(cases)
    if exclude_seen:
        return (
            f"{repeats} of {len(cases)} test targets repeat a history item: seen items are "
            "excluded, so they count as misses for every ranker"
        )
    return (
        f"seen items allowed (--allow-seen): rankers may return history items; "
        f"{repeats} of {len(cases)} test targets repeat one and count as hits when ranked"
    )


def protocol_description(
    data: ProtocolData, ks: Sequence[int], cases: Sequence[Case], recall, exclude_seen=True
) -> dict[str, Any]:
    return {
        "split": "leave-one-out by time: last item = test, the one before = validation",
        "events": data.events,
        "window": "every stored event"
        if data.newest_events is None
        else f"the store's newest {data.newest_events:,} events (train.max_events)",
        "order": "events sorted by timestamp, ties kept in source order (stable sort)",
        "candidates": "full catalog",
        "catalog_items": len(data.item_ids),
        "exclude_history": exclude_seen,
        "repeat_targets": repeat_targets(cases),
        "ks": list(ks),
        "users": len(cases),
        "fit": "branches fitted on train + validation items for test cases, on train for validation",
        "popularity_half_life_days": recall.popularity_half_life_days,
        "ann_embeddings": recall.ann_embeddings,
    }


def _active_models(settings, engine, notes: list[str]):
    """The active generative models, or None with a note saying why they are skipped."""
    try:
        from genrec.online.models.store import load_active_models
    except ImportError as exc:
        notes.append(f"generative rankers skipped: {exc}")
        return None
    try:
        models = load_active_models(settings, engine)
    except (ImportError, FileNotFoundError, LookupError, UserFacingError) as exc:
        notes.append(f"generative rankers skipped: no active models ({exc})")
        return None
    if models is None:
        notes.append("generative rankers skipped: no active models")
    return models


def _tuned_weights(
    data, settings, engine, models, max_users, progress, exclude_seen: bool = True
) -> tuple[dict[str, float], float]:
    """RRF weights tuned on the validation cases with branches fitted on train only."""
    recall = settings.recall
    k = max(recall.eval_ks)
    cases = data.cases("valid", max_users)
    _, stamps = data.fit_data("valid")
    branches = fitted_branches(data, "valid", settings, engine)
    depth = max(k, recall.merge_depth)
    lists = {
        name: branch_ranker(branches[name], stamps, exclude_seen)(cases, depth) for name in BRANCHES
    }
    if models is not None:
        executor, folder = _executor_and_folder(settings, engine, models)
        generated = generative_lists(
            models, cases, k, exclude_seen=exclude_seen, batch_size=recall.eval_batch_size,
            executor=executor, folder=folder, progress=progress,
        )["target"]  # fmt: skip
        lists = {"generative": generated, **lists}
    return tune_merge_weights(lists, cases, k, recall, exclude_seen=exclude_seen)


def format_table(report: Mapping[str, Any]) -> str:
    """One plain-text table: a row per ranker (results, then drafts), HR and NDCG columns."""
    ks = report["protocol"]["ks"]
    columns = [f"HR@{k}" for k in ks] + [f"NDCG@{k}" for k in ks]
    rows = [(name, m) for name, m in report["results"].items()]
    rows += [(f"draft:{name}", m) for name, m in report.get("drafts", {}).items()]
    width = max([len("ranker")] + [len(name) for name, _ in rows])
    lines = ["  ".join([f"{'ranker':<{width}}", *(f"{c:>8}" for c in columns), f"{'users':>6}"])]
    for name, metrics in rows:
        cells = [f"{metrics[c]:>8.4f}" for c in columns]
        lines.append("  ".join([f"{name:<{width}}", *cells, f"{metrics['users']:>6}"]))
    for variant, stats in report.get("agreement", {}).items():
        steps = ", ".join(f"{a:.3f}" for a in stats.get("strict_acceptance_per_step", []))
        lines.append(
            f"agreement {variant}: top-K overlap {stats.get('topk_overlap', 0):.3f}; strict acceptance per step [{steps}]"
        )
    for pair, metrics in report.get("paired", {}).items():
        cells = [
            f"{name} {m['diff']:+.4f} [{m['ci95_low']:+.4f}, {m['ci95_high']:+.4f}]"
            for name, m in metrics.items()
        ]
        lines.append(f"paired {pair}: " + "; ".join(cells))
    lines += [f"note: {note}" for note in report.get("notes", [])]
    return "\n".join(lines)


def plot_report(report: Mapping[str, Any], path) -> None:
    """Bar chart of HR@10 and NDCG@10 (or the largest k) per ranker, as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = headline_k(report["protocol"]["ks"])
    rows = {**report["results"], **{f"draft:{n}": m for n, m in report.get("drafts", {}).items()}}
    names = list(rows)
    x = range(len(names))
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(names)), 4))
    ax.bar([i - 0.2 for i in x], [rows[n][f"HR@{k}"] for n in names], 0.4, label=f"HR@{k}")
    ax.bar([i + 0.2 for i in x], [rows[n][f"NDCG@{k}"] for n in names], 0.4, label=f"NDCG@{k}")
    ax.set_xticks(list(x), names, rotation=20)
    ax.set_title(f"leave-one-out, full catalog, {report['protocol']['users']} users")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
