"""Strangers attack the direct data plane's TCP port (``p2p.direct``).

Anyone can reach the port; only a peer that got a ticket over its Noise-authenticated
libp2p connection may use it, once, soon, as itself. Everything else is closed at once (or
after the short hello deadline), counted, and never reaches a handler."""

from __future__ import annotations

import os
import struct
import time
from typing import cast

import pytest
import trio
from direct_helpers import ECHO, direct_pair

from inclavate.types import PeerId
from p2p.direct import MAGIC, PROTOCOL, TICKET_BYTES, DirectLimits, DirectLinks, Grant, LinkTable
from p2p.errors import DialError, LinkLimitReached, P2PError
from p2p.framing import FramedStream
from p2p.host import P2PHost
from p2p.sealed import SealedStream

FAST = DirectLimits(hello_timeout_s=0.5, max_unauthenticated=3, tickets_per_peer=2, ticket_ttl_s=5.0)


async def _closed_within(tcp: trio.SocketStream, seconds: float) -> bool:
    """Whether the other side closes ``tcp`` (EOF or reset) within ``seconds``."""
    with trio.move_on_after(seconds):
        try:
            while await tcp.receive_some(4096):
                pass
        except trio.BrokenResourceError:
            pass
        return True
    return False


async def _grant(asker: P2PHost, target: PeerId, protocol: str = ECHO) -> Grant:
    async with await asker.new_stream(target, PROTOCOL) as control:
        await control.send(protocol.encode(), timeout=5)
        return Grant.decode(await control.receive(timeout=5))


@pytest.mark.parametrize("hello", [b"", b"GET / HTTP/1.1\r\n\r\n" + b"x" * 40, MAGIC + os.urandom(TICKET_BYTES),
                                   b"INCLDP02" + os.urandom(TICKET_BYTES)])  # fmt: skip
async def test_a_connection_without_a_live_ticket_is_closed_fast(hello: bytes) -> None:
    with trio.fail_after(30):
        async with direct_pair(FAST) as (_, b, _, links_b):
            tcp = await trio.open_tcp_stream("127.0.0.1", links_b.port)
            await tcp.send_all(hello)
            started = trio.current_time()
            assert await _closed_within(tcp, 5)
            # silence waits out the hello deadline; anything else is refused on arrival
            assert trio.current_time() - started < (FAST.hello_timeout_s + 0.5 if not hello else 0.4)
            assert links_b.refused == 1
            await tcp.aclose()


async def test_a_ticket_works_once_and_only_for_its_holder_s_key() -> None:
    with trio.fail_after(30):
        async with direct_pair(FAST) as (a, b, _, links_b):
            grant = await _grant(a, b.peer_id)
            tcp = await trio.open_tcp_stream("127.0.0.1", grant.port)
            await tcp.send_all(MAGIC + grant.ticket)
            stream = SealedStream(FramedStream.over_trio(tcp), grant.key, dialer=True, remote_peer=b.peer_id, transport=tcp)
            assert await stream.receive(timeout=5) == b""
            again = await trio.open_tcp_stream("127.0.0.1", grant.port)
            await again.send_all(MAGIC + grant.ticket)  # the same ticket a second time
            assert await _closed_within(again, 1)
            await again.aclose()
            await stream.send(b"hi", timeout=5)
            assert await stream.receive(timeout=5) == a.peer_id.encode() + b":hi"
            await stream.close()


async def test_a_stolen_ticket_without_the_key_reaches_no_handler() -> None:
    """Someone who saw the ticket go by on the wire (it is sent in clear) still lacks the key:
    its first frame fails authentication and the connection is reset."""
    with trio.fail_after(30):
        async with direct_pair(FAST) as (a, b, _, _):
            grant = await _grant(a, b.peer_id)
            tcp = await trio.open_tcp_stream("127.0.0.1", grant.port)
            await tcp.send_all(MAGIC + grant.ticket)
            forged = SealedStream(FramedStream.over_trio(tcp), os.urandom(32), dialer=True, remote_peer=b.peer_id, transport=tcp)
            await forged.send(b"hidden states", timeout=5)
            raw = b""
            with trio.move_on_after(3):
                try:
                    while chunk := await tcp.receive_some(4096):
                        raw += chunk
                except trio.BrokenResourceError:
                    pass
            assert a.peer_id.encode() not in raw  # the echo handler never answered
            await tcp.aclose()


