"""Discovery: backoff arithmetic, the peer-list wire format, and a real 5-peer bootstrap."""

from __future__ import annotations

import random
from contextlib import AsyncExitStack

import pytest
import trio

from inclavate.errors import ConfigError
from inclavate.types import PeerId
from p2p.discovery import (
    Backoff,
    DiscoveryConfig,
    ExchangeSchedule,
    PeerAddrs,
    decode_peers,
    encode_peers,
    exchange_peers,
    run_discovery,
)
from p2p.errors import ProtocolError
from p2p.host import ConnectionEvent, P2PHost, open_host
from p2p.identity import Identity

FAST = DiscoveryConfig(target_degree=4, min_delay=0.05, max_delay=0.5, check_interval=0.1,
                       exchange_interval=0.3)


def test_backoff_grows_exponentially_is_capped_and_jittered() -> None:
    config = DiscoveryConfig(min_delay=1.0, max_delay=8.0, jitter=0.25)
    backoff = Backoff(config, random.Random(7))
    delays = []
    for _ in range(8):
        backoff.failed(now=100.0)
        delays.append(backoff.next_attempt - 100.0)
    nominal = [1, 2, 4, 8, 8, 8, 8, 8]
    for delay, base in zip(delays, nominal, strict=True):
        assert base * 0.75 <= delay <= base * 1.25
    assert len({round(d, 6) for d in delays[3:]}) > 1, "jitter must desynchronise retries"
    assert not backoff.due(100.0) and backoff.due(100.0 + 8 * 1.25)
    backoff.succeeded()
    assert backoff.due(100.0) and backoff.failures == 0


def test_re_asking_backs_off_while_it_teaches_nothing_and_resets_on_news() -> None:
    """A swarm smaller than the target degree stays below target: its re-asks must slow
    down (each is a stream opened and closed on both sides), not stop, and come back to
    the short period as soon as they teach something or a connection comes or goes."""
    schedule = ExchangeSchedule(DiscoveryConfig(exchange_interval=10.0, exchange_max_interval=160.0))
    now, periods = 0.0, []
    for _ in range(7):
        assert not schedule.due(now + schedule.period - 0.01) and schedule.due(now + schedule.period)
        now += schedule.period
        periods.append(schedule.period)
        schedule.asked(now)
        schedule.learned(0)
    assert periods == [10, 20, 40, 80, 160, 160, 160]
    schedule.learned(2)
    assert schedule.period == 10
    schedule.learned(0)
    schedule.connections_changed()
    assert schedule.period == 10
    with pytest.raises(ConfigError):
        DiscoveryConfig(exchange_interval=10.0, exchange_max_interval=5.0)


def test_peer_list_round_trip_and_rejects_garbage() -> None:
    peers = [PeerAddrs(PeerId("12D3KooWabc"), ("/ip4/1.2.3.4/tcp/1/p2p/12D3KooWabc",))]
    assert decode_peers(encode_peers(peers)) == peers
    for bad in [b"\xff", b"[]", b'{"peers": 3}', b'{"peers": [{"id": 1, "addrs": []}]}',
                b'{"peers": [{"id": "x", "addrs": [1]}]}']:
        with pytest.raises(ProtocolError):
            decode_peers(bad)


async def test_exchange_teaches_both_sides() -> None:
    with trio.fail_after(20):
        async with AsyncExitStack() as stack:
            a, b, c = [await stack.enter_async_context(open_host(Identity.generate()))
                       for _ in range(3)]
            nursery = await stack.enter_async_context(trio.open_nursery())
            # b serves the protocol; it is connected to c, which a does not know.
            big_target = DiscoveryConfig(target_degree=1)  # b: no dialing of its own
            await nursery.start(run_discovery, b, (), big_target)
            await b.connect(c.multiaddrs()[0])
            await a.connect(b.multiaddrs()[0])
            fresh = await exchange_peers(a, b.peer_id)
            assert [p.peer_id for p in fresh] == [c.peer_id]
            assert c.multiaddrs()[0] in a.known_addrs(c.peer_id)
            # ... and b learned a's listen address, which an inbound connection hides.
            assert a.multiaddrs()[0] in b.known_addrs(a.peer_id)
            nursery.cancel_scope.cancel()


def test_an_informant_names_only_addresses_no_nearer_than_itself() -> None:
    """Every address learnt is dialled, again and again: a stranger on the internet naming
    hosts and ports on our loopback or LAN made every honest peer a port scanner of its own
    network (an audit, 2026-12-07). A peer may name addresses as near as it is, no nearer."""
    from p2p.discovery import believable

    addrs = ("/ip4/127.0.0.1/tcp/22", "/ip4/10.0.0.1/tcp/22", "/ip4/192.168.1.1/tcp/80", "/ip6/::1/tcp/5",
             "/ip6/fe80::1/tcp/5", "/ip4/0.0.0.0/tcp/1", "/ip4/224.0.0.1/tcp/1", "/dns4/intranet.lan/tcp/80",
             "/ip4/93.184.216.34/tcp/4001", "/ip6/2606:4700::1/tcp/4001", "/ip4/::ffff:127.0.0.1/tcp/1")  # fmt: skip
    entry = PeerAddrs(PeerId("x"), addrs)
    public = ("/ip4/93.184.216.34/tcp/4001", "/ip6/2606:4700::1/tcp/4001")
    assert believable(entry, "93.184.216.1").addrs == public
    assert believable(entry, None).addrs == public  # an informant we are not connected to
    assert believable(entry, "10.0.0.7").addrs == ("/ip4/10.0.0.1/tcp/22", "/ip4/192.168.1.1/tcp/80",
                                                    "/ip6/fe80::1/tcp/5", *public)  # fmt: skip
    assert believable(entry, "127.0.0.1").addrs == ("/ip4/127.0.0.1/tcp/22", "/ip4/10.0.0.1/tcp/22",
                                                     "/ip4/192.168.1.1/tcp/80", "/ip6/::1/tcp/5", "/ip6/fe80::1/tcp/5",
                                                     *public, "/ip4/::ffff:127.0.0.1/tcp/1")  # fmt: skip


