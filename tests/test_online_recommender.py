"""The online recommender (online/recommender.py) and version switching, with fakes for the models."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import insert

from genrec.infra.database import make_engine
from genrec.infra.settings import RecallSettings, Settings
from genrec.ingest.history import history_pages
from genrec.online.branches import PopularityBranch
from genrec.online.live_version import ServingBundle, ServingVersions
from genrec.online.prompts import ItemTokens, history_prompt, history_tokens
from genrec.online.recommender import (
    GenerativeBatch,
    PrefixKVCache,
    Recommender,
    Request,
    merge_branches,
)
from genrec.schemas.events import UserEvent
from genrec.schemas.recommendations import ScoredItem
from genrec.schemas.tables import events
from genrec.schemas.token_layout import TokenLayout

ITEMS = [str(i) for i in range(1, 9)]


def item_tokens() -> ItemTokens:
    layout = TokenLayout.for_scratch_model((4, 4))
    codes = np.array([[i // 4, i % 4] for i in range(len(ITEMS))])
    return ItemTokens(ITEMS, codes, layout)


class FakeDecoder:
    """Ranks items by catalog order, seen items removed; records what it was asked."""

    def __init__(self) -> None:
        self.item_tokens = item_tokens()
        self.history_items = 50
        self.calls: list = []
        self.beam_widths: list[int] = []

    def decode(self, requests, beam_width):
        self.calls.append(list(requests))
        self.beam_widths.append(beam_width)
        items = []
        for request in requests:
            rows = [r for r in range(len(ITEMS)) if r not in set(request.exclude)]
            items.append([(r, -float(n)) for n, r in enumerate(rows[:beam_width])])
        stats = [{"mode": "strict", "target_calls": 2, "acceptance_rate": 0.75} for _ in items]
        return GenerativeBatch(items, stats)


@dataclass
class Entry:
    cutoff_event_row: int
    cutoff_ts_ms: int
    cutoff_event_id: str


class FakeKVStore:
    def __init__(self, entries: dict[str, Entry]) -> None:
        self.entries, self.lookups, self.loads = entries, 0, 0

    def lookup(self, kv_version, user_id):
        self.lookups += 1
        return self.entries.get(user_id)

    def load(self, entry, expected_model_version):
        self.loads += 1
        return f"prefix-kv@{entry.cutoff_event_row}"

    def load_many(self, kv_version, user_ids, expected_model_version):
        found = {u: self.lookup(kv_version, u) for u in user_ids}
        return {u: (e, self.load(e, expected_model_version)) for u, e in found.items() if e}


def event(event_id: str, user_id: str, item_id: str, ts: int) -> UserEvent:
    return UserEvent(event_id=event_id, user_id=user_id, item_id=item_id, event_type="view", ts=ts)


@pytest.fixture
def store(tmp_path: Path):
    engine = make_engine(f"sqlite:///{tmp_path / 'genrec.db'}")
    rows = [  # user 7: items 1, 2, 3 stored (ids 1..3); user 8: item 5 (id 4)
        ("s1", "7", "1", 1000), ("s2", "7", "2", 2000), ("s3", "7", "3", 3000), ("s4", "8", "5", 500),
    ]  # fmt: skip
    with engine.begin() as connection:
        connection.execute(
            insert(events),
            [
                {"event_id": e, "user_id": u, "item_id": i, "event_type": "view", "ts_ms": t}
                for e, u, i, t in rows
            ],
        )
    return engine


def bundle(decoder=None, kv_store=None, key="v1") -> ServingBundle:
    popularity = PopularityBranch.fit(
        {"a": ["8", "7", "8"], "b": ["8", "6"]}, item_ids=ITEMS, half_life_days=None
    )
    return ServingBundle(
        key, decoder=decoder, kv_store=kv_store, kv_version="kv1" if kv_store else None,
        branches={"popularity": popularity}, model_version="m1", semantic_id_version="s1",
    )  # fmt: skip


def test_cached_user_gets_suffix_after_cutoff_plus_events_in_hand(store) -> None:
    decoder = FakeDecoder()
    kv_store = FakeKVStore(
        {"7": Entry(cutoff_event_row=2, cutoff_ts_ms=2000, cutoff_event_id="s2")}
    )
    recommender = Recommender(Settings(online={"k": 3}), store)
    # s3 is stored already and also redelivered from Kafka: it must count once
    request = Request.of([event("s3", "7", "3", 3000), event("k1", "7", "4", 4000)])
    [message] = recommender.recommend([request], bundle(decoder, kv_store))

    [[gen]] = decoder.calls
    tokens = decoder.item_tokens
    assert gen.prefix_kv == "prefix-kv@2"
    assert gen.suffix_tokens == tokens.tokens_of("3") + tokens.tokens_of("4")
    assert gen.full_prompt == [1] + sum((tokens.tokens_of(i) for i in "1234"), [])
    assert sorted(gen.exclude) == [0, 1, 2, 3]
    assert message.event_id == "k1" and message.request_id == "k1"
    assert message.covered_event_ids == ["s3", "k1"]
    assert message.decoding["path"] == "prefix_kv"
    assert message.decoding["batch_users"] == 1  # the users of its decoding call
    assert [i.item_id for i in message.branches["generative"]] == ["5", "6", "7"]
    assert [i.item_id for i in message.branches["popularity"]] == ["8", "6", "7"]
    seen = {"1", "2", "3", "4"}
    assert not seen & {i.item_id for i in message.items}
    assert len(message.items) == 3 and all(i.branch for i in message.items)
    assert message.model_version == "m1" and message.semantic_id_version == "s1"


@dataclass
class CachedPrefix:
    prompt_ids: list[int]


class PromptKVStore(FakeKVStore):
    """Caches what the refresh caches: the prompt of the user's stored events up to the cutoff."""

    def __init__(self, engine, entries: dict[str, Entry], item_tokens, history_items) -> None:
        super().__init__(entries)
        self.engine, self.item_tokens, self.history_items = engine, item_tokens, history_items

    def load(self, entry, expected_model_version):
        self.loads += 1
        [page] = history_pages(self.engine, until_row=entry.cutoff_event_row, users_per_page=10)
        [history] = page.values()
        items = [e.item_id for e in history]
        return CachedPrefix(history_prompt(items, self.item_tokens, self.history_items))


