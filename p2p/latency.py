"""Measured link latency to other peers, the routing cost model's ``link_ms``.

Every ``interval`` each peer pings the peers it may route through over ``/inclavate/ping/1``
(one long-lived stream per peer, 8-byte frames echoed back) that it has not measured yet, whose
last ping failed, or whose last measure is ``refresh`` old, and keeps a smoothed round trip.
A peer that does not answer within the timeout keeps a high penalty until it does, so routes
avoid it without the registry having to call it Degraded first.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

import trio

from inclavate.types import PeerId
from p2p.errors import P2PError
from p2p.framing import FramedStream
from p2p.host import P2PHost
from p2p.routing import DEFAULT_LINK_MS
from p2p.ticks import sleep_to_tick

log = logging.getLogger(__name__)

PROTOCOL = "/inclavate/ping/1"
UNREACHABLE_MS = 1000.0
_ALPHA = 0.3


class LatencyMonitor:
    def __init__(
        self,
        host: P2PHost,
        targets: Callable[[], list[PeerId]],
        *,
        interval: float = 10.0,
        refresh: float = 30.0,
        timeout: float = 2.0,
        max_per_round: int = 64,
    ) -> None:
        self.host = host
        self.targets = targets
        self.interval = interval
        self.refresh = refresh
        """A measured, answering peer is pinged again after this, not every ``interval``: a
        ping is two messages through the whole stream stack on both ends (~15 trio steps
        each side), and every peer pinging every route candidate every 10 s was a fifth of an
        idle 3-peer chain's CPU (``scripts/bench_idle.py``). A link's round trip on a LAN
        does not move in seconds, and what routing must react to fast, a stalled or gone
        peer, it learns from the step deadline and the lost connection
        (:func:`usable_link_ms`). Yamux measures its own RTT every 30 s too."""
        self.timeout = timeout
        self.max_per_round = max_per_round
        """Peers pinged per ``interval``; past it, the targets take turns (each measured once
        every ``ceil(targets / max_per_round)`` rounds). Every routable peer every 10 s was
        ~400 pings a second and a stream (and a connection) to each at 4,096 peers."""
        self.rtt_ms: dict[PeerId, float] = {}
        self._measured_at: dict[PeerId, float] = {}
        """When each current target was last pinged (trio clock); bounded as ``rtt_ms`` is."""
        self._streams: dict[PeerId, FramedStream] = {}
        self._next = 0
        """Where in the sorted targets the next round starts, when they take turns."""

    def link_ms(self) -> dict[PeerId, float]:
        """One-way latency estimates: half the smoothed round trip."""
        return {peer: rtt / 2 for peer, rtt in self.rtt_ms.items()}

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        # A prober keeps one stream to each peer; 2 lets it replace one whose end we have
        # not seen yet (an echo stream otherwise lives an hour).
        self.host.set_stream_handler(PROTOCOL, _echo, max_frame_size=64, max_streams_per_peer=2)
        task_status.started()
        while True:
            targets = [p for p in self.targets() if p != self.host.peer_id]
            now = trio.current_time()
            batch = self.this_round([p for p in targets if self.due(p, now)])
            # A small swarm keeps a stream to every target (pinged in turns now); past
            # ``max_per_round`` only those pinged this round, as before.
            forgotten = self._forget_all_but(set(targets), set(targets if len(targets) <= self.max_per_round else batch))
            async with trio.open_nursery() as nursery:
                for stream in forgotten:
                    nursery.start_soon(stream.reset)
                for peer in batch:
                    nursery.start_soon(self.measure, peer)
            await sleep_to_tick(self.interval)

    def due(self, peer: PeerId, now: float) -> bool:
        """Whether ``peer`` is pinged this round: never measured, its last ping failed, or
        its measure is ``refresh`` old (half a round early, so it falls on the round)."""
        at = self._measured_at.get(peer)
        return at is None or self.rtt_ms.get(peer, UNREACHABLE_MS) >= UNREACHABLE_MS or now - at >= self.refresh - self.interval / 2

    def this_round(self, targets: list[PeerId]) -> list[PeerId]:
        """The targets to ping now: all of them, or past ``max_per_round`` the next that many
        in turn (wrapping round)."""
        if len(targets) <= self.max_per_round:
            return targets
        start = self._next % len(targets)
        self._next = start + self.max_per_round
        return [targets[(start + i) % len(targets)] for i in range(self.max_per_round)]

    def _forget_all_but(self, targets: set[PeerId], measured: set[PeerId]) -> list[FramedStream]:
        """Peers leave (and strangers come and go): keep round trips only for current
        targets, and streams only to those ``measured`` now (at most ``max_per_round``).
        Returns the streams let go, for the caller to reset: left open, each would hold one
        of the other end's 2 ping slots for its echo's hour, and a target that left and came
        back twice had every later stream refused (its pings and the failover probe's failed
        as if it were gone)."""
        self.rtt_ms = {p: ms for p, ms in self.rtt_ms.items() if p in targets}
        self._measured_at = {p: at for p, at in self._measured_at.items() if p in targets}
        return [self._streams.pop(peer) for peer in [p for p in self._streams if p not in measured]]

    async def measure(self, peer: PeerId) -> float:
        """Ping ``peer`` once; returns the round trip in ms and folds it into the average."""
        stream = self._streams.get(peer)
        try:
            if stream is None or stream.is_broken:
                stream = self._streams[peer] = await self.host.new_stream(peer, PROTOCOL, timeout=self.timeout, max_frame_size=64)
            started = time.perf_counter()
            await stream.send(b"ping", timeout=self.timeout)
            await stream.receive(timeout=self.timeout)
            rtt = (time.perf_counter() - started) * 1000
        except P2PError as exc:
            log.debug("ping %s failed: %s", peer, exc)
            self._streams.pop(peer, None)
            rtt = UNREACHABLE_MS
        self._measured_at[peer] = trio.current_time()
        previous = self.rtt_ms.get(peer)
        self.rtt_ms[peer] = rtt if previous is None or rtt == UNREACHABLE_MS else (1 - _ALPHA) * previous + _ALPHA * rtt
        return rtt


    async def responds(self, peer: PeerId) -> bool:
        """Whether ``peer`` answers one ping now, on a fresh stream (a failover probe must not
        share the measuring stream, nor wait behind it)."""
        try:
            stream = await self.host.new_stream(peer, PROTOCOL, timeout=self.timeout, max_frame_size=64)
            try:
                await stream.send(b"probe", timeout=self.timeout)
                await stream.receive(timeout=self.timeout)
            finally:
                await stream.close()
        except P2PError:
            return False
        return True


def usable_link_ms(link_ms: Mapping[PeerId, float], is_connected: Callable[[PeerId], bool]) -> dict[PeerId, float]:
    """Link costs for routing: a missed ping (the ``UNREACHABLE_MS`` penalty) from a peer we
    still hold a live connection to counts as an unknown link, not as a second's delay. Under
    load a starved event loop misses pings of healthy peers, and the penalty used to decide
    alone where sessions go: eight sessions failing over at once all went to the one replica
    whose last ping happened to succeed. A peer that is really stalled is caught by the step
    deadline; one that is gone, by its lost connection and its record.

    Unknown is the slowest link measured, not a guess: at the default's 5 ms, a peer that
    stays connected and answers no ping looked nearer than honest peers 40 ms away and drew
    every route (an audit, 2026-12-07)."""
    penalty = UNREACHABLE_MS / 2  # link_ms is half the round trip
    unknown = max((ms for ms in link_ms.values() if ms < penalty), default=DEFAULT_LINK_MS)
    return {peer: unknown if ms >= penalty and is_connected(peer) else ms for peer, ms in link_ms.items()}


async def _echo(stream: FramedStream, remote: PeerId) -> None:
    while True:
        await stream.send(await stream.receive(timeout=3600.0), timeout=5.0)
