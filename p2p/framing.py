"""Length-prefixed frames over a byte stream, with deadlines that never leave a peer hanging.

Wire format: each frame is a ``u32`` big-endian length followed by that many payload
bytes. Nothing else: no version byte, no checksum (Noise already authenticates every
byte). The read loop is our own because libp2p's helpers (``read_varint_prefixed_bytes``,
``read_exactly``) fail on messages above a few MiB, and a prefill's hidden states are
tens of MiB.

Failure rule, the point of this module: **a frame that was interrupted kills the
stream, on both ends.** A send or receive that misses its deadline, meets a transport
error, or is cancelled mid-frame resets the stream explicitly. This matters on yamux,
where a writer stalled on a full window gets an error but the reader is never told and
would wait forever; after our reset the reader's next ``receive`` raises
:class:`~p2p.errors.StreamClosed` instead. After any :class:`~p2p.errors.StreamError`
the stream is unusable and every later call raises ``StreamClosed``; the one exception
is a clean end of stream at a frame boundary, after which sending is still allowed
(the peer half-closed: it may still be waiting for our reply).

yamux caveat: a write blocked on a zero window for 5 s fails inside the library
whatever deadline we give, so a reader must keep reading; the ``timeout`` of
:meth:`FramedStream.send` is effectively capped at ~5 s of no progress.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import struct
import sys
from types import TracebackType
from collections.abc import Awaitable, Callable
from typing import Protocol

import trio
from libp2p.abc import INetStream
from libp2p.exceptions import BaseLibp2pError
from libp2p.network.stream.exceptions import StreamEOF

from inclavate.turns import QuickLock
from inclavate.types import PeerId
from p2p.errors import FrameTooLarge, ProtocolError, StreamClosed, StreamError, StreamTimeout

logger = logging.getLogger(__name__)

DEFAULT_MAX_FRAME_SIZE = 256 * 1024 * 1024
_HEADER = struct.Struct(">I")
# Reads are capped so a socket-backed stream never allocates a 32 MiB receive buffer
# for what arrives in 64 KiB pieces anyway.
_READ_CHUNK = 1024 * 1024
# Every read asks for at least this much: a small frame's header and payload (and the frames
# queued behind it) arrive in one read instead of two or more.
_READ_AHEAD = 64 * 1024
# Below this, header and payload go out in one write: one yamux/Noise frame instead of
# two, which is what a decode step (a few KiB, latency-bound) wants. Above it, two
# writes avoid copying a large payload just to prepend four bytes.
_COALESCE_LIMIT = 64 * 1024
# Most a frame written in place (send_nowait) may be: a decode step is a few KiB, and what the
# kernel does not take at once is copied to be written later.
_NOWAIT_LIMIT = 64 * 1024
# How long a best-effort FIN or RST may take before we give up on telling the peer.
_CLOSE_TIMEOUT = 1.0


class _NoDeadline:
    """What :func:`_deadline` gives for an unbounded call: entering a cancel scope costs
    ~7 us (more on caches an engine call left cold), at every frame of a link whose reader
    bounds its idle time itself (``p2p.forward``)."""

    cancelled_caught = False

    def __enter__(self) -> _NoDeadline:
        return self

    def __exit__(self, *_: object) -> bool:
        return False


_NO_DEADLINE = _NoDeadline()


def _deadline(timeout: float) -> trio.CancelScope | _NoDeadline:
    """A scope that ends the call ``timeout`` seconds from now; the caller checks
    ``cancelled_caught`` (trio's ``fail_after`` is this inside two generator-based context
    managers, which costs more per frame than the rest of the framing)."""
    if timeout == math.inf:
        return _NO_DEADLINE
    return trio.CancelScope(deadline=trio.current_time() + timeout)


def _writes(payloads: list[bytes]) -> list[bytes]:
    """The writes that carry ``payloads`` as frames: headers and small payloads joined up to
    ``_COALESCE_LIMIT``, a large payload written on its own (no copy to prepend a header)."""
    writes: list[bytes] = []
    pending: list[bytes] = []
    size = 0
    for payload in payloads:
        header = _HEADER.pack(len(payload))
        if len(payload) > _COALESCE_LIMIT:
            writes.append(b"".join([*pending, header]))
            writes.append(payload)
            pending, size = [], 0
            continue
        if pending and size + len(header) + len(payload) > _COALESCE_LIMIT:
            writes.append(b"".join(pending))
            pending, size = [], 0
        pending += [header, bytes(payload)]
        size += len(header) + len(payload)
    if pending:
        writes.append(b"".join(pending))
    return writes


class ByteStream(Protocol):
    """What :class:`FramedStream` needs from a transport.

    ``read`` returns at most ``max_bytes`` and ``b""`` only at a clean end of stream;
    transport failures (reset, broken connection) raise :class:`~p2p.errors.StreamClosed`.
    ``close`` is a graceful end of our sending side; ``reset`` aborts both directions.
    """

    async def read(self, max_bytes: int) -> bytes: ...
    async def write(self, data: bytes) -> None: ...
    async def close(self) -> None: ...
    async def reset(self) -> None: ...


class Libp2pByteStream:
    """A libp2p stream, its errors translated into ours at this one edge."""

    def __init__(self, stream: INetStream) -> None:
        self._stream = stream

    async def read(self, max_bytes: int) -> bytes:
        try:
            return await self._stream.read(max_bytes)
        except StreamEOF:
            return b""
        except (BaseLibp2pError, OSError, trio.BrokenResourceError) as exc:
            raise StreamClosed(f"stream broken while reading: {exc!r}") from exc

    async def write(self, data: bytes) -> None:
        try:
            await self._stream.write(data)
        except (BaseLibp2pError, OSError, trio.BrokenResourceError) as exc:
            raise StreamClosed(f"stream broken while writing: {exc!r}") from exc

    async def close(self) -> None:
        await self._stream.close()

    async def reset(self) -> None:
        await self._stream.reset()


class TrioByteStream:
    """A trio stream (socket, ``trio.testing`` pair) as a :class:`ByteStream`, for tests
    and for any non-libp2p link."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self._stream = stream

    async def read(self, max_bytes: int) -> bytes:
        try:
            return bytes(await self._stream.receive_some(max_bytes))
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise StreamClosed(f"stream broken while reading: {exc!r}") from exc

    async def write(self, data: bytes) -> None:
        try:
            await self._stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise StreamClosed(f"stream broken while writing: {exc!r}") from exc

    async def close(self) -> None:
        if isinstance(self._stream, trio.abc.HalfCloseableStream):
            await self._stream.send_eof()
        else:
            await self._stream.aclose()

    async def reset(self) -> None:
        await trio.aclose_forcefully(self._stream)


