"""Upload bodies: a streaming handler that falls behind makes the socket wait."""

from __future__ import annotations

import trio

from api.uploads import HIGH_WATER_BYTES, StreamedBody


async def test_the_socket_waits_for_a_streaming_reader_that_fell_behind() -> None:
    body = StreamedBody(None, None)
    await body.caught_up()  # nobody streams yet: never waits (a handler may read the body whole)
    body.append(b"first")
    assert await body.__anext__() == b"first"  # now a reader streams
    body.append(b"x" * (HIGH_WATER_BYTES + 1))
    waited = False
    with trio.move_on_after(0.2):
        await body.caught_up()
        waited = True
    assert not waited, "the socket side must wait while the reader is behind"
    async with trio.open_nursery() as nursery:
        released = trio.Event()

        async def socket_side() -> None:
            await body.caught_up()
            released.set()

        nursery.start_soon(socket_side)
        await trio.sleep(0.05)
        assert not released.is_set()
        assert len(await body.__anext__()) == HIGH_WATER_BYTES + 1
        with trio.fail_after(2):
            await released.wait()


async def test_a_body_read_whole_never_waits() -> None:
    body = StreamedBody(None, None)
    body.append(b"y" * (HIGH_WATER_BYTES * 2))
    with trio.fail_after(1):
        await body.caught_up()
    body.set_complete()
    assert len(await body) == HIGH_WATER_BYTES * 2
