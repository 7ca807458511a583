"""The explorer's web app: FastAPI routes over the three pages, served by uvicorn.

FastAPI (on Starlette) because it is the mainstream typed Python web framework:
query and path parameters are validated by type and bound before a handler
runs (a bad ``at`` or prefix is a 422 with the reason), it shares pydantic with
the rest of genrec, and uvicorn serves it with a clean shutdown on SIGTERM.
Pages are rendered on the server with Jinja2 (autoescaped) and draw charts as
inline SVG: no script, nothing fetched from another site.

Every route is a GET and nothing writes: the store, topics and artifacts are only
read. It binds to ``ui.host`` (127.0.0.1 by default: a user page shows a person's
history).

Example::

    $ genrec ui                       # http://127.0.0.1:8765
    $ GENREC_UI__METRICS_URLS='["http://worker-1:9102/metrics"]' genrec ui --port 9000
"""

from __future__ import annotations

import logging
import re
import signal
from pathlib import Path
from urllib.parse import quote

from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.responses import HTMLResponse, PlainTextResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from sqlalchemy import Engine, select

from genrec.app.ui.catalog_page import CodeTables, catalog_view
from genrec.app.ui.last_message import last_message
from genrec.app.ui.serving import LiveVersion
from genrec.app.ui.status_page import Scrapes, status_view
from genrec.app.ui.user_page import user_view
from genrec.infra.settings import Settings
from genrec.schemas.events import MAX_ID_LENGTH
from genrec.schemas.tables import events

log = logging.getLogger(__name__)
HERE = Path(__file__).parent
PREFIX = re.compile(r"^\d{1,6}(-\d{1,6}){0,7}$")  # "12" or "12-3": codes per level
RECENT_USERS = 20


def valid_user_id(user_id: str) -> str:
    """``user_id`` as the store keys it, or a 400 saying what is wrong with it."""
    if not 1 <= len(user_id) <= MAX_ID_LENGTH:
        raise HTTPException(400, f"a user id has 1 to {MAX_ID_LENGTH} characters")
    if user_id != user_id.strip() or not user_id.isprintable():
        raise HTTPException(400, "a user id has no control characters or outer spaces")
    return user_id


def create_app(settings: Settings, engine: Engine) -> FastAPI:
    """The explorer over ``engine``'s store and its active serving version."""
    app = FastAPI(title="genrec explorer", docs_url=None, redoc_url=None, openapi_url=None)
    templates = Jinja2Templates(directory=HERE / "templates")
    app.mount("/static", StaticFiles(directory=HERE / "static"), name="static")
    live, scrapes, code_tables = LiveVersion(settings, engine), Scrapes(), CodeTables()
    app.state.live = live

    def page(request: Request, name: str, status_code: int = 200, **context) -> HTMLResponse:
        return templates.TemplateResponse(request, name, context, status_code=status_code)

    @app.get("/", response_class=HTMLResponse)
    def index(request: Request):
        return page(request, "index.html", users=_recent_users(engine))

    @app.get("/users", response_class=HTMLResponse)
    def search(request: Request, user_id: str = Query("", max_length=4 * MAX_ID_LENGTH)):
        user_id = valid_user_id(user_id.strip())
        return RedirectResponse(f"/users/{quote(user_id, safe='')}", status_code=303)

    @app.get("/users/{user_id}", response_class=HTMLResponse)
    def user(request: Request, user_id: str, at: int | None = Query(None, ge=1)):
        view = user_view(live, settings, valid_user_id(user_id), at)
        if view is None:
            return page(request, "missing.html", 404, user_id=user_id)
        found = last_message(settings, user_id)
        return page(request, "user.html", view=view, last=found)

    @app.get("/catalog", response_class=HTMLResponse)
    def catalog(request: Request, prefix: str = Query("", max_length=64)):
        if prefix and not PREFIX.match(prefix):
            raise HTTPException(400, "a prefix is codes joined by '-', e.g. 12 or 12-3")
        codes = tuple(int(c) for c in prefix.split("-")) if prefix else ()
        return page(request, "catalog.html", view=catalog_view(live, settings, codes, code_tables))

    @app.get("/status", response_class=HTMLResponse)
    def status(request: Request):
        return page(request, "status.html", view=status_view(live, settings, scrapes))

    @app.get("/healthz", response_class=PlainTextResponse)
    def healthz():
        return "ok"

    return app


def _recent_users(engine: Engine) -> list[str]:
    """Users of the newest events (a bounded read of the newest rows)."""
    query = select(events.c.user_id).order_by(events.c.id.desc()).limit(20 * RECENT_USERS)
    with engine.connect() as connection:
        users = list(dict.fromkeys(row.user_id for row in connection.execute(query)))
    return users[:RECENT_USERS]


def serve(settings: Settings, engine: Engine, host: str, port: int) -> None:
    """Run the explorer until SIGINT/SIGTERM (uvicorn finishes open requests, then exits)."""
    import uvicorn

    if host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("genrec ui listens on %s: user histories are visible to that network", host)
    log.info("genrec ui on http://%s:%d", host, port)
    # uvicorn shuts down gracefully on SIGTERM, restores the handler it found, then
    # raises the signal again: with this one in place that ends in a clean exit (0).
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        uvicorn.run(create_app(settings, engine), host=host, port=port, log_level="warning")
    finally:
        signal.signal(signal.SIGTERM, previous)
    log.info("genrec ui stopped")
