"""Logging set-up shared by every command: one line per record, key=value friendly."""

from __future__ import annotations

import json
import logging
import sys
import time


class JsonFormatter(logging.Formatter):
    """Structured log lines (``GENREC_LOG_FORMAT=json``) for log shippers."""

    def format(self, record: logging.LogRecord) -> str:
        payload = {
            "ts": round(record.created, 3),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        extra = getattr(record, "fields", None)
        if isinstance(extra, dict):
            payload.update(extra)
        if record.exc_info:
            payload["exc"] = self.formatException(record.exc_info)
        return json.dumps(payload, default=str)


def configure_logging(level: str = "INFO", fmt: str | None = None) -> None:
    """Send genrec's logs to stderr as text or JSON lines (``log_format``); quiet chatty clients."""
    fmt = fmt or "text"
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        formatter = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
        formatter.converter = time.gmtime
        handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("kafka", "urllib3", "filelock", "httpx", "apscheduler.executors", "faiss"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
