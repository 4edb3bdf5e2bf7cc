"""FramedStream over in-memory and socket stream pairs: integrity, deadlines, bad frames."""

from __future__ import annotations

import os
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from turn_helpers import gives_a_turn

from p2p.errors import FrameTooLarge, ProtocolError, StreamClosed, StreamError, StreamTimeout
from p2p.framing import FramedStream

MiB = 1024 * 1024


def memory_pair(max_frame_size: int = 1 << 28) -> tuple[FramedStream, FramedStream]:
    left, right = trio.testing.memory_stream_pair()
    return (FramedStream.over_trio(left, max_frame_size=max_frame_size),
            FramedStream.over_trio(right, max_frame_size=max_frame_size))


def lockstep_pair() -> tuple[FramedStream, FramedStream]:
    """No buffering at all: a send blocks until the other side reads, like a full window."""
    left, right = trio.testing.lockstep_stream_pair()
    return FramedStream.over_trio(left), FramedStream.over_trio(right)


@pytest.mark.parametrize("size", [0, 1, 64 * 1024, 4 * MiB, 32 * MiB])
async def test_payloads_arrive_intact(size: int) -> None:
    a, b = memory_pair()
    payload = os.urandom(size)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(a.send, payload, 10.0)
            received = await b.receive(10.0)
    assert received == payload


async def test_frames_keep_their_boundaries_and_order() -> None:
    a, b = memory_pair()
    payloads = [os.urandom(n) for n in (3, 0, 70_000, 5)]
    with trio.fail_after(5):
        for p in payloads:
            await a.send(p, 1.0)
        assert [await b.receive(1.0) for _ in payloads] == payloads


async def test_a_burst_of_frames_keeps_boundaries_in_few_writes() -> None:
    writes: list[int] = []
    left, right = trio.testing.memory_stream_pair()
    a, b = FramedStream.over_trio(left), FramedStream.over_trio(right)
    write = a._raw.write

    async def counted(data: bytes) -> None:
        writes.append(len(data))
        await write(data)

    a._raw.write = counted  # type: ignore[method-assign]
    payloads = [os.urandom(n) for n in (3, 0, 2_000, 70_000, 5, *[40_000] * 3)]
    with trio.fail_after(5):
        await a.send_many(payloads, 1.0)
        assert [await b.receive(1.0) for _ in payloads] == payloads
    # small frames joined up to the coalescing limit; the large one in two writes
    assert len(writes) == 5


async def test_concurrent_senders_do_not_interleave() -> None:
    a, b = memory_pair()
    # Above the coalescing limit each frame is two writes: without the lock, a second
    # sender could slip its header between another's header and payload.
    payloads = {bytes([i]) * 100_000 for i in range(12)}
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            for p in payloads:
                nursery.start_soon(a.send, p, 5.0)
        got = {await b.receive(1.0) for _ in payloads}
    assert got == payloads


async def test_stalled_receiver_times_out_sender_within_deadline() -> None:
    a, b = lockstep_pair()
    start = trio.current_time()
    with trio.fail_after(5), pytest.raises(StreamTimeout):
        await a.send(os.urandom(4 * MiB), 0.3)
    assert 0.25 < trio.current_time() - start < 1.0
    assert a.is_broken
    # The reset reached the reader: it fails at once instead of waiting for a frame.
    # (A trio stream has no RST: the reader sees EOF, possibly after a partial header.)
    with trio.fail_after(2), pytest.raises(StreamError):
        await b.receive(10.0)
    with pytest.raises(StreamClosed):
        await a.send(b"again", 1.0)


async def test_stalled_socket_receiver_times_out_sender() -> None:
    # A real socket: kernel buffers absorb the first few hundred KiB, then it stalls.
    s1, s2 = trio.socket.socketpair()
    a = FramedStream.over_trio(trio.SocketStream(s1))
    b = FramedStream.over_trio(trio.SocketStream(s2))
    with trio.fail_after(5), pytest.raises(StreamTimeout):
        await a.send(os.urandom(32 * MiB), 0.3)
    # What was buffered is readable, then the stream ends mid-frame.
    with trio.fail_after(5), pytest.raises(StreamError):
        await b.receive(5.0)


async def test_receive_timeout_resets_for_both_sides() -> None:
    a, b = memory_pair()
    with trio.fail_after(5):
        with pytest.raises(StreamTimeout):
            await b.receive(0.1)
        with pytest.raises(StreamClosed):
            await a.receive(2.0)