@pytest.mark.parametrize("cutoff", [1, 2, 3])
def test_online_prompt_is_the_cached_prefix_followed_by_the_suffix(store, cutoff) -> None:
    # User 7's cached prefix covers their first ``cutoff`` stored events (items 1, 2, 3);
    # the rest of the store and the events in hand (one with an item that has no semantic
    # ID yet) are the suffix.
    decoder = FakeDecoder()
    tokens = decoder.item_tokens
    kv_store = PromptKVStore(
        store, {"7": Entry(cutoff, cutoff * 1000, f"s{cutoff}")}, tokens, decoder.history_items
    )
    request = Request.of([event("k1", "7", "4", 4000), event("k2", "7", "brand-new", 4500),
                          event("k3", "7", "6", 5000)])  # fmt: skip
    Recommender(Settings(online={"k": 3}), store).recommend([request], bundle(decoder, kv_store))
    [[gen]] = decoder.calls
    stored = ["1", "2", "3"]
    assert gen.prefix_kv.prompt_ids == history_prompt(stored[:cutoff], tokens, 50)
    suffix = [*stored[cutoff:], "4", "brand-new", "6"]
    assert gen.suffix_tokens == history_tokens(suffix, tokens, 50)
    assert gen.prefix_kv.prompt_ids + gen.suffix_tokens == gen.full_prompt


