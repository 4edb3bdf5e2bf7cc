"""trio primitives that end the caller's turn only when they must wait.

trio's ``Lock.acquire`` and ``MemorySendChannel.send`` always end the task's turn, even when
the lock is free or the channel has room: every other runnable task then runs first. On the
forward path that turn is paid at every hop of every token, by a frame nobody else is
waiting for (docs/ARCHITECTURE.md, "Fewer scheduler turns per frame"). These wait exactly
when trio's would.
"""

from __future__ import annotations

from types import TracebackType
from typing import TypeVar

import trio

T = TypeVar("T")


class QuickLock:
    """``async with`` a :class:`trio.Lock`, taken at once when it is free (a task already
    cancelled is still stopped here, before it holds the lock)."""

    def __init__(self) -> None:
        self._lock = trio.Lock()

    async def __aenter__(self) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()
        try:
            self._lock.acquire_nowait()
        except trio.WouldBlock:
            await self._lock.acquire()

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:  # fmt: skip
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()


async def send_or_wait(channel: trio.MemorySendChannel[T], value: T) -> None:
    """Put ``value`` in ``channel`` at once when it has room; wait for room otherwise
    (the back-pressure stays). Raises as ``channel.send`` does."""
    try:
        channel.send_nowait(value)
    except trio.WouldBlock:
        await channel.send(value)
