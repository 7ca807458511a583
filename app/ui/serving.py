"""The serving version the explorer shows: loaded once, reloaded when another is activated.

The explorer recommends with the very code a worker runs (``Recommender`` over a
``ServingBundle``), so a user page shows what serving would answer. Loading a
version reads its model, recall and prefix-KV artifacts; nothing is written.

Example::

    >>> live = LiveVersion(settings, engine)           # doctest: +SKIP
    >>> bundle = live.bundle()                          # None when nothing is active
"""

from __future__ import annotations

import logging
import threading

from sqlalchemy import Engine

from genrec.infra.settings import Settings
from genrec.online.live_version import ServingBundle, active_serving_key, load_serving_bundle
from genrec.online.recommender import Recommender

log = logging.getLogger(__name__)


class LiveVersion:
    """The active serving version's bundle and a ``Recommender`` for it (thread-safe)."""

    def __init__(self, settings: Settings, engine: Engine) -> None:
        self.settings, self.engine = settings, engine
        self.recommender = Recommender(settings, engine)
        self.lock = threading.Lock()  # one decode at a time; a load blocks the pages using it
        self._bundle: ServingBundle | None = None
        self.error: str | None = None  # why the active version could not be loaded

    def bundle(self) -> ServingBundle | None:
        """The active version's bundle (loaded on first use and after an activation)."""
        key = active_serving_key(self.engine)
        if key is None:
            self._bundle, self.error = None, "no serving version is active yet"
            return None
        with self.lock:
            if self._bundle is None or self._bundle.key != key:
                try:
                    self._bundle = load_serving_bundle(self.settings, self.engine, key)
                    self.error = None
                except Exception as exc:  # a page should say why, not fail
                    log.exception("loading serving version %s failed", key)
                    self._bundle, self.error = None, f"serving version {key}: {exc}"
            return self._bundle