class SocketByteStream(TrioByteStream):
    """A TCP socket written and read in place: a call that the kernel can complete now takes
    no scheduler turn. trio's socket methods end every call with one, so a decode step
    crossing a hop waited behind every other runnable task once more for its write and once
    more after its read had already arrived. A read that found data without waiting still
    takes its turn, so a peer that floods the socket cannot hold the event loop.

    POSIX only (``os.read`` and ``os.write`` on the socket's descriptor); elsewhere
    :meth:`FramedStream.over_socket` uses :class:`TrioByteStream`. Graceful close and reset
    go through the trio stream as before."""

    def __init__(self, stream: trio.SocketStream) -> None:
        super().__init__(stream)
        self._socket = stream.socket
        self.fileno: Callable[[], int] = stream.socket._sock.fileno  # type: ignore[attr-defined]
        """The descriptor, asked at each system call, never kept: the standard socket under
        trio's answers -1 once closed (``os.read(-1)`` fails), so a closed socket is never
        read through a descriptor since reused elsewhere. Its C method, not trio's Python
        ``fileno``: one Python call fewer at every read, write and wait of every frame.
        :func:`has_socket_under` says whether a trio socket has it."""
        self.drained = True
        """The last read took less than it asked for: the socket is most likely empty, so
        the next read waits for data first instead of failing a ``read`` (a system call
        and an exception, ~10-20 us on caches an engine call left cold) to learn that. A
        lone decode step's frame always finds its socket empty."""

    async def read(self, max_bytes: int) -> bytes:
        waited = self.drained
        if waited:
            await self._wait(trio.lowlevel.wait_readable)  # stops a cancelled task, as any wait
        else:
            await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            try:
                data = os.read(self.fileno(), max_bytes)
            except BlockingIOError:
                await self._wait(trio.lowlevel.wait_readable)
                waited = True
                continue
            except OSError as exc:
                raise StreamClosed(f"stream broken while reading: {exc!r}") from exc
            self.drained = len(data) < max_bytes
            if not waited:
                await trio.lowlevel.cancel_shielded_checkpoint()
            return data

    async def write(self, data: bytes) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()
        with memoryview(data) as view:
            while view:
                try:
                    view = view[os.write(self.fileno(), view) :]
                except BlockingIOError:
                    await self._wait(trio.lowlevel.wait_writable)
                except OSError as exc:
                    raise StreamClosed(f"stream broken while writing: {exc!r}") from exc

    async def _wait(self, until: Callable[[trio.socket.SocketType], Awaitable[None]]) -> None:
        try:
            await until(self._socket)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise StreamClosed(f"stream closed while waiting: {exc!r}") from exc


