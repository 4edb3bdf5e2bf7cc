"""``/inclavate/artifacts/2``: reach the artifact store of the peer that owns an id.

Any peer serves the artifact API; the bytes stay on the peer that created them (the id's
owner tag says which, :mod:`inclavate.owner_ids`), and the peer that got the request asks
the owner over this protocol. The messages are in :mod:`p2p.artifact_wire`.

The owner serves at most :data:`MAX_READS` reads and :data:`MAX_SMALL` other requests at
once, and at most :data:`MAX_READS_PER_PEER` / :data:`MAX_SMALL_PER_PEER` of them for any one
remote peer (more are refused as ``busy``): one peer cannot hold the owner's capacity, and
long reads cannot starve the short requests. A read is one piece of at most
:data:`p2p.artifact_wire.MAX_PIECE` bytes, and must finish within :func:`read_deadline` (its
length at :data:`MIN_READ_RATE`, plus :data:`READ_GRACE_S`), so an asker that trickles is
cut off rather than holding its slot as long as it likes. An owner that fails (or cuts a
read off) mid-piece resets the stream, so an asker never takes a short piece for a whole one.

The asker reads an object piece by piece (:class:`RemotePieces`): it takes a whole piece
off the wire as fast as the owner sends it, then hands it to its reader (the HTTP client)
from memory, and asks for the next piece only when the reader wants more. A slow client
thus holds no owner slot while it is not reading. Reads that held a stream for the whole
object let one client's four slow downloads through a peer take all of that peer's slots,
and every other download of that owner's artifacts through it was a 503. A ``busy`` answer
now means slots held for moments, so the asker waits (at most :data:`BUSY_WAIT_S`) and asks
again. Any swarm peer may ask: the spec's ownership is a single local principal, the same
one any HTTP client of any peer already is.

Pieces go over a sealed direct TCP link (:mod:`p2p.direct`, protocol :data:`DIRECT_PROTOCOL`)
where one can be made, else over libp2p: py-libp2p's Noise and yamux cost ~8 ms of CPU per
MiB on each side, which bounded a relayed download to a fraction of a direct one. A link
carries one request at a time, the same messages as a libp2p stream, and the asker keeps it
for the owner's next piece (:class:`_DirectPool`); the owner answers each request with the
same slots, per peer and in all, as one over libp2p. The owner's links of this protocol have
a table of their own (:data:`MAX_READS_PER_PEER` per peer, :data:`MAX_DIRECT_LINKS` in all), so they can
never refuse or push out a forward link.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any, Protocol

import trio

from inclavate.artifact_types import (
    ArtifactError,
    ArtifactMeta,
    ArtifactPage,
    ArtifactUnavailable,
    KeyPage,
    ListQuery,
    OwnerBusy,
    Usage,
)
from inclavate.artifacts import READ_CHUNK, ArtifactRead
from inclavate.byte_ranges import RangeMalformed, RangeNotSatisfiable
from inclavate.fan_out import in_steps
from inclavate.owner_ids import MalformedId, Owners
from inclavate.types import PeerId
from p2p.artifact_wire import (
    MAX_ANSWER_BYTES,
    MAX_LIST_ROWS,
    MAX_PIECE,
    MAX_RECORD_ANSWER_BYTES,
    MAX_REQUEST_BYTES,
    MAX_ROW_BYTES,
    PROTOCOL,
    answer_limit,
    decode_answer,
    decode_keys_in_steps,
    decode_meta,
    decode_page,
    decode_piece,
    decode_request,
    decode_usage,
    encode,
    list_answer_limit,
    list_request,
    piece_header,
    read_request,
    refusal,
)
from p2p.direct import DirectLinks, LinkTable
from p2p.errors import P2PError, ProtocolError, StreamClosed, StreamTimeout
from p2p.framing import FramedStream
from p2p.host import P2PHost
from p2p.sealed import SealedStream
from p2p.ticks import sleep_to_tick

log = logging.getLogger(__name__)

__all__ = [
    "MAX_READS",
    "MAX_READS_PER_PEER",
    "MAX_SMALL",
    "MAX_SMALL_PER_PEER",
    "MAX_RELAYED_READS",
    "BUSY_WAIT_S",
    "DIRECT_PROTOCOL",
    "MIN_READ_RATE",
    "PROTOCOL",
    "READ_GRACE_S",
    "ReadTooSlow",
    "RemoteArtifacts",
    "RemotePieces",
    "read_deadline",
    "serve_artifacts",
]

# The slot counts are read when serve_artifacts is called, the rate at each read (tests
# shorten them).
MAX_READS = 16
"""Read streams served at once, all remote peers together."""
MAX_READS_PER_PEER = 4
"""Read streams served at once to one remote peer: its HTTP clients share them (a page of
images downloaded through one peer), so fewer turns honest downloads away; more, and a few
identities hold the whole pool."""
MAX_SMALL = 16
"""``meta``/``list``/``usage``/``delete`` streams at once: a pool of their own, so reads
holding every read slot still leave the owner able to answer them."""
MAX_SMALL_PER_PEER = 4
MIN_READ_RATE = 128 * 1024
"""Bytes per second a read must average (1 Mbit/s); slower, it is cut off at its deadline."""
READ_GRACE_S = 30.0
"""Added to every read's deadline: the first frames, a slow start, a small object."""
BUSY_WAIT_S = 30.0
"""How long an asker keeps asking an owner that answers ``busy`` for one piece (a slot is
held for a piece's transfer, at most its deadline) before it gives up with a 503."""
MAX_RELAYED_READS = 256
"""Reads of other peers' artifacts open on this peer at once: each buffers up to one piece
(1 MiB), so its HTTP clients cannot make it hold more than 256 MiB; one more is a 503."""
DIRECT_PROTOCOL = PROTOCOL + "+direct"
"""The same requests and answers on a direct link, one request after another."""
MAX_DIRECT_LINKS = 64
"""The owner's live direct links of this protocol, all askers together (a full table closes
the oldest link of the asker holding the most, as :class:`p2p.direct.DirectLinks` does)."""
LINK_IDLE_S = 10.0
"""The owner closes a direct link on which no request came for this long."""
POOL_IDLE_S = 5.0
"""The asker reuses a link idle for less than this (well inside the owner's
:data:`LINK_IDLE_S`), and closes it otherwise."""
MAX_POOLED_LINKS = 64
"""Idle direct links an asker keeps, all owners together; one more closes the oldest."""
_DIRECT_DIAL_S = 2.0
_BUSY_BACKOFF_S = (0.02, 0.5)
"""The first and the longest pause between two asks of a busy owner."""
_REQUEST_TIMEOUT = 10.0
_ANSWER_TIMEOUT = 30.0
_DATA_TIMEOUT = 30.0
_REFUSED = (ArtifactError, MalformedId, RangeMalformed, RangeNotSatisfiable)
"""What the owner answers as a typed refusal rather than resetting the stream."""


