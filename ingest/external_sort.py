"""Sorting more rows than memory holds (ingest step: the external sort behind ``genrec replay``).

The caller sorts each chunk itself (stably, by the key columns) and hands it to
``SortedRuns.spill``, which writes it to a Parquet file of its own in a private temporary
folder (never a pickle). ``SortedRuns.merge`` then streams every row back, as a tuple in the
runs' column order, in global key order: ``heapq.merge`` over one iterator per source,
each reading its file in small record batches. ``heapq.merge`` is stable (equal keys come
out in the order of the iterables, then of each iterable's rows), so stably sorted runs of
consecutive parts of a log, merged in the order of those parts, give exactly the stable
sort of the whole log.

Cost, for n rows in r runs: disk holds the rows once (zstd Parquet); the merge reads each
row once and makes O(n log r) key comparisons in Python; memory is one batch per run
(``batch_rows``, chosen by the caller) plus the heap of r rows; r files are open during the
merge. ``close`` (or leaving the ``with`` block) removes the folder, error or not.

Example::

    >>> with SortedRuns(tmp_dir, ["ts", "row", "id"], key=["ts", "row"]) as runs:  # doctest: +SKIP
    ...     runs.spill(pa.Table.from_pandas(chunk.sort_values(["ts", "row"], kind="stable")))
    ...     for row in runs.merge(batch_rows=1024):
    ...         ...
"""

from __future__ import annotations

import heapq
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from operator import itemgetter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

# Spilled files keep row groups this small at most, so that reading one run a batch at a
# time never decodes more than this many of its rows at once.
SPILL_ROW_GROUP_ROWS = 65_536


class SortedRuns:
    """Sorted runs spilled to Parquet under ``parent`` and merged back by ``key``."""

    def __init__(
        self, parent: str | Path, columns: Sequence[str], key: Sequence[str], prefix: str = "sort-"
    ) -> None:
        self.columns, self.key = list(columns), tuple(key)
        missing = [k for k in self.key if k not in self.columns]
        if missing:
            raise ValueError(f"key columns {missing} are not among {self.columns}")
        self.parent, self.prefix = Path(parent), prefix
        self.folder: Path | None = None  # made at the first spill: no run, no folder
        self.paths: list[Path] = []
        self.rows = 0

    def spill(self, table: pa.Table) -> None:
        """Write one run: ``table`` (columns as given to the constructor) must already be
        sorted by ``key``, stably."""
        if list(table.column_names) != self.columns:
            raise ValueError(f"run columns {table.column_names} differ from {self.columns}")
        if self.folder is None:
            self.parent.mkdir(parents=True, exist_ok=True)
            self.folder = Path(tempfile.mkdtemp(prefix=self.prefix, dir=self.parent))
        path = self.folder / f"run-{len(self.paths):06d}.parquet"
        pq.write_table(table, path, compression="zstd", row_group_size=SPILL_ROW_GROUP_ROWS)
        self.paths.append(path)
        self.rows += table.num_rows

    def merge(
        self,
        *,
        batch_rows: int,
        before: Iterable[tuple] | None = None,
        after: Iterable[tuple] | None = None,
    ) -> Iterator[tuple]:
        """Every row, as a tuple in the runs' column order, in stable key order.

        ``before`` and ``after``: more sorted row iterables (same tuple layout) that count
        as runs placed before the first spilled one and after the last, e.g. a part of the
        log that was already in order, or the last run still in memory.
        """
        key = itemgetter(*(self.columns.index(k) for k in self.key))
        sources: list[Iterable[tuple]] = [] if before is None else [before]
        sources += [_run_rows(path, batch_rows) for path in self.paths]
        if after is not None:
            sources.append(after)
        return heapq.merge(*sources, key=key)

    def close(self) -> None:
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None
        self.paths = []

    def __enter__(self) -> SortedRuns:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _run_rows(path: Path, batch_rows: int) -> Iterator[tuple]:
    """One spilled run's rows, reading ``batch_rows`` at a time."""
    with pq.ParquetFile(path) as parquet:
        for batch in parquet.iter_batches(batch_size=max(int(batch_rows), 1)):
            yield from zip(*(column.to_pylist() for column in batch.columns), strict=True)
