"""How many inbound libp2p connections a peer holds, and which one goes past that.

py-libp2p 0.8.1 bounds none of them in a way that holds: its inbound cap leaks a slot per
connection ever accepted (``p2p.host`` sets it to a million), its pruner starts at 300
connections whatever the descriptors allow, and each accepted connection's task then waits
for the swarm's end, not its connection's. Measured with ``scripts/probe_p2p_flood.py``
against a peer limited to 256 descriptors: 230 connections through Noise and yamux under
fresh identities (free to make) held all 256 for as long as they stayed (never closed),
``/health`` did not answer and an honest peer could not join; 400 silent or stalled
connections, reopened as the peer's 10 s handshake deadline closed them, kept it at its
limit (``accept returned EMFILE`` 400-500 times in 30 s) and delayed an honest join 3x.

:class:`ConnectionGuard` replaces the swarm's inbound handler (TCP: our only transport)
with one that counts. First, at accept, a rate (``p2p/accept_rate.py``: token buckets per
source and in all): a connection past it is closed at once, before multistream and Noise,
which cost the peer far more CPU than the connection costs a stranger. Then two tables,
both :class:`~inclavate.source_table.ConnectionTable` (a newcomer is always taken; past the
bound the source, IPv4 address or IPv6 /64, holding the most loses its oldest):

* **handshaking**: from accept to yamux, at most :func:`handshake_capacity`, each with a
  :data:`HANDSHAKE_S` deadline. Cheap to flood, so small: an honest handshake takes
  milliseconds.
* **established**: inbound connections through yamux, at most :func:`inbound_capacity`
  (an eighth of ``RLIMIT_NOFILE``: the HTTP API holds a quarter, the rest is outbound
  dials, direct links, the engine, SQLite and model files). Connections to peers whose
  records we hold (:attr:`ConnectionGuard.valued`) go after the source's others.
  Outbound connections (we dialled them) are not counted and never evicted here: they are
  bounded apart (``p2p/outbound_guard.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import trio
from libp2p.abc import IMuxedConn, IRawConnection, ReadWriteCloser
from libp2p.network.connection.raw_connection import RawConnection
from libp2p.network.swarm import Swarm
from multiaddr import Multiaddr

from inclavate.descriptors import share
from inclavate.source_table import ConnectionTable, source_of
from inclavate.types import PeerId
from p2p.accept_rate import AcceptRate

logger = logging.getLogger(__name__)

HANDSHAKE_S = 10.0
"""From accept to a yamux connection (multistream, Noise, multistream, yamux)."""

SHARE_OF_DESCRIPTORS = 8
"""Inbound libp2p connections may hold one descriptor in this many."""

MIN_INBOUND, MAX_INBOUND = 16, 1024
"""However few or many descriptors: a peer must take some neighbours; past a thousand the
pruner (300 connections in all) and gossipsub's upkeep are the bound anyway."""

HANDSHAKES_PER_INBOUND = 4
"""Handshakes under way may be a quarter of the established bound (at least 4, at most 64)."""

_CLOSE_S = 1.0
"""Budget for closing one evicted or failed connection."""


