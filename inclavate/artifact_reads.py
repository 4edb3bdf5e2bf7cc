"""Reading one artifact: an open read (what is served, which range, the bytes as chunks).

Chunks are async iterator *classes* with ``aclose`` rather than async generators: a reader
that stops early (a client that leaves mid-download, a limit) releases the file or the
peer stream at once, with nothing left for a garbage collector to finalize.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import BinaryIO, Protocol

import trio

from inclavate.artifact_types import ArtifactMeta, ArtifactNotFound, ArtifactTooLarge, ArtifactUnavailable
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
    """``length`` bytes of an open file from ``start``, read in a worker thread.

    :meth:`revoke` (its object was deleted) closes the file at once, or as soon as a read
    under way returns, and ends the reader with :class:`ArtifactNotFound` at its next chunk:
    an open descriptor keeps a deleted file's blocks on disk, which the quota no longer
    counts, for as long as a slow client likes (an audit, 2026-12-07).
    """

    def __init__(self, handle: BinaryIO, start: int, length: int, *, on_close: Callable[[], None] | None = None) -> None:
        self._handle = handle
        self._start = start
        self._remaining = length
        self._positioned = False
        self._reading = False
        self._revoked = False
        self._on_close = on_close

    def __aiter__(self) -> FileChunks:
        return self

    async def __anext__(self) -> bytes:
        self._check_revoked()
        if self._remaining <= 0:
            await self.aclose()
            raise StopAsyncIteration
        self._reading = True
        try:
            if not self._positioned:
                await trio.to_thread.run_sync(self._handle.seek, self._start)
                self._positioned = True
            chunk = await trio.to_thread.run_sync(self._handle.read, min(READ_CHUNK, self._remaining))
        finally:
            self._reading = False
            if self._revoked:  # revoked while the read held the file: let go of it now
                self._close()
        self._check_revoked()
        if not chunk:
            await self.aclose()
            raise ArtifactUnavailable("artifact bytes ended early (the file was truncated)")
        self._remaining -= len(chunk)
        return chunk

    def revoke(self) -> None:
        """Its object was deleted: let go of the file now (after a read under way, which
        holds the file in its worker thread), and fail the next chunk."""
        self._revoked = True
        if not self._reading:
            self._close()

    def _check_revoked(self) -> None:
        if self._revoked:
            self._close()
            raise ArtifactNotFound("the artifact was deleted while it was being read")

    async def aclose(self) -> None:
        self._remaining = 0
        self._close()

    def _close(self) -> None:
        self._handle.close()
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close()


class OpenReads:
    """The local reads open on each object, so that deleting it can cut them
    (:meth:`revoke`): the disk then holds no byte the quota does not count."""

    def __init__(self) -> None:
        self._by_id: dict[str, set[FileChunks]] = {}

    def track(self, id_: str, handle: BinaryIO, start: int, length: int) -> FileChunks:
        """Chunks of ``handle`` for a read of ``id_``, known here until they close."""
        readers = self._by_id.setdefault(id_, set())
        chunks = FileChunks(handle, start, length, on_close=lambda: self._forget(id_, chunks))
        readers.add(chunks)
        return chunks

    def revoke(self, id_: str) -> int:
        """Cut every open read of ``id_`` (deleted); how many there were."""
        readers = self._by_id.pop(id_, set())
        for chunks in list(readers):
            chunks.revoke()
        return len(readers)

    def count(self, id_: str) -> int:
        """Reads of ``id_`` open now."""
        return len(self._by_id.get(id_, ()))

    def _forget(self, id_: str, chunks: FileChunks) -> None:
        readers = self._by_id.get(id_)
        if readers is not None:
            readers.discard(chunks)
            if not readers:
                del self._by_id[id_]
