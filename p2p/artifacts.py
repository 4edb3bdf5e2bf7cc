"""``/inclavate/artifacts/1``: reach the artifact store of the peer that owns an id.

Any peer serves the artifact API; the bytes stay on the peer that created them (the id's
owner tag says which, :mod:`inclavate.owner_ids`). The serving peer asks the owner over
this protocol, one request per stream:

* request: one JSON frame of at most 4 KiB, ``{"op": ..., ...}``::

      {"op": "meta",   "id": ID}
      {"op": "read",   "id": ID, "range": RANGE_HEADER | null}
      {"op": "delete", "id": ID}
      {"op": "list",   "limit": N, "kind": K|null, "files_only": B, "purpose": P|null,
                       "after": [MS, ID]|null, "ascending": B}
      {"op": "usage"}

* answer: one JSON frame ``{"ok": true, ...}`` or ``{"ok": false, "error": CODE,
  "message": TEXT[, "size": N]}``, CODE naming one of our exception types (:data:`_ERRORS`);
* a ``read`` that succeeded is followed by the bytes in frames of at most 256 KiB and an
  empty frame that marks the end. An owner that fails mid-object resets the stream, so a
  reader never takes a short object for a whole one.

Both ends validate: the owner decodes each request strictly (sizes, types, ranges of
numbers) and serves at most :data:`MAX_CONCURRENT` streams at once (more are answered
``busy``); the asker checks answers with :meth:`ArtifactMeta.from_record` and counts the
bytes against the announced length. Any swarm peer may ask: the spec's ownership is a
single local principal, the same one any HTTP client of any peer already is.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Protocol

import trio

from inclavate.artifact_types import (
    KINDS,
    ArtifactError,
    ArtifactMeta,
    ArtifactNotFound,
    ArtifactNotReady,
    ArtifactPage,
    ArtifactTooLarge,
    ArtifactUnavailable,
    BadArtifactRequest,
    ListQuery,
    QuotaExceeded,
    Totals,
    Usage,
)
from inclavate.artifacts import READ_CHUNK, ArtifactRead
from inclavate.byte_ranges import MAX_HEADER_CHARS, ByteRange, RangeMalformed, RangeNotSatisfiable
from inclavate.errors import InclavateError
from inclavate.owner_ids import MalformedId, parse_id
from inclavate.types import PeerId
from p2p.errors import P2PError, ProtocolError
from p2p.framing import FramedStream
from p2p.host import P2PHost

log = logging.getLogger(__name__)

PROTOCOL = "/inclavate/artifacts/1"
MAX_REQUEST_BYTES = 4096
MAX_LIST_WINDOW = 20_000
"""Rows one peer returns for one listing (a merged listing asks each peer for
``offset + limit`` rows; a deeper offset is refused at the API)."""
MAX_ANSWER_BYTES = MAX_LIST_WINDOW * 1024 + 4096
MAX_CONCURRENT = 16
_REQUEST_TIMEOUT = 10.0
_ANSWER_TIMEOUT = 30.0
_DATA_TIMEOUT = 30.0

_ERRORS: dict[str, type[InclavateError]] = {
    "not_found": ArtifactNotFound,
    "not_ready": ArtifactNotReady,
    "too_large": ArtifactTooLarge,
    "quota": QuotaExceeded,
    "bad_request": BadArtifactRequest,
    "malformed_id": MalformedId,
    "malformed_range": RangeMalformed,
    "unsatisfiable_range": RangeNotSatisfiable,
    "unavailable": ArtifactUnavailable,
}
_CODES = {cls: code for code, cls in _ERRORS.items()}


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
        op = request["op"]
        if op == "read":
            read = await store.open(request["id"], request["range"])
        else:
            answer = await _run(store, request)
    except (ArtifactError, MalformedId, RangeMalformed, RangeNotSatisfiable) as exc:
        await _send(stream, _error_answer(exc))
        return
    if op != "read":
        await _send(stream, {"ok": True, **answer})
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
        usage = store.usage()
        return {"generated": usage.generated.to_json(), "uploaded": usage.uploaded.to_json(),
                "max_bytes": usage.max_bytes, "max_objects": usage.max_objects}  # fmt: skip
    page = store.list(request["query"])
    return {"artifacts": [m.to_record() for m in page.artifacts], "truncated": page.truncated}


def _error_answer(exc: InclavateError) -> dict[str, Any]:
    code = next((c for cls, c in _CODES.items() if isinstance(exc, cls)), "unavailable")
    answer: dict[str, Any] = {"ok": False, "error": code, "message": str(exc)[:1000]}
    if isinstance(exc, RangeNotSatisfiable):
        answer["size"] = exc.size
    return answer


def decode_request(raw: bytes) -> dict[str, Any]:
    """A request, typed and bounded, or :class:`BadArtifactRequest`/:class:`MalformedId`."""
    if len(raw) > MAX_REQUEST_BYTES:
        raise BadArtifactRequest("request too large")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadArtifactRequest(f"request is not JSON: {exc}") from exc
    if not isinstance(body, dict) or body.get("op") not in ("meta", "read", "delete", "list", "usage"):
        raise BadArtifactRequest("request must be an object with a known op")
    op = body["op"]
    if op in ("meta", "read", "delete"):
        out: dict[str, Any] = {"op": op, "id": parse_id(_str(body.get("id"), 36, "id"))}
        if op == "read":
            header = body.get("range")
            out["range"] = None if header is None else _str(header, MAX_HEADER_CHARS, "range")
        return out
    if op == "usage":
        return {"op": op}
    limit = body.get("limit")
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIST_WINDOW:
        raise BadArtifactRequest(f"limit must be a whole number from 1 to {MAX_LIST_WINDOW}")
    kind = body.get("kind")
    if kind is not None and kind not in KINDS:
        raise BadArtifactRequest("unknown kind")
    purpose = body.get("purpose")
    after = body.get("after")
    if after is not None:
        if not (isinstance(after, list) and len(after) == 2 and isinstance(after[0], int)
                and not isinstance(after[0], bool) and 0 <= after[0] < 2**63):  # fmt: skip
            raise BadArtifactRequest("after must be [created_at_ms, id]")
        after = (after[0], parse_id(_str(after[1], 36, "after id")))
    query = ListQuery(
        limit=limit, kind=kind, files_only=body.get("files_only") is True,
        purpose=None if purpose is None else _str(purpose, 64, "purpose"),
        after=after, ascending=body.get("ascending") is True,
    )  # fmt: skip
    return {"op": op, "query": query}


def _str(value: object, limit: int, what: str) -> str:
    if not isinstance(value, str) or len(value) > limit:
        raise BadArtifactRequest(f"{what} must be a string of at most {limit} characters")
    return value


async def _send(stream: FramedStream, answer: dict[str, Any]) -> None:
    await stream.send(json.dumps(answer).encode(), timeout=_ANSWER_TIMEOUT)


# -- the asking side ------------------------------------------------------------------


class RemoteArtifacts:
    """Ask other peers' stores. Failures to reach a peer raise :class:`ArtifactUnavailable`;
    the owner's refusals come back as the same exception types the local store raises."""

    def __init__(self, host: P2PHost) -> None:
        self.host = host

    async def meta(self, peer: str, id_: str) -> ArtifactMeta:
        answer = await self._call(peer, {"op": "meta", "id": id_})
        return _meta_of(answer.get("artifact"), peer)

    async def delete(self, peer: str, id_: str) -> None:
        await self._call(peer, {"op": "delete", "id": id_})

    async def usage(self, peer: str) -> Usage:
        answer = await self._call(peer, {"op": "usage"})
        try:
            return Usage(
                generated=_totals(answer["generated"]), uploaded=_totals(answer["uploaded"]),
                max_bytes=_count(answer["max_bytes"]), max_objects=_count(answer["max_objects"]),
            )  # fmt: skip
        except (KeyError, TypeError) as exc:
            raise ArtifactUnavailable(f"peer {peer} sent a malformed usage answer") from exc

    async def list(self, peer: str, query: ListQuery) -> ArtifactPage:
        request = {
            "op": "list", "limit": query.limit, "kind": query.kind, "files_only": query.files_only,
            "purpose": query.purpose, "after": list(query.after) if query.after else None, "ascending": query.ascending,
        }  # fmt: skip
        answer = await self._call(peer, request)
        rows = answer.get("artifacts")
        if not isinstance(rows, list) or len(rows) > query.limit:
            raise ArtifactUnavailable(f"peer {peer} sent a malformed listing")
        return ArtifactPage([_meta_of(r, peer) for r in rows], truncated=answer.get("truncated") is True)

    async def open(self, peer: str, id_: str, range_header: str | None) -> ArtifactRead:
        """Open a read on the owner; the returned chunks hold the stream until exhausted."""
        stream = await self._open_stream(peer)
        try:
            await stream.send(json.dumps({"op": "read", "id": id_, "range": range_header}).encode(), timeout=_REQUEST_TIMEOUT)
            answer = _check(await _receive_json(stream, peer), peer)
            meta = _meta_of(answer.get("artifact"), peer)
            span = answer.get("range")
            byte_range = None
            if span is not None:
                if not (isinstance(span, list) and len(span) == 2 and all(isinstance(v, int) for v in span)
                        and 0 <= span[0] <= span[1] < meta.size_bytes):  # fmt: skip
                    raise ArtifactUnavailable(f"peer {peer} sent a malformed range")
                byte_range = ByteRange(span[0], span[1], meta.size_bytes)
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
                await stream.send(json.dumps(request).encode(), timeout=_REQUEST_TIMEOUT)
                return _check(await _receive_json(stream, peer), peer)
        except P2PError as exc:
            raise ArtifactUnavailable(f"the owner peer {peer} did not answer: {exc}") from exc


