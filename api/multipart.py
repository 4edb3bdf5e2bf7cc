"""A streaming ``multipart/form-data`` reader: parts one at a time, file bytes as they arrive.

Quart's ``request.files`` parses the whole body before the handler sees a byte. Here the
body is fed to werkzeug's sans-IO decoder in slices of at most :data:`_SLICE` bytes and
each file part's data is handed on as it is decoded, so an upload is never held whole in
memory (the store writes it to disk as it comes). Bounds, since every byte is hostile:

* text fields are read whole but capped (:data:`MAX_FIELD_BYTES`), as are the number of
  parts (:data:`MAX_PARTS`) and the bytes the decoder may hold undecided (part headers,
  a partial boundary: :data:`MAX_PENDING_BYTES`);
* malformed framing (no boundary, missing Content-Disposition, undecodable headers) is
  :class:`MultipartError` (400), and so is a body that ends before its closing boundary
  (:data:`TRUNCATED`: a client cut off, a chunked body whose last chunk came early), which
  Quart's own form parser took as a whole form of the parts that had arrived.

:func:`read_form` reads a small form whole (its text fields and one file, in memory) for
routes that need every field before acting; :class:`MultipartReader` streams.

Usage::

    async for part in MultipartReader(body_chunks, request.headers.get("Content-Type")):
        if part.filename is None:
            value = await part.text()
        else:
            async for chunk in part: ...

A part must be consumed (or skipped with :meth:`Part.drain`) before the next is asked for.
"""

from __future__ import annotations

from collections.abc import AsyncIterable
from dataclasses import dataclass, field

from werkzeug.exceptions import RequestEntityTooLarge
from werkzeug.http import parse_options_header
from werkzeug.sansio.multipart import Data, Epilogue, Event, Field, File, MultipartDecoder, NeedData

from api.errors import BadRequest, PayloadTooLarge

MAX_FIELD_BYTES = 4096
MAX_PARTS = 16
MAX_PENDING_BYTES = 64 * 1024
_SLICE = 64 * 1024
TRUNCATED = "the multipart body is truncated or malformed: it ended before its closing boundary"


class MultipartError(BadRequest):
    """The body is not a well-formed multipart/form-data body (400)."""


def boundary_of(content_type: str | None, fields: str = "purpose, file") -> bytes:
    """The boundary of a ``multipart/form-data`` Content-Type, or 400 naming the form's ``fields``."""
    mimetype, options = parse_options_header(content_type or "")
    boundary = options.get("boundary", "")
    if mimetype != "multipart/form-data" or not boundary:
        raise MultipartError(f"the body must be multipart/form-data with a boundary (fields: {fields})")
    if len(boundary) > 70 or not boundary.isascii():  # RFC 2046: 1-70 characters
        raise MultipartError("malformed multipart boundary")
    return boundary.encode()


@dataclass
class Part:
    """One part; iterate it (``async for chunk in part``) for its bytes as they are decoded."""

    name: str
    filename: str | None
    """Set for file parts (may be empty); None for text fields."""
    content_type: str | None
    _reader: MultipartReader = field(repr=False)
    _done: bool = False

    def __aiter__(self) -> Part:
        return self

    async def __anext__(self) -> bytes:
        while not self._done:
            data, more = await self._reader._next_data()
            self._done = not more
            if data:
                return data
        raise StopAsyncIteration

    async def text(self, limit: int = MAX_FIELD_BYTES) -> str:
        """A text field, whole (400 past ``limit`` bytes or if not UTF-8)."""
        value = bytearray()
        async for chunk in self:
            value += chunk
            if len(value) > limit:
                raise MultipartError(f"form field {self.name!r} is longer than {limit} bytes")
        try:
            return value.decode()
        except UnicodeDecodeError:
            raise MultipartError(f"form field {self.name!r} is not UTF-8 text") from None

    async def drain(self) -> None:
        async for _ in self:
            pass