def test_past_the_prompt_limit_the_prompt_starts_again_from_the_window(store) -> None:
    # H = 2: user 7's cached prefix is items 1, 2 (cutoff at their second stored event).
    # The prompt grows by every newer item up to 4 items; the fifth would pass it, and
    # the old rule (the suffix capped at H) would have skipped item 3. Instead the
    # prompt is the window of the last H items, decoded in full.
    decoder = FakeDecoder()
    decoder.history_items = 2
    tokens = decoder.item_tokens
    kv_store = PromptKVStore(store, {"7": Entry(2, 2000, "s2")}, tokens, decoder.history_items)
    served = bundle(decoder, kv_store)
    grown = Request.of([event("k1", "7", "4", 4000)])
    four = Settings(online={"k": 3, "max_prompt_items": 4})
    [message] = Recommender(four, store).recommend([grown], served)
    gen = decoder.calls[-1][0]
    assert gen.prefix_kv.prompt_ids + gen.suffix_tokens == history_prompt(list("1234"), tokens, 4)
    assert message.decoding["path"] == "prefix_kv" and message.decoding["prompt_items"] == 4
    past = Request.of([event("k1", "7", "4", 4000), event("k2", "7", "5", 5000)])
    [message] = Recommender(four, store).recommend([past], served)
    gen = decoder.calls[-1][0]
    assert gen.prefix_kv is None and gen.full_prompt == history_prompt(["4", "5"], tokens, 2)
    assert message.decoding["path"] == "full_prompt" and message.decoding["prompt_rebased"]
    wider = Settings(online={"k": 3, "max_prompt_items": 5})
    [message] = Recommender(wider, store).recommend([past], served)
    gen = decoder.calls[-1][0]
    assert gen.prefix_kv.prompt_ids + gen.suffix_tokens == history_prompt(list("12345"), tokens, 5)
    assert Settings(online={"max_prompt_items": 1}).online.prompt_items_limit(2) == 2
    assert Settings().online.prompt_items_limit(50) == 75  # unset: 1.5 x H


def test_an_event_served_before_ingest_stored_it_stays_in_the_next_history(store) -> None:
    decoder = FakeDecoder()
    kv_store = FakeKVStore(
        {"7": Entry(cutoff_event_row=3, cutoff_ts_ms=3000, cutoff_event_id="s3")}
    )
    recommender = Recommender(Settings(online={"k": 3}), store)
    served = bundle(decoder, kv_store)
    recommender.recommend([Request.of([event("k1", "7", "4", 4000)])], served)
    # k1 is not stored yet (ingest lags): the next request's history still has it
    recommender.recommend([Request.of([event("k2", "7", "5", 5000)])], served)
    tokens = decoder.item_tokens
    second = decoder.calls[1][0]
    assert second.suffix_tokens == tokens.tokens_of("4") + tokens.tokens_of("5")
    assert sorted(second.exclude) == [0, 1, 2, 3, 4]
    with store.begin() as connection:  # ingest catches up: k1 comes from the store now
        connection.execute(
            insert(events),
            [{"event_id": "k1", "user_id": "7", "item_id": "4", "event_type": "view",
              "ts_ms": 4000}],
        )  # fmt: skip
    recommender.recommend([Request.of([event("k3", "7", "6", 6000)])], served)
    third = decoder.calls[2][0]
    assert third.suffix_tokens == sum((tokens.tokens_of(i) for i in "456"), [])  # once each
    assert len(recommender.unstored) == 2  # k2 and k3 wait for the store; k1 is in it


def test_the_search_is_twice_k_wide_unless_set_and_k_items_are_served(store) -> None:
    request = Request.of([event("w1", "7", "4", 4000)])
    for online, beams in (({"k": 3}, 6), ({"k": 3, "beam_width": 4}, 4)):
        decoder = FakeDecoder()
        recommender = Recommender(Settings(online=online), store)
        [message] = recommender.recommend([request], bundle(decoder, FakeKVStore({})))
        assert decoder.beam_widths == [beams]
        assert len(message.branches["generative"]) == 3


def test_new_user_is_served_from_the_suffix_alone(store) -> None:
    decoder = FakeDecoder()
    recommender = Recommender(Settings(online={"k": 4}), store)
    request = Request.of([event("n1", "new", "2", 10), event("n2", "new", "6", 20)])
    [message] = recommender.recommend([request], bundle(decoder, FakeKVStore({})))
    [[gen]] = decoder.calls
    tokens = decoder.item_tokens
    assert gen.prefix_kv is None
    assert gen.full_prompt == [tokens.layout.bos_token_id] + tokens.tokens_of(
        "2"
    ) + tokens.tokens_of("6")
    assert message.decoding["path"] == "full_prompt"
    items = [i.item_id for i in message.branches["generative"]]
    assert len(items) == 4 and not {"2", "6"} & set(items) and set(items) <= set(ITEMS)


