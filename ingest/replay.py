"""Replays a recorded interaction log into Kafka as user events (ingest step).

Events are produced to ``kafka.topic_events`` keyed by user_id, in a stable
timestamp order (equal timestamps keep their file order, so each user's
partition, and therefore the store, keeps that order too), with deterministic
event ids: replaying twice stores nothing twice. The item catalog goes straight
into the ``items`` table (upsert), a page at a time.

The log is never held whole (issue #19): ``replay_events`` reads it a chunk of
``ingest.replay_chunk_rows`` rows (200,000) at a time (Parquet record batches, CSV
``chunksize``), in up to three streamed passes, and sends the same messages, in the same
order, with the same ids and the same errors as ``prepare_events`` on the whole frame:

1. the timestamp column alone, to choose its unit as ``timestamps_ms`` does for a whole
   column (seconds or ms by the largest magnitude, or ISO text as soon as one value is
   not a number);
2. every column, chunk by chunk: validation (every error kept, so the one raised is the
   one the whole-frame checks raise first, and nothing is produced from a bad log), the
   row count and the counts below the time bounds that ``--start``/``--end`` need (a
   fraction is of the whole log), and whether the log is already in (timestamp,
   file_row) order, as ``genrec synthetic`` writes it. From the first chunk out of order
   on, each chunk is sorted (stable) and spilled as a run to a Parquet file under
   ``DATA_DIR/tmp`` (``external_sort.SortedRuns``; the last run stays in memory);
3. the window's rows produced as they come: straight from the file when it was in order
   (chunks before the window are read but not converted; reading stops after it), else
   from a k-way merge by (timestamp, file_row) of the in-order head of the file (read
   again), the spilled runs and the last run.

Cost, for n events and chunk size c: memory is O(c) whatever n is, about three chunks of
normalized rows at most (the chunk read, its normalized copy, the previous sorted run)
plus, while merging, one batch of ``max(c / runs, 1024)`` rows per run, and the
producer's buffer (``buffer.memory``, 32 MiB); the number of runs, n / c, is the number
of files open during the merge. Time is O(n) for a log in order (read three times,
converted twice) and O(n log(n / c)) otherwise (the chunk sorts and the merge's
comparisons, which run in Python: about 1-2 us an event), plus one write and one read of
the spilled rows on disk (zstd, about 15-25 bytes an event). A ``DataFrame`` passed in
goes through the same passes (it is in memory already; ML-100K fits in one chunk, so it
is sorted there without touching the disk).

Example::

    >>> from genrec.ingest.replay import ml100k_events, replay_events
    >>> frame = ml100k_events()                               # 100,000 rows
    >>> replay_events(get_settings(), frame, end="0.8")       # doctest: +SKIP
    >>> replay_events(get_settings(), "var/synthetic/events.parquet")  # doctest: +SKIP
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from kafka import KafkaProducer
from kafka.errors import KafkaTimeoutError

from genrec.infra.database import make_engine
from genrec.infra.errors import UserFacingError
from genrec.infra.kafka_clients import open_client
from genrec.infra.progress import progress_bar
from genrec.infra.settings import Settings
from genrec.ingest.external_sort import SortedRuns
from genrec.ingest.movielens import load_ml100k
from genrec.ingest.store import upsert_items
from genrec.schemas.events import EVENT_TYPES, parse_timestamp_ms

log = logging.getLogger("genrec.ingest.replay")

REQUIRED_COLUMNS = ("user_id", "item_id", "timestamp")
OPTIONAL_COLUMNS = ("event_id", "event_type", "value", "file_row")
OUTPUT_COLUMNS = ["event_id", "user_id", "item_id", "event_type", "ts_ms", "value"]
SORT_KEY = ["ts_ms", "file_row"]
# A spilled run's layout: the sort key first, then the output columns.
RUN_COLUMNS = [*SORT_KEY, "event_id", "user_id", "item_id", "event_type", "value"]
MIN_MERGE_BATCH_ROWS = 1024
# Numeric timestamps below this are seconds (1e11 s is the year 5138; 1e11 ms is 1973).
SECONDS_LIMIT = 100_000_000_000


@dataclass(frozen=True)
class ReplayResult:
    produced: int
    first_ts_ms: int | None
    last_ts_ms: int | None
    seconds: float  # the producing pass: reading, converting (and merging) and sending
    in_order: bool = True  # the log was already in (timestamp, file_row) order
    sorted_runs: int = 0  # runs of the external sort (0: produced straight from the file)


def read_table(path: str | Path) -> pd.DataFrame:
    """A CSV (comma or tab separated, text columns) or Parquet file, whole."""
    path = Path(path)
    if not path.exists():
        raise UserFacingError(f"no such file: {path}")
    if _is_parquet(path):
        return pd.read_parquet(path)
    return pd.read_csv(path, sep=_separator(path), dtype=str, keep_default_na=False)


def _is_parquet(path: Path) -> bool:
    return path.suffix.lower() in (".parquet", ".pq") or ".parquet" in path.name


def _separator(path: Path) -> str:
    with path.open(encoding="utf-8", errors="replace") as handle:
        header = handle.readline()
    return "\t" if "\t" in header else ","


class TableSource:
    """A table read a chunk at a time: a CSV/TSV or Parquet file, or a frame in memory.

    ``chunks`` yields ``(first_row, frame)`` with the values ``read_table`` gives (CSV:
    text, nothing read as missing; Parquet: Arrow's pandas conversion, its pandas index
    restored), only the columns asked for.
    """

    def __init__(self, table: pd.DataFrame | str | Path) -> None:
        self.frame = table if isinstance(table, pd.DataFrame) else None
        self.path = None if self.frame is not None else Path(table)
        if self.frame is not None:
            self.columns = [str(c) for c in self.frame.columns]
        elif not self.path.exists():
            raise UserFacingError(f"no such file: {self.path}")
        elif _is_parquet(self.path):
            schema = pq.read_schema(self.path)
            index = (schema.pandas_metadata or {}).get("index_columns", [])
            self.columns = [c for c in schema.names if c not in index]
        else:
            self.separator = _separator(self.path)
            header = pd.read_csv(self.path, sep=self.separator, dtype=str, nrows=0)
            self.columns = [str(c) for c in header.columns]

    def __repr__(self) -> str:
        return f"TableSource({self.path or f'<frame of {len(self.frame)} rows>'})"

    def chunks(
        self, rows: int, columns: Sequence[str] | None = None
    ) -> Iterator[tuple[int, pd.DataFrame]]:
        """``(first_row, frame)`` of ``rows`` rows (the last one shorter; Parquet row groups
        may cut one short), ``columns`` only (None: all)."""
        rows = max(int(rows), 1)
        offset = 0
        for chunk in self._chunks(rows, None if columns is None else list(columns)):
            yield offset, chunk
            offset += len(chunk)

    def _chunks(self, rows: int, columns: list[str] | None) -> Iterator[pd.DataFrame]:
        if self.frame is not None:
            for start in range(0, len(self.frame), rows):
                part = self.frame.iloc[start : start + rows]
                yield part if columns is None else part[columns]
        elif _is_parquet(self.path):
            with pq.ParquetFile(self.path) as parquet:
                for batch in parquet.iter_batches(batch_size=rows, columns=columns):
                    yield pa.Table.from_batches([batch]).to_pandas()
        else:
            options = {"sep": self.separator, "dtype": str, "keep_default_na": False}
            with pd.read_csv(self.path, **options, usecols=columns, chunksize=rows) as reader:
                yield from reader


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
    """Normalize, sort (stable, by time) and cut a replay frame held whole.

    Output columns: event_id, user_id, item_id, event_type, ts_ms, value. Ids
    default to ``{event_id_prefix}-{file_row}`` (file_row: 0-based data row).
    ``replay_events`` produces the same rows from a file without holding it.
    """
    _check_columns(frame.columns)
    out = _normalized(frame, _file_rows(frame, 0), None, event_id_prefix)
    assert out is not None  # without a Problems to collect into, every check raises
    out = out.sort_values(SORT_KEY, kind="stable").reset_index(drop=True)
    out = cut_window(out, start=start, end=end)
    if limit is not None:
        out = out.iloc[: max(int(limit), 0)]
    return out[OUTPUT_COLUMNS]


def _check_columns(columns: Iterable[Any]) -> None:
    missing = [c for c in REQUIRED_COLUMNS if c not in set(columns)]
    if missing:
        raise UserFacingError(f"events need columns {REQUIRED_COLUMNS}; missing {missing}")


def _file_rows(frame: pd.DataFrame, offset: int) -> pd.Series:
    """The tiebreak and default id of each row: its ``file_row`` column, else its data row."""
    if "file_row" in frame.columns:
        return pd.Series(frame["file_row"].to_numpy(), dtype="int64")
    return pd.Series(np.arange(offset, offset + len(frame), dtype="int64"))


@dataclass
class Problems:
    """Validation errors of a log read in chunks, kept (the first of each check) so that the
    one raised is the one ``prepare_events`` raises on the whole frame, whose checks run
    column by column in this order."""

    ORDER = ("user_id", "item_id", "timestamp", "event_id")
    first: dict[str, str] = field(default_factory=dict)
    unknown_types: list[str] = field(default_factory=list)  # the 5 smallest, sorted

    def __bool__(self) -> bool:
        return bool(self.first or self.unknown_types)

    def check(self, name: str, convert: Any) -> pd.Series | None:
        try:
            return convert()
        except UserFacingError as exc:
            self.first.setdefault(name, str(exc))
            return None

    def raise_first(self) -> None:
        for name in self.ORDER:
            if name in self.first:
                raise UserFacingError(self.first[name])
        if self.unknown_types:
            raise UserFacingError(_unknown_types_message(self.unknown_types))


def _normalized(
    frame: pd.DataFrame,
    file_row: pd.Series,
    unit: str | None,
    event_id_prefix: str,
    problems: Problems | None = None,
) -> pd.DataFrame | None:
    """``frame``'s rows as ts_ms, file_row, ids, event_type and value, in file order.

    Without ``problems`` the first failing check raises; with it every check runs, their
    errors are recorded there and None comes back if any failed.
    """
    converters = {
        "user_id": lambda: _ids(frame["user_id"], "user_id"),
        "item_id": lambda: _ids(frame["item_id"], "item_id"),
        "ts_ms": lambda: timestamps_ms(frame["timestamp"], unit),
        "event_id": lambda: (
            _ids(frame["event_id"], "event_id")
            if "event_id" in frame.columns
            else event_id_prefix + "-" + file_row.astype(str)
        ),
    }
    columns: dict[str, pd.Series | None] = {"ts_ms": None, "file_row": file_row}
    for name, convert in converters.items():
        check = "timestamp" if name == "ts_ms" else name
        columns[name] = convert() if problems is None else problems.check(check, convert)
    types = _event_types(frame)
    unknown = sorted(set(types) - set(EVENT_TYPES))
    if unknown and problems is None:
        raise UserFacingError(_unknown_types_message(unknown))
    if unknown and problems is not None:
        problems.unknown_types = sorted(set(problems.unknown_types) | set(unknown[:5]))[:5]
    if any(column is None for column in columns.values()) or unknown:
        return None
    columns["event_type"], columns["value"] = types, _values(frame)
    return pd.DataFrame(columns)


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


def timestamp_unit(column: pd.Series) -> str:
    """How ``timestamps_ms`` reads this whole column: "s" or "ms" (all numbers; seconds
    when every magnitude is below ``SECONDS_LIMIT``) or "text" (ISO 8601 or digits)."""
    numeric = pd.to_numeric(column, errors="coerce")
    return _unit(bool(numeric.notna().all()), numeric.abs().max())


def _unit(all_numeric: bool, largest: float) -> str:
    if not all_numeric:
        return "text"
    return "s" if largest < SECONDS_LIMIT else "ms"  # NaN (no rows): ms, as before


def timestamps_ms(column: pd.Series, unit: str | None = None) -> pd.Series:
    """Epoch seconds or ms (chosen per column by magnitude) or ISO 8601 text -> epoch ms.

    ``unit`` ("s", "ms", "text"): the choice made for the whole log when ``column`` is
    one chunk of it; None: chosen from ``column``.
    """
    numeric = pd.to_numeric(column, errors="coerce")
    if unit is None:
        unit = _unit(bool(numeric.notna().all()), numeric.abs().max())
    if unit != "text":
        as_ms = numeric * 1000 if unit == "s" else numeric
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
    return frame["event_type"].astype(str).str.strip().str.lower().reset_index(drop=True)


def _unknown_types_message(unknown: list[str]) -> str:
    return f"unknown event_type values {unknown[:5]}; allowed: {EVENT_TYPES}"


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


def _parsed_bound(text: str | float | None) -> tuple[str, float] | UserFacingError | None:
    """``parse_bound``'s answer, or its error kept to be raised after the validation."""
    if text is None:
        return None
    try:
        return parse_bound(text)
    except UserFacingError as exc:
        return exc