class LocalArtifacts(Protocol):
    """What the owner side needs: :class:`inclavate.artifacts.ArtifactStore`."""

    def meta(self, id_: str) -> ArtifactMeta: ...
    async def open(self, id_: str, range_header: str | None = None) -> ArtifactRead: ...
    async def delete(self, id_: str) -> ArtifactMeta: ...
    def list(self, query: ListQuery) -> ArtifactPage: ...
    def usage(self) -> Usage: ...


class ReadTooSlow(StreamTimeout):
    """A remote read missed its overall deadline (:func:`read_deadline`): the asker took
    the bytes slower than :data:`MIN_READ_RATE`. The owner resets the stream."""


def read_deadline(length: int) -> float:
    """Seconds a read of ``length`` bytes may hold its slot. Each frame also has its own
    30 s; this bounds the whole, so one frame every 29 s cannot keep a slot for hours."""
    return READ_GRACE_S + length / MIN_READ_RATE


class _Slots:
    """At most ``total`` streams at once, at most ``per_peer`` of them for one remote peer.
    The table holds only peers with a stream open now, so it never exceeds ``total`` entries."""

    def __init__(self, total: int, per_peer: int) -> None:
        self._total = total
        self._per_peer = per_peer
        self._held: dict[PeerId, int] = {}
        self._in_use = 0

    def take(self, peer: PeerId) -> bool:
        held = self._held.get(peer, 0)
        if self._in_use >= self._total or held >= self._per_peer:
            return False
        self._held[peer] = held + 1
        self._in_use += 1
        return True

    def give(self, peer: PeerId) -> None:
        self._in_use -= 1
        if self._held[peer] <= 1:
            del self._held[peer]
        else:
            self._held[peer] -= 1


# -- the owner's side -----------------------------------------------------------------


