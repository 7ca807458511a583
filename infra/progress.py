"""Progress of long loops (core services): a bar on a terminal, plain log lines elsewhere.

Every step reports its loops through ``progress_bar()``. When ``sys.stderr`` is a
terminal it returns a tqdm bar, as before. Anywhere else (a file, a pipe, a
container's log, a log shipper) a bar's carriage-return frames are thousands of
useless lines, so it returns a ``ProgressLog`` instead: the same small
interface, which logs one line through ``logging`` (logger ``genrec.progress``)
at most every ``every_s`` seconds while the loop runs, and always one final line
when it ends::

    embed item texts: 4,096/16,384 batch (25%), 1,200 batch/s, eta 10 s
    embed item texts: 16,384/16,384 batch (100%) in 13.6 s, 1,205 batch/s

With ``GENREC_LOG_FORMAT=json`` each line also carries its figures as fields
(``progress``, ``n``, ``total``, ``unit``, ``elapsed_s``, ``rate_per_s``,
``eta_s``, ``final``, ``postfix``); ``GENREC_LOG_LEVELS=genrec.progress=WARNING``
silences them. ``quiet_library_bars()`` (called by the ``genrec`` entry point)
turns off the bars Hugging Face libraries draw themselves (loading and saving
weights) when stderr is not a terminal.

Example::

    >>> from genrec.infra.progress import progress_bar
    >>> for batch in progress_bar(range(3), desc="embed items", unit="batch"):
    ...     pass
    >>> with progress_bar(total=100, desc="train target") as bar:
    ...     bar.update(10)
    ...     bar.set_postfix(loss="0.123")
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol, TypeVar

log = logging.getLogger("genrec.progress")

EVERY_S = 5.0  # at most one line this often while a loop runs (plus its final line)

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class Progress(Protocol[T_co]):
    """What callers use of a bar: both tqdm and ``ProgressLog`` provide it."""

    def __iter__(self) -> Iterator[T_co]: ...

    def update(self, n: float = 1) -> Any: ...

    def set_postfix(
        self, ordered_dict: Mapping[str, Any] | None = None, refresh: bool = True, **kwargs: Any
    ) -> None: ...

    def write(self, s: str) -> None: ...

    def close(self) -> None: ...

    def __enter__(self) -> Progress[T_co]: ...

    def __exit__(self, *exc_info: object) -> None: ...


def stderr_is_terminal() -> bool:
    """Whether ``sys.stderr`` (where bars and logs go) is a terminal right now."""
    stream = sys.stderr
    try:
        return stream is not None and bool(stream.isatty())
    except (AttributeError, ValueError):  # a stand-in without isatty, or a closed file
        return False


def quiet_library_bars() -> None:
    """Off a terminal, switch off the tqdm bars of Hugging Face libraries (transformers draws
    one while it loads or saves weights): ``HF_HUB_DISABLE_PROGRESS_BARS=1`` unless set.

    Read when those libraries are imported, so call it first (the entry point does);
    child processes inherit it, and an explicit ``HF_HUB_DISABLE_PROGRESS_BARS=0`` wins.
    """
    if not stderr_is_terminal():
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def progress_bar(
    iterable: Iterable[T] | None = None,
    *,
    desc: str,
    total: float | None = None,
    unit: str = "it",
    disable: bool = False,
    leave: bool = True,
    every_s: float = EVERY_S,
) -> Progress[T]:
    """A tqdm bar when stderr is a terminal, else a ``ProgressLog`` (lines every ``every_s`` s).

    ``leave`` is tqdm's (keep the finished bar on screen); a ``ProgressLog`` always
    logs its final line. ``disable`` turns either off (``write`` still writes).
    """
    if stderr_is_terminal():
        # Imported here: tqdm takes ~40 ms, and the entry point imports this module.
        from tqdm import tqdm

        return tqdm(iterable, desc=desc, total=total, unit=unit, disable=disable, leave=leave)
    return ProgressLog(
        iterable, desc=desc, total=total, unit=unit, disable=disable, every_s=every_s
    )


class ProgressLog:
    """A progress reporter for logs: ``update``, ``set_postfix``, ``write``, ``close``,
    iteration and ``with``, like a tqdm bar, but one log line at most every ``every_s``
    seconds and a final one on ``close`` (called at the end of an iteration, by ``with``,
    or by the caller; once)."""

    def __init__(
        self,
        iterable: Iterable[Any] | None = None,
        *,
        desc: str,
        total: float | None = None,
        unit: str = "it",
        disable: bool = False,
        every_s: float = EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if every_s < 0:
            raise ValueError(f"every_s must be >= 0, got {every_s}")
        if total is None and iterable is not None:
            try:
                total = len(iterable)  # type: ignore[arg-type]
            except (TypeError, AttributeError):  # a generator: no total, no percentage
                total = None
        self.iterable = iterable
        self.desc = desc
        self.total = total
        self.unit = unit
        self.disable = disable
        self.every_s = every_s
        self.n: float = 0
        self._clock = clock
        self.start_t = clock()
        self._last_line_t = self.start_t
        self._postfix: dict[str, str] = {}
        self._closed = False

    def __iter__(self) -> Iterator[Any]:
        if self.iterable is None:
            raise TypeError(f"{self.desc}: nothing to iterate (give an iterable or call update)")
        try:
            for item in self.iterable:
                yield item
                self.update(1)
        finally:  # exhausted, or the loop left early (break, exception): the final line
            self.close()

    def __enter__(self) -> ProgressLog:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def update(self, n: float = 1) -> None:
        """Count ``n`` more; log a line if ``every_s`` has passed since the last one."""
        self.n += n
        if self.disable or self._closed:
            return
        now = self._clock()
        if now - self._last_line_t >= self.every_s:
            self._last_line_t = now
            self._log_line(now, final=False)

    def set_postfix(
        self, ordered_dict: Mapping[str, Any] | None = None, refresh: bool = True, **kwargs: Any
    ) -> None:
        """Figures shown after the counts (``loss=0.123``), as tqdm's; logged with the next line."""
        values = {**(ordered_dict or {}), **kwargs}
        self._postfix = {key: _postfix_value(value) for key, value in values.items()}

    def write(self, s: str) -> None:
        """A message of the loop's own (tqdm prints it above the bar): logged at once."""
        log.info("%s", s.rstrip("\n"))

    def close(self) -> None:
        """Log the final line (once; nothing when disabled)."""
        if self._closed:
            return
        self._closed = True
        if not self.disable:
            self._log_line(self._clock(), final=True)

    def _log_line(self, now: float, *, final: bool) -> None:
        elapsed = max(now - self.start_t, 0.0)
        rate = self.n / elapsed if elapsed > 0 and self.n > 0 else None
        eta = None
        if not final and rate and self.total is not None and self.n < self.total:
            eta = (self.total - self.n) / rate
        parts = [self._counts()]
        if final:
            parts[0] += f" in {format_duration(elapsed)}"
        if rate is not None:
            parts.append(format_rate(rate, self.unit))
        if eta is not None:
            parts.append(f"eta {format_duration(eta)}")
        parts += [f"{key}={value}" for key, value in self._postfix.items()]
        fields = {
            "progress": self.desc, "n": self.n, "total": self.total, "unit": self.unit,
            "elapsed_s": round(elapsed, 3), "rate_per_s": None if rate is None else round(rate, 3),
            "eta_s": None if eta is None else round(eta, 1), "final": final,
            "postfix": dict(self._postfix) or None,
        }  # fmt: skip
        log.info("%s: %s", self.desc, ", ".join(parts), extra={"fields": fields})

    def _counts(self) -> str:
        if self.total is None:
            return f"{format_count(self.n)} {self.unit}"
        percent = f" ({100 * self.n / self.total:.0f}%)" if self.total > 0 else ""
        return f"{format_count(self.n)}/{format_count(self.total)} {self.unit}{percent}"


def format_count(n: float) -> str:
    """``4096`` -> ``4,096``; a fractional count keeps one decimal."""
    return f"{int(n):,}" if float(n).is_integer() else f"{n:,.1f}"


def format_rate(per_s: float, unit: str) -> str:
    """``1,200 ev/s``, ``3.5 it/s``; below one a second, the time per unit (``42 s/epoch``)."""
    if per_s >= 1:
        return f"{_figure(per_s)} {unit}/s"
    return f"{_figure(1 / per_s)} s/{unit}"


def format_duration(seconds: float) -> str:
    """``0.4 s``, ``12 s``, ``3 min 05 s``, ``2 h 07 min``."""
    if seconds < 10:
        return f"{seconds:.1f} s"
    whole = round(seconds)
    if whole < 60:
        return f"{whole} s"
    minutes, secs = divmod(whole, 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def _figure(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def _postfix_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).strip()
