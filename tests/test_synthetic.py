"""The synthetic workload: deterministic, readable by replay, shaped like real traffic, bounded."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from genrec.infra.settings import RecallSettings, Settings
from genrec.ingest import replay
from genrec.ingest.synthetic import SyntheticConfig, event_batches, generate, item_batches, stream
from genrec.offline.recall import fit_itemcf
from genrec.offline.semantic_ids.embeddings import render_item_text
from genrec.online.branches import PopularityBranch
from genrec.schemas.events import validate_event_fields

# One shape for the realism checks: 30 events per user on average, 5,000 items.
SHAPE = {"users": 2_000, "items": 5_000, "events": 60_000}


def events_table(config: SyntheticConfig) -> pa.Table:
    return pa.concat_tables(list(event_batches(config)))


def events_frame(config: SyntheticConfig) -> pd.DataFrame:
    return events_table(config).to_pandas()


@pytest.fixture(scope="module")
def workload() -> pd.DataFrame:
    """Events without re-consumption, each with its item's category."""
    config = SyntheticConfig(**SHAPE, seed=3, reconsume_rate=0.0)
    frame = events_frame(config)
    catalog = pa.concat_tables(list(item_batches(config))).to_pandas()
    return frame.merge(catalog[["item_id", "category"]], on="item_id", how="left")


def test_same_seed_and_sizes_give_the_same_bytes(tmp_path: Path) -> None:
    base = {"users": 300, "items": 1_000, "events": 20_000, "seed": 5}
    first = generate(SyntheticConfig(**base, row_group_size=5_000), tmp_path / "a")
    again = generate(SyntheticConfig(**base, row_group_size=5_000), tmp_path / "b")
    regrouped = generate(SyntheticConfig(**base, row_group_size=3_000), tmp_path / "c")
    other = generate(SyntheticConfig(**{**base, "seed": 6}, row_group_size=5_000), tmp_path / "d")
    for name in ("events.parquet", "items.parquet"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
        assert (tmp_path / "a" / name).read_bytes() != (tmp_path / "d" / name).read_bytes()
        # The row-group size changes the layout, never the rows.
        assert pq.read_table(tmp_path / "a" / name).equals(pq.read_table(tmp_path / "c" / name))
    assert first.event_count == again.event_count == 20_000
    assert pq.ParquetFile(first.events).metadata.num_row_groups == 4
    assert pq.ParquetFile(regrouped.events).metadata.num_row_groups == 7
    assert pq.ParquetFile(other.events).metadata.num_rows == 20_000


def test_replay_reads_the_files_unchanged(tmp_path: Path) -> None:
    config = SyntheticConfig(users=200, items=800, events=5_000, seed=1, row_group_size=2_000)
    files = generate(config, tmp_path)
    raw = replay.read_table(files.events)
    prepared = replay.prepare_events(raw)
    assert len(prepared) == 5_000
    assert prepared["event_id"].is_unique
    assert prepared["event_id"].tolist() == raw["event_id"].tolist()  # already in replay's order
    assert prepared["ts_ms"].tolist() == raw["timestamp"].tolist()  # read as milliseconds
    assert prepared["ts_ms"].is_monotonic_increasing
    assert prepared["ts_ms"].iloc[0] >= 1_704_067_200_000  # 2024-01-01
    assert set(prepared["event_type"]) == {"view", "click", "cart", "purchase"}
    priced = prepared["event_type"].isin(["cart", "purchase"])
    assert prepared.loc[priced, "value"].gt(0).all()
    assert prepared.loc[~priced, "value"].isna().all()
    for _, value in replay.event_messages(prepared.head(200)):
        assert isinstance(validate_event_fields(value), tuple)

    rows = replay.item_rows(replay.read_table(files.items))
    assert len(rows) == 800
    catalog = {row["item_id"] for row in rows}
    assert set(prepared["item_id"]) <= catalog
    template = Settings().semantic_ids.text_template
    for row in rows[:50]:
        assert row["title"].startswith(row["attributes"]["brand"] + " ")
        assert row["attributes"]["category"] in row["title"]
        assert row["genres"] == row["attributes"]["category"]
        assert row["title"] in render_item_text(row, template)

    plain = generate(
        SyntheticConfig(users=200, items=800, events=1_000, text=False), tmp_path / "p"
    )
    table = replay.read_table(plain.items)
    assert "title" not in table.columns and "genres" not in table.columns
    for row in replay.item_rows(table)[:50]:
        assert row["title"] is None and row["genres"] is None
        assert row["attributes"]["category"].startswith("cat")
        assert render_item_text(row, template) is None  # the text path falls back to behavior


def test_popularity_is_zipf_like(workload: pd.DataFrame) -> None:
    counts = workload["item_id"].value_counts().to_numpy()
    top = SHAPE["items"] // 100
    assert counts[:top].sum() / len(workload) > 0.10  # the top 1% of items: 10x a uniform share
    ranks = np.arange(1, len(counts) + 1)
    middle = (ranks >= 5) & (ranks <= 500)  # below the head that saturates (once per user)
    slope = np.polyfit(np.log(ranks[middle]), np.log(counts[middle]), 1)[0]
    assert -1.3 < slope < -0.4


def test_user_activity_is_heavy_tailed(workload: pd.DataFrame) -> None:
    counts = workload["user_id"].value_counts().to_numpy()
    assert counts[: SHAPE["users"] // 10].sum() / len(workload) > 0.35
    assert counts.max() > 20 * np.median(counts)


def test_without_reconsumption_no_user_has_an_item_twice(workload: pd.DataFrame) -> None:
    assert not workload.duplicated(["user_id", "item_id"]).any()


def test_reconsume_rate_is_the_share_of_repeats() -> None:
    frame = events_frame(SyntheticConfig(**SHAPE, seed=3, reconsume_rate=0.2))
    repeats = frame.duplicated(["user_id", "item_id"]).mean()  # item had before, in time order
    assert 0.15 < repeats <= 0.2


def test_interests_drift_over_time(workload: pd.DataFrame) -> None:
    still = SyntheticConfig(**SHAPE, seed=3, reconsume_rate=0.0, interest_drifts=0.0)
    catalog = pa.concat_tables(list(item_batches(still))).to_pandas()
    steady = events_frame(still).merge(catalog[["item_id", "category"]], on="item_id")
    assert new_category_share(workload) > new_category_share(steady) + 0.1


def new_category_share(frame: pd.DataFrame) -> float:
    """For users with 40+ events: the share of their last quarter's events in categories
    absent from their first quarter."""
    shares = []
    for _, events in frame.sort_values("timestamp", kind="stable").groupby("user_id"):
        if len(events) < 40:
            continue
        quarter = len(events) // 4
        early = set(events["category"].iloc[:quarter])
        shares.append(float((~events["category"].iloc[-quarter:].isin(early)).mean()))
    assert len(shares) > 100
    return float(np.mean(shares))


def test_itemcf_beats_popularity_on_a_time_split(workload: pd.DataFrame) -> None:
    """Each user's last event held out; recall branches fitted on the rest, seen items excluded."""
    ordered = workload.sort_values(["user_id", "timestamp"], kind="stable")
    train, held_out = {}, {}
    for user, items in ordered.groupby("user_id")["item_id"]:
        sequence = [str(item) for item in items]
        if len(sequence) >= 3:
            train[user], held_out[user] = sequence[:-1], sequence[-1]
        else:
            train[user] = sequence
    catalog = [str(item) for item in range(1, SHAPE["items"] + 1)]
    recall = RecallSettings()
    popularity = PopularityBranch.fit(train, catalog, half_life_days=None)
    itemcf = fit_itemcf(train, catalog, recall)
    users = list(held_out)
    histories = [train[user] for user in users]
    hit_rates = {}
    for name, branch in (("popularity", popularity), ("itemcf", itemcf)):
        lists = branch.recommend_batch(histories, 10, excludes=histories)
        hits = [
            held_out[u] in {item for item, _ in top} for u, top in zip(users, lists, strict=True)
        ]
        hit_rates[name] = float(np.mean(hits))
    assert len(users) > 1_500
    assert hit_rates["popularity"] > 0.02  # popularity is a real baseline here...
    assert hit_rates["itemcf"] > 1.5 * hit_rates["popularity"]  # ...that structure beats


def test_stream_produces_replays_messages_and_loads_the_catalog(tmp_path: Path) -> None:
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'genrec.db'}")
    config = SyntheticConfig(users=100, items=300, events=3_000, seed=2, row_group_size=1_000)
    producer = FakeProducer()
    assert stream(settings, config, producer=producer) == 3_000
    expected = replay.event_messages(replay.prepare_events(events_frame(config)))
    assert producer.sent == [(settings.kafka.topic_events, key, value) for key, value in expected]
    assert producer.flushed
    from genrec.infra.database import make_engine
    from genrec.ingest.history import load_item_ids

    assert len(load_item_ids(make_engine(str(settings.database_url)))) == 300


class FakeProducer:
    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes, bytes]] = []
        self.flushed = False

    def send(self, topic: str, key: bytes, value: bytes):
        self.sent.append((topic, key, value))
        return self

    def add_errback(self, callback) -> None:
        pass

    def flush(self) -> None:
        self.flushed = True


