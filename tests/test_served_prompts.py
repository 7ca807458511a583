"""Prompt-KV reuse (online/served_prompts.py): the LRU, and a user's next request decoded from
the KV of their previous prompt giving the items of decoding the whole prompt."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from genrec.infra.database import make_engine
from genrec.infra.settings import Settings
from genrec.ingest.store import write_events
from genrec.online.decoding.prefix_kv import PrefixKV
from genrec.online.live_version import ServingBundle
from genrec.online.models.generative import GenerativeModels
from genrec.online.models.presets import build_draft, build_target, get_preset
from genrec.online.prompts import ItemTokens
from genrec.online.recommender import ModelDecoder, Recommender, Request
from genrec.online.served_prompts import ServedPrompts, starts
from genrec.schemas.events import UserEvent
from genrec.schemas.token_layout import TokenLayout


def kept(tokens: list[int], width: int = 10) -> PrefixKV:
    tensor = torch.zeros(1, len(tokens) - 1, width)  # 40 bytes a token with its values
    return PrefixKV(tokens, [tensor], [tensor.clone()], "m")


def test_a_kept_prompt_is_used_only_where_the_new_prompt_starts_with_it():
    served = ServedPrompts(size=10, max_bytes=10**6)
    served.put("u", kept([1, 5, 6, 7]), prompt_items=3, last_event_id="e3")
    entry = served.get("u")
    assert (entry.prompt_items, entry.last_event_id) == (3, "e3")
    assert starts([1, 5, 6, 7, 8, 9], entry.prompt_kv.prompt_ids)
    assert starts([1, 5, 6, 7], entry.prompt_kv.prompt_ids)  # nothing newer: all cached
    assert not starts([1, 5, 6], entry.prompt_kv.prompt_ids)  # shorter
    assert not starts([1, 6, 5, 7, 8], entry.prompt_kv.prompt_ids)  # another order (late event)
    assert served.get("v") is None


def test_the_lru_is_bounded_by_users_and_by_bytes():
    served = ServedPrompts(size=2, max_bytes=10**6)
    for user in ("a", "b", "c"):
        served.put(user, kept([1, 2, 3]))
    assert "a" not in served and len(served) == 2
    by_bytes = ServedPrompts(size=100, max_bytes=1000)  # a 11-token prompt: 800 bytes
    by_bytes.put("a", kept([1] * 11))
    by_bytes.put("b", kept([1] * 11))
    assert "a" not in by_bytes and "b" in by_bytes and by_bytes.nbytes == 800
    by_bytes.put("b", kept([1] * 3))  # replacing counts the new size only
    assert by_bytes.nbytes == 160
    ServedPrompts(size=0, max_bytes=1000).put("a", kept([1, 2]))  # size 0: keeps nothing


@pytest.fixture(scope="module")
def models() -> GenerativeModels:
    torch.manual_seed(0)
    layout = TokenLayout.for_scratch_model((8, 8, 4))
    rng = np.random.default_rng(0)
    codes = sorted({tuple(c) for c in rng.integers(0, [8, 8, 4], size=(200, 3)).tolist()})[:120]
    item_tokens = ItemTokens([f"i{n}" for n in range(len(codes))], np.array(codes), layout)
    preset = get_preset("tiny")
    target, draft = build_target(preset, layout).eval(), build_draft(preset, layout).eval()
    return GenerativeModels(
        target, {"atspeed_s": draft}, item_tokens, history_items=50, preset="tiny", version=3
    )


@pytest.mark.parametrize("mode", ["target", "strict"])
def test_the_next_request_prefills_only_its_new_events_and_gets_the_same_items(
    tmp_path: Path, models, mode: str
):
    engine = make_engine(f"sqlite:///{tmp_path / 'genrec.db'}")
    ts = iter(range(1000, 10**6, 1000))

    def store(user: str, items: list[str]) -> list[UserEvent]:
        stored = [
            UserEvent(event_id=f"{user}-{next(ts)}", user_id=user, item_id=i, event_type="view",
                      ts=next(ts))
            for i in items
        ]  # fmt: skip
        write_events(engine, [{"event_id": e.event_id, "user_id": e.user_id,
                               "item_id": e.item_id, "event_type": "view", "ts_ms": e.ts}
                              for e in stored])  # fmt: skip
        return stored

    store("a", [f"i{n}" for n in range(8)])
    store("b", [f"i{n}" for n in range(20, 23)])

    def recommender(reuse: bool) -> tuple[Recommender, ServingBundle]:
        settings = Settings(online={"k": 5, "mode": mode, "draft_beams": 16,
                                    "reuse_prompt_kv": reuse})  # fmt: skip
        decoder = ModelDecoder(models, settings.online)
        return Recommender(settings, engine), ServingBundle("v1", decoder=decoder)

    (reusing, bundle), (plain, plain_bundle) = recommender(True), recommender(False)
    for round_index in range(3):
        new = {"a": [f"i{40 + round_index}"], "b": [f"i{50 + round_index}", f"i{60 + round_index}"]}
        events = {u: store(u, items) for u, items in new.items()}
        requests = [Request.of(e) for e in events.values()]
        with_reuse = reusing.finish(reusing.prepare(requests, bundle))
        without = plain.finish(plain.prepare(requests, plain_bundle))
        for got, expected in zip(with_reuse, without, strict=True):
            assert got.branches["generative"] == expected.branches["generative"]
            assert got.decoding.get("prefix_source") == ("served" if round_index else None)
            assert got.decoding["path"] == ("prefix_kv" if round_index else "full_prompt")
            assert "prefix_source" not in expected.decoding
        if round_index:  # only the new events' tokens were prefilled
            depth = models.item_tokens.layout.depth
            assert [m.decoding["suffix_tokens"] for m in with_reuse] == [depth, 2 * depth]
    assert len(reusing.served) == 2 and reusing.served.nbytes > 0


@pytest.mark.parametrize("mode", ["target", "strict"])
def test_a_long_history_grows_its_kept_prompt_to_the_limit_then_starts_again(
    tmp_path: Path, models, mode: str
):
    # No refresh cache, H = 4 and at most 6 items a prompt: each request's prompt is the
    # kept one plus the new item (4, 5, 6 items), then the window of the last 4 again.
    # Every request's items are those of decoding that prompt whole (a plain decoder whose
    # window is that many items).
    engine = make_engine(f"sqlite:///{tmp_path / 'genrec.db'}")
    rows = [{"event_id": f"a-{n}", "user_id": "a", "item_id": f"i{n}", "event_type": "view",
             "ts_ms": 1000 * (n + 1)} for n in range(10)]  # fmt: skip
    write_events(engine, rows)

    def recommender(history_items: int, reuse: bool) -> tuple[Recommender, ServingBundle]:
        settings = Settings(online={"k": 5, "mode": mode, "draft_beams": 16,
                                    "reuse_prompt_kv": reuse, "max_prompt_items": 6})  # fmt: skip
        windowed = dataclasses.replace(models, history_items=history_items)
        return Recommender(settings, engine), ServingBundle("v1", decoder=ModelDecoder(
            windowed, settings.online))  # fmt: skip

    reusing, bundle = recommender(4, reuse=True)
    plain = {n: recommender(n, reuse=False) for n in (4, 5, 6)}
    for round_index, items in enumerate([4, 5, 6, 4, 5]):
        n = 10 + round_index
        new = UserEvent(event_id=f"a-{n}", user_id="a", item_id=f"i{n}", event_type="view",
                        ts=1000 * (n + 1))  # fmt: skip
        write_events(engine, [{"event_id": new.event_id, "user_id": "a", "item_id": new.item_id,
                               "event_type": "view", "ts_ms": new.ts}])  # fmt: skip
        [got] = reusing.finish(reusing.prepare([Request.of([new])], bundle))
        other, other_bundle = plain[items]
        [expected] = other.finish(other.prepare([Request.of([new])], other_bundle))
        assert got.branches["generative"] == expected.branches["generative"]
        assert got.decoding["prompt_items"] == items
        kept = round_index in (1, 2, 4)
        assert got.decoding["path"] == ("prefix_kv" if kept else "full_prompt")
        assert got.decoding.get("prefix_source") == ("served" if kept else None)
        assert got.decoding.get("prompt_rebased", False) == (round_index == 3)
        if kept:  # only the new item's tokens were prefilled
            assert got.decoding["suffix_tokens"] == models.item_tokens.layout.depth
