"""A synthetic interaction log with the shape of real traffic (ingest step: a replay source).

``generate`` writes ``events.parquet`` and ``items.parquet`` that ``genrec replay --events
--items`` reads unchanged; ``stream`` sends the same events to Kafka (and the catalog to the
store) chunk by chunk, without a file. Deterministic: the same seed and sizes give
byte-identical files, whatever the row-group size (it only changes how rows are grouped).

The shape:

- **items** have a category (about sqrt(items) categories, sizes log-normal), a brand (a pool
  of 8 brands per category), a price, and template text: ``title`` = "<brand> <adjective>
  <category> <model number>", ``genres`` = the category's name. ``text=False`` leaves title
  and genres out, and category and brand become opaque codes (``cat17``, ``brand203``).
- **popularity** is Zipf-like: item weight = 1 / rank ** ``item_zipf`` over a random ranking.
- **user activity** is heavy-tailed: each user's share of sessions is Pareto
  (``user_activity_shape``; 1.5: the top 10% of users make 42-48% of the events), capped at
  100x the least active user and so that nobody expects more events than half the catalog.
- **sessions**: a user's events come in sessions (geometric length, mean ``session_length``,
  ``gap_s`` apart on average), each about one of the user's ``interests_per_user`` latent
  interests (categories, drawn by category popularity); within it items follow popularity.
  ``explore_rate`` of the events ignore the interest (global popularity).
- **drift**: each user's interests are a window over a longer list that moves
  ``interest_drifts`` times over the timeline (at user-specific moments), so interests change.
- **re-consumption**: ``reconsume_rate`` of the events repeat an item the user already had
  (one of their last 8 events before this block of sessions, or one earlier in the session; a
  user's very first event cannot). No other event does: a draw the user already had is drawn
  again (twice by popularity, then three times uniformly in the interest, then by global
  popularity), and an event still without a new item after 8 tries is dropped (more sessions
  make up the count), so with ``reconsume_rate=0`` every (user, item) pair occurs once, as in
  MovieLens; popular items saturate as they do there.
- **time**: sessions start uniformly over ``days`` from 2024-01-01; files are in time order.

Events: ``event_id`` ("syn-<tag>-<n>", tag: a hash of the parameters, so two workloads never
share ids in one store), ``user_id``, ``item_id`` (integers from 1), ``event_type`` (view 75%,
click 15%, cart 7%, purchase 3%), ``timestamp`` (epoch ms: replay's column name), ``value``
(the price for cart and purchase, else null).

Cost: memory O(users + items + chunk), plus 2 bytes per event: per user a Pareto weight, a
drift phase, the interest list and a ring of the last 8 items (~110 bytes); per item a weight,
category, brand, price and sampling tables (~60 bytes); one block of sessions and one row
group of events (500k rows by default); and a bit table of the (user, item) pairs drawn, 16
slots per event (at most 512 MB), so that an item comes back only through re-consumption.
It never holds the event log: 20M events x 1M users x 1M items peaked at 0.6 GB
(docs/synthetic.md). Time: O(items) for the catalog, O(events * log(items)) for the events
(binary searches; a draw taken already is tried again), plus a fixed cost per block of
``block_sessions`` sessions (users / 8, between 256 and 32,768).

Example::

    >>> from genrec.ingest.synthetic import SyntheticConfig, event_batches, generate
    >>> config = SyntheticConfig(users=100, items=500, events=2_000, seed=7)
    >>> events = next(event_batches(config))
    >>> events.num_rows, events.column_names
    (2000, ['event_id', 'user_id', 'item_id', 'event_type', 'timestamp', 'value'])
    >>> generate(config, "var/synthetic").event_count  # doctest: +SKIP
    2000

    $ genrec synthetic --users 1000000 --items 1000000 --events 20000000 --out var/synthetic
    $ genrec replay --events var/synthetic/events.parquet --items var/synthetic/items.parquet
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

START_MS = 1_704_067_200_000  # 2024-01-01T00:00:00Z
MS_PER_DAY = 86_400_000
MAX_SESSION = 50  # events
RING = 8  # recent items per user that re-consumption draws from
ACTIVITY_CAP = 100.0  # the busiest user is at most 100x as active as the least
# Tries for an item the user has not had: by popularity in the session's interest, then
# uniformly in it (its tail), then by global popularity; then the event is dropped.
DRAWS_BY_POPULARITY = 2
DRAWS_IN_INTEREST = 5
DRAWS = 8
BRANDS_PER_CATEGORY = 8
EVENT_TYPE_NAMES = ("view", "click", "cart", "purchase")
EVENT_TYPE_SHARES = (0.75, 0.15, 0.07, 0.03)
PRICED_TYPES = (2, 3)  # cart, purchase: value = price

_NOUNS = (
    "shoes", "jacket", "headphones", "lamp", "backpack", "kettle", "watch", "chair",
    "sofa", "camera", "speaker", "blender", "tent", "bicycle", "keyboard", "monitor",
    "mug", "notebook", "pen", "sunglasses", "scarf", "gloves", "boots", "shirt",
    "jeans", "dress", "towel", "pillow", "blanket", "rug", "vase", "clock", "drill",
    "hammer", "ladder", "grill", "cooler", "bottle", "phone case", "charger", "router",
    "printer", "tablet", "desk", "shelf", "mattress", "stroller", "puzzle", "board game",
    "guitar", "yoga mat", "dumbbells", "helmet", "wallet", "belt", "perfume", "shampoo",
    "toothbrush", "frying pan", "knife set",
)  # fmt: skip
_MODIFIERS = (
    "trail", "office", "kids", "travel", "kitchen", "garden", "outdoor", "gaming",
    "studio", "winter", "summer", "vintage", "smart", "wireless", "leather", "wooden",
    "marine", "urban", "camping", "running", "home", "pro", "mini", "family", "pet",
    "baby", "party", "bath", "car", "school", "retro", "eco", "luxury", "sport",
    "classic", "folding", "portable", "ceramic", "steel", "cotton",
)  # fmt: skip
_ADJECTIVES = (
    "lightweight", "compact", "durable", "premium", "essential", "modern", "soft",
    "sleek", "rugged", "elegant", "quiet", "fast", "bright", "slim", "heavy-duty",
    "ergonomic", "waterproof", "breathable", "adjustable", "handmade", "minimal", "bold",
    "cozy", "silent", "versatile", "refined", "everyday", "signature", "ultra", "deluxe",
)  # fmt: skip
_SYLLABLES = (
    "ka", "lo", "mi", "ra", "ven", "tor", "zu", "bel", "nor", "qui", "sa", "dex", "fin",
    "gal", "hy", "jo", "lux", "mo", "nex", "pra", "ri", "sol", "tek", "ul", "vi", "wex",
    "xa", "yo", "zen", "cor",
)  # fmt: skip


@dataclass(frozen=True)
class SyntheticConfig:
    """Sizes, seed and shape of a synthetic workload (see the module docstring)."""

    users: int
    items: int
    events: int
    seed: int = 0
    text: bool = True
    reconsume_rate: float = 0.05
    days: float = 90.0
    interests_per_user: int = 3
    interest_drifts: float = 2.0
    item_zipf: float = 1.0
    user_activity_shape: float = 1.5
    session_length: float = 4.0
    gap_s: float = 60.0
    explore_rate: float = 0.1
    row_group_size: int = 500_000  # layout only: the rows do not depend on it

    def __post_init__(self) -> None:
        for name in ("users", "items", "events", "interests_per_user", "row_group_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        for name in ("reconsume_rate", "explore_rate"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        for name in ("days", "item_zipf", "user_activity_shape", "gap_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.interest_drifts < 0:
            raise ValueError(f"interest_drifts must be >= 0, got {self.interest_drifts}")
        if self.session_length < 1:
            raise ValueError(f"session_length must be >= 1, got {self.session_length}")

    @property
    def tag(self) -> str:
        """8 hex digits naming the rows (everything but the row-group size)."""
        fields = asdict(self)
        fields.pop("row_group_size")
        text = ",".join(f"{key}={fields[key]!r}" for key in sorted(fields))
        return hashlib.sha256(text.encode()).hexdigest()[:8]

    @property
    def block_sessions(self) -> int:
        """Sessions generated at a time: small enough that a user rarely has two in one block
        (re-consumption sees only earlier blocks and the session itself)."""
        return int(min(max(self.users // 8, 256), 32_768))


def _rng(config: SyntheticConfig, stream: int, block: int = 0) -> np.random.Generator:
    return np.random.default_rng([config.seed, stream, block])


# --- the catalog --------------------------------------------------------------------


class Catalog:
    """Per-item attributes and the tables that sample items by popularity (O(items))."""

    def __init__(self, config: SyntheticConfig) -> None:
        rng = _rng(config, 0)
        n = config.items
        self.n_categories = max(1, min(n, round(math.sqrt(n))))
        self.weight = (rng.permutation(n) + 1.0) ** -config.item_zipf
        sizes = rng.lognormal(0.0, 0.75, self.n_categories)
        self.category = np.minimum(
            np.searchsorted(np.cumsum(sizes) / sizes.sum(), rng.random(n), side="right"),
            self.n_categories - 1,
        ).astype(np.int32)
        self.n_brands = max(1, n // 25)
        pool = rng.integers(self.n_brands, size=self.n_categories)
        step = np.floor(BRANDS_PER_CATEGORY * rng.random(n) ** 2).astype(np.int64)
        self.brand = ((pool[self.category] + step) % self.n_brands).astype(np.int32)
        base = np.exp(rng.normal(3.5, 1.0, self.n_categories))
        self.price = np.round(base[self.category] * np.exp(rng.normal(0.0, 0.3, n)), 2)
        self.adjective = rng.integers(len(_ADJECTIVES), size=n).astype(np.int16)
        self.model = rng.integers(26 * 990, size=n).astype(np.int32)
        self.category_perm = rng.permutation(len(_NOUNS) * len(_MODIFIERS))
        self.brand_perm = rng.permutation(len(_SYLLABLES) ** _brand_syllables(self.n_brands))
        # Items grouped by category, with cumulative weights: one binary search samples an
        # item of a category (or of the whole catalog) with probability proportional to weight.
        self.order = np.argsort(self.category, kind="stable").astype(np.int64)
        self.cumulative = np.cumsum(self.weight[self.order])
        sorted_category = self.category[self.order]
        categories = np.arange(self.n_categories)
        self.start = np.searchsorted(sorted_category, categories, side="left")
        self.stop = np.searchsorted(sorted_category, categories, side="right")
        below = np.where(self.start > 0, self.cumulative[np.maximum(self.start - 1, 0)], 0.0)
        self.below = below
        self.mass = np.where(
            self.stop > self.start, self.cumulative[np.maximum(self.stop - 1, 0)] - below, 0.0
        )

    def sample_in(self, categories: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """One item index per entry of ``categories`` (non-empty ones), by popularity."""
        u = self.below[categories] + rng.random(len(categories)) * self.mass[categories]
        at = np.searchsorted(self.cumulative, u, side="right")
        at = np.clip(at, self.start[categories], self.stop[categories] - 1)
        return self.order[at]

    def sample_uniform_in(self, categories: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """One item index per entry of ``categories``, uniformly within the category."""
        size = self.stop[categories] - self.start[categories]
        at = self.start[categories] + np.floor(rng.random(len(categories)) * size).astype(np.int64)
        return self.order[np.minimum(at, self.stop[categories] - 1)]

    def sample_any(self, count: int, rng: np.random.Generator) -> np.ndarray:
        u = rng.random(count) * self.cumulative[-1]
        at = np.minimum(np.searchsorted(self.cumulative, u, side="right"), len(self.order) - 1)
        return self.order[at]

    def category_names(self, text: bool) -> pa.Array:
        names = []
        for k in range(self.n_categories):
            if not text:
                names.append(f"cat{k}")
                continue
            combo = int(self.category_perm[k % len(self.category_perm)])
            modifier, noun = divmod(combo, len(_NOUNS))
            series = k // len(self.category_perm)
            suffix = f" {series + 1}" if series else ""
            names.append(f"{_MODIFIERS[modifier]} {_NOUNS[noun]}{suffix}")
        return pa.array(names, type=pa.string())

    def brand_names(self, text: bool) -> pa.Array:
        if not text:
            return pa.array([f"brand{k}" for k in range(self.n_brands)], type=pa.string())
        width = _brand_syllables(self.n_brands)
        names = []
        for k in range(self.n_brands):
            code = int(self.brand_perm[k])
            parts = []
            for _ in range(width):
                code, digit = divmod(code, len(_SYLLABLES))
                parts.append(_SYLLABLES[digit])
            names.append("".join(parts).capitalize())
        return pa.array(names, type=pa.string())


def _brand_syllables(n_brands: int) -> int:
    width = 2
    while len(_SYLLABLES) ** width < n_brands:
        width += 1
    return width


def item_batches(config: SyntheticConfig, catalog: Catalog | None = None) -> Iterator[pa.Table]:
    """The catalog in tables of ``row_group_size`` rows: item_id, [title, genres,] category,
    brand, price."""
    catalog = catalog or Catalog(config)
    categories = catalog.category_names(config.text)
    brands = catalog.brand_names(config.text)
    adjectives = pa.array(_ADJECTIVES, type=pa.string())
    for lo in range(0, config.items, config.row_group_size):
        hi = min(lo + config.row_group_size, config.items)
        columns: dict[str, pa.Array] = {"item_id": pa.array(np.arange(lo, hi, dtype=np.int64) + 1)}
        category = categories.take(pa.array(catalog.category[lo:hi]))
        brand = brands.take(pa.array(catalog.brand[lo:hi]))
        if config.text:
            letter, number = np.divmod(catalog.model[lo:hi], 990)
            model = pc.binary_join_element_wise(
                pa.array(np.array(list("ABCDEFGHJKLMNPQRSTUVWXYZ23"))[letter]),
                pc.cast(pa.array(number + 10), pa.string()),
                "",
            )
            columns["title"] = pc.binary_join_element_wise(
                brand, adjectives.take(pa.array(catalog.adjective[lo:hi])), category, model, " "
            )
            columns["genres"] = category
        columns["category"] = category
        columns["brand"] = brand
        columns["price"] = pa.array(catalog.price[lo:hi])
        yield pa.table(columns)


# --- the events ---------------------------------------------------------------------


class _Users:
    """Per-user state (O(users)): activity, drift phase, interests, recent items."""

    def __init__(self, config: SyntheticConfig, catalog: Catalog) -> None:
        rng = _rng(config, 1)
        n = config.users
        activity = (1.0 - rng.random(n)) ** (-1.0 / config.user_activity_shape)  # Pareto, min 1
        activity = np.minimum(activity, _activity_cap(activity, config))
        self.cumulative = np.cumsum(activity)
        self.phase = rng.random(n).astype(np.float32)
        self.slots = config.interests_per_user + math.ceil(config.interest_drifts)
        appeal = catalog.mass**0.7  # niche categories still find their fans
        cumulative = np.cumsum(appeal)
        drawn = rng.random((n, self.slots)) * cumulative[-1]
        self.interests = np.minimum(
            np.searchsorted(cumulative, drawn, side="right"), catalog.n_categories - 1
        ).astype(np.int32)
        self.ring = np.zeros((n, RING), dtype=np.int64)
        self.seen = np.zeros(n, dtype=np.int64)  # events so far (ring slots filled: min(seen, 8))

    def pick(self, count: int, rng: np.random.Generator) -> np.ndarray:
        u = rng.random(count) * self.cumulative[-1]
        return np.minimum(np.searchsorted(self.cumulative, u, side="right"), len(self.phase) - 1)

    def remember(self, users: np.ndarray, items: np.ndarray) -> None:
        """Push events (in time order) into each user's ring of recent items."""
        if not len(users):
            return
        order = np.argsort(users, kind="stable")
        users, items = users[order], items[order]
        first = np.flatnonzero(np.r_[True, users[1:] != users[:-1]])
        sizes = np.diff(np.r_[first, len(users)])
        rank = np.arange(len(users)) - np.repeat(first, sizes)
        keep = rank >= np.repeat(sizes, sizes) - RING  # the last 8 of each user
        users, items, rank = users[keep], items[keep], rank[keep]
        self.ring[users, (self.seen[users] + rank) % RING] = items
        self.seen[users[np.r_[users[1:] != users[:-1], True]]] += sizes


