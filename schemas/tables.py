"""SQLAlchemy 2 tables of the behavior store and of every versioned artifact index.

One ``metadata`` holds them all; ``genrec.infra.database.make_engine`` creates
missing tables. Sections below are owned by the step that writes them:
ingest (items, users, events), offline (semantic IDs, models, job runs, KV
index).
"""

from __future__ import annotations

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Float,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
    func,
)

metadata = MetaData()

# SQLite only auto-increments an INTEGER PRIMARY KEY; PostgreSQL gets BIGINT.
BigId = BigInteger().with_variant(Integer(), "sqlite")

# --- ingest -----------------------------------------------------------------

items = Table(
    "items",
    metadata,
    Column("item_id", String(128), primary_key=True),
    Column("title", Text, nullable=True),
    Column("year", Integer, nullable=True),
    Column("genres", Text, nullable=True),
    Column("attributes", JSON, nullable=True),  # any further text columns of the catalog
    Column("updated_at", DateTime(timezone=True), server_default=func.now(), nullable=False),
)

users = Table(
    "users",
    metadata,
    Column("user_id", String(128), primary_key=True),
    Column("first_ts_ms", BigInteger, nullable=False),
    Column("last_ts_ms", BigInteger, nullable=False),
)
# The budgeted prefix-KV refresh reads users newest first (genrec.ingest.history).
Index("ix_users_last_ts", users.c.last_ts_ms, users.c.user_id)

events = Table(
    "events",
    metadata,
    # Insertion order: per user it is the Kafka partition order, i.e. the order produced.
    Column("id", BigId, primary_key=True, autoincrement=True),
    Column("event_id", String(128), nullable=False, unique=True),
    Column("user_id", String(128), nullable=False),
    Column("item_id", String(128), nullable=False),
    Column("event_type", String(16), nullable=False),
    Column("ts_ms", BigInteger, nullable=False),
    Column("value", Float, nullable=True),
    Column("context", JSON, nullable=True),
    Column("kafka_topic", String(255), nullable=True),
    Column("kafka_partition", Integer, nullable=True),
    Column("kafka_offset", BigInteger, nullable=True),
    Column("ingested_at", DateTime(timezone=True), server_default=func.now(), nullable=False),
    # Ids are never reused, as a PostgreSQL sequence's: readers keep "everything up to this
    # id" (a prefix KV's cutoff row, a worker's history watermark), and SQLite's plain rowid
    # would hand the ids of deleted newest events (bench load removes its own) to the next
    # ones, which those readers would then skip. Stores created before this keep their table.
    sqlite_autoincrement=True,
)
# Every history read (ingest.history) is "these users' events in (time, insertion) order,
# item and event id": with those two columns in the index too, it is an index-only scan,
# one sequential run per user, not a table lookup per event (SQLite, 64 ML-100K users /
# ~15,900 rows: 33 -> 13 ms; a store bigger than memory would pay a page read per event).
# ~60 bytes more an event than (user_id, ts_ms, id) alone, which it replaces, and ~1.8 us
# more CPU an insert (SQLite, batches of 5,000: 5.0 -> 6.8 us; ingest spends 4-5% of a core
# at 100 events/s either way).
Index(
    "ix_events_user_history",
    events.c.user_id, events.c.ts_ms, events.c.id, events.c.item_id, events.c.event_id,
)  # fmt: skip
# No index on item_id: nothing reads events by item, and every index costs ingest time.

# Indexes earlier releases built that the schema has since replaced, by table. `genrec store
# indexes --create` drops each once its table has every index of the schema (not before:
# reads would go without one while the replacement builds); until then every insert pays
# for both.
REPLACED_INDEXES: dict[str, tuple[str, ...]] = {
    "events": ("ix_events_user_ts",),  # (user_id, ts_ms, id): ix_events_user_history covers it
}

# --- semantic ids -----------------------------------------------------------

# One row per build. Readers only use the single row with active = true, which is
# flipped in one transaction after the build's item rows and artifacts are complete.
semantic_id_versions = Table(
    "semantic_id_versions",
    metadata,
    Column("version", BigId, primary_key=True, autoincrement=True),
    Column("status", String(16), nullable=False),  # building | complete | failed
    Column("active", Boolean, nullable=False, default=False),
    Column("kind", String(16), nullable=False),  # full | refresh
    Column("parent_version", BigInteger, nullable=True),
    Column("layout", Text, nullable=True),  # TokenLayout.to_json()
    Column("params", JSON, nullable=True),
    Column("metrics", JSON, nullable=True),
    Column("artifact_dir", Text, nullable=True),
    Column("error", Text, nullable=True),
    Column("created_at", DateTime(timezone=True), server_default=func.now(), nullable=False),
    Column("completed_at", DateTime(timezone=True), nullable=True),
)

semantic_id_items = Table(
    "semantic_id_items",
    metadata,
    Column("version", BigInteger, primary_key=True),
    Column("item_id", String(128), primary_key=True),
    Column("row", Integer, nullable=False),  # position in the version's item order
    Column("semantic_id", String(64), nullable=False),  # codes joined by '-', e.g. '3-0-17-0'
    UniqueConstraint("version", "semantic_id", name="uq_semantic_id_items_version_id"),
)