def inbound_capacity() -> int:
    """Established inbound connections held at once, from the soft descriptor limit now
    (``inclavate/descriptors.py``)."""
    return share(SHARE_OF_DESCRIPTORS, MIN_INBOUND, MAX_INBOUND, unknown=MAX_INBOUND // 4)


def handshake_capacity() -> int:
    """Inbound connections still negotiating, held at once."""
    return max(4, min(64, inbound_capacity() // HANDSHAKES_PER_INBOUND))


@dataclass
class _Handshaking:
    """A connection in the handshake. Evicting it closes its socket, so the handshake fails
    as on a peer's reset and the library releases what it took: cancelling the handshake
    instead skips the library's release of its resource manager's connection count
    (its cleanup awaits inside the cancelled scope), and after ~a thousand evictions that
    manager refused every inbound connection, honest ones included."""

    conn: ReadWriteCloser
    idle: bool = True

    def evict(self) -> None:
        socket = getattr(getattr(self.conn, "stream", None), "socket", None)
        if socket is not None:
            socket.close()  # trio wakes the handshake's pending read or write


@dataclass
class _Established:
    """An inbound connection through yamux: evicting it wakes its handler, which closes it."""

    peer: PeerId
    valued: Callable[[PeerId], bool]
    evicted: trio.Event = field(default_factory=trio.Event)

    @property
    def idle(self) -> bool:
        """Evicted first within its source: a connection of a peer we hold no record of."""
        return not self.valued(self.peer)

    def evict(self) -> None:
        self.evicted.set()


class ConnectionGuard:
    """Counts the swarm's inbound connections; :meth:`install` puts it in front of them."""

    def __init__(self, inbound: Callable[[], int] = inbound_capacity,
                 handshakes: Callable[[], int] = handshake_capacity, rate: AcceptRate | None = None) -> None:  # fmt: skip
        self.rate = rate or AcceptRate()
        """New connections let into the handshake, per source and in all."""
        self.handshaking = ConnectionTable(handshakes)
        self.established = ConnectionTable(inbound)
        self.valued: Callable[[PeerId], bool] = lambda _peer: False
        """Peers whose connections go last (the peer sets it: those whose records it holds)."""
        self._swarm: Swarm | None = None

    def install(self, swarm: Swarm) -> None:
        """Handle ``swarm``'s inbound connections (its listener calls this by name)."""
        self._swarm = swarm
        swarm._handle_inbound_connection = self.handle  # type: ignore[method-assign]  # noqa: SLF001

    async def handle(self, conn: ReadWriteCloser, maddr: Multiaddr) -> None:
        """One inbound connection from accept to close: the accept rate (past it, closed
        unread), the handshake under its deadline and the handshake table's bound, then the
        established table's bound until it ends."""
        source = source_of(_remote_host(conn))
        if not self.rate.take(source):
            logger.debug("closing a new inbound connection from %s unread: over its rate", source)
            _Handshaking(conn).evict()
            return
        muxed = await self._handshake(conn, source, maddr)
        if muxed is None:
            return
        held = _Established(PeerId(muxed.peer_id.to_base58()), self.valued)
        key = self.established.admit(source, held)
        try:
            await _first_of(held.evicted, getattr(muxed, "event_closed", None), getattr(muxed, "event_shutting_down", None))
            if held.evicted.is_set():
                logger.debug("closing the inbound connection of %s (%s): over the bound", held.peer, source)
                await self._close_swarm_conn(muxed)
        finally:
            self.established.release(key)

    async def _handshake(self, conn: ReadWriteCloser, source: str, maddr: Multiaddr) -> IMuxedConn | None:
        """The yamux connection, or None (failed, past the library's deadline, which
        :func:`p2p.host._build_libp2p_host` sets to :data:`HANDSHAKE_S`, or evicted)."""
        assert self._swarm is not None
        raw = RawConnection(conn, False)
        key = self.handshaking.admit(source, _Handshaking(conn))
        try:
            return await self._swarm.upgrade_inbound_raw_conn(raw, maddr)
        except Exception as exc:  # noqa: BLE001 - a stranger's failure is routine
            logger.debug("inbound handshake from %s failed: %r", source, exc)
        finally:
            self.handshaking.release(key)
        await _close_quietly(raw)
        return None

    async def _close_swarm_conn(self, muxed: IMuxedConn) -> None:
        assert self._swarm is not None
        with trio.move_on_after(_CLOSE_S):
            for conn in self._swarm.get_connections(muxed.peer_id):
                if conn.muxed_conn is muxed:
                    await conn.close()
                    return
            await muxed.close()


def _remote_host(conn: ReadWriteCloser) -> str | None:
    try:
        address = conn.get_remote_address()
    except Exception:  # noqa: BLE001 - a socket already reset has none
        return None
    return address[0] if address else None


async def _close_quietly(conn: IRawConnection) -> None:
    with trio.CancelScope(shield=True), trio.move_on_after(_CLOSE_S):
        try:
            await conn.close()
        except Exception:  # noqa: BLE001 - closing anyway
            pass


async def _first_of(*events: trio.Event | None) -> None:
    """Until the first of ``events`` is set."""
    async with trio.open_nursery() as nursery:
        for event in events:
            if event is not None:
                nursery.start_soon(_set_then_cancel, event, nursery.cancel_scope)


async def _set_then_cancel(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel()
