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
    Column,
    DateTime,
    Float,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
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
)
Index("ix_events_user_ts", events.c.user_id, events.c.ts_ms, events.c.id)
Index("ix_events_item", events.c.item_id)