async def test_a_peer_s_addresses_are_capped_whoever_sends_them() -> None:
    """The peerstore appended every new address: one identity's exchanges left 19,000 of its
    own, walked every second, the event loop stalled for a second and a half (an audit,
    2026-12-07). The newest MAX_ADDRS_PER_PEER are kept."""
    from p2p.host import MAX_ADDRS_PER_PEER

    async with open_host(Identity.generate()) as host:
        other = Identity.generate().peer_id
        for batch in range(50):
            host.add_addrs(other, [f"/ip4/127.0.0.1/tcp/{1000 + batch * 16 + i}" for i in range(16)])
        kept = host.known_addrs(other)
        assert len(kept) == MAX_ADDRS_PER_PEER and kept[0].startswith("/ip4/127.0.0.1/tcp/1784/")


async def test_hearsay_does_not_push_a_known_peer_s_own_addresses_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer's addresses are kept at most 16, the newest first: an informant's 16 made-up ones
    for a peer we knew pushed its real ones out (a review, 2026-12-07). Hearsay teaches only
    peers we know nothing of; a peer's own word replaces."""
    with trio.fail_after(20):
        async with AsyncExitStack() as stack:
            a, b, c = [await stack.enter_async_context(open_host(Identity.generate())) for _ in range(3)]
            nursery = await stack.enter_async_context(trio.open_nursery())
            await nursery.start(run_discovery, b, (), DiscoveryConfig(target_degree=1))
            real = c.multiaddrs()[0]
            a.add_addrs(c.peer_id, [real])  # a knows c, and is not connected to it
            made_up = tuple(f"/ip4/127.0.0.1/tcp/{9000 + i}/p2p/{c.peer_id}" for i in range(16))
            await a.connect(b.multiaddrs()[0])
            from p2p import discovery

            monkeypatch.setattr(discovery, "_shared_peers", lambda host, limit, exclude: [PeerAddrs(c.peer_id, made_up)])
            await exchange_peers(a, b.peer_id)  # b lies about c
            assert real in a.known_addrs(c.peer_id)
            nursery.cancel_scope.cancel()


async def test_five_peers_bootstrapped_from_one_address_mesh_up() -> None:
    with trio.fail_after(30):
        async with AsyncExitStack() as stack:
            hosts: list[P2PHost] = [
                await stack.enter_async_context(open_host(Identity.generate()))
                for _ in range(5)
            ]
            nursery = await stack.enter_async_context(trio.open_nursery())
            bootstrap = [hosts[0].multiaddrs()[0]]
            for i, host in enumerate(hosts):
                await nursery.start(run_discovery, host, bootstrap if i else (), FAST)
            with trio.move_on_after(15):
                while min(len(h.connected_peers()) for h in hosts) < 2:
                    await trio.sleep(0.05)
            degrees = [len(h.connected_peers()) for h in hosts]
            assert min(degrees) >= 2, degrees
            # Not a star: peers other than the bootstrap node found each other.
            assert any(len(h.connected_peers()) >= 2 for h in hosts[1:])
            nursery.cancel_scope.cancel()


async def test_reconnects_after_losing_every_connection() -> None:
    with trio.fail_after(30):
        async with AsyncExitStack() as stack:
            a, b = [await stack.enter_async_context(open_host(Identity.generate()))
                    for _ in range(2)]
            events = a.connection_events()
            nursery = await stack.enter_async_context(trio.open_nursery())
            await nursery.start(run_discovery, a, [b.multiaddrs()[0]], FAST)
            with trio.fail_after(5):
                assert await events.receive() == ConnectionEvent(b.peer_id, True)
                await b.disconnect(a.peer_id)
                # Discovery re-dials at once; the disconnect itself may or may not be
                # reported before the reconnect (see ConnectionEvent).
                event = await events.receive()
                if not event.connected:
                    event = await events.receive()
                assert event == ConnectionEvent(b.peer_id, True)
            # Both ends agree the new connection is live (no half-open leftovers).
            await trio.sleep(0.3)
            assert a.connected_peers() == [b.peer_id]
            assert b.connected_peers() == [a.peer_id]
            nursery.cancel_scope.cancel()


async def test_bootstrap_to_a_dead_address_backs_off_and_does_not_crash() -> None:
    with trio.fail_after(20):
        async with AsyncExitStack() as stack:
            a = await stack.enter_async_context(open_host(Identity.generate()))
            attempts = []
            real_connect = a.connect

            async def counting_connect(addr: str) -> PeerId:
                attempts.append(trio.current_time())
                return await real_connect(addr)

            a.connect = counting_connect  # type: ignore[method-assign]
            dead = f"/ip4/127.0.0.1/tcp/1/p2p/{Identity.generate().peer_id}"
            nursery = await stack.enter_async_context(trio.open_nursery())
            await nursery.start(run_discovery, a, [dead], FAST)
            await trio.sleep(1.0)
            assert a.connected_peers() == []
            # Checked every 0.1 s, but retried after ~0.05, 0.1, 0.2, 0.4 s: about 5
            # attempts in the second, not 10.
            assert 3 <= len(attempts) <= 7, attempts
            nursery.cancel_scope.cancel()
