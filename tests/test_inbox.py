"""``p2p.inbox``: an entry's per-leg inbox and the alarm that times its waits (no cancel
scope per token) behave as the memory channel inside ``move_on_after`` they replace."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
from trio.testing import MockClock

from p2p.inbox import Alarm, Inbox


def _run(main) -> None:  # type: ignore[no-untyped-def]
    trio.run(main, clock=MockClock(autojump_threshold=0))


@asynccontextmanager
async def _inbox(timed_by_alarm: bool) -> AsyncIterator[tuple[trio.Nursery, Alarm, Inbox[int]]]:
    """An inbox of 4, its waits timed by a running alarm or (not running) by a cancel scope."""
    async with trio.open_nursery() as nursery:
        alarm = Alarm()
        if timed_by_alarm:
            await nursery.start(alarm.run)
        yield nursery, alarm, Inbox[int](4, alarm)


@pytest.mark.parametrize("timed_by_alarm", [True, False])
def test_a_wait_gets_what_arrives_or_none_at_its_due_time(timed_by_alarm: bool) -> None:
    async def main() -> None:
        async with _inbox(timed_by_alarm) as (nursery, alarm, inbox):
            began = trio.current_time()
            assert await inbox.receive_by(began + 0.1) is None
            assert trio.current_time() - began == pytest.approx(0.1)

            async def later() -> None:
                await trio.sleep(0.05)
                inbox.send_nowait(7)

            nursery.start_soon(later)
            began = trio.current_time()
            assert await inbox.receive_by(began + 0.1) == 7
            assert trio.current_time() - began == pytest.approx(0.05)
            assert not alarm._due  # an answered wait leaves no row behind
            inbox.send_nowait(8)
            assert await inbox.receive_by(trio.current_time() + 0.1) == 8  # queued: taken at once
            inbox.send_nowait(9)
            assert await inbox.receive_by(trio.current_time()) is None  # due already: as a spent scope
            assert inbox.receive_nowait() == 9
            nursery.cancel_scope.cancel()

    _run(main)


def test_the_alarm_wakes_each_wait_at_its_own_time() -> None:
    """Two sessions' waits, the later registered first and one due before the alarm's next
    wake: each ends at its own due time, and nothing is left in the alarm."""

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            alarm = Alarm()
            await nursery.start(alarm.run)
            ended: dict[str, float] = {}
            start = trio.current_time()

            async def wait(name: str, inbox: Inbox[int], after: float) -> None:
                assert await inbox.receive_by(start + after) is None
                ended[name] = trio.current_time() - start

            nursery.start_soon(wait, "late", Inbox[int](4, alarm), 0.3)
            await trio.sleep(0)
            nursery.start_soon(wait, "soon", Inbox[int](4, alarm), 0.1)
            await trio.sleep(1)
            assert ended == pytest.approx({"late": 0.3, "soon": 0.1})
            assert not alarm._due
            nursery.cancel_scope.cancel()

    _run(main)


def test_a_full_inbox_refuses_more_and_a_closed_one_ends_its_reader() -> None:
    """A route's hops cannot grow an inbox past its size; closing it lets the reader take
    what is queued, then ends it (``async for`` stops, a waiting reader is told at once)."""

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            alarm = Alarm()
            await nursery.start(alarm.run)
            inbox = Inbox[int](2, alarm)
            inbox.send_nowait(1)
            inbox.send_nowait(2)
            with pytest.raises(trio.WouldBlock):
                inbox.send_nowait(3)
            inbox.close()
            with pytest.raises(trio.ClosedResourceError):
                inbox.send_nowait(4)
            assert [item async for item in inbox] == [1, 2]
            with pytest.raises(trio.EndOfChannel):
                inbox.receive_nowait()

            waiting = Inbox[int](2, alarm)
            nursery.start_soon(_close_soon, waiting)
            with pytest.raises(trio.EndOfChannel):
                await waiting.receive_by(trio.current_time() + 10)
            assert not alarm._due
            nursery.cancel_scope.cancel()

    _run(main)


async def _close_soon(inbox: Inbox[int]) -> None:
    await trio.sleep(0.01)
    inbox.close()


def test_a_cancelled_wait_leaves_the_inbox_usable_and_the_alarm_empty() -> None:
    """The client goes away while its token is out: the wait is cancelled as a memory
    channel's was, no row stays in the alarm, and a cancelled caller is stopped even when
    an item is queued."""

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            alarm = Alarm()
            await nursery.start(alarm.run)
            inbox = Inbox[int](4, alarm)
            with trio.move_on_after(0.05) as scope:
                await inbox.receive_by(trio.current_time() + 10)
            assert scope.cancelled_caught and not alarm._due
            inbox.send_nowait(5)
            with trio.CancelScope() as scope:
                scope.cancel()
                await inbox.receive_by(trio.current_time() + 10)
            assert scope.cancelled_caught
            assert await inbox.receive() == 5
            nursery.cancel_scope.cancel()

    _run(main)


@pytest.mark.parametrize("timed_by_alarm", [True, False])
def test_a_token_already_queued_still_lets_the_other_tasks_run(timed_by_alarm: bool) -> None:
    """A whole peer's token is queued before its generation waits for it: taken at once,
    with no turn, the generation never let its response's task write a chunk until it
    ended (found by ``bench_chain --sections pinned``: the whole peer "decoded" 106,019
    tokens a second). A queued item is handed over after a turn, as a memory channel's."""

    async def main() -> None:
        async with _inbox(timed_by_alarm) as (nursery, alarm, inbox):
            turns = [0]

            async def ticker() -> None:
                while True:
                    turns[0] += 1
                    await trio.sleep(0)

            nursery.start_soon(ticker)
            await trio.sleep(0)
            for item in range(3):
                inbox.send_nowait(item)
            before = turns[0]
            assert await inbox.receive() == 0
            for item in (1, 2):
                assert await inbox.receive_by(trio.current_time() + 1) == item
            assert turns[0] - before >= 2  # the others ran meanwhile
            nursery.cancel_scope.cancel()

    _run(main)
