"""One micro-batch of requests -> one recommendation message per request (online step).

For every request (a user's latest event in the batch) the recommender:

1. reads the user's history from the behavior store (newest ``max_history_events``,
   one query for the whole batch) and adds the events in hand from Kafka that
   ingest has not stored yet (deduplicated by ``event_id``), in time order;
2. looks up the user's prefix KV (an in-memory LRU over the KV store) and splits
   the history at its cutoff: events up to ``cutoff_event_row`` are in the cached
   prefix, the rest is the real-time suffix. Users without a cache are decoded
   from the whole prompt (BOS + their items);
3. asks every traditional branch (popularity, item-CF, ANN) for its list, the
   whole batch in one call per branch;
4. decodes the top items with the generative decoder (prefill the suffix onto
   the prefix KV, speculative beam search over valid semantic IDs), dropping
   items the user has already seen, in calls of at most ``max_batch_users``;
5. merges all lists and builds the ``RecommendationMessage``.

Seen items are left out by the lists themselves (the beam search masks them, each
branch gets them as ``excludes``) while ``online.exclude_seen`` is on; off, nothing
is left out anywhere, so a re-consumed item can come back from any list and the
merge (which never filters by history) keeps it.

Steps 1-3 are ``prepare`` and steps 4-5 ``finish``: the worker prepares the next
batch on its consumer's thread while its engine thread finishes the current one
(``recommend`` does both in turn). The decoder, KV store and branches come from
a ``ServingBundle`` (see ``genrec.online.live_version``) so tests can inject
small models and fakes.

Example::

    >>> from genrec.infra.database import make_engine
    >>> from genrec.infra.settings import Settings
    >>> from genrec.online.live_version import ServingBundle
    >>> recommender = Recommender(Settings(online={"k": 3}), make_engine("sqlite://"))
    >>> event = UserEvent(event_id="e1", user_id="7", item_id="42", event_type="view", ts=1)
    >>> [m.event_id for m in recommender.recommend([Request.of([event])], ServingBundle("empty"))]
    ['e1']
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from sqlalchemy import Engine

from genrec.infra import metrics
from genrec.infra.settings import OnlineSettings, Settings
from genrec.ingest.history import History, HistoryEvent
from genrec.online.auto_mode import AutoMode
from genrec.online.history_cache import HistoryCache, UnstoredEvents
from genrec.online.merge import merge_lists
from genrec.online.prefix_kv_store import KVStoreUnavailable
from genrec.online.prompts import history_prompt, history_tokens
from genrec.online.served_prompts import ServedPrompts, starts
from genrec.schemas.events import UserEvent
from genrec.schemas.recommendations import RecommendationMessage, ScoredItem

if TYPE_CHECKING:
    from genrec.online.prompts import ItemTokens

log = logging.getLogger(__name__)

GENERATIVE = "generative"


@dataclass(frozen=True)
class Request:
    """A user's latest event in a micro-batch, plus every event of theirs the batch covered."""

    user_id: str
    event: UserEvent
    covered: tuple[UserEvent, ...]  # in Kafka (= produce) order, ``event`` last
    received_at: float  # time.monotonic() when the worker first held one of these events

    @classmethod
    def of(cls, user_events: Sequence[UserEvent], received_at: float | None = None) -> Request:
        if not user_events:
            raise ValueError("a request needs at least one event")
        if len({e.user_id for e in user_events}) != 1:
            raise ValueError("a request's events must belong to one user")
        at = received_at if received_at is not None else time.monotonic()
        return cls(user_events[-1].user_id, user_events[-1], tuple(user_events), at)


@dataclass
class GenerativeRequest:
    """What the decoder needs for one user. ``prefix_kv`` None -> decode ``full_prompt``."""

    user_id: str
    full_prompt: list[int]  # BOS + the items of the history window
    prefix_kv: Any | None = None
    suffix_tokens: list[int] = field(default_factory=list)  # the items after the prefix's cutoff
    exclude: list[int] = field(default_factory=list)  # item rows masked (seen, if excluded)
    prompt_items: int = 0  # items in the prompt decoded (prefix + suffix, or full_prompt)
    last_event_id: str | None = None  # the history's newest event: where new items start


@dataclass
class GenerativeBatch:
    """Per request the (item row, score) list, best first, and its decoding statistics."""

    items: list[list[tuple[int, float]]]
    stats: list[dict[str, Any]]  # per request: target_calls, acceptance_rate, mode ...
    # per request the KV of the prompt it decoded (``PrefixKV``; None: not kept), for the
    # user's next request (``online.served_prompts``)
    prompt_kvs: list[Any] | None = None


@dataclass
class PreparedBatch:
    """A batch ready for the engine: ``Recommender.prepare``'s work, ``finish``'s input."""

    requests: list[Request]
    bundle: Any  # the ServingBundle that prepared it, and decodes it
    gen_requests: list[GenerativeRequest] | None  # None: the bundle has no decoder
    decoding: list[dict[str, Any]]  # per request: path, prompt/suffix tokens, then decode stats
    branch_lists: dict[str, list[list[tuple[str, float]]]]  # per branch, per request

    @property
    def users(self) -> int:
        return len(self.requests)


class GenerativeDecoder(Protocol):
    """Decodes a batch of users to their top items (each request's ``exclude`` removed)."""

    item_tokens: ItemTokens  # item ids, rows and tokens
    history_items: int  # the model's history window H

    def decode(self, requests: Sequence[GenerativeRequest], beam_width: int) -> GenerativeBatch: ...