async def test_expired_tickets_and_excess_tickets_are_refused() -> None:
    now = [0.0]
    limits = FAST
    async with direct_pair(limits) as (a, b, _, links_b):
        links_b._clock = lambda: now[0]
        grants = [await _grant(a, b.peer_id) for _ in range(3)]  # 2 per peer: the first is dropped
        now[0] = 1.0
        for grant, usable in ((grants[0], False), (grants[1], True)):
            tcp = await trio.open_tcp_stream("127.0.0.1", grant.port)
            await tcp.send_all(MAGIC + grant.ticket)
            stream = SealedStream(FramedStream.over_trio(tcp), grant.key, dialer=True, remote_peer=b.peer_id, transport=tcp)
            if usable:
                assert await stream.receive(timeout=5) == b""
            else:
                assert await _closed_within(tcp, 1)
            await stream.reset()
        now[0] = 1.0 + limits.ticket_ttl_s
        tcp = await trio.open_tcp_stream("127.0.0.1", grants[2].port)
        await tcp.send_all(MAGIC + grants[2].ticket)  # expired by now
        assert await _closed_within(tcp, 1)
        await tcp.aclose()


async def test_a_flood_of_silent_connections_is_bounded() -> None:
    with trio.fail_after(30):
        async with direct_pair(FAST) as (a, b, links_a, links_b):
            silent = []
            for _ in range(FAST.max_unauthenticated):
                silent.append(await trio.open_tcp_stream("127.0.0.1", links_b.port))
                while len(links_b._pending) < len(silent):  # accepted, in this order
                    await trio.sleep(0.01)
            extra = await trio.open_tcp_stream("127.0.0.1", links_b.port)
            assert await _closed_within(silent[0], 1)  # over the bound: the oldest waiting one goes
            assert len(links_b._pending) == FAST.max_unauthenticated
            for tcp in (*silent[1:], extra):
                assert await _closed_within(tcp, FAST.hello_timeout_s + 1)
            # and an honest peer still gets through afterwards
            stream = await links_a.open(b.peer_id, ECHO, timeout=5)
            await stream.send(b"ok", timeout=5)
            assert await stream.receive(timeout=5) == a.peer_id.encode() + b":ok"
            await stream.close()
            for tcp in (*silent, extra):
                await tcp.aclose()


def test_a_full_waiting_table_evicts_the_oldest_of_the_source_holding_most() -> None:
    """One address flooding pushes out only its own connections; among equals, the oldest."""
    links = DirectLinks(cast(P2PHost, None), limits=FAST)
    first, flood_old, flood_new = trio.CancelScope(), trio.CancelScope(), trio.CancelScope()
    links._pending = {first: "192.0.2.1", flood_old: "192.0.2.66", flood_new: "192.0.2.66"}
    links._evict_pending()
    assert flood_old.cancel_called and list(links._pending) == [first, flood_new]
    links._evict_pending()
    assert first.cancel_called and list(links._pending) == [flood_new]


async def _hold_silent(port: int) -> None:
    """One stranger's place in a flood: a TCP connection that never says hello, reopened as
    soon as the acceptor closes it."""
    while True:
        try:
            tcp = await trio.open_tcp_stream("127.0.0.1", port)
        except OSError:
            await trio.sleep(0.01)
            continue
        try:
            await _closed_within(tcp, 60)
        finally:
            await trio.aclose_forcefully(tcp)


async def test_honest_dials_get_through_a_held_flood_of_silent_connections() -> None:
    """A stranger keeps more silent connections open than may wait for a ticket, reopening
    each one the acceptor closes (the default limits, as an attacker would meet them). An
    honest dial still gets through: a newcomer pushes out the oldest waiting connection, so
    only someone opening connections faster than an honest hello completes could starve it."""
    limits = DirectLimits()
    with trio.fail_after(45):
        async with direct_pair(limits) as (a, b, links_a, links_b), trio.open_nursery() as flood:
            for _ in range(limits.max_unauthenticated + 8):
                flood.start_soon(_hold_silent, links_b.port)
            while links_b.refused < 8:  # the waiting places are full and the flood keeps them so
                await trio.sleep(0.05)
            for _ in range(5):
                stream = await links_a.open(b.peer_id, ECHO, timeout=5)
                await stream.send(b"through", timeout=5)
                assert await stream.receive(timeout=5) == a.peer_id.encode() + b":through"
                await stream.close()
            assert len(links_b._pending) <= limits.max_unauthenticated  # and the flood is still bounded
            flood.cancel_scope.cancel()


async def test_live_links_per_peer_are_bounded() -> None:
    with trio.fail_after(30):
        async with direct_pair(DirectLimits(links_per_peer=1)) as (a, b, links_a, links_b):
            first = await links_a.open(b.peer_id, ECHO, timeout=5)
            with pytest.raises(DialError):
                await links_a.open(b.peer_id, ECHO, timeout=5)
            assert links_b.refused == 1
            await first.send(b"still", timeout=5)
            assert await first.receive(timeout=5) == a.peer_id.encode() + b":still"
            await first.close()