def serve_artifacts(host: P2PHost, store: LocalArtifacts, direct: DirectLinks | None = None) -> None:
    """Answer ``/inclavate/artifacts/2`` from ``store``, and its requests on ``direct``'s
    links of :data:`DIRECT_PROTOCOL` (with the same slots) where given."""
    reads = _Slots(MAX_READS, MAX_READS_PER_PEER)
    small = _Slots(MAX_SMALL, MAX_SMALL_PER_PEER)  # meta, list, usage, delete

    async def handle(stream: FramedStream | SealedStream, remote: PeerId) -> None:
        await serve(stream, remote, await stream.receive(timeout=_REQUEST_TIMEOUT))

    async def handle_link(stream: SealedStream, remote: PeerId) -> None:
        """Requests one after another, each served as on its own stream; ends when the asker
        closes the link or leaves it idle for :data:`LINK_IDLE_S`. While it waits, the same
        asker's next link may replace it (:meth:`DirectLinks.idle`)."""
        assert direct is not None
        while True:
            stream.max_frame_size = MAX_REQUEST_BYTES  # the last answer raised it
            try:
                with direct.idle(stream):
                    raw = await stream.receive(timeout=LINK_IDLE_S)
            except (StreamClosed, StreamTimeout):
                return
            await serve(stream, remote, raw)

    async def serve(stream: FramedStream | SealedStream, remote: PeerId, raw: bytes) -> None:
        stream.max_frame_size = MAX_ANSWER_BYTES  # requests are small; answers may not be
        try:
            request = decode_request(raw)
        except _REFUSED as exc:
            await _send(stream, refusal(exc))
            return
        slots = reads if request["op"] == "read" else small
        if not slots.take(remote):
            await _send(stream, refusal(OwnerBusy("the owner peer is busy; retry")))
            return
        try:
            await _answer(stream, store, request)
        finally:
            slots.give(remote)

    # An asker may hold MAX_READS_PER_PEER reads and MAX_SMALL_PER_PEER small requests at
    # once; a stream past those gets a refusal from its slots, one past this a reset.
    host.set_stream_handler(PROTOCOL, handle, max_frame_size=MAX_REQUEST_BYTES,
                            max_streams_per_peer=MAX_READS_PER_PEER + MAX_SMALL_PER_PEER)
    if direct is not None:  # an asker needs no more links than it may hold reads at once
        direct.set_handler(DIRECT_PROTOCOL, handle_link, LinkTable(MAX_READS_PER_PEER, MAX_DIRECT_LINKS))


async def _answer(stream: FramedStream | SealedStream, store: LocalArtifacts, request: dict[str, Any]) -> None:
    try:
        if request["op"] == "read":
            read = await store.open(request["id"], piece_header(request["offset"], request["length"]))
        else:
            await _send(stream, {"ok": True, **await _run(store, request)})
            return
    except _REFUSED as exc:
        await _send(stream, refusal(exc))
        return
    assert read.range is not None  # a piece is always a range
    header = {"ok": True, "artifact": read.meta.to_record(), "range": [read.range.start, read.range.end]}
    length = read.range.length
    deadline = read_deadline(length)
    try:
        with trio.move_on_after(deadline) as cut:
            await _send(stream, header)
            async for chunk in read.chunks:  # an error here propagates: the host resets the stream
                await stream.send(chunk, timeout=_DATA_TIMEOUT)
            await stream.send(b"", timeout=_DATA_TIMEOUT)
    finally:
        await read.chunks.aclose()
    if cut.cancelled_caught:  # raised, so the host resets the stream: never a short object
        raise ReadTooSlow(f"a read of {length} bytes took longer than {deadline:.1f} s")


async def _run(store: LocalArtifacts, request: dict[str, Any]) -> dict[str, Any]:
    op = request["op"]
    if op == "meta":
        return {"artifact": store.meta(request["id"]).to_record()}
    if op == "delete":
        await store.delete(request["id"])
        return {}
    if op == "usage":
        usage = store.usage().to_json()
        return {k: usage[k] for k in ("generated", "uploaded", "max_bytes", "max_objects")}
    page = store.list(request["query"])
    if request["keys"]:
        return {"keys": [[m.created_at_ms, m.id] for m in page.artifacts], "truncated": page.truncated}
    return {"artifacts": [m.to_record() for m in page.artifacts], "truncated": page.truncated}


async def _send(stream: FramedStream | SealedStream, answer: dict[str, Any]) -> None:
    await stream.send(encode(answer), timeout=_ANSWER_TIMEOUT)