def _activity_cap(activity: np.ndarray, config: SyntheticConfig) -> float:
    """``ACTIVITY_CAP``, lowered until no user expects more than half the catalog in events
    (a user cannot have more distinct items than there are)."""

    def busiest(cap: float) -> float:
        capped = np.minimum(activity, cap)
        return config.events * cap / capped.sum()

    if busiest(ACTIVITY_CAP) <= config.items / 2:
        return ACTIVITY_CAP
    lo, hi = 1.0, ACTIVITY_CAP
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if busiest(mid) <= config.items / 2 else (lo, mid)
    return lo


class _SeenPairs:
    """Which (user, item) pairs were drawn: one bit per slot of a hash table about 16 slots
    per event (at most 512 MB). A false hit only makes a draw try again; a pair drawn is
    always found, so an item the user had is never drawn again by chance."""

    def __init__(self, events: int) -> None:
        self.bits = int(min(max(1 << 20, 1 << math.ceil(math.log2(16 * events))), 1 << 32))
        self.shift = np.uint64(64 - int(math.log2(self.bits)))
        self.table = np.zeros(self.bits // 8, dtype=np.uint8)

    def _slots(self, pairs: np.ndarray) -> np.ndarray:
        return (pairs.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) >> self.shift

    def contains(self, pairs: np.ndarray) -> np.ndarray:
        slots = self._slots(pairs)
        return ((self.table[slots >> np.uint64(3)] >> (slots & np.uint64(7))) & 1).astype(bool)

    def add(self, pairs: np.ndarray) -> None:
        slots = self._slots(pairs)
        bits = np.left_shift(1, slots & np.uint64(7)).astype(np.uint8)
        np.bitwise_or.at(self.table, slots >> np.uint64(3), bits)


_COLUMNS = ("ts", "session", "position", "user", "item", "kind")


def _block_span(config: SyntheticConfig) -> float:
    """Milliseconds of timeline per block: sessions enough for ``events`` over ``days``."""
    sessions = config.events / config.session_length
    return config.days * MS_PER_DAY * config.block_sessions / sessions


def _block(
    config: SyntheticConfig, catalog: Catalog, users: _Users, seen: _SeenPairs, block: int
) -> dict[str, np.ndarray]:
    """The events of one block of sessions (unsorted columns; ``ts`` in ms from START_MS)."""
    rng = _rng(config, 2, block)
    sessions = config.block_sessions
    horizon = config.days * MS_PER_DAY
    span = _block_span(config)
    starts = (block + np.sort(rng.random(sessions))) * span
    who = users.pick(sessions, rng)
    lengths = np.minimum(rng.geometric(1.0 / config.session_length, sessions), MAX_SESSION)
    drift = np.floor(
        np.clip(starts / horizon, 0.0, 1.0) * config.interest_drifts + users.phase[who]
    )
    window = np.minimum(drift.astype(np.int64), math.ceil(config.interest_drifts))
    slot = window + rng.integers(config.interests_per_user, size=sessions)
    interest = users.interests[who, slot]

    count = int(lengths.sum())
    session = np.repeat(np.arange(sessions), lengths)
    first = np.repeat(np.cumsum(lengths) - lengths, lengths)  # per event: its session's first
    position = np.arange(count) - first
    gaps = rng.exponential(config.gap_s * 1000.0, count)
    gaps[position == 0] = 0.0
    elapsed = np.cumsum(gaps)
    ts = np.floor(starts[session] + elapsed - elapsed[first]).astype(np.int64)
    user = who[session]

    in_ring = np.minimum(users.seen[user], RING)
    repeat = (rng.random(count) < config.reconsume_rate) & (in_ring + position > 0)
    explore = rng.random(count) < config.explore_rate
    item = np.full(count, -1, dtype=np.int64)
    _draw_new(config, catalog, seen, rng, item, user, interest[session], explore, ~repeat)
    if repeat.any():
        _reconsume(users, rng, item, user, position, first, in_ring, repeat)
    kind = rng.choice(len(EVENT_TYPE_NAMES), size=count, p=EVENT_TYPE_SHARES).astype(np.int8)
    keep = item >= 0  # events left without an item the user had not had yet are dropped
    return {
        "ts": ts[keep],
        "session": session[keep].astype(np.int64) + block * sessions,
        "position": position[keep].astype(np.int64),
        "user": user[keep].astype(np.int64),
        "item": item[keep],
        "kind": kind[keep],
    }


def _draw_new(config, catalog: Catalog, seen: _SeenPairs, rng, item, user, interest, explore, new):
    """Items the users never had for the events in ``new`` (by popularity in the session's
    interest, or in the catalog when ``explore``): drawn again while taken (in the seen filter,
    or twice in this block), uniformly in the interest after ``DRAWS_BY_POPULARITY`` tries, by
    global popularity after ``DRAWS_IN_INTEREST``; left -1 (dropped) after ``DRAWS``."""
    todo = np.flatnonzero(new)
    for attempt in range(DRAWS):
        if not len(todo):
            break
        wide = explore[todo] if attempt < DRAWS_IN_INTEREST else np.ones(len(todo), dtype=bool)
        narrow = todo[~wide]
        if attempt < DRAWS_BY_POPULARITY:
            item[narrow] = catalog.sample_in(interest[narrow], rng)
        else:
            item[narrow] = catalog.sample_uniform_in(interest[narrow], rng)
        item[todo[wide]] = catalog.sample_any(int(wide.sum()), rng)
        todo = _taken(config, seen, item, user, new, todo)
    item[todo] = -1
    accepted = new & (item >= 0)
    seen.add(user[accepted] * config.items + item[accepted])


def _taken(config, seen: _SeenPairs, item, user, new, todo) -> np.ndarray:
    """The events of ``todo`` whose (user, item) was seen before this block, or is also held
    by another new event of the block (settled ones, then the earliest, keep it)."""
    pair = user * config.items + item
    held = np.flatnonzero(new)
    fresh = np.zeros(len(item), dtype=bool)
    fresh[todo] = True
    order = np.lexsort((held, fresh[held], pair[held]))
    ranked = held[order]
    repeated = np.r_[False, pair[ranked][1:] == pair[ranked][:-1]]
    duplicate = np.zeros(len(item), dtype=bool)
    duplicate[ranked[repeated]] = True
    return todo[duplicate[todo] | seen.contains(pair[todo])]


def _reconsume(users: _Users, rng, item, user, position, first, in_ring, repeat) -> None:
    """Items for the ``repeat`` events: one the user had, uniformly from their ring (events
    before this block) or the events earlier in this session."""
    choice = np.floor(rng.random(len(item)) * (in_ring + position)).astype(np.int64)
    from_ring = repeat & (choice < in_ring)
    item[from_ring] = users.ring[user[from_ring], choice[from_ring]]
    from_session = np.flatnonzero(repeat & ~from_ring)
    source = first[from_session] + choice[from_session] - in_ring[from_session]
    by_position = np.argsort(position[from_session], kind="stable")
    from_session, source = from_session[by_position], source[by_position]
    # An event may repeat one that repeats another: earlier positions are settled first (a
    # repeat of a dropped event, item -1, is dropped too).
    for lo, hi in _runs(position[from_session]):
        item[from_session[lo:hi]] = item[source[lo:hi]]


def _runs(values: np.ndarray) -> Iterator[tuple[int, int]]:
    if not len(values):
        return
    edges = np.flatnonzero(values[1:] != values[:-1]) + 1
    bounds = np.r_[0, edges, len(values)]
    yield from zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True)


