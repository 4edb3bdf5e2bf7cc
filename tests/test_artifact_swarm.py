"""Artifacts across peers, in process: two libp2p hosts, each with its own store, serving
``/inclavate/artifacts/1``; every operation through the peer that does not hold the bytes,
and what a hostile asker or a hostile owner gets."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio

from inclavate.artifact_swarm import SwarmArtifacts
from inclavate.artifact_types import (
    ArtifactConfig,
    ArtifactNotFound,
    ArtifactNotReady,
    ArtifactUnavailable,
    BadArtifactRequest,
    ListQuery,
)
from inclavate.artifacts import ArtifactStore
from inclavate.byte_ranges import RangeMalformed, RangeNotSatisfiable
from inclavate.owner_ids import MalformedId, new_id
from inclavate.types import PeerId
import p2p.artifacts
from p2p.artifacts import PROTOCOL, RemoteArtifacts, serve_artifacts
from p2p.errors import P2PError
from p2p.framing import FramedStream
from p2p.host import P2PHost, open_host
from p2p.identity import Identity


@dataclass
class Node:
    host: P2PHost
    store: ArtifactStore
    swarm: SwarmArtifacts


async def chunks(data: bytes) -> AsyncIterator[bytes]:
    for i in range(0, len(data), 100_000):
        yield data[i : i + 100_000]


@asynccontextmanager
async def two_peers(tmp_path: Path, config: ArtifactConfig | None = None) -> AsyncIterator[tuple[Node, Node]]:
    async with AsyncExitStack() as stack:
        hosts = [await stack.enter_async_context(open_host(Identity.generate(), listen_host="127.0.0.1")) for _ in range(2)]
        peers = [h.peer_id for h in hosts]
        nodes = []
        for i, host in enumerate(hosts):
            store = ArtifactStore(tmp_path / f"peer{i}", host.peer_id, config)
            stack.callback(store.close)
            serve_artifacts(host, store)
            nodes.append(Node(host, store, SwarmArtifacts(store, RemoteArtifacts(host), lambda: peers, lambda: peers)))
        await hosts[0].connect(hosts[1].multiaddrs()[0])
        yield nodes[0], nodes[1]


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


async def test_hostile_requests_are_refused_and_contained(tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with two_peers(tmp_path) as (a, b):
            meta = await a.store.create(chunks(b"precious"))
            refusals = [
                b"not json",
                b"[]",
                json.dumps({"op": "format_disk"}).encode(),
                json.dumps({"op": "read", "id": "../../index.db"}).encode(),
                json.dumps({"op": "read", "id": meta.id, "range": "x" * 300}).encode(),
                json.dumps({"op": "list", "limit": 10**9}).encode(),
                json.dumps({"op": "list", "limit": True}).encode(),
                json.dumps({"op": "list", "limit": 5, "after": [-1, meta.id]}).encode(),
                json.dumps({"op": "list", "limit": 5, "kind": {"$ne": 1}}).encode(),
                json.dumps({"op": "delete", "id": 12}).encode(),
            ]
            for payload in refusals:
                answer = await raw_request(b.host, a.host, payload)
                assert answer is not None and answer["ok"] is False, payload
                assert answer["error"] in ("bad_request", "malformed_id", "malformed_range"), answer
            # a request frame over 4 KiB: the owner resets the stream, nothing else happens
            assert await raw_request(b.host, a.host, b"{" + b" " * 10_000 + b"}") is None
            assert await read(b.swarm, meta.id) == b"precious"
            assert a.store.meta(meta.id).ready


async def test_a_lying_owner_is_caught(tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with two_peers(tmp_path) as (a, b):
            real = await a.store.create(chunks(b"12345"))

            async def liar(stream: FramedStream, remote: PeerId) -> None:
                request = json.loads(await stream.receive(timeout=5))
                stream.max_frame_size = 1 << 20
                record = {**real.to_record(), "id": request["id"]}
                await stream.send(json.dumps({"ok": True, "artifact": record, "range": None}).encode(), timeout=5)
                await stream.send(b"123456789", timeout=5)  # more than the 5 bytes announced
                await stream.send(b"", timeout=5)

            a.host.set_stream_handler(PROTOCOL, liar)
            opened = await b.swarm.open(real.id)
            with pytest.raises(ArtifactUnavailable):
                async for _ in opened.chunks:
                    pass


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
    with trio.fail_after(60):
        async with two_peers(tmp_path) as (a, b):
            data = os.urandom(6_000_000)  # more than the stream window
            big = await a.store.create(chunks(data))
            held = await b.swarm.open(big.id)
            await held.chunks.__anext__()  # the owner is now blocked sending the rest
            with pytest.raises(ArtifactUnavailable, match="busy"):
                await b.swarm.open(big.id)
            assert (await b.swarm.meta(big.id)).id == big.id  # small requests have their own slots
            await held.chunks.aclose()
            with trio.fail_after(10):
                while True:
                    try:
                        assert await read(b.swarm, big.id, "bytes=0-9") == data[:10]
                        break
                    except ArtifactUnavailable:
                        await trio.sleep(0.05)


@asynccontextmanager
async def third_peer(owner: P2PHost) -> AsyncIterator[RemoteArtifacts]:
    """One more peer connected to ``owner``, asking it directly (a hostile asker)."""
    async with open_host(Identity.generate(), listen_host="127.0.0.1") as host:
        await host.connect(owner.multiaddrs()[0] + "/p2p/" + owner.peer_id)
        yield RemoteArtifacts(host)


async def test_one_peer_holding_slow_reads_does_not_starve_the_others(tmp_path: Path) -> None:
    """The audit's attack: a peer opens as many reads as the owner serves and takes one frame
    of each now and then. Other peers' meta and reads must still be served."""
    data = os.urandom(6_000_000)  # more than a stream's window: the owner blocks on each read
    with trio.fail_after(60):
        async with two_peers(tmp_path) as (a, b), third_peer(a.host) as attacker:
            big = await a.store.create(chunks(data))
            held, refused = [], 0
            try:
                for _ in range(16):  # the owner's whole read pool before the fix
                    try:
                        opened = await attacker.open(a.host.peer_id, big.id, None)
                    except ArtifactUnavailable:
                        refused += 1
                        continue
                    held.append(opened)
                    await opened.chunks.__anext__()
                assert (await b.swarm.meta(big.id)).id == big.id
                assert await read(b.swarm, big.id) == data
                assert (await b.swarm.usage()).total.objects == 1
                assert len(held) <= p2p.artifacts.MAX_READS_PER_PEER and refused == 16 - len(held)
            finally:
                for opened in held:
                    await opened.chunks.aclose()


