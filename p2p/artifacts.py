"""``/inclavate/artifacts/1``: reach the artifact store of the peer that owns an id.

Any peer serves the artifact API; the bytes stay on the peer that created them (the id's
owner tag says which, :mod:`inclavate.owner_ids`), and the peer that got the request asks
the owner over this protocol. The messages are in :mod:`p2p.artifact_wire`.

The owner serves at most :data:`MAX_READS` reads and :data:`MAX_SMALL` other requests at
once, and at most :data:`MAX_READS_PER_PEER` / :data:`MAX_SMALL_PER_PEER` of them for any one
remote peer (more are refused as ``unavailable``, so the asker answers 503 rather than
queueing): one peer cannot hold the owner's capacity, and long reads cannot starve the short
requests. A read must also finish within :func:`read_deadline` (its length at
:data:`MIN_READ_RATE`, plus :data:`READ_GRACE_S`), so a reader that trickles is cut off
rather than holding its slot as long as it likes. An owner that fails (or cuts a read off)
mid-object resets the stream, so a reader never takes a short object for a whole one. The
asker counts the bytes against the announced length and resets the stream when its reader
stops early (the HTTP client left), so the owner stops sending at once. Any swarm peer may
ask: the spec's ownership is a single local principal, the same one any HTTP client of any
peer already is.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import trio

from inclavate.artifact_types import (
    ArtifactError,
    ArtifactMeta,
    ArtifactPage,
    ArtifactUnavailable,
    ListQuery,
    Usage,
)
from inclavate.artifacts import READ_CHUNK, ArtifactRead
from inclavate.byte_ranges import RangeMalformed, RangeNotSatisfiable
from inclavate.owner_ids import MalformedId
from inclavate.types import PeerId
from p2p.artifact_wire import (
    MAX_ANSWER_BYTES,
    MAX_REQUEST_BYTES,
    PROTOCOL,
    decode_answer,
    decode_meta,
    decode_page,
    decode_range,
    decode_request,
    decode_usage,
    encode,
    list_request,
    refusal,
)
from p2p.errors import P2PError, ProtocolError, StreamTimeout
from p2p.framing import FramedStream
from p2p.host import P2PHost

log = logging.getLogger(__name__)

__all__ = [
    "MAX_READS",
    "MAX_READS_PER_PEER",
    "MAX_SMALL",
    "MAX_SMALL_PER_PEER",
    "MIN_READ_RATE",
    "PROTOCOL",
    "READ_GRACE_S",
    "ReadTooSlow",
    "RemoteArtifacts",
    "RemoteChunks",
    "read_deadline",
    "serve_artifacts",
]

# The slot counts are read when serve_artifacts is called, the rate at each read (tests
# shorten them).
MAX_READS = 16
"""Read streams served at once, all remote peers together."""
MAX_READS_PER_PEER = 4
"""Read streams served at once to one remote peer: its HTTP clients share them (a page of
images downloaded through one peer), so fewer turns honest downloads away; more, and a few
identities hold the whole pool."""
MAX_SMALL = 16
"""``meta``/``list``/``usage``/``delete`` streams at once: a pool of their own, so reads
holding every read slot still leave the owner able to answer them."""
MAX_SMALL_PER_PEER = 4
MIN_READ_RATE = 128 * 1024
"""Bytes per second a read must average (1 Mbit/s); slower, it is cut off at its deadline."""
READ_GRACE_S = 30.0
"""Added to every read's deadline: the first frames, a slow start, a small object."""
_REQUEST_TIMEOUT = 10.0
_ANSWER_TIMEOUT = 30.0
_DATA_TIMEOUT = 30.0
_REFUSED = (ArtifactError, MalformedId, RangeMalformed, RangeNotSatisfiable)
"""What the owner answers as a typed refusal rather than resetting the stream."""


class LocalArtifacts(Protocol):
    """What the owner side needs: :class:`inclavate.artifacts.ArtifactStore`."""

    def meta(self, id_: str) -> ArtifactMeta: ...
    async def open(self, id_: str, range_header: str | None = None) -> ArtifactRead: ...
    async def delete(self, id_: str) -> ArtifactMeta: ...
    def list(self, query: ListQuery) -> ArtifactPage: ...
    def usage(self) -> Usage: ...