# -- the asking side ------------------------------------------------------------------


class _AskerSlots:
    """Streams this peer has open to each owner for one pool (reads, or the small requests),
    at most what an owner accepts from one peer (:data:`MAX_READS_PER_PEER`,
    :data:`MAX_SMALL_PER_PEER`); one more waits here for a stream to end.

    Without it, a relay with more downloads of one owner's artifacts at once than those
    counts (16 at once, measured) opened more streams than the owner's
    ``max_streams_per_peer`` and the owner reset the extra ones: a 503 before the headers,
    or a body cut mid-download. The table holds only owners with a stream open or awaited
    now, so it never holds more entries than there are tasks asking."""

    def __init__(self, per_owner: Callable[[], int]) -> None:
        self._per_owner = per_owner
        self._owners: dict[str, tuple[trio.Semaphore, int]] = {}

    @asynccontextmanager
    async def hold(self, peer: str, wait_s: float = math.inf) -> AsyncIterator[None]:
        """A stream to ``peer`` may be opened inside; :class:`OwnerBusy` if none was free
        within ``wait_s``."""
        slots, count = self._owners.get(peer) or (None, 0)
        if slots is None:
            count = self._per_owner()
            slots = trio.Semaphore(count)
            self._owners[peer] = slots, count
        try:
            with trio.move_on_after(wait_s) as waited:  # only the wait: the stream has its own deadlines
                await slots.acquire()
            if waited.cancelled_caught:
                raise OwnerBusy(f"this peer's {count} streams to {peer} stayed in use for {wait_s:.0f} s")
            try:
                yield
            finally:
                slots.release()
        finally:
            if slots.statistics().tasks_waiting == 0 and slots.value == count:
                self._owners.pop(peer, None)

    def __len__(self) -> int:
        return len(self._owners)


class _StaleLink(Exception):
    """A direct link ended before its owner answered: the owner closed it while idle (after
    :data:`LINK_IDLE_S`, or for our next link, :meth:`p2p.direct.DirectLinks.idle`) or went
    away; the piece is asked for again over libp2p."""


class _DirectPool:
    """Direct links to owners (:data:`DIRECT_PROTOCOL`), each kept after a whole piece for the
    next one. A link is in use by one read, or idle here; a read takes an idle link or dials
    one, so an asker never holds more links to an owner than reads (:class:`_AskerSlots`:
    the owner's per-peer count). One dial per owner at a time, the others meanwhile over
    libp2p: a burst of reads must not take the tickets the forward link may need. Idle links
    are at most :data:`MAX_POOLED_LINKS`, each younger than :data:`POOL_IDLE_S`."""

    def __init__(self, direct: DirectLinks) -> None:
        self._direct = direct
        self._idle: dict[str, list[tuple[float, SealedStream]]] = {}
        self._dialing: set[str] = set()
        self.dialed = 0

    def __len__(self) -> int:
        return sum(map(len, self._idle.values()))

    async def take(self, peer: str) -> SealedStream | None:
        """An idle link to ``peer``, a new one, or None (use libp2p)."""
        await self.prune()
        idle = self._idle.get(peer)
        if idle:
            link = idle.pop()[1]
            if not idle:
                del self._idle[peer]
            return link
        if peer in self._dialing:
            return None
        self._dialing.add(peer)
        try:
            link = await self._direct.open(PeerId(peer), DIRECT_PROTOCOL, timeout=_DIRECT_DIAL_S)
            self.dialed += 1
            return link
        except P2PError as exc:
            log.debug("artifact pieces from %s over libp2p: %s", peer, exc)
            return None
        finally:
            self._dialing.discard(peer)

    async def give(self, peer: str, link: SealedStream) -> None:
        """``link`` served a whole piece: keep it for the next one. (Kept first, then the
        pool trimmed: a cancel while trimming leaves it here to be closed, not leaked.)"""
        self._idle.setdefault(peer, []).append((trio.current_time(), link))
        await self.prune()
        while len(self) > MAX_POOLED_LINKS:
            oldest = min(self._idle, key=lambda p: self._idle[p][0][0])
            await self._idle[oldest].pop(0)[1].reset()
            if not self._idle[oldest]:
                del self._idle[oldest]

    async def close(self) -> None:
        for links in self._idle.values():
            for _, link in links:
                await link.reset()
        self._idle.clear()

    async def prune(self) -> None:
        """Close the idle links older than :data:`POOL_IDLE_S` (their owner closes them soon)."""
        stale = trio.current_time() - POOL_IDLE_S
        for peer in list(self._idle):
            links = self._idle[peer]
            while links and links[0][0] <= stale:
                await links.pop(0)[1].reset()
            if not links:
                del self._idle[peer]


