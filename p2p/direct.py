"""The direct data plane: one plain TCP connection per neighbour, sealed with a key agreed
over Noise, beside libp2p.

Why: on loopback a decode-sized frame (1-2 KiB) costs ~1 ms of CPU per message through
py-libp2p's pure-Python yamux and Noise framing, against ~0.15 ms over a plain socket
(measured: see docs/ARCHITECTURE.md, "Wire format"). A token crosses every hop of a chain,
so that difference is most of what a hop cost.

Handshake (A dials B; both already share a Noise-authenticated libp2p connection)::

    A -> B  over libp2p /inclavate/direct/1:  the protocol A wants to speak (UTF-8)
    B -> A  over libp2p:  1 | TCP port u16 | ticket (16 random bytes) | key (32 random bytes)
            (or 0 | reason: no such protocol here)
    A -> B  TCP to the IP of A's libp2p connection to B, that port:  "INCLDP01" | ticket
    B -> A  TCP: a sealed empty frame (B proves it holds the key), or the sealed frame
            "limit" and the end (B holds as many of A's links of that protocol as it
            allows, none idle: A tries again in moments, not after ``retry_after_s``)
    then    sealed frames both ways (:mod:`p2p.sealed`)

The ticket is used once and expires in seconds; B binds the TCP connection to the PeerID it
issued the ticket to, so every frame on it is as authenticated as one over libp2p. A
stranger's connection is closed at once when its first 24 bytes are not a live ticket, or
after ``hello_timeout_s`` when they do not come; when too many wait, a newcomer closes the
oldest waiting one of the source holding the most, so a flood of silent connections cannot
lock honest dialers out. Tickets and live links are bounded per peer and in all, and a full
table makes room the same way: the oldest ticket (link) of the peer holding the most goes,
never the newcomer, since identities cost nothing to make. A peer at its own per-peer
bound replaces its oldest idle link (:meth:`DirectLinks.idle`), never another peer's: a
redial comes when its old links ended on its side, before the acceptor saw them end. Whoever
cannot make a direct connection (firewall, NAT, an older peer) uses the libp2p stream, as
before: :meth:`DirectLinks.open` fails fast and remembers the failure for a while.
"""

from __future__ import annotations

import logging
import os
import struct
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

import trio

from inclavate.descriptors import share
from inclavate.types import PeerId
from p2p.errors import DialError, LinkLimitReached, ListenError, P2PError, ProtocolError
from p2p.framing import FramedStream
from p2p.host import P2PHost
from p2p.sealed import KEY_BYTES, SealedStream

log = logging.getLogger(__name__)

PROTOCOL = "/inclavate/direct/1"
MAGIC = b"INCLDP01"
TICKET_BYTES = 16
_GRANT = struct.Struct(f">BH{TICKET_BYTES}s{KEY_BYTES}s")
_MAX_PROTOCOL_BYTES = 128
_CONTROL_FRAME_BYTES = 256
_AT_LIMIT = b"limit"
"""The acceptor's first sealed frame instead of its empty proof: this peer's links of the
protocol are at their bound, none idle (:class:`~p2p.errors.LinkLimitReached`)."""


def _links_share() -> int:
    """Live inbound links of one protocol, at most, whatever its table says: a 32nd of the
    descriptors (``inclavate/descriptors.py``; the fixed 512 + 64 links and 64 hellos took
    every descriptor of a peer limited to 1,024)."""
    return share(32, 16, 512)


def _hellos_share() -> int:
    """Connections awaiting their ticket, at most: a 64th of the descriptors."""
    return share(64, 4, 64)


DirectHandler = Callable[[SealedStream, PeerId], Awaitable[None]]
_K = TypeVar("_K")