class ReadTooSlow(StreamTimeout):
    """A remote read missed its overall deadline (:func:`read_deadline`): the asker took
    the bytes slower than :data:`MIN_READ_RATE`. The owner resets the stream."""


def read_deadline(length: int) -> float:
    """Seconds a read of ``length`` bytes may hold its slot. Each frame also has its own
    30 s; this bounds the whole, so one frame every 29 s cannot keep a slot for hours."""
    return READ_GRACE_S + length / MIN_READ_RATE


class _Slots:
    """At most ``total`` streams at once, at most ``per_peer`` of them for one remote peer.
    The table holds only peers with a stream open now, so it never exceeds ``total`` entries."""

    def __init__(self, total: int, per_peer: int) -> None:
        self._total = total
        self._per_peer = per_peer
        self._held: dict[PeerId, int] = {}
        self._in_use = 0

    def take(self, peer: PeerId) -> bool:
        held = self._held.get(peer, 0)
        if self._in_use >= self._total or held >= self._per_peer:
            return False
        self._held[peer] = held + 1
        self._in_use += 1
        return True

    def give(self, peer: PeerId) -> None:
        self._in_use -= 1
        if self._held[peer] <= 1:
            del self._held[peer]
        else:
            self._held[peer] -= 1


# -- the owner's side -----------------------------------------------------------------


def serve_artifacts(host: P2PHost, store: LocalArtifacts) -> None:
    """Answer ``/inclavate/artifacts/1`` from ``store``."""
    reads = _Slots(MAX_READS, MAX_READS_PER_PEER)
    small = _Slots(MAX_SMALL, MAX_SMALL_PER_PEER)  # meta, list, usage, delete

    async def handle(stream: FramedStream, remote: PeerId) -> None:
        raw = await stream.receive(timeout=_REQUEST_TIMEOUT)
        stream.max_frame_size = MAX_ANSWER_BYTES  # requests are small; answers may not be
        try:
            request = decode_request(raw)
        except _REFUSED as exc:
            await _send(stream, refusal(exc))
            return
        slots = reads if request["op"] == "read" else small
        if not slots.take(remote):
            await _send(stream, {"ok": False, "error": "unavailable", "message": "the owner peer is busy; retry"})
            return
        try:
            await _answer(stream, store, request)
        finally:
            slots.give(remote)

    # An asker may hold MAX_READS_PER_PEER reads and MAX_SMALL_PER_PEER small requests at
    # once; a stream past those gets a refusal from its slots, one past this a reset.
    host.set_stream_handler(PROTOCOL, handle, max_frame_size=MAX_REQUEST_BYTES,
                            max_streams_per_peer=MAX_READS_PER_PEER + MAX_SMALL_PER_PEER)


async def _answer(stream: FramedStream, store: LocalArtifacts, request: dict[str, Any]) -> None:
    try:
        if request["op"] == "read":
            read = await store.open(request["id"], request["range"])
        else:
            await _send(stream, {"ok": True, **await _run(store, request)})
            return
    except _REFUSED as exc:
        await _send(stream, refusal(exc))
        return
    header = {"ok": True, "artifact": read.meta.to_record(),
              "range": [read.range.start, read.range.end] if read.range else None}  # fmt: skip
    length = read.range.length if read.range else read.meta.size_bytes
    deadline = read_deadline(length)
    try:
        with trio.move_on_after(deadline) as cut:
            await _send(stream, header)
            async for chunk in read.chunks:  # an error here propagates: the host resets the stream
                await stream.send(chunk, timeout=_DATA_TIMEOUT)
            await stream.send(b"", timeout=_DATA_TIMEOUT)
    finally:
        await read.chunks.aclose()
    if cut.cancelled_caught:  # raised, so the host resets the stream: never a short object
        raise ReadTooSlow(f"a read of {length} bytes took longer than {deadline:.0f} s")


async def _run(store: LocalArtifacts, request: dict[str, Any]) -> dict[str, Any]:
    op = request["op"]
    if op == "meta":
        return {"artifact": store.meta(request["id"]).to_record()}
    if op == "delete":
        await store.delete(request["id"])
        return {}
    if op == "usage":
        usage = store.usage().to_json()
        return {k: usage[k] for k in ("generated", "uploaded", "max_bytes", "max_objects")}
    page = store.list(request["query"])
    return {"artifacts": [m.to_record() for m in page.artifacts], "truncated": page.truncated}