class RemoteArtifacts:
    """Ask other peers' stores. Failures to reach a peer raise :class:`ArtifactUnavailable`;
    the owner's refusals come back as the same exception types the local store raises.
    With ``direct``, pieces go over direct links where one can be made (:class:`_DirectPool`)."""

    def __init__(self, host: P2PHost, direct: DirectLinks | None = None) -> None:
        self.host = host
        self._links = _DirectPool(direct) if direct is not None else None
        self._read_slots = _AskerSlots(lambda: MAX_READS_PER_PEER)
        self._small_slots = _AskerSlots(lambda: MAX_SMALL_PER_PEER)
        self._relayed: weakref.WeakSet[RemotePieces] = weakref.WeakSet()
        """Open :class:`RemotePieces`. Weak: a read whose response was never sent (its
        client left before the first byte) is never closed, and must still stop counting
        once collected, or such leaks would add up to a peer that relays nothing any more."""

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Close idle direct links once stale (the owner has closed them, or will), and all
        of them when cancelled."""
        task_status.started()
        try:
            while True:
                await sleep_to_tick(POOL_IDLE_S)
                if self._links is not None:
                    await self._links.prune()
        finally:
            if self._links is not None:
                with trio.CancelScope(shield=True):
                    await self._links.close()

    @property
    def relayed_reads(self) -> int:
        """Open reads of other peers' artifacts, at most :data:`MAX_RELAYED_READS`."""
        return len(self._relayed)

    def relaying(self, read: RemotePieces, open_: bool) -> None:
        """``read`` is open (counts toward :data:`MAX_RELAYED_READS`), or no longer."""
        if open_:
            self._relayed.add(read)
        else:
            self._relayed.discard(read)

    async def meta(self, peer: str, id_: str) -> ArtifactMeta:
        answer = await self._call(peer, {"op": "meta", "id": id_})
        return decode_meta(answer.get("artifact"), peer, id_)

    async def delete(self, peer: str, id_: str) -> None:
        await self._call(peer, {"op": "delete", "id": id_})

    async def usage(self, peer: str) -> Usage:
        return decode_usage(await self._call(peer, {"op": "usage"}), peer)

    async def list(self, peer: str, query: ListQuery, owners: Owners, row_bytes: int = MAX_ROW_BYTES) -> ArtifactPage:
        """``query``'s rows on ``peer``, asked :data:`MAX_LIST_ROWS` at a time (each next ask
        after the last row got), so no answer outgrows its bound however long the rows; each
        answer at most ``row_bytes`` a row (its frame refused on its prefix past that), each
        row's id one ``peer`` owns among ``owners`` (the registry)."""
        rows: list[ArtifactMeta] = []
        while True:
            part = replace(query, limit=min(query.limit - len(rows), MAX_LIST_ROWS))
            most = list_answer_limit(part.limit, False, row_bytes)
            page = decode_page(await self._call(peer, list_request(part), most), peer, part.limit, owners)
            rows += page.artifacts
            if len(rows) >= query.limit or len(page.artifacts) < part.limit:
                return ArtifactPage(rows, page.truncated)
            query = replace(query, after=rows[-1].sort_key())

    async def keys(self, peer: str, query: ListQuery, owners: Owners) -> KeyPage:
        """The sort keys of ``query``'s rows on ``peer``: :meth:`key_answer` then
        :meth:`decode_keys` (a fan-out runs them as its two phases, the second in its one
        decode turn)."""
        return await self.decode_keys(peer, await self.key_answer(peer, query), query, owners)

    async def key_answer(self, peer: str, query: ListQuery) -> bytes:
        """``peer``'s answer to a ``keys`` listing of ``query``, not yet parsed: its frame at
        most what ``query.limit`` keys may take (at most ~61 bytes each; :func:`answer_limit`,
        refused on its length prefix)."""
        return await self._call_raw(peer, list_request(query, keys=True))

    async def decode_keys(self, peer: str, raw: bytes, query: ListQuery, owners: Owners) -> KeyPage:
        """:meth:`key_answer`'s frame decoded (:func:`decode_key_answer`)."""
        return await decode_key_answer(raw, peer, query, owners)

    async def open(self, peer: str, id_: str, range_header: str | None) -> ArtifactRead:
        """Open a read on the owner: its meta decides the range (as the owner's store would),
        and the first piece is fetched here, so a refusal is a status, not a cut-off body."""
        meta = await self.meta(peer, id_)
        byte_range = meta.range_to_read(range_header)
        if self.relayed_reads >= MAX_RELAYED_READS:
            raise ArtifactUnavailable(f"this peer relays {MAX_RELAYED_READS} downloads already; retry")
        start, length = (byte_range.start, byte_range.length) if byte_range else (0, meta.size_bytes)
        chunks = RemotePieces(self, peer, meta, start, length)
        try:
            await chunks.fetch()
        except BaseException:
            await chunks.aclose()
            raise
        return ArtifactRead(meta, byte_range, chunks)

    async def read_piece(self, peer: str, meta: ArtifactMeta, offset: int, length: int) -> list[bytes]:
        """Bytes ``offset .. offset + length`` of ``meta``'s object (inside it, at most
        :data:`MAX_PIECE`), whole, asking again while the owner is busy. Everything an owner
        could make us hold is bounded: the piece's bytes, its deadline, the busy wait."""
        pause = _BUSY_BACKOFF_S[0]
        with trio.move_on_after(BUSY_WAIT_S) as waited:
            async with self._read_slots.hold(peer):  # this peer's own streams first, then the owner's
                while True:
                    try:
                        return await self._read_piece_once(peer, meta, offset, length)
                    except OwnerBusy:
                        await trio.sleep(pause)
                        pause = min(pause * 2, _BUSY_BACKOFF_S[1])
        assert waited.cancelled_caught
        raise OwnerBusy(f"the owner peer {peer} stayed busy for {BUSY_WAIT_S:.0f} s")

    async def _read_piece_once(self, peer: str, meta: ArtifactMeta, offset: int, length: int) -> list[bytes]:
        if self._links is not None:
            link = await self._links.take(peer)
            if link is not None:
                try:
                    piece = await self._read_piece_on(link, peer, meta, offset, length)
                except _StaleLink:
                    pass  # asked again below, over libp2p
                except OwnerBusy:  # one whole answer frame: the link is ready for the next ask
                    await self._links.give(peer, link)
                    raise
                else:
                    await self._links.give(peer, link)
                    return piece
        stream = await self._open_stream(peer, MAX_RECORD_ANSWER_BYTES)
        piece = await self._read_piece_on(stream, peer, meta, offset, length)
        await stream.close()
        return piece

    async def _read_piece_on(self, stream: FramedStream | SealedStream, peer: str, meta: ArtifactMeta,
                             offset: int, length: int) -> list[bytes]:  # fmt: skip
        """One piece asked and taken whole on ``stream`` (reset on any failure but a ``busy``
        answer on a direct link); a direct link that ends before the answer raises
        :class:`_StaleLink` (a fresh one too: the owner may replace it for our next link)."""
        stream.max_frame_size = MAX_RECORD_ANSWER_BYTES  # the header; _receive_piece bounds the rest
        answered = busy = False
        try:
            with trio.move_on_after(read_deadline(length)):
                await stream.send(encode(read_request(meta.id, offset, length)), timeout=_REQUEST_TIMEOUT)
                raw = await stream.receive(timeout=_ANSWER_TIMEOUT)
                answered = True
                try:
                    answer = decode_answer(raw, peer)
                except OwnerBusy:
                    busy = isinstance(stream, SealedStream)
                    raise
                decode_piece(answer, meta, offset, length, peer)
                return await _receive_piece(stream, peer, length)
            raise ProtocolError(f"a piece of {length} bytes took longer than {read_deadline(length):.1f} s")
        except StreamClosed as exc:
            await stream.reset()
            if isinstance(stream, SealedStream) and not answered:
                raise _StaleLink() from exc
            raise ArtifactUnavailable(f"reading from the owner peer {peer} failed: {exc}") from exc
        except P2PError as exc:
            await stream.reset()
            raise ArtifactUnavailable(f"reading from the owner peer {peer} failed: {exc}") from exc
        except BaseException:
            if not busy:
                await stream.reset()
            raise

    async def _open_stream(self, peer: str, max_answer: int) -> FramedStream:
        """A stream whose frames may be at most ``max_answer`` bytes, refused on their length
        prefix: an answer is bounded by what its request can honestly need."""
        try:
            return await self.host.new_stream(peer, PROTOCOL, timeout=5.0, max_frame_size=max_answer)
        except P2PError as exc:
            raise ArtifactUnavailable(f"the owner peer {peer} is not reachable: {exc}") from exc

    async def _call(self, peer: str, request: dict[str, Any], max_answer: int | None = None) -> dict[str, Any]:
        """``request``'s answer, its frame at most ``max_answer`` bytes (default: what an
        honest owner may need, :func:`answer_limit`)."""
        return decode_answer(await self._call_raw(peer, request, max_answer), peer)

    async def _call_raw(self, peer: str, request: dict[str, Any], max_answer: int | None = None) -> bytes:
        """``request``'s answer frame, not yet parsed (:meth:`_call`)."""
        async with self._small_slots.hold(peer, BUSY_WAIT_S):
            return await self._call_once(peer, request, answer_limit(request) if max_answer is None else max_answer)

    async def _call_once(self, peer: str, request: dict[str, Any], max_answer: int) -> bytes:
        stream = await self._open_stream(peer, max_answer)
        try:
            async with stream:
                await stream.send(encode(request), timeout=_REQUEST_TIMEOUT)
                return await stream.receive(timeout=_ANSWER_TIMEOUT)
        except P2PError as exc:
            raise ArtifactUnavailable(f"the owner peer {peer} did not answer: {exc}") from exc