def event_batches(config: SyntheticConfig, catalog: Catalog | None = None) -> Iterator[pa.Table]:
    """The events in time order, in tables of ``row_group_size`` rows (the last may be short)."""
    catalog = catalog or Catalog(config)
    users = _Users(config, catalog)
    seen = _SeenPairs(config.events)
    span = _block_span(config)
    carry = {name: np.zeros(0, dtype=np.int64) for name in _COLUMNS}
    pending: list[dict[str, np.ndarray]] = []
    pending_rows = 0
    emitted = 0
    block = 0
    while emitted + pending_rows < config.events:
        fresh = _block(config, catalog, users, seen, block)
        merged = {name: np.concatenate([carry[name], fresh[name]]) for name in _COLUMNS}
        order = np.lexsort((merged["position"], merged["session"], merged["ts"]))
        merged = {name: column[order] for name, column in merged.items()}
        # Sessions that run past the block's end finish in the next one, in time order.
        cut = int(np.searchsorted(merged["ts"], np.floor((block + 1) * span), side="left"))
        cut = min(cut, config.events - emitted - pending_rows)
        ready = {name: column[:cut] for name, column in merged.items()}
        carry = {name: column[cut:] for name, column in merged.items()}
        users.remember(ready["user"], ready["item"])
        pending.append(ready)
        pending_rows += cut
        block += 1
        while pending_rows >= config.row_group_size or (
            pending_rows and emitted + pending_rows == config.events
        ):
            joined = {name: np.concatenate([p[name] for p in pending]) for name in _COLUMNS}
            size = min(config.row_group_size, pending_rows)
            yield _event_table(config, catalog, joined, size, emitted)
            emitted += size
            pending_rows -= size
            pending = [{name: column[size:] for name, column in joined.items()}]


