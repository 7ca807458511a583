"""The Redis backend of the prefix-KV store: the tier that every worker host shares (online step).

``online.kv_store = "redis"``. The offline refresh writes each user's cache under its
KV version; workers on any host read a batch's caches in one pipelined round trip,
behind their in-memory LRU (``genrec.online.recommender.PrefixKVCache``). The index rows
stay in the database (``prefix_kv_index``, as for the local backend): the refresh reads
them to reuse unchanged caches, to fill its byte budget and to report sizes; serving
never needs them, each value carries its entry.

Keys (``P`` = ``redis.key_prefix``, default ``genrec:pkv``; ``D`` = sha1 of the user id)::

    P:{D}:v000007   hash  entry -> the PrefixKVEntry as JSON, kv -> safetensors bytes
    P:v000007:users set   the D of every user written into version 7 (what GC deletes)
    P:versions      set   the KV versions that have keys (GC finds killed runs' leftovers)

Redis Cluster: the hash tag is the user's digest ``{D}``, so users spread evenly over
the 16384 slots and every version of one user sits in the same slot. That is what the
one multi-key command needs: ``COPY`` of an unchanged cache from the previous version
(refresh ``reuse_unchanged_kv``), which Cluster only allows within a slot. Everything
else is one key per command; a batch is a pipeline of such commands, which redis-py's
cluster client splits by node. The two sets are one key each (one slot each).

Values are safetensors (``prefix_kv_to_bytes``), parsed without running code; never
pickle. A version is complete before the refresh activates it: ``put_many`` raises on
any failed write, so the run fails and the previous version keeps serving. After
activation ``garbage_collect`` deletes the versions no longer kept: it walks each one's
user set with ``SSCAN`` and ``UNLINK``s ``redis.write_batch`` keys per pipeline
(bounded memory whatever the number of users; ``UNLINK`` frees in the background).

Reads fail fast (``redis.socket_timeout_s``, ``connect_timeout_s``): an unreachable or
stalled Redis (or any Redis error) raises ``KVStoreUnavailable``, the worker serves those
users from their prompts, and for ``redis.retry_after_s`` the store answers so at once
instead of waiting on every batch; then it tries again, so serving recovers by itself
when Redis is back.
Writes (the refresh) wait up to ``redis.write_timeout_s``.

Memory: one version holds ``users x bytes per user`` (``refresh.kv_budget_mb`` bounds it)
plus ~100 bytes per user of key, entry and set member; at most ``refresh.keep_versions``
versions (default 2) are live, and a third only while a refresh is writing it. Run Redis
with ``maxmemory-policy noeviction``: a full Redis then fails the refresh's writes
(previous version keeps serving) instead of evicting caches of the live version.

Example::

    store = RedisKVStore.from_settings(settings.redis, engine)
    store.put_many(7, [(entry, prefix_kv)])
    store.load_many(7, ["user-1", "user-2"], expected_model_version="3")
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.exceptions import RedisClusterException, RedisError
from redis.retry import Retry
from sqlalchemy import Engine

from genrec.infra.settings import RedisSettings
from genrec.online.prefix_kv_store import (
    IndexedKVStore,
    KVStoreUnavailable,
    LoadedKV,
    PrefixKV,
    PrefixKVEntry,
    _check_version,
    _row,
    version_dir_name,
)

log = logging.getLogger(__name__)

ENTRY_FIELD, KV_FIELD = "entry", "kv"
# What makes a read "unavailable" (serve from the prompt): not only a refused connection
# or a timeout but any Redis error (a failed AUTH, a cluster without a quorum, a server
# still loading): a worker must keep answering, and its log says which it was.
UNREACHABLE = (RedisError, RedisClusterException)


class RedisKeys:
    """The key layout above, for one ``key_prefix``."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    @staticmethod
    def digest(user_id: str) -> str:
        return hashlib.sha1(user_id.encode("utf-8")).hexdigest()

    def user(self, kv_version: int, user_id: str) -> str:
        return self.of_digest(kv_version, self.digest(user_id))

    def of_digest(self, kv_version: int, digest: str) -> str:
        return f"{self.prefix}:{{{digest}}}:{version_dir_name(kv_version)}"

    def version_users(self, kv_version: int) -> str:
        return f"{self.prefix}:{version_dir_name(kv_version)}:users"

    @property
    def versions(self) -> str:
        return f"{self.prefix}:versions"


