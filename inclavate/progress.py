"""Byte progress for long downloads and hashes, without a dependency.

On a terminal a single line is redrawn in place (``\\r``) at most ten times a second; on
anything else (CI logs, pipes, test captures) a redrawn line would be noise, so a task
writes a start line, a line at most every ``log_interval`` seconds while it runs, and a
summary line. ``Progress(None)`` is silent, which is what library callers (peers pulling
a model from a trio thread) get by default.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TextIO

Clock = Callable[[], float]

REDRAW_INTERVAL_S = 0.1
"""Terminal redraw throttle: faster is invisible and costs a write per chunk."""

LOG_INTERVAL_S = 30.0
"""Plain-log cadence: a 5 GB download at 20 MB/s logs about 8 lines, a small one just 2."""


class Progress:
    """Where progress goes (a text stream or nowhere) and how it is drawn there."""

    def __init__(
        self,
        stream: TextIO | None = None,
        *,
        interactive: bool | None = None,
        clock: Clock = time.monotonic,
        log_interval: float = LOG_INTERVAL_S,
    ) -> None:
        self.stream = stream
        if interactive is None:
            interactive = stream is not None and _isatty(stream)
        self.interactive = interactive
        self.clock = clock
        self.log_interval = log_interval

    def log(self, message: str) -> None:
        """One plain line (a step starting or ending), on either kind of stream."""
        if self.stream is not None:
            self.stream.write(message + "\n")
            self.stream.flush()

    @contextmanager
    def task(self, label: str, total: int | None, *, initial: int = 0) -> Iterator[ProgressTask]:
        """Track one transfer of ``total`` bytes (None if unknown), ``initial`` already done.

        ``initial`` is what a resumed download already had: it counts towards done and the
        percentage but not towards the rate, which would otherwise look absurdly high.
        """
        task = ProgressTask(self, label, total, initial)
        task.begin()
        try:
            yield task
        except BaseException:
            task.end(failed=True)
            raise
        task.end()


class ProgressTask:
    """One transfer's counters and its drawing; get one from :meth:`Progress.task`."""

    def __init__(self, progress: Progress, label: str, total: int | None, initial: int) -> None:
        self._p = progress
        self.label = label
        self.total = total
        self.done = initial
        self._initial = initial
        self._started = progress.clock()
        self._last_draw = self._started

    def advance(self, n: int) -> None:
        """Record ``n`` more bytes; redraws or logs only when the interval allows."""
        self.done += n
        if self._p.stream is None:
            return
        now = self._p.clock()
        interval = REDRAW_INTERVAL_S if self._p.interactive else self._p.log_interval
        if now - self._last_draw >= interval:
            self._last_draw = now
            self._emit(self.status_line(now), final=False)

    def begin(self) -> None:
        if self._p.stream is None:
            return
        if self._p.interactive:
            self._emit(self.status_line(self._started), final=False)
        else:
            size = f" ({_mb(self.total)})" if self.total is not None else ""
            resumed = f", resuming at {_mb(self._initial)}" if self._initial else ""
            self._p.log(f"{self.label}{size}{resumed} ...")

    def end(self, *, failed: bool = False) -> None:
        if self._p.stream is None:
            return
        if failed:
            # Also ends a half-drawn terminal line, so the error message starts clean.
            self._emit(f"{self.label}: stopped at {_mb(self.done)}", final=True)
            return
        elapsed = max(self._p.clock() - self._started, 1e-9)
        moved = self.done - self._initial
        summary = f"{self.label}: {_mb(self.done)} in {elapsed:.1f} s ({_mb(moved / elapsed)}/s)"
        self._emit(summary, final=True)

    def status_line(self, now: float) -> str:
        """``label  45.2/98.4 MB  45%  12.3 MB/s  ETA 0:04``; parts that are unknown are left out."""
        elapsed = now - self._started
        rate = (self.done - self._initial) / elapsed if elapsed > 0 else 0.0
        parts = [self.label]
        if self.total:
            parts.append(f"{_mb(self.done, unit=False)}/{_mb(self.total)}")
            parts.append(f"{min(100, 100 * self.done // self.total)}%")
        else:
            parts.append(_mb(self.done))
        if rate > 0:
            parts.append(f"{_mb(rate)}/s")
            if self.total:
                parts.append(f"ETA {_duration(max(self.total - self.done, 0) / rate)}")
        return "  ".join(parts)

    def _emit(self, text: str, *, final: bool) -> None:
        stream = self._p.stream
        assert stream is not None
        if self._p.interactive:
            # \r then the text, then \x1b[K (erase to end of line) so a shorter line
            # leaves no tail of the previous one.
            stream.write("\r" + text + "\x1b[K" + ("\n" if final else ""))
            stream.flush()
        else:
            self._p.log(text)


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # ValueError: a closed stream
        return False


def _mb(n_bytes: float | None, *, unit: bool = True) -> str:
    """Decimal megabytes, the unit download sizes are advertised in."""
    if n_bytes is None:
        return "?"
    text = f"{n_bytes / 1e6:.1f}"
    return f"{text} MB" if unit else text


def _duration(seconds: float) -> str:
    seconds = int(seconds + 0.5)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"
