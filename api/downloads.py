"""Serving an artifact's bytes: the one place that decides status, headers and type.

Both ``GET /v1/artifacts/:id`` and ``GET /v1/files/:id/content`` serve through here. The
media type was chosen by whoever uploaded the bytes, and a document served under its own
type from this origin would run in the viewer's session (HTML, SVG, XML with scripts), so
only a known-inert set is served as recorded; everything else goes out as
``application/octet-stream``. Every download carries ``X-Content-Type-Options: nosniff``
(no browser guesses a type back) and a CSP sandbox; the Files API adds
``Content-Disposition: attachment``.
"""

from __future__ import annotations

import logging
import re
from urllib.parse import quote

from quart import Response, jsonify

from api.errors import error_response_parts
from inclavate.artifact_reads import ByteChunks
from inclavate.artifact_swarm import SwarmArtifacts
from inclavate.artifact_types import DEFAULT_MEDIA_TYPE, ArtifactError
from inclavate.artifacts import ArtifactRead
from inclavate.byte_ranges import RangeNotSatisfiable

log = logging.getLogger(__name__)

INERT_MEDIA_TYPES = frozenset({
    "audio/wav", "audio/x-wav", "audio/wave", "audio/vnd.wave", "audio/mpeg", "audio/mp3", "audio/mp4",
    "audio/aac", "audio/ogg", "audio/opus", "audio/flac", "audio/x-flac", "audio/webm",
    "image/png", "image/jpeg", "image/gif", "image/webp", "image/bmp",
    "video/mp4", "video/webm", "video/ogg", "video/quicktime",
    "text/plain", "application/octet-stream",
})  # fmt: skip
"""Types no browser executes. Not here on purpose: text/html, image/svg+xml, application/xml,
text/xml, application/pdf (scriptable viewers), application/javascript, text/css."""

ARTIFACT_ID_HEADER = "x-dppan-artifact-id"


_CHARSET = re.compile(r"charset\s*=\s*\"?([A-Za-z0-9._:-]{1,40})\"?\s*$", re.IGNORECASE)


def served_media_type(media_type: str) -> str:
    """The type to serve for a recorded one, judged by its essence (a generator records
    ``text/plain; charset=utf-8``). text/plain names its charset: the one recorded (an
    upload's own, a plain token), else UTF-8; a UTF-16 upload labelled UTF-8 showed garbled."""
    essence, _, parameters = media_type.partition(";")
    essence = essence.strip().lower()
    if essence not in INERT_MEDIA_TYPES:
        return DEFAULT_MEDIA_TYPE
    if essence != "text/plain":
        return essence
    charset = next((m.group(1).lower() for p in parameters.split(";") if (m := _CHARSET.match(p.strip()))), "utf-8")
    return f"text/plain; charset={charset}"


async def serve_artifact(artifacts: SwarmArtifacts, id_: str, range_header: str | None, *, attachment: bool) -> Response:
    """The response to a download request, wherever in the swarm the artifact lives."""
    try:
        read = await artifacts.open(id_, range_header)
    except RangeNotSatisfiable as exc:
        return range_refused(exc)
    return download_response(read, attachment_name=(read.meta.filename or read.meta.id) if attachment else None)


def range_refused(exc: RangeNotSatisfiable) -> Response:
    """416 in the usual error shape, with the ``Content-Range: bytes */<size>`` it requires."""
    status, body = error_response_parts(exc)
    response = jsonify(body)
    response.status_code = status
    response.headers["Content-Range"] = f"bytes */{exc.size}"
    return response


def download_response(read: ArtifactRead, *, attachment_name: str | None = None) -> Response:
    """200 with the whole object, or 206 with ``Content-Range`` for a range."""
    headers = {
        "Content-Length": str(read.length),
        "Accept-Ranges": "bytes",
        "X-Content-Type-Options": "nosniff",
        "Content-Security-Policy": "default-src 'none'; sandbox",
        ARTIFACT_ID_HEADER: read.meta.id,
    }
    if read.meta.digest:
        headers["ETag"] = f'"{read.meta.digest}"'
    if read.range is not None:
        headers["Content-Range"] = read.range.content_range()
    if attachment_name is not None:
        headers["Content-Disposition"] = content_disposition(attachment_name)
    response = Response(_Body(read), status=206 if read.range else 200, headers=headers,
                        content_type=served_media_type(read.meta.media_type))  # fmt: skip
    response.timeout = None  # a large object over a slow link takes as long as it takes
    return response


class DownloadCutShort(Exception):
    """A download's bytes stopped coming after its headers went out: its artifact was deleted
    on its owner, or the owner left, mid-read. Ending the connection is all that is left to
    tell the client (its body falls short of ``Content-Length``); it is logged at info here,
    and hypercorn's "Error in ASGI Framework" for it is left out (:func:`is_cut_short`)."""


class _Body:
    """``read.chunks`` as a response body: a failure to read the next chunk ends the
    connection as :class:`DownloadCutShort`. Any client could have a relayed download's
    artifact deleted under it, and each logged an error with its traceback (an audit,
    2026-12-07)."""

    def __init__(self, read: ArtifactRead) -> None:
        self._read = read
        self._chunks: ByteChunks = read.chunks

    def __aiter__(self) -> _Body:
        return self

    async def __anext__(self) -> bytes:
        try:
            return await self._chunks.__anext__()
        except ArtifactError as exc:
            log.info("the download of artifact %s was cut short: %s", self._read.meta.id, exc)
            raise DownloadCutShort(str(exc)) from None

    async def aclose(self) -> None:
        await self._chunks.aclose()


def is_cut_short(error: BaseException | None) -> bool:
    """Whether ``error`` is a :class:`DownloadCutShort`, alone or in a group of them."""
    if isinstance(error, BaseExceptionGroup):
        return all(is_cut_short(e) for e in error.exceptions)
    return isinstance(error, DownloadCutShort)


def content_disposition(filename: str) -> str:
    """``attachment`` with an ASCII fallback name and the exact UTF-8 name (RFC 6266), so no
    filename can break out of the header (quotes, CR/LF and non-ASCII are encoded)."""
    fallback = "".join(ch if 32 <= ord(ch) < 127 and ch not in '"\\;' else "_" for ch in filename) or "file"
    return f"attachment; filename=\"{fallback}\"; filename*=UTF-8''{quote(filename, safe='')}"
