"""A stranger's libp2p streams against a real Host on 127.0.0.1: how many it may hold open,
what memory they pin, and whether an honest peer is still served meanwhile.

The stranger is a real libp2p host (``hostile_peer``) whose muxer's own 256-stream backlog
is lifted: that limit is the *opener's*, and a stranger's implementation need not keep it.
Before the caps (2026-12-05) one stranger held every stream it opened (10,000 idle ping
streams on one connection, each for the echo's hour), and at the library's shared limit
of 10,000 no other peer's stream, nor any stream the victim opened, was served."""

from __future__ import annotations

import logging
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
from hostile_peer import HostilePeer, hostile_peer
from libp2p.abc import INetConn
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID
from libp2p.stream_muxer.yamux.yamux import TYPE_DATA, YAMUX_HEADER_FORMAT

from inclavate.types import PeerId
from p2p.framing import FramedStream
from p2p.host import P2PHost, open_host
from p2p.identity import Identity
from p2p.latency import PROTOCOL as PING
from p2p.latency import LatencyMonitor
from p2p.stream_quota import PEER_STREAMS, Refusal

KiB = 1024
OWN_STREAMS = 4
"""Streams the victim itself may have open to the stranger."""


@asynccontextmanager
async def victim_with_ping() -> AsyncIterator[P2PHost]:
    """A host serving ``/inclavate/ping/1`` the way a peer does (its latency monitor)."""
    async with open_host(Identity.generate()) as victim, trio.open_nursery() as nursery:
        await nursery.start(LatencyMonitor(victim, lambda: []).run)
        yield victim
        nursery.cancel_scope.cancel()


def connection(host: P2PHost, peer: PeerId) -> INetConn:
    (conn,) = host.libp2p_host.get_network().connections[ID.from_base58(peer)]
    return conn


def live_streams(victim: P2PHost, peer: PeerId) -> int:
    conns = victim.libp2p_host.get_network().connections.get(ID.from_base58(peer), [])
    return sum(len(c.streams) for c in conns)


def lift_backlog(evil: HostilePeer) -> None:
    """Let the stranger open as many streams as it likes on its one connection."""
    connection(evil.host, evil.target).muxed_conn.stream_backlog_semaphore = trio.Semaphore(10**6)  # type: ignore[attr-defined]


async def open_idle(evil: HostilePeer, protocol: str, n: int) -> int:
    """Open up to ``n`` streams on ``protocol`` and send nothing; returns how many opened
    (negotiation of a refused stream may fail: the victim resets it)."""
    opened = 0
    for _ in range(n):
        try:
            await evil.host.libp2p_host.new_stream(ID.from_base58(evil.target), [TProtocol(protocol)])
            opened += 1
        except Exception:  # noqa: BLE001 - a refused stream fails in the library's zoo of ways
            pass
    return opened


async def open_unnegotiated(evil: HostilePeer, n: int) -> None:
    """Open ``n`` raw yamux streams that never say which protocol they want."""
    lift_backlog(evil)
    muxer = connection(evil.host, evil.target).muxed_conn
    for _ in range(n):
        await muxer.open_stream()
    await trio.sleep(0.5)


async def settle(victim: P2PHost, peer: PeerId, at_most: int) -> None:
    with trio.move_on_after(3):
        while live_streams(victim, peer) > at_most:
            await trio.sleep(0.05)


async def ping(host: P2PHost, peer: PeerId) -> None:
    stream = await host.new_stream(peer, PING, timeout=3, max_frame_size=64)
    async with stream:
        await stream.send(b"ping", timeout=3)
        assert await stream.receive(timeout=3) == b"ping"


async def test_a_stranger_holds_at_most_its_cap_of_idle_ping_streams() -> None:
    # Before: all 300 lived (an echo waits an hour for its next ping).
    with trio.fail_after(60):
        async with victim_with_ping() as victim:
            async with hostile_peer(victim.multiaddrs()[0], gossip=False) as evil:
                lift_backlog(evil)
                await open_idle(evil, PING, 300)
                await settle(victim, evil.peer_id, 2 + 2)  # its ping cap, plus its sync and peer exchange answers
                assert live_streams(victim, evil.peer_id) <= 4
                assert victim.inbound.protocols.held((ID.from_base58(evil.peer_id), PING)) == 2
                assert victim.inbound.refused.total() >= 298
            # The stranger left: nothing of it stays counted.
            with trio.fail_after(5):
                while len(victim.inbound.peers) or len(victim.inbound.protocols):
                    await trio.sleep(0.05)


async def test_streams_that_never_negotiate_count_against_the_peer() -> None:
    # Raw yamux streams that never say which protocol they want: each used to hold a handler
    # task and a slot of the library's shared stream limit for the 10 s negotiation timeout.
    with trio.fail_after(60):
        async with victim_with_ping() as victim:
            async with hostile_peer(victim.multiaddrs()[0], gossip=False) as evil:
                await open_unnegotiated(evil, 300)
                await settle(victim, evil.peer_id, PEER_STREAMS + OWN_STREAMS)
                # Its streams, plus the few the victim opened to it (pubsub, identify).
                assert live_streams(victim, evil.peer_id) <= PEER_STREAMS + OWN_STREAMS


