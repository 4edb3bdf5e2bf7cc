"""An entry's inbox for one leg: its answers queued, the session's waiting task woken by
the frame itself, and a wait's deadline kept without a cancel scope per token.

The entry waits for every token of a session (``p2p.chain.SwarmPipeline._await_token``) with
a deadline: the route's health is looked at every ``poll_s`` while a step is out, and the
step fails over when its adaptive deadline passes. That wait was a trio memory channel's
``receive`` inside ``trio.move_on_after``: the cancel scope alone (entered, its deadline
registered with the run, exited, unregistered) was ~60 Python calls a token of ~125 for the
whole hand-over, on caches the entry's own engine call had just left cold
(docs/ARCHITECTURE.md, "Open in issue 10", (2)). Here a waiting task parks with a due time
in one shared :class:`Alarm` (a dict entry), a frame's arrival reschedules it directly, and
the alarm's task wakes the few waits that come due: at most once per ``poll_s`` for a
session that is decoding, never for one that is not waiting.

An :class:`Inbox` is also a drop-in for the memory channel's other uses (``receive``,
``receive_nowait``, ``async for``, the sender's ``send_nowait`` and ``close``), with the same
bound: a stranger's frames can fill it, never grow it.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Generic, TypeVar

import outcome
import trio

T = TypeVar("T")


class Alarm:
    """Wakes inboxes whose wait came due: one task (:meth:`run`) for every inbox of a service.

    ``_due`` holds one row per inbox waiting now (a bounded number: one per session this peer
    drives); the task sleeps until the earliest, and a wait due sooner than that moves its
    deadline. A wait answered before its time leaves its row at once, so the task wakes for
    stale rows at most once per wait that was due the soonest."""

    def __init__(self) -> None:
        self._due: dict[Inbox[object], float] = {}
        self._next = math.inf
        self._scope: trio.CancelScope | None = None
        self.running = False

    def wake_at(self, inbox: Inbox[object], at: float) -> None:
        self._due[inbox] = at
        if at < self._next:
            self._next = at
            if self._scope is not None:
                self._scope.deadline = at

    def forget(self, inbox: Inbox[object]) -> None:
        self._due.pop(inbox, None)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self.running = True
        task_status.started()
        try:
            while True:
                with trio.CancelScope(deadline=self._next) as self._scope:
                    await trio.sleep_forever()
                self._scope = None
                self._fire(trio.current_time())
        finally:
            self.running = False
            self._scope = None
            for inbox in list(self._due):  # nobody will wake them now: their waits end here
                inbox._time_out()
            self._due.clear()

    def _fire(self, now: float) -> None:
        for inbox, at in list(self._due.items()):
            if at <= now:
                del self._due[inbox]
                inbox._time_out()
        self._next = min(self._due.values(), default=math.inf)


class Inbox(Generic[T]):
    """Messages for one session's waiting task, at most ``capacity`` queued (bounded like the
    memory channel it replaces). One task reads it at a time."""

    def __init__(self, capacity: int, alarm: Alarm | None = None) -> None:
        self._items: deque[T] = deque()
        self._capacity = capacity
        self._alarm = alarm
        self._task: trio.lowlevel.Task | None = None
        self._closed = False

    # ---------------------------------------------------------------- sender's side

    def send_nowait(self, item: T) -> None:
        """Hand ``item`` to the waiting task, or queue it; ``trio.WouldBlock`` when full,
        ``trio.ClosedResourceError`` once closed (as a memory channel's sender)."""
        if self._closed:
            raise trio.ClosedResourceError("the inbox is closed")
        task = self._task
        if task is not None:
            self._task = None
            if self._alarm is not None:
                self._alarm.forget(self)  # type: ignore[arg-type]
            trio.lowlevel.reschedule(task, outcome.Value(item))
        elif len(self._items) >= self._capacity:
            raise trio.WouldBlock
        else:
            self._items.append(item)

    def close(self) -> None:
        """No more items: what is queued can still be read, then the reader gets
        ``trio.EndOfChannel`` (a waiting reader at once)."""
        self._closed = True
        task = self._task
        if task is not None:
            self._task = None
            if self._alarm is not None:
                self._alarm.forget(self)  # type: ignore[arg-type]
            trio.lowlevel.reschedule(task, outcome.Error(trio.EndOfChannel()))

    # ---------------------------------------------------------------- reader's side

    def receive_nowait(self) -> T:
        if self._items:
            return self._items.popleft()
        if self._closed:
            raise trio.EndOfChannel
        raise trio.WouldBlock

    async def receive(self) -> T:
        """The next item, waiting as long as it takes (a cancel scope of the caller's bounds it)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        if self._items:
            return await self._queued()
        if self._closed:
            raise trio.EndOfChannel
        return await self._park()  # type: ignore[no-any-return]

    async def receive_by(self, at: float) -> T | None:
        """The next item, or None once trio's clock reaches ``at`` without one.

        What ``with trio.move_on_after(...): await receive()`` did, without a cancel scope
        when the service's alarm runs (a per-token wait's cost; see the module's docstring).
        A cancelled caller is stopped here as by ``receive``, even with an item queued."""
        await trio.lowlevel.checkpoint_if_cancelled()
        alarm = self._alarm
        if alarm is None or not alarm.running:
            with trio.CancelScope(deadline=at):
                return await self.receive()
            return None
        if at <= trio.current_time():  # as a scope whose deadline has passed: no item taken
            await trio.lowlevel.checkpoint()
            return None
        if self._items:
            return await self._queued()
        if self._closed:
            raise trio.EndOfChannel
        alarm.wake_at(self, at)  # type: ignore[arg-type]
        return await self._park()  # type: ignore[no-any-return]

    def __aiter__(self) -> Inbox[T]:
        return self

    async def __anext__(self) -> T:
        try:
            return await self.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None

    async def _queued(self) -> T:
        """The first queued item, after a turn as a memory channel takes: a whole peer's
        token is queued before its generation waits for it, and without the turn that
        generation never let the response's task (or any other) run until it ended."""
        await trio.lowlevel.cancel_shielded_checkpoint()
        return self._items.popleft()

    def _park(self) -> object:
        if self._task is not None:
            raise trio.BusyResourceError("another task is already reading this inbox")
        self._task = trio.lowlevel.current_task()

        def abort(_: object) -> trio.lowlevel.Abort:
            self._task = None
            if self._alarm is not None:
                self._alarm.forget(self)  # type: ignore[arg-type]
            return trio.lowlevel.Abort.SUCCEEDED

        return trio.lowlevel.wait_task_rescheduled(abort)

    def _time_out(self) -> None:
        """The alarm's word: the wait came due with nothing for it."""
        task = self._task
        if task is not None:
            self._task = None
            trio.lowlevel.reschedule(task, outcome.Value(None))
