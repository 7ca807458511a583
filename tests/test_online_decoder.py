"""The production decoder adapter (ModelDecoder) on tiny random models: prefix KV == full prompt."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from prometheus_client import REGISTRY

from genrec.infra.settings import OnlineSettings
from genrec.online.decoding import prefix_kv as prefix_kv_module
from genrec.online.decoding.prefix_kv import compute_prefix_kv
from genrec.online.models.generative import GenerativeModels
from genrec.online.models.presets import build_draft, build_target, get_preset
from genrec.online.prompts import ItemTokens, history_prompt
from genrec.online.recommender import GenerativeRequest, ModelDecoder
from genrec.schemas.token_layout import TokenLayout


@pytest.fixture(scope="module")
def models() -> GenerativeModels:
    torch.manual_seed(0)
    layout = TokenLayout.for_scratch_model((8, 8, 4))
    rng = np.random.default_rng(0)
    codes = {tuple(c) for c in rng.integers(0, [8, 8, 4], size=(200, 3)).tolist()}
    codes = sorted(codes)[:120]
    item_tokens = ItemTokens([f"i{n}" for n in range(len(codes))], np.array(codes), layout)
    preset = get_preset("tiny")
    target, draft = build_target(preset, layout).eval(), build_draft(preset, layout).eval()
    return GenerativeModels(
        target, {"atspeed_s": draft}, item_tokens, history_items=50, preset="tiny"
    )


def requests(models, histories, cached: bool, suffix_items: int = 2) -> list[GenerativeRequest]:
    out = []
    for history in histories:
        full = history_prompt(history, models.item_tokens, 50)
        seen = [models.item_tokens.index[i] for i in history]
        request = GenerativeRequest("u", full, exclude=seen)
        if cached:
            prefix = history_prompt(history[:-suffix_items], models.item_tokens, 50)
            request.prefix_kv = compute_prefix_kv(models.target, [prefix], "m")[0]
            request.suffix_tokens = full[len(prefix) :]
        out.append(request)
    return out


@pytest.mark.parametrize("mode", ["target", "strict"])
def test_prefix_kv_path_gives_the_full_prompt_items(models, mode) -> None:
    histories = [
        [f"i{n}" for n in range(s, s + length)] for s, length in ((0, 6), (10, 9), (30, 4))
    ]
    decoder = ModelDecoder(models, OnlineSettings(mode=mode, draft_beams=16))
    full = decoder.decode(requests(models, histories, cached=False), beam_width=8)
    cached = decoder.decode(requests(models, histories, cached=True), beam_width=8)
    for a, b, history in zip(full.items, cached.items, histories, strict=True):
        assert [row for row, _ in a] == [row for row, _ in b]
        assert np.allclose([s for _, s in a], [s for _, s in b], atol=1e-4)
        assert a and not {models.item_tokens.index[i] for i in history} & {row for row, _ in a}
    assert all(s["target_calls"] >= 1 for s in cached.stats)
    if mode == "strict":
        assert all(s["mode"] == "strict" and "acceptance_rate" in s for s in cached.stats)
    else:
        assert all(s["mode"] == "target" for s in cached.stats)


def test_mixed_batch_of_cached_and_new_users(models) -> None:
    histories = [["i1", "i2", "i3"], ["i5"], ["i7", "i8", "i9", "i10"]]
    decoder = ModelDecoder(models, OnlineSettings(mode="strict", draft_beams=16))
    mixed = requests(models, histories, cached=False)
    mixed[2] = requests(models, [histories[2]], cached=True)[0]
    alone = decoder.decode(requests(models, histories, cached=False), beam_width=6)
    result = decoder.decode(mixed, beam_width=6)
    assert [[r for r, _ in row] for row in result.items] == [
        [r for r, _ in row] for row in alone.items
    ]


def test_cached_prompt_plus_suffix_longer_than_the_window(models) -> None:
    """Serving: the cache holds the last H items up to the refresh, the suffix adds newer ones,
    so the target reads more than the H-item ``full_prompt``; the draft must read the same."""
    history = [f"i{n}" for n in range(20, 30)]
    prefix = history_prompt(history[:8], models.item_tokens, 6)
    suffix = sum((models.item_tokens.tokens_of(i) for i in history[8:]), [])
    full = history_prompt(history, models.item_tokens, 6)
    seen = [models.item_tokens.index[i] for i in history]
    prefix_kv = compute_prefix_kv(models.target, [prefix], "m")[0]
    request = GenerativeRequest("u", full, prefix_kv, suffix, seen)
    reference = GenerativeRequest("u", prefix + suffix, exclude=seen)
    assert len(prefix + suffix) > len(full)
    target_only = ModelDecoder(models, OnlineSettings(mode="target"))
    expected = target_only.decode([reference], beam_width=8).items[0]
    for mode in ("strict", "target"):
        decoder = ModelDecoder(models, OnlineSettings(mode=mode, draft_beams=16))
        got = decoder.decode([request], beam_width=8)
        assert [r for r, _ in got.items[0]] == [r for r, _ in expected]
        assert got.stats[0]["mode"] == mode


def test_draft_prefix_kv_is_computed_once_per_cached_prefix(models, monkeypatch) -> None:
    """The draft prefills a user's cached prompt on the first request only; results unchanged."""
    histories = [[f"i{n}" for n in range(s, s + 7)] for s in (0, 40)]
    reqs = requests(models, histories, cached=True)
    decoder = ModelDecoder(models, OnlineSettings(mode="strict", draft_beams=16))
    calls = []
    real = prefix_kv_module.compute_prefix_kv
    monkeypatch.setattr(
        prefix_kv_module,
        "compute_prefix_kv",
        lambda model, prompts, version: calls.append(len(prompts)) or real(model, prompts, version),
    )
    first = decoder.decode(reqs, beam_width=8)
    second = decoder.decode(reqs, beam_width=8)
    assert calls == [2]  # both users' draft prefixes in one batched prefill, then reused
    assert all(r.prefix_kv.companions["draft:atspeed_s"].model_version == "m/draft:atspeed_s"
               for r in reqs)  # fmt: skip
    assert [[r for r, _ in row] for row in first.items] == [
        [r for r, _ in row] for row in second.items
    ]
    target_only = ModelDecoder(models, OnlineSettings(mode="target"))
    expected = target_only.decode(requests(models, histories, cached=False), beam_width=8)
    assert [[r for r, _ in row] for row in second.items] == [
        [r for r, _ in row] for row in expected.items
    ]


