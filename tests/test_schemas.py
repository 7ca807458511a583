"""Message contracts: user-event validation, dead letters, recommendations, JSON Schema files."""

from __future__ import annotations

import json

import pytest

from genrec.schemas import generate
from genrec.schemas.events import (
    DeadLetter,
    Rejection,
    UserEvent,
    parse_timestamp_ms,
    validate_event,
)
from genrec.schemas.recommendations import RecommendationMessage, ScoredItem

GOOD = {
    "event_id": "e1",
    "user_id": "u1",
    "item_id": "i1",
    "event_type": "view",
    "ts": 1_700_000_000_000,
}


def encode(**changes) -> bytes:
    payload = {**GOOD, **changes}
    return json.dumps({k: v for k, v in payload.items() if v is not ...}).encode()


def test_valid_event_normalizes_ids_and_time():
    event = validate_event(
        encode(user_id=7, item_id=42, ts="2024-01-01T00:00:00Z", value=4, context={"page": "home"})
    )
    assert isinstance(event, UserEvent)
    assert (event.user_id, event.item_id, event.ts, event.value) == (
        "7",
        "42",
        1_704_067_200_000,
        4.0,
    )
    assert event.context == {"page": "home"} and event.schema_version == 1
    assert event.kafka_key() == b"7"


@pytest.mark.parametrize(
    "text, expected",
    [
        (1_700_000_000_123, 1_700_000_000_123),
        ("1700000000123", 1_700_000_000_123),
        (1.7e12, 1_700_000_000_000),
        ("2024-01-01T00:00:00.250+01:00", 1_704_063_600_250),
        ("2024-01-01 00:00:00", 1_704_067_200_000),  # no zone: UTC
        ("2024-01-01", 1_704_067_200_000),
    ],
)
def test_timestamps(text, expected):
    assert parse_timestamp_ms(text) == expected


@pytest.mark.parametrize(
    "raw, reason",
    [
        (b"\xff\xfe{}", "not_utf8"),
        (b'{"event_id": "e1"', "not_json"),
        (b"", "not_json"),
        (None, "not_json"),
        (b"[1, 2]", "schema_violation"),
        (encode(event_id=...), "missing_id"),
        (encode(user_id=""), "missing_id"),
        (encode(item_id=None), "missing_id"),
        (encode(user_id="   "), "missing_id"),
        (encode(event_type="like"), "unknown_event_type"),
        (encode(ts="yesterday"), "bad_timestamp"),
        (encode(ts=-1), "bad_timestamp"),
        (encode(ts=True), "bad_timestamp"),
        (encode(ts=10**16), "bad_timestamp"),
        (encode(ts=...), "schema_violation"),
        (encode(value="high"), "schema_violation"),
        (encode(context=[1]), "schema_violation"),
        (encode(user_id=1.5), "schema_violation"),
        (encode(schema_version=99), "schema_violation"),
        (encode(event_id="x" * 129), "schema_violation"),
        (encode(event_type="like", ts="bad", user_id=None), "missing_id"),  # most fundamental first
        (encode(context={"blob": "x" * 70_000}), "too_large"),
    ],
)
def test_rejections(raw, reason):
    outcome = validate_event(raw, max_bytes=64 * 1024)
    assert isinstance(outcome, Rejection), outcome
    assert outcome.reason == reason and outcome.detail


def test_unknown_fields_are_ignored_for_forward_compatibility():
    assert isinstance(validate_event(encode(new_field={"a": 1})), UserEvent)


def test_dead_letter_keeps_the_original_bytes():
    raw = b"\xff not json"
    rejection = validate_event(raw)
    letter = DeadLetter.from_message(
        rejection, value=raw, key=b"u1", topic="t", partition=3, offset=17
    )
    again = DeadLetter.model_validate_json(letter.model_dump_json())
    assert again.original() == raw and again.reason == "not_utf8" and again.key == "u1"
    assert (again.source_topic, again.source_partition, again.source_offset) == ("t", 3, 17)
    assert again.failed_at > 0


def test_recommendation_message_round_trip():
    message = RecommendationMessage(
        user_id=7,
        event_id="e1",
        items=[
            ScoredItem(item_id=1, score=0.5, rank=0, branch="generative", semantic_id=[1, 2, 3, 0])
        ],
        branches={"popularity": [ScoredItem(item_id="2", score=10.0)]},
        model_version="target-3",
        semantic_id_version="7",
        decoding={"beam_width": 10, "acceptance_rate": 0.8},
        latency_ms=12.5,
    )
    again = RecommendationMessage.model_validate_json(message.to_json_bytes())
    assert again == message and again.user_id == "7" and again.produced_at > 0


def test_json_schema_files_are_in_sync():
    assert generate.stale_files() == [], "run: python -m genrec.schemas.generate"


def test_json_schema_lists_the_contract():
    schema = json.loads((generate.JSON_DIR / "user_event.schema.json").read_text())
    assert set(schema["required"]) == {"event_id", "user_id", "item_id", "event_type", "ts"}
    assert schema["properties"]["event_type"]["enum"] == [
        "view",
        "click",
        "cart",
        "purchase",
        "rate",
    ]
