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
    """A lock for ``async with`` only, taken at once when it is free (a task already
    cancelled is still stopped here, before it holds the lock); waiters take it in order.

    trio's :class:`trio.Lock` is this plus owner checks and deadlock bookkeeping, ~10 calls
    per acquire and release: every frame of a link takes one, on caches an engine call left
    cold. Here the lock is a flag, and a waiter parks in trio's :class:`ParkingLot`: a
    release hands the lock straight to the first waiter (the flag stays set), and a waiter
    cancelled while parked leaves the lot without ever holding it."""

    def __init__(self) -> None:
        self.held = False
        """Whether someone holds the lock: what :meth:`locked` answers, for a short path
        checked at every frame to read without a call (``p2p.framing``). Never set it from
        outside: :meth:`take_if_free` and :meth:`release` do."""
        self._waiters = trio.lowlevel.ParkingLot()

    async def __aenter__(self) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()
        if self.held:
            await self._waiters.park()  # woken by a release that handed us the lock
        else:
            self.held = True

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:  # fmt: skip
        if self._waiters:
            self._waiters.unpark()
        else:
            self.held = False

    def locked(self) -> bool:
        return self.held

    def take_if_free(self) -> bool:
        """Take the lock if nobody holds it: True, and the caller must :meth:`release` it.
        For a short path that would otherwise pay ``async with``'s calls at every frame
        (``FramedStream.receive``); unlike entering, it is no checkpoint."""
        if self.held:
            return False
        self.held = True
        return True

    def release(self) -> None:
        """Hand the lock to the first waiter, or free it: what leaving ``async with`` does."""
        if self._waiters:
            self._waiters.unpark()
        else:
            self.held = False


async def send_or_wait(channel: trio.MemorySendChannel[T], value: T) -> None:
    """Put ``value`` in ``channel`` at once when it has room; wait for room otherwise
    (the back-pressure stays). Raises as ``channel.send`` does."""
    try:
        channel.send_nowait(value)
    except trio.WouldBlock:
        await channel.send(value)