class PrefixKVCache:
    """An LRU of loaded prefix KVs keyed by (kv version, user); misses are cached too.

    Bounded by entries and by bytes: a SmolLM2-sized user prefix is ~9 MB, so a
    count alone would not bound a worker's memory. Thread-safe: the worker looks
    prefixes up on its consumer's thread while its engine thread recounts the
    ones it decoded.

    A batch's memory misses are read from the KV store together (``load_many``: one
    pipelined round trip for Redis). A store that cannot be reached answers nothing
    for them: they are served from their prompts, counted, and not remembered, so the
    next batch asks the store again and hits once it is back.
    """

    _MISS = object()
    UNAVAILABLE_LOG_S = 30.0  # at most one "store unreachable" warning this often

    def __init__(self, size: int, max_bytes: int | None = None) -> None:
        self.size, self.max_bytes = size, max_bytes
        self.nbytes = 0
        self._entries: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._sizes: dict[tuple[str, str], int] = {}  # bytes of each entry, as last counted
        self._lock = threading.Lock()
        self._unavailable_logged_at: float | None = None
        self._unavailable_unlogged = 0  # users served from the prompt since the last warning

    def get(self, kv_store: Any, kv_version: str, user_id: str, model_version: Any) -> tuple:
        """``(entry, prefix_kv)`` or ``(None, None)``; loads from ``kv_store`` on a memory miss."""
        found, _unavailable = self.get_many(kv_store, kv_version, [user_id], model_version)
        return found.get(user_id, (None, None))

    def get_many(
        self, kv_store: Any, kv_version: str, user_ids: Sequence[str], model_version: Any
    ) -> tuple[dict[str, tuple], set[str]]:
        """Per user with a usable cache ``(entry, prefix_kv)``, and the users whose cache
        could not be asked for because the store is unreachable."""
        found: dict[str, tuple] = {}
        missing: list[str] = []
        with self._lock:
            for user_id in dict.fromkeys(user_ids):
                key = (kv_version, user_id)
                if key not in self._entries:
                    missing.append(user_id)
                    continue
                self._entries.move_to_end(key)
                metrics.PREFIX_KV_LOOKUPS.labels(result="memory").inc()
                if self._entries[key] is not self._MISS:
                    found[user_id] = self._entries[key]
        if not missing:
            return found, set()
        # Loaded outside the lock: a store read must not hold up the engine's recount.
        try:
            loaded = kv_store.load_many(kv_version, missing, expected_model_version=model_version)
        except KVStoreUnavailable as exc:
            metrics.PREFIX_KV_LOOKUPS.labels(result="unavailable").inc(len(missing))
            self._log_unavailable(exc, len(missing))
            return found, set(missing)
        with self._lock:
            for user_id in missing:
                result = self._checked(user_id, loaded.get(user_id))
                metrics.PREFIX_KV_LOOKUPS.labels(
                    result="miss" if result is self._MISS else "store"
                ).inc()
                self._remember((kv_version, user_id), result)
                if result is not self._MISS:
                    found[user_id] = result
        return found, set()

    def _checked(self, user_id: str, loaded: Any) -> Any:
        """A store's answer for one user as an LRU value: ``(entry, prefix_kv)`` or a miss."""
        if loaded is None:
            return self._MISS
        if isinstance(loaded, Exception):  # a stale or unreadable entry: serve without it
            log.warning("prefix KV of user %s unusable: %s", user_id, loaded)
            metrics.ERRORS.labels(component="online", kind="prefix_kv_load").inc()
            return self._MISS
        return loaded

    def _log_unavailable(self, exc: Exception, users: int) -> None:
        """One warning per ``UNAVAILABLE_LOG_S`` however many batches fall back meanwhile."""
        now = time.monotonic()
        self._unavailable_unlogged += users
        last = self._unavailable_logged_at
        if last is None or now - last >= self.UNAVAILABLE_LOG_S:
            log.warning("prefix KV store unreachable (%s): %d users served from their prompts "
                        "since the last message; retrying on the next batches",
                        exc, self._unavailable_unlogged)  # fmt: skip
            self._unavailable_logged_at, self._unavailable_unlogged = now, 0

    def _remember(self, key: tuple[str, str], found: Any) -> None:
        if self.size <= 0:
            return
        self._entries[key] = found
        self._count(key)
        self._evict()

    def recount(self, kv_version: str, user_ids: Sequence[str]) -> None:
        """Re-measure these users' entries (the decoder adds the draft's prefix KV to them)."""
        with self._lock:
            for user_id in user_ids:
                if (kv_version, user_id) in self._entries:
                    self._count((kv_version, user_id))
            self._evict()

    def _count(self, key: tuple[str, str]) -> None:
        size = _prefix_bytes(self._entries[key])
        self.nbytes += size - self._sizes.get(key, 0)
        self._sizes[key] = size

    def _evict(self) -> None:
        while len(self._entries) > self.size or (
            self.max_bytes is not None and self.nbytes > self.max_bytes and len(self._entries) > 1
        ):
            key, _evicted = self._entries.popitem(last=False)
            self.nbytes -= self._sizes.pop(key, 0)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._sizes.clear()
            self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)


def _prefix_bytes(found: Any) -> int:
    """Bytes of a cached ``(entry, PrefixKV)`` with its companions (0 for a miss or a fake)."""
    prefix_kv = found[1] if isinstance(found, tuple) else None
    return _kv_bytes(prefix_kv) + sum(
        _kv_bytes(c) for c in getattr(prefix_kv, "companions", {}).values()
    )


