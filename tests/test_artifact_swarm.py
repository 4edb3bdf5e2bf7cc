"""Artifacts across peers, in process: two libp2p hosts, each with its own store, serving
``/inclavate/artifacts/2``; every operation through the peer that does not hold the bytes,
and what a hostile asker or a hostile owner gets."""

from __future__ import annotations

import gc
import json
import os
import struct
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio
from owner_grinding import ground

import inclavate.artifact_swarm
from inclavate.artifact_swarm import KEYS_SHARE_S, PEER_TIMEOUT_S, ROW_BYTES_PER_LISTING, SwarmArtifacts
from inclavate.artifact_types import (
    MAX_FILENAME_CHARS,
    ArtifactConfig,
    ArtifactMeta,
    ArtifactNotFound,
    ArtifactNotReady,
    ArtifactPage,
    ArtifactUnavailable,
    BadArtifactRequest,
    KeyPage,
    ListQuery,
    Usage,
)
from inclavate.artifacts import READ_CHUNK, ArtifactStore
from inclavate.artifact_types import MAX_ERROR_CHARS, error_text
from inclavate.byte_ranges import RangeMalformed, RangeNotSatisfiable
import inclavate.fan_out
from inclavate.fan_out import (ASK_PATIENCE_S, MAX_ASKS_IN_FLIGHT, MAX_ASKS_PER_FANOUT, MAX_LISTINGS_AT_ONCE,
                               MAX_LISTINGS_WAITING, LeftOut, ListingGate, ListingsBusy, listing_budget)  # fmt: skip
from inclavate.owner_ids import MalformedId, Owners, new_id
from inclavate.types import PeerId
import p2p.artifacts
from p2p.artifact_wire import (HONEST_ROW_BYTES, MAX_ANSWER_BYTES, MAX_PIECE, MAX_RECORD_ANSWER_BYTES, MAX_ROW_BYTES, decode_keys,
                               encode, list_answer_limit, read_request)  # fmt: skip
from p2p.artifacts import DIRECT_PROTOCOL, MAX_READS_PER_PEER, PROTOCOL, RemoteArtifacts, serve_artifacts
from p2p.direct import MAGIC, TICKET_BYTES, DirectLinks, LinkTable
from p2p.errors import P2PError
from p2p.framing import FramedStream
from p2p.host import P2PHost, open_host
from p2p.identity import Identity


@dataclass
class Node:
    host: P2PHost
    store: ArtifactStore
    swarm: SwarmArtifacts
    remote: RemoteArtifacts
    direct: DirectLinks | None = None


async def chunks(data: bytes) -> AsyncIterator[bytes]:
    for i in range(0, len(data), 100_000):
        yield data[i : i + 100_000]


@asynccontextmanager
async def two_peers(tmp_path: Path, config: ArtifactConfig | None = None, direct: bool = False) -> AsyncIterator[tuple[Node, Node]]:
    """Two connected peers; with ``direct``, each serves and dials direct links too."""
    async with AsyncExitStack() as stack:
        hosts = [await stack.enter_async_context(open_host(Identity.generate(), listen_host="127.0.0.1")) for _ in range(2)]
        nursery = await stack.enter_async_context(trio.open_nursery())
        stack.callback(nursery.cancel_scope.cancel)
        peers = [h.peer_id for h in hosts]
        nodes = []
        for i, host in enumerate(hosts):
            store = ArtifactStore(tmp_path / f"peer{i}", host.peer_id, config)
            stack.callback(store.close)
            links = DirectLinks(host) if direct else None
            if links is not None:
                await nursery.start(links.run)
            serve_artifacts(host, store, links)
            remote = RemoteArtifacts(host, links)
            await nursery.start(remote.run)
            nodes.append(Node(host, store, SwarmArtifacts(store, remote, lambda: peers, lambda: peers), remote, links))
        await hosts[0].connect(hosts[1].multiaddrs()[0])
        yield nodes[0], nodes[1]



def pair(a: Node, b: Node) -> Owners:
    """The owners of the two peers' ids, as a listing on either knows them."""
    return Owners([a.host.peer_id, b.host.peer_id])

async def read(swarm: SwarmArtifacts, id_: str, range_header: str | None = None) -> bytes:
    opened = await swarm.open(id_, range_header)
    return b"".join([c async for c in opened.chunks])


async def test_every_operation_through_the_other_peer(tmp_path: Path) -> None:
    data = os.urandom(1_300_000)  # several 256 KiB frames
    with trio.fail_after(60):
        async with two_peers(tmp_path) as (a, b):
            meta = await a.store.create(chunks(data), media_type="audio/wav", filename="x.wav", purpose="vision")
            assert await b.swarm.meta(meta.id) == meta
            assert await read(b.swarm, meta.id) == data
            part = await b.swarm.open(meta.id, "bytes=1000-1999")
            assert part.range is not None and part.range.content_range() == f"bytes 1000-1999/{len(data)}"
            assert b"".join([c async for c in part.chunks]) == data[1000:2000]
            with pytest.raises(RangeNotSatisfiable) as info:
                await b.swarm.open(meta.id, "bytes=0-1,5-6")
            assert info.value.size == len(data)
            with pytest.raises(RangeMalformed):
                await b.swarm.open(meta.id, "bytes=z")
            # an abandoned remote read does not wedge the owner
            half = await b.swarm.open(meta.id)
            await half.chunks.__anext__()
            await half.chunks.aclose()
            assert await read(b.swarm, meta.id, "bytes=0-0") == data[:1]
            # the owner clamps an end past the object, and the asker accepts the clamped range
            assert await read(b.swarm, meta.id, f"bytes={len(data) - 4}-{len(data) + 99}") == data[-4:]

            await b.store.create(chunks(b"held by b"), kind="generated")
            listed = await a.swarm.list(ListQuery())
            assert [m.id for m in listed.artifacts] == [m.id for m in (await b.swarm.list(ListQuery())).artifacts]
            keys = [m.sort_key() for m in listed.artifacts]
            assert len(keys) == 2 and keys == sorted(keys, reverse=True)
            page = await a.swarm.list(ListQuery(limit=1, offset=1))
            assert [m.id for m in page.artifacts] == [listed.artifacts[1].id] and not page.truncated
            assert (await a.swarm.list(ListQuery(limit=1))).truncated
            assert [m.kind for m in (await a.swarm.list(ListQuery(kind="generated"))).artifacts] == ["generated"]
            assert [m.id for m in (await b.swarm.list(ListQuery(files_only=True))).artifacts] == [meta.id]
            usage = (await a.swarm.usage()).to_json()
            assert usage["objects"] == 2 and usage["bytes"] == len(data) + 9
            assert usage["uploaded"] == {"bytes": len(data), "objects": 1}

            await b.swarm.delete(meta.id)
            with pytest.raises(ArtifactNotFound):
                a.store.meta(meta.id)
            with pytest.raises(ArtifactNotFound):
                await b.swarm.delete(meta.id)


async def test_an_uppercase_id_reads_through_the_other_peer_as_through_the_owner(tmp_path: Path) -> None:
    """A UUID is case-insensitive and the owner answers ``F0508D13-...`` as ``f0508d13-...``;
    through any other peer the asker sent the id as typed, the owner described the canonical
    id, and the asker took that for a lie: 503 "held by a peer that does not answer now"."""
    with trio.fail_after(60):
        async with two_peers(tmp_path) as (a, b):
            meta = await a.store.create(chunks(b"shouted"), media_type="text/plain")
            upper = meta.id.upper()
            assert await a.swarm.meta(upper) == meta
            assert await b.swarm.meta(upper) == meta
            assert await read(b.swarm, upper, "bytes=0-2") == b"sho"
            await b.swarm.delete(upper)
            with pytest.raises(ArtifactNotFound):
                await b.swarm.meta(meta.id)