@dataclass(frozen=True)
class DirectLimits:
    ticket_ttl_s: float = 10.0
    tickets_per_peer: int = 4
    """Unused tickets one peer may hold; asking for more drops its oldest."""
    max_tickets: int = 1024
    """Unused tickets in all. One more drops the oldest ticket of the peer holding the most
    (refusing the newcomer let free identities re-asking every ``ticket_ttl_s`` hold the table
    and refuse every honest dial)."""
    hello_timeout_s: float = 2.0
    """An accepted TCP connection must show its ticket within this, or it is closed."""
    max_unauthenticated: int = 64
    """Accepted connections still waiting for their ticket. One more closes the oldest waiting
    connection of the source IP that has the most (refusing the newcomer instead let anyone
    who kept this many silent connections open lock every honest dialer out)."""
    links_per_peer: int = 4
    """Live inbound direct connections of one peer (one per protocol and direction is normal).
    One more replaces that peer's oldest idle link (:meth:`DirectLinks.idle`), else is refused
    with ``limit``."""
    max_links: int = 512
    """Live inbound direct connections in all. One more closes the oldest link of the peer
    holding the most (refusing the newcomer let free identities each holding
    ``links_per_peer`` idle links refuse every honest dial)."""
    retry_after_s: float = 60.0
    """After a failed direct dial, use libp2p to that peer for this long (for that protocol:
    an older peer without one protocol's handler still gets direct links for the others)."""
    limit_retry_s: float = 2.0
    """After a dial refused with ``limit`` (:class:`~p2p.errors.LinkLimitReached`: the
    acceptor has not yet seen our old links end), use libp2p to that peer for only this long.
    As a failure it cost ``retry_after_s``: a relay redialing an owner that still held its
    four old artifact links read every piece of that owner over libp2p for a minute."""


@dataclass(frozen=True)
class LinkTable:
    """A protocol's own bounds on live inbound links (:meth:`DirectLinks.set_handler`): its
    links are counted, and pushed out when full, only among themselves, so they can never
    refuse or close a link of another protocol (nor be closed for one)."""

    links_per_peer: int
    max_links: int


def _oldest_of_the_most(owners: Mapping[_K, str]) -> _K:
    """The first (oldest) key of whoever owns the most keys in ``owners`` (not empty)."""
    held = Counter(owners.values())
    most = max(held.values())
    return next(key for key, owner in owners.items() if held[owner] == most)


@dataclass(frozen=True)
class _Ticket:
    peer: PeerId
    protocol: str
    key: bytes
    expires: float


@dataclass(frozen=True)
class Grant:
    """What B answers A over libp2p: where to connect and with what."""

    port: int
    ticket: bytes
    key: bytes

    def encode(self) -> bytes:
        return _GRANT.pack(1, self.port, self.ticket, self.key)

    @classmethod
    def decode(cls, data: bytes) -> Grant:
        if len(data) != _GRANT.size or data[0] != 1:
            reason = data[1:120].decode("utf-8", "replace") if data[:1] == b"\0" else "malformed grant"
            raise DialError(f"direct connection refused: {reason}")
        _, port, ticket, key = _GRANT.unpack(data)
        if port == 0:
            raise DialError("direct connection refused: port 0")
        return cls(port, ticket, key)


