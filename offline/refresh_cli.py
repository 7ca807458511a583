"""``genrec offline refresh`` (one run now) and ``genrec offline schedule`` (APScheduler).

Example::

    $ genrec offline refresh                       # incremental semantic IDs + prefix KV
    $ genrec offline refresh --retrain-target      # also retrain target and re-align drafts
    $ genrec offline refresh --status              # the last runs
    $ genrec offline schedule --cron "0 3 * * *"
"""

from __future__ import annotations

import argparse
import json

from genrec.infra.errors import UserFacingError
from genrec.infra.settings import get_settings

# Handlers import their step's modules when they run, so that `genrec --help` and
# every other command start without torch, transformers, pandas or a database.


def register(commands: argparse._SubParsersAction, groups) -> None:
    offline = groups.group("offline", "Offline refresh: semantic IDs, models, prefix KV")
    refresh = offline.add_parser(
        "refresh",
        help="run one refresh now: semantic IDs, models (if configured), prefix KV, activate",
    )
    refresh.add_argument(
        "--full-semantic-ids",
        action="store_true",
        default=None,
        help="rebuild semantic IDs from scratch (implies --retrain-target)",
    )
    refresh.add_argument(
        "--no-semantic-ids", action="store_true", help="keep the current semantic IDs"
    )
    refresh.add_argument(
        "--retrain-target",
        action="store_true",
        default=None,
        help="retrain the target; the drafts are re-aligned to it",
    )
    refresh.add_argument(
        "--realign-drafts",
        action="store_true",
        default=None,
        help="re-align the drafts to the current target",
    )
    refresh.add_argument("--preset", default=None, help="model preset for training (e.g. tiny)")
    refresh.add_argument("--no-kv", action="store_true", help="skip the prefix KV precompute")
    refresh.add_argument(
        "--wait-lock",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="wait this long for a running refresh to finish (default: fail)",
    )
    refresh.add_argument(
        "--status",
        action="store_true",
        help="show the last runs and the active serving version, run nothing",
    )
    refresh.set_defaults(handler=_refresh)

    schedule = offline.add_parser(
        "schedule", help="run refreshes on a schedule (interval or cron; survives restarts)"
    )
    schedule.add_argument("--interval-minutes", type=float, default=None)
    schedule.add_argument("--cron", default=None, help='crontab line, e.g. "0 3 * * *"')
    schedule.add_argument("--run-now", action="store_true", help="also run once at start")
    schedule.set_defaults(handler=_schedule)  # fmt: skip


def _settings_with(**refresh_overrides):
    settings = get_settings()
    changes = {k: v for k, v in refresh_overrides.items() if v is not None}
    refresh = settings.refresh.model_copy(update=changes)
    return settings.model_copy(update={"refresh": refresh})


def _refresh(args: argparse.Namespace) -> int:
    from genrec.infra.database import make_engine
    from genrec.offline.refresh import run_refresh
    from genrec.offline.run_lock import LockBusy

    settings = _settings_with(
        full_semantic_ids=args.full_semantic_ids,
        semantic_ids=False if args.no_semantic_ids else None,
        retrain_target=args.retrain_target,
        realign_drafts=args.realign_drafts,
        train_preset=args.preset,
        precompute_kv=False if args.no_kv else None,
    )
    engine = make_engine(settings.database_url)
    if args.status:
        return _print_status(engine)
    try:
        report = run_refresh(settings, engine, trigger="cli", lock_wait_s=args.wait_lock)
    except LockBusy as exc:
        raise UserFacingError(f"another refresh is running: {exc}") from exc
    print(json.dumps(report.__dict__, indent=2, default=str))
    return 0


def _print_status(engine) -> int:
    from genrec.infra.serving_versions import active_serving_version
    from genrec.offline.refresh import last_runs

    status = {"active": active_serving_version(engine), "runs": last_runs(engine)}
    print(json.dumps(status, indent=2, default=lambda v: getattr(v, "__dict__", str(v))))
    return 0


def _schedule(args: argparse.Namespace) -> int:
    from genrec.offline.schedule import run_schedule

    settings = _settings_with(interval_minutes=args.interval_minutes, cron=args.cron)
    return run_schedule(settings, run_now=args.run_now)