SMALL = "/test/small/1"


@pytest.mark.parametrize(("attack", "refused_with"), [
    (struct.pack(">I", 4000) + os.urandom(4000), "FrameTooLarge"),  # over the limit, brought whole by one read
    (struct.pack(">I", 2**32 - 1) + os.urandom(10), "FrameTooLarge"),  # a 4 GiB length with nothing behind it
    (struct.pack(">I", 100) + os.urandom(100), "ProtocolError"),  # the right size, not sealed with the key
    (struct.pack(">I", 100) + os.urandom(40), "ProtocolError"),  # a frame cut short, then the end
])  # fmt: skip
async def test_a_ticket_holder_s_hostile_frames_end_only_its_own_link(attack: bytes, refused_with: str) -> None:
    """A peer that got a ticket (so it passed the hello) writes raw bytes: a frame's length is
    checked before anything is allocated for it, a frame that fails authentication resets the
    link, and the acceptor goes on serving everyone else."""
    with trio.fail_after(30):
        async with direct_pair(FAST) as (a, b, links_a, links_b):
            ended: list[str] = []

            async def small(stream: SealedStream, remote: PeerId) -> None:
                stream.max_frame_size = 1024
                try:
                    while True:
                        await stream.receive(timeout=30)
                except BaseException as exc:
                    ended.append(type(exc).__name__)
                    raise

            links_b.set_handler(SMALL, small)
            grant = await _grant(a, b.peer_id, SMALL)
            tcp = await trio.open_tcp_stream("127.0.0.1", grant.port)
            await tcp.send_all(MAGIC + grant.ticket + attack)
            if attack.startswith(struct.pack(">I", 100)) and len(attack) < 104:
                await tcp.send_eof()
            assert await _closed_within(tcp, 2)
            await tcp.aclose()
            while not ended:  # the handler hears of it just after the socket is reset
                await trio.sleep(0.01)
            assert ended == [refused_with]
            stream = await links_a.open(b.peer_id, ECHO, timeout=5)  # the acceptor still serves
            await stream.send(b"ok", timeout=5)
            assert await stream.receive(timeout=5) == a.peer_id.encode() + b":ok"
            await stream.close()


class _Asking:
    """A ticket request as the grant handler reads it off a Noise-authenticated libp2p stream.
    A stranger's identity costs nothing, so these tests name strangers instead of keying a
    host for each: the grant handler only ever sees the PeerID."""

    def __init__(self, protocol: str = ECHO) -> None:
        self._request = protocol.encode()
        self.answer = b""

    async def receive(self, timeout: float) -> bytes:
        return self._request

    async def send(self, data: bytes, timeout: float) -> None:
        self.answer = data


async def _stranger_grant(links: DirectLinks, who: str, protocol: str = ECHO) -> Grant:
    asking = _Asking(protocol)
    await links._grant(cast(FramedStream, asking), PeerId(who))
    return Grant.decode(asking.answer)


async def _stranger_link(links: DirectLinks, who: str, protocol: str = ECHO) -> SealedStream:
    """A live direct link held by the stranger ``who`` (the acceptor has proved its key)."""
    grant = await _stranger_grant(links, who, protocol)
    tcp = await trio.open_tcp_stream("127.0.0.1", grant.port)
    await tcp.send_all(MAGIC + grant.ticket)
    stream = SealedStream(FramedStream.over_trio(tcp), grant.key, dialer=True, remote_peer=PeerId("acceptor"), transport=tcp)
    assert await stream.receive(timeout=5) == b""
    return stream


async def _echoes(stream: SealedStream, who: bytes) -> bool:
    try:
        await stream.send(b"alive", timeout=5)
        return await stream.receive(timeout=5) == who + b":alive"
    except P2PError:
        return False


TABLES = DirectLimits(tickets_per_peer=2, max_tickets=6, links_per_peer=2, max_links=4)


async def test_strangers_holding_every_ticket_do_not_lock_an_honest_dial_out() -> None:
    """Free identities re-asking for tickets keep the table full; the honest dialer's request
    drops the oldest ticket of one of them instead of being refused."""
    with trio.fail_after(30):
        async with direct_pair(TABLES) as (a, b, links_a, links_b):
            for i in range(TABLES.max_tickets):
                await _stranger_grant(links_b, f"stranger-{i % 3}")
            assert len(links_b._tickets) == TABLES.max_tickets
            stream = await links_a.open(b.peer_id, ECHO, timeout=5)
            assert await _echoes(stream, a.peer_id.encode())
            await stream.close()
            assert links_b.tickets_evicted == 1 and len(links_b._tickets) == TABLES.max_tickets - 1  # the honest one is used


