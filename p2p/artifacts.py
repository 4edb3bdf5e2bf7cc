"""``/inclavate/artifacts/1``: reach the artifact store of the peer that owns an id.

Any peer serves the artifact API; the bytes stay on the peer that created them (the id's
owner tag says which, :mod:`inclavate.owner_ids`), and the peer that got the request asks
the owner over this protocol. The messages are in :mod:`p2p.artifact_wire`.

The owner serves at most :data:`MAX_CONCURRENT` streams at once (more are refused as
``unavailable``, so the asker answers 503 rather than queueing), and an owner that fails
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
from p2p.errors import P2PError, ProtocolError
from p2p.framing import FramedStream
from p2p.host import P2PHost

log = logging.getLogger(__name__)

__all__ = ["MAX_CONCURRENT", "PROTOCOL", "RemoteArtifacts", "RemoteChunks", "serve_artifacts"]

MAX_CONCURRENT = 16
_REQUEST_TIMEOUT = 10.0
_ANSWER_TIMEOUT = 30.0
_DATA_TIMEOUT = 30.0


class LocalArtifacts(Protocol):
    """What the owner side needs: :class:`inclavate.artifacts.ArtifactStore`."""

    def meta(self, id_: str) -> ArtifactMeta: ...
    async def open(self, id_: str, range_header: str | None = None) -> ArtifactRead: ...
    async def delete(self, id_: str) -> ArtifactMeta: ...
    def list(self, query: ListQuery) -> ArtifactPage: ...
    def usage(self) -> Usage: ...


# -- the owner's side -----------------------------------------------------------------


def serve_artifacts(host: P2PHost, store: LocalArtifacts) -> None:
    """Answer ``/inclavate/artifacts/1`` from ``store``."""
    slots = trio.Semaphore(MAX_CONCURRENT)

    async def handle(stream: FramedStream, remote: PeerId) -> None:
        raw = await stream.receive(timeout=_REQUEST_TIMEOUT)
        stream.max_frame_size = MAX_ANSWER_BYTES  # requests are small; answers may not be
        try:
            slots.acquire_nowait()
        except trio.WouldBlock:
            await _send(stream, {"ok": False, "error": "unavailable", "message": "the owner peer is busy; retry"})
            return
        try:
            await _answer(stream, store, raw)
        finally:
            slots.release()

    host.set_stream_handler(PROTOCOL, handle, max_frame_size=MAX_REQUEST_BYTES)


async def _answer(stream: FramedStream, store: LocalArtifacts, raw: bytes) -> None:
    try:
        request = decode_request(raw)
        if request["op"] == "read":
            read = await store.open(request["id"], request["range"])
        else:
            await _send(stream, {"ok": True, **await _run(store, request)})
            return
    except (ArtifactError, MalformedId, RangeMalformed, RangeNotSatisfiable) as exc:
        await _send(stream, refusal(exc))
        return
    header = {"ok": True, "artifact": read.meta.to_record(),
              "range": [read.range.start, read.range.end] if read.range else None}  # fmt: skip
    try:
        await _send(stream, header)
        async for chunk in read.chunks:  # an error here propagates: the host resets the stream
            await stream.send(chunk, timeout=_DATA_TIMEOUT)
        await stream.send(b"", timeout=_DATA_TIMEOUT)
    finally:
        await read.chunks.aclose()


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
        return decode_meta(answer.get("artifact"), peer)

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
            meta = decode_meta(answer.get("artifact"), peer)
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