async def test_states_and_unknown_owners(tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with two_peers(tmp_path) as (a, b):
            async with a.store.begin(kind="generated", pending=True) as writer:
                assert (await b.swarm.meta(writer.id)).state == "pending"
                with pytest.raises(ArtifactNotReady):
                    await b.swarm.open(writer.id)
            with pytest.raises(ArtifactNotFound):  # nobody carries this tag
                await b.swarm.meta("1deaf021-07a3-407c-9d6f-1af47c23db18")
            with pytest.raises(MalformedId):
                await b.swarm.meta("../../x")
            # an owner that the registry names but that does not answer: 503, not 404
            ghost = Identity.generate().peer_id
            lonely = SwarmArtifacts(b.store, RemoteArtifacts(b.host), lambda: [ghost], lambda: [])
            with pytest.raises(ArtifactUnavailable):
                await lonely.meta(new_id(ghost))


async def test_swarm_listing_depth_is_bounded(tmp_path: Path) -> None:
    async with two_peers(tmp_path) as (a, _):
        from api.errors import error_response_parts

        with pytest.raises(Exception) as info:
            await a.swarm.list(ListQuery(limit=1000, offset=100_000))
        assert error_response_parts(info.value)[0] == 400


async def raw_request(asker: P2PHost, owner: P2PHost, payload: bytes) -> dict | None:
    stream = await asker.new_stream(owner.peer_id, PROTOCOL, timeout=5)
    async with stream:
        await stream.send(payload, timeout=5)
        try:
            return json.loads(await stream.receive(timeout=5))
        except P2PError:
            return None


async def raw_read(asker: P2PHost, owner: P2PHost, id_: str, offset: int = 0, length: int = MAX_PIECE) -> tuple[FramedStream, dict]:
    """A read asked for by hand (a hostile asker): the stream, left open, and the answer."""
    stream = await asker.new_stream(owner.peer_id, PROTOCOL, timeout=5, max_frame_size=MAX_ANSWER_BYTES)
    await stream.send(json.dumps(read_request(id_, offset, length)).encode(), timeout=5)
    return stream, json.loads(await stream.receive(timeout=5))


async def test_hostile_requests_are_refused_and_contained(tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with two_peers(tmp_path) as (a, b):
            meta = await a.store.create(chunks(b"precious"))
            refusals = [
                b"not json",
                b"[]",
                json.dumps({"op": "format_disk"}).encode(),
                json.dumps({"op": "read", "id": "../../index.db"}).encode(),
                json.dumps({"op": "read", "id": meta.id, "range": "bytes=0-"}).encode(),  # version 1's read
                *(json.dumps({"op": "read", "id": meta.id, "offset": offset, "length": 4}).encode()
                  for offset in (None, -1, "0", True, 1.5, 2**63, 10**30, [0], {"$gt": 0})),
                *(json.dumps({"op": "read", "id": meta.id, "offset": 0, "length": length}).encode()
                  for length in (None, 0, -5, "4", True, 2.0, MAX_PIECE + 1, 10**12, 2**64)),
                json.dumps({"op": "list", "limit": 10**9}).encode(),
                json.dumps({"op": "list", "limit": True}).encode(),
                json.dumps({"op": "list", "limit": 1001}).encode(),  # whole rows: 1 000 an answer
                json.dumps({"op": "list", "limit": 20_001, "keys": True}).encode(),  # keys: the swarm's window
                json.dumps({"op": "list", "limit": 5, "after": [-1, meta.id]}).encode(),
                json.dumps({"op": "list", "limit": 5, "kind": {"$ne": 1}}).encode(),
                json.dumps({"op": "delete", "id": 12}).encode(),
            ]
            for payload in refusals:
                answer = await raw_request(b.host, a.host, payload)
                assert answer is not None and answer["ok"] is False, payload
                assert answer["error"] in ("bad_request", "malformed_id", "malformed_range"), answer
            # a start at or past the object's end (the largest offset too) is 416 with its size
            for offset in (8, 9, 2**63 - 1):
                stream, answer = await raw_read(b.host, a.host, meta.id, offset, MAX_PIECE)
                await stream.reset()
                assert answer["ok"] is False and answer["error"] == "unsatisfiable_range" and answer["size"] == 8
            # an end past the object is clamped, and says so
            stream, answer = await raw_read(b.host, a.host, meta.id, 4, MAX_PIECE)
            assert answer["ok"] is True and answer["range"] == [4, 7]
            assert await stream.receive(timeout=5) == b"ious" and await stream.receive(timeout=5) == b""
            await stream.close()
            # a request frame over 4 KiB: the owner resets the stream, nothing else happens
            assert await raw_request(b.host, a.host, b"{" + b" " * 10_000 + b"}") is None
            assert await read(b.swarm, meta.id) == b"precious"
            assert a.store.meta(meta.id).ready


LIES = {
    "more bytes than asked": lambda r, rec: ({"artifact": rec, "range": r}, [b"123456789"]),
    "a frame past the chunk size": lambda r, rec: ({"artifact": rec, "range": r}, [b"1" * (READ_CHUNK + 1)]),
    "fewer bytes than asked": lambda r, rec: ({"artifact": rec, "range": r}, [b"123"]),
    "another range": lambda r, rec: ({"artifact": rec, "range": [0, 2]}, [b"123"]),
    "no range": lambda r, rec: ({"artifact": rec, "range": None}, [b"12345"]),
    "another size": lambda r, rec: ({"artifact": {**rec, "size_bytes": 4}, "range": r}, [b"12345"]),
    "another digest": lambda r, rec: ({"artifact": {**rec, "digest": "0" * 64}, "range": r}, [b"12345"]),
    "a stall mid-piece": lambda r, rec: ({"artifact": rec, "range": r}, [b"12", None]),
}


@pytest.mark.parametrize("lie", list(LIES))
async def test_a_lying_owner_is_caught(tmp_path: Path, lie: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An owner describes its artifact honestly, then serves a piece that is not the one
    asked for, or not whole, or never ends: the asker refuses it (503), holding no more
    than the piece it asked for, and no longer than that piece's deadline."""
    monkeypatch.setattr(p2p.artifacts, "READ_GRACE_S", 1.0)
    with trio.fail_after(60):
        async with two_peers(tmp_path) as (a, b):
            real = await a.store.create(chunks(b"12345"))

            async def liar(stream: FramedStream, remote: PeerId) -> None:
                request = json.loads(await stream.receive(timeout=5))
                stream.max_frame_size = 1 << 20
                record = {**real.to_record(), "id": request["id"]}
                if request["op"] == "meta":
                    await stream.send(json.dumps({"ok": True, "artifact": record}).encode(), timeout=5)
                    return
                span = [request["offset"], request["offset"] + request["length"] - 1]
                header, frames = LIES[lie](span, record)
                await stream.send(json.dumps({"ok": True, **header}).encode(), timeout=5)
                for frame in frames + [b""]:
                    if frame is None:
                        await trio.sleep_forever()
                    await stream.send(frame, timeout=5)

            a.host.set_stream_handler(PROTOCOL, liar)
            with pytest.raises(ArtifactUnavailable), trio.fail_after(10):
                opened = await b.swarm.open(real.id)
                async for _ in opened.chunks:
                    pass
            assert b.remote.relayed_reads == 0  # nothing held after a refused piece
            assert (len(b.remote._read_slots), len(b.remote._small_slots)) == (0, 0)  # nor a stream slot


# Where a hostile owner announces a frame larger than the answer can honestly be, and what
# it announces: it then sends a few bytes of it and stalls, so an asker that took the
# announcement in would wait for the rest (30 s) instead of refusing it at once.
OVERSIZED = {
    "a meta answer": ("meta", 4 << 20),
    "a read's header": ("header", 4 << 20),
    "a frame past the chunk size": ("data", READ_CHUNK + 1),
    "a frame past the piece's bytes": ("data", 6),
}


@pytest.mark.parametrize("lie", list(OVERSIZED))
async def test_an_answer_larger_than_its_request_needs_is_cut_off_on_its_prefix(tmp_path: Path, lie: str) -> None:
    """Every answer but a listing is bounded by what its request can need (a record; a
    piece's header, then at most the bytes the piece still lacks, in frames of at most
    READ_CHUNK), checked on the frame's length prefix: the relay refuses the frame before
    buffering it, and its client gets a 503, not wrong bytes nor a 30 s wait."""
    where, announced = OVERSIZED[lie]
    with trio.fail_after(60):
        async with two_peers(tmp_path) as (a, b):
            real = await a.store.create(chunks(b"12345"))

            async def liar(stream: FramedStream, remote: PeerId) -> None:
                request = json.loads(await stream.receive(timeout=5))
                record = {**real.to_record(), "id": request["id"]}
                if request["op"] == "read" and where == "data":
                    span = [request["offset"], request["offset"] + request["length"] - 1]
                    await stream.send(encode({"ok": True, "artifact": record, "range": span}), timeout=5)
                elif request["op"] == "meta" and where != "meta":
                    await stream.send(encode({"ok": True, "artifact": record}), timeout=5)
                    return
                await stream._raw.write(struct.pack(">I", announced) + b"1" * 5)  # then nothing more
                await trio.sleep_forever()

            a.host.set_stream_handler(PROTOCOL, liar)
            with pytest.raises(ArtifactUnavailable, match="exceeds the limit"), trio.fail_after(5):
                await b.swarm.open(real.id)
            assert b.remote.relayed_reads == 0
            assert (len(b.remote._read_slots), len(b.remote._small_slots)) == (0, 0)


def test_the_largest_honest_record_answer_fits_its_bound() -> None:
    """The bound above is no cap on honest owners: a record with every text field at its
    longest, every character one JSON escapes to 12 bytes, still fits."""
    from inclavate.artifact_types import MAX_FILENAME_CHARS, MAX_MEDIA_TYPE_CHARS, MAX_PURPOSE_CHARS, ArtifactMeta

    astral = "\U0001F600"
    record = {"size_bytes": 2**63 - 1, "state": "failed", "kind": "generated", "created_at_ms": 2**63 - 1,
              "expires_at_ms": 2**63 - 1, "id": astral * 36, "media_type": astral * MAX_MEDIA_TYPE_CHARS, "digest": astral * 64,
              "filename": astral * MAX_FILENAME_CHARS, "purpose": astral * MAX_PURPOSE_CHARS, "error": astral * 1000}
    ArtifactMeta.from_record(record)  # every field within its limit
    header = encode({"ok": True, "artifact": record, "range": [2**63 - 2, 2**63 - 1]})
    assert MAX_RECORD_ANSWER_BYTES - 1024 < len(header) <= MAX_RECORD_ANSWER_BYTES
    refused = encode({"ok": False, "error": "unsatisfiable_range", "message": astral * 1000, "size": 2**63 - 1})
    assert len(refused) <= MAX_RECORD_ANSWER_BYTES
    # and listings: MAX_LIST_ROWS such rows, or SWARM_LIST_WINDOW of the longest keys
    from inclavate.artifact_types import SWARM_LIST_WINDOW
    from p2p.artifact_wire import KEY_BYTES, MAX_LIST_ROWS

    rows = encode({"ok": True, "artifacts": [record] * MAX_LIST_ROWS, "truncated": False})
    assert list_answer_limit(MAX_LIST_ROWS, False) - 1024 * MAX_LIST_ROWS < len(rows) <= list_answer_limit(MAX_LIST_ROWS, False)
    key = [2**63 - 1, new_id(Identity.generate().peer_id)]
    assert len(encode(key)) == KEY_BYTES
    keys = encode({"ok": True, "keys": [key] * SWARM_LIST_WINDOW, "truncated": False})
    assert len(keys) <= list_answer_limit(SWARM_LIST_WINDOW, True) <= MAX_ANSWER_BYTES


async def test_an_owner_that_stays_busy_is_a_503_in_bounded_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(p2p.artifacts, "BUSY_WAIT_S", 1.0)
    with trio.fail_after(60):
        async with two_peers(tmp_path) as (a, b):
            real = await a.store.create(chunks(b"12345"))
            asked = 0

            async def busy(stream: FramedStream, remote: PeerId) -> None:
                nonlocal asked
                request = json.loads(await stream.receive(timeout=5))
                if request["op"] == "meta":
                    answer = {"ok": True, "artifact": {**real.to_record(), "id": request["id"]}}
                else:
                    asked += 1
                    answer = {"ok": False, "error": "busy", "message": "busy"}
                await stream.send(json.dumps(answer).encode(), timeout=5)

            a.host.set_stream_handler(PROTOCOL, busy)
            with pytest.raises(ArtifactUnavailable, match="busy"), trio.fail_after(5):
                await b.swarm.open(real.id)
            assert 2 <= asked <= 10  # asked again, with pauses that grow


async def test_a_peer_refusing_its_part_of_a_listing_is_left_out(tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with two_peers(tmp_path) as (a, b):
            mine = await a.store.create(chunks(b"x"))

            async def refuse(stream: FramedStream, remote: PeerId) -> None:
                await stream.receive(timeout=5)
                await stream.send(json.dumps({"ok": False, "error": "bad_request", "message": "no"}).encode(), timeout=5)

            b.host.set_stream_handler(PROTOCOL, refuse)
            assert [m.id for m in (await a.swarm.list(ListQuery())).artifacts] == [mine.id]
            assert (await a.swarm.usage()).total.objects == 1


def _insert_rows(store: ArtifactStore, count: int, filename: str, start_ms: int = 1_700_000_000_000) -> list[ArtifactMeta]:
    """``count`` ready Files-API rows in ``store``'s index, one transaction (no bytes: a
    listing reads only the index)."""
    rows = [ArtifactMeta(id=new_id(store.owner), media_type="text/plain", size_bytes=1, digest="0" * 64, state="ready",
                         kind="uploaded", created_at_ms=start_ms + i, filename=filename, purpose="user_data")
            for i in range(count)]  # fmt: skip
    db = store.index._db
    with db.conn:
        db["artifacts"].insert_all([m.to_record() for m in rows])  # type: ignore[union-attr]
    return rows


async def test_a_swarm_listing_is_the_slice_of_every_peer_s_rows_in_order(tmp_path: Path) -> None:
    """Every page (offset, limit; newest first, and oldest first after a cursor) is exactly
    that slice of all rows of both peers in the spec's order, whichever peer asks."""
    with trio.fail_after(120):
        async with two_peers(tmp_path) as (a, b):
            made = _insert_rows(a.store, 7, "a.txt", 1000) + _insert_rows(b.store, 6, "b.txt", 1003)
            newest = sorted(made, key=ArtifactMeta.sort_key, reverse=True)
            for asker in (a, b):
                for offset in range(len(made) + 1):
                    for limit in (1, 3, 5):
                        page = await asker.swarm.list(ListQuery(limit=limit, offset=offset))
                        assert page.artifacts == newest[offset : offset + limit], (offset, limit)
                        assert page.truncated == (offset + limit < len(made))
                oldest = newest[::-1]
                for cursor in range(len(made)):
                    query = ListQuery(limit=4, files_only=True, after=oldest[cursor].sort_key(), ascending=True)
                    assert (await asker.swarm.list(query)).artifacts == oldest[cursor + 1 : cursor + 5]


async def test_a_peer_with_the_longest_filenames_is_in_a_deep_listing(tmp_path: Path) -> None:
    """7 000 Files of a peer, each named with 255 emoji (the longest name the upload routes
    keep, 3 KiB of JSON): a listing 7 000 rows deep through another peer shows its rows.
    Before, that peer answered with all 7 000 whole rows (~24 MB, over the 20 MB a listing
    answer was allowed) and was left out; now it answers their keys (~61 bytes each), then
    only the rows that made the page."""
    longest = "\U0001F600" * MAX_FILENAME_CHARS
    with trio.fail_after(120):
        async with two_peers(tmp_path) as (a, b):
            rows = _insert_rows(a.store, 7000, longest)
            assert len(encode({"ok": True, "artifacts": [m.to_record() for m in rows]})) > 20_000 * 1024 + 4096
            page = await b.swarm.list(ListQuery(limit=1000, offset=6000))
            assert page.artifacts == sorted(rows, key=ArtifactMeta.sort_key, reverse=True)[6000:]
            files = await b.swarm.list(ListQuery(limit=2000, files_only=True, after=rows[2500].sort_key(), ascending=True))
            assert files.artifacts == rows[2501:4501] and files.truncated  # two answers of 1 000 rows


@pytest.mark.parametrize("keys", [True, False])
async def test_a_listing_answer_over_its_bound_is_refused_on_its_prefix(tmp_path: Path, keys: bool) -> None:
    """A key listing may be ~61 bytes a key, a row listing MAX_ROW_BYTES a row, for the
    count asked: one announced a byte larger is refused before its bytes are taken in, and
    the peer's rows are left out of the listing."""
    with trio.fail_after(60):
        async with two_peers(tmp_path) as (a, b):
            theirs = _insert_rows(a.store, 3, "a.txt")
            mine = _insert_rows(b.store, 2, "b.txt", start_ms=1)

            async def liar(stream: FramedStream, remote: PeerId) -> None:
                request = json.loads(await stream.receive(timeout=5))
                if request["keys"] is not keys:  # the other step answered honestly
                    listed = [[m.created_at_ms, m.id] for m in reversed(theirs)]
                    await stream.send(encode({"ok": True, "keys": listed, "truncated": False}), timeout=5)
                    return
                announced = list_answer_limit(request["limit"], keys) + 1
                await stream._raw.write(struct.pack(">I", announced) + b"1" * 5)  # then nothing more
                await trio.sleep_forever()

            a.host.set_stream_handler(PROTOCOL, liar)
            with pytest.raises(ArtifactUnavailable, match="exceeds the limit"):
                await (b.remote.keys if keys else b.remote.list)(a.host.peer_id, ListQuery(limit=1000), pair(a, b))
            assert (await b.swarm.list(ListQuery())).artifacts == mine[::-1]


async def test_oversized_display_fields_are_refused_at_creation(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path, Identity.generate().peer_id)
    try:
        for fields in [{"purpose": "p" * 65}, {"filename": "f" * 256}, {"media_type": "a/" + "b" * 300}]:
            with pytest.raises(BadArtifactRequest):
                await store.create(chunks(b"x"), **fields)  # type: ignore[arg-type]
    finally:
        store.close()


async def test_an_owner_serves_a_bounded_number_of_streams(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(p2p.artifacts, "MAX_READS", 1)
    monkeypatch.setattr(p2p.artifacts, "BUSY_WAIT_S", 1.0)
    with trio.fail_after(60):
        async with two_peers(tmp_path) as (a, b):
            data = os.urandom(6_000_000)
            big = await a.store.create(chunks(data))
            held, answer = await raw_read(b.host, a.host, big.id)  # a piece more than the stream window
            assert answer["ok"] is True and answer["range"] == [0, MAX_PIECE - 1]
            try:
                await held.receive(timeout=5)  # the owner is now blocked sending the rest
                stream, answer = await raw_read(b.host, a.host, big.id, 0, 10)
                await stream.reset()
                assert answer == {"ok": False, "error": "busy", "message": answer["message"]}
                with pytest.raises(ArtifactUnavailable, match="busy"):  # an honest asker waits a while, then gives up
                    await b.swarm.open(big.id)
                assert (await b.swarm.meta(big.id)).id == big.id  # small requests have their own slots
            finally:
                await held.reset()
            assert await read(b.swarm, big.id, "bytes=0-9") == data[:10]


@asynccontextmanager
async def third_peer(owner: P2PHost) -> AsyncIterator[P2PHost]:
    """One more peer connected to ``owner``, asking it directly (a hostile asker)."""
    async with open_host(Identity.generate(), listen_host="127.0.0.1") as host:
        await host.connect(owner.multiaddrs()[0] + "/p2p/" + owner.peer_id)
        yield host


async def test_one_peer_holding_slow_reads_does_not_starve_the_others(tmp_path: Path) -> None:
    """The audit's attack: a peer opens as many reads as the owner serves and takes one frame
    of each now and then. Other peers' meta and reads must still be served."""
    data = os.urandom(6_000_000)
    with trio.fail_after(60):
        async with two_peers(tmp_path) as (a, b), third_peer(a.host) as attacker:
            big = await a.store.create(chunks(data))
            held, refused = [], 0
            try:
                for _ in range(16):  # the owner's whole read pool
                    stream, answer = await raw_read(attacker, a.host, big.id)  # more than a window
                    if answer["ok"]:
                        held.append(stream)
                        assert len(await stream.receive(timeout=5)) == READ_CHUNK
                    else:
                        refused += 1
                        assert answer["error"] == "busy"
                        await stream.reset()
                assert (await b.swarm.meta(big.id)).id == big.id
                assert await read(b.swarm, big.id) == data
                assert (await b.swarm.usage()).total.objects == 1
                assert len(held) == p2p.artifacts.MAX_READS_PER_PEER and refused == 16 - len(held)
            finally:
                for stream in held:
                    await stream.reset()


async def test_an_asker_that_trickles_is_cut_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A read must average MIN_READ_RATE: one frame now and then, each within the per-frame
    timeout, no longer keeps a slot for as long as the asker likes."""
    monkeypatch.setattr(p2p.artifacts, "MIN_READ_RATE", 4 << 20)  # a piece's deadline: 1.25 s
    monkeypatch.setattr(p2p.artifacts, "READ_GRACE_S", 1.0)
    monkeypatch.setattr(p2p.artifacts, "MAX_READS_PER_PEER", 1)  # so reading again needs the slot back
    data = os.urandom(6_000_000)
    with trio.fail_after(60):
        async with two_peers(tmp_path) as (a, b):
            big = await a.store.create(chunks(data))
            assert await read(b.swarm, big.id) == data  # an asker at full speed is not cut off
            stream, answer = await raw_read(b.host, a.host, big.id)
            assert answer["ok"] is True
            received = 0
            with pytest.raises(P2PError), trio.fail_after(10):
                while await stream.receive(timeout=5):
                    received += READ_CHUNK
                    await trio.sleep(1.0)
            assert received < MAX_PIECE
            # the cut-off read gave its slot back: the same peer reads again at once
            stream, answer = await raw_read(b.host, a.host, big.id, 0, 10)
            await stream.reset()
            assert answer["ok"] is True


async def test_a_peer_cannot_list_or_describe_another_owner_s_artifacts(tmp_path: Path) -> None:
    """A listing is a k-way merge of every peer's own rows, and a peer's answer could carry
    rows for ids it does not own: another owner's artifact, under a forged filename, size
    and digest, shown beside the real one in every swarm-wide listing. A peer now speaks
    only for ids that carry its own tag, in listings and in a meta or read answer."""
    with trio.fail_after(60):
        async with two_peers(tmp_path) as (a, b):
            real = await a.store.create(chunks(b"12345"), filename="report.txt", purpose="assistants")
            forged = {**real.to_record(), "filename": "invoice.pdf", "size_bytes": 999, "digest": "0" * 64}
            theirs = await b.store.create(chunks(b"abc"))
            place_a_s = False

            async def liar(stream: FramedStream, remote: PeerId) -> None:
                request = json.loads(await stream.receive(timeout=5))
                stream.max_frame_size = 1 << 20
                if request["op"] == "list" and request["keys"]:  # places its own row (or a's too), then lies in the rows
                    placed = sorted([theirs.sort_key()] + ([real.sort_key()] if place_a_s else []), reverse=True)
                    answer = {"ok": True, "keys": [list(key) for key in placed], "truncated": False}
                elif request["op"] == "list":
                    answer = {"ok": True, "artifacts": [forged, theirs.to_record()], "truncated": False}
                else:  # asked about its own artifact, it describes another owner's
                    answer = {"ok": True, "artifact": forged, "range": None}
                await stream.send(json.dumps(answer).encode(), timeout=5)

            b.host.set_stream_handler(PROTOCOL, liar)
            rows = (await a.swarm.list(ListQuery())).artifacts
            assert [m.id for m in rows if m.id == real.id] == [real.id], "a forged row of a's own artifact"
            assert all(m.filename != "invoice.pdf" for m in rows)
            place_a_s = True
            with pytest.raises(ArtifactUnavailable, match="does not own"):  # nor place another owner's row
                await a.remote.keys(b.host.peer_id, ListQuery(), pair(a, b))
            with pytest.raises(ArtifactUnavailable):
                await a.swarm.meta(theirs.id)


async def test_slow_downloads_through_a_peer_do_not_starve_its_other_downloads(tmp_path: Path) -> None:
    """An owner gives each asking peer MAX_READS_PER_PEER read slots, and the peer relaying
    its HTTP clients' downloads shares them. One client's four slow downloads (a chunk taken,
    then nothing) held all four for as long as they stayed open, and every other download of
    that owner's artifacts through the same peer was refused busy (a 503). Now the relay
    fetches in pieces, each holding a slot only while it crosses the wire: the fifth read,
    and eight more at once, are served while the slow ones wait, and the slow ones finish."""
    data = os.urandom(6_000_000)  # more than a stream's window and several pieces
    with trio.fail_after(60):
        async with two_peers(tmp_path) as (a, b):
            big = await a.store.create(chunks(data))
            slow = []
            try:
                for _ in range(p2p.artifacts.MAX_READS_PER_PEER):
                    opened = await b.swarm.open(big.id)
                    slow.append((opened, [await opened.chunks.__anext__()]))
                assert await read(b.swarm, big.id) == data
                results: list[bytes] = []

                async def one() -> None:
                    results.append(await read(b.swarm, big.id, "bytes=1000000-3999999"))

                async with trio.open_nursery() as nursery:
                    for _ in range(8):
                        nursery.start_soon(one)
                assert results == [data[1_000_000:4_000_000]] * 8
                for opened, got in slow:
                    got += [c async for c in opened.chunks]
                    assert b"".join(got) == data
            finally:
                for opened, _ in slow:
                    await opened.chunks.aclose()
            assert b.remote.relayed_reads == 0


async def test_many_downloads_of_one_owner_through_one_peer_all_finish(tmp_path: Path) -> None:
    """A relay with more downloads of one owner's artifacts at once than the owner accepts
    streams from one peer opened a stream per download regardless, and the owner reset the
    extra streams: a 503 before the headers, or a body cut half way. The relay now holds at
    most MAX_READS_PER_PEER read streams and MAX_SMALL_PER_PEER others to each owner, and
    the rest wait their turn (fails on the tree before: "the peer closed the stream")."""
    data = os.urandom(3_000_000)
    with trio.fail_after(60):
        async with two_peers(tmp_path) as (a, b):
            big = await a.store.create(chunks(data))
            results: list[bytes] = []

            async def one() -> None:
                results.append(await read(b.swarm, big.id))

            async with trio.open_nursery() as nursery:
                for _ in range(16):
                    nursery.start_soon(one)
            assert results == [data] * 16
            assert b.remote.relayed_reads == 0
            assert (len(b.remote._read_slots), len(b.remote._small_slots)) == (0, 0)  # emptied


async def test_the_downloads_a_peer_relays_are_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each open remote read buffers up to a piece on the relaying peer, and it no longer
    needs an owner slot to stay open: the number open at once is this peer's own bound."""
    monkeypatch.setattr(p2p.artifacts, "MAX_RELAYED_READS", 2)
    data = os.urandom(3_000_000)
    with trio.fail_after(60):
        async with two_peers(tmp_path) as (a, b):
            big = await a.store.create(chunks(data))
            first, second = await b.swarm.open(big.id), await b.swarm.open(big.id)
            with pytest.raises(ArtifactUnavailable, match="relays"):
                await b.swarm.open(big.id)
            await first.chunks.aclose()
            await first.chunks.aclose()  # twice gives back one
            assert await read(b.swarm, big.id) == data  # read to the end: given back too
            assert b.remote.relayed_reads == 1
            await second.chunks.aclose()
            assert b.remote.relayed_reads == 0


async def test_a_relayed_read_never_closed_stops_counting_once_dropped(tmp_path: Path) -> None:
    """A response that was never sent (its client left before the first byte) never closes
    its read: counted for good, 256 such leaks made the peer refuse every download of
    another peer's artifacts until it restarted."""
    with trio.fail_after(60):
        async with two_peers(tmp_path) as (a, b):
            big = await a.store.create(chunks(os.urandom(3_000_000)))
            opened = await b.swarm.open(big.id)
            assert b.remote.relayed_reads == 1
            del opened
            gc.collect()
            assert b.remote.relayed_reads == 0


async def test_a_download_cut_mid_body_by_a_busy_owner_ends_short_of_its_length(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The relay sends the 200 and its Content-Length after the first piece; an owner that is
    then busy for longer than BUSY_WAIT_S cannot be turned into a status any more. The client
    must see a failure it cannot mistake for the whole object: the connection ends before
    the declared length (httpx raises), never a short body that ends like a complete one."""
    import httpx
    from artifact_api_helpers import ArtifactContext

    from api.app import create_app, serve_api
    from inclavate.local_swarm import free_port

    monkeypatch.setattr(p2p.artifacts, "BUSY_WAIT_S", 1.0)
    data = os.urandom(3 * MAX_PIECE)
    with trio.fail_after(60):
        async with two_peers(tmp_path) as (a, b):
            real = await a.store.create(chunks(data))

            async def busy_after_one_piece(stream: FramedStream, remote: PeerId) -> None:
                request = json.loads(await stream.receive(timeout=5))
                stream.max_frame_size = 1 << 20
                record = {**real.to_record(), "id": request["id"]}
                if request["op"] == "meta":
                    await stream.send(json.dumps({"ok": True, "artifact": record}).encode(), timeout=5)
                elif request["offset"] == 0:  # the first piece, honestly: the 200 goes out
                    span = [0, request["length"] - 1]
                    await stream.send(json.dumps({"ok": True, "artifact": record, "range": span}).encode(), timeout=5)
                    for i in range(0, request["length"], READ_CHUNK):
                        await stream.send(data[i : min(i + READ_CHUNK, request["length"])], timeout=5)
                    await stream.send(b"", timeout=5)
                else:
                    await stream.send(json.dumps({"ok": False, "error": "busy", "message": "busy"}).encode(), timeout=5)

            a.host.set_stream_handler(PROTOCOL, busy_after_one_piece)
            ctx = ArtifactContext(b.store)
            ctx._artifacts = b.swarm
            port = free_port()
            async with trio.open_nursery() as nursery:
                await nursery.start(serve_api, create_app(ctx), "127.0.0.1", port)  # type: ignore[arg-type]

                def download() -> tuple[int, str, int]:
                    got = 0
                    with httpx.stream("GET", f"http://127.0.0.1:{port}/v1/artifacts/{real.id}", timeout=30) as response:
                        status, length = response.status_code, response.headers["content-length"]
                        try:
                            for chunk in response.iter_raw():
                                got += len(chunk)
                        except httpx.RemoteProtocolError:
                            return status, length, -got  # the client knows it is cut
                    return status, length, got

                status, length, got = await trio.to_thread.run_sync(download)
                nursery.cancel_scope.cancel()
            assert (status, length) == (200, str(len(data)))
            assert -len(data) < got < 0  # cut, and the client was told so: never a whole-looking body
            assert b.remote.relayed_reads == 0


# -- pieces over direct links ----------------------------------------------------------


def _artifact_links(node: Node) -> dict:
    assert node.direct is not None
    return node.direct._tables[DIRECT_PROTOCOL][1]


async def test_pieces_go_over_one_direct_link_kept_for_the_next(tmp_path: Path) -> None:
    """Four pieces through the relay on one direct link, dialed once and kept; the owner
    counts it in its artifact table, none in the forward protocol's."""
    data = os.urandom(3 * MAX_PIECE + 5)
    with trio.fail_after(60):
        async with two_peers(tmp_path, direct=True) as (a, b):
            real = await a.store.create(chunks(data))
            assert await read(b.swarm, real.id) == data
            assert await read(b.swarm, real.id, "bytes=5-") == data[5:]
            assert b.remote._links is not None and b.remote._links.dialed == 1 and len(b.remote._links) == 1
            assert len(_artifact_links(a)) == 1 and a.direct is not None and not a.direct._links


async def test_an_owner_without_direct_links_is_read_over_libp2p(tmp_path: Path) -> None:
    """An older owner (no handler for the direct protocol): the dial fails once, is
    remembered for this protocol only, and every piece goes over libp2p."""
    data = os.urandom(MAX_PIECE + 5)
    with trio.fail_after(60):
        async with two_peers(tmp_path, direct=True) as (a, b):
            assert a.direct is not None and b.direct is not None
            del a.direct._handlers[DIRECT_PROTOCOL]
            real = await a.store.create(chunks(data))
            assert await read(b.swarm, real.id) == data
            assert b.remote._links is not None and b.remote._links.dialed == 0
            assert list(b.direct._failed_until) == [(a.host.peer_id, DIRECT_PROTOCOL)]


async def test_a_link_the_owner_closed_while_idle_is_asked_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The owner closes an idle link (LINK_IDLE_S) as the asker reuses it: the piece is asked
    again over libp2p, not failed."""
    monkeypatch.setattr(p2p.artifacts, "LINK_IDLE_S", 0.2)
    data = os.urandom(100)
    with trio.fail_after(60):
        async with two_peers(tmp_path, direct=True) as (a, b):
            real = await a.store.create(chunks(data))
            assert await read(b.swarm, real.id) == data
            while _artifact_links(a):
                await trio.sleep(0.05)
            assert await read(b.swarm, real.id) == data
            assert b.remote._links is not None and len(b.remote._links) == 0  # the stale link was dropped


async def test_a_stranger_without_a_ticket_reaches_no_artifact_handler(tmp_path: Path) -> None:
    """Anyone can reach the direct port: without a live ticket its connection is closed
    before the artifact handler (or any slot) sees it."""
    with trio.fail_after(30):
        async with two_peers(tmp_path, direct=True) as (a, b):
            assert a.direct is not None and a.direct.port is not None
            tcp = await trio.open_tcp_stream("127.0.0.1", a.direct.port)
            await tcp.send_all(MAGIC + os.urandom(TICKET_BYTES) + json.dumps(read_request(new_id(a.host.peer_id), 0, 1)).encode())
            with trio.move_on_after(5) as waited:
                try:
                    while await tcp.receive_some(4096):
                        pass
                except trio.BrokenResourceError:
                    pass
            assert not waited.cancelled_caught and a.direct.refused == 1 and not _artifact_links(a)
            await tcp.aclose()


STALLS = {
    "before the answer": lambda span, rec: None,
    "mid-piece": lambda span, rec: ({"ok": True, "artifact": rec, "range": span}, b"12"),
}


@pytest.mark.parametrize("stall", list(STALLS))
async def test_an_owner_stalling_on_a_direct_link_is_cut_off(tmp_path: Path, stall: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An owner that takes a read on its direct link and then sends nothing more: the asker
    gives up at the piece's deadline (a 503), drops the link, and holds nothing after."""
    monkeypatch.setattr(p2p.artifacts, "READ_GRACE_S", 1.0)
    with trio.fail_after(60):
        async with two_peers(tmp_path, direct=True) as (a, b):
            real = await a.store.create(chunks(b"12345"))

            async def staller(stream, remote: PeerId) -> None:  # type: ignore[no-untyped-def]
                request = json.loads(await stream.receive(timeout=5))
                stream.max_frame_size = 1 << 20
                sent = STALLS[stall]([request["offset"], request["offset"] + request["length"] - 1], real.to_record())
                if sent is not None:
                    await stream.send(encode(sent[0]), timeout=5)
                    await stream.send(sent[1], timeout=5)
                await trio.sleep_forever()

            assert a.direct is not None
            a.direct.set_handler(DIRECT_PROTOCOL, staller, LinkTable(4, 64))
            with pytest.raises(ArtifactUnavailable), trio.fail_after(10):
                await b.swarm.open(real.id)
            assert b.remote._links is not None and b.remote._links.dialed == 1 and len(b.remote._links) == 0
            assert b.remote.relayed_reads == 0
            assert (len(b.remote._read_slots), len(b.remote._small_slots)) == (0, 0)


async def test_an_owner_s_per_peer_read_slots_count_direct_and_libp2p_reads_together(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With one read slot per peer: a read held on a direct link makes a libp2p read busy,
    and one held over libp2p makes a direct read busy."""
    monkeypatch.setattr(p2p.artifacts, "MAX_READS_PER_PEER", 1)
    with trio.fail_after(60):
        async with two_peers(tmp_path, direct=True) as (a, b):
            real = await a.store.create(chunks(b"12345"))
            opened = a.store.open
            gate = trio.Event()

            async def stalled_open(id_: str, range_header: str | None = None):  # type: ignore[no-untyped-def]
                read = await opened(id_, range_header)

                async def held() -> AsyncIterator[bytes]:
                    try:
                        await gate.wait()  # the owner's disk stalls: the slot stays held
                        async for chunk in read.chunks:
                            yield chunk
                    finally:
                        await read.chunks.aclose()

                return type(read)(read.meta, read.range, held())

            monkeypatch.setattr(a.store, "open", stalled_open)
            assert b.direct is not None
            request = json.dumps(read_request(real.id, 0, 5)).encode()

            async def direct_answer() -> dict:
                link = await b.direct.open(a.host.peer_id, DIRECT_PROTOCOL, timeout=5)
                link.max_frame_size = MAX_RECORD_ANSWER_BYTES
                await link.send(request, timeout=5)
                answer = json.loads(await link.receive(timeout=5))
                links.append(link)
                return answer

            links: list = []
            async with trio.open_nursery() as nursery:
                held_direct = trio.Event()

                async def hold_direct() -> None:
                    await direct_answer()
                    held_direct.set()

                nursery.start_soon(hold_direct)
                await held_direct.wait()  # the header came: the direct read holds the slot
                stream, answer = await raw_read(b.host, a.host, real.id, 0, 5)
                assert answer["error"] == "busy"
                await stream.reset()
                gate.set()
            for link in links:
                await link.reset()
            while _artifact_links(a):  # the owner's table allows this peer one artifact link
                await trio.sleep(0.01)

            gate = trio.Event()
            stream = await b.host.new_stream(a.host.peer_id, PROTOCOL, timeout=5, max_frame_size=MAX_RECORD_ANSWER_BYTES)
            await stream.send(request, timeout=5)
            assert json.loads(await stream.receive(timeout=5))["ok"] is True  # held over libp2p
            assert (await direct_answer())["error"] == "busy"
            gate.set()
            await stream.reset()
            for link in links:
                await link.reset()


async def test_a_busy_answer_on_a_direct_link_keeps_the_link(tmp_path: Path) -> None:
    """``busy`` is one whole answer frame: the asker asks again on the same link (one dial),
    and the owner's link handler takes the next request."""
    data = os.urandom(100)
    with trio.fail_after(60):
        async with two_peers(tmp_path, direct=True) as (a, b):
            real = await a.store.create(chunks(data))
            assert a.direct is not None
            honest = a.direct._handlers[DIRECT_PROTOCOL]
            busy_for = [2]

            async def busy_at_first(stream, remote: PeerId) -> None:  # type: ignore[no-untyped-def]
                while busy_for[0]:
                    await stream.receive(timeout=5)
                    busy_for[0] -= 1
                    await stream.send(encode({"ok": False, "error": "busy", "message": "busy"}), timeout=5)
                await honest(stream, remote)

            a.direct.set_handler(DIRECT_PROTOCOL, busy_at_first)
            assert await read(b.swarm, real.id) == data
            assert busy_for == [0] and b.remote._links is not None and b.remote._links.dialed == 1


async def test_a_redial_while_the_owner_still_holds_the_old_links_stays_direct(tmp_path: Path) -> None:
    """A relay dials again while the owner still holds its four old links (their ends still in
    flight: here, four links the relay holds and no longer uses): the owner closes that
    relay's oldest idle link for the new one, and the pieces stay direct. Before, the owner
    refused the fifth link and the relay read every piece of that owner over libp2p (5x
    slower) for ``DirectLimits.retry_after_s`` (60 s)."""
    data = os.urandom(100)
    with trio.fail_after(60):
        async with two_peers(tmp_path, direct=True) as (a, b):
            real = await a.store.create(chunks(data))
            assert b.direct is not None and b.remote._links is not None
            old = [await b.direct.open(a.host.peer_id, DIRECT_PROTOCOL, timeout=5) for _ in range(MAX_READS_PER_PEER)]
            try:
                assert len(_artifact_links(a)) == MAX_READS_PER_PEER
                assert await read(b.swarm, real.id) == data
                assert await read(b.swarm, real.id) == data  # on the link kept from the first
                assert b.remote._links.dialed == 1 and not b.direct._failed_until
                assert len(_artifact_links(a)) == MAX_READS_PER_PEER  # its own oldest made room: never over its cap
                with pytest.raises(P2PError):
                    await old[0].receive(timeout=5)  # closed by the owner
            finally:
                for link in old:
                    await link.reset()


async def test_a_relay_s_idle_links_are_bounded_and_expire(monkeypatch: pytest.MonkeyPatch) -> None:
    """However many owners a relay reads from, it keeps at most MAX_POOLED_LINKS idle links
    (the oldest closed first), and none idle for POOL_IDLE_S."""
    from typing import cast

    from p2p.artifacts import _DirectPool

    class FakeLink:
        closed = False

        async def reset(self) -> None:
            self.closed = True

    monkeypatch.setattr(p2p.artifacts, "MAX_POOLED_LINKS", 2)
    pool = _DirectPool(cast(DirectLinks, None))
    links = [FakeLink() for _ in range(3)]
    for i, link in enumerate(links):
        await pool.give(f"owner-{i}", link)  # type: ignore[arg-type]
        await trio.sleep(0.01)
    assert len(pool) == 2 and [link.closed for link in links] == [True, False, False]
    monkeypatch.setattr(p2p.artifacts, "POOL_IDLE_S", 0.005)
    await pool.prune()
    assert len(pool) == 0 and all(link.closed for link in links) and not pool._idle


@pytest.mark.parametrize("lie", [lie for lie, (where, _) in OVERSIZED.items() if where != "meta"])
async def test_an_oversized_answer_on_a_direct_link_is_cut_off_on_its_prefix(tmp_path: Path, lie: str) -> None:
    """The same bounds on a direct link: the sealed frame's length prefix is checked against
    what the piece can need (plus the seal's tag) before its bytes are taken in."""
    from p2p.sealed import TAG_BYTES

    where, announced = OVERSIZED[lie]
    with trio.fail_after(60):
        async with two_peers(tmp_path, direct=True) as (a, b):
            real = await a.store.create(chunks(b"12345"))

            async def liar(stream, remote: PeerId) -> None:  # type: ignore[no-untyped-def]
                request = json.loads(await stream.receive(timeout=5))
                stream.max_frame_size = 1 << 20
                if where == "data":
                    span = [request["offset"], request["offset"] + request["length"] - 1]
                    await stream.send(encode({"ok": True, "artifact": real.to_record(), "range": span}), timeout=5)
                await stream._inner._raw.write(struct.pack(">I", announced + TAG_BYTES) + b"1" * 5)
                await trio.sleep_forever()

            assert a.direct is not None
            a.direct.set_handler(DIRECT_PROTOCOL, liar)
            with pytest.raises(ArtifactUnavailable, match="exceeds the limit"), trio.fail_after(5):
                await b.swarm.open(real.id)
            assert b.remote._links is not None and b.remote._links.dialed == 1 and len(b.remote._links) == 0
            assert b.remote.relayed_reads == 0


class _FakeRemotes:
    """Other peers' stores, in process: each peer's rows, its keys then its rows answered
    after ``delay`` seconds (a pair), its row answers rewritten by ``rows_lie``."""

    def __init__(self, rows: dict[str, list[ArtifactMeta]], delay: dict[str, tuple[float, float]] | None = None,
                 rows_lie: dict[str, list[ArtifactMeta]] | None = None) -> None:  # fmt: skip
        self.rows, self.delay, self.rows_lie = rows, delay or {}, rows_lie or {}

    def _page(self, peer: str, query: ListQuery) -> list[ArtifactMeta]:
        ordered = sorted(self.rows[peer], key=ArtifactMeta.sort_key, reverse=not query.ascending)
        if query.after is not None:
            ordered = [m for m in ordered if m.sort_key() != query.after and (m.sort_key() > query.after) == query.ascending]
        return ordered[: query.limit]

    async def key_answer(self, peer: str, query: ListQuery) -> KeyPage:  # the fakes' "frame": already a page
        await trio.sleep(self.delay.get(peer, (0, 0))[0])
        return KeyPage([m.sort_key() for m in self._page(peer, query)], False)

    async def decode_keys(self, peer: str, raw: KeyPage, query: ListQuery, owners: Owners) -> KeyPage:
        return raw

    async def list(self, peer: str, query: ListQuery, owners: Owners, row_bytes: int = MAX_ROW_BYTES) -> ArtifactPage:
        await trio.sleep(self.delay.get(peer, (0, 0))[1])
        return ArtifactPage(self.rows_lie.get(peer, self._page(peer, query)), False)


def _fake_rows(owner: str, count: int, start_ms: int) -> list[ArtifactMeta]:
    return [ArtifactMeta(id=new_id(owner), media_type="text/plain", size_bytes=1, digest="0" * 64, state="ready",
                         kind="uploaded", created_at_ms=start_ms + i, filename=f"{owner}.txt", purpose="user_data")
            for i in range(count)]  # fmt: skip


def _listing_answer(request: dict, rows: list[ArtifactMeta], truncated: bool) -> bytes:
    """What an owner answers a ``list`` request with ``rows``: their keys or their records."""
    if request["keys"]:
        return encode({"ok": True, "keys": [[m.created_at_ms, m.id] for m in rows], "truncated": truncated})
    return encode({"ok": True, "artifacts": [m.to_record() for m in rows], "truncated": truncated})


@pytest.mark.parametrize("slow", [(PEER_TIMEOUT_S - 0.1, PEER_TIMEOUT_S - 0.1), (PEER_TIMEOUT_S / 2 - 0.1, PEER_TIMEOUT_S / 2 - 0.1),
                                  (PEER_TIMEOUT_S - 0.1, 0), (PEER_TIMEOUT_S / 2 - 0.1, 0)])  # fmt: skip
async def test_a_peer_slow_at_both_steps_of_a_listing_holds_it_at_most_peer_timeout_s(
        tmp_path: Path, autojump_clock: trio.abc.Clock, slow: tuple[float, float]) -> None:  # fmt: skip
    """A hostile peer answers its keys, then its rows, each as late as it may (or later):
    the listing still ends PEER_TIMEOUT_S after it began, and an honest peer taking 1 s at
    each step is still shown. Before, each step had PEER_TIMEOUT_S of its own, so one such
    peer held every swarm-wide listing for twice that; one deadline for both steps instead
    let a peer answering its keys late leave the honest peers no time for their rows."""
    store = ArtifactStore(tmp_path, Identity.generate().peer_id)
    try:
        honest, hostile = _fake_rows("honest", 3, 1000), _fake_rows("slow", 2, 2000)
        remote = _FakeRemotes({"honest": honest, "slow": hostile}, delay={"slow": slow, "honest": (1.0, 1.0)})
        swarm = SwarmArtifacts(store, remote, lambda: ["honest", "slow"], lambda: ["honest", "slow"])
        began = trio.current_time()
        page = await swarm.list(ListQuery())
        assert trio.current_time() - began <= PEER_TIMEOUT_S
        assert [m for m in page.artifacts if m in honest] == honest[::-1]
    finally:
        store.close()


async def test_rows_that_disagree_with_a_peer_s_keys_are_never_shown_nor_doubled(tmp_path: Path) -> None:
    """A hostile peer places three keys, then answers its rows step with one of them twice,
    a row it never placed, and another in the wrong order: only rows it placed are shown,
    each once and where its key placed it; the honest peer's rows are all there, and the
    listing neither fails nor waits."""
    store = ArtifactStore(tmp_path, Identity.generate().peer_id)
    try:
        honest, placed = _fake_rows("honest", 3, 1000), _fake_rows("liar", 3, 1001)
        unplaced = _fake_rows("liar", 1, 5000)[0]
        lie = [placed[0], unplaced, placed[2], placed[0]]
        remote = _FakeRemotes({"honest": honest, "liar": placed}, rows_lie={"liar": lie})
        swarm = SwarmArtifacts(store, remote, lambda: ["honest", "liar"], lambda: ["honest", "liar"])
        page = await swarm.list(ListQuery())
        expected = sorted(honest + [placed[0], placed[2]], key=ArtifactMeta.sort_key, reverse=True)
        assert page.artifacts == expected
    finally:
        store.close()


async def test_keys_before_a_listing_s_cursor_leave_their_peer_out(tmp_path: Path) -> None:
    """Files are walked by cursor: a page after the last row seen. A hostile peer answers
    with keys (and rows) before the cursor: they would lead the page, its last row's key
    would walk the cursor back, and the client would be shown rows it already saw, again
    and again. A key listing that does not start after its cursor is malformed: the peer is
    left out and the page is the other rows after the cursor."""
    with trio.fail_after(60):
        async with two_peers(tmp_path) as (a, b):
            mine = _insert_rows(a.store, 4, "a.txt", start_ms=5000)
            behind = _fake_rows(b.host.peer_id, 2, 1)

            async def liar(stream: FramedStream, remote: PeerId) -> None:
                request = json.loads(await stream.receive(timeout=5))
                rows = behind if request["ascending"] else behind[::-1]  # in the order asked
                await stream.send(_listing_answer(request, rows, False), timeout=5)

            b.host.set_stream_handler(PROTOCOL, liar)
            cursor = ListQuery(limit=3, files_only=True, after=mine[1].sort_key(), ascending=True)
            with pytest.raises(ArtifactUnavailable, match="cursor"):
                await a.remote.keys(b.host.peer_id, cursor, pair(a, b))
            assert (await a.swarm.list(cursor)).artifacts == mine[2:]
            with pytest.raises(ArtifactUnavailable, match="cursor"):  # newest first: keys not below it
                await a.remote.keys(b.host.peer_id, ListQuery(limit=3, after=(0, behind[0].id)), pair(a, b))


async def test_a_peer_answering_full_row_pages_forever_is_asked_only_for_the_rows_wanted(tmp_path: Path) -> None:
    """Rows are asked for 1 000 at a time, each next ask after the last row got. A hostile
    peer answers every ask with the same full 1 000 rows (never moving past the cursor):
    the asker stops once it holds the rows it wanted (3 asks for 2 500), and a swarm-wide
    page shows each of those rows once, where its keys placed it."""
    with trio.fail_after(60):
        async with two_peers(tmp_path) as (a, b):
            same = _fake_rows(b.host.peer_id, 1000, 1)
            asked: list[dict] = []

            async def liar(stream: FramedStream, remote: PeerId) -> None:
                request = json.loads(await stream.receive(timeout=5))
                asked.append(request)
                rows = same[::-1][: request["limit"]]
                await stream.send(_listing_answer(request, rows, True), timeout=5)

            b.host.set_stream_handler(PROTOCOL, liar)
            page = await a.remote.list(b.host.peer_id, ListQuery(limit=2500), pair(a, b))
            assert len(asked) == 3 and len(page.artifacts) == 2500
            asked.clear()
            listed = await a.swarm.list(ListQuery(limit=1000))
            assert listed.artifacts == same[::-1] and [r["keys"] for r in asked] == [True, False]


async def test_a_peer_claiming_more_rows_than_it_listed_does_not_make_a_listing_truncated(tmp_path: Path) -> None:
    """``truncated`` means "walk on": a store says it only when it filled the ``limit`` asked
    and had more. A hostile peer listing two keys (or none) of a window of 20 says it has
    more: the listing is not truncated on its word (a Files client would be told
    ``has_more`` on its last page, for ever)."""
    with trio.fail_after(60):
        async with two_peers(tmp_path) as (a, b):
            mine = _insert_rows(a.store, 2, "a.txt")
            few = _fake_rows(b.host.peer_id, 2, 1)
            listed: list[list] = [[[m.created_at_ms, m.id] for m in few[::-1]], []]

            async def liar(stream: FramedStream, remote: PeerId) -> None:
                request = json.loads(await stream.receive(timeout=5))
                rows = few[::-1][: request["limit"]]
                answer = ({"ok": True, "keys": listed[0], "truncated": True} if request["keys"]
                          else {"ok": True, "artifacts": [m.to_record() for m in rows], "truncated": True})  # fmt: skip
                await stream.send(encode(answer), timeout=5)

            b.host.set_stream_handler(PROTOCOL, liar)
            for keys in ([[m.created_at_ms, m.id] for m in few[::-1]], []):
                listed[0] = keys
                page = await a.swarm.list(ListQuery(limit=20))
                assert page.artifacts == sorted(mine + few[: len(keys)], key=ArtifactMeta.sort_key, reverse=True)
                assert not page.truncated
            listed[0] = [[m.created_at_ms, m.id] for m in few[::-1]]
            assert (await a.remote.keys(b.host.peer_id, ListQuery(limit=2), pair(a, b))).truncated  # it filled the limit


class _TrackedKeys(list):
    """A key listing whose liveness is counted (weakly): the keys a listing still holds."""


class _CountingRemotes(_FakeRemotes):
    """Fake peers that count what the asking peer does with them: asks in flight at once (the
    most seen), the order keys were asked in, and the most listed keys still alive on the
    asker (at each answer's end and each rows ask: before, all were kept until the merge)."""

    def __init__(self, rows: dict[str, list[ArtifactMeta]], delay: float = 0.1, stall: frozenset[str] = frozenset()) -> None:
        super().__init__(rows)
        self.pause, self.stall = delay, stall
        self.in_flight = self.most_in_flight = self.most_keys_alive = self.keys_answered = 0
        self.row_bytes_allowed = 0  # what the rows asks allowed, all together
        self.most_listings: int | None = None  # set to 0 to count a gate's listings at once
        self.gate: ListingGate | None = None
        self.keys_asked: list[str] = []
        self.keys_asked_at: dict[str, float] = {}
        self._pages: list[weakref.ref[_TrackedKeys]] = []

    def _count_alive(self) -> None:
        self.most_keys_alive = max(self.most_keys_alive, sum(len(keys) for ref in self._pages if (keys := ref()) is not None))

    @asynccontextmanager
    async def _asked(self, peer: str) -> AsyncIterator[None]:
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await trio.sleep(1000 if peer in self.stall else self.pause)
            yield
        finally:
            self.in_flight -= 1

    async def key_answer(self, peer: str, query: ListQuery) -> KeyPage:
        self.keys_asked.append(peer)
        self.keys_asked_at[peer] = trio.current_time()
        if self.gate is not None:
            self.most_listings = max(self.most_listings or 0, self.gate.running)
        async with self._asked(peer):
            keys = _TrackedKeys(m.sort_key() for m in self._page(peer, query))
            self.keys_answered += len(keys)
            self._pages.append(weakref.ref(keys))
            self._count_alive()
            return KeyPage(keys, len(keys) == query.limit)

    async def list(self, peer: str, query: ListQuery, owners: Owners, row_bytes: int = MAX_ROW_BYTES) -> ArtifactPage:
        self.row_bytes_allowed += query.limit * row_bytes
        self._count_alive()
        async with self._asked(peer):
            return ArtifactPage(self._page(peer, query), False)

    async def usage(self, peer: str) -> Usage:
        async with self._asked(peer):
            return Usage()


@asynccontextmanager
async def _swarm_of(tmp_path: Path, remote: _CountingRemotes) -> AsyncIterator[SwarmArtifacts]:
    store = ArtifactStore(tmp_path, Identity.generate().peer_id)
    try:
        peers = sorted(remote.rows)
        yield SwarmArtifacts(store, remote, lambda: peers, lambda: peers)
    finally:
        store.close()


async def test_a_listing_among_many_peers_holds_a_bounded_number_of_keys_and_asks(
        tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:  # fmt: skip
    """200 identities each answer a full window of keys (200): the listing asks at most
    MAX_ASKS_PER_FANOUT of them at a time and holds at most that many answers' keys at
    once, and the page is still the swarm's first rows. Before, it asked all 200 at once
    and kept all 40 000 keys until the merge (with 4 096 identities and 20 000 keys each:
    gigabytes)."""
    remote = _CountingRemotes({f"p{i:03}": _fake_rows(f"p{i:03}", 200, 1000 * i) for i in range(200)})
    async with _swarm_of(tmp_path, remote) as swarm:
        page = await swarm.list(ListQuery(limit=100, offset=100))
    newest = sorted((m for rows in remote.rows.values() for m in rows), key=ArtifactMeta.sort_key, reverse=True)
    assert page.artifacts == newest[100:200] and page.truncated
    assert len(remote.keys_asked) == 200
    assert remote.most_keys_alive <= MAX_ASKS_PER_FANOUT * 200
    assert remote.most_in_flight <= MAX_ASKS_PER_FANOUT


async def test_every_listing_and_usage_of_a_peer_together_ask_a_bounded_number_of_peers(
        tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:  # fmt: skip
    """Any HTTP client may start listings: four at once and a usage total, over 100 peers,
    have at most MAX_ASKS_IN_FLIGHT asks in flight together (before: 500)."""
    remote = _CountingRemotes({f"p{i:03}": _fake_rows(f"p{i:03}", 20, 1000 * i) for i in range(100)})
    async with _swarm_of(tmp_path, remote) as swarm:
        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(swarm.list, ListQuery(limit=20))
            nursery.start_soon(swarm.usage)
    assert MAX_ASKS_PER_FANOUT < remote.most_in_flight <= MAX_ASKS_IN_FLIGHT


async def test_a_listing_among_more_peers_than_it_asks_at_once_is_the_merged_slice(
        tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:  # fmt: skip
    """40 honest peers (more than are asked at once, answering in a random order) with
    interleaved rows: every page, newest first and after a cursor oldest first, is exactly
    that slice of all their rows, ``truncated`` exactly when rows remain."""
    names = [f"p{i:02}" for i in range(40)]
    rows = {name: _fake_rows(name, 3 + i % 7, 100 + (i * 37) % 50) for i, name in enumerate(names)}
    remote = _CountingRemotes(rows, delay=0.05)
    newest = sorted((m for r in rows.values() for m in r), key=ArtifactMeta.sort_key, reverse=True)
    async with _swarm_of(tmp_path, remote) as swarm:
        for offset, limit in ((0, 1), (0, 20), (7, 13), (50, 100), (len(newest) - 3, 5), (len(newest), 5)):
            page = await swarm.list(ListQuery(limit=limit, offset=offset))
            assert page.artifacts == newest[offset : offset + limit], (offset, limit)
            assert page.truncated == (offset + limit < len(newest))
        oldest = newest[::-1]
        for cursor in (0, 17, len(oldest) - 2):
            query = ListQuery(limit=30, files_only=True, after=oldest[cursor].sort_key(), ascending=True)
            assert (await swarm.list(query)).artifacts == oldest[cursor + 1 : cursor + 31]
    assert remote.most_in_flight <= MAX_ASKS_PER_FANOUT


async def test_a_peer_with_rows_on_a_recent_page_is_asked_before_strangers(
        tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:  # fmt: skip
    """When identities are too many to ask before the deadline, which get asked decides who
    is shown: a peer that had rows on a recent page is asked first, the rest in a random
    order (not one a flood can grind ids for). Before, every peer was asked at once, in
    sorted order."""
    strangers = {f"s{i:03}": [] for i in range(100)}
    remote = _CountingRemotes({**strangers, "zz-honest": _fake_rows("zz-honest", 3, 1000)})
    async with _swarm_of(tmp_path, remote) as swarm:
        assert len((await swarm.list(ListQuery())).artifacts) == 3
        remote.keys_asked.clear()
        remote.keys_asked_at.clear()
        assert len((await swarm.list(ListQuery())).artifacts) == 3
    first = remote.keys_asked_at["zz-honest"]
    assert first == min(remote.keys_asked_at.values())
    assert sum(at == first for at in remote.keys_asked_at.values()) <= MAX_ASKS_PER_FANOUT
    assert [p for p in remote.keys_asked if p in strangers] != sorted(strangers)  # 1 chance in 100! of failing


async def test_peers_that_stall_do_not_keep_an_honest_peer_out_of_a_listing(
        tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:  # fmt: skip
    """40 identities that never answer and one honest peer: while others wait for a turn an
    ask gets ASK_PATIENCE_S, so the stalling ones cannot hold every turn until the deadline
    and the honest peer's rows are shown, within PEER_TIMEOUT_S. (It passes on the tree
    before too, which asked everyone at once: it pins that asking in turns keeps this.)"""
    stalling = {f"s{i:03}": _fake_rows(f"s{i:03}", 1, 5000) for i in range(40)}
    honest = _fake_rows("honest", 3, 1000)
    remote = _CountingRemotes({**stalling, "honest": honest}, stall=frozenset(stalling))
    async with _swarm_of(tmp_path, remote) as swarm:
        began = trio.current_time()
        page = await swarm.list(ListQuery())
        assert trio.current_time() - began <= PEER_TIMEOUT_S
    assert page.artifacts == honest[::-1] and ASK_PATIENCE_S * 2 < KEYS_SHARE_S


class _TwoOwners:
    """Two peers answering for one id: ``honest`` with the real record, ``hostile`` with a
    forged one (its own bytes under another owner's id); deletes are recorded."""

    def __init__(self, honest: str, real: ArtifactMeta) -> None:
        self.honest, self.real = honest, real
        self.asked: list[tuple[str, str]] = []

    async def meta(self, peer: str, id_: str) -> ArtifactMeta:
        self.asked.append(("meta", peer))
        if peer == self.honest:
            return self.real
        return ArtifactMeta(id=id_, media_type="application/pdf", size_bytes=999, digest="0" * 64, state="ready",
                            kind="uploaded", created_at_ms=1, filename="invoice.pdf", purpose="user_data")  # fmt: skip

    async def delete(self, peer: str, id_: str) -> None:
        self.asked.append(("delete", peer))


async def test_a_peer_ground_to_an_owners_32_bit_tag_cannot_answer_for_its_artifacts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """An identity ground to the honest owner's 32-bit tag (2^32 / N key generations) was a
    candidate owner of all its artifacts, asked first when its PeerID sorts first: its forged
    record was served for the honest id, and a delete went to it (and stopped there). Now
    the id's 60-bit tag names the honest owner alone, and only it is asked."""
    honest, hostile = "12D3KooWBhonest", "12D3KooWAhostile"
    ground(monkeypatch, honest, hostile)
    real = _fake_rows(honest, 1, 1000)[0]
    owners = _TwoOwners(honest, real)
    store = ArtifactStore(tmp_path, Identity.generate().peer_id)
    try:
        swarm = SwarmArtifacts(store, owners, lambda: [hostile, honest], lambda: [hostile, honest])  # type: ignore[arg-type]
        assert await swarm.meta(real.id) == real
        await swarm.delete(real.id)
        assert owners.asked == [("meta", honest), ("delete", honest)]
    finally:
        store.close()


async def test_a_peer_ground_to_an_owners_32_bit_tag_cannot_list_its_artifacts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """B's identity ground to A's 32-bit tag: it places A's artifact in its keys and lists a
    forged record of it (another filename, size, digest). Before, the rows carried B's
    32-bit tag, so they were taken, and the forged row shown beside the real one; now a row
    must carry B's whole 60-bit tag, and B is left out of the page."""
    with trio.fail_after(60):
        async with two_peers(tmp_path) as (a, b):
            ground(monkeypatch, a.host.peer_id, b.host.peer_id)
            real = await a.store.create(chunks(b"12345"), filename="report.txt", purpose="assistants")
            forged = {**real.to_record(), "filename": "invoice.pdf", "size_bytes": 999, "digest": "0" * 64}
            b.host.set_stream_handler(PROTOCOL, _lister(keys_of=[real], records=[forged]))
            rows = (await a.swarm.list(ListQuery())).artifacts
            assert [m.filename for m in rows] == ["report.txt"]


def _lister(keys_of: list[ArtifactMeta], records: list[dict]) -> Callable[[FramedStream, PeerId], Awaitable[None]]:
    """An owner's handler that lists the keys of ``keys_of``, then answers the rows step with
    ``records`` as given (forged, or under a malformed id)."""

    async def handler(stream: FramedStream, remote: PeerId) -> None:
        request = json.loads(await stream.receive(timeout=5))
        stream.max_frame_size = 1 << 20
        if request["op"] == "list" and request["keys"]:
            answer = {"ok": True, "keys": [list(m.sort_key()) for m in keys_of], "truncated": False}
        else:
            answer = {"ok": True, "artifacts": records, "truncated": False}
        await stream.send(json.dumps(answer).encode(), timeout=5)

    return handler


@pytest.mark.parametrize("bad_id", ["z" * 36, "NOT-A-UUID" + "0" * 26, "upper"])
async def test_a_listing_row_under_no_uuid_leaves_its_peer_out(tmp_path: Path, bad_id: str) -> None:
    """A row's id was taken as any 36 characters, its owner tag read as hex: one that was
    not hex raised a ValueError out of the listing (a 500 for every swarm-wide listing
    while that peer answered). Now the peer is left out and the page is the others' rows."""
    with trio.fail_after(60):
        async with two_peers(tmp_path) as (a, b):
            mine = await a.store.create(chunks(b"12345"), filename="report.txt")
            theirs = await b.store.create(chunks(b"abc"))

            listed = theirs.id.upper() if bad_id == "upper" else bad_id
            b.host.set_stream_handler(PROTOCOL, _lister(keys_of=[theirs], records=[{**theirs.to_record(), "id": listed}]))
            assert [m.id for m in (await a.swarm.list(ListQuery())).artifacts] == [mine.id]


async def test_a_peer_runs_a_bounded_number_of_listings_and_refuses_the_rest_in_bounded_time(
        tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:  # fmt: skip
    """A client starting listings in parallel (over peers that stall, so each listing holds
    its turn to its deadline): at most MAX_LISTINGS_AT_ONCE run, MAX_LISTINGS_WAITING wait
    (here 1 s) and are then refused, any more are refused at once, all with ListingsBusy
    (503, Retry-After). Before, every listing ran at once, each decoding for its whole
    keys step. Job listings share the turns (a sibling's gate is the same)."""
    stalling = {f"s{i:03}": _fake_rows(f"s{i:03}", 1, 5000) for i in range(40)}
    remote = _CountingRemotes(stalling, stall=frozenset(stalling))
    outcomes: list[str] = []
    async with _swarm_of(tmp_path, remote) as swarm:
        swarm.fan_out.gate = remote.gate = ListingGate(wait_s=1.0)
        assert swarm.fan_out.sibling("job listing").gate is swarm.fan_out.gate

        async def one() -> None:
            began = trio.current_time()
            try:
                await swarm.list(ListQuery())
                outcomes.append("listed")
            except ListingsBusy:
                outcomes.append("busy now" if trio.current_time() == began else "busy after a wait")

        async with trio.open_nursery() as nursery:
            for _ in range(MAX_LISTINGS_AT_ONCE + MAX_LISTINGS_WAITING + 5):
                nursery.start_soon(one)
        assert swarm.fan_out.gate.refused == MAX_LISTINGS_WAITING + 5 and swarm.fan_out.gate.running == 0
    assert outcomes.count("listed") == MAX_LISTINGS_AT_ONCE and remote.most_listings == MAX_LISTINGS_AT_ONCE
    assert outcomes.count("busy now") == 5 and outcomes.count("busy after a wait") == MAX_LISTINGS_WAITING


def test_a_busy_peer_s_listing_refusal_is_a_503_with_retry_after() -> None:
    from api.errors import error_headers, error_response_parts

    exc = ListingsBusy("this peer is busy listing")
    assert error_response_parts(exc) == (503, {"error": "this peer is busy listing"})
    assert error_headers(exc) == {"Retry-After": str(inclavate.fan_out.LISTING_RETRY_AFTER_S)}


async def test_a_listing_takes_in_a_bounded_number_of_keys_however_many_peers_answer(
        tmp_path: Path, autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """100 identities each answer a full window of keys (200), fast: the listing takes in at
    most its budget (16 full answers here, the floor set to 0) and leaves the rest out,
    counted; before, it decoded all 20 000 keys (at 200 x 5 000: ~2.6 s of event loop).
    Peers that answer few keys give the rest back: 100 honest peers of 5 rows are all shown."""
    monkeypatch.setattr(inclavate.fan_out, "MIN_LISTING_BUDGET", 0)
    remote = _CountingRemotes({f"p{i:03}": _fake_rows(f"p{i:03}", 200, 1000 * i) for i in range(100)}, delay=0.001)
    async with _swarm_of(tmp_path, remote) as swarm:
        page = await swarm.list(ListQuery(limit=100, offset=100))
        assert len(page.artifacts) == 100
        assert remote.keys_answered <= listing_budget(200) == MAX_ASKS_PER_FANOUT * 200
        assert swarm.fan_out.left_out[LeftOut.BUDGET] == 100 - len(remote.keys_asked) > 0
    few = {f"p{i:03}": _fake_rows(f"p{i:03}", 5, 1000 * i) for i in range(100)}
    remote = _CountingRemotes(few, delay=0.001)
    newest = sorted((m for rows in few.values() for m in rows), key=ArtifactMeta.sort_key, reverse=True)
    async with _swarm_of(tmp_path / "few", remote) as swarm:
        assert (await swarm.list(ListQuery(limit=100, offset=100))).artifacts == newest[100:200]
        assert len(remote.keys_asked) == 100 and swarm.fan_out.left_out.total() == 0


@pytest.mark.parametrize("limit", [5000, 10_000])
async def test_a_listing_s_rows_step_allows_a_bounded_number_of_bytes(
        tmp_path: Path, autojump_clock: trio.abc.Clock, limit: int) -> None:  # fmt: skip
    """The rows asks of one listing, all peers together, allow at most ROW_BYTES_PER_LISTING
    (32 MiB) or, for a page so long that its share is below the longest honest row, that
    row per row on the page (10 000 rows: ~67 MB). Before, each row was allowed
    MAX_ROW_BYTES: 103 MB for 5 000 rows, 206 MB for a Files page of 10 000 (1 000 rows:
    20 MB, then and now)."""
    rows = {f"p{i}": _fake_rows(f"p{i}", limit // 10, 1000 * i) for i in range(10)}
    remote = _CountingRemotes(rows, delay=0.001)
    async with _swarm_of(tmp_path, remote) as swarm:
        page = await swarm.list(ListQuery(limit=limit, files_only=True))
    assert len(page.artifacts) == limit
    assert remote.row_bytes_allowed <= max(ROW_BYTES_PER_LISTING, limit * HONEST_ROW_BYTES) < limit * MAX_ROW_BYTES


def _store_failed_rows(store: ArtifactStore, count: int, error: str) -> list[ArtifactMeta]:
    """``count`` failed rows whose error is ``error`` as it is, written past the store's
    own cleaning (what a hostile or old store may hold)."""
    rows = [ArtifactMeta(id=new_id(store.owner), media_type="text/plain", size_bytes=0, digest=None, state="failed",
                         kind="uploaded", created_at_ms=1_700_000_000_000 + i, filename="f.txt", purpose="user_data",
                         error=error) for i in range(count)]  # fmt: skip
    db = store.index._db
    with db.conn:
        db["artifacts"].insert_all([m.to_record() for m in rows])  # type: ignore[union-attr]
    return rows


async def test_a_peer_whose_rows_exceed_the_listing_s_share_is_left_out(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Rows the store never writes (an error of 1 000 emoji: 12 KiB each, within
    MAX_ROW_BYTES) are more than a listing's share of its bytes (set to the longest honest
    row here): that peer's answer is refused on its prefix and the peer left out, as a
    malformed one. Before, any answer up to MAX_ROW_BYTES a row was taken. The store's
    own failed rows, with the longest error it keeps and 255-emoji filenames, fit."""
    monkeypatch.setattr(inclavate.artifact_swarm, "ROW_BYTES_PER_LISTING", 0)
    with trio.fail_after(60):
        async with two_peers(tmp_path) as (a, b):
            mine = _insert_rows(b.store, 2, "b.txt", start_ms=1)
            _store_failed_rows(a.store, 100, "\U0001F600" * 1000)
            assert (await b.swarm.list(ListQuery(limit=200))).artifacts == mine[::-1]
        async with two_peers(tmp_path / "honest") as (a, b):
            worst = error_text("\U0001F600\x00\"" * 1000)
            assert len(json.dumps(worst)) <= 2 * len(worst) + 2 <= 2002
            failed = _store_failed_rows(a.store, 100, worst)
            longest = _insert_rows(a.store, 100, "\U0001F600" * 255, start_ms=1_800_000_000_000)
            page = await b.swarm.list(ListQuery(limit=200))
            assert page.artifacts == (failed + longest)[::-1]
            assert max(len(encode(m.to_record())) for m in page.artifacts) <= HONEST_ROW_BYTES


async def test_the_store_keeps_a_failed_artifact_s_error_as_printable_ascii(tmp_path: Path) -> None:
    """Whatever an exception's message holds, the error kept is at most MAX_ERROR_CHARS of
    printable ASCII (2 JSON bytes a character at most), so honest rows stay within
    HONEST_ROW_BYTES; before, 1 000 emoji were kept as they were (12 KiB of JSON)."""
    store = ArtifactStore(tmp_path, Identity.generate().peer_id)
    try:
        pending = ArtifactMeta(id=new_id(store.owner), media_type="text/plain", size_bytes=0, digest=None,
                               state="pending", kind="uploaded", created_at_ms=1, filename="f.txt")  # fmt: skip
        db = store.index._db
        with db.conn:
            db["artifacts"].insert(pending.to_record())  # type: ignore[union-attr]
        store.fail(pending.id, "OSError: " + "\U0001F600\n" * 1000)  # what ArtifactWriter.abort passes
        error = store.meta(pending.id).error
        assert error is not None and len(error) == MAX_ERROR_CHARS and error.isascii() and error.isprintable()
        assert error.startswith("OSError: \\U0001f600 ")
    finally:
        store.close()


WIDE = 20_000
"""Keys in the widest answer a swarm-wide listing asks for (``SWARM_LIST_WINDOW``)."""


def _wide_keys(owner: str) -> list[list]:
    """``WIDE`` keys of ids ``owner`` minted, newest first, as its store lists them."""
    return [[1_700_000_000_000 + WIDE - i, new_id(owner)] for i in range(WIDE)]


def _legacy_id(owner: str) -> str:
    """An id carrying only the first 32 bits of ``owner``'s tag (minted before the widening)."""
    prefix = Owners([owner]).prefix(owner)
    assert prefix is not None
    return f"{prefix[:8]}-0000-4000-8000-{os.urandom(6).hex()}"


def _lie(keys: list[list], lie: str) -> list[list]:
    """``keys`` with one lie told near their end (past every decode step but the last)."""
    at = WIDE - 3
    ms, id_ = keys[at]
    swaps = {"ms_bool": [True, id_], "ms_negative": [-1, id_], "ms_past_int64": [2**63, id_], "ms_float": [float(ms), id_],
             "ms_text": [str(ms), id_], "id_not_hex": [ms, "z" * 36], "id_long": [ms, id_ + "0"], "id_number": [ms, 7],
             "two_ids_in_one": [ms, f"{id_}\n{new_id('hostile')}"],
             "id_other_owner": [ms, new_id("honest")], "three_fields": [ms, id_, 0], "not_a_list": {"ms": ms},
             "repeated": keys[at - 1], "out_of_order": [ms + 10, id_]}  # fmt: skip
    if lie == "too_many":
        return keys + [[1, new_id("hostile")]]
    if lie == "out_of_order_early_then_malformed":  # keys are checked before their order, as ever
        keys[1], keys[at] = [keys[1][0] + 10, keys[1][1]], [True, id_]
        return keys
    keys[at] = swaps[lie]
    return keys


@pytest.mark.parametrize("lie, error", [
    ("ms_bool", "malformed key:"), ("ms_negative", "malformed key:"), ("ms_past_int64", "malformed key:"),
    ("ms_float", "malformed key:"), ("ms_text", "malformed key:"), ("id_not_hex", "malformed key:"),
    ("id_long", "malformed key:"), ("id_number", "malformed key:"), ("two_ids_in_one", "malformed key:"), ("three_fields", "malformed key:"),
    ("not_a_list", "malformed key:"), ("id_other_owner", "does not own"), ("repeated", "out of order"),
    ("out_of_order", "out of order"), ("too_many", "malformed key listing"),
    ("out_of_order_early_then_malformed", "malformed key:"),
])  # fmt: skip
async def test_a_huge_hostile_key_answer_is_refused_as_before(lie: str, error: str) -> None:
    """A hostile peer answers a listing with 20,000 keys, one of them a lie near the end:
    decoded in steps, with a fast path for well-formed keys, the answer is refused with the
    same error as when it was decoded key by key in one go, parsed from the wire
    (``decode_key_answer``) as in one call (``decode_keys``)."""
    owners, query = Owners(["hostile", "honest"]), ListQuery(limit=WIDE)
    answer = {"ok": True, "keys": _lie(_wide_keys("hostile"), lie), "truncated": True}
    with pytest.raises(ArtifactUnavailable, match=f"peer hostile .*{error}"):
        decode_keys(answer, "hostile", query, owners)
    with pytest.raises(ArtifactUnavailable, match=f"peer hostile .*{error}"):
        await p2p.artifacts.decode_key_answer(encode(answer), "hostile", query, owners)


async def test_keys_before_the_cursor_in_a_huge_answer_are_refused_as_before() -> None:
    owners = Owners(["hostile"])
    keys = _wide_keys("hostile")
    answer = encode({"ok": True, "keys": keys, "truncated": True})
    query = ListQuery(limit=WIDE, after=(keys[5][0], keys[5][1]))
    with pytest.raises(ArtifactUnavailable, match="not after the listing's cursor"):
        await p2p.artifacts.decode_key_answer(answer, "hostile", query, owners)


def test_a_huge_answer_with_ids_in_capitals_and_legacy_ids_is_taken_as_before() -> None:
    """What a key may be besides the fast path's canonical ids of the peer's own tag: an id
    in capitals (normalised) and a legacy id of the peer's 32-bit tag, taken as ever."""
    keys = _wide_keys("owner")
    keys[7][1] = keys[7][1].upper()
    keys[WIDE - 2][1] = _legacy_id("owner")
    page = decode_keys({"ok": True, "keys": keys, "truncated": True}, "owner", ListQuery(limit=WIDE), Owners(["owner"]))
    assert page.keys == [(ms, id_.lower()) for ms, id_ in keys] and page.truncated


class _CountingOwners(Owners):
    """Owners that count the questions a decode asks them: how far it has got."""

    asked = 0

    def prefix(self, peer: str) -> str | None:
        self.asked += 1
        return super().prefix(peer)

    def carries_owner(self, id_: str, peer: str) -> bool:
        self.asked += 1
        return super().carries_owner(id_, peer)


async def test_a_huge_key_answer_is_decoded_while_other_tasks_run(tmp_path: Path) -> None:
    """A peer answers a listing with 20,000 keys (~1.2 MB): the asker decodes them in steps
    and other tasks (a chat stream's) run between the steps, where the whole answer was
    decoded in one go (~35 ms of event loop, and 16 answers arriving together held it for
    their sum). Ordering, not timing: a task that runs at every chance sees the decode
    part-way (it asked the owners some of its questions, not all)."""
    with trio.fail_after(60):
        async with two_peers(tmp_path) as (a, b):
            keys = _wide_keys(b.host.peer_id)

            async def owner(stream: FramedStream, remote: PeerId) -> None:
                await stream.receive(timeout=5)
                stream.max_frame_size = 2 << 20
                await stream.send(encode({"ok": True, "keys": keys, "truncated": True}), timeout=5)

            b.host.set_stream_handler(PROTOCOL, owner)
            owners = _CountingOwners([a.host.peer_id, b.host.peer_id])
            seen: list[int] = []

            async def other_task() -> None:
                while True:
                    seen.append(owners.asked)
                    await trio.lowlevel.checkpoint()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(other_task)
                page = await a.remote.keys(b.host.peer_id, ListQuery(limit=WIDE), owners)
                nursery.cancel_scope.cancel()
            assert page.keys == [tuple(k) for k in keys]
            assert any(0 < asked < owners.asked for asked in seen), "the other task never ran while the keys were decoded"


async def test_answers_waiting_for_the_decode_turn_are_not_cut_by_the_asks_patience(
        autojump_clock: trio.abc.Clock) -> None:  # fmt: skip
    """Twenty peers answer at once and each answer takes 0.2 s to decode, in the one decode
    turn: the answers queue for the turn, the last ones for longer than ASK_PATIENCE_S.
    Patience is for peers that stall; fetching the answer is the ask's first phase, bounded
    by it, and decoding the second, bounded by the fan-out's deadline only, so every answer
    is taken. With the decode under the patience, those queued past ASK_PATIENCE_S were left
    out (a busy peer dropped honest answers it had already received)."""
    taken: list[str] = []
    fan_out = inclavate.fan_out.FanOut("test listing")

    async def ask(peer: str) -> bytes:
        return peer.encode()  # the peer answers at once

    async def decode(peer: str, raw: bytes) -> str:
        await trio.sleep(0.2)  # decoding, in the turn
        return raw.decode()

    peers = [f"p{i:02}" for i in range(MAX_ASKS_PER_FANOUT + 4)]  # some wait for a turn: the first asks are patient
    await fan_out.ask(peers, ask, lambda peer, answer: taken.append(answer), trio.current_time() + 60, decode=decode)
    assert 0.2 * MAX_ASKS_PER_FANOUT > ASK_PATIENCE_S
    assert sorted(taken) == peers and not fan_out.left_out.snapshot()
