"""Plain helpers shared by test modules (fixtures live in ``tests/conftest.py``).

Test modules import from here, never from each other, so that a test's setup does
not depend on which other test file happens to define it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from sqlalchemy import func, select

from genrec.infra.database import make_engine
from genrec.infra.settings import KafkaSettings, Settings
from genrec.infra.topics import create_topics
from genrec.online.prompts import ItemTokens
from genrec.schemas.tables import events
from genrec.schemas.token_layout import TokenLayout

if TYPE_CHECKING:
    from sqlalchemy import Table

    from genrec.app.bench.decode import BenchModels
    from genrec.app.kafka_broker import KafkaBroker

# --- waiting and counting ---------------------------------------------------


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``condition`` until it holds; fail with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.2)


def count_rows(database_url: str, table: Table = events) -> int:
    """Rows in ``table`` of the store at ``database_url`` (a fresh engine, disposed after)."""
    engine = make_engine(database_url)
    try:
        with engine.connect() as connection:
            return connection.execute(select(func.count()).select_from(table)).scalar_one()
    finally:
        engine.dispose()


# --- kafka ------------------------------------------------------------------


def unique_kafka(broker: KafkaBroker) -> KafkaSettings:
    """KafkaSettings for ``broker`` with topic names of their own, not yet created."""
    suffix = uuid.uuid4().hex[:10]
    return KafkaSettings(
        bootstrap=broker.bootstrap,
        client_id=f"genrec-test-{suffix}",
        topic_events=f"genrec.user-events.{suffix}",
        topic_recommendations=f"genrec.recommendations.{suffix}",
        topic_dlq=f"genrec.user-events.{suffix}.dlq",
    )


def fresh_kafka(broker: KafkaBroker) -> KafkaSettings:
    """KafkaSettings for ``broker`` with their own topics, already created."""
    kafka = unique_kafka(broker)
    create_topics(kafka)
    return kafka


# --- online -----------------------------------------------------------------

SERVING_USERS = 100  # ML-100K users (ids 1..100) in the small serving version (``serving_home``)


# --- models and decoding ----------------------------------------------------

# ``genrec bench decode`` presets the decoding tests run on: the trained ones need a
# trained store, which only the slow end-to-end tests build.
DECODING_PRESETS = ("tiny",)


def random_items(n: int, codes_per_level=(6, 5, 4), seed: int = 0) -> ItemTokens:
    """``n`` items with distinct random semantic IDs over a small scratch layout."""
    rng = np.random.default_rng(seed)
    chosen = rng.choice(int(np.prod(codes_per_level)), size=n, replace=False)
    codes = np.stack(np.unravel_index(chosen, codes_per_level), axis=1)
    layout = TokenLayout.for_scratch_model(codes_per_level)
    return ItemTokens([f"i{k}" for k in range(n)], codes, layout)


def split_prompts(
    case: BenchModels, users: slice = slice(None)
) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """(prefix prompts, suffixes, full prompts) of a decoding bench case's users: the newest
    ``suffix_items`` items form the suffix."""
    depth = case.layout.depth
    prefixes, suffixes, full = [], [], []
    for user in case.eval_users[users]:
        cut = len(user.prompt) - user.suffix_items * depth
        prefixes.append(user.prompt[:cut])
        suffixes.append(user.prompt[cut:])
        full.append(user.prompt)
    return prefixes, suffixes, full


# --- training on ML-100K users ----------------------------------------------

ML100K_SAMPLE_USERS = 60  # users in ``ml100k_sample_store`` (their last 40 events each)


@dataclass(frozen=True)
class SyntheticSemanticIds:
    """The fields of a SemanticIdSet that the models read, with random unique codes."""

    version: int
    item_ids: list[str]
    codes: np.ndarray
    layout: TokenLayout


def tiny_settings(home: Path) -> Settings:
    """Settings that train the ``tiny`` preset in seconds on ``ml100k_sample_store``."""
    return Settings(
        home=home,
        model={"preset": "tiny", "history_items": 10, "teacher_prompts": 24,
               "agreement_users": 16, "torch_threads": 1},
    )  # fmt: skip


def random_prefix_kv(n_tokens: int, model_version: str = "m1", layers: int = 2):
    """A small PrefixKV of ``n_tokens`` prompt tokens with random keys and values."""
    import torch  # here: most tests importing this module never need torch

    from genrec.online.decoding.prefix_kv import PrefixKV

    generator = torch.Generator().manual_seed(n_tokens)
    shape = (2, n_tokens - 1, 4)  # [kv heads, cached tokens, head dim]
    keys = [torch.randn(shape, generator=generator) for _ in range(layers)]
    values = [torch.randn(shape, generator=generator) for _ in range(layers)]
    return PrefixKV(list(range(1, n_tokens + 1)), keys, values, model_version)


def kv_entry(user_id: str, kv_version: int, n_tokens: int, row: int = 10):
    """The index entry of ``random_prefix_kv(n_tokens)`` for ``user_id``."""
    from genrec.online.prefix_kv_store import PrefixKVEntry

    return PrefixKVEntry(
        user_id=user_id, kv_version=kv_version, model_version="m1", cutoff_event_row=row,
        cutoff_ts_ms=1000 * row, cutoff_event_id=f"e{row}", n_tokens=n_tokens,
        prompt_sha1=f"sha-{user_id}-{n_tokens}",
    )  # fmt: skip
