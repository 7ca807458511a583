"""``genrec offline train``: target + three drafts on the active semantic IDs (offline step, models).

One run: load the active semantic IDs and the leave-one-out split, train the
target (every next-item position; early stopping on validation HR@10, or for a
final-fit preset such as ``small`` the fixed schedule on train + validation items), the SFT
draft, the target's teacher beams, the AtSpeed-S and AtSpeed-R drafts, measure
them (validation and test HR@10 of the target, draft agreement on validation
cases), save everything as a new model version and activate it.

Example::

    $ genrec offline train --preset small
    $ genrec offline train --preset smollm2-135m --max-steps 50   # a short CPU schedule
    $ genrec offline train --drafts-only                         # re-align to the active target
    $ genrec offline train --train-only   # no final fit on validation items (honest valid HR)
    $ genrec offline train --workers 4    # 4 data-parallel Ray Train workers (train.workers)
"""

from __future__ import annotations

import argparse

from genrec.infra.settings import get_settings

# The handler imports the training run (and the database) when it runs, so that
# `genrec --help` and every other command start without torch, transformers or SQLAlchemy.


def register(commands: argparse._SubParsersAction, groups) -> None:
    """Add ``genrec offline train``."""
    offline = groups.group("offline", "Offline refresh: semantic IDs, models, prefix KV")
    parser = offline.add_parser(
        "train", help="train the target and draft models, save and activate a model version"
    )
    parser.add_argument("--preset", choices=["tiny", "small", "smollm2-135m"], default=None,
                        help="model preset (default: settings.model.preset)")  # fmt: skip
    parser.add_argument("--max-steps", type=int, default=None, help="cap target optimizer steps")
    parser.add_argument("--epochs", type=int, default=None, help="max target epochs")
    parser.add_argument("--draft-epochs", type=int, default=None)
    parser.add_argument("--teacher-prompts", type=int, default=None)
    parser.add_argument("--train-only", action="store_true",
                        help="fit on training items only, validating (no final fit on train + "
                             "validation): honest validation figures, e.g. before "
                             "genrec eval --tune-merge")  # fmt: skip
    parser.add_argument("--drafts-only", action="store_true",
                        help="keep the active target, re-train and re-align the drafts")  # fmt: skip
    parser.add_argument("--workers", type=int, default=None,
                        help="data-parallel training workers (default: train.workers; more "
                             "than 1 runs on Ray Train, offline.ray_address)")  # fmt: skip
    parser.add_argument("--no-progress", action="store_true")
    parser.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    from genrec.infra.database import make_engine
    from genrec.offline.training.run import train_models

    settings = get_settings()
    if args.workers is not None:
        train = settings.train.model_copy(update={"workers": max(1, args.workers)})
        settings = settings.model_copy(update={"train": train})
    engine = make_engine(settings.database_url)
    version, metrics = train_models(
        settings, engine, preset_name=args.preset, train_target_model=not args.drafts_only,
        overrides={"max_steps": args.max_steps, "epochs": args.epochs,
                   "draft_epochs": args.draft_epochs, "teacher_prompts": args.teacher_prompts,
                   "fit_on_valid": False if args.train_only else None},
        progress=not args.no_progress,
    )  # fmt: skip
    print(f"model version {version} active: {metrics}")
    return 0