def test_auto_mode_serves_the_same_items_and_settles_on_one_mode(models) -> None:
    """auto alternates strict and target (both lossless: the same items) and then keeps one."""
    histories = [[f"i{n}" for n in range(s, s + 6)] for s in (0, 20, 50)]
    expected = ModelDecoder(models, OnlineSettings(mode="target")).decode(
        requests(models, histories, cached=True), beam_width=8
    )
    settings = OnlineSettings(mode="auto", auto_mode_batches=2, draft_beams=16)
    decoder = ModelDecoder(models, settings)
    counted = {m: REGISTRY.get_sample_value("genrec_decode_batches_total", {"mode": m}) or 0.0
               for m in ("strict", "target")}  # fmt: skip
    modes = []
    for _ in range(6):
        got = decoder.decode(requests(models, histories, cached=True), beam_width=8)
        assert [[r for r, _ in row] for row in got.items] == [
            [r for r, _ in row] for row in expected.items
        ]
        modes.append((got.stats[0]["mode"], got.stats[0]["auto_mode"]))
    assert [mode for mode, _ in modes[:4]] == ["strict", "target", "strict", "target"]
    assert {state for _, state in modes[:4]} == {"timing"}
    assert decoder.auto.settled and modes[4:] == [(decoder.auto.choice, "settled")] * 2
    for mode in ("strict", "target"):  # /metrics shows what each batch was decoded with
        now = REGISTRY.get_sample_value("genrec_decode_batches_total", {"mode": mode})
        assert now - counted[mode] == 2 + 2 * (decoder.auto.choice == mode)
    described = decoder.describe()
    assert described["mode"] == "auto" and described["draft"] == "atspeed_s"
    assert described["serving"] == decoder.auto.choice
    assert set(described["ms_per_request"]) == {"strict", "target"}


def test_auto_mode_without_a_draft_is_target_only(models) -> None:
    no_drafts = GenerativeModels(models.target, {}, models.item_tokens, 50, preset="tiny")
    decoder = ModelDecoder(no_drafts, OnlineSettings(mode="auto"))
    got = decoder.decode(requests(models, [["i1", "i2", "i3"]], cached=False), beam_width=4)
    assert decoder.auto is None and got.stats[0]["mode"] == "target"
    assert decoder.describe() == {"mode": "auto", "draft": None, "serving": "target"}


