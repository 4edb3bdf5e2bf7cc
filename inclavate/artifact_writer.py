"""Writing one artifact: stream in, hash as it goes, commit durably or leave nothing.

The order that makes a kill -9 harmless (see :mod:`inclavate.artifacts` for the recovery
that completes it): bytes go to the store's temp path, hashed in the same worker-thread
pass that writes them (1 MiB at a time, so few thread hops); commit fsyncs the file,
renames it to its object path, fsyncs the directory, and only then publishes the ready
row. Abort (or leaving ``async with`` without commit) removes the bytes and fails a
pending row. A full disk is 507, any other I/O failure 503.
"""

from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path
from types import TracebackType
from typing import BinaryIO, Protocol

import trio

from inclavate.artifact_types import ArtifactMeta, ArtifactTooLarge, ArtifactUnavailable, QuotaExceeded

WRITE_BUFFER = 1024 * 1024
"""Bytes gathered before one write+hash in a worker thread."""


class Ledger(Protocol):
    """What a writer asks of its store (:class:`inclavate.artifacts.ArtifactStore`), which
    keeps the books: paths, bytes in flight against the quota, the index row."""

    def tmp_path(self, id_: str) -> Path: ...
    def object_path(self, id_: str) -> Path: ...
    def reserve(self, id_: str, total_bytes: int) -> None:
        """Count ``total_bytes`` in flight for ``id_`` (QuotaExceeded past the quota)."""
    def publish(self, meta: ArtifactMeta, *, indexed: bool) -> None:
        """Record ``meta`` as ready (ArtifactNotFound if its pending row was deleted)."""
    def fail(self, id_: str, reason: str) -> None: ...
    def release(self, id_: str, *, indexed: bool) -> None:
        """The writer is done: its bytes in flight (and object slot) are given back."""


class ArtifactWriter:
    """Bytes on their way into the store; see :meth:`ArtifactStore.begin`."""

    def __init__(self, store: Ledger, meta: ArtifactMeta, handle: BinaryIO, max_bytes: int, *, indexed: bool) -> None:
        self.meta = meta
        self._store = store
        self._handle = handle
        self._max_bytes = max_bytes
        self._indexed = indexed
        self._hash = hashlib.sha256()
        self._buffer = bytearray()
        self._size = 0
        self._finished = False

    @property
    def id(self) -> str:
        return self.meta.id

    @property
    def size(self) -> int:
        return self._size

    async def write(self, chunk: bytes) -> None:
        """Append bytes (413 past ``max_bytes``, 507 past the store's byte quota)."""
        if self._finished:
            raise RuntimeError("write after commit or abort")
        if self._size + len(chunk) > self._max_bytes:
            raise ArtifactTooLarge(f"upload is over the {self._max_bytes}-byte limit")
        self._store.reserve(self.id, self._size + len(chunk))
        self._size += len(chunk)
        self._buffer += chunk
        if len(self._buffer) >= WRITE_BUFFER:
            await self._flush()

    async def _flush(self) -> None:
        data, self._buffer = bytes(self._buffer), bytearray()

        def write() -> None:
            self._hash.update(data)
            self._handle.write(data)

        try:
            await trio.to_thread.run_sync(write)
        except OSError as exc:
            raise _storage_error(exc) from exc

    async def commit(self, *, purpose: str | None = None) -> ArtifactMeta:
        """Make the artifact ready (durably, see the module docstring) and return it.

        ``purpose`` sets the Files API's display field of a plain upload, for a multipart
        body that names it only after the file."""
        if purpose is not None:
            if self._indexed:
                raise ValueError("the purpose of a pending artifact is fixed at begin()")
            self.meta = ArtifactMeta(**{**self.meta.to_record(), "purpose": purpose})
        await self._flush()
        tmp, final = self._store.tmp_path(self.id), self._store.object_path(self.id)

        def persist() -> None:
            self._handle.flush()
            os.fsync(self._handle.fileno())
            self._handle.close()
            os.replace(tmp, final)
            _fsync_dir(final.parent)

        try:
            await trio.to_thread.run_sync(persist)
        except OSError as exc:
            raise _storage_error(exc) from exc
        digest = self._hash.hexdigest()
        ready = ArtifactMeta(**{**self.meta.to_record(), "state": "ready", "size_bytes": self._size, "digest": digest})
        try:
            self._store.publish(ready, indexed=self._indexed)
        except BaseException:
            final.unlink(missing_ok=True)
            raise
        finally:
            self._release()
        return ready

    async def abort(self, reason: str = "the write did not complete") -> None:
        """Discard the bytes; a pending row becomes failed with ``reason``."""
        if self._finished:
            return
        self._release()
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(self._discard)
        if self._indexed:
            self._store.fail(self.id, reason)

    def _discard(self) -> None:
        self._handle.close()
        self._store.tmp_path(self.id).unlink(missing_ok=True)
        # A commit that failed after its rename (directory fsync, index) left bytes that
        # no ready row points to: remove them now rather than at the next start.
        self._store.object_path(self.id).unlink(missing_ok=True)

    def _release(self) -> None:
        if self._finished:
            return
        self._finished = True
        self._store.release(self.id, indexed=self._indexed)

    async def __aenter__(self) -> ArtifactWriter:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if not self._finished:
            await self.abort(f"{type(exc).__name__}: {exc}" if exc is not None else "the writer closed without commit")


def _storage_error(exc: OSError) -> ArtifactUnavailable | QuotaExceeded:
    """A full disk is the store being full (507), whatever the configured quota says;
    any other I/O failure is the store being unusable (503)."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return QuotaExceeded("this peer's disk is full; delete some artifacts first")
    return ArtifactUnavailable(f"cannot write artifact bytes: {exc.strerror}")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
