"""How many inbound libp2p streams one remote peer may hold open on this peer at once.

Every inbound stream runs a handler task until it ends, and several handlers wait long by
design (a forward stream idles up to an hour, a ping stream too). py-libp2p bounds inbound
streams only by one semaphore of 10,000 that inbound *and outbound* streams share, so one
stranger on one connection could open ~10,000 idle streams (measured: 40 s, on loopback)
and every other peer's ping, sync or forward stream, and every stream this peer opens, then
waited for a slot for as long as the stranger liked. Its own muxer's 256-stream backlog
is no bound: that is the *opener's* limit, which a stranger's implementation need not keep.

:class:`StreamQuota` counts live inbound streams per key and refuses past a cap; the host
keys it by remote peer (all protocols, negotiation included), by (peer, protocol) with a
cap each protocol chooses, and in all. Counts live only while a stream does: the table
holds keys of live streams and nothing else.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass
from enum import Enum

from libp2p.abc import INetStream

from inclavate.untrusted import DropCounter

logger = logging.getLogger(__name__)

PEER_STREAMS = 64
"""Inbound streams of one remote peer, every protocol together (still negotiating ones
included). An honest neighbour holds about a dozen: a forward stream (two for a moment when
one is replaced), a ping stream, a pubsub stream, a sync and a peer exchange after each
connect, a direct-link ticket, a vocab fetch, up to 4 artifact reads and 4 small artifact
requests; identify's own. 64 leaves it room for bursts and never binds it."""

TOTAL_STREAMS = 4096
"""Inbound streams of all peers together, beyond each one's :data:`RESERVED_STREAMS`.
py-libp2p's one semaphore of 10,000 is shared with the streams this peer opens, which wait
when it is empty: 4,096 plus the reserves (2,400 at 300 connections) keep a third of it for
our own (156 identities used to fill the library's)."""

RESERVED_STREAMS = 8
"""Each peer's first inbound streams, which :data:`TOTAL_STREAMS` does not count: an honest
neighbour's usual half dozen (a forward stream, a ping, pubsub, a sync, a peer exchange, a
ticket) still open however many strangers fill the total (64 identities at their cap did,
and every other peer's new streams were then refused). What they can hold on top of the
total is this many per connection: 2,400 at the pruner's 300 connections."""

DEFAULT_PROTOCOL_STREAMS = 8
"""Per peer and protocol, unless the protocol's handler asks for another number: a
one-request protocol is asked at most a few times at once by an honest peer."""


class Refusal(Enum):
    """Why a stream was refused (a fixed set: the counter never grows with input)."""

    PEER = "peer holds its cap of streams"
    PROTOCOL = "peer holds its cap of streams of this protocol"
    TOTAL = "inbound streams of all peers at their cap"


class StreamQuota:
    """Live counts per key, each key capped; keys leave the table at zero."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._live: dict[Hashable, int] = {}

    def take(self, key: Hashable, cap: int | None = None) -> bool:
        """Count one more stream of ``key``, or False (nothing counted) at its cap."""
        held = self._live.get(key, 0)
        if held >= (self.cap if cap is None else cap):
            return False
        self._live[key] = held + 1
        return True

    def give(self, key: Hashable) -> None:
        """One stream of ``key`` ended (taken before)."""
        held = self._live[key] - 1
        if held:
            self._live[key] = held
        else:
            del self._live[key]

    def held(self, key: Hashable) -> int:
        return self._live.get(key, 0)

    def __len__(self) -> int:
        """Keys with live streams (the table's size)."""
        return len(self._live)


RawHandler = Callable[[INetStream], Awaitable[None]]


@dataclass(frozen=True)
class _Claim:
    quota: StreamQuota
    key: Hashable
    cap: int | None
    reason: Refusal


_ALL = "all peers"


class InboundStreams:
    """The caps above, applied by wrapping libp2p stream handlers (one instance per host).

    :meth:`guard_peer` wraps the swarm's handler of *every* inbound stream, so the per-peer
    and total caps hold before protocol negotiation (a stream that never negotiates holds a
    slot for libp2p's 10 s negotiation timeout) and cover library protocols too;
    :meth:`guard_protocol` wraps one protocol's handler. A refused stream is reset at once:
    its opener sees a reset stream, which an honest opener treats as a failed request."""

    def __init__(self, *, per_peer: int = PEER_STREAMS, total: int = TOTAL_STREAMS,
                 per_protocol: int = DEFAULT_PROTOCOL_STREAMS) -> None:
        self.peers = StreamQuota(per_peer)
        self.protocols = StreamQuota(per_protocol)
        self.total = StreamQuota(total)
        self.refused = DropCounter()
        """Refused streams, by :class:`Refusal`."""

    def guard_peer(self, handler: RawHandler) -> RawHandler:
        def claims(peer: object) -> list[_Claim]:
            own = _Claim(self.peers, peer, None, Refusal.PEER)
            if self.peers.held(peer) < RESERVED_STREAMS:
                return [own]
            return [own, _Claim(self.total, _ALL, None, Refusal.TOTAL)]

        return self._guarded(handler, "any", claims)

    def guard_protocol(self, name: str, handler: RawHandler, cap: int | None = None) -> RawHandler:
        """``handler`` with at most ``cap`` (default :data:`DEFAULT_PROTOCOL_STREAMS`) live
        streams per peer; ``name`` may stand for several protocol ids (pubsub's versions)."""

        def claims(peer: object) -> list[_Claim]:
            return [_Claim(self.protocols, (peer, name), cap, Refusal.PROTOCOL)]

        return self._guarded(handler, name, claims)

    def _guarded(self, handler: RawHandler, name: str, claims: Callable[[object], list[_Claim]]) -> RawHandler:
        async def guarded(stream: INetStream) -> None:
            peer = stream.muxed_conn.peer_id
            taken: list[_Claim] = []
            try:
                for claim in claims(peer):
                    if not claim.quota.take(claim.key, claim.cap):
                        self.refused.count(claim.reason)
                        logger.debug("refused an inbound %s stream from %s: %s", name, peer, claim.reason.value)
                        with contextlib.suppress(Exception):  # the stranger may be gone already
                            await stream.reset()
                        return
                    taken.append(claim)
                await handler(stream)
            finally:
                for claim in taken:
                    claim.quota.give(claim.key)

        return guarded