async def test_an_honest_peer_is_served_while_a_stranger_holds_its_cap() -> None:
    # The library's one stream limit (10,000, inbound and outbound together) is shrunk to
    # 300 so that the test fills it in seconds; before, the stranger's 300 idle streams
    # took all of it and the honest ping waited past its deadline.
    with trio.fail_after(60):
        async with victim_with_ping() as victim, victim_with_ping() as honest:
            victim.libp2p_host.get_network()._stream_semaphore = trio.Semaphore(300)  # type: ignore[attr-defined]
            await honest.connect(victim.multiaddrs()[0])
            async with hostile_peer(victim.multiaddrs()[0], gossip=False) as evil:
                lift_backlog(evil)
                with trio.move_on_after(20):
                    await open_idle(evil, PING, 300)
                    await open_unnegotiated(evil, 300)
                for _ in range(3):
                    with trio.fail_after(5):
                        await ping(honest, victim.peer_id)
                # The victim can still open streams of its own.
                with trio.fail_after(5):
                    await ping(victim, honest.peer_id)


async def _answer_slowly(stream: FramedStream, remote: PeerId) -> None:
    """A handler busy after reading its request (answering an asker who does not read)."""
    await stream.receive(timeout=5)
    await trio.sleep(30)


async def test_a_sender_past_its_yamux_window_does_not_grow_the_receive_buffer(
        caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    # py-libp2p buffered whatever arrived past the window (it only logged a warning):
    # measured 125 MiB held for one stream after 2,000 frames of 64 KiB.
    caplog.set_level(logging.ERROR)
    with trio.fail_after(60):
        async with open_host(Identity.generate()) as victim:
            victim.set_stream_handler("/test/slow/1", _answer_slowly)
            async with hostile_peer(victim.multiaddrs()[0], gossip=False) as evil:
                stream = await evil.host.libp2p_host.new_stream(ID.from_base58(evil.target), [TProtocol("/test/slow/1")])
                await stream.write(struct.pack(">I", 1) + b"r")
                muxer = connection(evil.host, evil.target).muxed_conn
                chunk = b"q" * (64 * KiB)
                stream_id = stream.muxed_stream.stream_id  # type: ignore[attr-defined]
                for _ in range(128):  # 8 MiB, ignoring the 256 KiB window
                    header = struct.pack(YAMUX_HEADER_FORMAT, 0, TYPE_DATA, 0, stream_id, len(chunk))
                    await muxer._write_frame(header + chunk)  # type: ignore[attr-defined]
                await trio.sleep(0.5)
                buffers = connection(victim, evil.peer_id).muxed_conn.stream_buffers  # type: ignore[attr-defined]
                assert sum(map(len, buffers.values())) <= 256 * KiB
    # The library logs each refused frame at error level: a stranger must not fill the log.
    assert "past a window" not in caplog.text


async def test_a_peer_leaving_the_probe_targets_and_coming_back_leaves_no_stream_behind() -> None:
    # Route candidates come and go; a stream forgotten with its target used to stay open at
    # the other end (its echo waits an hour), so two such round trips locked pings out.
    with trio.fail_after(60):
        async with victim_with_ping() as target, open_host(Identity.generate()) as prober:
            await prober.connect(target.multiaddrs()[0])
            targets: list[PeerId] = []
            monitor = LatencyMonitor(prober, lambda: list(targets), interval=0.05)
            async with trio.open_nursery() as nursery:
                await nursery.start(monitor.run)
                for _ in range(4):
                    targets[:] = [target.peer_id]
                    while target.peer_id not in monitor.rtt_ms:
                        await trio.sleep(0.02)
                    targets[:] = []
                    while target.peer_id in monitor.rtt_ms:
                        await trio.sleep(0.02)
                await trio.sleep(0.3)
                assert target.inbound.protocols.held((ID.from_base58(prober.peer_id), PING)) == 0
                # The failover probe opens a stream of its own: it was reset on arrival.
                assert await monitor.responds(target.peer_id)
                nursery.cancel_scope.cancel()


async def test_strangers_filling_the_total_leave_an_honest_peer_its_first_streams() -> None:
    # The total cap is shrunk to 16 so that one stranger fills it; before, once it was full
    # every other peer's new stream was refused (64 free identities fill the real 4,096).
    with trio.fail_after(60):
        async with victim_with_ping() as victim, victim_with_ping() as honest:
            victim.inbound.total.cap = 16
            async with hostile_peer(victim.multiaddrs()[0], gossip=False) as evil:
                await open_unnegotiated(evil, 64)
                assert victim.inbound.refused[Refusal.TOTAL] > 0  # full: the stranger's are refused
                await honest.connect(victim.multiaddrs()[0])
                for _ in range(3):
                    with trio.fail_after(5):
                        await ping(honest, victim.peer_id)