def _kv_bytes(prefix_kv: Any) -> int:
    tensors = [*getattr(prefix_kv, "keys", []), *getattr(prefix_kv, "values", [])]
    return sum(t.numel() * t.element_size() for t in tensors if hasattr(t, "element_size"))


# A merge returns the merged list as ``ScoredItem``s or as mappings of their fields (what the
# message validates either way); the default returns mappings (``merged_rows``).
MergeFn = Callable[
    [Mapping[str, Sequence[tuple[str, float]]], int], list[ScoredItem | dict[str, Any]]
]


class Recommender:
    """Turns micro-batches of requests into messages with the models of a ``ServingBundle``."""

    def __init__(self, settings: Settings, engine: Engine, merge_fn: MergeFn | None = None) -> None:
        self.settings = settings.online
        self.recall = settings.recall
        self.engine = engine
        self.merge_fn = merge_fn or (lambda lists, k: merged_rows(lists, k, settings.recall))
        self.prefix_kvs = PrefixKVCache(
            self.settings.prefix_kv_lru_size, int(self.settings.prefix_kv_lru_mb * 2**20)
        )
        self.served = None
        if self.settings.reuse_prompt_kv:
            self.served = ServedPrompts(
                self.settings.prompt_kv_lru_size, int(self.settings.prompt_kv_lru_mb * 2**20)
            )
        self.stored_histories = HistoryCache(
            self.settings.history_cache_events, self.settings.history_cache_s,
            self.settings.max_history_events,
        )  # fmt: skip
        self.unstored = UnstoredEvents(self.settings.history_cache_s)
        self._bundle_key: str | None = None

    def recommend(
        self,
        requests: Sequence[Request],
        bundle,
        histories: Sequence[Sequence[HistoryEvent]] | None = None,
    ) -> list[RecommendationMessage]:
        """One message per request, in request order: ``prepare`` then ``finish``."""
        return self.finish(self.prepare(requests, bundle, histories))

    def prepare(
        self,
        requests: Sequence[Request],
        bundle,
        histories: Sequence[Sequence[HistoryEvent]] | None = None,
    ) -> PreparedBatch:
        """Everything but the decoding: histories (one query), prefix KVs, branch lists.

        ``histories`` (one per request, in time order) replaces the store read: a
        read-only view recommends as of an earlier point of a user's history.
        """
        if bundle.key != self._bundle_key:  # a new version: cached prefixes belong to the old one
            self.prefix_kvs.clear()
            if self.served is not None:
                self.served.clear()
            self._bundle_key = bundle.key
        started = time.perf_counter()
        if histories is None:
            histories = self._histories(requests)
        elif len(histories) != len(requests):
            raise ValueError(f"{len(histories)} histories for {len(requests)} requests")
        else:
            histories = [History.of(h) for h in histories]
        metrics.STAGE_LATENCY.labels(stage="history").observe(time.perf_counter() - started)
        gen_requests, decoding = self._generative_requests(requests, histories, bundle)
        lists = self._branches(requests, histories, bundle)
        return PreparedBatch(list(requests), bundle, gen_requests, decoding, lists)

    def finish(self, prepared: PreparedBatch) -> list[RecommendationMessage]:
        """Decode a prepared batch (in calls of at most ``max_batch_users``) and build its
        messages, in request order."""
        generative = self._decode(prepared)
        started = time.perf_counter()
        messages = []
        for i, request in enumerate(prepared.requests):
            branch_lists = {name: rows[i] for name, rows in prepared.branch_lists.items()}
            if generative is not None:
                branch_lists = {GENERATIVE: generative[i], **branch_lists}
            messages.append(
                self._message(request, branch_lists, prepared.decoding[i], prepared.bundle)
            )
        metrics.STAGE_LATENCY.labels(stage="merge").observe(time.perf_counter() - started)
        return messages

    # --- 1. history --------------------------------------------------------------

    def _histories(self, requests: Sequence[Request]) -> list[History]:
        """Store history + events served before that the store lacks yet + events in hand
        (deduplicated by event_id), in time order."""
        stored = self.stored_histories.histories(self.engine, [r.user_id for r in requests])
        histories = []
        for request in requests:
            history = stored.get(request.user_id) or History()
            known = set(history.event_ids)
            extra = self.unstored.pending(request.user_id, known)
            known.update(e.event_id for e in extra)
            in_hand = [
                HistoryEvent(e.item_id, e.ts, e.event_id, None)
                for e in request.covered
                if e.event_id not in known
            ]
            self.unstored.add(request.user_id, in_hand)
            extra += in_hand
            if extra:  # else the store's order stands: (ts, id), as sorting would leave it
                # Stable: store rows keep their (ts, id) order, new events follow in the
                # order served (Kafka order within a batch).
                history = (history + extra).in_time_order()
            histories.append(history)
        return histories

    # --- 2. prefix KV and prompts, 4. generative decoding ---------------------------------

    def _generative_requests(self, requests, histories, bundle) -> tuple[list | None, list[dict]]:
        """Per request what the decoder needs (None without a decoder) and its statistics."""
        decoding: list[dict[str, Any]] = [{} for _ in requests]
        if bundle.decoder is None:
            for stats in decoding:
                stats["path"] = "no_generative"
            return None, decoding
        started = time.perf_counter()
        found, unavailable = {}, set()
        if bundle.kv_store is not None and bundle.kv_version is not None:
            found, unavailable = self.prefix_kvs.get_many(
                bundle.kv_store, bundle.kv_version, [r.user_id for r in requests],
                bundle.model_version,
            )  # fmt: skip
        gen_requests = [
            self._generative_request(
                r, h, bundle, stats, found.get(r.user_id), r.user_id in unavailable
            )
            for r, h, stats in zip(requests, histories, decoding, strict=True)
        ]
        metrics.STAGE_LATENCY.labels(stage="prefix_kv").observe(time.perf_counter() - started)
        return gen_requests, decoding

    def _decode(self, prepared: PreparedBatch) -> list | None:
        """Each request's generative (item id, score) list, best first (None: no decoder)."""
        # calls of (nearly) equal size: 67 users as 34 + 33, not 64 + 3, whose second call
        # would pay a whole call's fixed work for 3 users
        n = prepared.users
        calls = -(-n // self.settings.max_batch_users)
        bounds = [i * n // calls for i in range(calls + 1)] if calls else [0]
        lists: list = []
        for start, stop in zip(bounds, bounds[1:], strict=False):
            part = slice(start, stop)
            metrics.BATCH_USERS.observe(len(prepared.requests[part]))
            if prepared.gen_requests is not None:
                lists.extend(
                    self._decode_chunk(
                        prepared.gen_requests[part], prepared.decoding[part], prepared
                    )
                )
        return None if prepared.gen_requests is None else lists

    def _decode_chunk(self, gen_requests, decoding, prepared: PreparedBatch) -> list:
        bundle = prepared.bundle
        decoder = bundle.decoder
        started = time.perf_counter()
        # seen items (with online.exclude_seen) are masked inside the beam search, so
        # every beam is an item the user may get
        beam_width = self.settings.generative_beams()
        try:
            batch = decoder.decode(gen_requests, beam_width)
        except Exception:
            log.exception(
                "generative decoding failed for %d users; serving branches only", len(gen_requests)
            )
            metrics.ERRORS.labels(component="online", kind="generative").inc()
            metrics.FALLBACKS.labels(reason="generative_error").inc(len(gen_requests))
            for stats in decoding:
                stats["path"] = "no_generative"
                stats["fallback"] = "generative_error"
            return [[] for _ in gen_requests]
        metrics.STAGE_LATENCY.labels(stage="generative").observe(time.perf_counter() - started)
        if bundle.kv_version is not None:  # decoding may have cached the draft's prefix KVs
            self.prefix_kvs.recount(bundle.kv_version, [r.user_id for r in gen_requests])
        if self.served is not None and batch.prompt_kvs is not None:
            for request, prompt_kv in zip(gen_requests, batch.prompt_kvs, strict=True):
                if prompt_kv is not None:
                    self.served.put(
                        request.user_id, prompt_kv, request.prompt_items, request.last_event_id
                    )
        item_ids = decoder.item_tokens.item_ids
        lists = [
            [(item_ids[row], score) for row, score in items[: self.settings.k]]
            for items in batch.items
        ]
        for stats, request_stats in zip(decoding, batch.stats, strict=True):
            stats.update(request_stats)
            stats["batch_users"] = len(gen_requests)  # users of the decoding call it rode in
            _observe_decoding(stats)
        return lists

    def _generative_request(
        self, request, history, bundle, stats, cached: tuple | None, store_down: bool
    ) -> GenerativeRequest:
        """``cached``: the user's ``(entry, prefix_kv)`` (None: decode the full prompt);
        ``store_down``: none because the KV store was unreachable.

        The prompt, first that applies: the refresh's prefix + every newer item, or the
        user's kept prompt + its new items, while that holds at most
        ``online.max_prompt_items`` items (of the two the one whose cached part is
        longer); else the full prompt of the last H items (online/served_prompts.py).
        """
        item_tokens = bundle.decoder.item_tokens
        window = bundle.decoder.history_items
        limit = self.settings.prompt_items_limit(window)
        item_ids = history.item_ids
        seen = []
        if self.settings.exclude_seen:
            rows = set(map(item_tokens.index.get, item_ids))  # one lookup an item, not two
            rows.discard(None)  # items the model does not know
            seen = sorted(rows)
        window_items = item_tokens.last_known(item_ids, window)
        full_prompt = history_prompt(window_items, item_tokens, window)
        gen = GenerativeRequest(
            request.user_id, full_prompt, exclude=seen, prompt_items=len(window_items),
            last_event_id=history.event_ids[-1] if history.event_ids else None,
        )  # fmt: skip
        entry, prefix_kv = cached or (None, None)
        over_limit = False
        if prefix_kv is not None:
            over_limit = not _extend_refresh_prefix(
                gen, history, entry.cutoff_event_row, prefix_kv, bundle.decoder, limit
            )
            if not over_limit:
                stats["prefix_cutoff_event_id"] = getattr(entry, "cutoff_event_id", None)
        served = ""
        if self.served is not None:
            served = self._reuse_served_prompt(gen, history, item_tokens, limit)
        if served == "served":
            stats["prefix_source"] = "served"
        elif gen.prefix_kv is None:
            stats["path"] = "full_prompt"
            stats["prompt_tokens"] = len(full_prompt)
            stats["prompt_items"] = gen.prompt_items
            if over_limit or served == "over_limit":  # a cached prompt + newer items would
                reason = "prompt_limit"  # pass the limit: start again from the window
                stats["prompt_rebased"] = True
            else:
                reason = "kv_store_unavailable" if store_down else "no_prefix_kv"
            if store_down:
                stats["fallback"] = reason
            metrics.FALLBACKS.labels(reason=reason).inc()
            return gen
        stats["path"] = "prefix_kv"
        stats["suffix_tokens"] = len(gen.suffix_tokens)
        stats["prompt_items"] = gen.prompt_items
        return gen

    def _reuse_served_prompt(self, gen: GenerativeRequest, history, item_tokens, limit) -> str:
        """Decode from the KV of the user's last decoded prompt when that prompt plus the
        user's new items holds at most ``limit`` items, is where this one starts, and is
        longer than the refresh's prefix: only the newer tokens are prefilled.

        Says "served" when it did, "over_limit" when the kept prompt would grow past
        ``limit``, "" otherwise (none kept, or not where this prompt starts)."""
        kept = self.served.get(gen.user_id)
        if kept is None:
            return ""
        if gen.prefix_kv is not None:  # the refresh's prefix + newer items fit: that prompt
            prompt, items = gen.prefix_kv.prompt_ids + list(gen.suffix_tokens), gen.prompt_items
        else:
            most = limit - kept.prompt_items
            new = _items_after(history, kept.last_event_id, item_tokens, most)
            if new is None:
                return ""
            if new > most:
                return "over_limit"
            items = kept.prompt_items + new
            prompt = (
                history_prompt(history.item_ids, item_tokens, items)
                if items
                else [item_tokens.layout.bos_token_id]
            )
        kept_kv = kept.prompt_kv
        if not starts(prompt, kept_kv.prompt_ids) or (
            gen.prefix_kv is not None and kept_kv.length <= gen.prefix_kv.length
        ):
            return ""
        gen.prefix_kv, gen.suffix_tokens = kept_kv, prompt[len(kept_kv.prompt_ids) :]
        gen.prompt_items = items
        metrics.PREFIX_KV_LOOKUPS.labels(result="served").inc()
        return "served"

    # --- 3. branches, 5. merge ----------------------------------------------------------

    def _branches(self, requests, histories, bundle) -> dict[str, list[list[tuple[str, float]]]]:
        started = time.perf_counter()
        items = [h.item_ids for h in histories]
        timestamps = [h.ts_ms for h in histories]
        # None: no branch leaves anything out (re-consumption allowed, online.exclude_seen)
        excludes = [set(h) for h in items] if self.settings.exclude_seen else None
        depth = max(self.settings.k, self.recall.merge_depth)  # merged lists need some depth
        lists: dict[str, list[list[tuple[str, float]]]] = {}
        for name, branch in bundle.branches.items():
            try:
                lists[name] = branch.recommend_batch(items, depth, excludes, timestamps)
            except Exception:
                log.exception("branch %s failed; its list is empty for this batch", name)
                metrics.ERRORS.labels(component="online", kind=f"branch_{name}").inc()
                metrics.FALLBACKS.labels(reason="branch_error").inc(len(requests))
                lists[name] = [[] for _ in requests]
        metrics.STAGE_LATENCY.labels(stage="branches").observe(time.perf_counter() - started)
        return lists

    def _message(self, request, branch_lists, decoding, bundle) -> RecommendationMessage:
        k = self.settings.k
        codes = _generative_codes(branch_lists.get(GENERATIVE, [])[:k], bundle)
        branches = {
            name: [
                _scored(i, s, r, semantic_id=codes.get(i))
                if name == GENERATIVE
                else _scored(i, s, r)
                for r, (i, s) in enumerate(rows[:k])
            ]
            for name, rows in branch_lists.items()
        }
        merged = [_with_semantic_id(item, codes) for item in self.merge_fn(branch_lists, k)]
        # Which serving version answered: the model version alone does not change when a
        # refresh only recomputes the prefix KV.
        decoding = {**decoding, "serving_version": bundle.key, "kv_version": bundle.kv_version}
        return RecommendationMessage(
            request_id=request.event.event_id,  # at-least-once: consumers dedupe on it
            user_id=request.user_id,
            event_id=request.event.event_id,
            covered_event_ids=[e.event_id for e in request.covered],
            items=merged,
            branches=branches,
            model_version=_text(bundle.model_version),
            semantic_id_version=_text(bundle.semantic_id_version),
            decoding=decoding,
            latency_ms=(time.monotonic() - request.received_at) * 1000.0,
        )


def _generative_codes(rows: Sequence[tuple[str, float]], bundle) -> dict[str, list[int]]:
    """Semantic ID (codes per level) of each generative item, from the model's own mapping."""
    if not rows or bundle.decoder is None:
        return {}
    item_tokens = bundle.decoder.item_tokens
    tokens = [item_tokens.tokens_of(item_id) for item_id, _score in rows]
    return dict(zip((i for i, _ in rows), item_tokens.layout.decode(tokens), strict=True))


def merge_branches(
    lists: Mapping[str, Sequence[tuple[str, float]]], k: int, recall
) -> list[ScoredItem]:
    """The merged list (``genrec.online.merge`` with ``recall.merge_*``), each item credited
    to the branch that ranked it best."""
    return [ScoredItem(**row) for row in merged_rows(lists, k, recall)]


def merged_rows(
    lists: Mapping[str, Sequence[tuple[str, float]]], k: int, recall
) -> list[dict[str, Any]]:
    """``merge_branches`` as the fields of each item (the message validates them once)."""
    merged = merge_lists(
        lists, k, recall.merge_method, recall.merge_weights, recall.merge_quotas or None,
        recall.merge_rrf_k,
    )  # fmt: skip
    best: dict[str, tuple[int, str]] = {}
    for name, rows in lists.items():
        for rank, (item_id, _score) in enumerate(rows):
            if rank < best.get(item_id, (rank + 1, ""))[0]:
                best[item_id] = (rank, name)
    return [
        _scored(item_id, score, rank, branch=best[item_id][1])
        for rank, (item_id, score) in enumerate(merged)
    ]


def _scored(item_id: str, score: float, rank: int, **fields: Any) -> dict[str, Any]:
    """The fields of a ``ScoredItem``: the message validates its ~50 items at once in
    pydantic-core, 3x faster than building them one by one with ``model_construct``
    (97 vs 290 us a message here), and a score that is not finite fails there."""
    return {"item_id": item_id, "score": float(score), "rank": rank, **fields}


def _with_semantic_id(item: ScoredItem | dict[str, Any], codes: Mapping[str, list[int]]):
    """A merged generative item with its semantic ID (others as they are)."""
    if isinstance(item, ScoredItem):
        if item.branch == GENERATIVE and item.item_id in codes:
            return item.model_copy(update={"semantic_id": codes[item.item_id]})
        return item
    if item.get("branch") == GENERATIVE and item["item_id"] in codes:
        return {**item, "semantic_id": codes[item["item_id"]]}
    return item


def _extend_refresh_prefix(gen, history, cutoff_row: int, prefix_kv, decoder, limit: int) -> bool:
    """Prompt ``gen`` as the refresh's cached prefix + every known item after its cutoff
    (store row ``cutoff_row``), if that holds at most ``limit`` items (else leave ``gen``
    and say False)."""
    item_tokens = decoder.item_tokens
    before, suffix = 0, []
    for item_id, row in zip(history.item_ids, history.rows, strict=True):
        if item_id not in item_tokens.index:
            continue  # new items wait for the next refresh, here as at the refresh
        if row is None or row > cutoff_row:
            suffix.append(item_id)
        else:
            before += 1
    # The cached prompt was built by history_prompt at the refresh, from the last H of the
    # items before the cutoff: the suffix is laid out by the same builder, so prefix +
    # suffix is the prompt of those items and every newer one.
    prefix_items = min(before, decoder.history_items)
    if prefix_items + len(suffix) > limit:
        return False
    gen.prefix_kv = prefix_kv
    gen.suffix_tokens = history_tokens(suffix, item_tokens, len(suffix)) if suffix else []
    gen.prompt_items = prefix_items + len(suffix)
    return True


def _items_after(history, event_id: str | None, item_tokens, most: int) -> int | None:
    """How many known items ``history`` has after the event ``event_id``, walking back from
    its end: ``most + 1`` as soon as there are more than ``most`` (the walk stops there),
    None when the event is not in ``history``."""
    if event_id is None:
        return None
    count, index = 0, item_tokens.index
    for i in range(len(history.event_ids) - 1, -1, -1):
        if count > most:
            return count
        if history.event_ids[i] == event_id:
            return count
        if history.item_ids[i] in index:
            count += 1
    return None


def _observe_decoding(stats: Mapping[str, Any]) -> None:
    if stats.get("target_calls") is not None:
        metrics.TARGET_CALLS.observe(stats["target_calls"])
    if stats.get("acceptance_rate") is not None:
        metrics.ACCEPTANCE_RATE.observe(stats["acceptance_rate"])
    if stats.get("fallback") == "target_only":
        metrics.FALLBACKS.labels(reason="target_only").inc()


def _text(value: Any) -> str | None:
    return None if value is None else str(value)


# --- the production decoder ------------------------------------------------------------------


class ModelDecoder:
    """``GenerativeDecoder`` over an active model version (``GenerativeModels``).

    Users with a prefix KV are decoded as one ``PrefixBatch``: the target prefills
    only the suffix onto the cached prefix, and so does the draft onto its own
    prefix KV of the same prompt (computed on the user's first request, then kept
    with the target's in the LRU); the others from their full prompts. ``online.mode``: ``strict`` or
    ``relaxed`` speculative beam search with the aligned draft, ``target``, or ``auto``
    (the faster of the two lossless ones, strict and target, timed on live batches:
    ``genrec.online.auto_mode``). An ``AcceptanceMonitor`` switches to target-only while
    the draft's acceptance rate is below ``online.min_acceptance_rate``.
    """

    def __init__(self, models, settings: OnlineSettings) -> None:
        # torch and the decoding engine load here, not at import: a worker without a
        # generative model (and every test with a fake decoder) never loads them.
        import torch

        from genrec.online.decoding.engine import AcceptanceMonitor
        from genrec.online.decoding.trie import ItemTrie

        self.models, self.settings = models, settings
        self.item_tokens = models.item_tokens
        self.history_items = models.history_items
        self.layout = models.layout
        self.device = torch.device(getattr(models, "device", "cpu"))
        self.trie = getattr(models, "tree", None)  # GenerativeModels already holds its trie
        if not isinstance(self.trie, ItemTrie):
            table = torch.as_tensor(self.item_tokens.table, device=self.device)
            self.trie = ItemTrie(table, self.layout)
        self.draft_name = _pick_draft(models, settings)
        self.draft = None if self.draft_name is None else models.drafts[self.draft_name]
        log.info("decoding: online.mode %s, draft %s", settings.mode, self.draft_name)
        # Relaxed acceptance samples on the CPU (a few hundred draws per step), so the
        # generator is a CPU one on every device.
        self.generator = torch.Generator().manual_seed(settings.seed)
        self.monitor = AcceptanceMonitor(threshold=settings.min_acceptance_rate)
        self.auto = None
        if settings.mode == "auto" and self.draft is not None:
            self.auto = AutoMode(settings.auto_mode_batches, settings.auto_mode_recheck_batches)

    def describe(self) -> dict[str, Any]:
        """For /healthz: the configured mode, the draft, and what ``auto`` is serving."""
        described: dict[str, Any] = {"mode": self.settings.mode, "draft": self.draft_name}
        if self.draft is None:
            described["serving"] = "target"
        elif self.auto is None:
            described["serving"] = self.settings.mode
        else:
            described["serving"] = self.auto.choice or "timing"
            described["ms_per_request"] = self.auto.summary()
        return described

    def _next_mode(self) -> str:
        """The mode the next batch decodes in (``auto``: as chosen so far)."""
        if self.draft is None:
            return "target"
        return self.auto.next_mode() if self.auto is not None else self.settings.mode

    def decode(self, requests: Sequence[GenerativeRequest], beam_width: int) -> GenerativeBatch:
        """Top ``beam_width`` items of every request, in ONE engine call for the batch.

        Under ``torch.inference_mode``: no tensor of a serving decode ever needs autograd,
        and skipping its version counters and view tracking takes ~9% off a small model's
        decode on a CPU (6.5 -> 5.9 ms for one user, 13.2 -> 12.3 ms for eight).
        """
        import torch  # loaded in __init__ already

        with torch.inference_mode():
            return self._decode(requests, beam_width)

    def _decode(self, requests: Sequence[GenerativeRequest], beam_width: int) -> GenerativeBatch:
        mode, started = self._next_mode(), time.perf_counter()
        items: list[list[tuple[int, float]]] = [[] for _ in requests]
        stats: list[dict[str, Any]] = [{} for _ in requests]
        prompt_kvs: list[Any] = [None] * len(requests)
        for rows, target_prompts in self._engine_prompts(requests):
            exclude = _excluded([requests[i] for i in rows])
            draft_prompts = self._draft_prompts(target_prompts, mode)
            result = self._search(target_prompts, draft_prompts, beam_width, exclude, mode)
            self._collect(result, rows, requests, beam_width, items, stats, mode)
            self._keep_prompt_kvs(result, rows, prompt_kvs)
        if self.auto is not None and requests:
            # _collect read every result back to the host, so the device work is done
            self.auto.record(mode, time.perf_counter() - started, len(requests))
        metrics.DECODE_BATCHES.labels(mode=mode).inc()
        return GenerativeBatch(items, stats, prompt_kvs if self.settings.reuse_prompt_kv else None)

    def _engine_prompts(self, requests: Sequence[GenerativeRequest]) -> list[tuple[list[int], Any]]:
        """Per engine call: (the requests' rows in the engine's order, the target's prompts).

        Users with a prefix KV form a ``PrefixBatch`` (the suffix is all the target
        prefills), in order of suffix length so that the engine prefills long and short
        ones in separate calls (``slot_cache.pending_chunks``) instead of padding all to
        the longest. Users without one join it as EMPTY prefixes (BOS alone, no cached
        token; the rest of the prompt is their suffix), after the others, by prompt
        length: the same tokens at the same positions as decoding their prompts alone, in
        the same call. Decoded apart, a batch that mixes both paid a second decode's
        fixed work (a few ms on a CPU, whatever its size), which at low load, batches of
        one to three users, is most of a request's time. But one call pads every user's
        pending tokens to the longest and every prompt to the longest prefix, and each
        beam step attends over that width: joined only while the keys that adds stay
        under ``JOIN_MAX_EXTRA_KEYS`` (``_join_pays``), else two calls as before.
        """
        # loads torch, as in __init__
        from genrec.online.decoding.prefix_kv import PrefixBatch, PrefixKV, empty_kv

        with_prefix = sorted(
            (i for i, r in enumerate(requests) if r.prefix_kv is not None),
            key=lambda i: len(requests[i].suffix_tokens),
        )
        without = sorted(
            (i for i, r in enumerate(requests) if r.prefix_kv is None),
            key=lambda i: len(requests[i].full_prompt),
        )
        if not with_prefix:
            return [(without, [requests[i].full_prompt for i in without])] if without else []
        batches = []
        if without and not _join_pays([requests[i] for i in with_prefix],
                                      [requests[i] for i in without]):  # fmt: skip
            batches.append((without, [requests[i].full_prompt for i in without]))
            without = []
        version = requests[with_prefix[0]].prefix_kv.model_version
        keys, values = empty_kv(self.models.target) if without else ([], [])
        prefixes = [requests[i].prefix_kv for i in with_prefix] + [
            PrefixKV(requests[i].full_prompt[:1], keys, values, version) for i in without
        ]
        suffixes = [list(requests[i].suffix_tokens) for i in with_prefix] + [
            requests[i].full_prompt[1:] for i in without
        ]
        return [(with_prefix + without, PrefixBatch(prefixes, suffixes)), *batches]

    def _keep_prompt_kvs(self, result, rows: list[int], prompt_kvs: list[Any]) -> None:
        """The decoded prompts' KVs into ``prompt_kvs`` (at ``rows``), the draft's as the
        companion ``_draft_prompts`` looks for, under this model version."""
        if result.prompt_kv is None:
            return
        version, key = str(getattr(self.models, "version", "")), f"draft:{self.draft_name}"
        drafts = result.draft_prompt_kv or [None] * len(rows)
        for i, kept, draft_kv in zip(rows, result.prompt_kv, drafts, strict=True):
            kept.model_version = version
            if draft_kv is not None:
                draft_kv.model_version = f"{version}/{key}"
                kept.companions[key] = draft_kv
            prompt_kvs[i] = kept

    def _draft_prompts(self, target_prompts, mode: str):
        """The draft's view of the target's prompts: plain prompts as they are; for a
        ``PrefixBatch``, its own prefix KV of the same cached prompts.

        The draft must read exactly the target's tokens (cached prompt + suffix; both
        trees' positions must agree), which can be longer than ``full_prompt``. Its prefix
        KV is computed on a user's first request and kept with the target's (``companions``,
        so it shares the LRU entry): later requests prefill only the suffix in both models.
        """
        # loads torch, as in __init__
        from genrec.online.decoding.prefix_kv import PrefixBatch, compute_prefix_kv

        if not isinstance(target_prompts, PrefixBatch):
            return target_prompts
        pairs = list(zip(target_prompts.prefixes, target_prompts.suffixes, strict=True))
        if mode == "target" or not self.monitor.use_speculative():
            return [prefix.prompt_ids + list(suffix) for prefix, suffix in pairs]
        key = f"draft:{self.draft_name}"
        missing = list({id(p): p for p, _ in pairs if key not in p.companions}.values())
        if missing:
            version = f"{missing[0].model_version}/{key}"
            computed = compute_prefix_kv(self.draft, [p.prompt_ids for p in missing], version)
            for prefix_kv, draft_kv in zip(missing, computed, strict=True):
                prefix_kv.companions[key] = draft_kv
        return PrefixBatch([p.companions[key] for p, _ in pairs], [list(s) for _, s in pairs])

    def _search(self, target_prompts, draft_prompts, beam_width: int, exclude, mode: str):
        """Top ``beam_width`` items per user, its seen items (``exclude``) masked in the search."""
        if mode == "target":
            # loads torch, as in __init__
            from genrec.online.decoding.engine import batched_beam_search

            return batched_beam_search(
                self.models.target, target_prompts, self.trie, self.layout, beam_width,
                exclude=exclude, keep_prompt_kv=self.settings.reuse_prompt_kv,
            )  # fmt: skip
        # loads torch, as in __init__
        from genrec.online.decoding.engine import batched_speculative_beam_search

        if target_prompts is not draft_prompts:
            target_prompts = (target_prompts, draft_prompts)
        return batched_speculative_beam_search(
            self.models.target, self.draft, target_prompts, self.trie, self.layout,
            k=beam_width, n_draft=max(self.settings.draft_beams, beam_width),
            gamma=self.settings.gamma, mode=mode, generator=self.generator,
            monitor=self.monitor, exclude=exclude, keep_prompt_kv=self.settings.reuse_prompt_kv,
        )  # fmt: skip

    def _collect(self, result, rows, requests, beam_width, items, stats, mode: str) -> None:
        for position, i in enumerate(rows):
            seen = set(requests[i].exclude)
            found = zip(
                result.item_index[position].tolist(), result.scores[position].tolist(), strict=True
            )
            items[i] = [(row, score) for row, score in found if row >= 0 and row not in seen]
            decode_stats = result.stats[position] if result.stats else None
            stats[i] = self._stats(decode_stats, beam_width, mode)

    def _stats(self, decode_stats, beam_width: int, mode: str) -> dict[str, Any]:
        speculative = bool(getattr(decode_stats, "speculative", False))
        stats: dict[str, Any] = {
            "mode": mode if speculative else "target",
            "beam_width": beam_width,
        }
        if mode != "target" and not speculative:
            stats["fallback"] = "target_only"
        if self.auto is not None:
            stats["auto_mode"] = "settled" if self.auto.settled else "timing"
        if decode_stats is not None:
            for key in ("target_calls", "draft_calls", "rounds", "drafted_steps", "accepted_steps"):
                stats[key] = int(getattr(decode_stats, key, 0))
            if decode_stats.drafted_steps:
                stats["acceptance_rate"] = decode_stats.accepted_steps / decode_stats.drafted_steps
        return stats


# A decode call's fixed work (set-up, one model call per level, the trie lookups: ~4-6 ms on
# the 2-core CPU with the ``small`` target) costs about what this many more keys, summed over
# the batch's users, cost in every attention of a decode (one user x one key ~0.3 us a beam
# step at 20 beams there): the bound below which a batch is decoded in one call.
JOIN_MAX_EXTRA_KEYS = 4096


def _join_pays(cached: Sequence[GenerativeRequest], uncached: Sequence[GenerativeRequest]) -> bool:
    """Whether users without a prefix KV (``uncached``) should join those with one in one call:
    the keys every beam step adds by padding (the cached users' pending tokens to the longest
    prompt, the uncached users' rows to the longest prefix) stay under ``JOIN_MAX_EXTRA_KEYS``."""
    cached_pending = max(len(r.suffix_tokens) for r in cached) + 1
    uncached_pending = max(len(r.full_prompt) for r in uncached)
    prefix = max(r.prefix_kv.length for r in cached)
    wider = max(0, uncached_pending - cached_pending)
    return len(cached) * wider + len(uncached) * prefix <= JOIN_MAX_EXTRA_KEYS


def _excluded(requests: Sequence[GenerativeRequest]) -> list[list[int]] | None:
    """The search's ``exclude``: None when no request masks anything (seen items allowed),
    so the engine builds no per-user exclusion table."""
    exclude = [request.exclude for request in requests]
    return exclude if any(exclude) else None


def _pick_draft(models, settings: OnlineSettings) -> str | None:
    """The name of the draft variant to decode with (None: target only): ``online.draft``,
    else the version's best for the mode (``GenerativeModels.drafts_for``; auto is strict)."""
    drafts: Mapping[str, Any] = models.drafts
    if settings.mode == "target" or not drafts:
        return None
    if settings.draft is not None:
        if settings.draft not in drafts:
            raise ValueError(f"draft {settings.draft!r} not in this version ({sorted(drafts)})")
        return settings.draft
    return models.drafts_for("relaxed" if settings.mode == "relaxed" else "strict")[0]