# --- models -----------------------------------------------------------------

# One row per trained target + drafts. Exactly one row has status "active"; the
# artifacts are complete on disk before the row is flipped, in one transaction.
model_versions = Table(
    "model_versions",
    metadata,
    Column("version", BigId, primary_key=True, autoincrement=True),
    Column("preset", String(32), nullable=False),
    Column("semantic_id_version", String(64), nullable=True),
    Column("status", String(16), nullable=False),  # building | active | failed | retired
    Column("params", JSON, nullable=True),
    Column("metrics", JSON, nullable=True),
    Column("artifact_dir", Text, nullable=True),
    Column("error", Text, nullable=True),
    Column("created_at", DateTime(timezone=True), server_default=func.now(), nullable=False),
    Column("activated_at", DateTime(timezone=True), nullable=True),
)

# --- refresh ----------------------------------------------------------------

# One row per offline refresh run (``genrec offline refresh`` or the scheduler).
job_runs = Table(
    "job_runs",
    metadata,
    Column("id", BigId, primary_key=True, autoincrement=True),
    Column("job", String(64), nullable=False),  # "refresh"
    Column("status", String(16), nullable=False),  # running | succeeded | failed | abandoned
    Column("trigger", String(32), nullable=True),  # cli | schedule | test
    Column("owner", String(255), nullable=True),  # host:pid:nonce, as in job_locks
    Column("started_at", DateTime(timezone=True), nullable=False),
    Column("finished_at", DateTime(timezone=True), nullable=True),
    Column("serving_version", BigInteger, nullable=True),
    Column("event_cutoff_row", BigInteger, nullable=True),
    Column("counts", JSON, nullable=True),  # events, items, users, kv bytes, step seconds ...
    Column("error", Text, nullable=True),
)

# What the online workers serve: one row per refresh that got as far as building.
# Exactly one row has active = true; activation flips it in one transaction.
serving_versions = Table(
    "serving_versions",
    metadata,
    Column("version", BigId, primary_key=True, autoincrement=True),  # also the KV version
    Column("status", String(16), nullable=False),  # building | active | retired | failed
    Column("active", Boolean, nullable=False, default=False),
    Column("semantic_id_version", BigInteger, nullable=True),
    Column("model_version", String(64), nullable=True),
    Column("kv_version", BigInteger, nullable=True),
    Column("event_cutoff_row", BigInteger, nullable=True),  # every events.id <= this was read
    Column("job_run_id", BigInteger, nullable=True),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("activated_at", DateTime(timezone=True), nullable=True),
)
Index(
    "uq_serving_versions_one_active",
    serving_versions.c.active,
    unique=True,
    sqlite_where=serving_versions.c.active,
    postgresql_where=serving_versions.c.active,
)

# Where each user's precomputed long-history prefix KV cache lives, per KV version.
prefix_kv_index = Table(
    "prefix_kv_index",
    metadata,
    Column("kv_version", BigInteger, primary_key=True),
    Column("user_id", String(128), primary_key=True),
    Column("model_version", String(64), nullable=False),
    Column("cutoff_event_row", BigInteger, nullable=False),  # events.id of the last event included
    Column("cutoff_ts_ms", BigInteger, nullable=False),
    Column("cutoff_event_id", String(128), nullable=False),
    Column("n_tokens", Integer, nullable=False),
    Column("nbytes", BigInteger, nullable=False),
    Column("path", Text, nullable=False),  # relative to the backend's root
    Column("prompt_sha1", String(40), nullable=True),  # lets the next run reuse unchanged entries
)

# --- published artifacts (artifacts.store = database) -------------------------

# Which files make up one serving version, by path inside the version (model/..., recall/...).
# All of a version's rows are inserted in one transaction after its blobs are complete.
artifact_files = Table(
    "artifact_files",
    metadata,
    Column("version", BigInteger, primary_key=True),  # serving_versions.version
    Column("path", Text, primary_key=True),
    Column("sha256", String(64), nullable=False),
    Column("size", BigInteger, nullable=False),
)
Index("ix_artifact_files_sha256", artifact_files.c.sha256)  # garbage collection's orphan check

# One row per distinct file content, inserted with its chunks in one transaction: a blob
# row exists only once all its chunks do. Files equal across versions share one blob.
artifact_blobs = Table(
    "artifact_blobs",
    metadata,
    Column("sha256", String(64), primary_key=True),
    Column("size", BigInteger, nullable=False),
    Column("chunks", Integer, nullable=False),
    Column("created_at", DateTime(timezone=True), server_default=func.now(), nullable=False),
)

artifact_chunks = Table(
    "artifact_chunks",
    metadata,
    Column("sha256", String(64), primary_key=True),
    Column("seq", Integer, primary_key=True),  # 0, 1, ...: the blob is their concatenation
    Column("data", LargeBinary, nullable=False),  # artifacts.chunk_mb at most
)

# Cross-process mutual exclusion with a lease: a killed holder's lease simply expires.
job_locks = Table(
    "job_locks",
    metadata,
    Column("name", String(64), primary_key=True),
    Column("owner", String(255), nullable=True),
    Column("acquired_ms", BigInteger, nullable=True),
    Column("expires_ms", BigInteger, nullable=False, default=0),
)
