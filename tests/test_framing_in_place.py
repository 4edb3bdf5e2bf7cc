"""The short path of a receive with no deadline over a socket (``FramedStream.receive``,
``SealedStream.receive``): a lone frame that one read brings whole is waited for, read,
unframed and opened in one coroutine. Whatever else a hostile sender writes (a frame split
across reads, several in one, bytes after one, a length that lies, an early end, a forged
or replayed seal) must end exactly as on the general path: each case below passes on the
tree before the short path too (``/tmp/wt-base`` on 2026-12-07), except the first, which
checks the short path is taken."""

from __future__ import annotations

import math
import os
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
from turn_helpers import gives_a_turn

from p2p.errors import FrameTooLarge, ProtocolError, StreamClosed
from p2p.framing import FramedStream, has_socket_under
from p2p.sealed import TAG_BYTES, SealedStream, Sealer

KEY = bytes(range(32))
LIMIT = 1024


def frame(payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + payload


@asynccontextmanager
async def hostile_pair() -> AsyncIterator[tuple[trio.SocketStream, FramedStream]]:
    """A raw socket end the test writes any bytes into, and a framed reader on the other."""
    s1, s2 = trio.socket.socketpair()
    writer = trio.SocketStream(s1)
    reader = FramedStream.over_socket(trio.SocketStream(s2), max_frame_size=LIMIT)
    try:
        yield writer, reader
    finally:
        await reader.reset()
        await writer.aclose()


async def write_in_pieces(writer: trio.SocketStream, pieces: list[bytes], then_close: bool) -> None:
    for piece in pieces:
        await writer.send_all(piece)
        await trio.sleep(0.02)  # each piece its own read
    if then_close:
        await writer.send_eof()


def test_a_trio_socket_is_read_in_place() -> None:
    """If a trio upgrade moves the standard socket, this fails instead of every link silently
    taking the slower general path."""
    s1, s2 = trio.socket.socketpair()
    with s1, s2:
        assert has_socket_under(trio.SocketStream(s1))


async def test_a_lone_frame_takes_the_short_path(monkeypatch: pytest.MonkeyPatch) -> None:
    general = []
    real = FramedStream._read_frame

    async def counted(self: FramedStream) -> bytes:
        general.append(1)
        return await real(self)

    monkeypatch.setattr(FramedStream, "_read_frame", counted)
    async with hostile_pair() as (writer, reader), trio.open_nursery() as nursery:
        with trio.fail_after(5):
            for i in range(3):
                nursery.start_soon(write_in_pieces, writer, [frame(b"step %d" % i)], False)
                assert await reader.receive(math.inf) == b"step %d" % i
    assert general == []


SPLIT = os.urandom(300)


@pytest.mark.parametrize(
    ("pieces", "frames", "ends_with"),
    [
        ([frame(SPLIT)[:100], frame(SPLIT)[100:]], [SPLIT], StreamClosed),  # split across reads
        ([frame(SPLIT)[:4], frame(SPLIT)[4:]], [SPLIT], StreamClosed),  # the header alone first
        ([frame(SPLIT)[:2], frame(SPLIT)[2:]], [SPLIT], StreamClosed),  # part of the header
        ([frame(b"one") + frame(b"two")], [b"one", b"two"], StreamClosed),  # two in one read
        ([frame(b"one") + frame(b"two")[:3], frame(b"two")[3:]], [b"one", b"two"], StreamClosed),
        ([frame(b"")], [b""], StreamClosed),  # an empty frame
        ([frame(b"a" * LIMIT)], [b"a" * LIMIT], StreamClosed),  # at the limit
        ([struct.pack(">I", LIMIT + 1) + b"a" * (LIMIT + 1)], [], FrameTooLarge),  # over it
        ([struct.pack(">I", 0xFFFFFFFF) + b"a" * 10], [], FrameTooLarge),
        ([struct.pack(">I", 500) + b"a" * 100], [], ProtocolError),  # a length that lies: then the end
        ([frame(b"one") + b"\0\0\0"], [b"one"], ProtocolError),  # bytes after a frame: then the end
        ([b"\0\0"], [], ProtocolError),  # half a header, then the end
        ([], [], StreamClosed),  # the end at a frame boundary
    ],
)
async def test_whatever_a_sender_writes_ends_as_on_the_general_path(
    pieces: list[bytes], frames: list[bytes], ends_with: type[Exception]
) -> None:
    async with hostile_pair() as (writer, reader), trio.open_nursery() as nursery:
        with trio.fail_after(5):
            nursery.start_soon(write_in_pieces, writer, pieces, True)
            assert [await reader.receive(math.inf) for _ in frames] == frames
            with pytest.raises(ends_with):
                await reader.receive(math.inf)
            if ends_with is StreamClosed:  # a clean end: the peer may still wait for our reply
                assert not reader.is_broken
                await reader.send(b"reply", 1.0)
                assert await writer.receive_some(100) == frame(b"reply")
            else:  # a protocol error resets the stream
                assert reader.is_broken
                with pytest.raises(StreamClosed):
                    await reader.receive(math.inf)


async def test_a_frame_already_waiting_is_read_after_a_turn() -> None:
    """A peer flooding the socket cannot hold the event loop: the short path's wait ends the
    turn even when data is there (frames then cut from what that read brought ahead take
    none, as on the general path: at most one read's worth)."""
    async with hostile_pair() as (writer, reader):
        with trio.fail_after(5):
            await writer.send_all(frame(b"one") + frame(b"two"))
            await trio.sleep(0.05)
            assert await gives_a_turn(lambda: reader.receive(math.inf))
            assert await reader.receive(math.inf) == b"two"
            await writer.send_all(frame(b"three"))
            await trio.sleep(0.05)
            assert await gives_a_turn(lambda: reader.receive(math.inf))


async def test_a_reader_cancelled_while_waiting_resets_the_stream() -> None:
    async with hostile_pair() as (writer, reader):
        with trio.fail_after(5):
            with trio.move_on_after(0.05):
                await reader.receive(math.inf)
            assert reader.is_broken
            with pytest.raises(StreamClosed):
                await reader.receive(math.inf)
            assert await writer.receive_some(100) == b""  # told: the socket was closed


async def test_a_reader_already_cancelled_leaves_the_stream_alone() -> None:
    async with hostile_pair() as (writer, reader):
        with trio.fail_after(5):
            with trio.CancelScope() as scope:
                scope.cancel()
                await reader.receive(math.inf)
            assert not reader.is_broken
            await writer.send_all(frame(b"still here"))
            assert await reader.receive(math.inf) == b"still here"


async def test_a_socket_closed_under_a_waiting_reader_is_never_read_through_a_reused_descriptor() -> None:
    s1, s2 = trio.socket.socketpair()
    tcp = trio.SocketStream(s2)
    reader = FramedStream.over_socket(tcp)
    async with trio.open_nursery() as nursery:
        failed = []

        async def read() -> None:
            try:
                failed.append(await reader.receive(math.inf))
            except StreamClosed:
                failed.append(StreamClosed)

        nursery.start_soon(read)
        await trio.testing.wait_all_tasks_blocked()
        await tcp.aclose()
        other1, other2 = trio.socket.socketpair()  # most likely given the closed descriptor
        with other1, other2:
            await other1.send(frame(b"not yours"))
            await trio.testing.wait_all_tasks_blocked()
            assert failed == [StreamClosed]
            assert await other2.recv(100) == frame(b"not yours")  # untouched, reused or not
    s1.close()


async def test_a_second_reader_waits_its_turn() -> None:
    async with hostile_pair() as (writer, reader), trio.open_nursery() as nursery:
        got: list[bytes] = []

        async def read() -> None:
            got.append(await reader.receive(math.inf))

        with trio.fail_after(5):
            nursery.start_soon(read)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(read)
            await trio.testing.wait_all_tasks_blocked()
            await writer.send_all(frame(b"first"))
            await trio.sleep(0.02)
            await writer.send_all(frame(b"second"))
    assert got == [b"first", b"second"]


@asynccontextmanager
async def sealed_hostile_pair() -> AsyncIterator[tuple[trio.SocketStream, SealedStream, Sealer]]:
    """A raw socket end, a sealed reader (the acceptor) on the other, and the dialer's
    sealer: what a ticket holder could seal."""
    async with hostile_pair() as (writer, reader):
        reader.max_frame_size = LIMIT + TAG_BYTES
        yield writer, SealedStream(reader, KEY, dialer=False, remote_peer="p"), Sealer(KEY, dialer_to_acceptor=True)


@pytest.mark.parametrize("attack", ["forged", "replayed", "shorter_than_its_tag", "reflected", "split"])
async def test_a_sealed_frame_that_does_not_open_resets_the_stream(attack: str) -> None:
    async with sealed_hostile_pair() as (writer, stream, sealer):
        with trio.fail_after(5):
            first = sealer.seal(b"first")
            await writer.send_all(frame(first))
            assert await stream.receive(math.inf) == b"first"
            bad = {
                "forged": os.urandom(40),
                "replayed": first,
                "shorter_than_its_tag": b"x" * (TAG_BYTES - 1),
                "reflected": Sealer(KEY, dialer_to_acceptor=False).seal(b"second"),
                "split": None,
            }[attack]
            if bad is None:  # a good frame in two reads still opens
                second = frame(sealer.seal(b"second"))
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(write_in_pieces, writer, [second[:10], second[10:]], False)
                    assert await stream.receive(math.inf) == b"second"
                return
            await writer.send_all(frame(bad))
            with pytest.raises(ProtocolError):
                await stream.receive(math.inf)
            assert stream.is_broken
            with pytest.raises(StreamClosed):
                await stream.receive(math.inf)