def _in_order(prepared: pd.DataFrame, last: tuple[int, int] | None) -> bool:
    """Whether ``prepared`` (after ``last``, the previous row's key) is in (ts_ms, file_row)
    order: then a stable sort would leave it as it is."""
    ts, rows = prepared["ts_ms"].to_numpy(), prepared["file_row"].to_numpy()
    if last is not None:
        ts, rows = np.concatenate(([last[0]], ts)), np.concatenate(([last[1]], rows))
    if len(ts) < 2:
        return True
    step = np.diff(ts)
    return bool(np.all((step > 0) | ((step == 0) & (np.diff(rows) >= 0))))


@dataclass
class ReplayScan:
    """Passes 1 and 2 of a streamed replay (module docstring): validation, counts, order,
    and the spilled runs of an out-of-order log; then ``rows()`` streams pass 3."""

    source: TableSource
    event_id_prefix: str
    chunk_rows: int
    temp_dir: Path
    bounds: dict[str, tuple[str, float] | UserFacingError | None]
    unit: str = "ms"
    problems: Problems = field(default_factory=Problems)
    n: int = 0
    below: dict[str, int] = field(default_factory=lambda: {"start": 0, "end": 0})
    in_order: bool = True
    head_rows: int = 0  # rows [0, head_rows) of the file are in order (out-of-order logs)
    last_key: tuple[int, int] | None = None
    runs: SortedRuns | None = None
    held: pd.DataFrame | None = None  # the newest sorted run, kept in memory
    window: tuple[int, int] = (0, 0)  # [lo, stop) in sorted order

    @property
    def columns(self) -> list[str]:
        present = set(self.source.columns)
        return [c for c in (*REQUIRED_COLUMNS, *OPTIONAL_COLUMNS) if c in present]

    @property
    def count(self) -> int:
        return max(self.window[1] - self.window[0], 0)

    @property
    def sorted_runs(self) -> int:
        if self.held is None or self.runs is None:
            return 0
        return len(self.runs.paths) + 1

    def scan(self, start: Any, end: Any, limit: int | None) -> ReplayScan:
        """Passes 1 and 2; raises what ``prepare_events`` would, before anything is sent."""
        _check_columns(self.source.columns)
        self.unit = self._timestamp_unit()
        for name, bound in (("start", start), ("end", end)):
            self.bounds[name] = _parsed_bound(bound)
        for offset, chunk in self.source.chunks(self.chunk_rows, self.columns):
            self._feed(offset, chunk)
        self.problems.raise_first()
        for name in ("start", "end"):
            if isinstance(self.bounds[name], UserFacingError):
                raise self.bounds[name]
        self.window = self._window(limit)
        return self

    def _timestamp_unit(self) -> str:
        largest = math.nan
        for _, chunk in self.source.chunks(self.chunk_rows, ["timestamp"]):
            numeric = pd.to_numeric(chunk["timestamp"], errors="coerce")
            if not numeric.notna().all():
                return "text"  # one value that is not a number makes the column text
            if len(numeric):
                top = float(numeric.abs().max())
                largest = top if math.isnan(largest) else max(largest, top)
        return _unit(True, largest)

    def _feed(self, offset: int, chunk: pd.DataFrame) -> None:
        prepared = _normalized(
            chunk, _file_rows(chunk, offset), self.unit, self.event_id_prefix, self.problems
        )
        self.n += len(chunk)
        if prepared is None or self.problems:
            self._drop_runs()  # nothing of a bad log is replayed: stop sorting it
            return
        for name, bound in self.bounds.items():
            if isinstance(bound, tuple) and bound[0] == "time":
                self.below[name] += int((prepared["ts_ms"] < bound[1]).sum())
        if self.in_order and _in_order(prepared, self.last_key):
            if len(prepared):
                self.last_key = (int(prepared["ts_ms"].iat[-1]), int(prepared["file_row"].iat[-1]))
            return
        if self.in_order:
            self.in_order, self.head_rows = False, offset
        ordered = prepared.sort_values(SORT_KEY, kind="stable")[RUN_COLUMNS]
        if self.runs is None:
            self.runs = SortedRuns(self.temp_dir, RUN_COLUMNS, SORT_KEY, prefix="replay-")
        if self.held is not None:
            self.runs.spill(pa.Table.from_pandas(self.held, preserve_index=False))
        self.held = ordered.reset_index(drop=True)

    def _window(self, limit: int | None) -> tuple[int, int]:
        """[lo, stop) of the sorted log, as ``cut_window`` and then ``limit`` cut it."""
        ends = {"start": 0, "end": self.n}
        for name, bound in self.bounds.items():
            if isinstance(bound, tuple):
                kind, value = bound
                ends[name] = round(value * self.n) if kind == "fraction" else self.below[name]
        lo = ends["start"]
        stop = max(lo, ends["end"])
        if limit is not None:
            stop = min(stop, lo + max(int(limit), 0))
        return lo, min(stop, max(self.n, lo))

    def rows(self) -> Iterator[tuple]:
        """Pass 3: the window's rows in ``OUTPUT_COLUMNS`` order, in stable time order."""
        lo, stop = self.window
        if self.held is None or self.runs is None:
            return self._file_rows(OUTPUT_COLUMNS, lo, stop)
        batch_rows = max(self.chunk_rows // (self.sorted_runs + 1), MIN_MERGE_BATCH_ROWS)
        head = self._file_rows(RUN_COLUMNS, 0, self.head_rows) if self.head_rows else None
        last = self.held.itertuples(index=False, name=None)
        merged = self.runs.merge(batch_rows=batch_rows, before=head, after=last)
        return (
            (row[2], row[3], row[4], row[5], row[0], row[6]) for row in islice(merged, lo, stop)
        )

    def _file_rows(self, layout: list[str], lo: int, stop: int) -> Iterator[tuple]:
        """Rows [lo, stop) of the file (in order there), converted, in ``layout``."""
        for offset, chunk in self.source.chunks(self.chunk_rows, self.columns):
            if offset >= stop:
                return
            if offset + len(chunk) <= lo:
                continue  # before the window: read, not converted
            prepared = _normalized(
                chunk, _file_rows(chunk, offset), self.unit, self.event_id_prefix
            )
            part = prepared.iloc[max(lo - offset, 0) : stop - offset]
            yield from part[layout].itertuples(index=False, name=None)

    def _drop_runs(self) -> None:
        self.held = None
        if self.runs is not None:
            self.runs.close()

    def __enter__(self) -> ReplayScan:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._drop_runs()


def event_message(row: tuple) -> tuple[bytes, bytes]:
    """(key, value) bytes of one prepared row (``OUTPUT_COLUMNS`` order) for the producer."""
    event_id, user_id, item_id, event_type, ts_ms, value = row
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
    return user_id.encode(), json.dumps(payload, separators=(",", ":")).encode()


def event_messages(frame: pd.DataFrame) -> list[tuple[bytes, bytes]]:
    """(key, value) bytes of each prepared row, ready for the producer."""
    return [event_message(row) for row in frame[OUTPUT_COLUMNS].itertuples(index=False)]


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
    events: pd.DataFrame | str | Path | TableSource,
    *,
    rate: float | None = None,
    start: str | float | None = None,
    end: str | float | None = None,
    limit: int | None = None,
    event_id_prefix: str = "replay",
    topic: str | None = None,
    progress: bool = True,
    producer: Any = None,
    chunk_rows: int | None = None,
) -> ReplayResult:
    """Produce ``events`` (a frame, a CSV/Parquet file or its ``TableSource``; columns as in
    ``prepare_events``) to the events topic, ``chunk_rows`` (default
    ``ingest.replay_chunk_rows``) at a time; returns counts."""
    source = events if isinstance(events, TableSource) else TableSource(events)
    topic = topic or settings.kafka.topic_events
    assert settings.data_dir is not None
    with ReplayScan(
        source,
        event_id_prefix,
        chunk_rows or settings.ingest.replay_chunk_rows,
        settings.data_dir / "tmp",
        bounds={},
    ) as scan:
        scan.scan(start, end, limit)
        log.debug(  # debug: a failing replay's only line stays its error
            "replay: %d events in %s, %s; %d in the window",
            scan.n,
            source,
            "in time order" if scan.in_order else f"sorting {scan.sorted_runs} runs",
            scan.count,
        )
        began, runs = time.monotonic(), scan.sorted_runs
        with EventSender(settings, topic, producer) as sender:
            first, last = _send_rows(sender, scan.rows(), scan.count, rate, progress)
        seconds = time.monotonic() - began
    log.info(
        "replayed %d events to %s in %.1f s (%s .. %s)",
        sender.sent,
        topic,
        seconds,
        _iso(first),
        _iso(last),
    )
    return ReplayResult(
        produced=sender.sent,
        first_ts_ms=first,
        last_ts_ms=last,
        seconds=seconds,
        in_order=scan.in_order,
        sorted_runs=runs,
    )


