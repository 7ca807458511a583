"""The ``genrec`` command line: one entry point, subcommands registered by each module.

Each module that owns a step exposes ``register(commands, groups)`` in its own
``cli.py``; this file only wires them together, so ``genrec --help`` stays fast
(heavy imports such as torch happen inside the command handlers).

Example::

    $ genrec --help
    $ genrec kafka up
    $ genrec ingest --exit-when-idle 10
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable, Sequence

from genrec.infra.errors import UserFacingError
from genrec.infra.logs import configure_logging
from genrec.infra.progress import quiet_library_bars
from genrec.infra.settings import get_settings, unknown_variables

# Modules that add subcommands, in the order they appear in --help.
COMMAND_MODULES = (
    "genrec.app.commands",
    "genrec.ingest.cli",
    "genrec.offline.cli",
    "genrec.offline.semantic_ids.cli",
    "genrec.offline.training.cli",
    "genrec.offline.refresh_cli",
    "genrec.offline.eval_cli",
    "genrec.online.cli",
    "genrec.app.bench.cli",
    "genrec.app.ui.cli",
)

Handler = Callable[[argparse.Namespace], int | None]


class CommandGroups:
    """Shared parent commands (``offline``, ``bench``) that several modules extend."""

    def __init__(self, commands: argparse._SubParsersAction) -> None:
        self._commands = commands
        self._groups: dict[str, argparse._SubParsersAction] = {}

    def group(self, name: str, help_text: str) -> argparse._SubParsersAction:
        """The subparsers of ``genrec NAME``, created on first use."""
        if name not in self._groups:
            parser = self._commands.add_parser(name, help=help_text, description=help_text)
            self._groups[name] = parser.add_subparsers(dest=f"{name}_command", metavar="COMMAND")
            parser.set_defaults(handler=lambda _args, p=parser: p.print_help() or 2)
        return self._groups[name]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="genrec",
        description="Streaming generative recommendation: Kafka ingest, semantic IDs, "
        "speculative beam search.",
    )
    parser.add_argument(
        "--log-level", default=None, help="DEBUG, INFO, WARNING (default: settings)"
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    groups = CommandGroups(commands)
    for module_name in COMMAND_MODULES:
        module = importlib.import_module(module_name)
        module.register(commands, groups)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Handler | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 2
    from pydantic import ValidationError

    try:
        settings = get_settings()
    except ValidationError as exc:
        print(f"genrec: invalid settings\n{settings_problems(exc)}", file=sys.stderr)
        return 2
    unknown = unknown_variables()
    if unknown:
        print(f"genrec: unknown settings\n{unknown_problems(unknown)}", file=sys.stderr)
        return 2
    configure_logging(
        args.log_level or settings.log_level, settings.log_format, settings.log_levels
    )
    quiet_library_bars()  # before a handler imports transformers
    try:
        result = handler(args)
    except KeyboardInterrupt:
        return 130
    except UserFacingError as exc:
        logging.getLogger("genrec").error("%s", exc)
        return 2
    return int(result or 0)


def settings_problems(exc) -> str:
    """One line per bad setting, named as its ``GENREC_`` variable (values are not echoed)."""
    lines = []
    for error in exc.errors(include_url=False):
        where = "__".join(str(part) for part in error["loc"]).upper()
        lines.append(f"  GENREC_{where}: {error['msg']}")
    return "\n".join(lines)


def unknown_problems(unknown: dict[str, str | None]) -> str:
    """One line per ``GENREC_`` variable that no setting reads, with the closest name."""
    lines = []
    for name, close in unknown.items():
        hint = f" (did you mean {close}?)" if close else ""
        lines.append(f"  {name}: not a genrec setting{hint}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