async def _receive_json(stream: FramedStream, peer: str) -> dict[str, Any]:
    raw = await stream.receive(timeout=_ANSWER_TIMEOUT)
    try:
        answer = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        answer = None
    if not isinstance(answer, dict):
        raise ArtifactUnavailable(f"peer {peer} sent a malformed answer")
    return answer


def _check(answer: dict[str, Any], peer: str) -> dict[str, Any]:
    """The answer if ok; the owner's refusal raised as our own exception type otherwise."""
    if answer.get("ok") is True:
        return answer
    code, message = answer.get("error"), str(answer.get("message", "refused"))[:1000]
    cls = _ERRORS.get(code) if isinstance(code, str) else None
    if cls is RangeNotSatisfiable:
        size = answer.get("size")
        raise RangeNotSatisfiable(message, size if isinstance(size, int) and size >= 0 else 0)
    if cls is None:
        raise ArtifactUnavailable(f"peer {peer} refused: {message}")
    raise cls(message)


def _count(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**63:
        raise TypeError("expected a non-negative integer")
    return value


def _totals(value: object) -> Totals:
    if not isinstance(value, dict):
        raise TypeError("expected an object")
    return Totals(_count(value["bytes"]), _count(value["objects"]))


def _meta_of(record: object, peer: str) -> ArtifactMeta:
    try:
        if not isinstance(record, dict):
            raise ValueError("not an object")
        return ArtifactMeta.from_record(record)
    except ValueError as exc:
        raise ArtifactUnavailable(f"peer {peer} sent malformed artifact metadata: {exc}") from exc


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
