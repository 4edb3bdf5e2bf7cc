"""A streamed response's producer runs in the app's nursery: whatever its client does, the
producer must end and nothing may fail into that nursery (api.relay)."""

from __future__ import annotations

import logging

import pytest
import trio

from api.relay import Offer, relay


async def test_items_arrive_in_order_and_the_iteration_ends_with_the_producer() -> None:
    async def produce(offer: Offer[int]) -> None:
        for i in range(5):
            offer(i)
            await trio.sleep(0)

    async with trio.open_nursery() as nursery:
        assert [item async for item in relay(nursery, produce)] == [0, 1, 2, 3, 4]


async def test_a_client_leaving_while_the_producer_is_runnable_cancels_it_and_fails_nothing() -> None:
    """The race that took a peer's API down: the response stopped while the producer was
    ready to run, the producer found the channel closed, and its error handler's send raised
    into the app's nursery ("Nursery is closed to new arrivals" for every later request)."""
    ended = trio.Event()

    async def produce(offer: Offer[int]) -> None:
        try:
            i = 0
            while True:
                try:
                    offer(i)
                except Exception:  # noqa: BLE001 - what the chat route's producer does with a failure
                    offer(-1)
                    raise
                i += 1
                await trio.lowlevel.cancel_shielded_checkpoint()  # runnable at every turn
                await trio.lowlevel.checkpoint()
        finally:
            ended.set()

    async with trio.open_nursery() as nursery:
        for _ in range(20):
            ended = trio.Event()
            stream = relay(nursery, produce)
            async for item in stream:
                if item == 3:
                    break
            await stream.aclose()
            with trio.fail_after(5):
                await ended.wait()


async def test_an_offer_after_the_client_left_cancels_the_producer_instead_of_raising() -> None:
    left, offered = trio.Event(), []

    async def produce(offer: Offer[str]) -> None:
        offer("first")
        with trio.CancelScope(shield=True):
            await left.wait()  # the client leaves meanwhile; the producer does not notice yet
        offer("late")  # no reader any more: must not raise
        offered.append("late")
        await trio.sleep_forever()  # cancelled here, not left running

    async with trio.open_nursery() as nursery:
        stream = relay(nursery, produce)
        assert await stream.__anext__() == "first"
        await stream.aclose()
        left.set()
    assert offered == ["late"]


async def test_a_producer_that_raises_is_logged_and_the_nursery_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    async def produce(offer: Offer[int]) -> None:
        offer(1)
        raise RuntimeError("a bug")

    with caplog.at_level(logging.ERROR, logger="api.relay"):
        async with trio.open_nursery() as nursery:
            assert [item async for item in relay(nursery, produce)] == [1]
            nursery.start_soon(trio.sleep, 0)  # still open to new tasks
    assert "producer failed" in caplog.text and "a bug" in caplog.text