def test_unknown_items_are_left_out_of_the_prompt(store) -> None:
    decoder = FakeDecoder()
    request = Request.of([event("x1", "9", "brand-new-item", 10)])
    [message] = Recommender(Settings(online={"k": 2}), store).recommend([request], bundle(decoder))
    assert decoder.calls[0][0].full_prompt == [1]
    assert len(message.branches["generative"]) == 2


def test_decoder_failure_falls_back_to_branches(store) -> None:
    class Broken(FakeDecoder):
        def decode(self, requests, beam_width):
            raise RuntimeError("boom")

    request = Request.of([event("x1", "8", "1", 10)])
    [message] = Recommender(Settings(online={"k": 2}), store).recommend([request], bundle(Broken()))
    assert message.decoding["fallback"] == "generative_error"
    assert message.branches["generative"] == []
    assert [i.item_id for i in message.items] == ["8", "6"]


def test_prepare_reads_once_and_finish_decodes_in_calls_of_max_batch_users(
    store, monkeypatch
) -> None:
    import genrec.online.history_cache as history_module

    reads, branch_calls = [], []
    read = history_module.load_histories_of
    monkeypatch.setattr(
        history_module,
        "load_histories_of",
        lambda *a, **kw: reads.append(a[1]) or read(*a, **kw),
    )
    served = bundle(FakeDecoder())
    popularity = served.branches["popularity"]
    scored = popularity.recommend_batch
    popularity.recommend_batch = lambda *a, **kw: branch_calls.append(len(a[0])) or scored(*a, **kw)
    requests = [Request.of([event(f"k{n}", str(n), "1", 5000 + n)]) for n in range(7)]
    recommender = Recommender(Settings(online={"k": 2, "max_batch_users": 3}), store)
    prepared = recommender.prepare(requests, served)
    # one store query and one call per branch for the whole batch; nothing decoded yet
    assert len(reads) == 1 and branch_calls == [7] and served.decoder.calls == []
    messages = recommender.finish(prepared)
    assert [len(call) for call in served.decoder.calls] == [2, 2, 3]  # as even as can be
    assert [m.event_id for m in messages] == [f"k{n}" for n in range(7)]
    assert all(m.decoding["path"] == "full_prompt" for m in messages)
    assert [m.decoding["batch_users"] for m in messages] == [2, 2, 2, 2, 3, 3, 3]


def test_prefix_kv_lru_caches_hits_and_misses_and_evicts() -> None:
    kv_store = FakeKVStore({"a": Entry(1, 1, "e"), "b": Entry(2, 2, "f")})
    cache = PrefixKVCache(size=2)
    assert cache.get(kv_store, "kv1", "a", "m")[1] == "prefix-kv@1"
    assert cache.get(kv_store, "kv1", "a", "m")[1] == "prefix-kv@1"
    assert cache.get(kv_store, "kv1", "zz", "m") == (None, None)
    assert cache.get(kv_store, "kv1", "zz", "m") == (None, None)
    assert kv_store.lookups == 2 and kv_store.loads == 1
    cache.get(kv_store, "kv1", "b", "m")  # evicts "a", the least recently used
    cache.get(kv_store, "kv1", "a", "m")
    assert kv_store.lookups == 4 and len(cache) == 2


def test_new_bundle_clears_the_prefix_cache(store) -> None:
    kv_store = FakeKVStore({"7": Entry(3, 3000, "s3")})
    recommender = Recommender(Settings(online={"k": 2}), store)
    request = Request.of([event("k9", "7", "5", 9000)])
    recommender.recommend([request], bundle(FakeDecoder(), kv_store, key="v1"))
    recommender.recommend([request], bundle(FakeDecoder(), kv_store, key="v1"))
    assert kv_store.lookups == 1
    recommender.recommend([request], bundle(FakeDecoder(), kv_store, key="v2"))
    assert kv_store.lookups == 2


def test_merge_credits_each_item_to_its_best_branch() -> None:
    merged = merge_branches(
        {"generative": [("x", 1.0), ("y", 0.5)], "popularity": [("y", 9.0), ("z", 1.0)]},
        k=3, recall=RecallSettings(merge_weights={}),
    )  # fmt: skip
    assert [(i.item_id, i.branch, i.rank) for i in merged] == [
        ("y", "popularity", 0), ("x", "generative", 1), ("z", "popularity", 2),
    ]  # fmt: skip


