"""The recommendation contract (online step): what workers publish on ``genrec.recommendations``.

One message per answered request, keyed by ``user_id``: the merged top-K list,
the list of every branch that contributed (generative beam search, popularity,
item-CF, embedding ANN...), the versions of the model and of the semantic-ID
mapping that produced it, decoding statistics and the latency.

Example::

    >>> from genrec.schemas.recommendations import RecommendationMessage, ScoredItem
    >>> message = RecommendationMessage(
    ...     user_id="7", items=[ScoredItem(item_id="42", score=0.9, branch="generative")],
    ...     branches={"generative": [ScoredItem(item_id="42", score=0.9)]},
    ...     latency_ms=31.5)
    >>> message.model_dump()["items"][0]["item_id"]
    '42'
"""

from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from genrec.schemas.events import SCHEMA_VERSION, EpochMs, Identifier


def _now_ms() -> int:
    return int(time.time() * 1000)


class ScoredItem(BaseModel):
    """One recommended item. ``score`` is comparable within one list only."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    item_id: Identifier
    score: float = Field(allow_inf_nan=False)
    rank: int | None = Field(default=None, ge=0, description="0-based position in its list.")
    branch: str | None = Field(default=None, description="The branch that proposed it.")
    semantic_id: list[int] | None = Field(default=None, description="Codes of its semantic ID.")


class RecommendationMessage(BaseModel):
    """Top-K items for one user, with per-branch lists and how they were produced."""

    model_config = ConfigDict(extra="ignore", title="RecommendationMessage")

    schema_version: int = Field(default=SCHEMA_VERSION, ge=1)
    request_id: str | None = None
    user_id: Identifier
    event_id: str | None = Field(default=None, description="The event that triggered it, if any.")
    covered_event_ids: list[str] = Field(
        default_factory=list,
        description="Every event this answer accounts for when several were coalesced, in order.",
    )
    items: list[ScoredItem] = Field(description="The merged list, best first.")
    branches: dict[str, list[ScoredItem]] = Field(
        default_factory=dict, description="Each recall branch's own list, best first."
    )
    model_version: str | None = None
    semantic_id_version: str | None = None
    decoding: dict[str, Any] = Field(
        default_factory=dict,
        description="Decoding statistics: beam width, draft steps, acceptance rate, target calls...",
    )
    latency_ms: float = Field(ge=0, description="From receiving the event to publishing.")
    produced_at: EpochMs = Field(default_factory=_now_ms)

    def kafka_key(self) -> bytes:
        return self.user_id.encode()

    def to_json_bytes(self) -> bytes:
        return self.model_dump_json().encode()