async def test_oversize_send_is_refused_and_stream_survives() -> None:
    a, b = memory_pair(max_frame_size=1000)
    with pytest.raises(FrameTooLarge):
        await a.send(b"x" * 1001, 1.0)
    with trio.fail_after(2):
        await a.send(b"y" * 1000, 1.0)
        assert await b.receive(1.0) == b"y" * 1000


async def test_oversize_header_is_rejected_before_allocating() -> None:
    left, right = trio.testing.memory_stream_pair()
    b = FramedStream.over_trio(right, max_frame_size=MiB)
    # Announce 4 GiB - 1 and send nothing more: a reader that trusted the header would
    # allocate or wait for it; ours refuses on the header alone.
    await left.send_all(struct.pack(">I", 0xFFFFFFFF))
    with trio.fail_after(2), pytest.raises(FrameTooLarge) as info:
        await b.receive(1.0)
    assert info.value.size == 0xFFFFFFFF
    assert b.is_broken


@pytest.mark.parametrize("sent", [b"\x00\x00", struct.pack(">I", 100) + b"x" * 10])
async def test_eof_mid_frame_is_a_protocol_error(sent: bytes) -> None:
    left, right = trio.testing.memory_stream_pair()
    b = FramedStream.over_trio(right)
    await left.send_all(sent)
    await left.send_eof()
    with trio.fail_after(2), pytest.raises(ProtocolError):
        await b.receive(1.0)


async def test_clean_close_then_reply() -> None:
    client, server = memory_pair()
    with trio.fail_after(5):
        await client.send(b"request", 1.0)
        await client.close()
        assert await server.receive(1.0) == b"request"
        with pytest.raises(StreamClosed):
            await server.receive(1.0)
        # The peer only half-closed: the server can still answer, the client still read.
        await server.send(b"reply", 1.0)
        assert await client.receive(1.0) == b"reply"
        with pytest.raises(StreamClosed):
            await client.send(b"late", 1.0)


async def test_cancel_mid_frame_resets() -> None:
    a, b = lockstep_pair()
    with trio.fail_after(5):
        with trio.move_on_after(0.1):
            await a.send(os.urandom(MiB), 10.0)
        assert a.is_broken
        with pytest.raises(StreamError):
            await b.receive(1.0)


async def test_context_manager_resets_on_error() -> None:
    a, b = memory_pair()
    with trio.fail_after(5):
        with pytest.raises(RuntimeError):
            async with a:
                raise RuntimeError("boom")
        with pytest.raises(StreamClosed):
            await b.receive(1.0)


class CountedReads:
    """A byte stream handing out what was written to it, at most ``piece`` bytes per read."""

    def __init__(self, data: bytes, piece: int) -> None:
        self.data, self.piece, self.reads = data, piece, 0

    async def read(self, max_bytes: int) -> bytes:
        await trio.lowlevel.checkpoint()
        self.reads += 1
        n = min(max_bytes, self.piece)
        out, self.data = self.data[:n], self.data[n:]
        return out

    async def write(self, data: bytes) -> None:
        raise AssertionError("read-only")

    async def close(self) -> None:
        pass

    async def reset(self) -> None:
        pass


def frames(*payloads: bytes) -> bytes:
    return b"".join(struct.pack(">I", len(p)) + p for p in payloads)


async def test_frames_that_arrive_in_one_read_come_out_one_at_a_time() -> None:
    payloads = [os.urandom(n) for n in (1400, 0, 7, 1400, 3000)]
    raw = CountedReads(frames(*payloads), piece=1 << 20)
    stream = FramedStream(raw)
    with trio.fail_after(2):
        assert [await stream.receive(1.0) for _ in payloads] == payloads
        # One read brought them all; what was read ahead never leaks into a later frame.
        assert raw.reads == 1
        with pytest.raises(StreamClosed):
            await stream.receive(1.0)


class ChunkedReads(CountedReads):
    """Hands out the given chunks, one per read (however much the reader asks for)."""

    def __init__(self, *chunks: bytes) -> None:
        super().__init__(b"", piece=0)
        self.chunks = list(chunks)

    async def read(self, max_bytes: int) -> bytes:
        await trio.lowlevel.checkpoint()
        self.reads += 1
        return self.chunks.pop(0) if self.chunks else b""


