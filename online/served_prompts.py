"""The prompt KVs a worker has decoded, kept for the users' next requests (online step).

Every decode prefills a user's prompt: the cached prefix of the last refresh plus the
tokens of newer events, or the whole prompt when the user has no cache. The engine can
hand that prompt's KV back (``keep_prompt_kv``); kept here, the user's next request,
whose prompt is usually the same tokens plus those of its new events, prefills only the
new ones. A kept KV is used only when its tokens are exactly the start of the new
prompt, so the items are those of decoding the whole prompt (up to float rounding):
nothing changes when an event arrives out of order or the history window slides, it is
just not used. The idea is vLLM's automatic prefix caching, per user.

Memory: an LRU bounded by users (``online.prompt_kv_lru_size``) and bytes
(``online.prompt_kv_lru_mb``); per user about (prompt tokens) x layers x 2 x KV width
(the `small` target ~1.5 KB a token, so ~0.3 MB for a 200-token prompt; SmolLM2-135M
~45 KB a token). It grows with the users a worker sees, never with the catalog or the
event log, and is dropped when the serving version changes. Thread-safe.

Example::

    >>> served = ServedPrompts(size=2, max_bytes=2**20)
    >>> served.kept_prefix_of("u1", [1, 7, 260]) is None
    True
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any


class ServedPrompts:
    """Per user the KV of the last prompt decoded for them (``PrefixKV``, the draft's as a
    companion), least recently used first out."""

    def __init__(self, size: int, max_bytes: int) -> None:
        self.size, self.max_bytes = size, max_bytes
        self.nbytes = 0
        self._entries: OrderedDict[str, tuple[Any, int]] = OrderedDict()
        self._lock = threading.Lock()

    def kept_prefix_of(self, user_id: str, prompt_ids: Sequence[int]) -> Any | None:
        """The user's kept prompt KV when its tokens start ``prompt_ids`` (else None)."""
        with self._lock:
            found = self._entries.get(user_id)
            if found is None:
                return None
            self._entries.move_to_end(user_id)
        kept = found[0]
        n = len(kept.prompt_ids)
        if n > len(prompt_ids) or list(prompt_ids[:n]) != kept.prompt_ids:
            return None
        return kept

    def put(self, user_id: str, prompt_kv: Any) -> None:
        """Keep ``prompt_kv`` as the user's (replacing the one before)."""
        if self.size <= 0:
            return
        size = prompt_kv_bytes(prompt_kv)
        with self._lock:
            _old, old_size = self._entries.pop(user_id, (None, 0))
            self.nbytes += size - old_size
            self._entries[user_id] = (prompt_kv, size)
            while self._entries and (
                len(self._entries) > self.size or self.nbytes > self.max_bytes
            ):
                _user, (_kv, evicted) = self._entries.popitem(last=False)
                self.nbytes -= evicted

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.nbytes = 0

    def __contains__(self, user_id: object) -> bool:
        return user_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)


def prompt_kv_bytes(prompt_kv: Any) -> int:
    """Bytes of a ``PrefixKV``'s tensors and its companions'."""
    total = 0
    for kv in (prompt_kv, *getattr(prompt_kv, "companions", {}).values()):
        tensors = [*getattr(kv, "keys", []), *getattr(kv, "values", [])]
        total += sum(t.numel() * t.element_size() for t in tensors if hasattr(t, "element_size"))
    return total