class MultipartReader:
    """The parts of a body, in order (``async for part in reader``)."""

    def __init__(self, body: AsyncIterable[bytes], content_type: str | None, *, fields: str = "purpose, file") -> None:
        self._decoder = MultipartDecoder(boundary_of(content_type, fields), max_parts=MAX_PARTS)
        self._body = body.__aiter__()
        self._pending = memoryview(b"")
        self._ended = False
        self._current: Part | None = None

    def __aiter__(self) -> MultipartReader:
        return self

    async def __anext__(self) -> Part:
        if self._current is not None and not self._current._done:
            await self._current.drain()
        while True:
            event = await self._next_event()
            if isinstance(event, Epilogue):
                raise StopAsyncIteration
            if isinstance(event, File | Field):
                filename = event.filename if isinstance(event, File) else None
                self._current = Part(event.name or "", filename, event.headers.get("Content-Type"), self)
                return self._current
            # Preamble: nothing to do.

    async def _next_data(self) -> tuple[bytes, bool]:
        event = await self._next_event()
        if not isinstance(event, Data):
            raise MultipartError("malformed multipart body: a part ended without its data")
        return event.data, event.more_data

    async def _next_event(self) -> Event:
        while True:
            try:
                event = self._decoder.next_event()
            except (ValueError, RequestEntityTooLarge) as exc:  # includes UnicodeDecodeError
                if self._ended:  # the decoder wanted more: the body stopped short
                    raise MultipartError(TRUNCATED) from exc
                raise MultipartError(f"malformed multipart body: {exc}") from exc
            if not isinstance(event, NeedData):
                return event
            if len(self._decoder.buffer) > MAX_PENDING_BYTES:
                raise MultipartError("malformed multipart body: part headers or boundary too long")
            await self._feed()

    async def _feed(self) -> None:
        if not self._pending:
            if self._ended:
                raise MultipartError(TRUNCATED)
            try:
                self._pending = memoryview(await self._body.__anext__())
            except StopAsyncIteration:
                self._ended = True
                self._decoder.receive_data(None)
                return
        # A memoryview, so slicing a large buffered chunk copies each slice once.
        piece, self._pending = self._pending[:_SLICE], self._pending[_SLICE:]
        self._decoder.receive_data(bytes(piece))


@dataclass(frozen=True)
class UploadedFile:
    """The file part of a form read by :func:`read_form`."""

    filename: str
    content_type: str | None
    """The part's own Content-Type header; None when it has none."""
    data: bytes


@dataclass(frozen=True)
class Form:
    fields: dict[str, str]
    """Text fields by name (the first of each name)."""
    file: UploadedFile | None


async def read_form(body: AsyncIterable[bytes], content_type: str | None, *, file_field: str,
                    max_file_bytes: int, field_limit: int = MAX_FIELD_BYTES,
                    fields: str = "purpose, file") -> Form:  # fmt: skip
    """A whole form: text fields (each at most ``field_limit`` bytes) and the first file part
    named ``file_field`` (413 past ``max_file_bytes``); other file parts are skipped.
    Unlike Quart's ``request.form``, a body that stops before its closing boundary is a 400
    (:data:`TRUNCATED`), not a form of whatever parts had arrived."""
    values: dict[str, str] = {}
    upload: UploadedFile | None = None
    async for part in MultipartReader(body, content_type, fields=fields):
        if part.filename is None:
            values.setdefault(part.name, await part.text(field_limit))
        elif part.name == file_field and upload is None:
            upload = UploadedFile(part.filename, part.content_type, await _file_bytes(part, max_file_bytes))
        else:
            await part.drain()
    return Form(values, upload)


async def _file_bytes(part: Part, limit: int) -> bytes:
    data = bytearray()
    async for chunk in part:
        data += chunk
        if len(data) > limit:
            raise PayloadTooLarge(f"the file is over {limit // (1024 * 1024)} MiB")
    return bytes(data)
