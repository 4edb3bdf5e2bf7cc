"""Frames sealed with a shared key: the record layer of the direct data plane.

A :class:`SealedStream` is a :class:`~p2p.framing.FramedStream` whose every payload is
ChaCha20-Poly1305 (IETF) ciphertext under a 32-byte key that the two ends agreed over a
Noise-authenticated libp2p stream (:mod:`p2p.direct`). ``cryptography`` (OpenSSL) does the
work: the same cipher as libsodium's ``crypto_aead_chacha20poly1305_ietf``, with a third of
its per-call cost from Python (a small frame: ~2 against ~6 us to seal, more right after an
engine call has emptied the caches), which every hop pays twice.

Nonces are never sent: each direction counts its frames, and the 12-byte nonce is the
direction (who dialed) followed by the frame's number. So one key serves both directions
without a nonce ever repeating, and a frame replayed, dropped, reordered or reflected back
fails authentication, which resets the stream like any other protocol error. The length
prefix is not authenticated by itself, but a forged one splits the ciphertext where no tag
verifies. A stream stops after 2**64 frames (it never gets there).
"""

from __future__ import annotations

import struct
from collections.abc import Coroutine
from types import TracebackType
from typing import Any

import trio
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from inclavate.turns import QuickLock
from inclavate.types import PeerId
from p2p.errors import FrameTooLarge, ProtocolError
from p2p.framing import FramedStream

KEY_BYTES = 32
TAG_BYTES = 16
_NONCE = struct.Struct("<4sQ")
_MAX_COUNTER = 2**64 - 1


class Sealer:
    """Seals (or opens) the frames of one direction, in order."""

    def __init__(self, key: bytes, *, dialer_to_acceptor: bool) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"a key is {KEY_BYTES} bytes, got {len(key)}")
        self._cipher = ChaCha20Poly1305(bytes(key))
        self._direction = b"\x01\0\0\0" if dialer_to_acceptor else b"\x02\0\0\0"
        self._counter = 0

    def _next_nonce(self) -> bytes:
        if self._counter >= _MAX_COUNTER:
            raise ProtocolError("a sealed stream ran out of nonces")
        nonce = _NONCE.pack(self._direction, self._counter)
        self._counter += 1
        return nonce

    def seal(self, plaintext: bytes) -> bytes:
        return self._cipher.encrypt(self._next_nonce(), plaintext, None)

    def open(self, ciphertext: bytes) -> bytes:
        """The plaintext, or :class:`ProtocolError` if the frame is not the next one sealed
        with our key in this direction (forged, replayed, reordered, truncated)."""
        if len(ciphertext) < TAG_BYTES:
            raise ProtocolError("a sealed frame is shorter than its tag")
        try:
            return self._cipher.decrypt(self._next_nonce(), ciphertext, None)
        except InvalidTag:
            raise ProtocolError("a sealed frame failed authentication") from None


class SealedStream:
    """The :class:`FramedStream` interface over a framed stream of sealed payloads.

    The remote peer's identity is the one the key was agreed with over Noise: only it (and
    we) can seal a frame that opens here.
    """

    def __init__(self, inner: FramedStream, key: bytes, *, dialer: bool, remote_peer: PeerId,
                 transport: trio.abc.AsyncResource | None = None) -> None:  # fmt: skip
        self._inner = inner
        self._transport = transport
        """Closed after a graceful close too (a socket's FIN alone leaves its descriptor open)."""
        self._out = Sealer(key, dialer_to_acceptor=dialer)
        self._in = Sealer(key, dialer_to_acceptor=not dialer)
        self._send_lock = QuickLock()  # seal and write in one order: the nonce counts frames
        # No receive lock of our own: the inner stream hands out frames one receiver at a
        # time, and opens each (``opener``) before its receiver yields, so nonces are taken
        # in order.
        inner.opener = self._in.open
        self.remote_peer = remote_peer

    @property
    def max_frame_size(self) -> int:
        return self._inner.max_frame_size - TAG_BYTES

    @max_frame_size.setter
    def max_frame_size(self, value: int) -> None:
        self._inner.max_frame_size = value + TAG_BYTES

    @property
    def max_receive_size(self) -> int | None:
        inner = self._inner.max_receive_size
        return None if inner is None else inner - TAG_BYTES

    @max_receive_size.setter
    def max_receive_size(self, value: int | None) -> None:
        self._inner.max_receive_size = None if value is None else value + TAG_BYTES

    @property
    def is_broken(self) -> bool:
        return self._inner.is_broken

    async def send(self, payload: bytes, timeout: float) -> None:
        """As :meth:`FramedStream.send`; the deadline covers the wait for our lock too."""
        await self.send_many([payload], timeout)

    async def send_many(self, payloads: list[bytes], timeout: float) -> None:
        """As :meth:`FramedStream.send_many`: each payload sealed as its own frame (nonces in
        order), the burst handed to the framed stream at once so it leaves in few writes."""
        for payload in payloads:
            if len(payload) > self.max_frame_size:  # refused before a nonce is spent on it
                raise FrameTooLarge(len(payload), self.max_frame_size)
        started = trio.current_time()
        async with self._send_lock:
            sealed = [self._out.seal(bytes(payload)) for payload in payloads]
            try:
                await self._inner.send_many(sealed, max(0.0, timeout - (trio.current_time() - started)))
            except BaseException:
                # Nonces were spent on frames that may never be written (a cancel while the
                # framed stream's lock was held elsewhere): the next frame would go out under
                # a nonce the peer does not expect. Fail the stream now, not at the peer.
                await self._inner.reset()
                raise

    @property
    def has_unsent(self) -> bool:
        return bool(self._inner.unsent)  # not through the inner property: a call a frame

    def send_nowait(self, payload: bytes) -> bool:
        """As :meth:`FramedStream.send_nowait`; a nonce is spent only on a frame committed
        (or on a stream whose write failed, which is then reset)."""
        if self._send_lock.held:
            return False
        return self._inner.send_nowait(payload, self._out.seal, TAG_BYTES)

    def receive(self, timeout: float) -> Coroutine[Any, Any, bytes]:
        """As :meth:`FramedStream.receive`, which opens the frame itself (its ``opener``):
        a frame that is not the next one sealed for us raises :class:`ProtocolError` and
        resets the stream. Not a coroutine of its own: the inner one is returned to be
        awaited, which spares a frame's wrapper call and resumption (two Python calls at
        every hop of every token)."""
        return self._inner.receive(timeout)

    async def close(self) -> None:
        try:
            await self._inner.close()
        finally:
            if self._transport is not None:
                await trio.aclose_forcefully(self._transport)

    async def reset(self) -> None:
        await self._inner.reset()

    async def __aenter__(self) -> SealedStream:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:  # fmt: skip
        if exc is None:
            await self.close()
        else:
            await self.reset()