def test_a_branch_score_that_is_not_finite_fails_the_message_with_the_field_named(
    store,
) -> None:
    """The message validates its items (built as plain fields, not models): a NaN score
    from a branch is refused with a clear error, never published."""
    import pydantic

    class NanBranch:
        def recommend_batch(self, histories, k, excludes, timestamps):
            return [[("6", float("nan"))] for _ in histories]

    served = bundle(FakeDecoder())
    served.branches["broken"] = NanBranch()
    recommender = Recommender(Settings(online={"k": 3}), store)
    with pytest.raises(pydantic.ValidationError, match="finite number"):
        recommender.recommend([Request.of([event("k5", "7", "4", 4000)])], served)


def test_a_custom_merge_may_return_scored_items_and_generative_ones_get_their_codes(
    store,
) -> None:
    def merge(lists, k):
        return [ScoredItem(item_id=i, score=s, rank=r, branch="generative")
                for r, (i, s) in enumerate(lists["generative"][:k])]  # fmt: skip

    recommender = Recommender(Settings(online={"k": 3}), store, merge_fn=merge)
    [message] = recommender.recommend(
        [Request.of([event("k6", "8", "1", 600)])], bundle(FakeDecoder())
    )
    tokens = item_tokens()
    assert [i.item_id for i in message.items] == ["2", "3", "4"]
    for item in message.items:
        assert item.semantic_id == tokens.layout.decode([tokens.tokens_of(item.item_id)])[0]


def test_versions_swap_between_batches_and_survive_a_failed_load() -> None:
    active = {"key": "v1"}
    loads = []

    def load(key):
        loads.append(key)
        if key == "bad":
            raise RuntimeError("half-written version")
        return ServingBundle(key)

    versions = ServingVersions(lambda: active["key"], load).start(background=False)
    assert versions.current().key == "v1" and not versions.check_now()
    active["key"] = "v2"
    assert versions.check_now()
    assert versions.current().key == "v2"
    active["key"] = "bad"
    assert not versions.check_now() and not versions.check_now()
    assert versions.current().key == "v2" and loads == ["v1", "v2", "bad"]


def test_installing_a_version_freezes_what_is_alive_and_frees_what_the_last_one_dropped():
    import gc
    import weakref

    class Models:  # a cycle: only the cyclic collector frees it
        def __init__(self) -> None:
            self.me = self

    active = {"key": "v1"}

    def load(key: str) -> ServingBundle:
        return ServingBundle(key, decoder=Models())

    gc.collect()
    try:
        versions = ServingVersions(lambda: active["key"], load, freeze_gc=True)
        versions.start(background=False)
        assert gc.get_freeze_count() > 0
        first = weakref.ref(versions.current().decoder)
        for key in ("v2", "v3"):
            active["key"] = key
            assert versions.check_now() and versions.current().key == key
        assert first() is None  # frozen with v1, collected at v3's install
    finally:
        gc.unfreeze()


def test_nothing_active_serves_an_empty_bundle() -> None:
    versions = ServingVersions(lambda: None, lambda key: ServingBundle(key)).start(background=False)
    assert versions.current().key == "none" and versions.current().decoder is None


def test_prefix_kv_lru_is_bounded_by_bytes() -> None:
    import torch

    from genrec.online.decoding.prefix_kv import PrefixKV

    keys = [torch.zeros(2, 100, 8)]  # 12,800 bytes with the values

    class TensorKVStore(FakeKVStore):
        def load(self, entry, expected_model_version):
            self.loads += 1
            return PrefixKV([1] * 101, keys, [torch.zeros(2, 100, 8)], "m")

    entries = {u: Entry(1, 1, "e") for u in "abc"}
    kv_store = TensorKVStore(entries)
    cache = PrefixKVCache(size=10, max_bytes=30_000)
    for user in "abc":
        cache.get(kv_store, "kv1", user, "m")
    assert len(cache) == 2 and cache.nbytes == 25_600  # "a" went to stay under 30,000 bytes
    cache.get(kv_store, "kv1", "a", "m")
    assert kv_store.loads == 4
    # The decoder adds a draft's prefix KV to an entry: a recount makes the bound see it.
    _entry, prefix_kv = cache.get(kv_store, "kv1", "a", "m")
    prefix_kv.companions["draft:x"] = PrefixKV([1] * 101, keys, [torch.zeros(2, 100, 8)], "m/d")
    cache.recount("kv1", ["a", "nobody"])
    assert len(cache) == 1 and cache.nbytes == 25_600  # "c" went; "a" is 2 x 12,800 now
    cache.clear()
    assert cache.nbytes == 0 and len(cache) == 0


