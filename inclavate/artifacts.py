"""One peer's artifact store: bytes in files under its data dir, metadata in SQLite.

Interface (what the API and the generators use)::

    store = ArtifactStore(data_dir, owner_peer_id, ArtifactConfig.from_env(os.environ))

    # an upload, streamed: never held whole in memory
    meta = await store.create(chunks, media_type="audio/wav", kind="uploaded",
                              max_bytes=UPLOAD_MAX_BYTES, declared_size=content_length)

    # a generator's output: visible as "pending" at once, "ready" (or "failed") later
    async with store.begin(media_type="audio/wav", kind="generated", pending=True) as writer:
        writer.id                     # known before the first byte (put it in the job)
        await writer.write(b"...")    # any number of times
        meta = await writer.commit()  # leaving the block without commit marks it failed

    store.meta(id)                    # ArtifactMeta (ArtifactNotFound)
    read = await store.open(id, "bytes=0-99")   # ArtifactRead: meta, range, chunks
    async for chunk in read.chunks: ...         # (ArtifactNotReady, RangeMalformed, ...)
    meta, data = await store.read_all(id, max_bytes)   # small inputs, e.g. a clip to transcribe
    store.list(ListQuery(limit, offset, kind))  # ArtifactPage, (created_at DESC, id DESC)
    store.usage()                               # Usage: COUNT/SUM split by origin
    await store.delete(id)                      # ArtifactNotFound if absent
    await store.run_sweeper()                   # in a nursery: deletes what expired

Ids come from :func:`inclavate.owner_ids.new_id`, so any peer can tell whose store holds one.

Crash safety. Bytes go to ``tmp/<id>.part`` and are hashed as they arrive; commit fsyncs
the file, renames it to ``objects/<id>``, fsyncs the directory, and only then marks the row
ready (the row is inserted then, for a plain upload). Delete removes the row first, cuts
the local reads open on the object (:class:`~inclavate.artifact_reads.OpenReads`: their
files close at once, so the disk never holds bytes the quota stopped counting), then
removes the file. So at any kill -9 the disk holds at worst a temp file, or an object without a
ready row; :meth:`ArtifactStore.__init__` removes both (and fails rows left pending by a
writer that died), so a restart never shows a ready artifact with missing or partial bytes
and never keeps an orphan.

Quotas count committed bytes plus the bytes in flight in open writers, so concurrent
uploads cannot together overshoot ``max_bytes``; an object slot is taken at ``begin``.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import AsyncIterable
from pathlib import Path

import trio

from inclavate.artifact_index import ArtifactIndex
from inclavate.artifact_types import (
    DEFAULT_MEDIA_TYPE,
    MAX_FILENAME_CHARS,
    MAX_MEDIA_TYPE_CHARS,
    MAX_PURPOSE_CHARS,
    UPLOAD_MAX_BYTES,
    ArtifactConfig,
    ArtifactKind,
    ArtifactMeta,
    ArtifactNotFound,
    ArtifactPage,
    ArtifactTooLarge,
    ArtifactUnavailable,
    BadArtifactRequest,
    ListQuery,
    QuotaExceeded,
    Totals,
    Usage,
    now_ms,
)
from inclavate.artifact_reads import READ_CHUNK, ArtifactRead, ByteChunks, OpenReads, read_whole
from inclavate.artifact_writer import ArtifactWriter
from inclavate.owner_ids import new_id, parse_id

log = logging.getLogger(__name__)

__all__ = ["ArtifactRead", "ArtifactStore", "ArtifactWriter", "ByteChunks", "READ_CHUNK", "read_whole"]


class ArtifactStore:
    def __init__(self, data_dir: Path, owner: str, config: ArtifactConfig | None = None) -> None:
        self.owner = owner
        self.config = config or ArtifactConfig()
        self.root = data_dir / "artifacts"
        self._objects = self.root / "objects"
        self._tmp = self.root / "tmp"
        for d in (self._objects, self._tmp):
            d.mkdir(parents=True, exist_ok=True)
        self.index = ArtifactIndex(self.root / "index.db")
        self._inflight: dict[str, int] = {}  # open writer id -> bytes written so far
        self._unindexed_writers = 0  # open writers that hold no row yet (an object slot each)
        self.reads = OpenReads()  # local reads open now, cut when their object is deleted
        self._recover()
        self._stored = self.index.stored()

    def close(self) -> None:
        self.index.close()

    # -- recovery ----------------------------------------------------------------------

    def _recover(self) -> None:
        """Undo what a crash left (see the module docstring). Runs before serving."""
        shutil.rmtree(self._tmp, ignore_errors=True)
        self._tmp.mkdir(parents=True, exist_ok=True)
        for id_ in self.index.ids_in_state("pending"):
            self.index.mark_failed(id_, "the peer restarted while this artifact was being written")
            log.warning("artifact %s was pending when the peer stopped: marked failed", id_)
        ready = self.index.ids_in_state("ready")
        on_disk = {p.name for p in self._objects.iterdir()}
        for name in on_disk - ready:
            (self._objects / name).unlink(missing_ok=True)
            log.info("removed orphan artifact bytes %s (no ready row)", name)
        for id_ in ready - on_disk:
            self.index.delete(id_)
            log.error("artifact %s was ready but its bytes are missing: removed its row", id_)

    # -- writing -----------------------------------------------------------------------

    def begin(
        self,
        *,
        media_type: str = DEFAULT_MEDIA_TYPE,
        kind: ArtifactKind,
        max_bytes: int = UPLOAD_MAX_BYTES,
        declared_size: int | None = None,
        pending: bool = False,
        filename: str | None = None,
        purpose: str | None = None,
    ) -> ArtifactWriter:
        """Open a writer (use it as ``async with``). ``pending=True`` inserts a visible
        pending row now (a job's output); otherwise the row appears at commit, ready.

        Refuses at once, before any byte is read, what can already be known to fail:
        ``declared_size`` (a Content-Length) over ``max_bytes`` (413) or over the space
        the quota leaves (507), and a store at its object ceiling (507).
        """
        for name, value, limit in (("media type", media_type, MAX_MEDIA_TYPE_CHARS),
                                   ("filename", filename, MAX_FILENAME_CHARS), ("purpose", purpose, MAX_PURPOSE_CHARS)):  # fmt: skip
            if value is not None and len(value) > limit:
                raise BadArtifactRequest(f"{name} is longer than {limit} characters")
        if declared_size is not None and declared_size > max_bytes:
            raise ArtifactTooLarge(f"{declared_size} bytes is over the {max_bytes}-byte limit of one upload")
        cfg = self.config
        if cfg.max_objects and self._stored.objects + self._unindexed_writers >= cfg.max_objects:
            raise QuotaExceeded(f"the artifact store holds its maximum of {cfg.max_objects} objects; delete some first")
        self._check_bytes(declared_size or 0)
        created = now_ms()
        ttl = cfg.ttl_ms
        meta = ArtifactMeta(
            id=new_id(self.owner), media_type=media_type, size_bytes=0, digest=None, state="pending", kind=kind,
            created_at_ms=created, expires_at_ms=created + ttl if ttl is not None else None,
            filename=filename, purpose=purpose,
        )  # fmt: skip
        handle = open(self.tmp_path(meta.id), "xb")  # noqa: SIM115 - owned by the writer
        if pending:
            try:
                self._insert(meta)
            except BaseException:
                handle.close()
                self.tmp_path(meta.id).unlink(missing_ok=True)
                raise
        else:
            self._unindexed_writers += 1
        self._inflight[meta.id] = 0
        return ArtifactWriter(self, meta, handle, max_bytes, indexed=pending)

    async def create(
        self,
        chunks: AsyncIterable[bytes],
        *,
        media_type: str = DEFAULT_MEDIA_TYPE,
        kind: ArtifactKind = "uploaded",
        max_bytes: int = UPLOAD_MAX_BYTES,
        declared_size: int | None = None,
        filename: str | None = None,
        purpose: str | None = None,
    ) -> ArtifactMeta:
        """Stream ``chunks`` into a new ready artifact (nothing is kept if anything fails).

        An async generator passed as ``chunks`` is closed on the way out, also when a limit
        stops the upload half way.
        """
        try:
            async with self.begin(media_type=media_type, kind=kind, max_bytes=max_bytes, declared_size=declared_size,
                                  filename=filename, purpose=purpose) as writer:  # fmt: skip
                async for chunk in chunks:
                    await writer.write(chunk)
                return await writer.commit()
        finally:
            aclose = getattr(chunks, "aclose", None)
            if aclose is not None:
                await aclose()

    def _check_bytes(self, more: int) -> None:
        limit = self.config.max_bytes
        if limit and self._stored.bytes + sum(self._inflight.values()) + more > limit:
            raise QuotaExceeded(f"the artifact store is full ({limit} bytes); delete some artifacts first")

    def _insert(self, meta: ArtifactMeta) -> None:
        self.index.insert(meta)
        self._stored = self._stored + Totals(meta.size_bytes, 1)

    # -- the writer's ledger (inclavate.artifact_writer.Ledger) ----------------------------

    def tmp_path(self, id_: str) -> Path:
        return self._tmp / f"{id_}.part"

    def object_path(self, id_: str) -> Path:
        return self._objects / id_

    def reserve(self, id_: str, total_bytes: int) -> None:
        self._check_bytes(total_bytes - self._inflight.get(id_, 0))
        self._inflight[id_] = total_bytes

    def publish(self, meta: ArtifactMeta, *, indexed: bool) -> None:
        if not indexed:
            self._insert(meta)
        elif self.index.mark_ready(meta.id, meta.size_bytes, meta.digest or ""):
            self._stored = self._stored + Totals(meta.size_bytes, 0)
        else:
            raise ArtifactNotFound(f"artifact {meta.id} was deleted while it was being written")

    def fail(self, id_: str, reason: str) -> None:
        self.index.mark_failed(id_, reason)

    def release(self, id_: str, *, indexed: bool) -> None:
        self._inflight.pop(id_, None)
        if not indexed:
            self._unindexed_writers -= 1

    # -- reading -----------------------------------------------------------------------

    def meta(self, id_: str) -> ArtifactMeta:
        """Metadata of a live artifact in any state (ArtifactNotFound if absent or expired)."""
        meta = self.index.get(parse_id(id_))
        if meta is None or meta.expired(now_ms()):
            raise ArtifactNotFound(f"no artifact {id_}")
        return meta

    async def open(self, id_: str, range_header: str | None = None) -> ArtifactRead:
        """Open a ready artifact for reading, whole or one range of it."""
        meta = self.meta(id_)
        byte_range = meta.range_to_read(range_header)
        try:
            handle = await trio.to_thread.run_sync(open, self.object_path(meta.id), "rb")
        except FileNotFoundError:  # deleted between the row lookup and the open
            raise ArtifactNotFound(f"no artifact {id_}") from None
        except OSError as exc:
            raise ArtifactUnavailable(f"cannot read artifact {meta.id}: {exc.strerror}") from exc
        start, length = (byte_range.start, byte_range.length) if byte_range else (0, meta.size_bytes)
        chunks = self.reads.track(meta.id, handle, start, length)
        if self.index.get(meta.id) is None:  # deleted while the file was being opened: too late to be cut
            await chunks.aclose()
            raise ArtifactNotFound(f"no artifact {id_}")
        return ArtifactRead(meta, byte_range, chunks)

    async def read_all(self, id_: str, max_bytes: int) -> tuple[ArtifactMeta, bytes]:
        """A whole ready artifact in memory, for inputs known to be small (ArtifactTooLarge)."""
        read = await self.open(id_)
        return read.meta, await read_whole(read, max_bytes)

    def list(self, query: ListQuery) -> ArtifactPage:
        return self.index.page(query, now_ms())

    def usage(self) -> Usage:
        totals = self.index.totals(now_ms())
        cfg = self.config
        return Usage(
            generated=totals.get("generated", Totals()), uploaded=totals.get("uploaded", Totals()),
            max_bytes=cfg.max_bytes, max_objects=cfg.max_objects, default_ttl_hours=cfg.ttl_hours,
        )  # fmt: skip

    # -- deleting ----------------------------------------------------------------------

    async def delete(self, id_: str) -> ArtifactMeta:
        """Remove row, then bytes. Open local reads of it are cut (their next chunk fails,
        and their file is closed at once): the quota stops counting the bytes now, so no
        reader may keep them on disk (a slow download held a deleted object for hours)."""
        meta = self.index.delete(parse_id(id_))
        if meta is None:
            raise ArtifactNotFound(f"no artifact {id_}")
        self._stored = self._stored + Totals(-meta.size_bytes, -1)
        self.reads.revoke(meta.id)
        await trio.to_thread.run_sync(lambda: self.object_path(meta.id).unlink(missing_ok=True))
        return meta

    async def sweep_expired(self) -> int:
        """Delete every artifact whose ``expires_at`` has passed; returns how many."""
        swept = 0
        while ids := self.index.expired_ids(now_ms()):
            for id_ in ids:
                try:
                    await self.delete(id_)
                    swept += 1
                except ArtifactNotFound:
                    pass
        if swept:
            log.info("swept %d expired artifact(s)", swept)
        return swept

    async def run_sweeper(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Sweep expired artifacts every ``sweep_interval_s`` (only when a TTL is set)."""
        task_status.started()
        if self.config.ttl_hours is None:
            return
        while True:
            try:
                await self.sweep_expired()
            except ArtifactUnavailable as exc:
                log.warning("artifact sweep failed, retrying later: %s", exc)
            await trio.sleep(self.config.sweep_interval_s)