async def test_a_full_ticket_table_drops_the_oldest_of_the_peer_holding_most() -> None:
    """The honest peer's one ticket is the oldest in the table, yet a newcomer drops the oldest
    ticket of the stranger holding two, and the honest ticket still opens a link."""
    with trio.fail_after(30):
        async with direct_pair(TABLES) as (a, b, _, links_b):
            honest = await _grant(a, b.peer_id)
            greedy = [await _stranger_grant(links_b, "greedy") for _ in range(2)]
            for i in range(TABLES.max_tickets - 3):
                await _stranger_grant(links_b, f"stranger-{i}")
            await _stranger_grant(links_b, "newcomer")
            assert greedy[0].ticket not in links_b._tickets and greedy[1].ticket in links_b._tickets
            assert honest.ticket in links_b._tickets and links_b.tickets_evicted == 1
            tcp = await trio.open_tcp_stream("127.0.0.1", honest.port)
            await tcp.send_all(MAGIC + honest.ticket)
            stream = SealedStream(FramedStream.over_trio(tcp), honest.key, dialer=True, remote_peer=b.peer_id, transport=tcp)
            assert await stream.receive(timeout=5) == b""
            assert await _echoes(stream, a.peer_id.encode())
            await stream.close()


async def test_strangers_holding_every_link_do_not_lock_an_honest_dial_out() -> None:
    """Free identities each keeping their quota of links open fill the acceptor; the honest
    dial closes the oldest link of one of them, whose far end sees it end."""
    with trio.fail_after(30):
        async with direct_pair(TABLES) as (a, b, links_a, links_b):
            held = [await _stranger_link(links_b, f"stranger-{i // 2}") for i in range(TABLES.max_links)]
            stream = await links_a.open(b.peer_id, ECHO, timeout=5)
            assert await _echoes(stream, a.peer_id.encode())
            assert not await _echoes(held[0], b"stranger-0")  # closed to make room
            assert all([await _echoes(s, f"stranger-{i // 2}".encode()) for i, s in enumerate(held) if i])
            assert len(links_b._links) == TABLES.max_links and links_b.links_evicted == 1
            await stream.close()
            for s in held:
                await s.reset()


async def test_a_full_link_table_closes_the_oldest_of_the_peer_holding_most() -> None:
    """The honest peer's one link is the oldest, yet a newcomer closes the oldest link of the
    stranger holding two; the closed link's handler ends and its place is given back."""
    with trio.fail_after(30):
        async with direct_pair(TABLES) as (a, b, links_a, links_b):
            honest = await links_a.open(b.peer_id, ECHO, timeout=5)
            greedy = [await _stranger_link(links_b, "greedy") for _ in range(2)]
            other = await _stranger_link(links_b, "other")
            newcomer = await _stranger_link(links_b, "newcomer")
            assert not await _echoes(greedy[0], b"greedy")
            for stream, who in ((honest, a.peer_id.encode()), (greedy[1], b"greedy"), (other, b"other"),
                                (newcomer, b"newcomer")):  # fmt: skip
                assert await _echoes(stream, who)
            assert sorted(links_b._links.values()) == sorted([a.peer_id, "greedy", "other", "newcomer"])
            for stream in (honest, *greedy, other, newcomer):
                await stream.reset()
            while links_b._links:  # every handler ends and gives its place back
                await trio.sleep(0.01)


OWN = "/test/own-table/1"


async def test_a_protocol_with_its_own_link_table_never_refuses_or_pushes_out_the_others() -> None:
    """Artifact links (``p2p.artifacts``) have a table of their own: a peer holding its quota
    of forward links still gets one, and strangers filling that table push out only its
    links, never a forward link, which the shared table's bounds alone govern."""
    with trio.fail_after(30):
        async with direct_pair(DirectLimits(links_per_peer=1, max_links=2)) as (a, b, links_a, links_b):

            async def echo(stream: SealedStream, remote: PeerId) -> None:
                while True:
                    await stream.send(remote.encode() + b":" + await stream.receive(timeout=30), timeout=5)

            links_b.set_handler(OWN, echo, LinkTable(links_per_peer=1, max_links=2))
            forward = await links_a.open(b.peer_id, ECHO, timeout=5)  # a's one link in the shared table
            own = await links_a.open(b.peer_id, OWN, timeout=5)  # not refused: its own table
            assert await _echoes(own, a.peer_id.encode())
            strangers = [await _stranger_link(links_b, f"stranger-{i}", OWN) for i in range(3)]
            assert not await _echoes(own, a.peer_id.encode())  # pushed out of its own table
            assert await _echoes(forward, a.peer_id.encode())  # the forward link never is
            assert list(links_b._links.values()) == [a.peer_id] and links_b.links_evicted == 2
            assert len(links_b._tables[OWN][1]) == 2
            with pytest.raises(DialError):  # the shared table's per-peer bound is unchanged
                await links_a.open(b.peer_id, ECHO, timeout=5)
            for stream in (forward, own, *strangers):
                await stream.reset()