# --- online.exclude_seen: repeat consumption -------------------------------------------------


def repeat_bundle(decoder) -> ServingBundle:
    """Popularity, item-CF and ANN that all rank user 7's seen items (1, 2, 3) high."""
    from genrec.online.branches import AnnBranch, ItemCFBranch

    sequences = {"a": ["1", "2", "3", "1"], "b": ["2", "1", "5"], "c": ["3", "2", "6"]}
    vectors = np.array([[1, 0]] * 4 + [[0.9, 0.1]] + [[0, 1]] * 3, dtype=np.float32)
    return ServingBundle(
        "v1", decoder=decoder, model_version="m1", semantic_id_version="s1",
        branches={
            "popularity": PopularityBranch.fit(sequences, item_ids=ITEMS, half_life_days=None),
            "itemcf": ItemCFBranch.fit(sequences, item_ids=ITEMS, window=3),
            "ann": AnnBranch.fit(ITEMS, vectors),
        },
    )  # fmt: skip


@pytest.mark.parametrize("exclude_seen", [True, False])
def test_seen_items_come_back_from_every_list_only_when_allowed(store, exclude_seen) -> None:
    decoder = FakeDecoder()
    settings = Settings(online={"k": 4, "exclude_seen": exclude_seen})
    request = Request.of([event("r1", "7", "4", 4000)])  # user 7 had 1, 2, 3 stored
    [message] = Recommender(settings, store).recommend([request], repeat_bundle(decoder))
    seen = {"1", "2", "3", "4"}
    [[gen]] = decoder.calls
    assert sorted(gen.exclude) == ([0, 1, 2, 3] if exclude_seen else [])
    lists = {name: {i.item_id for i in items} for name, items in message.branches.items()}
    lists["merged"] = {i.item_id for i in message.items}
    assert set(lists) == {"generative", "popularity", "itemcf", "ann", "merged"}
    for name, items in lists.items():
        assert items and bool(items & seen) is not exclude_seen, name


@pytest.mark.parametrize("mode", ["target", "strict"])
@pytest.mark.parametrize("exclude_seen", [True, False])
def test_the_beam_search_returns_seen_items_only_when_allowed(store, mode, exclude_seen) -> None:
    """A real (tiny, random) target and draft over the 8-item catalog, 8 beams wide: every
    valid item comes back, so seen ones do exactly when they are not masked."""
    import torch

    from genrec.online.models.generative import GenerativeModels
    from genrec.online.models.presets import build_draft, build_target, get_preset
    from genrec.online.recommender import ModelDecoder

    torch.manual_seed(0)
    tokens, preset = item_tokens(), get_preset("tiny")
    target = build_target(preset, tokens.layout).eval()
    draft = build_draft(preset, tokens.layout).eval()
    models = GenerativeModels(target, {"atspeed_s": draft}, tokens, history_items=50, preset="tiny")
    online = {"k": 8, "beam_width": 8, "mode": mode, "draft_beams": 8, "exclude_seen": exclude_seen}
    decoder = ModelDecoder(models, Settings(online=online).online)
    recommender = Recommender(Settings(online=online), store)
    request = Request.of([event("r1", "7", "4", 4000)])
    [message] = recommender.recommend([request], ServingBundle("v1", decoder=decoder))
    generated = [i.item_id for i in message.branches["generative"]]
    expected = set(ITEMS) - ({"1", "2", "3", "4"} if exclude_seen else set())
    assert set(generated) == expected and len(generated) == len(expected)
    assert {i.item_id for i in message.items} == expected  # the merge keeps them