async def test_frames_each_brought_whole_by_a_read_or_cut_anywhere_come_out_intact() -> None:
    """A read that brings exactly one frame is cut directly; any other read is buffered."""
    one, empty, seven, three = os.urandom(1400), b"", os.urandom(7), os.urandom(3)
    tail = frames(seven, three)
    stream = FramedStream(ChunkedReads(frames(one), frames(empty), tail[:13], tail[13:], frames(one)))
    with trio.fail_after(2):
        assert [await stream.receive(1.0) for _ in range(5)] == [one, empty, seven, three, one]
        with pytest.raises(StreamClosed):
            await stream.receive(1.0)


async def test_an_oversize_frame_brought_whole_by_one_read_is_refused() -> None:
    stream = FramedStream(ChunkedReads(frames(os.urandom(200))), max_frame_size=100)
    with trio.fail_after(2), pytest.raises(FrameTooLarge):
        await stream.receive(1.0)


@pytest.mark.parametrize("piece", [1, 3, 5, 1404])
async def test_a_frame_split_across_reads_is_put_back_together(piece: int) -> None:
    payloads = [os.urandom(1400), os.urandom(2), os.urandom(9000)]
    stream = FramedStream(CountedReads(frames(*payloads), piece=piece))
    with trio.fail_after(5):
        assert [await stream.receive(1.0) for _ in payloads] == payloads


async def test_read_ahead_then_an_end_mid_frame_is_a_protocol_error() -> None:
    whole, cut = os.urandom(100), frames(os.urandom(100))[:50]
    stream = FramedStream(CountedReads(frames(whole) + cut, piece=1 << 20))
    with trio.fail_after(2):
        assert await stream.receive(1.0) == whole
        with pytest.raises(ProtocolError):
            await stream.receive(1.0)


async def test_a_receive_cancelled_before_it_starts_leaves_the_stream_usable() -> None:
    a, b = memory_pair()
    with trio.fail_after(2):
        with trio.CancelScope() as scope:
            scope.cancel()
            await b.receive(1.0)
        assert not b.is_broken
        await a.send(b"after", 1.0)
        assert await b.receive(1.0) == b"after"


async def test_receivers_waiting_on_the_lock_each_get_one_whole_frame() -> None:
    a, b = memory_pair()
    got: list[bytes] = []

    async def take_one() -> None:
        got.append(await b.receive(2.0))

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(take_one)
            await trio.testing.wait_all_tasks_blocked()
            await a.send_many([b"x" * 10, b"y" * 20, b"z" * 30], 1.0)  # one write: all read ahead at once
    assert sorted(got) == [b"x" * 10, b"y" * 20, b"z" * 30]


