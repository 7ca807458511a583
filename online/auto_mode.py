"""``online.mode = auto``: serve whichever lossless decoding mode is faster here (online step).

``strict`` speculative beam search and ``target``-only beam search return the same items
(strict is lossless), so which one a worker uses is a question of speed alone, and the
answer depends on the machine and the models: on a CPU the draft's calls cost about as
much as the target's and ``target`` wins (``small``: 7.0 vs 14.5 ms per request at K = 10);
on a GPU with a large target, ``strict`` wins (SmolLM2-135M on an H200: 1.16x). See
docs/decoding.md. Instead of a table of guesses, the worker times both on its own traffic:
it alternates them batch by batch until each has decoded ``batches`` batches, settles on
the one with fewer milliseconds per request, and measures again after ``recheck_every``
settled batches, since load and traffic change. ``relaxed`` is never chosen: it changes
the items.

Example::

    >>> chooser = AutoMode(batches=2, recheck_every=100)
    >>> for seconds in (0.020, 0.010, 0.022, 0.011):
    ...     mode = chooser.next_mode()
    ...     chooser.record(mode, seconds if mode == "strict" else seconds / 2, requests=1)
    >>> chooser.next_mode(), chooser.settled
    ('target', True)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

CANDIDATES = ("strict", "target")  # both lossless: the same items, only the time differs


@dataclass
class _Timing:
    batches: int = 0
    requests: int = 0
    seconds: float = 0.0

    def ms_per_request(self) -> float:
        return 1000.0 * self.seconds / max(self.requests, 1)


@dataclass
class AutoMode:
    """Times ``strict`` against ``target`` on live batches and picks the faster."""

    batches: int = 16  # batches each mode decodes before the choice
    recheck_every: int = 5000  # settled batches before both are timed again
    choice: str | None = field(default=None, init=False)  # the settled mode; None while timing
    since_choice: int = field(default=0, init=False)
    timings: dict[str, _Timing] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        if self.batches < 1 or self.recheck_every < 1:
            raise ValueError("batches and recheck_every must be >= 1")
        self._reset()

    @property
    def settled(self) -> bool:
        return self.choice is not None

    def next_mode(self) -> str:
        """The mode for the next batch: the choice once settled, else the less-timed mode."""
        if self.choice is not None:
            if self.since_choice < self.recheck_every:
                return self.choice
            self.choice = None  # measure again
            self._reset()
        return min(CANDIDATES, key=lambda mode: self.timings[mode].batches)

    def record(self, mode: str, seconds: float, requests: int) -> None:
        """One decoded batch of ``requests`` users in ``mode`` took ``seconds``."""
        if self.choice is not None:
            self.since_choice += 1
            return
        timing = self.timings[mode]
        timing.batches += 1
        timing.requests += requests
        timing.seconds += seconds
        if all(self.timings[m].batches >= self.batches for m in CANDIDATES):
            self._settle()

    def summary(self) -> dict[str, float]:
        """Milliseconds per request of each mode in the current (or last) measurement."""
        return {mode: round(t.ms_per_request(), 3) for mode, t in self.timings.items()}

    def _settle(self) -> None:
        self.choice = min(CANDIDATES, key=lambda mode: self.timings[mode].ms_per_request())
        self.since_choice = 0
        timed = ", ".join(f"{mode} {ms:.1f} ms/request" for mode, ms in self.summary().items())
        log.info("online.mode auto: %s over %d batches each; serving %s", timed, self.batches,
                 self.choice)  # fmt: skip

    def _reset(self) -> None:
        self.timings = {mode: _Timing() for mode in CANDIDATES}
