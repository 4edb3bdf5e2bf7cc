"""How many outbound libp2p connections a peer keeps, and which idle one it closes past that.

Strangers decide whom we dial: a registry record is free (4,096 in all, 64 per signer), a
peer exchange hands us up to 32 addresses per answer, and every swarm-wide listing asks
each live registry peer over ``/inclavate/artifacts/2``, dialling it if need be. py-libp2p
0.8.1 keeps each such connection until its own pruner starts, at 300 connections whatever
the descriptors allow: K identities listening on addresses a stranger runs took K
descriptors after a few listings (``scripts/probe_outbound_flood.py``).

:class:`OutboundGuard` bounds them to :func:`outbound_capacity` (an eighth of the soft
``RLIMIT_NOFILE``, ``inclavate/descriptors.py``). Past it, it closes the least needed
(:func:`to_close`): never a connection with one of our streams open on it (an ask, a
route hop's forward stream while a session runs, a latency probe's stream, a sync;
gossipsub's long-lived streams do not count), never a gossip mesh neighbour, never one that
has been idle less than :data:`MIN_IDLE_S` (dialled for an ask whose stream is not open
yet); of the rest, the longest idle first. Closed is not forgotten: the peer's
addresses stay, and the next ask dials it again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import trio
from libp2p.abc import INetConn, INetwork
from libp2p.rcmgr import Direction

from inclavate.descriptors import share
from inclavate.types import PeerId
from p2p.ticks import next_tick

logger = logging.getLogger(__name__)

SHARE_OF_DESCRIPTORS = 8
"""Outbound libp2p connections may hold one descriptor in this many (idle ones: see
:func:`to_close`)."""

MIN_OUTBOUND, MAX_OUTBOUND = 16, 1024
"""However few descriptors: the target degree (8) and a fan-out's 16 asks at a time need
some; past a thousand, the library's own pruner (300 connections) is the bound anyway."""

MIN_IDLE_S = 1.0
"""A connection idle less than this is not closed: one just dialled for an ask has no
stream yet. What comes on top of the bound is therefore what our own dialling opens in a
second (a fan-out has at most 32 asks in flight, ``inclavate/fan_out.py``)."""

CHECK_S = 0.5
"""How often the guard looks again when not woken by a new connection: a connection over
the bound may only have become idle (its stream closed) since."""

LONG_LIVED_PREFIXES = ("/meshsub/", "/floodsub/")
"""Streams the pubsub router keeps open on every connection: they do not make it busy
(any peer could keep one open to stay connected)."""


def outbound_capacity() -> int:
    """Idle outbound connections held at once, from the soft descriptor limit now."""
    return share(SHARE_OF_DESCRIPTORS, MIN_OUTBOUND, MAX_OUTBOUND, unknown=MAX_OUTBOUND // 4)


@dataclass(frozen=True)
class Outbound:
    """One outbound connection as :func:`to_close` sees it."""

    key: int
    busy: bool
    """One of our streams is open on it (pubsub's long-lived ones aside)."""
    kept: bool
    """A gossip mesh neighbour (bounded by gossipsub's degree, whatever strangers do)."""
    idle_since: float
    """When it was last seen busy, or opened (trio's clock)."""


def to_close(conns: Sequence[Outbound], capacity: int, now: float, min_idle: float = MIN_IDLE_S) -> list[int]:
    """The keys of the connections to close so that at most ``capacity`` stay: the longest
    idle first, never a busy or kept one nor one idle less than ``min_idle``. Fewer (maybe
    none) when not enough may be closed: the bound is on idle connections."""
    excess = len(conns) - capacity
    if excess <= 0:
        return []
    closable = [c for c in conns if not c.busy and not c.kept and now - c.idle_since >= min_idle]
    closable.sort(key=lambda c: c.idle_since)
    return [c.key for c in closable[:excess]]


def _is_busy(conn: INetConn) -> bool:
    for stream in list(getattr(conn, "streams", ())):
        protocol = stream.get_protocol()
        if protocol is None or not str(protocol).startswith(LONG_LIVED_PREFIXES):
            return True  # negotiating, or one of ours
    return False


def _is_outbound(conn: INetConn) -> bool:
    return getattr(conn, "direction", None) == Direction.OUTBOUND


class OutboundGuard:
    """Keeps the swarm's outbound connections within :func:`outbound_capacity`; run
    :meth:`run` for as long as the host runs."""

    def __init__(self, network: INetwork, mesh: Callable[[], Iterable[PeerId]],
                 capacity: Callable[[], int] = outbound_capacity) -> None:  # fmt: skip
        self._network = network
        self._mesh = mesh
        self._capacity = capacity
        self.closed = 0
        """Connections closed to keep the bound (a counter for tests and metrics)."""
        self._idle_since: dict[int, float] = {}
        self._wake = trio.Event()

    def wake(self) -> None:
        """A connection opened: look now rather than at the next check."""
        self._wake.set()

    async def run(self) -> None:
        """Until cancelled: after each wake or :data:`CHECK_S`, close what is over the bound."""
        while True:
            with trio.move_on_at(next_tick(trio.current_time(), CHECK_S)):
                await self._wake.wait()
            self._wake = trio.Event()
            await self.prune()

    def outbound(self) -> list[INetConn]:
        """Our outbound connections now, open ones only."""
        return [c for conns in list(self._network.get_connections_map().values()) for c in conns
                if _is_outbound(c) and not c.is_closed]  # fmt: skip

    async def prune(self) -> int:
        """Close the outbound connections over the bound (at once, concurrently); how many."""
        conns = {id(c): c for c in self.outbound()}
        now = trio.current_time()
        mesh = set(self._mesh())
        views = [self._view(key, conn, now, mesh) for key, conn in conns.items()]
        for key in set(self._idle_since) - set(conns):
            del self._idle_since[key]
        victims = [conns[key] for key in to_close(views, self._capacity(), now)]
        if victims:
            logger.debug("closing %d idle outbound connections over the bound of %d", len(victims), self._capacity())
            self.closed += len(victims)
            await _close_all(victims)
        return len(victims)

    def _view(self, key: int, conn: INetConn, now: float, mesh: set[PeerId]) -> Outbound:
        peer = PeerId(conn.muxed_conn.peer_id.to_base58())
        busy = _is_busy(conn)
        if busy or key not in self._idle_since:
            self._idle_since[key] = now
        kept = peer in mesh
        return Outbound(key, busy, kept, self._idle_since[key])


async def _close_all(conns: Iterable[INetConn]) -> None:
    """Close concurrently: each close sleeps 100 ms in ``SwarmConn._cleanup``."""

    async def close(conn: INetConn) -> None:
        try:
            await conn.close()
        except Exception as exc:  # noqa: BLE001 - closing anyway; the peer may be gone
            logger.debug("error closing an outbound connection: %r", exc)

    async with trio.open_nursery() as nursery:
        for conn in conns:
            nursery.start_soon(close, conn)
