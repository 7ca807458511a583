"""The prompt KVs a worker has decoded, kept for the users' next requests (online step).

Every decode prefills a user's prompt: the cached prefix of the last refresh plus the
tokens of newer events, or the whole prompt when the user has no cache. The engine can
hand that prompt's KV back (``keep_prompt_kv``); kept here, the user's next request,
whose prompt is usually the same tokens plus those of its new events, prefills only the
new ones. A kept KV is used only when its tokens are exactly the start of the new
prompt, so the items are those of decoding that whole prompt (up to float rounding):
nothing changes when an event arrives out of order, it is just not used. The idea is
vLLM's automatic prefix caching, per user.

Which prompt: a kept prompt of ``n`` items grows by the user's new items (those after
its ``last_event_id``) up to ``online.max_prompt_items`` (default 1.5H, H =
``model.history_items``); past that the next request decodes the full prompt of the
last H items, which is kept and grows again. So the model never sees a history with a
gap, a prompt holds at most 1.5H items (at least H once a user has that many), and one
request in about H/2 per user pays a full prefill. (A prompt that always held the last H
items would slide with every event of a user past H items, and no kept prompt would
ever match.)

Memory: an LRU bounded by users (``online.prompt_kv_lru_size``) and bytes
(``online.prompt_kv_lru_mb``); per user about (prompt tokens) x layers x 2 x KV width
(the `small` target ~1.5 KB a token, so ~0.3-0.45 MB for a prompt of 50-75 items;
SmolLM2-135M ~45 KB a token). It grows with the users a worker sees, never with the
catalog or the event log, and is dropped when the serving version changes. Thread-safe.

Example::

    >>> served = ServedPrompts(size=2, max_bytes=2**20)
    >>> served.get("u1") is None
    True
    >>> starts([1, 7, 260, 9], kept_ids=[1, 7, 260]), starts([1, 260, 7], kept_ids=[1, 7])
    (True, False)
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ServedPrompt:
    """A user's last decoded prompt: its KV, how many items it holds, and the event id
    of the newest event of the history it was built from (where new items start)."""

    prompt_kv: Any  # PrefixKV, the draft's as a companion
    prompt_items: int
    last_event_id: str | None


class ServedPrompts:
    """Per user the ``ServedPrompt`` of the last prompt decoded for them, least recently
    used first out."""

    def __init__(self, size: int, max_bytes: int) -> None:
        self.size, self.max_bytes = size, max_bytes
        self.nbytes = 0
        self._entries: OrderedDict[str, tuple[ServedPrompt, int]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, user_id: str) -> ServedPrompt | None:
        """The user's kept prompt (None: none kept), now the most recently used."""
        with self._lock:
            found = self._entries.get(user_id)
            if found is None:
                return None
            self._entries.move_to_end(user_id)
        return found[0]

    def put(
        self, user_id: str, prompt_kv: Any, prompt_items: int = 0, last_event_id: str | None = None
    ) -> None:
        """Keep ``prompt_kv`` (a prompt of ``prompt_items`` items, up to the event
        ``last_event_id``) as the user's, replacing the one before."""
        if self.size <= 0:
            return
        size = prompt_kv_bytes(prompt_kv)
        entry = ServedPrompt(prompt_kv, prompt_items, last_event_id)
        with self._lock:
            _old, old_size = self._entries.pop(user_id, (None, 0))
            self.nbytes += size - old_size
            self._entries[user_id] = (entry, size)
            while self._entries and (
                len(self._entries) > self.size or self.nbytes > self.max_bytes
            ):
                _user, (_kept, evicted) = self._entries.popitem(last=False)
                self.nbytes -= evicted

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.nbytes = 0

    def __contains__(self, user_id: object) -> bool:
        return user_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)


def starts(prompt_ids: Sequence[int], kept_ids: Sequence[int]) -> bool:
    """Whether ``prompt_ids`` begins with all of ``kept_ids``."""
    n = len(kept_ids)
    return n <= len(prompt_ids) and list(prompt_ids[:n]) == list(kept_ids)


def prompt_kv_bytes(prompt_kv: Any) -> int:
    """Bytes of a ``PrefixKV``'s tensors and its companions'."""
    total = 0
    for kv in (prompt_kv, *getattr(prompt_kv, "companions", {}).values()):
        tensors = [*getattr(kv, "keys", []), *getattr(kv, "values", [])]
        total += sum(t.numel() * t.element_size() for t in tensors if hasattr(t, "element_size"))
    return total
