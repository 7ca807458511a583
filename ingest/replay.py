"""Replays a recorded interaction log into Kafka as user events (ingest step).

Events are produced to ``kafka.topic_events`` keyed by user_id, in a stable
timestamp order (equal timestamps keep their file order, so each user's
partition, and therefore the store, keeps that order too), with deterministic
event ids: replaying twice stores nothing twice. The item catalog goes straight
into the ``items`` table (upsert).

Example::

    >>> from genrec.ingest.replay import ml100k_events, replay_events
    >>> frame = ml100k_events()                               # 100,000 rows
    >>> replay_events(get_settings(), frame, end="0.8")       # doctest: +SKIP
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pandas as pd
from kafka import KafkaProducer
from kafka.errors import KafkaTimeoutError

from genrec.infra.database import make_engine
from genrec.infra.errors import UserFacingError
from genrec.infra.kafka_clients import open_client
from genrec.infra.progress import progress_bar
from genrec.infra.settings import Settings
from genrec.ingest.movielens import load_ml100k
from genrec.ingest.store import upsert_items
from genrec.schemas.events import EVENT_TYPES, parse_timestamp_ms

log = logging.getLogger("genrec.ingest.replay")

REQUIRED_COLUMNS = ("user_id", "item_id", "timestamp")
# Numeric timestamps below this are seconds (1e11 s is the year 5138; 1e11 ms is 1973).
SECONDS_LIMIT = 100_000_000_000


@dataclass(frozen=True)
class ReplayResult:
    produced: int
    first_ts_ms: int | None
    last_ts_ms: int | None
    seconds: float


def read_table(path: str | Path) -> pd.DataFrame:
    """A CSV (comma or tab separated, text columns) or Parquet file."""
    path = Path(path)
    if not path.exists():
        raise UserFacingError(f"no such file: {path}")
    if path.suffix.lower() in (".parquet", ".pq") or ".parquet" in path.name:
        return pd.read_parquet(path)
    with path.open(encoding="utf-8", errors="replace") as handle:
        header = handle.readline()
    separator = "\t" if "\t" in header else ","
    return pd.read_csv(path, sep=separator, dtype=str, keep_default_na=False)


def ml100k_events() -> pd.DataFrame:
    """ML-100K as a replay frame: ids ``ml-100k-{file_row}``, event_type rate, value = rating."""
    events = load_ml100k().events
    return pd.DataFrame(
        {
            "event_id": "ml-100k-" + events["file_row"].astype(str),
            "user_id": events["user_id"],
            "item_id": events["item_id"],
            "timestamp": events["timestamp"],
            "event_type": "rate",
            "value": events["rating"],
            "file_row": events["file_row"],
        }
    )


def ml100k_items() -> list[dict[str, Any]]:
    return item_rows(load_ml100k().items)


def prepare_events(
    frame: pd.DataFrame,
    *,
    event_id_prefix: str = "replay",
    start: str | float | None = None,
    end: str | float | None = None,
    limit: int | None = None,
) -> pd.DataFrame:
    """Normalize, sort (stable, by time) and cut a replay frame.

    Output columns: event_id, user_id, item_id, event_type, ts_ms, value. Ids
    default to ``{event_id_prefix}-{file_row}`` (file_row: 0-based data row).
    """
    missing = [c for c in REQUIRED_COLUMNS if c not in frame.columns]
    if missing:
        raise UserFacingError(f"events need columns {REQUIRED_COLUMNS}; missing {missing}")
    file_row = frame["file_row"] if "file_row" in frame.columns else pd.Series(range(len(frame)))
    file_row = pd.Series(file_row.to_numpy(), dtype="int64")
    out = pd.DataFrame(
        {
            "user_id": _ids(frame["user_id"], "user_id"),
            "item_id": _ids(frame["item_id"], "item_id"),
            "ts_ms": timestamps_ms(frame["timestamp"]),
            "file_row": file_row,
        }
    )
    if "event_id" in frame.columns:
        out["event_id"] = _ids(frame["event_id"], "event_id")
    else:
        out["event_id"] = event_id_prefix + "-" + file_row.astype(str)
    out["event_type"] = _event_types(frame)
    out["value"] = _values(frame)
    out = out.sort_values(["ts_ms", "file_row"], kind="stable").reset_index(drop=True)
    out = cut_window(out, start=start, end=end)
    if limit is not None:
        out = out.iloc[: max(int(limit), 0)]
    return out[["event_id", "user_id", "item_id", "event_type", "ts_ms", "value"]]


def _ids(column: pd.Series, name: str) -> pd.Series:
    values = column.to_numpy()
    if column.dtype.kind == "f":  # ints read as float because of a gap: 7.0 -> "7"
        if column.isna().any():
            raise UserFacingError(f"{name} has empty values")
        return pd.Series([str(int(v)) for v in values], dtype=object)
    text = pd.Series([str(v).strip() for v in values], dtype=object)
    if column.isna().any() or (text == "").any():
        raise UserFacingError(f"{name} has empty values")
    return text


def timestamps_ms(column: pd.Series) -> pd.Series:
    """Epoch seconds or ms (chosen per column by magnitude) or ISO 8601 text -> epoch ms."""
    numeric = pd.to_numeric(column, errors="coerce")
    if numeric.notna().all():
        as_ms = numeric * 1000 if numeric.abs().max() < SECONDS_LIMIT else numeric
        return as_ms.round().astype("int64").reset_index(drop=True)
    try:
        return pd.Series([parse_timestamp_ms(str(v)) for v in column], dtype="int64")
    except ValueError as exc:
        raise UserFacingError(f"timestamp column: {exc}") from None


def _event_types(frame: pd.DataFrame) -> pd.Series:
    if "event_type" not in frame.columns:
        return pd.Series(
            ["rate" if "value" in frame.columns else "view"] * len(frame), dtype=object
        )
    types = frame["event_type"].astype(str).str.strip().str.lower().reset_index(drop=True)
    unknown = sorted(set(types) - set(EVENT_TYPES))
    if unknown:
        raise UserFacingError(f"unknown event_type values {unknown[:5]}; allowed: {EVENT_TYPES}")
    return types


def _values(frame: pd.DataFrame) -> pd.Series:
    if "value" not in frame.columns:
        return pd.Series([None] * len(frame), dtype=object)
    return pd.to_numeric(frame["value"], errors="coerce").reset_index(drop=True)


def parse_bound(text: str | float) -> tuple[str, float]:
    """``"0.8"`` -> ("fraction", 0.8); epoch s/ms or ISO text -> ("time", epoch ms)."""
    try:
        number = float(text)
    except (TypeError, ValueError):
        try:
            return "time", float(parse_timestamp_ms(str(text)))
        except ValueError as exc:
            raise UserFacingError(f"bad --start/--end {text!r}: {exc}") from None
    if 0 <= number <= 1:
        return "fraction", number
    if number < 0 or math.isnan(number):
        raise UserFacingError(f"bad --start/--end {text!r}: negative")
    return "time", number * 1000 if number < SECONDS_LIMIT else number


def cut_window(frame: pd.DataFrame, *, start=None, end=None) -> pd.DataFrame:
    """Keep [start, end): times on ``ts_ms``, fractions on the (sorted) row order."""
    n = len(frame)
    lo, hi = 0, n
    if start is not None:
        kind, bound = parse_bound(start)
        lo = round(bound * n) if kind == "fraction" else int((frame["ts_ms"] < bound).sum())
    if end is not None:
        kind, bound = parse_bound(end)
        hi = round(bound * n) if kind == "fraction" else int((frame["ts_ms"] < bound).sum())
    return frame.iloc[lo : max(lo, hi)].reset_index(drop=True)


def event_messages(frame: pd.DataFrame) -> list[tuple[bytes, bytes]]:
    """(key, value) bytes of each prepared row, ready for the producer."""
    messages = []
    for event_id, user_id, item_id, event_type, ts_ms, value in frame.itertuples(index=False):
        payload = {
            "schema_version": 1,
            "event_id": event_id,
            "user_id": user_id,
            "item_id": item_id,
            "event_type": event_type,
            "ts": int(ts_ms),
        }
        if value is not None and not (isinstance(value, float) and math.isnan(value)):
            payload["value"] = float(value)
        messages.append((user_id.encode(), json.dumps(payload, separators=(",", ":")).encode()))
    return messages


def make_producer(settings: Settings) -> Any:
    return open_client(
        KafkaProducer,
        settings.kafka,
        acks="all",
        enable_idempotence=True,  # a retried send never lands twice
        linger_ms=20,
        batch_size=512 * 1024,
        reconnect_backoff_max_ms=2000,
    )


class EventSender:
    """Sends event messages to ``topic`` through ``producer`` (or one of its own, closed at the
    end) and owns what can go wrong: leaving the block flushes, a missing topic (``send``
    waited ``max_block_ms`` for its metadata) and events Kafka did not acknowledge are one
    ``UserFacingError`` each, naming the bootstrap address.

    Example::

        >>> with EventSender(settings, settings.kafka.topic_events) as sender:  # doctest: +SKIP
        ...     sender.send(key, value)
    """

    def __init__(self, settings: Settings, topic: str, producer: Any = None) -> None:
        self.bootstrap, self.topic = settings.kafka.bootstrap, topic
        self.own_producer = producer is None
        self.producer = producer or make_producer(settings)
        self.failures: list[BaseException] = []
        self.sent = 0

    def send(self, key: bytes, value: bytes) -> None:
        self.producer.send(self.topic, key=key, value=value).add_errback(self.failures.append)
        self.sent += 1

    def __enter__(self) -> EventSender:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        try:
            if error is None:
                self.producer.flush()
        except KafkaTimeoutError as exc:
            error = exc
        finally:
            if self.own_producer:
                self.producer.close(timeout=30)
        if isinstance(error, KafkaTimeoutError):
            raise UserFacingError(
                f"cannot produce to {self.topic} at {self.bootstrap}: {error} (does the topic "
                "exist? `genrec topics create` makes it)"
            ) from error
        if error is None and self.failures:
            raise UserFacingError(
                f"{len(self.failures):,} of {self.sent:,} events were not acknowledged by Kafka "
                f"at {self.bootstrap}: {self.failures[0]!r}"
            )


def replay_events(
    settings: Settings,
    frame: pd.DataFrame,
    *,
    rate: float | None = None,
    start: str | float | None = None,
    end: str | float | None = None,
    limit: int | None = None,
    event_id_prefix: str = "replay",
    topic: str | None = None,
    progress: bool = True,
    producer: Any = None,
) -> ReplayResult:
    """Produce ``frame`` (columns as in ``prepare_events``) to the events topic; returns counts."""
    prepared = prepare_events(
        frame, event_id_prefix=event_id_prefix, start=start, end=end, limit=limit
    )
    messages = event_messages(prepared)
    topic = topic or settings.kafka.topic_events
    began = time.monotonic()
    with EventSender(settings, topic, producer) as sender:
        for i, (key, value) in enumerate(
            progress_bar(messages, desc="replay", unit="ev", disable=not progress)
        ):
            sender.send(key, value)
            if rate:
                ahead = (i + 1) / rate - (time.monotonic() - began)
                if ahead > 0:
                    time.sleep(ahead)
    seconds = time.monotonic() - began
    first = int(prepared["ts_ms"].iloc[0]) if len(prepared) else None
    last = int(prepared["ts_ms"].iloc[-1]) if len(prepared) else None
    log.info(
        "replayed %d events to %s in %.1f s (%s .. %s)",
        len(messages),
        topic,
        seconds,
        _iso(first),
        _iso(last),
    )
    return ReplayResult(produced=len(messages), first_ts_ms=first, last_ts_ms=last, seconds=seconds)


def _iso(ts_ms: int | None) -> str:
    if ts_ms is None:
        return "-"
    return datetime.fromtimestamp(ts_ms / 1000, tz=UTC).isoformat(timespec="seconds")


def item_rows(frame: pd.DataFrame) -> list[dict[str, Any]]:
    """Catalog rows for ``upsert_items``: title/year/genres if present, other columns as attributes."""
    if "item_id" not in frame.columns:
        raise UserFacingError("items need an item_id column")
    extra = [c for c in frame.columns if c not in ("item_id", "title", "year", "genres")]
    rows = []
    for record in frame.to_dict("records"):
        row: dict[str, Any] = {"item_id": _text(record["item_id"])}
        for name in ("title", "genres"):
            row[name] = _text(record.get(name)) or None
        row["year"] = _year(record.get("year"))
        attributes = {c: _text(record[c]) for c in extra if _text(record[c])}
        row["attributes"] = attributes or None
        rows.append(row)
    if any(not row["item_id"] for row in rows):
        raise UserFacingError("items have empty item_id values")
    return rows


def _text(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)) or value is pd.NA:
        return ""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value).strip()


def _year(value: Any) -> int | None:
    text = _text(value)
    try:
        return int(float(text)) if text else None
    except ValueError:
        return None


def load_items(settings: Settings, rows: list[dict[str, Any]]) -> int:
    """Upsert catalog rows into the configured store; returns how many."""
    engine = make_engine(str(settings.database_url))
    try:
        return upsert_items(engine, rows)
    finally:
        engine.dispose()


def replay_ml100k(settings: Settings, **window) -> int:
    """ML-100K's catalog into the store and its events (``window``: ``cut_window``'s
    ``start``/``end``, plus ``replay_events``' options) into Kafka; returns how many were produced."""
    load_items(settings, ml100k_items())
    frame = ml100k_events()
    return replay_events(settings, frame, event_id_prefix="ml-100k", **window).produced