def has_socket_under(stream: trio.SocketStream) -> bool:
    """Whether :class:`SocketByteStream` can read ``stream`` in place: POSIX, and trio's
    socket wraps a standard one where trio keeps it (``_sock``, trio 0.2x-0.3x;
    ``tests/test_framing.py`` fails if an upgrade moves it, rather than every link
    silently taking :class:`TrioByteStream`'s slower path)."""
    return sys.platform != "win32" and isinstance(getattr(stream.socket, "_sock", None), socket.socket)


class FramedStream:
    """Frames over one stream: at most one sender and one receiver on the wire at a time.

    Concurrent ``send`` calls queue on a lock (frames never interleave); so do concurrent
    ``receive`` calls. ``timeout`` is in seconds and covers the whole call, including the
    wait for the lock; ``math.inf`` waits forever (a server idle between requests).
    """

    def __init__(
        self,
        raw: ByteStream,
        *,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
        remote_peer: PeerId | None = None,
    ) -> None:
        if not 0 < max_frame_size <= 0xFFFFFFFF:
            raise ValueError(f"max_frame_size must be in 1..2**32-1, got {max_frame_size}")
        self._raw = raw
        self._fileno = raw.fileno if isinstance(raw, SocketByteStream) else None
        """A socket read and written in place by :meth:`receive`'s and :meth:`send_nowait`'s
        short paths (None: every frame takes the general one)."""
        self.opener: Callable[[bytes], bytes] | None = None
        """Applied to every frame received, inside :meth:`receive` (``p2p.sealed`` opens its
        frames here): a frame is waited for, read, unframed and opened in one coroutine, not
        through a wrapper's, whose call and resumption are two more Python calls at every
        frame of every hop on caches an engine call left cold. Its errors are the receive's:
        a :class:`ProtocolError` resets the stream."""
        self.max_frame_size = max_frame_size
        self.max_receive_size: int | None = None
        """Frames read are refused above this instead of ``max_frame_size`` (None: that),
        leaving what may be sent alone: a direction that owes us nothing (a link's back
        channel, a proof that is empty) is read at 0."""
        self.remote_peer = remote_peer
        self._send_lock = QuickLock()
        self._recv_lock = QuickLock()
        self._buffer = bytearray()
        """Bytes read past the last frame returned (at most one read's worth)."""
        self._broken: StreamError | None = None
        self.unsent = b""
        """The rest of a frame :meth:`send_nowait` committed; written before anything else
        (read, never written, outside this class)."""
        self._nowait_error: StreamError | None = None
        """A write in place failed: the next send raises it (and resets the stream)."""
        self._peer_finished = False  # clean EOF seen at a frame boundary
        self._local_finished = False  # we closed our sending side

    @classmethod
    def over_libp2p(cls, stream: INetStream, *, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
                    remote_peer: PeerId | None = None) -> FramedStream:
        return cls(Libp2pByteStream(stream), max_frame_size=max_frame_size,
                   remote_peer=remote_peer)

    @classmethod
    def over_trio(cls, stream: trio.abc.Stream, *, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
                  remote_peer: PeerId | None = None) -> FramedStream:
        return cls(TrioByteStream(stream), max_frame_size=max_frame_size,
                   remote_peer=remote_peer)

    @classmethod
    def over_socket(cls, stream: trio.SocketStream, *, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
                    remote_peer: PeerId | None = None) -> FramedStream:  # fmt: skip
        raw = SocketByteStream(stream) if has_socket_under(stream) else TrioByteStream(stream)
        return cls(raw, max_frame_size=max_frame_size, remote_peer=remote_peer)

    @property
    def is_broken(self) -> bool:
        return self._broken is not None

    async def send(self, payload: bytes, timeout: float) -> None:
        """Send one frame. Raises StreamTimeout, StreamClosed, or FrameTooLarge.

        An oversized payload is refused before anything is written, so unlike the other
        errors :class:`FrameTooLarge` from ``send`` leaves the stream usable.
        """
        await self.send_many([payload], timeout)

    @property
    def has_unsent(self) -> bool:
        """Part of a frame committed by :meth:`send_nowait` still waits to be written: the
        caller must see that :meth:`send_many` runs (with no payloads, it writes just that)."""
        return bool(self.unsent)

    def send_nowait(self, payload: bytes, seal: Callable[[bytes], bytes] | None = None,
                    overhead: int = 0) -> bool:  # fmt: skip
        """Commit one small frame to the stream now, with no wait and no scheduler turn,
        when nothing else is being sent (a decode step crossing an idle link). True: the frame
        is committed, all written or its rest in :attr:`has_unsent`. False: nothing was
        written (the stream is busy, cannot be written in place, or failed; then the next
        :meth:`send_many` raises the failure): send it the usual way.

        ``seal`` (``p2p.sealed``, which adds ``overhead`` bytes) is applied only once the
        frame will be committed, so a nonce is spent only on a frame committed, or on a
        stream whose write failed, which is then reset. One call checks, seals and writes:
        the checks, the commit and the raw stream's write were three layers at every hop."""
        fileno = self._fileno
        if (fileno is None or len(payload) + overhead > min(self.max_frame_size, _NOWAIT_LIMIT)
                or self._send_lock.held or self.unsent or self._broken is not None
                or self._nowait_error is not None or self._local_finished):  # fmt: skip
            return False
        if seal is not None:
            payload = seal(payload)
        data = _HEADER.pack(len(payload)) + payload
        try:
            written = os.write(fileno(), data)
        except BlockingIOError:
            written = 0
        except OSError as exc:
            self._nowait_error = StreamClosed(f"stream broken while writing: {exc!r}")
            return False
        if written < len(data):
            self.unsent = data[written:]
        return True

    async def send_many(self, payloads: list[bytes], timeout: float) -> None:
        """Send frames back to back; small ones leave in one write (one yamux/Noise frame
        for a burst of decode steps instead of one each), after the rest of a frame
        :meth:`send_nowait` committed. Errors as :meth:`send`."""
        for payload in payloads:
            if len(payload) > self.max_frame_size:
                raise FrameTooLarge(len(payload), self.max_frame_size)
        if self._local_finished:  # a caller bug, not a transport failure: no reset
            raise StreamClosed("send after close")
        started = False
        try:
            with _deadline(timeout) as deadline:
                async with self._send_lock:
                    self._check_usable()
                    if self._nowait_error is not None:
                        raise self._nowait_error
                    started = True
                    if self.unsent:
                        await self._raw.write(self.unsent)
                        self.unsent = b""
                    for write in _writes(payloads):
                        await self._raw.write(write)
            if deadline.cancelled_caught:
                raise await self._fail(StreamTimeout(f"send missed its {timeout:g}s deadline"))
        except StreamError as exc:
            await self._fail(exc)
            raise
        except BaseException:
            if started:  # cancelled from outside mid-frame: the peer holds half a frame
                await self._fail(StreamClosed("send cancelled mid-frame"))
            raise

    async def receive(self, timeout: float) -> bytes:
        """Receive one frame (opened by :attr:`opener` where set). Raises StreamTimeout,
        StreamClosed, or ProtocolError.

        The common case of a link, a reader with no deadline of its own (``p2p.forward``)
        on an idle socket, nobody else receiving, takes a short path in this one function:
        take the lock's flag, wait, read, and when the read brought exactly one whole frame
        of an allowed length, open it. At a hop that is ~15 Python calls a frame fewer than
        the general path's layers (lock protocol, ``_read_frame``, the raw stream's ``read``
        and ``_wait``). Anything else it read (part of a frame, several, a length over the
        limit, the end of the stream) goes to the general path with the bytes already in
        the buffer, so errors and what is kept for the next frame are the same."""
        fileno = self._fileno
        # A task already cancelled stops here, before it holds the lock (as entering it does).
        await trio.lowlevel.checkpoint_if_cancelled()
        if (fileno is None or timeout != math.inf or self._buffer or not self._raw.drained  # type: ignore[attr-defined]
                or not self._recv_lock.take_if_free()):  # fmt: skip
            return await self._receive(timeout)
        started = False
        try:
            try:
                if self._peer_finished or self._broken is not None:
                    self._may_receive()
                started = True
                fd = fileno()
                if fd < 0:
                    raise StreamClosed("the socket is closed")
                try:
                    await trio.lowlevel.wait_readable(fd)  # a descriptor closed meanwhile: woken, raises
                except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                    raise StreamClosed(f"stream closed while waiting: {exc!r}") from exc
                try:
                    chunk: bytes | None = os.read(fileno(), _READ_AHEAD)  # asked again: the wait was a turn
                except BlockingIOError:
                    chunk = None
                except OSError as exc:
                    raise StreamClosed(f"stream broken while reading: {exc!r}") from exc
                if chunk is None:  # woken with nothing to read: the general path waits again
                    frame = await self._read_frame()
                elif not chunk:
                    self._peer_finished = True
                    raise StreamClosed("the peer closed the stream")
                else:
                    self._raw.drained = len(chunk) < _READ_AHEAD  # type: ignore[attr-defined]
                    length = _HEADER.unpack_from(chunk)[0] if len(chunk) >= _HEADER.size else -1
                    limit = self.max_frame_size if self.max_receive_size is None else self.max_receive_size
                    if len(chunk) == _HEADER.size + length and 0 < length <= limit:
                        frame = chunk[_HEADER.size :]
                    else:  # part of a frame, several, a length refused, an empty frame, bytes after
                        self._buffer += chunk
                        frame = await self._read_frame()
            finally:
                self._recv_lock.release()
            opener = self.opener
            return frame if opener is None else opener(frame)
        except BaseException as exc:
            await self._after_failed_receive(exc, started)
            raise

    async def _receive(self, timeout: float) -> bytes:
        """:meth:`receive`'s general path: a deadline, another receiver, a stream that is
        not a socket, bytes already read ahead."""
        started = False
        try:
            if timeout == math.inf:  # a reader that bounds its idle time itself: no scope at all
                async with self._recv_lock:
                    started = self._may_receive()
                    frame = await self._read_frame()
                    return frame if self.opener is None else self.opener(frame)
            with trio.CancelScope(deadline=trio.current_time() + timeout):
                async with self._recv_lock:
                    started = self._may_receive()
                    frame = await self._read_frame()
                    return frame if self.opener is None else self.opener(frame)
            # Only reached when the deadline's scope ended the read (it returns otherwise).
            raise await self._fail(StreamTimeout(f"receive missed its {timeout:g}s deadline"))
        except BaseException as exc:
            await self._after_failed_receive(exc, started)
            raise

    async def _after_failed_receive(self, exc: BaseException, started: bool) -> None:
        """What a failed receive leaves: a stream error fails the stream (a clean close at a
        frame boundary is no failure: the send side stays), a cancel once it had started
        (the peer may be mid-frame) does too."""
        if isinstance(exc, StreamError):
            if not self._peer_finished:
                await self._fail(exc)
        elif started:
            await self._fail(StreamClosed("receive cancelled mid-frame"))

    async def close(self) -> None:
        """End our sending side gracefully; the peer's next receive sees a clean close.

        Receiving stays possible (a client may close and then read the reply). If the
        FIN cannot be sent within a second the stream is reset instead.
        """
        if self._broken is not None or self._local_finished:
            return
        with trio.move_on_after(_CLOSE_TIMEOUT) as scope:
            async with self._send_lock:
                self._local_finished = True
                try:
                    if self.unsent:
                        await self._raw.write(self.unsent)
                        self.unsent = b""
                    await self._raw.close()
                except Exception as exc:  # the peer is gone either way
                    logger.debug("graceful close failed, resetting: %r", exc)
                    await self._fail(StreamClosed("close failed"))
        if scope.cancelled_caught:
            await self._fail(StreamClosed("close timed out"))

    async def reset(self) -> None:
        """Abort both directions now; the peer's pending and next calls fail."""
        await self._fail(StreamClosed("the stream was reset locally"))

    async def __aenter__(self) -> FramedStream:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            await self.close()
        else:
            await self.reset()

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise StreamClosed(f"stream unusable: {self._broken}")

    def _may_receive(self) -> bool:
        """True, or StreamClosed when the peer has closed its side or the stream is broken."""
        if self._peer_finished:
            raise StreamClosed("the peer closed the stream")
        if self._broken is not None:  # _check_usable, without one more call a frame
            raise StreamClosed(f"stream unusable: {self._broken}")
        return True

    async def _read_frame(self) -> bytes:
        """The next frame's payload. A frame that one read brings whole, and nothing after it
        (a lone decode step's), is cut from that read directly."""
        if not self._buffer:
            chunk = await self._raw.read(_READ_AHEAD)
            if len(chunk) > _HEADER.size and len(chunk) == _HEADER.size + self._length(chunk):
                return chunk[_HEADER.size :]
            if not chunk:
                self._peer_finished = True
                raise StreamClosed("the peer closed the stream")
            self._buffer += chunk
        length = self._length(await self._read_exactly(_HEADER.size, at_boundary=True))
        return await self._read_exactly(length, at_boundary=False)

    def _length(self, header: bytes) -> int:
        """The payload length a frame's header (the start of ``header``) declares, refused
        above ``max_frame_size`` (``max_receive_size`` where set) before anything is
        allocated for it."""
        (length,) = _HEADER.unpack_from(header)
        limit = self.max_frame_size if self.max_receive_size is None else self.max_receive_size
        if length > limit:
            raise FrameTooLarge(length, limit)
        return length

    async def _read_exactly(self, n: int, *, at_boundary: bool) -> bytes:
        """``n`` bytes: first what an earlier read brought ahead, then reads of at least
        ``_READ_AHEAD`` (what arrives beyond ``n`` waits in the buffer for the next frame)."""
        buffer = self._buffer
        while len(buffer) < n:
            chunk = await self._raw.read(min(max(n - len(buffer), _READ_AHEAD), _READ_CHUNK))
            if not chunk:
                if at_boundary and not buffer:
                    self._peer_finished = True
                    raise StreamClosed("the peer closed the stream")
                raise ProtocolError(f"stream ended {len(buffer)} bytes into a {n}-byte read")
            if not buffer and len(chunk) == n:
                return chunk  # the common case of a large payload: no copy
            buffer += chunk
        with memoryview(buffer) as view:  # one copy out: a large frame is held twice at most
            data = bytes(view[:n])
        del buffer[:n]
        return data

    async def _fail(self, error: StreamError) -> StreamError:
        """Mark the stream dead and reset it (once), shielded: a stream we are abandoning
        because of a cancel must still be reset, or the peer waits forever."""
        if self._broken is None:
            self._broken = error
            with trio.CancelScope(shield=True), trio.move_on_after(_CLOSE_TIMEOUT):
                try:
                    await self._raw.reset()
                except Exception as exc:  # best effort; we are failing anyway
                    logger.debug("reset failed: %r", exc)
        return error