async def _send(stream: FramedStream, answer: dict[str, Any]) -> None:
    await stream.send(encode(answer), timeout=_ANSWER_TIMEOUT)


# -- the asking side ------------------------------------------------------------------


class RemoteArtifacts:
    """Ask other peers' stores. Failures to reach a peer raise :class:`ArtifactUnavailable`;
    the owner's refusals come back as the same exception types the local store raises."""

    def __init__(self, host: P2PHost) -> None:
        self.host = host

    async def meta(self, peer: str, id_: str) -> ArtifactMeta:
        answer = await self._call(peer, {"op": "meta", "id": id_})
        return decode_meta(answer.get("artifact"), peer, id_)

    async def delete(self, peer: str, id_: str) -> None:
        await self._call(peer, {"op": "delete", "id": id_})

    async def usage(self, peer: str) -> Usage:
        return decode_usage(await self._call(peer, {"op": "usage"}), peer)

    async def list(self, peer: str, query: ListQuery) -> ArtifactPage:
        return decode_page(await self._call(peer, list_request(query)), peer, query.limit)

    async def open(self, peer: str, id_: str, range_header: str | None) -> ArtifactRead:
        """Open a read on the owner; the returned chunks hold the stream until exhausted."""
        stream = await self._open_stream(peer)
        try:
            await stream.send(encode({"op": "read", "id": id_, "range": range_header}), timeout=_REQUEST_TIMEOUT)
            answer = decode_answer(await stream.receive(timeout=_ANSWER_TIMEOUT), peer)
            meta = decode_meta(answer.get("artifact"), peer, id_)
            byte_range = decode_range(answer.get("range"), meta, peer)
        except P2PError as exc:
            await stream.reset()
            raise ArtifactUnavailable(f"the owner peer {peer} did not answer: {exc}") from exc
        except BaseException:
            await stream.reset()
            raise
        length = byte_range.length if byte_range else meta.size_bytes
        return ArtifactRead(meta, byte_range, RemoteChunks(stream, peer, length))

    async def _open_stream(self, peer: str) -> FramedStream:
        try:
            return await self.host.new_stream(peer, PROTOCOL, timeout=5.0, max_frame_size=MAX_ANSWER_BYTES)
        except P2PError as exc:
            raise ArtifactUnavailable(f"the owner peer {peer} is not reachable: {exc}") from exc

    async def _call(self, peer: str, request: dict[str, Any]) -> dict[str, Any]:
        stream = await self._open_stream(peer)
        try:
            async with stream:
                await stream.send(encode(request), timeout=_REQUEST_TIMEOUT)
                return decode_answer(await stream.receive(timeout=_ANSWER_TIMEOUT), peer)
        except P2PError as exc:
            raise ArtifactUnavailable(f"the owner peer {peer} did not answer: {exc}") from exc


class RemoteChunks:
    """An artifact's bytes as they arrive from its owner, checked against the announced
    length. Read to the end, the stream is closed politely; abandoned half way (the HTTP
    client left) or broken, it is reset, so the owner stops sending at once."""

    def __init__(self, stream: FramedStream, peer: str, length: int) -> None:
        self._stream = stream
        self._peer = peer
        self._length = length
        self._received = 0
        self._complete = False

    def __aiter__(self) -> RemoteChunks:
        return self

    async def __anext__(self) -> bytes:
        if self._complete:
            raise StopAsyncIteration
        try:
            chunk = await self._stream.receive(timeout=_DATA_TIMEOUT)
            self._received += len(chunk)
            if len(chunk) > READ_CHUNK or self._received > self._length:
                raise ProtocolError(f"peer {self._peer} sent more bytes than the artifact holds")
            if not chunk and self._received != self._length:
                raise ProtocolError(f"peer {self._peer} ended the artifact after {self._received} of {self._length} bytes")
        except P2PError as exc:
            await self.aclose()
            raise ArtifactUnavailable(f"reading from the owner peer {self._peer} failed: {exc}") from exc
        if not chunk:
            self._complete = True
            await self._stream.close()
            raise StopAsyncIteration
        return chunk

    async def aclose(self) -> None:
        if not self._complete:
            self._complete = True
            await self._stream.reset()