async def decode_key_answer(raw: bytes, peer: str, query: ListQuery, owners: Owners) -> KeyPage:
    """``peer``'s answer to a ``keys`` listing, parsed, then decoded in steps with a checkpoint
    between them (:func:`~inclavate.fan_out.in_steps`): an answer of 20,000 keys is ~1.2 MB.
    A fan-out runs this in its one decode turn (:meth:`inclavate.fan_out.FanOut.ask`'s
    second phase), as up to 32 answers arrive at once."""
    answer = decode_answer(raw, peer)
    await trio.lowlevel.checkpoint()
    return await in_steps(decode_keys_in_steps(answer, peer, query, owners))


async def _receive_piece(stream: FramedStream | SealedStream, peer: str, length: int) -> list[bytes]:
    """Exactly ``length`` bytes in frames of at most :data:`READ_CHUNK`, then the end frame.
    Each frame may be at most what the piece still lacks: one that announces more is refused
    on its length prefix (:class:`~p2p.errors.FrameTooLarge`), before its bytes are taken in."""
    frames: list[bytes] = []
    received = 0
    while True:
        stream.max_frame_size = min(READ_CHUNK, length - received)
        frame = await stream.receive(timeout=_DATA_TIMEOUT)
        received += len(frame)
        if len(frame) > READ_CHUNK or received > length:
            raise ProtocolError(f"peer {peer} sent more bytes than the piece holds")
        if not frame:
            if received != length:
                raise ProtocolError(f"peer {peer} ended a piece after {received} of {length} bytes")
            return frames
        frames.append(frame)


