"""Periodic work on a shared grid: every ticker of a process wakes on the same turns.

A peer runs a dozen background loops (registry ageing and heartbeat, discovery, the healer,
the outbound guard, job deadlines, metrics, ...), most every second. Each slept its own
``trio.sleep(period)`` from whenever it started, so their wake-ups were spread over the
second: ~10 separate wake-ups a second, each one the process leaving ``epoll_wait``, and
on this VM a wake-up costs far more than the loop's work (8 one-second tickers: 2.1 ms of
CPU a second spread, 0.56 ms on a shared grid, ``scripts/bench_idle.py`` has the peers'
figures). Sleeping until the next multiple of the period on trio's clock puts every
ticker whose period divides another's on the same wake-ups. Each process's trio clock has
its own random offset, so peers on one machine do not wake in lockstep.

What changes for a loop: its first wait is shorter than a period (up to a whole one), and
a loop whose work took a while waits for the next tick rather than a full period.
"""

from __future__ import annotations

import math

import trio


def next_tick(now: float, period: float) -> float:
    """The first multiple of ``period`` strictly after ``now``."""
    if period <= 0:
        raise ValueError("a tick period must be positive")
    return (math.floor(now / period) + 1) * period


async def sleep_to_tick(period: float) -> None:
    """Sleep until the next multiple of ``period`` on trio's clock (a cancellation point)."""
    await trio.sleep_until(next_tick(trio.current_time(), period))
