"""The user-event contract (ingest step): what producers send on ``genrec.user-events``.

A user event is one JSON object per Kafka message, keyed by ``user_id`` so one
user's events stay in one partition, in the order they were produced.
``validate_event`` turns raw message bytes into a ``UserEvent`` or a
``Rejection`` with a machine-readable reason; rejected messages travel on to
the dead-letter topic as a ``DeadLetter``. ``validate_event_fields`` is the same
check returning a plain tuple (what ingest stores). Both first try a fast path
that accepts only the common, unambiguous shape (plain ids, a known event type,
integer epoch ms); everything else goes through the pydantic model, which stays
the authority and produces every ``Rejection``.

Example::

    >>> from genrec.schemas.events import validate_event
    >>> validate_event(b'{"event_id": "e1", "user_id": 7, "item_id": "42", '
    ...                b'"event_type": "view", "ts": "2024-01-01T00:00:00Z"}').ts
    1704067200000
    >>> validate_event(b'{"event_id": "e1"').reason
    'not_json'
    >>> validate_event_fields(b'{"event_id": "e1", "user_id": 7, "item_id": "42", '
    ...                       b'"event_type": "view", "ts": 5}')
    ('e1', '7', '42', 'view', 5, None, None)
"""

from __future__ import annotations

import base64
import math
import time
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    StrictFloat,
    StrictStr,
    StringConstraints,
    ValidationError,
    WithJsonSchema,
)
from pydantic_core import from_json

SCHEMA_VERSION = 1
EVENT_TYPES = ("view", "click", "cart", "purchase", "rate")
EventType = Literal["view", "click", "cart", "purchase", "rate"]
MAX_ID_LENGTH = 128
# 9999-12-31T23:59:59.999Z: anything later is a unit mistake, not a date.
MAX_TS_MS = 253_402_300_799_999
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)

# Reasons a message is dead-lettered, most fundamental first: when a message has
# several problems, the first one in this order is the one reported.
RejectReason = Literal[
    "too_large",
    "not_utf8",
    "not_json",
    "missing_id",
    "bad_timestamp",
    "unknown_event_type",
    "schema_violation",
]
REJECT_REASONS: tuple[str, ...] = get_args(RejectReason)


def parse_timestamp_ms(value: Any) -> int:
    """Epoch milliseconds (int, integral float, or digits as text) or ISO 8601 text -> epoch ms.

    ISO text without a zone is read as UTC. Raises ``ValueError`` otherwise.
    """
    if isinstance(value, bool):
        raise ValueError("timestamp must be epoch milliseconds or ISO 8601 text, not a boolean")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int):
        ts_ms = value
    elif isinstance(value, str):
        text = value.strip()
        if text.isdigit():  # digits only: epoch ms sent as text
            return parse_timestamp_ms(int(text))
        try:
            parsed = datetime.fromisoformat(text)
        except ValueError:
            raise ValueError(f"timestamp {text[:64]!r} is not ISO 8601") from None
        if parsed.tzinfo is None:
            parsed = parsed.replace(tzinfo=UTC)
        ts_ms = (parsed - _EPOCH) // timedelta(milliseconds=1)
    else:
        raise ValueError("timestamp must be epoch milliseconds or ISO 8601 text")
    if not 0 <= ts_ms <= MAX_TS_MS:
        raise ValueError(f"timestamp {ts_ms} ms is outside 1970..9999")
    return ts_ms


# Strings and integers are validated inside pydantic-core (Rust); Python runs only
# to turn an integer id into text or to parse ISO text: most events never need it.
Identifier = Annotated[
    Annotated[str, StringConstraints(strip_whitespace=True, min_length=1, max_length=MAX_ID_LENGTH)]
    | Annotated[int, Strict(), AfterValidator(str)],
    Field(union_mode="left_to_right"),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "string", "minLength": 1, "maxLength": MAX_ID_LENGTH},
                {"type": "integer"},
            ],
            "description": "An identifier; integers are accepted and stored as text.",
        }
    ),
]

EpochMs = Annotated[
    Annotated[int, Strict(), Field(ge=0, le=MAX_TS_MS)]
    | Annotated[StrictFloat | StrictStr, AfterValidator(parse_timestamp_ms)],
    Field(union_mode="left_to_right"),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "integer", "minimum": 0, "maximum": MAX_TS_MS},
                {"type": "string", "format": "date-time"},
            ],
            "description": "Epoch milliseconds, or ISO 8601 text (UTC when no zone is given).",
        }
    ),
]


