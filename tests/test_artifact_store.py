"""The local artifact store: streamed writes, digests, states, listing order, quotas, TTL,
ranges, restarts, and what a kill -9 mid-upload leaves behind (nothing)."""

from __future__ import annotations

import hashlib
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import trio

from inclavate import artifacts as artifacts_module
from inclavate.artifact_index import ArtifactIndex
from inclavate.artifact_types import (
    ArtifactConfig,
    ArtifactNotFound,
    ArtifactNotReady,
    ArtifactTooLarge,
    ListQuery,
    QuotaExceeded,
    Totals,
)
from inclavate.artifacts import ArtifactStore
from inclavate.byte_ranges import RangeNotSatisfiable
from inclavate.owner_ids import MalformedId, owner_candidates

OWNER = "12D3KooWOwnerOwnerOwnerOwnerOwnerOwnerOwnerOwnerOwn"


async def chunks_of(data: bytes, size: int = 70_000) -> AsyncIterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


def make_store(tmp_path: Path, **config: object) -> ArtifactStore:
    return ArtifactStore(tmp_path, OWNER, ArtifactConfig(**config))  # type: ignore[arg-type]


async def read_whole(store: ArtifactStore, id_: str, range_header: str | None = None) -> bytes:
    read = await store.open(id_, range_header)
    return b"".join([c async for c in read.chunks])