class DirectLinks:
    """Serves and dials direct connections for the protocols given a handler."""

    def __init__(self, host: P2PHost, *, port: int = 0, limits: DirectLimits = DirectLimits(),
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self._host = host
        self._listen_port = port
        self.limits = limits
        self._clock = clock
        self._handlers: dict[str, DirectHandler] = {}
        self._tickets: dict[bytes, _Ticket] = {}
        self._pending: dict[trio.CancelScope, str] = {}
        """Connections waiting for their ticket, oldest first: the scope that evicts one, its
        source IP."""
        self._links: dict[trio.CancelScope, PeerId] = {}
        """Live inbound links, oldest first: the scope that closes one, its peer (the protocols
        without a :class:`LinkTable` of their own, bounded by ``limits``)."""
        self._tables: dict[str, tuple[LinkTable, dict[trio.CancelScope, PeerId]]] = {}
        """The live inbound links of each protocol given a :class:`LinkTable`, the same way."""
        self._scopes: dict[SealedStream, trio.CancelScope] = {}
        """Each live inbound link's stream and the scope that closes it (for :meth:`idle`)."""
        self._idle: set[trio.CancelScope] = set()
        """The live inbound links whose handler waits for a request (:meth:`idle`)."""
        self._failed_until: dict[tuple[PeerId, str], float] = {}
        self.port: int | None = None
        self.refused = 0
        """Inbound connections closed before a handler saw them (no ticket, bounds)."""
        self.tickets_evicted = 0
        """Unused tickets dropped to make room for another peer's (``max_tickets``)."""
        self.links_evicted = 0
        """Live links closed to make room for another peer's (``max_links``)."""
        self.links_replaced = 0
        """Idle links closed to make room for the same peer's next one (``links_per_peer``)."""

    def set_handler(self, protocol: str, handler: DirectHandler, table: LinkTable | None = None) -> None:
        """Serve ``protocol``'s links with ``handler``; with ``table``, its links are bounded
        by it alone, apart from every other protocol's (else they share ``limits``' table)."""
        self._handlers[protocol] = handler
        if table is not None:
            self._tables[protocol] = table, {}

    def _table_of(self, protocol: str) -> tuple[int, int, dict[trio.CancelScope, PeerId]]:
        """``protocol``'s links per peer, links in all, and its table of live links."""
        if protocol in self._tables:
            table, links = self._tables[protocol]
            return table.links_per_peer, min(table.max_links, _links_share()), links
        return self.limits.links_per_peer, min(self.limits.max_links, _links_share()), self._links

    @contextmanager
    def idle(self, stream: SealedStream) -> Iterator[None]:
        """Inside, ``stream`` (an inbound link given to a handler) waits for its peer's next
        request, and that peer's next link of the protocol, past its bound, may close it:
        the peer does not use it, or will learn it is closed before it gets an answer on it.
        A link busy answering is never closed for one of its own peer's."""
        scope = self._scopes.get(stream)
        if scope is not None:
            self._idle.add(scope)
        try:
            yield
        finally:
            if scope is not None:
                self._idle.discard(scope)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            listeners = await trio.open_tcp_listeners(self._listen_port, host=self._host.listen_host)
        except OSError as exc:
            raise ListenError(f"cannot listen for direct links on {self._host.listen_host}:{self._listen_port}: {exc}") from exc
        self.port = listeners[0].socket.getsockname()[1]
        # One ticket request per direct link being set up; a peer holds at most
        # tickets_per_peer tickets, so it never needs more requests open at once.
        self._host.set_stream_handler(PROTOCOL, self._grant, max_frame_size=_CONTROL_FRAME_BYTES,
                                      max_streams_per_peer=self.limits.tickets_per_peer)
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(trio.serve_listeners, self._accept, listeners)
                task_status.started()
        finally:
            self._host.remove_stream_handler(PROTOCOL)

    # ------------------------------------------------------------------ acceptor

    async def _grant(self, control: FramedStream, remote: PeerId) -> None:
        """Hand ``remote`` a one-time ticket and key for a direct connection."""
        request = await control.receive(timeout=self.limits.hello_timeout_s)
        protocol = request.decode("utf-8", "replace")
        if len(request) > _MAX_PROTOCOL_BYTES or protocol not in self._handlers or self.port is None:
            await control.send(b"\0no direct handler for that protocol", timeout=self.limits.hello_timeout_s)
            return
        self._prune_tickets()
        mine = [t for t, v in self._tickets.items() if v.peer == remote]
        for old in mine[: max(0, len(mine) - self.limits.tickets_per_peer + 1)]:
            del self._tickets[old]
        if self.limits.max_tickets < 1:
            await control.send(b"\0too many tickets outstanding", timeout=self.limits.hello_timeout_s)
            return
        while len(self._tickets) >= self.limits.max_tickets:  # never refuse the newcomer: see max_tickets
            del self._tickets[_oldest_of_the_most({t: v.peer for t, v in self._tickets.items()})]
            self.tickets_evicted += 1
        grant = Grant(self.port, os.urandom(TICKET_BYTES), os.urandom(KEY_BYTES))
        self._tickets[grant.ticket] = _Ticket(remote, protocol, grant.key, self._clock() + self.limits.ticket_ttl_s)
        await control.send(grant.encode(), timeout=self.limits.hello_timeout_s)

    def _prune_tickets(self) -> None:
        now = self._clock()
        for ticket in [t for t, v in self._tickets.items() if v.expires <= now]:
            del self._tickets[ticket]

    async def _accept(self, tcp: trio.SocketStream) -> None:
        """Serve one inbound connection; its socket is closed however that ends (a refusal,
        the handler's end, a cancel while the ticket is awaited). The handler is awaited
        here, not in a coroutine under this one: each frame it waits for resumes every
        coroutine above it, a Python call each."""
        try:
            ticket = await self._admit(tcp)
            if ticket is None:
                return
            per_peer, max_links, links = self._table_of(ticket.protocol)
            stream = SealedStream(FramedStream.over_socket(tcp), ticket.key, dialer=False, remote_peer=ticket.peer, transport=tcp)
            if max_links < 1 or not self._room_for(ticket.peer, per_peer, links):
                await self._refuse_at_limit(stream)
                return
            while len(links) >= max_links:
                self._evict_link(links)
            handler = self._handlers.get(ticket.protocol)
            live = trio.CancelScope()
            links[live] = ticket.peer
            self._scopes[stream] = live
            try:
                with live:  # cancelled by _evict_link: the stream is reset, the socket closed
                    async with stream:
                        await stream.send(b"", timeout=self.limits.hello_timeout_s)
                        if handler is not None:
                            await handler(stream, ticket.peer)
            except P2PError as exc:
                log.debug("direct %s link from %s ended: %s", ticket.protocol, ticket.peer, exc)
            except Exception:  # noqa: BLE001 - one link's failure stays with it
                log.exception("direct %s handler failed on a link from %s", ticket.protocol, ticket.peer)
            finally:
                links.pop(live, None)
                self._scopes.pop(stream, None)
                self._idle.discard(live)
        finally:
            await trio.aclose_forcefully(tcp)

    async def _admit(self, tcp: trio.SocketStream) -> _Ticket | None:
        """The live ticket an inbound connection shows within ``hello_timeout_s``, or None
        (counted in ``refused``) when it shows none or too many wait for theirs."""
        try:
            source: str = tcp.socket.getpeername()[0]
        except OSError:  # reset before we got to it
            source = ""
        waiting_bound = min(self.limits.max_unauthenticated, _hellos_share())
        if not source or waiting_bound < 1:
            self.refused += 1
            return None
        while len(self._pending) >= waiting_bound:
            self._evict_pending()
        ticket = None
        waiting = trio.CancelScope()
        self._pending[waiting] = source
        try:
            with waiting:
                ticket = await self._read_ticket(tcp)
        finally:
            self._pending.pop(waiting, None)
        if ticket is None:
            self.refused += 1
        return ticket

    async def _refuse_at_limit(self, stream: SealedStream) -> None:
        """Tell a dialer whose links of the protocol are at their bound, none idle, so."""
        self.refused += 1
        with trio.move_on_after(self.limits.hello_timeout_s):
            try:  # sealed: only the ticket's holder reads it, and only the acceptor could write it
                await stream.send(_AT_LIMIT, timeout=self.limits.hello_timeout_s)
            except (P2PError, OSError, trio.BrokenResourceError, trio.ClosedResourceError):
                pass

    def _room_for(self, peer: PeerId, per_peer: int, links: dict[trio.CancelScope, PeerId]) -> bool:
        """Whether ``peer`` may have one more link in ``links``: it holds fewer than
        ``per_peer``, or one of its own is idle and is closed now for it (its oldest idle one).
        A peer dials only when it lacks a link, so at its bound some of the links counted
        here have ended on its side and not yet here; refusing made it wait
        ``retry_after_s``. Only the peer's own links go, so it never exceeds its bound nor
        pushes out another peer's."""
        mine = [scope for scope, owner in links.items() if owner == peer]
        if len(mine) < per_peer:
            return True
        oldest_idle = next((scope for scope in mine if scope in self._idle), None)
        if oldest_idle is None:
            return False
        del links[oldest_idle]
        self._idle.discard(oldest_idle)
        oldest_idle.cancel()
        self.links_replaced += 1
        return True

    def _evict_pending(self) -> None:
        """Close the oldest waiting connection of the source with the most waiting: a flood
        from one address pushes out only its own, a flood from many its oldest, so an honest
        hello is lost only if ``max_unauthenticated`` newer connections beat it (it takes
        milliseconds), never by sitting behind silent ones."""
        oldest = _oldest_of_the_most(self._pending)
        del self._pending[oldest]
        oldest.cancel()

    def _evict_link(self, links: dict[trio.CancelScope, PeerId]) -> None:
        """Close the oldest live link of the peer holding the most: its place is free at once,
        its handler is cancelled and its socket closed, so the far end sees the link end and
        falls back to libp2p or redials, as after any lost link. Free identities holding
        ``links_per_peer`` links each push out only their own; a peer holding one link loses
        it only when every peer holds one and ``max_links`` newer ones arrive."""
        oldest = _oldest_of_the_most(links)
        del links[oldest]
        oldest.cancel()
        self.links_evicted += 1

    async def _read_ticket(self, tcp: trio.SocketStream) -> _Ticket | None:
        """The live ticket this connection shows first, or None (closed by the caller)."""
        want = len(MAGIC) + TICKET_BYTES
        hello = b""
        with trio.move_on_after(self.limits.hello_timeout_s):
            try:
                while len(hello) < want:
                    chunk = await tcp.receive_some(want - len(hello))
                    if not chunk:
                        return None
                    hello += chunk
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return None
        if len(hello) < want or not hello.startswith(MAGIC):
            return None
        ticket = self._tickets.pop(hello[len(MAGIC):], None)
        if ticket is None or ticket.expires <= self._clock():
            return None
        return ticket

    # -------------------------------------------------------------------- dialer

    async def open(self, peer: PeerId, protocol: str, timeout: float) -> SealedStream:
        """A sealed direct stream to ``peer`` speaking ``protocol``; :class:`DialError` when
        none can be made (the caller falls back to libp2p)."""
        if self._failed_until.get((peer, protocol), 0.0) > self._clock():
            raise DialError(f"no direct connection to {peer} (failed recently)")
        ip = self._host.remote_ip(peer)
        if ip is None:  # not a failure of the direct path: no libp2p connection to learn it from
            raise DialError(f"not connected to {peer} over libp2p: no address to dial directly")
        try:
            with trio.fail_after(timeout):
                return await self._dial(peer, ip, protocol, timeout)
        except (trio.TooSlowError, DialError, P2PError, OSError, trio.BrokenResourceError) as exc:
            if len(self._failed_until) >= 4096:
                self._failed_until.clear()
            retry = self.limits.limit_retry_s if isinstance(exc, LinkLimitReached) else self.limits.retry_after_s
            self._failed_until[peer, protocol] = self._clock() + retry
            if isinstance(exc, DialError):
                raise
            raise DialError(f"direct connection to {peer} failed: {exc!r}") from exc

    async def _dial(self, peer: PeerId, ip: str, protocol: str, timeout: float) -> SealedStream:
        async with await self._host.new_stream(peer, PROTOCOL, timeout=timeout,
                                               max_frame_size=_CONTROL_FRAME_BYTES) as control:  # fmt: skip
            await control.send(protocol.encode(), timeout=timeout)
            grant = Grant.decode(await control.receive(timeout=timeout))
        tcp = await trio.open_tcp_stream(ip, grant.port)
        try:
            await tcp.send_all(MAGIC + grant.ticket)
            stream = SealedStream(FramedStream.over_socket(tcp), grant.key, dialer=True, remote_peer=peer, transport=tcp)
            # The proof is empty (or the 5-byte "limit"): a frame the acceptor announces larger
            # is refused on its length prefix (it could announce 256 MiB and have us take it in
            # until the deadline); the link's user sets what it takes after.
            stream.max_receive_size = len(_AT_LIMIT)
            proof = await stream.receive(timeout=timeout)
            if proof == _AT_LIMIT:
                raise LinkLimitReached(f"{peer} holds as many of our {protocol} links as it allows, none idle")
            if proof != b"":
                raise ProtocolError("the direct connection's first frame is not the acceptor's proof")
            stream.max_receive_size = None
        except BaseException:
            await trio.aclose_forcefully(tcp)
            raise
        return stream