def _event_table(config, catalog: Catalog, columns, size: int, offset: int) -> pa.Table:
    kind = columns["kind"][:size]
    item = columns["item"][:size]
    priced = np.isin(kind, PRICED_TYPES)
    ids = pc.cast(pa.array(np.arange(offset, offset + size, dtype=np.int64)), pa.string())
    return pa.table(
        {
            "event_id": pc.binary_join_element_wise(f"syn-{config.tag}-", ids, ""),
            "user_id": pa.array(columns["user"][:size] + 1),
            "item_id": pa.array(item + 1),
            "event_type": pa.array(EVENT_TYPE_NAMES, type=pa.string()).take(pa.array(kind)),
            "timestamp": pa.array(columns["ts"][:size] + START_MS),
            "value": pa.array(np.where(priced, catalog.price[item], 0.0), mask=~priced),
        }
    )


# --- writing and streaming ------------------------------------------------------------


@dataclass(frozen=True)
class SyntheticFiles:
    events: Path
    items: Path
    event_count: int
    item_count: int


def generate(
    config: SyntheticConfig,
    out_dir: str | Path,
    *,
    on_events: Callable[[int], Any] | None = None,
) -> SyntheticFiles:
    """Write ``out_dir/items.parquet`` and ``out_dir/events.parquet`` (zstd, one row group per
    ``row_group_size`` rows); ``on_events(n)`` is called after each row group of n events."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    catalog = Catalog(config)
    item_count = _write(out / "items.parquet", item_batches(config, catalog))
    event_count = _write(out / "events.parquet", event_batches(config, catalog), on_events)
    return SyntheticFiles(out / "events.parquet", out / "items.parquet", event_count, item_count)


def _write(path: Path, tables: Iterator[pa.Table], on_rows=None) -> int:
    partial = path.with_name(path.name + ".partial")
    rows = 0
    writer = None
    try:
        for table in tables:
            if writer is None:
                writer = pq.ParquetWriter(partial, table.schema, compression="zstd")
            writer.write_table(table, row_group_size=len(table))
            rows += len(table)
            if on_rows is not None:
                on_rows(len(table))
    finally:
        if writer is not None:
            writer.close()
    partial.replace(path)
    return rows


def stream(
    settings,
    config: SyntheticConfig,
    *,
    producer: Any = None,
    load_items: bool = True,
    on_events: Callable[[int], Any] | None = None,
) -> int:
    """Upsert the catalog into the store, then produce the events to ``kafka.topic_events``
    as ``genrec replay`` would (same messages), one row group at a time; returns how many."""
    from genrec.ingest import replay  # lazy: pandas and kafka load only for --kafka

    catalog = Catalog(config)
    if load_items:
        for table in item_batches(config, catalog):
            replay.load_items(settings, replay.item_rows(table.to_pandas()))
    produced = 0
    with replay.EventSender(settings, settings.kafka.topic_events, producer) as sender:
        for table in event_batches(config, catalog):
            prepared = replay.prepare_events(table.to_pandas())
            for key, value in replay.event_messages(prepared):
                sender.send(key, value)
            produced += len(prepared)
            if on_events is not None:
                on_events(len(prepared))
            if sender.failures:
                break
    return produced