PEAK_RSS = """
import json, resource, sys
from genrec.ingest.synthetic import SyntheticConfig, generate
config = SyntheticConfig(users=20_000, items=20_000, events=int(sys.argv[1]), row_group_size=100_000)
files = generate(config, sys.argv[2])
print(json.dumps({"events": files.event_count,
                  "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def test_memory_does_not_grow_with_the_event_log(tmp_path: Path) -> None:
    """Peak RSS for 200k and 2M events (same users and items): the 2M-event log alone is
    ~120 MiB in Arrow; generating it costs a few MiB more than 200k (about 2 bytes per event)."""
    peaks = {}
    for events in (200_000, 2_000_000):
        done = subprocess.run(
            [sys.executable, "-c", PEAK_RSS, str(events), str(tmp_path / str(events))],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout)
        assert result["events"] == events
        peaks[events] = result["peak_mib"]
    assert peaks[2_000_000] - peaks[200_000] < 60, peaks


def test_bad_sizes_are_refused() -> None:
    for bad in ({"users": 0}, {"events": 0}, {"reconsume_rate": 1.5}, {"seed": -1}):
        with pytest.raises(ValueError):
            SyntheticConfig(**{"users": 10, "items": 10, "events": 10, **bad})


def test_the_command_writes_both_files(tmp_path: Path, capsys) -> None:
    from genrec.app.cli import main

    args = ["--users", "50", "--items", "100", "--events", "1000", "--seed", "4", "--no-text"]
    assert main(["synthetic", *args, "--out", str(tmp_path)]) == 0
    assert "events: 1,000 written to" in capsys.readouterr().out
    assert pq.read_metadata(tmp_path / "events.parquet").num_rows == 1_000
    assert "title" not in pq.read_schema(tmp_path / "items.parquet").names
    config = SyntheticConfig(users=50, items=100, events=1_000, seed=4, text=False)
    assert pq.read_table(tmp_path / "events.parquet").equals(events_table(config))
    assert main(["synthetic", "--users", "0", "--items", "1", "--events", "1", "--out", "x"]) == 2