class RemotePieces:
    """An artifact's bytes from its owner, one piece of at most :data:`MAX_PIECE` at a time:
    the next piece is asked for only when the reader has taken the last one, so a reader that
    stops for a while holds memory for one piece and no stream, and no slot at the owner."""

    def __init__(self, remote: RemoteArtifacts, peer: str, meta: ArtifactMeta, start: int, length: int) -> None:
        self._remote = remote
        self._peer = peer
        self._meta = meta
        self._next = start
        self._end = start + length
        self._frames: list[bytes] = []
        remote.relaying(self, True)

    def __aiter__(self) -> RemotePieces:
        return self

    async def __anext__(self) -> bytes:
        if not self._frames:
            try:
                await self.fetch()
            except BaseException:
                await self.aclose()
                raise
        if not self._frames:
            await self.aclose()
            raise StopAsyncIteration
        return self._frames.pop(0)

    async def fetch(self) -> None:
        """Take the next piece off the wire, unless all of it has been."""
        if self._next >= self._end:
            return
        length = min(MAX_PIECE, self._end - self._next)
        self._frames = await self._remote.read_piece(self._peer, self._meta, self._next, length)
        self._next += length

    async def aclose(self) -> None:
        self._frames = []
        self._next = self._end
        self._remote.relaying(self, False)