def make_client(settings: RedisSettings, *, timeout_s: float) -> Any:
    """A redis-py client (``RedisCluster`` when ``settings.cluster``) from the settings.

    Retries are immediate and few (``settings.retries``): one covers a pooled connection
    that a Redis restart broke; more would only stretch an outage's timeouts.
    """
    options: dict[str, Any] = dict(
        host=settings.host,
        port=settings.port,
        username=settings.username,
        password=settings.password.get_secret_value() if settings.password else None,
        socket_timeout=timeout_s,
        socket_connect_timeout=settings.connect_timeout_s,
        retry=Retry(NoBackoff(), settings.retries),
    )
    if settings.tls:
        options.update(
            ssl=True,
            ssl_ca_certs=_path(settings.tls_ca_file),
            ssl_certfile=_path(settings.tls_cert_file),
            ssl_keyfile=_path(settings.tls_key_file),
            ssl_check_hostname=settings.tls_check_hostname,
        )
    if settings.cluster:
        from redis.cluster import RedisCluster

        return RedisCluster(**options)
    return redis.Redis(db=settings.db, **options)


def _path(value) -> str | None:
    return None if value is None else str(value)


class RedisKVStore(IndexedKVStore):
    """Prefix KVs as Redis hashes (layout in the module docstring); index rows in the database.

    ``reader`` serves lookups (short timeouts), ``writer`` the refresh's writes and deletes.
    """

    def __init__(
        self,
        reader: Any,
        writer: Any,
        engine: Engine,
        *,
        key_prefix: str = "genrec:pkv",
        retry_after_s: float = 1.0,
        write_batch: int = 500,
        where: str = "redis",
    ) -> None:
        super().__init__(engine)
        self.reader, self.writer = reader, writer
        self.keys = RedisKeys(key_prefix)
        self.retry_after_s, self.write_batch = retry_after_s, write_batch
        self.where = where  # host:port/db, for messages (never the credentials)
        self._down_until = 0.0

    @classmethod
    def from_settings(cls, settings: RedisSettings, engine: Engine) -> RedisKVStore:
        return cls(
            make_client(settings, timeout_s=settings.socket_timeout_s),
            make_client(settings, timeout_s=settings.write_timeout_s),
            engine,
            key_prefix=settings.key_prefix,
            retry_after_s=settings.retry_after_s,
            write_batch=settings.write_batch,
            where=f"{settings.host}:{settings.port}/{settings.db}",
        )

    def __repr__(self) -> str:
        return f"RedisKVStore({self.where}, prefix={self.keys.prefix!r})"

    # --- the refresh's writes --------------------------------------------------------

    def put_many(
        self, kv_version: int, entries_and_prefix_kvs: Iterable[tuple[PrefixKVEntry, PrefixKV]]
    ) -> None:
        """Write the batch in one pipeline, then index it; raises if any write failed."""
        from genrec.online.decoding.prefix_kv import prefix_kv_to_bytes  # loads torch

        pipe = self._pipeline(self.writer)
        rows = []
        for entry, prefix_kv in entries_and_prefix_kvs:
            _check_version(entry, kv_version)
            key, data = self.keys.user(kv_version, entry.user_id), prefix_kv_to_bytes(prefix_kv)
            row = _row(entry, key, len(data))
            self._track(pipe, kv_version, entry.user_id)
            pipe.hset(key, mapping={ENTRY_FIELD: _entry_json(row), KV_FIELD: data})
            rows.append(row)
        if rows:
            pipe.execute()  # raise_on_error: one failed HSET fails the batch, and so the run
        self._index(rows)

    def reuse_many(
        self, kv_version: int, new_and_old: Iterable[tuple[PrefixKVEntry, PrefixKVEntry]]
    ) -> None:
        """Copy each unchanged cache from the old version's key (same slot: same user) and
        give it the new entry. An old value that is gone (a flushed Redis) is not indexed:
        that user is served from the prompt, and the next run computes the cache."""
        pairs = list(new_and_old)
        if not pairs:
            return
        pipe = self._pipeline(self.writer)
        for new, old in pairs:
            _check_version(new, kv_version)
            self._track(pipe, kv_version, new.user_id)
            pipe.copy(old.path, self.keys.user(kv_version, new.user_id), replace=True)
        copied = pipe.execute()[2::3]  # per pair: SADD version, SADD user, COPY
        pipe, rows = self._pipeline(self.writer), []
        for (new, old), ok in zip(pairs, copied, strict=True):
            if not ok:
                log.warning(
                    "prefix KV of user %s vanished from %s; not reused", new.user_id, old.path
                )
                continue
            key = self.keys.user(kv_version, new.user_id)
            rows.append(_row(new, key, old.nbytes))
            pipe.hset(key, ENTRY_FIELD, _entry_json(rows[-1]))
        if rows:
            pipe.execute()
        self._index(rows)

    def _track(self, pipe: Any, kv_version: int, user_id: str) -> None:
        """Register the key before writing it: a killed run's keys are still found by GC."""
        pipe.sadd(self.keys.versions, str(int(kv_version)))
        pipe.sadd(self.keys.version_users(kv_version), self.keys.digest(user_id))

    # --- serving reads ---------------------------------------------------------------

    def lookup(self, kv_version: int, user_id: str) -> PrefixKVEntry | None:
        return self.lookup_many(kv_version, [user_id]).get(user_id)

    def lookup_many(self, kv_version: int, user_ids: Sequence[str]) -> dict[str, PrefixKVEntry]:
        """The batch's entries in one pipelined round trip."""
        users = list(dict.fromkeys(user_ids))
        answers = self._read(
            lambda pipe: [pipe.hget(self.keys.user(int(kv_version), u), ENTRY_FIELD) for u in users]
        )
        found = {}
        for user_id, raw in zip(users, answers, strict=True):
            if isinstance(raw, Exception):
                log.warning("prefix KV entry of user %s unreadable: %s", user_id, raw)
            elif raw:
                found[user_id] = _parse_entry(raw)
        return found

    def load(self, entry: PrefixKVEntry, expected_model_version: Any) -> PrefixKV:
        data = self._read(lambda pipe: [pipe.hget(entry.path, KV_FIELD)])[0]
        if isinstance(data, Exception):
            raise data
        if data is None:
            raise FileNotFoundError(f"prefix KV of user {entry.user_id!r} is missing: {entry.path}")
        return _parse_kv(data, expected_model_version, entry.path)

    def load_many(
        self, kv_version: int, user_ids: Sequence[str], expected_model_version: Any
    ) -> dict[str, LoadedKV]:
        """Entries and caches of the batch in one pipelined round trip (``HMGET`` per user)."""
        users = list(dict.fromkeys(user_ids))
        keys = [self.keys.user(int(kv_version), u) for u in users]
        answers = self._read(lambda pipe: [pipe.hmget(k, ENTRY_FIELD, KV_FIELD) for k in keys])
        loaded: dict[str, LoadedKV] = {}
        for user_id, key, answer in zip(users, keys, answers, strict=True):
            if isinstance(answer, Exception):  # e.g. WRONGTYPE: this key, not the batch
                loaded[user_id] = answer
                continue
            raw_entry, data = answer
            if raw_entry is None:
                continue
            try:
                entry = _parse_entry(raw_entry)
                if data is None:
                    raise FileNotFoundError(f"prefix KV of user {user_id!r} is missing: {key}")
                loaded[user_id] = (entry, _parse_kv(data, expected_model_version, key))
            except Exception as exc:  # noqa: BLE001 - one user's value, not the batch
                loaded[user_id] = exc
        return loaded

    def _read(self, queue) -> list[Any]:
        """Run the commands ``queue(pipe)`` adds as one pipeline on the reader; a Redis
        that fails it raises ``KVStoreUnavailable`` (and at once for ``retry_after_s``).
        A command's own error (one damaged key) is its answer instead."""
        if time.monotonic() < self._down_until:
            raise KVStoreUnavailable(f"Redis at {self.where} was unreachable moments ago")
        pipe = self._pipeline(self.reader)
        queue(pipe)
        try:
            return pipe.execute(raise_on_error=False)
        except UNREACHABLE as exc:
            self._down_until = time.monotonic() + self.retry_after_s
            raise KVStoreUnavailable(f"Redis at {self.where}: {type(exc).__name__}: {exc}") from exc

    @staticmethod
    def _pipeline(client: Any) -> Any:
        if hasattr(client, "get_nodes"):  # RedisCluster: its pipeline is never a transaction
            return client.pipeline()
        return client.pipeline(transaction=False)

    # --- versions --------------------------------------------------------------------

    def garbage_collect(self, keep_versions: Iterable[int]) -> int:
        """Delete every version not in ``keep_versions``: index rows, then keys. Call it
        after activation, holding the refresh lock. Returns the number of versions removed."""
        keep = {int(v) for v in keep_versions}
        removed = self._drop_index_except(keep)
        stored = {int(v) for v in self.writer.smembers(self.keys.versions)}
        for kv_version in sorted(stored - keep):
            self._delete_keys(kv_version)
        removed |= stored - keep
        if removed:
            log.info("prefix KV (Redis): removed versions %s", ", ".join(map(str, sorted(removed))))
        return len(removed)

    def discard(self, kv_version: int) -> None:
        """Remove one unactivated version; with Redis unreachable its keys stay registered
        and the next run's garbage collection deletes them."""
        self._drop_index(kv_version)
        try:
            self._delete_keys(kv_version)
        except UNREACHABLE as exc:
            log.warning("prefix KV version %d left in Redis for the next collection: %s",
                        kv_version, exc)  # fmt: skip

    def _delete_keys(self, kv_version: int) -> None:
        """UNLINK a version's user keys ``write_batch`` per pipeline, then its set."""
        for digests in self._user_digests(kv_version):
            pipe = self._pipeline(self.writer)
            for digest in digests:
                pipe.unlink(self.keys.of_digest(kv_version, digest))
            pipe.execute()
        self.writer.unlink(self.keys.version_users(kv_version))
        self.writer.srem(self.keys.versions, str(int(kv_version)))

    def _user_digests(self, kv_version: int) -> Iterator[list[str]]:
        """The version's user digests, ``write_batch`` at a time (SSCAN: no full read).

        The set does not change while it is scanned (only the user keys are unlinked; the
        set goes last), and SSCAN returns every member present throughout a scan."""
        batch: list[str] = []
        name = self.keys.version_users(kv_version)
        for member in self.writer.sscan_iter(name, count=self.write_batch):
            batch.append(member.decode() if isinstance(member, bytes) else member)
            if len(batch) >= self.write_batch:
                yield batch
                batch = []
        if batch:
            yield batch


def _entry_json(row: dict[str, Any]) -> str:
    return json.dumps(row, separators=(",", ":"))


def _parse_entry(raw: bytes | str) -> PrefixKVEntry:
    fields = json.loads(raw)
    names = {f.name for f in dataclasses.fields(PrefixKVEntry)}
    return PrefixKVEntry(**{k: v for k, v in fields.items() if k in names})


def _parse_kv(data: bytes, expected_model_version: Any, key: str) -> PrefixKV:
    from genrec.online.decoding.prefix_kv import prefix_kv_from_bytes  # loads torch

    return prefix_kv_from_bytes(data, str(expected_model_version), source=key)