def _send_rows(
    sender: EventSender, rows: Iterator[tuple], total: int, rate: float | None, progress: bool
) -> tuple[int | None, int | None]:
    """Send each row's message (at ``rate`` events/s at most); the first and last ts_ms."""
    first = last = None
    began = time.monotonic()
    with progress_bar(total=total, desc="replay", unit="ev", disable=not progress) as bar:
        for i, row in enumerate(rows):
            sender.send(*event_message(row))
            bar.update(1)
            if first is None:
                first = int(row[4])
            last = int(row[4])
            if rate:
                ahead = (i + 1) / rate - (time.monotonic() - began)
                if ahead > 0:
                    time.sleep(ahead)
    return first, last


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


def load_item_file(settings: Settings, path: str | Path, page_rows: int | None = None) -> int:
    """Upsert a catalog file (CSV or Parquet, as ``item_rows`` reads it) ``page_rows`` items
    (default ``ingest.replay_chunk_rows``) at a time; returns how many. The whole file's
    ``item_id`` column is checked first, so a file ``item_rows`` refuses upserts nothing."""
    source = TableSource(path)
    page_rows = page_rows or settings.ingest.replay_chunk_rows
    if "item_id" not in source.columns:
        raise UserFacingError("items need an item_id column")
    for _, chunk in source.chunks(page_rows, ["item_id"]):
        if any(not _text(value) for value in chunk["item_id"]):
            raise UserFacingError("items have empty item_id values")
    engine = make_engine(str(settings.database_url))
    try:
        return sum(upsert_items(engine, item_rows(page)) for _, page in source.chunks(page_rows))
    finally:
        engine.dispose()


def replay_ml100k(settings: Settings, **window) -> int:
    """ML-100K's catalog into the store and its events (``window``: ``cut_window``'s
    ``start``/``end``, plus ``replay_events``' options) into Kafka; returns how many were produced."""
    load_items(settings, ml100k_items())
    frame = ml100k_events()
    return replay_events(settings, frame, event_id_prefix="ml-100k", **window).produced