class UserEvent(BaseModel):
    """One user behavior event. Kafka key: ``user_id`` (UTF-8)."""

    model_config = ConfigDict(extra="ignore", frozen=True, title="UserEvent")

    schema_version: int = Field(default=SCHEMA_VERSION, ge=1, le=SCHEMA_VERSION)
    event_id: Identifier = Field(description="Unique per event; redelivery is deduplicated on it.")
    user_id: Identifier
    item_id: Identifier
    event_type: EventType
    ts: EpochMs = Field(description="When the event happened.")
    value: float | None = Field(
        default=None, allow_inf_nan=False, description="Rating, price, dwell time..."
    )
    context: dict[str, Any] | None = Field(
        default=None, description="Free-form details (page, device, query...)."
    )

    def kafka_key(self) -> bytes:
        return self.user_id.encode()

    def to_json_bytes(self) -> bytes:
        return self.model_dump_json(exclude_none=True).encode()


class Rejection(BaseModel):
    """Why one message was refused: ``reason`` is a code, ``detail`` is for humans."""

    model_config = ConfigDict(frozen=True)

    reason: RejectReason
    detail: str


class DeadLetter(BaseModel):
    """A refused message on ``genrec.user-events.dlq``, with everything needed to replay it."""

    model_config = ConfigDict(extra="ignore", title="DeadLetter")

    schema_version: int = Field(default=SCHEMA_VERSION, ge=1)
    reason: RejectReason
    detail: str
    original_base64: str = Field(description="The message value exactly as received, base64.")
    original_key_base64: str | None = None
    key: str | None = Field(default=None, description="The message key as text, when UTF-8.")
    source_topic: str
    source_partition: int
    source_offset: int
    source_timestamp_ms: int | None = None
    failed_at: int = Field(description="Epoch milliseconds when ingest refused it.")

    @classmethod
    def from_message(
        cls,
        rejection: Rejection,
        *,
        value: bytes | None,
        key: bytes | None,
        topic: str,
        partition: int,
        offset: int,
        timestamp_ms: int | None = None,
    ) -> DeadLetter:
        key_text = None
        if key is not None:
            try:
                key_text = key.decode()
            except UnicodeDecodeError:
                key_text = None
        return cls(
            reason=rejection.reason,
            detail=rejection.detail,
            original_base64=base64.b64encode(value or b"").decode(),
            original_key_base64=base64.b64encode(key).decode() if key is not None else None,
            key=key_text,
            source_topic=topic,
            source_partition=partition,
            source_offset=offset,
            source_timestamp_ms=timestamp_ms,
            failed_at=int(time.time() * 1000),
        )

    def original(self) -> bytes:
        return base64.b64decode(self.original_base64)


# --- validation ---------------------------------------------------------------

_ID_FIELDS = ("event_id", "user_id", "item_id")


# (event_id, user_id, item_id, event_type, ts_ms, value, context): a UserEvent's stored
# fields, in the order of the store's event columns.
EventFields = tuple[str, str, str, str, int, float | None, dict[str, Any] | None]
_FIELD_NAMES = ("event_id", "user_id", "item_id", "event_type", "ts", "value", "context")


def validate_event(raw: bytes | None, max_bytes: int = 64 * 1024) -> UserEvent | Rejection:
    """Raw Kafka message value -> ``UserEvent``, or the ``Rejection`` that explains why not."""
    outcome = _validate(raw, max_bytes)
    if type(outcome) is tuple:
        return UserEvent.model_construct(**dict(zip(_FIELD_NAMES, outcome, strict=True)))
    return outcome


def validate_event_fields(raw: bytes | None, max_bytes: int = 64 * 1024) -> EventFields | Rejection:
    """``validate_event`` as a plain ``EventFields`` tuple: no model object on the common path."""
    outcome = _validate(raw, max_bytes)
    if type(outcome) is UserEvent:
        return tuple(getattr(outcome, name) for name in _FIELD_NAMES)
    return outcome


