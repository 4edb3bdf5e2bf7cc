"""Reading one artifact: an open read (what is served, which range, the bytes as chunks).

Chunks are async iterator *classes* with ``aclose`` rather than async generators: a reader
that stops early (a client that leaves mid-download, a limit) releases the file or the
peer stream at once, with nothing left for a garbage collector to finalize.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import BinaryIO, Protocol

import trio

from inclavate.artifact_types import ArtifactMeta, ArtifactTooLarge, ArtifactUnavailable
from inclavate.byte_ranges import ByteRange

READ_CHUNK = 256 * 1024


class ByteChunks(Protocol):
    """An object's bytes as an async iterator; ``aclose`` releases what it holds (a file,
    a stream) when a reader stops early. Quart's response body calls it, so do we."""

    def __aiter__(self) -> ByteChunks: ...
    async def __anext__(self) -> bytes: ...
    async def aclose(self) -> None: ...


@dataclass
class ArtifactRead:
    """An open read: what is served, and the bytes as an async iterator of chunks."""

    meta: ArtifactMeta
    range: ByteRange | None
    """None: the whole object (200); otherwise the part served (206)."""
    chunks: ByteChunks

    @property
    def length(self) -> int:
        return self.range.length if self.range is not None else self.meta.size_bytes


async def read_whole(read: ArtifactRead, max_bytes: int) -> bytes:
    """Every byte of an open read, refused (and the read closed) past ``max_bytes``."""
    try:
        if read.length > max_bytes:
            raise ArtifactTooLarge(f"artifact {read.meta.id} is {read.length} bytes; the limit is {max_bytes}")
        return b"".join([chunk async for chunk in read.chunks])
    finally:
        await read.chunks.aclose()


class FileChunks:
    """``length`` bytes of an open file from ``start``, read in a worker thread."""

    def __init__(self, handle: BinaryIO, start: int, length: int) -> None:
        self._handle = handle
        self._start = start
        self._remaining = length
        self._positioned = False

    def __aiter__(self) -> FileChunks:
        return self

    async def __anext__(self) -> bytes:
        if self._remaining <= 0:
            await self.aclose()
            raise StopAsyncIteration
        if not self._positioned:
            await trio.to_thread.run_sync(self._handle.seek, self._start)
            self._positioned = True
        chunk = await trio.to_thread.run_sync(self._handle.read, min(READ_CHUNK, self._remaining))
        if not chunk:
            await self.aclose()
            raise ArtifactUnavailable("artifact bytes ended early (the file was truncated)")
        self._remaining -= len(chunk)
        return chunk

    async def aclose(self) -> None:
        self._remaining = 0
        self._handle.close()
