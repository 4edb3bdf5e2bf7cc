"""QuickLock and send_or_wait: trio's lock and channel, minus the turn when nothing waits."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from turn_helpers import gives_a_turn

from inclavate.turns import QuickLock, send_or_wait


async def enter(lock: QuickLock) -> None:
    async with lock:
        pass


async def test_a_free_lock_is_taken_without_a_scheduler_turn() -> None:
    assert not await gives_a_turn(lambda: enter(QuickLock()))


async def test_a_held_lock_is_waited_for_in_order() -> None:
    lock = QuickLock()
    order: list[int] = []

    async def holder(i: int) -> None:
        async with lock:
            order.append(i)
            await trio.sleep(0.01)

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(holder, i)
                await trio.testing.wait_all_tasks_blocked()
    assert order == [0, 1, 2]


async def test_a_cancelled_task_does_not_take_a_free_lock() -> None:
    lock = QuickLock()
    entered = False
    with trio.CancelScope() as scope:
        scope.cancel()
        async with lock:
            entered = True
    assert not entered
    assert not await gives_a_turn(lambda: enter(lock))  # and the lock is still free


async def test_a_waiter_cancelled_while_parked_never_holds_the_lock_and_the_next_one_gets_it() -> None:
    lock = QuickLock()
    got: list[str] = []

    async def waiter(name: str, task_status: trio.TaskStatus[trio.CancelScope]) -> None:
        with trio.CancelScope() as scope:
            task_status.started(scope)
            async with lock:
                got.append(name)

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            async with lock:
                first = await nursery.start(waiter, "cancelled")
                await nursery.start(waiter, "next")
                await trio.testing.wait_all_tasks_blocked()
                assert lock.locked()
                first.cancel()
                await trio.testing.wait_all_tasks_blocked()
        assert got == ["next"]
        assert not lock.locked()
        assert not await gives_a_turn(lambda: enter(lock))


async def test_send_or_wait_waits_only_for_room() -> None:
    send, receive = trio.open_memory_channel[int](1)
    with trio.testing.assert_no_checkpoints():
        await send_or_wait(send, 1)
    with trio.move_on_after(0.1) as waited:
        await send_or_wait(send, 2)
    assert waited.cancelled_caught
    assert receive.receive_nowait() == 1
    send.close()
    with pytest.raises(trio.ClosedResourceError):
        await send_or_wait(send, 3)