async def test_a_reader_that_trickles_is_cut_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A read must average MIN_READ_RATE: one frame now and then, each within the per-frame
    timeout, no longer keeps a slot for as long as the reader likes."""
    monkeypatch.setattr(p2p.artifacts, "MIN_READ_RATE", 1 << 20)  # 6 MB: a deadline of ~7 s
    monkeypatch.setattr(p2p.artifacts, "READ_GRACE_S", 1.0)
    monkeypatch.setattr(p2p.artifacts, "MAX_READS_PER_PEER", 1)  # so reading again needs the slot back
    data = os.urandom(6_000_000)
    with trio.fail_after(60):
        async with two_peers(tmp_path) as (a, b):
            big = await a.store.create(chunks(data))
            assert await read(b.swarm, big.id) == data  # a reader at full speed is not cut off
            slow = await b.swarm.open(big.id)
            received = 0
            try:
                with pytest.raises(ArtifactUnavailable):
                    with trio.fail_after(30):  # trickling at ~340 KB/s would take ~18 s
                        async for chunk in slow.chunks:
                            received += len(chunk)
                            await trio.sleep(0.75)
                assert received < len(data)
            finally:
                await slow.chunks.aclose()
            # the cut-off read gave its slot back: the same peer reads again
            assert await read(b.swarm, big.id) == data


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

            async def liar(stream: FramedStream, remote: PeerId) -> None:
                request = json.loads(await stream.receive(timeout=5))
                stream.max_frame_size = 1 << 20
                if request["op"] == "list":
                    answer = {"ok": True, "artifacts": [forged, theirs.to_record()], "truncated": False}
                else:  # asked about its own artifact, it describes another owner's
                    answer = {"ok": True, "artifact": forged, "range": None}
                await stream.send(json.dumps(answer).encode(), timeout=5)

            b.host.set_stream_handler(PROTOCOL, liar)
            rows = (await a.swarm.list(ListQuery())).artifacts
            assert [m.id for m in rows if m.id == real.id] == [real.id], "a forged row of a's own artifact"
            assert all(m.filename != "invoice.pdf" for m in rows)
            with pytest.raises(ArtifactUnavailable):
                await a.swarm.meta(theirs.id)
