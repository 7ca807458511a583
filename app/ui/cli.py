"""``genrec ui``: the read-only recommendation explorer (see ``genrec.app.ui``)."""

from __future__ import annotations

import argparse


def register(commands: argparse._SubParsersAction, groups) -> None:
    """Add ``genrec ui``."""
    del groups
    ui = commands.add_parser(
        "ui",
        help="a read-only web explorer: users' lists, the catalog by semantic ID, serving status",
        description="Serve the explorer on ui.host:ui.port (127.0.0.1:8765 by default) over "
        "the store, the active serving version and the workers' metrics (ui.metrics_urls).",
    )
    ui.add_argument("--host", default=None, help="address to bind (default: ui.host)")
    ui.add_argument("--port", type=int, default=None, help="port (default: ui.port)")
    ui.set_defaults(handler=_ui)


def _ui(args: argparse.Namespace) -> int:
    from genrec.app.ui.server import serve
    from genrec.infra.database import make_engine
    from genrec.infra.settings import get_settings

    settings = get_settings()
    engine = make_engine(settings.database_url, create_tables=False)  # read-only
    serve(settings, engine, args.host or settings.ui.host, args.port or settings.ui.port)
    return 0