async def test_a_large_frame_in_small_reads_is_held_at_most_twice() -> None:
    """A sender trickling a frame at the size limit in small pieces gets it buffered, then
    copied out once: no third copy of a frame a stranger chose the size of."""
    import tracemalloc

    size = 16 * MiB
    data = frames(os.urandom(size))
    stream = FramedStream(CountedReads(data, piece=64 * 1024), max_frame_size=size)
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        with trio.fail_after(10):
            got = await stream.receive(5.0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(got) == size
    # ``data`` itself is not traced (allocated before start); the buffer plus the frame
    # handed out is 2x, plus the reads in flight.
    assert peak < 2.5 * size, peak / size


@asynccontextmanager
async def socket_pair() -> AsyncIterator[tuple[FramedStream, FramedStream]]:
    s1, s2 = trio.socket.socketpair()
    a, b = FramedStream.over_socket(trio.SocketStream(s1)), FramedStream.over_socket(trio.SocketStream(s2))
    try:
        yield a, b
    finally:
        await a.reset()
        await b.reset()


@pytest.mark.parametrize("size", [0, 1200, 4 * MiB, 32 * MiB])
async def test_frames_cross_a_socket_read_and_written_in_place(size: int) -> None:
    """Larger than the kernel's buffers: the writer waits for room while the reader reads."""
    payloads = [os.urandom(size), b"after"]
    async with socket_pair() as (a, b), trio.open_nursery() as nursery:
        with trio.fail_after(20):
            nursery.start_soon(a.send_many, payloads, 20.0)
            assert [await b.receive(20.0), await b.receive(20.0)] == payloads
            await b.send(b"back", 5.0)
            assert await a.receive(5.0) == b"back"


async def test_a_socket_write_the_kernel_takes_needs_no_scheduler_turn() -> None:
    async with socket_pair() as (a, b):
        with trio.fail_after(5):
            assert not await gives_a_turn(lambda: a.send(b"x" * 1200, 5.0))
            assert await b.receive(5.0) == b"x" * 1200


async def test_a_frame_reaching_an_idle_socket_is_read_without_a_failed_read_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """A lone decode step finds its socket empty: the reader waits first, and spends no
    system call and exception learning that nothing is there yet."""
    import p2p.framing

    failed, real_read = [], os.read

    def counting_read(fd: int, n: int) -> bytes:
        try:
            return real_read(fd, n)
        except BlockingIOError:
            failed.append(fd)
            raise

    async with socket_pair() as (a, b), trio.open_nursery() as nursery:
        monkeypatch.setattr(p2p.framing.os, "read", counting_read)
        with trio.fail_after(5):
            for i in range(3):
                nursery.start_soon(a.send, b"step %d" % i, 5.0)
                assert await b.receive(5.0) == b"step %d" % i
    assert failed == []


async def test_a_socket_read_that_finds_data_waiting_still_takes_a_turn() -> None:
    """A peer flooding the socket cannot hold the event loop: every frame read takes a turn."""
    async with socket_pair() as (a, b):
        with trio.fail_after(5):
            await a.send_many([b"one", b"two"], 5.0)
            await trio.sleep(0.05)
            assert await gives_a_turn(lambda: b.receive(5.0))


async def test_a_socket_closed_under_a_reader_or_writer_ends_the_stream() -> None:
    async with socket_pair() as (a, b):
        async with trio.open_nursery() as nursery:

            async def read() -> None:
                with pytest.raises(StreamClosed):
                    await b.receive(5.0)

            with trio.fail_after(5):
                nursery.start_soon(read)
                await trio.testing.wait_all_tasks_blocked()
                await b.reset()
        with trio.fail_after(5), pytest.raises(StreamError):
            await a.send(os.urandom(32 * MiB), 5.0)  # the other end is gone
        with pytest.raises(StreamClosed):
            await b.send(b"after reset", 1.0)


async def test_a_frame_committed_in_place_arrives_whole_even_when_the_kernel_takes_part() -> None:
    """``send_nowait`` writes what the kernel takes and keeps the rest for the next
    ``send_many``, which writes it before anything else: frames never tear or reorder."""
    async with socket_pair() as (a, b):
        with trio.fail_after(20):
            small = b"s" * 1200
            assert a.send_nowait(small)
            assert not a.has_unsent
            assert await b.receive(5.0) == small
            # Nobody reads: frames go in whole until the kernel's buffers take one in part.
            sent = 0
            while a.send_nowait(payload := os.urandom(60 * 1024)) and not a.has_unsent:
                sent += 1
            assert a.has_unsent, "the kernel took every frame whole"
            assert not a.send_nowait(b"x"), "a frame committed in part must finish first"
            async with trio.open_nursery() as nursery:
                nursery.start_soon(a.send_many, [b"after"], 20.0)  # writes the rest first
                for _ in range(sent):
                    assert len(await b.receive(20.0)) == 60 * 1024
                assert await b.receive(20.0) == payload
                assert await b.receive(20.0) == b"after"


async def test_a_frame_is_not_written_in_place_while_a_send_holds_the_stream() -> None:
    async with socket_pair() as (a, b), trio.open_nursery() as nursery:
        with trio.fail_after(20):
            nursery.start_soon(a.send_many, [os.urandom(8 * MiB)], 20.0)
            await trio.testing.wait_all_tasks_blocked()  # mid-write, waiting for room
            assert not a.send_nowait(b"overtaker")
            assert len(await b.receive(20.0)) == 8 * MiB
            assert a.send_nowait(b"then")
            assert await b.receive(5.0) == b"then"


async def test_a_failed_write_in_place_is_raised_by_the_next_send() -> None:
    async with socket_pair() as (a, b):
        with trio.fail_after(5):
            await b.reset()
            for _ in range(100):  # the first writes may still land in the kernel's buffer
                if not a.send_nowait(b"x" * 1200):
                    break
            else:
                raise AssertionError("writes to a closed peer kept succeeding")
            with pytest.raises(StreamError):
                await a.send(b"y", 1.0)


async def test_a_memory_stream_is_never_written_in_place() -> None:
    """Only a socket can be written without waiting; libp2p streams queue as before."""
    a, b = memory_pair()
    assert not a.send_nowait(b"x")
    await a.send(b"x", 1.0)
    assert await b.receive(1.0) == b"x"
