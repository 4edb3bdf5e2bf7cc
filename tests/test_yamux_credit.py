"""Yamux receive credit in halves of the window (``p2p.yamux_credit``): few updates, and a
sender that outruns the window still gets everything through."""

from __future__ import annotations

import pytest
import trio
from libp2p.stream_muxer.yamux.yamux import YamuxStream

from p2p.framing import FramedStream
from p2p.host import P2PHost
from test_host import running_hosts

PROTOCOL = "/inclavate/test-credit/1"
FRAMES, FRAME_BYTES = 600, 1000  # 600 KB: more than twice the 256 KiB initial window


async def _transfer(a: P2PHost, b: P2PHost, *, slow_reader: bool) -> list[bytes]:
    got: list[bytes] = []
    done = trio.Event()

    async def handler(stream: FramedStream, _remote: str) -> None:
        while len(got) < FRAMES:
            got.append(await stream.receive(timeout=20))
            if slow_reader and len(got) % 100 == 0:
                await trio.sleep(0.2)  # the sender meanwhile runs out of credit and waits
        done.set()

    b.set_stream_handler(PROTOCOL, handler)
    await a.connect(b.multiaddrs()[0])
    async with await a.new_stream(b.peer_id, PROTOCOL, timeout=10) as stream:
        for i in range(FRAMES):
            await stream.send(i.to_bytes(4, "big") * (FRAME_BYTES // 4), timeout=20)
        await done.wait()
    return got


async def test_small_reads_return_credit_in_halves_not_after_every_read(monkeypatch: pytest.MonkeyPatch) -> None:
    updates: list[int] = []
    original = YamuxStream.send_window_update

    async def counted(self: YamuxStream, increment: int, skip_lock: bool = False) -> None:
        updates.append(increment)
        await original(self, increment, skip_lock=skip_lock)

    monkeypatch.setattr(YamuxStream, "send_window_update", counted)
    with trio.fail_after(60):
        async with running_hosts(2) as (a, b):
            got = await _transfer(a, b, slow_reader=False)
    assert [int.from_bytes(frame[:4], "big") for frame in got] == list(range(FRAMES))
    # One update per read (the library's own rule) would be ~600 here; in halves of a
    # 256 KiB window, 600 KB need a handful (pubsub's idle chatter included).
    assert len(updates) <= 12, len(updates)


async def test_a_sender_beyond_the_window_waits_for_a_slow_reader_and_finishes() -> None:
    with trio.fail_after(60):
        async with running_hosts(2) as (a, b):
            got = await _transfer(a, b, slow_reader=True)
    assert [int.from_bytes(frame[:4], "big") for frame in got] == list(range(FRAMES))


async def test_a_sender_ignoring_the_window_breaks_nothing_and_credit_resumes_once_drained() -> None:
    """A hostile peer may send past the credit we gave: the stream still delivers every
    frame in order, and once the reader has drained it we credit the window again (none is
    owed while the overrun is buffered), so the stream does not stall afterwards."""
    receiving: list[YamuxStream] = []
    got: list[bytes] = []
    drained = trio.Event()

    async def handler(stream: FramedStream, _remote: str) -> None:
        receiving.append(stream._raw._stream.muxed_stream)  # type: ignore[attr-defined]
        while len(got) < 2 * FRAMES:
            got.append(await stream.receive(timeout=20))
            if len(got) == FRAMES:
                drained.set()

    with trio.fail_after(60):
        async with running_hosts(2) as (a, b):
            b.set_stream_handler(PROTOCOL, handler)
            await a.connect(b.multiaddrs()[0])
            async with await a.new_stream(b.peer_id, PROTOCOL, timeout=10) as stream:
                sender: YamuxStream = stream._raw._stream.muxed_stream  # type: ignore[attr-defined]
                sender.send_window = 1 << 30  # ignores flow control: never waits for credit
                for i in range(FRAMES):
                    await stream.send(i.to_bytes(4, "big") * (FRAME_BYTES // 4), timeout=20)
                await drained.wait()
                (receiver,) = receiving
                window = receiver.target_recv_window
                assert receiver.recv_window >= window // 2  # credited again after the overrun
                sender.send_window = receiver.recv_window  # honest from here on
                for i in range(FRAMES, 2 * FRAMES):
                    await stream.send(i.to_bytes(4, "big") * (FRAME_BYTES // 4), timeout=20)
                while len(got) < 2 * FRAMES:
                    await trio.sleep(0.01)
    assert [int.from_bytes(frame[:4], "big") for frame in got] == list(range(2 * FRAMES))
