"""Give the memory of a flood of request bodies back to the system once it is over.

The body budget (:mod:`api.body_budget`) bounds the bytes a peer holds at once, but not what
the allocator keeps afterwards: glibc raises its mmap threshold to the size of the largest
block freed (up to 32 MiB), so after the first large body is freed, later ones come from the
heap, and a freed heap in the middle of live blocks is kept. Measured with
``scripts/bench_body_flood.py`` (40 connections x 23 of 24 MiB, three floods): a peer's RSS
stayed 702 MB above its start. ``malloc_trim(0)`` returns every whole free page of every
arena (``madvise(MADV_DONTNEED)``).

Why not ``MALLOC_MMAP_THRESHOLD_`` for the peer instead: it must be set before the process
starts (every way of starting a peer would need it) and it fixes the threshold for every
allocation, the hot path's included (a 192 KiB logits array would be mmapped and faulted in
afresh each token). A trim costs nothing until a flood happened.

When: :func:`trim_after_floods` looks once a second (never on a request's path) and trims
when the budget has held at least :data:`TRIM_AFTER_BYTES` since the last trim and now holds
at most :data:`TRIM_BELOW_BYTES`; the call runs in a worker thread (it takes the arenas'
locks for a few ms per GB). Where glibc is absent (musl, macOS) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from collections.abc import Callable

import trio

from api.body_budget import MIB, BodyBudget
from p2p.ticks import sleep_to_tick

log = logging.getLogger(__name__)

TRIM_AFTER_BYTES = 64 * MIB
"""Bodies held at once that make a trim worth it once they are gone (an honest peer's
streamed uploads hold at most 4 MiB each; chats a few KiB)."""
TRIM_BELOW_BYTES = 8 * MIB
"""The budget counts as (near) empty again below this."""
CHECK_INTERVAL_S = 1.0
"""How often the budget is looked at: at most one trim a second."""


def _find_malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


malloc_trim = _find_malloc_trim()


def should_trim(budget: BodyBudget) -> bool:
    """Whether a flood held enough of ``budget`` since the last trim, and is over."""
    return budget.high_since_trim >= TRIM_AFTER_BYTES and budget.held <= TRIM_BELOW_BYTES


async def trim_after_floods(budget: BodyBudget, interval_s: float = CHECK_INTERVAL_S) -> None:
    """Run until cancelled: trim the heap after each flood of bodies is over."""
    if malloc_trim is None:
        return
    trim = malloc_trim
    while True:
        await sleep_to_tick(interval_s)
        if should_trim(budget):
            budget.high_since_trim = budget.held
            budget.trims += 1
            released = await trio.to_thread.run_sync(trim, 0)
            log.debug("heap trimmed after a flood of request bodies (released: %s)", bool(released))
