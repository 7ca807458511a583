"""``genrec replay``: the streamed replay gives what the whole-frame one gives (same messages,
order, ids, windows and errors; in order or through the external sort; CSV and Parquet),
and end to end: MovieLens-100K and a CSV/Parquet log through Kafka into the store."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from sqlalchemy import select

from genrec.infra.database import make_engine
from genrec.infra.errors import UserFacingError
from genrec.infra.settings import Settings
from genrec.ingest import external_sort, replay
from genrec.ingest.consumer import Ingestor
from genrec.ingest.synthetic import SyntheticConfig, generate
from genrec.schemas.tables import events, items

GENREC = Path(sys.executable).parent / "genrec"
SECOND = 1_700_000_000  # epoch seconds: the logs below are in seconds unless said otherwise


class RecordingProducer:
    """A producer that keeps what it is sent (every send acknowledged)."""

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, bytes]] = []

    def send(self, topic: str, key: bytes, value: bytes) -> RecordingProducer:
        self.sent.append((key, value))
        return self

    def add_errback(self, callback) -> None:
        pass

    def flush(self) -> None:
        pass


def streamed(settings: Settings, events, chunk_rows: int, **options):
    """What ``replay_events`` sends for ``events`` read ``chunk_rows`` at a time."""
    producer = RecordingProducer()
    result = replay.replay_events(
        settings, events, producer=producer, progress=False, chunk_rows=chunk_rows, **options
    )
    assert result.produced == len(producer.sent)
    return producer.sent, result


def whole(frame: pd.DataFrame, **options) -> list[tuple[bytes, bytes]]:
    """The whole-frame replay: the log in memory, sorted at once (the reference)."""
    return replay.event_messages(replay.prepare_events(frame, **options))


def random_log(n: int, seed: int, *, in_order: bool = False) -> pd.DataFrame:
    """``n`` events over 40 seconds (many ties), some with a value, of a few types."""
    rng = random.Random(seed)
    seconds = [rng.randint(0, 40) for _ in range(n)]
    if in_order:
        seconds.sort()
    return pd.DataFrame(
        {
            "user_id": [f"u{rng.randint(1, 9)}" for _ in range(n)],
            "item_id": [str(rng.randint(1, 50)) for _ in range(n)],
            "timestamp": [str(SECOND + s) for s in seconds],
            "event_type": [rng.choice(["view", "click", " Cart", "purchase"]) for _ in range(n)],
            "value": [rng.choice(["", "2.5", "7"]) for _ in range(n)],
        }
    )


def write(frame: pd.DataFrame, path: Path) -> Path:
    if path.suffix == ".parquet":
        frame.to_parquet(path, row_group_size=64)  # row groups cut some chunks short
    else:
        frame.to_csv(path, index=False, sep="\t" if path.suffix == ".tsv" else ",")
    return path


WINDOWS = [
    {},
    {"end": "0.8"},
    {"start": "0.25", "end": "0.75", "limit": 40},
    {"start": str(SECOND + 10), "end": str(SECOND + 30)},
    {"start": "0.5", "end": str(SECOND + 5)},  # end before start: nothing
    {"start": "2023-11-14T22:13:40Z", "limit": 0},
    {"limit": 123},
]


@pytest.mark.parametrize("in_order", [False, True], ids=["unsorted", "sorted"])
@pytest.mark.parametrize("suffix", [".csv", ".tsv", ".parquet"])
def test_streamed_replay_sends_what_the_whole_frame_replay_sends(
    tmp_path: Path, suffix: str, in_order: bool
) -> None:
    settings = Settings(home=tmp_path)
    path = write(random_log(300, seed=7, in_order=in_order), tmp_path / f"log{suffix}")
    reference = replay.read_table(path)
    for window in WINDOWS:
        expected = whole(reference, event_id_prefix="log", **window)
        for chunk_rows in (37, 10_000):
            sent, result = streamed(settings, path, chunk_rows, event_id_prefix="log", **window)
            assert sent == expected, (window, chunk_rows)
            assert result.in_order is in_order
    assert not any((tmp_path / "var" / "tmp").glob("*/*"))  # every run removed after use


def test_a_tiny_chunk_takes_the_external_sort_and_spills_runs(tmp_path, monkeypatch) -> None:
    settings = Settings(home=tmp_path)
    frame = random_log(500, seed=3)
    spilled: list[int] = []
    spill = external_sort.SortedRuns.spill

    def counting_spill(self, table) -> None:
        spill(self, table)
        spilled.append(table.num_rows)
        assert self.paths[-1].exists() and self.paths[-1].parent.parent == tmp_path / "var" / "tmp"

    monkeypatch.setattr(external_sort.SortedRuns, "spill", counting_spill)
    sent, result = streamed(settings, frame, 50)
    assert sent == whole(frame)
    assert not result.in_order and result.sorted_runs == 10
    assert spilled == [50] * 9  # the last run is merged from memory
    spilled.clear()
    sent, result = streamed(settings, frame, 500)  # one chunk: sorted in memory, no disk
    assert sent == whole(frame) and result.sorted_runs == 1 and spilled == []


def test_a_log_in_order_at_first_merges_its_head_from_the_file(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path)
    ordered, rest = random_log(300, seed=1, in_order=True), random_log(200, seed=2)
    path = write(pd.concat([ordered, rest], ignore_index=True), tmp_path / "log.parquet")
    reference = replay.read_table(path)
    for window in WINDOWS:
        sent, result = streamed(settings, path, 64, **window)
        assert sent == whole(reference, **window), window
        assert result.sorted_runs == 4  # rows 0-255 stay in the file; 256-499 in 4 runs


def test_the_timestamp_unit_is_chosen_over_the_whole_log(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path)
    seconds = random_log(100, seed=4)
    in_ms = seconds.copy()
    in_ms.loc[99, "timestamp"] = str(SECOND * 1000)  # one value in ms: the column is ms
    mixed = seconds.copy()
    mixed.loc[60, "timestamp"] = "2023-11-14T22:13:30Z"  # one ISO value: the column is text
    mixed["timestamp"] = [str(int(t) * 1000) if t.isdigit() else t for t in mixed["timestamp"]]
    for frame in (seconds, in_ms, mixed):
        path = write(frame, tmp_path / "log.csv")
        for chunk_rows in (7, 1_000):
            assert streamed(settings, path, chunk_rows)[0] == whole(replay.read_table(path))


def test_numeric_parquet_timestamps_and_a_file_row_column(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path)
    frame = random_log(400, seed=5)
    frame["timestamp"] = frame["timestamp"].astype("int64") * 1000  # int64 epoch ms
    frame["file_row"] = list(range(400))[::-1]  # ties broken by this column, not file order
    frame["user_id"] = frame["user_id"].str[1:].astype("int64")  # integer ids
    path = write(frame, tmp_path / "log.parquet")
    for chunk_rows in (16, 1_000):
        sent, _ = streamed(settings, path, chunk_rows, event_id_prefix="x", end="0.9")
        assert sent == whole(replay.read_table(path), event_id_prefix="x", end="0.9")


def test_ml100k_streamed_in_chunks_is_the_whole_frame_replay(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path)
    frame = replay.ml100k_events()
    sent, result = streamed(settings, frame, 25_000, event_id_prefix="ml-100k", end="0.8")
    assert sent == whole(frame, event_id_prefix="ml-100k", end="0.8")
    assert len(sent) == 80_000 and result.in_order  # load_ml100k keeps it in time order


def test_a_synthetic_file_is_in_order_and_produced_as_read(tmp_path: Path) -> None:
    files = generate(SyntheticConfig(users=200, items=500, events=5_000, seed=1), tmp_path / "s")
    settings = Settings(home=tmp_path)
    sent, result = streamed(settings, files.events, 1_000, start="0.1")
    assert sent == whole(replay.read_table(files.events), start="0.1")
    assert result.in_order and result.sorted_runs == 0 and result.produced == 4_500


@pytest.mark.parametrize(
    ("column", "bad", "message"),
    [
        ("user_id", "", "user_id has empty values"),
        ("item_id", " ", "item_id has empty values"),
        ("timestamp", "soon", "timestamp column: timestamp 'soon' is not ISO 8601"),
        ("event_type", "like", "unknown event_type values"),
    ],
)
def test_bad_logs_raise_the_whole_frame_error_and_send_nothing(
    tmp_path: Path, column: str, bad: str, message: str
) -> None:
    settings = Settings(home=tmp_path)
    frame = random_log(300, seed=6)
    frame.loc[[250, 280], column] = bad
    frame.loc[20, "event_type"] = "zap"  # an earlier error of a check that comes later
    path = write(frame, tmp_path / "log.csv")
    with pytest.raises(UserFacingError) as expected:
        whole(replay.read_table(path))
    assert message in str(expected.value)
    producer = RecordingProducer()
    with pytest.raises(UserFacingError) as got:
        replay.replay_events(settings, path, producer=producer, progress=False, chunk_rows=40)
    assert str(got.value) == str(expected.value) and producer.sent == []
    assert not any((tmp_path / "var" / "tmp").glob("*/*"))


def test_bad_columns_and_bounds_are_refused_before_sending(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path)
    frame = random_log(50, seed=8)
    unknown = frame.assign(event_type=[f"t{i % 9}" for i in range(50)])  # 9 unknown values
    cases = [
        (frame.drop(columns="item_id"), {}),
        (unknown, {}),
        (frame, {"start": "yesterday"}),
        (frame, {"start": "0.5", "end": "-2"}),
    ]
    for log, options in cases:
        with pytest.raises(UserFacingError) as expected:
            whole(log, **options)
        with pytest.raises(UserFacingError) as got:
            streamed(settings, write(log, tmp_path / "log.csv"), 7, **options)
        assert str(got.value) == str(expected.value)
    with pytest.raises(UserFacingError, match="no such file"):
        streamed(settings, tmp_path / "missing.parquet", 7)


def test_the_catalog_is_upserted_in_pages_as_whole(tmp_path: Path) -> None:
    catalog = pd.DataFrame(
        {
            "item_id": [str(i) for i in range(25)],
            "title": [f"Item {i}" for i in range(25)],
            "year": ["1999", "", "2001", "x", "1984"] * 5,
            "brand": ["acme", "", "zed", "acme", ""] * 5,
        }
    )
    rows = {}
    for name, pages in (("whole", None), ("paged", 4)):
        url = f"sqlite:///{tmp_path / name}.db"
        settings = Settings(home=tmp_path, database_url=url)
        path = write(catalog, tmp_path / "items.parquet")
        if pages is None:
            assert replay.load_items(settings, replay.item_rows(replay.read_table(path))) == 25
        else:
            assert replay.load_item_file(settings, path, page_rows=pages) == 25
        engine = make_engine(url)
        with engine.connect() as connection:
            columns = (items.c.item_id, items.c.title, items.c.year, items.c.attributes)
            rows[name] = connection.execute(select(*columns).order_by(items.c.item_id)).all()
        engine.dispose()
    assert rows["paged"] == rows["whole"]
    bad = catalog.assign(item_id=[str(i) if i != 22 else "" for i in range(25)])
    url = f"sqlite:///{tmp_path / 'bad'}.db"
    with pytest.raises(UserFacingError, match="items have empty item_id values"):
        replay.load_item_file(
            Settings(home=tmp_path, database_url=url), write(bad, tmp_path / "b.csv"), 4
        )
    engine = make_engine(url)
    with engine.connect() as connection:  # checked before the first page: nothing upserted
        assert connection.execute(select(items.c.item_id)).all() == []
    engine.dispose()


def run_genrec(
    kafka_settings, database_url: str, home: Path, *args: str, chunk_rows: int | None = None
) -> str:
    env = {
        **os.environ,
        "GENREC_HOME": str(home),
        "GENREC_DATABASE_URL": database_url,
        "GENREC_KAFKA__BOOTSTRAP": kafka_settings.bootstrap,
        "GENREC_KAFKA__TOPIC_EVENTS": kafka_settings.topic_events,
        "GENREC_KAFKA__TOPIC_DLQ": kafka_settings.topic_dlq,
    }
    if chunk_rows is not None:
        env["GENREC_INGEST__REPLAY_CHUNK_ROWS"] = str(chunk_rows)
    done = subprocess.run(
        [str(GENREC), *args], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_replay_ml100k_window_keeps_the_store_order(
    kafka_settings, database_url, tmp_path, ml100k_engine
):
    out = run_genrec(
        kafka_settings, database_url, tmp_path, "replay", "--dataset", "ml-100k", "--end", "0.05"
    )
    assert "5,000 produced" in out and "1,682 upserted" in out
    settings = Settings(home=tmp_path, database_url=database_url, kafka=kafka_settings)
    assert Ingestor(settings).run(exit_when_idle_s=3).events_stored == 5000

    order = select(events.c.event_id, events.c.user_id, events.c.ts_ms, events.c.value).order_by(
        events.c.user_id, events.c.ts_ms, events.c.id
    )
    engine = make_engine(database_url)
    with engine.connect() as connection:
        replayed = connection.execute(order).all()
        catalog = dict(connection.execute(select(items.c.item_id, items.c.title)).all())
    engine.dispose()
    with ml100k_engine.connect() as connection:
        reference = connection.execute(
            order.where(events.c.event_id.in_([r.event_id for r in replayed]))
        ).all()
    assert [tuple(r) for r in replayed] == [tuple(r) for r in reference]  # same ids, same tie order
    assert len(catalog) == 1682 and catalog["1"].startswith("Toy Story")


@pytest.mark.parametrize("chunk_rows", [None, 2], ids=["one-chunk", "external-sort"])
def test_replay_any_file_with_items_and_options(kafka_settings, tmp_path, chunk_rows):
    url = f"sqlite:///{tmp_path / 'store.db'}"
    log = tmp_path / "clicks.csv"
    pd.DataFrame(
        {
            "user_id": ["a", "b", "a", "c", "b"],
            "item_id": ["x", "y", "z", "x", "x"],
            "timestamp": [
                "2024-01-01T00:00:03Z",
                "2024-01-01T00:00:01Z",
                "2024-01-01T00:00:01Z",
                "2024-01-01T00:00:09Z",
                "2024-01-01T00:00:05Z",
            ],
            "event_type": ["view", "click", "view", "purchase", "cart"],
        }
    ).to_csv(log, index=False)
    catalog = tmp_path / "items.parquet"
    pd.DataFrame({"item_id": ["x", "y", "z"], "brand": ["acme", "", "zed"]}).to_parquet(catalog)
    out = run_genrec(
        kafka_settings,
        url,
        tmp_path,
        "replay",
        "--events",
        str(log),
        "--items",
        str(catalog),
        "--start",
        "2024-01-01T00:00:02Z",
        "--limit",
        "2",
        "--rate",
        "100",
        chunk_rows=chunk_rows,
    )
    assert "2 produced" in out
    settings = Settings(home=tmp_path, database_url=url, kafka=kafka_settings)
    Ingestor(settings).run(exit_when_idle_s=3)
    engine = make_engine(url)
    with engine.connect() as connection:
        stored = connection.execute(
            select(events.c.event_id, events.c.event_type).order_by(events.c.ts_ms)
        ).all()
        attributes = dict(connection.execute(select(items.c.item_id, items.c.attributes)).all())
    engine.dispose()
    assert [tuple(r) for r in stored] == [("clicks-0", "view"), ("clicks-4", "cart")]
    assert attributes == {"x": {"brand": "acme"}, "y": None, "z": {"brand": "zed"}}
