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


class _CurrentStderr(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at each record, not the one at set-up: a caller
    that swaps it (a test harness, a daemon redirecting its output) never gets records
    written into a closed file."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self):  # noqa: ANN201 - logging.StreamHandler's own attribute
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:  # noqa: ANN001
        pass


def parse_log_levels(spec: str) -> dict[str, str]:
    """``"kafka.coordinator=DEBUG,genrec.online=WARNING"`` -> {logger: level}; a clear error."""
    levels: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, sep, level = part.partition("=")
        level = level.strip().upper()
        if not sep or not name.strip() or level not in logging.getLevelNamesMapping():
            raise ValueError(f"log_levels: {part!r} is not logger=LEVEL (e.g. kafka=DEBUG)")
        levels[name.strip()] = level
    return levels


def configure_logging(level: str = "INFO", fmt: str | None = None, levels: str = "") -> None:
    """Send genrec's logs to stderr as text or JSON lines (``log_format``); quiet chatty
    clients, then apply per-logger ``levels`` (``log_levels``: ``kafka.coordinator=DEBUG``)."""
    fmt = fmt or "text"
    handler = _CurrentStderr()
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
    for name, name_level in parse_log_levels(levels).items():
        logging.getLogger(name).setLevel(name_level)


def dump_stacks_on_sigusr1() -> None:
    """``kill -USR1 <pid>`` writes every thread's stack to stderr; the service goes on.

    For the long-running services (``genrec serve``, ``genrec ingest``): a process that
    stops making progress without failing (a Kafka client waiting on a dead coordinator,
    say) can then be diagnosed where it runs, with nothing installed. ``faulthandler``
    writes from C, so it works even while the interpreter is stuck in a blocking call.
    """
    import faulthandler  # here: only services that opt in pay for registering the signal
    import signal

    if hasattr(signal, "SIGUSR1"):  # not on Windows
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
