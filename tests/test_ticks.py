"""Periodic loops on a shared grid (p2p/ticks.py): every ticker of a process wakes on the
same turns, so an idle peer leaves ``epoll_wait`` once a tick, not once per loop."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from p2p.ticks import next_tick, sleep_to_tick


def test_next_tick_is_the_first_multiple_strictly_after_now() -> None:
    assert next_tick(0.0, 1.0) == 1.0
    assert next_tick(0.999, 1.0) == 1.0
    assert next_tick(1.0, 1.0) == 2.0  # on a tick: the next one, never a zero wait
    assert next_tick(7.3, 0.5) == 7.5
    assert next_tick(7.3, 2.0) == 8.0
    with pytest.raises(ValueError):
        next_tick(1.0, 0.0)


def test_loops_started_at_different_times_wake_on_the_same_instants() -> None:
    """Three loops (0.5 s, 1 s, 2 s) started at scattered times: every wake of the slower
    ones falls on a wake of the faster ones (the wake-ups a process pays for are the 0.5 s
    loop's alone), where ``trio.sleep(period)`` had each on its own phase."""
    wakes: dict[float, list[float]] = {0.5: [], 1.0: [], 2.0: []}

    async def ticker(start: float, period: float) -> None:
        await trio.sleep(start)
        while True:
            await sleep_to_tick(period)
            wakes[period].append(trio.current_time())

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for start, period in ((0.13, 0.5), (0.41, 1.0), (0.77, 2.0)):
                nursery.start_soon(ticker, start, period)
            await trio.sleep(10.1)
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert len(wakes[0.5]) == 20 and len(wakes[1.0]) == 10 and len(wakes[2.0]) == 5
    assert set(wakes[1.0]) <= set(wakes[0.5]) and set(wakes[2.0]) <= set(wakes[1.0])