async def test_streamed_upload_is_stored_with_its_digest(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    data = os.urandom(3 * 1024 * 1024 + 17)  # crosses the write buffer several times
    meta = await store.create(chunks_of(data), media_type="audio/wav")
    assert meta.state == "ready" and meta.kind == "uploaded" and meta.size_bytes == len(data)
    assert meta.digest == hashlib.sha256(data).hexdigest()
    assert owner_candidates(meta.id, ["12D3KooWother", OWNER]) == [OWNER]
    body = meta.to_json()
    assert body["created_at"].endswith("Z") and body["expires_at"] is None
    assert "filename" not in body and "purpose" not in body
    assert store.meta(meta.id) == meta
    assert await read_whole(store, meta.id) == data
    assert list((tmp_path / "artifacts" / "tmp").iterdir()) == []


async def test_range_reads(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    data = bytes(range(256)) * 4000
    meta = await store.create(chunks_of(data))
    read = await store.open(meta.id, "bytes=1000-300999")
    assert read.range is not None and read.length == 300000
    assert b"".join([c async for c in read.chunks]) == data[1000:301000]
    assert await read_whole(store, meta.id, f"bytes={len(data) - 3}-") == data[-3:]
    assert await read_whole(store, meta.id, f"bytes={len(data) - 3}-{len(data) + 99}") == data[-3:]
    with pytest.raises(RangeNotSatisfiable):
        await store.open(meta.id, f"bytes={len(data)}-{len(data) + 99}")


async def test_size_cap_refuses_declared_and_streamed_bytes(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    with pytest.raises(ArtifactTooLarge):
        await store.create(chunks_of(b""), max_bytes=10, declared_size=11)
    with pytest.raises(ArtifactTooLarge):
        await store.create(chunks_of(b"x" * 11, 3), max_bytes=10)
    assert store.list(ListQuery()).artifacts == []
    assert list((tmp_path / "artifacts" / "tmp").iterdir()) == []
    assert store.usage().total.objects == 0


async def test_byte_quota_counts_writes_in_flight(tmp_path: Path) -> None:
    store = make_store(tmp_path, max_bytes=100)
    first = await store.create(chunks_of(b"a" * 60))
    with pytest.raises(QuotaExceeded):
        await store.create(chunks_of(b"b" * 41))
    with pytest.raises(QuotaExceeded):  # known from Content-Length before any byte
        store.begin(kind="uploaded", declared_size=50)
    async with store.begin(kind="uploaded") as w1, store.begin(kind="uploaded") as w2:
        await w1.write(b"c" * 30)
        with pytest.raises(QuotaExceeded):
            await w2.write(b"d" * 11)
        await w1.abort()
    await store.delete(first.id)
    await store.create(chunks_of(b"e" * 100))
    assert store.usage().to_json()["bytes"] == 100


async def test_object_quota(tmp_path: Path) -> None:
    store = make_store(tmp_path, max_objects=2)
    await store.create(chunks_of(b"1"))
    async with store.begin(kind="generated", pending=True):
        with pytest.raises(QuotaExceeded):
            await store.create(chunks_of(b"2"))
    # the aborted pending output stays as a failed row and still holds its slot
    assert store.usage().total.objects == 2
    with pytest.raises(QuotaExceeded):
        store.begin(kind="uploaded")


async def test_listing_order_pages_and_kind_filter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = make_store(tmp_path)
    monkeypatch.setattr(artifacts_module, "now_ms", lambda: 1_000_000)  # all in the same millisecond
    same_ms = [await store.create(chunks_of(b"u"), kind="uploaded") for _ in range(3)]
    monkeypatch.setattr(artifacts_module, "now_ms", lambda: 2_000_000)
    generated = [await store.create(chunks_of(b"gg"), kind="generated") for _ in range(2)]
    monkeypatch.undo()
    expected = sorted(generated, key=lambda m: m.id, reverse=True) + sorted(same_ms, key=lambda m: m.id, reverse=True)
    whole = store.list(ListQuery(limit=100))
    assert [m.id for m in whole.artifacts] == [m.id for m in expected] and not whole.truncated
    walked = []
    for offset in range(0, 5, 2):
        page = store.list(ListQuery(limit=2, offset=offset))
        walked += page.artifacts
        assert page.truncated == (offset + 2 < 5)
    assert [m.id for m in walked] == [m.id for m in expected]
    assert {m.kind for m in store.list(ListQuery(kind="generated")).artifacts} == {"generated"}
    assert len(store.list(ListQuery(kind="uploaded")).artifacts) == 3
    after = store.list(ListQuery(after=expected[1].sort_key()))
    assert [m.id for m in after.artifacts] == [m.id for m in expected[2:]]
    usage = store.usage().to_json()
    assert usage == {"bytes": 7, "objects": 5, "max_bytes": 0, "max_objects": 0,
                     "generated": {"bytes": 4, "objects": 2}, "uploaded": {"bytes": 3, "objects": 3}}  # fmt: skip


async def test_pending_output_becomes_ready_or_failed(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    async with store.begin(media_type="audio/wav", kind="generated", pending=True) as writer:
        assert store.meta(writer.id).state == "pending"
        with pytest.raises(ArtifactNotReady):
            await store.open(writer.id)
        await writer.write(b"RIFF")
        meta = await writer.commit()
    assert store.meta(meta.id).state == "ready" and await read_whole(store, meta.id) == b"RIFF"

    with pytest.raises(ValueError):
        async with store.begin(kind="generated", pending=True) as failing:
            await failing.write(b"half")
            raise ValueError("generator crashed")
    failed = store.meta(failing.id)
    assert failed.state == "failed" and "generator crashed" in (failed.error or "")
    with pytest.raises(ArtifactNotReady):
        await store.open(failed.id)
    await store.delete(failed.id)


async def test_delete_during_a_pending_write_wins(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    async with store.begin(kind="generated", pending=True) as writer:
        await writer.write(b"abc")
        await store.delete(writer.id)
        with pytest.raises(ArtifactNotFound):
            await writer.commit()
    assert list((tmp_path / "artifacts" / "objects").iterdir()) == []
    assert store.usage().total.objects == 0


async def test_delete_cuts_open_reads_and_closes_their_files(tmp_path: Path) -> None:
    """Deleting an object closed none of its open reads: each kept the file (and its blocks)
    while the quota counted the bytes freed (an audit, 2026-12-07, F4). Now every open read
    of it lets go of the file at once and fails its next chunk; reads of others go on."""
    store = make_store(tmp_path)
    data = os.urandom(3 * 1024 * 1024)
    meta = await store.create(chunks_of(data))
    other = await store.create(chunks_of(b"kept"))
    reads = [await store.open(meta.id), await store.open(meta.id, "bytes=100-")]
    kept = await store.open(other.id)
    assert await reads[0].chunks.__anext__() == data[:256 * 1024]
    await store.delete(meta.id)
    for read in reads:
        with pytest.raises(ArtifactNotFound):
            await read.chunks.__anext__()
        await read.chunks.aclose()  # what a response does on the way out: harmless twice
    assert store.reads.count(meta.id) == 0 and store.usage().total.bytes == len(b"kept")
    assert b"".join([c async for c in kept.chunks]) == b"kept" and store.reads.count(other.id) == 0


async def test_unknown_and_malformed_ids(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    with pytest.raises(ArtifactNotFound):
        store.meta("1deaf021-07a3-407c-9d6f-1af47c23db18")
    with pytest.raises(ArtifactNotFound):
        await store.delete("1deaf021-07a3-407c-9d6f-1af47c23db18")
    with pytest.raises(MalformedId):
        await store.open("../index.db")


async def test_ttl_expiry_hides_then_sweeps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = make_store(tmp_path, ttl_hours=1.0)
    meta = await store.create(chunks_of(b"soon gone"))
    assert meta.expires_at_ms == meta.created_at_ms + 3_600_000
    assert store.usage().to_json()["default_ttl_hours"] == 1.0
    assert await store.sweep_expired() == 0
    monkeypatch.setattr(artifacts_module, "now_ms", lambda: meta.created_at_ms + 3_600_000)
    with pytest.raises(ArtifactNotFound):
        store.meta(meta.id)  # expired reads as gone even before the sweep
    assert store.list(ListQuery()).artifacts == [] and store.usage().total.objects == 0
    assert await store.sweep_expired() == 1
    assert list((tmp_path / "artifacts" / "objects").iterdir()) == []


async def test_sweeper_task_runs_on_its_interval(tmp_path: Path) -> None:
    store = make_store(tmp_path, ttl_hours=0.5 / 3600, sweep_interval_s=0.1)
    meta = await store.create(chunks_of(b"x"))
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run_sweeper)
        with trio.fail_after(10):
            while (tmp_path / "artifacts" / "objects" / meta.id).exists():
                await trio.sleep(0.05)
        nursery.cancel_scope.cancel()


async def test_ready_artifacts_survive_a_restart_byte_for_byte(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    data = os.urandom(2_000_000)
    meta = await store.create(chunks_of(data), media_type="audio/wav", filename="a.wav", purpose="user_data")
    store.close()
    again = make_store(tmp_path)
    assert again.meta(meta.id) == meta
    assert await read_whole(again, meta.id) == data
    assert again.usage().total.bytes == len(data)


async def test_restart_cleans_what_a_crash_left(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    kept = await store.create(chunks_of(b"kept"))
    lost = await store.create(chunks_of(b"lost"))
    pending = store.begin(kind="generated", pending=True)
    pending._handle.close()  # its process "dies" here, leaving the temp file
    store.close()
    root = tmp_path / "artifacts"
    (root / "objects" / lost.id).unlink()  # a ready row whose bytes vanished
    (root / "objects" / "1deaf021-07a3-407c-9d6f-1af47c23db18").write_bytes(b"renamed, never indexed")
    assert (root / "tmp" / f"{pending.id}.part").exists()
    again = make_store(tmp_path)
    assert [m.id for m in again.list(ListQuery()).artifacts if m.state == "ready"] == [kept.id]
    assert again.meta(pending.id).state == "failed"
    with pytest.raises(ArtifactNotFound):
        again.meta(lost.id)
    assert sorted(p.name for p in (root / "objects").iterdir()) == [kept.id]
    assert list((root / "tmp").iterdir()) == []


CRASHING_UPLOAD = textwrap.dedent(
    """
    import sys, trio
    from pathlib import Path
    from inclavate.artifacts import ArtifactStore

    async def main():
        store = ArtifactStore(Path(sys.argv[1]), sys.argv[2])
        pending = store.begin(kind="generated", pending=True)
        plain = store.begin(kind="uploaded")
        for _ in range(3):
            await pending.write(b"p" * 1_000_000)
            await plain.write(b"u" * 1_000_000)
        print(pending.id, plain.id, flush=True)
        await trio.sleep(60)

    trio.run(main)
    """
)


@pytest.mark.slow
def test_kill_9_mid_upload_leaves_no_ready_artifact_and_no_orphan(tmp_path: Path) -> None:
    command = [sys.executable, "-c", CRASHING_UPLOAD, str(tmp_path), OWNER]
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as proc:
        try:
            pending_id, plain_id = proc.stdout.readline().split()  # type: ignore[union-attr]
            assert len(list((tmp_path / "artifacts" / "tmp").iterdir())) == 2
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
    store = make_store(tmp_path)
    rows = store.list(ListQuery()).artifacts
    assert [(m.id, m.state) for m in rows] == [(pending_id, "failed")]
    with pytest.raises(ArtifactNotFound):
        store.meta(plain_id)
    root = tmp_path / "artifacts"
    assert list((root / "tmp").iterdir()) == [] and list((root / "objects").iterdir()) == []


def _fill(index: ArtifactIndex, n: int, now: int) -> None:
    """``n`` ready rows, one in 500 a file upload, all expiring an hour from ``now``, and a few
    already expired (not swept yet)."""
    rows = [(f"a{i:07d}", "audio/wav", 10, "d", "ready", "uploaded" if i % 500 == 0 else "generated", now - n + i,
             now - 1 if i < 3 else now + 3_600_000, "assistants" if i % 500 == 0 else None) for i in range(n)]  # fmt: skip
    with index._db.conn:
        index._db.conn.executemany(
            "INSERT INTO artifacts (id, media_type, size_bytes, digest, state, kind, created_at_ms, expires_at_ms,"
            " purpose) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)  # fmt: skip


def _steps(index: ArtifactIndex, work: Callable[[], object]) -> int:
    """SQLite VM instructions ``work`` runs (they grow with the rows a query visits)."""
    count = [0]

    def step() -> int:
        count[0] += 1
        return 0

    index._db.conn.set_progress_handler(step, 1)
    try:
        work()
    finally:
        index._db.conn.set_progress_handler(None, 1)
    return count[0]


@pytest.mark.parametrize("schema", [1, 2])
def test_index_work_does_not_grow_with_rows(tmp_path: Path, schema: int) -> None:
    """The sweeper's look for expired rows, ``usage`` (any peer may ask) and a Files or kind
    listing visit a few rows whatever the table holds: version 1 scanned all of it for each
    (~6, ~57 and ~22 ms at 100,000 artifacts). A version-1 table gains the indexes on open."""
    now = 10_000_000
    path = tmp_path / "index.db"
    if schema == 1:  # the version-1 table, as a peer of the previous release left it
        conn = sqlite3.connect(path)
        conn.execute("CREATE TABLE artifacts (id TEXT PRIMARY KEY, media_type TEXT NOT NULL, size_bytes INTEGER NOT NULL,"
                     " digest TEXT, state TEXT NOT NULL, kind TEXT NOT NULL, created_at_ms INTEGER NOT NULL,"
                     " expires_at_ms INTEGER, filename TEXT, purpose TEXT, error TEXT)")  # fmt: skip
        conn.execute("CREATE INDEX idx_artifacts_created_at_ms_id ON artifacts (created_at_ms, id)")
        conn.execute("PRAGMA user_version = 1")
        conn.commit()
        conn.close()
    index = ArtifactIndex(path)
    _fill(index, 20_000, now)
    index.close()
    index = ArtifactIndex(path)
    bound = 2_000  # a full scan of 20,000 rows runs hundreds of thousands
    assert _steps(index, lambda: index.expired_ids(now)) < bound
    assert sorted(index.expired_ids(now)) == ["a0000000", "a0000001", "a0000002"]
    assert _steps(index, lambda: index.totals(now)) < bound
    assert _steps(index, lambda: index.page(ListQuery(limit=20, files_only=True), now)) < 20 * bound
    assert _steps(index, lambda: index.page(ListQuery(limit=20, kind="uploaded"), now)) < 20 * bound
    page = index.page(ListQuery(limit=20, files_only=True), now)
    assert len(page.artifacts) == 20 and all(m.purpose == "assistants" for m in page.artifacts)


async def test_usage_counts_match_the_table_through_every_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``usage`` and the quota read counts kept beside the table: they match a full count
    after uploads, pending outputs made ready or failed, deletes, expiry and a restart."""
    clock = [1_000_000]
    monkeypatch.setattr(artifacts_module, "now_ms", lambda: clock[0])
    store = make_store(tmp_path, ttl_hours=1.0)

    def counted(now: int) -> dict[str, tuple[int, int]]:
        sql = ("SELECT kind, COALESCE(SUM(size_bytes), 0), COUNT(*) FROM artifacts"
               " WHERE expires_at_ms IS NULL OR expires_at_ms > ? GROUP BY kind")  # fmt: skip
        return {k: (b, n) for k, b, n in store.index._db.execute(sql, [now]).fetchall()}

    def usage() -> dict[str, tuple[int, int]]:
        return {k: (t.bytes, t.objects) for k, t in store.index.totals(clock[0]).items()}

    first = await store.create(chunks_of(b"x" * 100))
    async with store.begin(kind="generated", pending=True) as writer:
        await writer.write(b"y" * 30)
        assert usage() == counted(clock[0]) == {"uploaded": (100, 1), "generated": (0, 1)}
        await writer.commit()
    with pytest.raises(RuntimeError):
        async with store.begin(kind="generated", pending=True) as failing:
            await failing.write(b"z" * 7)
            raise RuntimeError("the generator died")
    assert usage() == counted(clock[0]) == {"uploaded": (100, 1), "generated": (30, 2)}
    clock[0] += 1_000
    await store.create(chunks_of(b"w" * 5))
    await store.delete(first.id)
    assert usage() == counted(clock[0]) == {"uploaded": (5, 1), "generated": (30, 2)}
    clock[0] += 3_600_000 - 500  # the first three expired, the last upload not yet
    assert usage() == counted(clock[0]) == {"uploaded": (5, 1)}
    assert store.index.stored() == store.usage().total + Totals(30, 2)  # not swept yet
    assert await store.sweep_expired() == 2
    store.close()
    again = make_store(tmp_path, ttl_hours=1.0)
    assert {k: (t.bytes, t.objects) for k, t in again.index.totals(clock[0]).items()} == {"uploaded": (5, 1)}
    assert again.index.stored() == Totals(5, 1)
