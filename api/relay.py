"""Items made by a task in the app's nursery, relayed to a response that may go away.

A streamed generation runs in the app's nursery, not in its response's task, so that a
response cancelled by its client still lets the generation clean up after itself (free the
session's KV cache on every stage). Nothing that task does may fail into that nursery: an
exception there ends the nursery, and every later request of the peer fails with "Nursery
is closed to new arrivals". The client leaving is the common case: when the response
stops, the producer is cancelled *before* the channel closes (closing a receive channel
with ``async with`` takes a checkpoint, and a producer that ran in it found the channel
closed: ``BrokenResourceError`` in an error handler, and the peer's API was gone), and an
item offered to a response that has gone cancels the producer instead of raising.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import trio

log = logging.getLogger(__name__)

T = TypeVar("T")

Offer = Callable[[T], None]
"""Queue an item for the response (never blocks, never raises)."""


async def relay(nursery: trio.Nursery, produce: Callable[[Offer[T]], Awaitable[None]]) -> AsyncIterator[T]:
    """Run ``produce(offer)`` in ``nursery``; yield what it offers, until it returns.

    The producer is started on the first iteration and cancelled when the iteration stops
    early; whatever it raises is logged, never raised into ``nursery``. Items are buffered
    without a bound: the producer is a generation, bounded by its request's ``max_tokens``.
    """
    send, receive = trio.open_memory_channel[T](math.inf)
    scope = trio.CancelScope()

    def offer(item: T) -> None:
        try:
            send.send_nowait(item)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            scope.cancel()  # the response has gone: nothing made from here on has a reader

    async def run() -> None:
        with scope:
            try:
                await produce(offer)
            except Exception:  # noqa: BLE001 - a failure here would end the app's nursery
                log.exception("a streamed response's producer failed")
            finally:
                send.close()

    nursery.start_soon(run)
    try:
        async for item in receive:
            yield item
    finally:
        scope.cancel()  # first: no checkpoint between this and the close below
        receive.close()
