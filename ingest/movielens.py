"""MovieLens-100K, read from the files the ``recbole`` package ships (no download).

The interactions come back in a stable timestamp order: events that share a
timestamp keep their file order, the tie rule every genrec evaluation uses.

Example::

    >>> from genrec.ingest.movielens import load_ml100k
    >>> dataset = load_ml100k()
    >>> len(dataset.events), len(dataset.items)
    (100000, 1682)
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from sqlalchemy import insert

from genrec.schemas import tables

DATASET_NAME = "ml-100k"


@dataclass(frozen=True)
class MovieLens:
    """``events``: user_id, item_id, rating, timestamp (s), file_row; ``items``: item_id, title, year, genres."""

    events: pd.DataFrame
    items: pd.DataFrame


def ml100k_dir() -> Path:
    """Folder of the ML-100K files inside the installed recbole package (never imported)."""
    spec = importlib.util.find_spec("recbole")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "MovieLens-100K needs the recbole package: pip install --no-deps recbole==1.2.1"
        )
    folder = Path(spec.submodule_search_locations[0]) / "dataset_example" / DATASET_NAME
    if not (folder / "ml-100k.inter").exists():
        raise FileNotFoundError(f"ml-100k.inter not found under {folder}")
    return folder


def load_ml100k() -> MovieLens:
    folder = ml100k_dir()
    events = pd.read_csv(folder / "ml-100k.inter", sep="\t", dtype=str)
    events.columns = ["user_id", "item_id", "rating", "timestamp"]
    events["rating"] = events["rating"].astype(float)
    events["timestamp"] = events["timestamp"].astype(float).astype("int64")
    events["file_row"] = range(len(events))
    events = events.sort_values("timestamp", kind="stable").reset_index(drop=True)

    items = pd.read_csv(folder / "ml-100k.item", sep="\t", dtype=str, keep_default_na=False)
    items.columns = ["item_id", "title", "year", "genres"]
    items["year"] = pd.to_numeric(items["year"], errors="coerce").astype("Int64")
    # The file marks missing values with the misspelt placeholder 'unkonwn'.
    items.loc[items["title"] == "unkonwn", "title"] = ""
    items["genres"] = items["genres"].replace("unknown", "")
    return MovieLens(events=events, items=items)


def store_ml100k(engine) -> None:
    """ML-100K's items and rating events into an empty store, as replay + ingest would write
    them (event ids ``ml-100k-{file_row}``, type ``rate``), without Kafka: for benchmarks and
    tests that need the real data in a store quickly."""
    dataset = load_ml100k()
    item_rows = [
        {
            "item_id": row.item_id,
            "title": row.title or None,
            "year": None if pd.isna(row.year) else int(row.year),
            "genres": row.genres or None,
        }
        for row in dataset.items.itertuples()
    ]
    event_rows = [
        {
            "event_id": f"ml-100k-{row.file_row}",
            "user_id": row.user_id,
            "item_id": row.item_id,
            "event_type": "rate",
            "ts_ms": int(row.timestamp) * 1000,
            "value": float(row.rating),
        }
        for row in dataset.events.itertuples()
    ]
    with engine.begin() as connection:
        connection.execute(insert(tables.items), item_rows)
        connection.execute(insert(tables.events), event_rows)
