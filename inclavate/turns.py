"""trio primitives that end the caller's turn only when they must wait.

trio's ``Lock.acquire`` and ``MemorySendChannel.send`` always end the task's turn, even when
the lock is free or the channel has room: every other runnable task then runs first. On the
forward path that turn is paid at every hop of every token, by a frame nobody else is
waiting for (docs/ARCHITECTURE.md, "Fewer scheduler turns per frame"). These wait exactly
when trio's would.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import TracebackType
from typing import TypeVar

import trio

T = TypeVar("T")

logger = logging.getLogger(__name__)


class QuickLock:
    """A lock for ``async with`` only, taken at once when it is free (a task already
    cancelled is still stopped here, before it holds the lock); waiters take it in order.

    trio's :class:`trio.Lock` is this plus owner checks and deadlock bookkeeping, ~10 calls
    per acquire and release: every frame of a link takes one, on caches an engine call left
    cold. Here the lock is a flag, and a waiter parks in trio's :class:`ParkingLot`: a
    release hands the lock straight to the first waiter (the flag stays set), and a waiter
    cancelled while parked leaves the lot without ever holding it."""

    def __init__(self) -> None:
        self._held = False
        self._waiters = trio.lowlevel.ParkingLot()

    async def __aenter__(self) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()
        if self._held:
            await self._waiters.park()  # woken by a release that handed us the lock
        else:
            self._held = True

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:  # fmt: skip
        if self._waiters:
            self._waiters.unpark()
        else:
            self._held = False

    def locked(self) -> bool:
        return self._held


async def send_or_wait(channel: trio.MemorySendChannel[T], value: T) -> None:
    """Put ``value`` in ``channel`` at once when it has room; wait for room otherwise
    (the back-pressure stays). Raises as ``channel.send`` does."""
    try:
        channel.send_nowait(value)
    except trio.WouldBlock:
        await channel.send(value)


class _TurnEnd(trio.abc.Instrument):
    """Runs the callbacks :func:`at_turn_end` collected, just before the event loop looks for
    I/O again: once every task of the loop's current pass has reached its next checkpoint."""

    def __init__(self) -> None:
        self.due: list[Callable[[], None]] = []

    def before_io_wait(self, timeout: float) -> None:
        if not self.due:
            return
        due, self.due = self.due, []
        for callback in due:
            try:
                callback()
            except Exception:  # an instrument that raises is removed by trio: keep this one
                logger.exception("a turn-end callback failed")


_turn_end: trio.lowlevel.RunVar[_TurnEnd] = trio.lowlevel.RunVar("turn_end")


def at_turn_end(callback: Callable[[], None]) -> None:
    """Call ``callback()`` (synchronous, must not raise) once, at the end of the event loop's
    current pass: when every task it is running has reached its next checkpoint, before it
    looks for I/O (and before the tasks those made runnable run).

    What it is for: a write that wakes another process. On a core that both share, the
    kernel hands the woken reader the CPU at once, and whatever the writer still had to do
    (its bookkeeping, the way back to ``epoll_wait``) then cuts into the reader's work; a
    write made last leaves the writer nothing to do but sleep (docs/ARCHITECTURE.md, "A write
    leaves at the end of the turn")."""
    try:
        turn_end = _turn_end.get()
    except LookupError:
        turn_end = _TurnEnd()
        trio.lowlevel.add_instrument(turn_end)
        _turn_end.set(turn_end)
    turn_end.due.append(callback)
