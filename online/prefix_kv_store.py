"""The prefix-KV store: each user's precomputed long-history KV cache, per KV version.

Written by the offline refresh (``genrec.offline.refresh``), read by the online
workers. A KV version is written completely *before* the serving version that
names it is activated, and readers only look up the active version, so a
half-written version is never seen. ``KVStore`` is the interface; the default
backend keeps one safetensors file per user under a version directory and an
index row per user in the database (``prefix_kv_index``). ``online.kv_store =
"redis"`` picks the shared tier of ``genrec.online.prefix_kv_redis`` (the same
safetensors bytes as Redis values, the same index rows). Another backend implements
the protocol and is registered in ``BACKENDS``.

A worker reads a whole batch's caches at once (``load_many``: one database query and
the files for the local backend, one pipelined round trip for Redis); a backend it
cannot reach raises ``KVStoreUnavailable`` and the worker serves those users from
their prompts.

Layout of the local backend::

    kv_dir/v000007/3f/3fa2...e1.safetensors    # sha1(user_id), sharded by 2 hex digits

Example::

    >>> from genrec.infra.database import make_engine
    >>> from genrec.infra.settings import Settings
    >>> settings = Settings(home="/tmp/genrec-kv-doc")
    >>> store = open_kv_store(settings, make_engine("sqlite:///:memory:"))
    >>> store.lookup(1, "user-1") is None
    True
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from sqlalchemy import Engine, delete, func, insert, select

from genrec.schemas.tables import prefix_kv_index

log = logging.getLogger(__name__)

PrefixKV = (
    Any  # genrec.online.decoding.prefix_kv.PrefixKV; kept loose so this module stays torch-free
)


IN_CHUNK = 500  # user ids per IN (...) list: far below every database's parameter limit


@dataclass(frozen=True)
class KVShape:
    """What one cached token costs: per layer a key and a value of ``kv_heads x head_dim``."""

    layers: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, model) -> KVShape:
        """The KV shape of a transformers causal LM (its decoder's text config)."""
        config = model.config.get_text_config(decoder=True)
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        return cls(int(config.num_hidden_layers), int(heads), int(head_dim))

    def tensor_bytes(self, n_tokens: int, itemsize: int) -> int:
        """Bytes of one user's tensors: keys and values of ``n_tokens - 1`` cached tokens,
        plus the ``n_tokens`` prompt ids (int64)."""
        cached = max(n_tokens - 1, 0)
        return 2 * self.layers * self.kv_heads * cached * self.head_dim * itemsize + 8 * n_tokens


# Characters of one safetensors header entry besides its name, dtype and numbers:
# "<name>":{"dtype":"<dtype>","shape":[a,b,c],"data_offsets":[start,end]},
_HEADER_ENTRY = len('"":{"dtype":"","shape":[,,],"data_offsets":[,]},')


def kv_file_nbytes_bound(shape: KVShape, n_tokens: int, itemsize: int, model_version: str) -> int:
    """An upper bound of the ``nbytes`` the local backend records for one user's file.

    The decoder's safetensors file is the tensors (exact, ``KVShape.tensor_bytes``) after
    an 8-byte length and a JSON header padded to 8 bytes; the header is bounded here by
    the widest numbers it can hold. The refresh admits users to a byte budget by this
    bound before computing them (it is at most a few hundred bytes above the file).
    """
    data = shape.tensor_bytes(n_tokens, itemsize)
    digits = len(str(data))  # every offset is at most the data's length
    widest = len(str(max(shape.kv_heads, n_tokens, shape.head_dim)))
    names = [f"keys.{layer}" for layer in range(shape.layers)]
    names += [f"values.{layer}" for layer in range(shape.layers)] + ["prompt_ids"]
    tensors = sum(len(name) + _HEADER_ENTRY + 4 + 3 * widest + 2 * digits for name in names)
    metadata = 128 + len(model_version) + 2 * len(str(n_tokens)) + len(str(shape.layers))
    return 8 + tensors + metadata + 8 + data  # 8: the length; the last 8: padding


@dataclass(frozen=True)
class PrefixKVEntry:
    """Index row of one user's prefix KV in one KV version.

    ``cutoff_*`` name the user's newest stored event the prefix covers: the
    largest ``events.id`` the refresh read for this user, with its ``ts_ms``
    and ``event_id``. Online, the suffix is the user's events with a larger
    ``events.id``. ``path`` is relative to the backend's root; ``nbytes`` is
    filled in by the store when written.
    """

    user_id: str
    kv_version: int
    model_version: str
    cutoff_event_row: int
    cutoff_ts_ms: int
    cutoff_event_id: str
    n_tokens: int
    nbytes: int = 0
    path: str = ""
    prompt_sha1: str | None = None  # hash of the prompt tokens: lets the next refresh reuse it


class KVStoreUnavailable(ConnectionError):
    """The backend cannot be reached now (Redis down or slow); the caller serves without it."""


# What ``load_many`` answers per user found: the entry and its PrefixKV, or why the
# stored cache cannot be used (another model version, a damaged value).
LoadedKV = tuple[PrefixKVEntry, PrefixKV] | Exception


class KVStore(Protocol):
    def put_many(
        self, kv_version: int, entries_and_prefix_kvs: Iterable[tuple[PrefixKVEntry, PrefixKV]]
    ) -> None: ...

    def lookup(self, kv_version: int, user_id: str) -> PrefixKVEntry | None: ...

    def load(self, entry: PrefixKVEntry, expected_model_version: Any) -> PrefixKV: ...

    def lookup_many(self, kv_version: int, user_ids: Sequence[str]) -> dict[str, PrefixKVEntry]:
        """Entries of the users that have one (absent: no cache)."""
        ...

    def load_many(
        self, kv_version: int, user_ids: Sequence[str], expected_model_version: Any
    ) -> dict[str, LoadedKV]:
        """Each found user's ``(entry, PrefixKV)`` or the error that makes it unusable
        (absent: no cache); raises ``KVStoreUnavailable`` when the backend is unreachable."""
        ...

    def sizes(self, kv_version: int) -> dict[str, float]: ...

    def garbage_collect(self, keep_versions: Iterable[int]) -> int: ...


class PrefixKVCodec(Protocol):
    """How a PrefixKV becomes a file and back (the decoder's safetensors format by default)."""

    def save(self, path: Path, prefix_kv: PrefixKV) -> None: ...

    def load(self, path: Path, expected_model_version: Any) -> PrefixKV: ...


class DecoderCodec:
    """``genrec.online.decoding.prefix_kv``'s save/load, imported on first use (torch is heavy)."""

    def save(self, path: Path, prefix_kv: PrefixKV) -> None:
        from genrec.online.decoding.prefix_kv import save_prefix_kv

        save_prefix_kv(path, prefix_kv)

    def load(self, path: Path, expected_model_version: Any) -> PrefixKV:
        from genrec.online.decoding.prefix_kv import load_prefix_kv

        return load_prefix_kv(path, expected_model_version)


def version_dir_name(kv_version: int) -> str:
    return f"v{int(kv_version):06d}"


class IndexedKVStore:
    """The ``prefix_kv_index`` half of a backend: one row per user and version in the
    database, which the refresh reads (reuse, budget, sizes); a backend adds the bytes."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def lookup(self, kv_version: int, user_id: str) -> PrefixKVEntry | None:
        query = select(prefix_kv_index).where(
            prefix_kv_index.c.kv_version == kv_version, prefix_kv_index.c.user_id == user_id
        )
        with self.engine.connect() as connection:
            row = connection.execute(query).mappings().first()
        return _entry(row) if row else None

    def lookup_many(self, kv_version: int, user_ids: Sequence[str]) -> dict[str, PrefixKVEntry]:
        return self.entries(kv_version, user_ids=user_ids)

    def entries(
        self,
        kv_version: int,
        user_range: tuple[str, str] | None = None,
        *,
        user_ids: Sequence[str] | None = None,
    ) -> dict[str, PrefixKVEntry]:
        """Users' entries of one version (the refresh compares them with the next run).

        ``user_range``: only user ids from ``first`` to ``last`` (inclusive, database order);
        ``user_ids``: only these users (read ``IN_CHUNK`` at a time: a page of the refresh
        can hold more users than a statement takes parameters).
        """
        query = select(prefix_kv_index).where(prefix_kv_index.c.kv_version == kv_version)
        user_id = prefix_kv_index.c.user_id
        if user_range is not None:
            first, last = user_range
            query = query.where(user_id >= first, user_id <= last)
        chunks = [None] if user_ids is None else _chunks(list(user_ids), IN_CHUNK)
        found: dict[str, PrefixKVEntry] = {}
        with self.engine.connect() as connection:
            for chunk in chunks:
                part = query if chunk is None else query.where(user_id.in_(chunk))
                found.update(
                    (row["user_id"], _entry(row)) for row in connection.execute(part).mappings()
                )
        return found

    def sizes(self, kv_version: int) -> dict[str, float]:
        """Users, total bytes, mean/max bytes per user and mean tokens of one version."""
        c = prefix_kv_index.c
        query = select(
            func.count(), func.sum(c.nbytes), func.avg(c.nbytes), func.max(c.nbytes),
            func.avg(c.n_tokens),
        ).where(c.kv_version == kv_version)  # fmt: skip
        with self.engine.connect() as connection:
            users, total, mean, largest, tokens = connection.execute(query).one()
        return {
            "users": int(users),
            "total_bytes": int(total or 0),
            "mean_bytes_per_user": float(mean or 0.0),
            "max_bytes_per_user": int(largest or 0),
            "mean_tokens_per_user": float(tokens or 0.0),
        }

    def user_sizes(self, kv_version: int) -> dict[str, int]:
        """Bytes per user of one version."""
        c = prefix_kv_index.c
        query = select(c.user_id, c.nbytes).where(c.kv_version == kv_version)
        with self.engine.connect() as connection:
            return {user_id: int(nbytes) for user_id, nbytes in connection.execute(query)}

    def _index(self, rows: list[dict[str, Any]]) -> None:
        if rows:
            with self.engine.begin() as connection:
                connection.execute(insert(prefix_kv_index), rows)

    def _drop_index_except(self, keep: set[int]) -> set[int]:
        """Delete the index rows of every version not in ``keep``; returns those versions."""
        with self.engine.begin() as connection:
            indexed = {
                int(v)
                for (v,) in connection.execute(select(prefix_kv_index.c.kv_version).distinct())
            }
            connection.execute(
                delete(prefix_kv_index).where(prefix_kv_index.c.kv_version.not_in(keep))
            )
        return indexed - keep

    def _drop_index(self, kv_version: int) -> None:
        with self.engine.begin() as connection:
            connection.execute(
                delete(prefix_kv_index).where(prefix_kv_index.c.kv_version == kv_version)
            )


class LocalDirKVStore(IndexedKVStore):
    """One file per user under ``root/vNNNNNN/``; an index row per user in the database."""

    def __init__(self, root: Path, engine: Engine, codec: PrefixKVCodec | None = None) -> None:
        super().__init__(engine)
        self.root = Path(root)
        self.codec = codec or DecoderCodec()

    def relative_path(self, kv_version: int, user_id: str) -> str:
        digest = hashlib.sha1(user_id.encode("utf-8")).hexdigest()
        return f"{version_dir_name(kv_version)}/{digest[:2]}/{digest}.safetensors"

    def _place(self, kv_version: int, entry: PrefixKVEntry) -> tuple[str, Path]:
        """Where ``entry``'s file goes (relative to the root, and absolute), folder made."""
        _check_version(entry, kv_version)
        relative = self.relative_path(kv_version, entry.user_id)
        target = self.root / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        return relative, target

    def put_many(
        self, kv_version: int, entries_and_prefix_kvs: Iterable[tuple[PrefixKVEntry, PrefixKV]]
    ) -> None:
        """Write each file (temp name, then rename), then index the batch in one transaction."""
        rows = []
        for entry, prefix_kv in entries_and_prefix_kvs:
            relative, target = self._place(kv_version, entry)
            partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
            self.codec.save(partial, prefix_kv)
            os.replace(partial, target)
            rows.append(_row(entry, relative, target.stat().st_size))
        self._index(rows)

    def reuse_many(
        self, kv_version: int, new_and_old: Iterable[tuple[PrefixKVEntry, PrefixKVEntry]]
    ) -> None:
        """Index ``new`` entries whose file is ``old``'s (same model and prompt), by hard link.

        The new entry keeps its own cutoff: a user whose new events all lack a
        semantic ID has the same prompt but a later cutoff.
        """
        rows = []
        for new, old in new_and_old:
            relative, target = self._place(kv_version, new)
            if target.exists():
                target.unlink()
            try:
                os.link(self.root / old.path, target)
            except OSError:  # another filesystem, or links unsupported
                shutil.copyfile(self.root / old.path, target)
            rows.append(_row(new, relative, target.stat().st_size))
        self._index(rows)

    def load(self, entry: PrefixKVEntry, expected_model_version: Any) -> PrefixKV:
        """The user's PrefixKV; the codec raises if it was computed by another model version.

        Model versions are compared as text (files and index store ``str(version)``).
        """
        path = self.root / entry.path
        if not path.exists():
            raise FileNotFoundError(f"prefix KV file of user {entry.user_id!r} is missing: {path}")
        return self.codec.load(path, str(expected_model_version))

    def load_many(
        self, kv_version: int, user_ids: Sequence[str], expected_model_version: Any
    ) -> dict[str, LoadedKV]:
        """The batch's entries in one query, then their files (a missing or stale file is
        that user's error, not the batch's)."""
        loaded: dict[str, LoadedKV] = {}
        for user_id, entry in self.lookup_many(kv_version, user_ids).items():
            try:
                loaded[user_id] = (entry, self.load(entry, expected_model_version))
            except Exception as exc:  # noqa: BLE001 - one user's cache, not the batch
                loaded[user_id] = exc
        return loaded

    def garbage_collect(self, keep_versions: Iterable[int]) -> int:
        """Drop every version not in ``keep_versions`` (index rows first, then files).

        Also removes directories left by killed runs. Call it only while holding
        the refresh lock, so that no version is being written. Returns the
        number of versions removed.
        """
        keep = {int(v) for v in keep_versions}
        keep_names = {version_dir_name(v) for v in keep}
        removed = {version_dir_name(v) for v in self._drop_index_except(keep)}
        if self.root.exists():
            for child in self.root.iterdir():
                if child.is_dir() and child.name.startswith("v") and child.name not in keep_names:
                    shutil.rmtree(child, ignore_errors=True)
                    removed.add(child.name)
        if removed:
            log.info("prefix KV: removed versions %s", ", ".join(sorted(removed)))
        return len(removed)

    def discard(self, kv_version: int) -> None:
        """Remove one (unactivated) version entirely: its index rows and its directory."""
        self._drop_index(kv_version)
        shutil.rmtree(self.root / version_dir_name(kv_version), ignore_errors=True)


def _check_version(entry: PrefixKVEntry, kv_version: int) -> None:
    if entry.kv_version != kv_version:
        raise ValueError(
            f"entry of user {entry.user_id!r} says KV version {entry.kv_version}, "
            f"written as {kv_version}"
        )


def _row(entry: PrefixKVEntry, relative: str, nbytes: int) -> dict[str, Any]:
    return {
        "kv_version": entry.kv_version,
        "user_id": entry.user_id,
        "model_version": str(entry.model_version),
        "cutoff_event_row": entry.cutoff_event_row,
        "cutoff_ts_ms": entry.cutoff_ts_ms,
        "cutoff_event_id": entry.cutoff_event_id,
        "n_tokens": entry.n_tokens,
        "nbytes": nbytes,
        "path": relative,
        "prompt_sha1": entry.prompt_sha1,
    }


def _chunks(values: list[str], size: int) -> list[list[str]]:
    return [values[i : i + size] for i in range(0, len(values), size)]


def _entry(row) -> PrefixKVEntry:
    return PrefixKVEntry(**{key: row[key] for key in PrefixKVEntry.__dataclass_fields__})


def _open_local(settings, engine: Engine) -> LocalDirKVStore:
    return LocalDirKVStore(kv_root(settings), engine)


def _open_redis(settings, engine: Engine) -> KVStore:
    from genrec.online.prefix_kv_redis import RedisKVStore  # redis-py only where configured

    return RedisKVStore.from_settings(settings.redis, engine)


# Backend name (settings.online.kv_store) -> factory(settings, engine).
BACKENDS: dict[str, Callable[[Any, Engine], KVStore]] = {"local": _open_local, "redis": _open_redis}


def kv_root(settings) -> Path:
    """Where the local backend keeps files: ``refresh.kv_dir`` or ``data_dir/prefix_kv``."""
    configured = settings.refresh.kv_dir
    return Path(configured) if configured is not None else Path(settings.data_dir) / "prefix_kv"


def open_kv_store(settings, engine: Engine) -> KVStore:
    """The configured backend, ``online.kv_store`` (the local directory by default)."""
    backend = settings.online.kv_store
    if backend not in BACKENDS:
        raise ValueError(f"unknown KV store backend {backend!r}; choose from {sorted(BACKENDS)}")
    return BACKENDS[backend](settings, engine)