def test_the_strict_draft_is_the_one_training_measured_best(models) -> None:
    """Strict gains from acceptance alone: rank the drafts by the version's measured figure."""
    drafts = {name: models.drafts["atspeed_s"] for name in ("sft", "atspeed_s", "atspeed_r")}
    measured = {
        "sft": [0.83, 0.90, 1.0],
        "atspeed_s": [0.79, 0.83, 1.0],
        "atspeed_r": [0.82, 0.85, 1.0],
    }
    metrics = {"agreement_valid@10": {
        name: {"topk_overlap": 0.4, "strict_acceptance_per_step": steps}
        for name, steps in measured.items()
    }}  # fmt: skip
    version = GenerativeModels(models.target, drafts, models.item_tokens, 50, preset="tiny",
                               metrics=metrics)  # fmt: skip
    assert version.drafts_for("strict") == ["sft", "atspeed_r", "atspeed_s"]
    assert version.drafts_for("relaxed")[0] == "atspeed_r"
    for mode, expected in (("strict", "sft"), ("auto", "sft"), ("relaxed", "atspeed_r")):
        assert ModelDecoder(version, OnlineSettings(mode=mode)).draft_name == expected
    chosen = ModelDecoder(version, OnlineSettings(mode="strict", draft="atspeed_s"))
    assert chosen.draft_name == "atspeed_s"  # online.draft wins
    unmeasured = GenerativeModels(models.target, drafts, models.item_tokens, 50, preset="tiny")
    assert unmeasured.drafts_for("strict")[0] == "atspeed_s"


@pytest.mark.parametrize("mode", ["target", "strict"])
def test_cached_and_uncached_users_share_one_engine_call(models, mode, monkeypatch) -> None:
    """Users without a prefix KV join the cached ones as empty prefixes: one engine call for
    the batch, the items and scores of decoding each user's full prompt; where the padding
    would cost more than a second call (``JOIN_MAX_EXTRA_KEYS``), two calls, same items."""
    from genrec.online import recommender as recommender_module

    histories = [[f"i{n}" for n in range(s, s + length)] for s, length in ((0, 3), (9, 8), (30, 5))]
    mixed = requests(models, histories, cached=True)
    mixed[1] = requests(models, [histories[1]], cached=False)[0]
    decoder = ModelDecoder(models, OnlineSettings(mode=mode, draft_beams=16))
    expected = ModelDecoder(models, OnlineSettings(mode="target")).decode(
        requests(models, histories, cached=False), beam_width=8
    )
    calls = []
    real = decoder._search
    monkeypatch.setattr(decoder, "_search", lambda *a: calls.append(a[0]) or real(*a))
    for join_max, n_calls in ((recommender_module.JOIN_MAX_EXTRA_KEYS, 1), (0, 2)):
        monkeypatch.setattr(recommender_module, "JOIN_MAX_EXTRA_KEYS", join_max)
        calls.clear()
        got = decoder.decode(mixed, beam_width=8)
        assert len(calls) == n_calls
        for a, b in zip(got.items, expected.items, strict=True):
            assert [row for row, _ in a] == [row for row, _ in b]
            assert np.allclose([s for _, s in a], [s for _, s in b], atol=1e-5)
        assert [s["mode"] for s in got.stats] == [mode] * 3
    # the kept prompt of the uncached user is its whole prompt, as decoded alone
    assert got.prompt_kvs[1].prompt_ids == mixed[1].full_prompt


def test_serving_decodes_in_inference_mode_and_offline_decodes_still_run(models) -> None:
    """The worker's decode runs under inference mode; its reused KV buffers never reach a
    decode outside it (an evaluation's), which could not write into them."""
    from genrec.online.decoding.engine import batched_beam_search

    histories = [[f"i{n}" for n in range(s, s + 5)] for s in (0, 20)]
    decoder = ModelDecoder(models, OnlineSettings(mode="target"))
    served = decoder.decode(requests(models, histories, cached=True), beam_width=8)
    assert served.prompt_kvs[0].keys[0].is_inference()
    uncached = requests(models, histories, cached=False)
    offline = batched_beam_search(
        models.target, [r.full_prompt for r in uncached], models.tree, models.layout, 8,
        exclude=[r.exclude for r in uncached],
    )  # fmt: skip
    assert not offline.scores.is_inference()
    assert offline.item_index.tolist() == [[row for row, _ in items] for items in served.items]