def _validate(raw: bytes | None, max_bytes: int) -> EventFields | UserEvent | Rejection:
    """The checks both share: size and encoding, then the fast path (fields), else the
    pydantic model (an event, or the ``Rejection`` it explains)."""
    problem = _check_bytes(raw, max_bytes)
    if problem is not None:
        return problem
    fields = fast_event_fields(raw)
    if fields is not None:
        return fields
    try:
        return UserEvent.model_validate_json(raw)
    except ValidationError as exc:
        return classify_errors(exc)


def _check_bytes(raw: bytes | None, max_bytes: int) -> Rejection | None:
    if raw is None:
        return Rejection(reason="not_json", detail="message has no value (tombstone)")
    if len(raw) > max_bytes:
        return Rejection(reason="too_large", detail=f"{len(raw)} bytes > limit {max_bytes}")
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return Rejection(reason="not_utf8", detail=f"invalid UTF-8 at byte {exc.start}")
    return None


# --- fast path ------------------------------------------------------------------
# Accepts only what the model would accept unchanged (or turn into text/float the same
# way); returns None for anything else, which then takes the pydantic path.

_EVENT_TYPE_SET = frozenset(EVENT_TYPES)
_INT_ID_LIMIT = 2**63  # str() of any int inside this is cheap and exact
_EXACT_FLOAT_INT = 2**53  # ints a float holds exactly


def fast_event_fields(raw: bytes) -> EventFields | None:
    """The fields of a plainly valid event, or None when the pydantic path must decide."""
    try:
        data = from_json(raw)
    except ValueError:
        return None
    if type(data) is not dict:
        return None
    schema_version = data.get("schema_version", SCHEMA_VERSION)
    if type(schema_version) is not int or schema_version != SCHEMA_VERSION:
        return None
    event_type = data.get("event_type")
    if type(event_type) is not str or event_type not in _EVENT_TYPE_SET:
        return None
    ts = data.get("ts")
    if type(ts) is not int or not 0 <= ts <= MAX_TS_MS:
        return None
    value = data.get("value")
    if value is not None:
        value = _fast_value(value)
        if value is None:
            return None
    context = data.get("context")
    if context is not None and type(context) is not dict:
        return None
    event_id = _fast_id(data.get("event_id"))
    user_id = _fast_id(data.get("user_id"))
    item_id = _fast_id(data.get("item_id"))
    if event_id is None or user_id is None or item_id is None:
        return None
    return (event_id, user_id, item_id, event_type, ts, value, context)


def _fast_id(value: Any) -> str | None:
    if type(value) is str:
        # No whitespace at either end: stripping (Unicode White_Space, a subset of what
        # str.isspace calls space) would change nothing, so the length check is final.
        if 0 < len(value) <= MAX_ID_LENGTH and not value[0].isspace() and not value[-1].isspace():
            return value
        return None
    if type(value) is int and -_INT_ID_LIMIT < value < _INT_ID_LIMIT:
        return str(value)
    return None


def _fast_value(value: Any) -> float | None:
    if type(value) is float:
        return value if math.isfinite(value) else None
    if type(value) is int and -_EXACT_FLOAT_INT <= value <= _EXACT_FLOAT_INT:
        return float(value)
    return None


def classify_errors(exc: ValidationError) -> Rejection:
    """The most fundamental problem among pydantic's errors, as a ``Rejection``."""
    found: dict[str, str] = {}
    for error in exc.errors(include_url=False):
        reason = _reason_for(error)
        where = ".".join(str(part) for part in error["loc"]) or "message"
        found.setdefault(reason, f"{where}: {error['msg']}")
    reason = min(found, key=REJECT_REASONS.index)
    return Rejection(reason=reason, detail=found[reason])


def _reason_for(error: Any) -> RejectReason:
    kind = error["type"]
    field = error["loc"][0] if error["loc"] else None
    if kind in ("json_invalid", "json_type"):
        return "not_json"
    if field in _ID_FIELDS and kind in ("missing", "string_too_short", "too_short"):
        return "missing_id"
    if field in _ID_FIELDS and kind == "string_type" and error.get("input", None) is None:
        return "missing_id"
    if field == "ts" and kind != "missing":
        return "bad_timestamp"
    if field == "event_type" and kind == "literal_error":
        return "unknown_event_type"
    return "schema_violation"
