"""Commands of the evaluation step and of the recall branches.

- ``genrec eval [--json PATH] [--plot PATH] [--tune-merge] [--no-generative] [--max-users N]
  [--allow-seen | --exclude-seen]``: the fixed leave-one-out protocol (docs/evaluation.md)
  over every ranker, seen items excluded unless allowed (default ``recall.eval_exclude_seen``);
  prints one table, optionally writes the JSON report and a PNG bar chart.
- ``genrec offline fit-recall [--until-ts-ms T] [--out DIR]``: fits popularity, item-CF
  and ANN on the stored events (up to T) and swaps them into ``DIR/<branch>``
  (default ``recall.artifacts_dir`` or ``data_dir/recall``), where serving loads them.

Example::

    $ genrec eval --json var/eval/latest.json
    $ genrec offline fit-recall
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from genrec.infra.errors import UserFacingError
from genrec.infra.settings import get_settings

# Handlers import their step's modules when they run, so that `genrec --help` and
# every other command start without torch, transformers, pandas or a database.

log = logging.getLogger(__name__)


def register(commands: argparse._SubParsersAction, groups) -> None:
    """Add ``genrec eval`` and ``genrec offline fit-recall``."""
    evaluate = commands.add_parser(
        "eval",
        help="evaluate every ranker under the fixed leave-one-out protocol",
        description="Leave-one-out by time, full-catalog ranking, history excluded "
        "(unless --allow-seen), HR/NDCG@{5,10,20}: popularity, itemcf, ann, generative, "
        "merged, drafts.",
    )
    evaluate.add_argument("--json", type=Path, default=None, help="write the report here")
    evaluate.add_argument("--plot", type=Path, default=None, help="write a PNG bar chart here")
    evaluate.add_argument(
        "--tune-merge", action="store_true", help="tune RRF merge weights on the validation split"
    )
    evaluate.add_argument(
        "--no-generative", action="store_true", help="skip the generative rankers even if active"
    )
    evaluate.add_argument(
        "--max-users", type=int, default=None, help="only the first N test users (quick checks)"
    )
    seen = evaluate.add_mutually_exclusive_group()
    seen.add_argument(
        "--allow-seen", dest="exclude_seen", action="store_false", default=None,
        help="let every ranker return history items; a repeated test item counts as a hit "
        "(re-consumption: grocery, music, news)",
    )  # fmt: skip
    seen.add_argument(
        "--exclude-seen", dest="exclude_seen", action="store_true", default=None,
        help="leave history items out (default, unless recall.eval_exclude_seen is false)",
    )  # fmt: skip
    evaluate.set_defaults(handler=_eval)

    offline = groups.group("offline", "offline step: semantic IDs, models, prefix KV, recall")
    fit = offline.add_parser(
        "fit-recall",
        help="fit the popularity, item-CF and ANN recall branches on the stored events",
    )
    fit.add_argument("--until-ts-ms", type=int, default=None, help="only events up to this time")
    fit.add_argument("--out", type=Path, default=None, help="artifact root (one folder per branch)")
    fit.set_defaults(handler=_fit_recall)


def _eval(args: argparse.Namespace) -> int:
    from genrec.infra.database import make_engine
    from genrec.offline.evaluation import format_table, plot_report, run_protocol

    if args.max_users is not None and args.max_users < 1:
        raise UserFacingError(f"--max-users must be >= 1, got {args.max_users}")
    settings = get_settings()
    engine = make_engine(settings.database_url)
    try:
        report = run_protocol(
            settings,
            engine,
            generative=not args.no_generative,
            tune_merge=args.tune_merge,
            max_users=args.max_users,
            exclude_seen=args.exclude_seen,  # None: recall.eval_exclude_seen
        )
    except ValueError as exc:
        raise UserFacingError(str(exc)) from exc
    print(format_table(report))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
        log.info("report written to %s", args.json)
    if args.plot is not None:
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        plot_report(report, args.plot)
        log.info("plot written to %s", args.plot)
    return 0


def _fit_recall(args: argparse.Namespace) -> int:
    from genrec.infra.database import make_engine
    from genrec.offline.recall import fit_store_branches, save_branches

    settings = get_settings()
    engine = make_engine(settings.database_url)
    root = args.out or settings.recall.artifacts_dir or settings.path("recall", "x").parent
    try:
        branches = fit_store_branches(settings, engine, until_ts_ms=args.until_ts_ms)
    except (ValueError, FileNotFoundError) as exc:
        raise UserFacingError(str(exc)) from exc
    save_branches(branches, root)
    for name, branch in branches.items():
        log.info("recall branch %s: %d items -> %s", name, len(branch.item_ids), Path(root) / name)
    return 0