IDLE = "/test/idle/1"


async def test_a_peer_at_its_bound_replaces_only_its_own_idle_link() -> None:
    """A peer holding its ``links_per_peer`` links of a protocol dials again (its old links
    ended on its side, not yet here): its own oldest idle link is closed for the new one, so
    it never holds more than its bound, and another peer's idle link, older still, is never
    touched. With none of its own idle, the dial is refused with ``limit`` and remembered
    for ``limit_retry_s``, not the ``retry_after_s`` of a peer without the handler."""
    limits = DirectLimits(links_per_peer=2, max_links=8)
    with trio.fail_after(30):
        async with direct_pair(limits) as (a, b, links_a, links_b):

            async def echo_when_idle(stream: SealedStream, remote: PeerId) -> None:
                while True:
                    with links_b.idle(stream):
                        payload = await stream.receive(timeout=30)
                    if payload == b"hold":  # busy answering from now on
                        await trio.sleep_forever()
                    await stream.send(remote.encode() + b":" + payload, timeout=5)

            links_b.set_handler(IDLE, echo_when_idle, LinkTable(links_per_peer=2, max_links=8))
            mine = a.peer_id.encode()
            other = await _stranger_link(links_b, "other", IDLE)
            first, second = [await links_a.open(b.peer_id, IDLE, timeout=5) for _ in range(2)]
            third = await links_a.open(b.peer_id, IDLE, timeout=5)
            assert not await _echoes(first, mine)  # its own oldest idle link made room
            assert await _echoes(second, mine) and await _echoes(third, mine) and await _echoes(other, b"other")
            assert sorted(links_b._tables[IDLE][1].values()) == sorted([a.peer_id, a.peer_id, "other"])
            assert links_b.links_replaced == 1 and links_b.refused == 0
            for stream in (second, third):
                await stream.send(b"hold", timeout=5)
            while len(links_b._idle) > 1:  # only the stranger's link is idle now
                await trio.sleep(0.01)
            with pytest.raises(LinkLimitReached):
                await links_a.open(b.peer_id, IDLE, timeout=5)
            assert links_a._failed_until[b.peer_id, IDLE] - time.monotonic() <= limits.limit_retry_s < limits.retry_after_s
            assert links_b.refused == 1 and links_b.links_replaced == 1 and await _echoes(other, b"other")
            assert sorted(links_b._tables[IDLE][1].values()) == sorted([a.peer_id, a.peer_id, "other"])
            for stream in (first, second, third, other):
                await stream.reset()


@pytest.mark.parametrize("announced", [100_000_000, 64])
async def test_a_hostile_acceptor_s_first_frame_is_refused_on_its_length_prefix(announced: int) -> None:
    """The acceptor's first frame proves it holds the key, and is empty. A hostile acceptor
    (a peer we dialed, as any next hop is) announced a frame of up to 256 MiB there, and the
    dialer took it in for as long as the dial's deadline: now any frame but an empty one is
    refused on its length prefix, and the dial fails at once."""
    async with direct_pair() as (a, b, links_a, _):
        async with trio.open_nursery() as n:
            listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
            port = listeners[0].socket.getsockname()[1]

            async def hostile(tcp: trio.SocketStream) -> None:
                await tcp.receive_some(len(MAGIC) + TICKET_BYTES)
                await tcp.send_all(struct.pack(">I", announced) + b"x" * 16)
                await trio.sleep_forever()  # the rest never comes

            async def grant(control: FramedStream, remote: PeerId) -> None:
                await control.receive(timeout=5)
                await control.send(Grant(port, os.urandom(TICKET_BYTES), os.urandom(32)).encode(), timeout=5)

            await n.start(trio.serve_listeners, hostile, listeners)
            b.set_stream_handler(PROTOCOL, grant)
            with trio.fail_after(5):  # the dial's own deadline is 20 s
                with pytest.raises(DialError, match="larger than|exceeds|too large"):
                    await links_a.open(b.peer_id, ECHO, timeout=20)
            n.cancel_scope.cancel()
