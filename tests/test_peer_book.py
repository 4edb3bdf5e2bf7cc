"""The peer book: peers' own addresses kept between runs, so a restarted peer finds the swarm
again when its bootstrap moved or left."""

from __future__ import annotations

import logging
import signal
import socket
import sqlite3
from contextlib import AsyncExitStack
from functools import partial
from pathlib import Path

import pytest
import trio

from inclavate import peer_book
from inclavate.peer_book import PeerBook
from p2p.discovery import DiscoveryConfig, PeerAddrs, exchange_peers, run_discovery
from p2p.host import open_host
from p2p.identity import Identity
from swarm import PeerProcess, Swarm

FAST = DiscoveryConfig(target_degree=4, min_delay=0.05, max_delay=0.5, check_interval=0.1, exchange_interval=0.3)
DAY_MS = 24 * 3600 * 1000


class Clock:
    def __init__(self) -> None:
        self.ms = 1_000_000_000_000

    def __call__(self) -> int:
        return self.ms


def entry(n: int, port: int = 4001) -> PeerAddrs:
    peer = f"12D3KooWpeer{n:04d}"
    return PeerAddrs(peer, (f"/ip4/10.0.0.{n % 250}/tcp/{port}/p2p/{peer}",))


def test_what_a_peer_said_of_itself_and_our_port_outlive_the_process(tmp_path: Path) -> None:
    clock = Clock()
    with_other = PeerAddrs("12D3KooWme", ("/ip4/10.0.0.1/tcp/1/p2p/12D3KooWme", "/ip4/10.0.0.9/tcp/9/p2p/12D3KooWsomeoneelse"))
    book = PeerBook(tmp_path / "peers.db", clock=clock)
    assert book.own_port() is None
    book.listened_on(40123)
    book.met(entry(1))
    clock.ms += 1000
    book.met(with_other)  # an address naming another peer is not this peer's to give
    book.met(PeerAddrs("12D3KooWnothing", ("/ip4/10.0.0.2/tcp/2",)))  # names no peer: nothing kept
    book.close()
    again = PeerBook(tmp_path / "peers.db", clock=clock)
    assert again.recall() == [PeerAddrs("12D3KooWme", ("/ip4/10.0.0.1/tcp/1/p2p/12D3KooWme",)), entry(1)]  # last met first
    assert again.own_port() == 40123
    again.close()


def test_a_taken_port_of_the_last_run_is_said_not_passed_over(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Where the last run's p2p port is taken the peer listens on another, and addresses that
    others were given for it (their ``--bootstrap``) no longer reach it. Before, it moved
    without a word: its log's "p2p on ..." line showed the new port, nothing said why."""
    from inclavate.peer import Peer
    from inclavate.peer_config import PeerConfig
    from inclavate.types import ModelId

    peer = Peer(PeerConfig(model_id=ModelId("smollm2:135m"), home=tmp_path, data_dir=tmp_path, p2p_host="127.0.0.1"))
    peer.peer_book = PeerBook.in_dir(tmp_path)
    try:
        with socket.socket() as squatter:
            squatter.bind(("127.0.0.1", 0))
            squatter.listen()
            port = squatter.getsockname()[1]
            peer.peer_book.listened_on(port)
            with caplog.at_level(logging.WARNING):
                assert peer._port_of_last_run() == 0
        assert f"the p2p port of the last run, {port}, is taken" in caplog.text, caplog.text
        caplog.clear()
        assert peer._port_of_last_run() == port and not caplog.text  # free again: taken back, quietly
    finally:
        peer.peer_book.close()


def test_a_full_book_keeps_the_peers_met_lately_and_forgets_after_a_week(tmp_path: Path) -> None:
    clock = Clock()
    book = PeerBook(tmp_path / "peers.db", clock=clock)
    for n in range(peer_book.MAX_PEERS):
        book.met(entry(n))
    clock.ms += 3600 * 1000
    book.met(entry(9999))  # a stranger's fresh identity does not push out a peer met an hour ago
    assert len(book.recall()) == peer_book.MAX_PEERS and entry(9999) not in book.recall()
    clock.ms += peer_book.MOVED_MS
    book.met(entry(5, port=4002))  # a peer already known moves: kept
    assert entry(5, port=4002) in book.recall()
    clock.ms += DAY_MS
    book.met(entry(9999))  # the entry met longest ago is a day old: it makes room
    recalled = book.recall()
    assert recalled[0] == entry(9999) and entry(0) not in recalled and len(recalled) == peer_book.MAX_PEERS
    book.close()
    clock.ms += 7 * DAY_MS - 1
    again = PeerBook(tmp_path / "peers.db", clock=clock)
    assert again.recall() == [entry(9999)]  # met a week ago less a millisecond; the rest a week and more
    again.close()


def test_a_peer_is_written_again_only_after_a_while(tmp_path: Path) -> None:
    """Every exchange brings a peer's addresses (as often as a hostile peer opens one): a write
    each time would be a disk write per stream a stranger opens."""
    clock = Clock()
    book = PeerBook(tmp_path / "peers.db", clock=clock)

    def stored_ms() -> int:
        with sqlite3.connect(tmp_path / "peers.db") as db:
            return int(db.execute("SELECT last_met_ms FROM peers").fetchone()[0])

    book.met(entry(1))
    first = clock.ms
    clock.ms += peer_book.REFRESH_MS - 1
    book.met(entry(1))
    assert stored_ms() == first
    clock.ms += 1
    book.met(entry(1))
    assert stored_ms() == clock.ms
    moved = clock.ms
    clock.ms += peer_book.MOVED_MS - 1
    book.met(entry(1, port=4002))  # moved, but a minute has not passed
    assert stored_ms() == moved and book.recall() == [entry(1)]
    clock.ms += 1
    book.met(entry(1, port=4002))
    assert stored_ms() == clock.ms and book.recall() == [entry(1, port=4002)]
    book.close()


def test_a_failed_write_costs_the_entry_not_discovery(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    book = PeerBook(tmp_path / "peers.db")
    with sqlite3.connect(tmp_path / "peers.db") as db:
        db.execute("DROP TABLE peers")
        db.execute("CREATE VIEW peers AS SELECT 1 AS peer_id")  # every write to it fails
    book.met(entry(1))  # logged, not raised
    assert book.recall() == [] and "could not remember peer" in caplog.text
    book.close()


class MemoryBook:
    def __init__(self, recalled: list[PeerAddrs] | None = None) -> None:
        self.entries = {e.peer_id: e for e in recalled or []}

    def recall(self) -> list[PeerAddrs]:
        return list(self.entries.values())

    def met(self, entry: PeerAddrs) -> None:
        self.entries[entry.peer_id] = entry


async def test_the_book_keeps_each_peers_own_word_and_never_hearsay() -> None:
    with trio.fail_after(20):
        async with AsyncExitStack() as stack:
            a, b, c = [await stack.enter_async_context(open_host(Identity.generate())) for _ in range(3)]
            await b.connect(c.multiaddrs()[0])
            b.add_addrs(c.peer_id, ["/ip4/127.0.0.1/tcp/1"])  # what b says of c is hearsay to a
            await a.connect(b.multiaddrs()[0])
            asker, answerer = MemoryBook(), MemoryBook()
            nursery = await stack.enter_async_context(trio.open_nursery())
            await nursery.start(partial(run_discovery, b, [], FAST, book=answerer))
            await exchange_peers(a, b.peer_id, FAST, asker)
            assert set(asker.entries) == {b.peer_id} and set(asker.entries[b.peer_id].addrs) <= set(b.multiaddrs())
            assert set(answerer.entries) == {a.peer_id}  # the asker told b its own addresses
            nursery.cancel_scope.cancel()


async def test_a_peer_with_no_bootstrap_finds_the_peers_it_met_before() -> None:
    with trio.fail_after(20):
        async with AsyncExitStack() as stack:
            b = await stack.enter_async_context(open_host(Identity.generate()))
            book = MemoryBook([PeerAddrs(b.peer_id, tuple(b.multiaddrs()))])
            a = await stack.enter_async_context(open_host(Identity.generate()))
            nursery = await stack.enter_async_context(trio.open_nursery())
            await nursery.start(partial(run_discovery, a, [], FAST, book=book))
            while b.peer_id not in a.connected_peers():
                await trio.sleep(0.05)
            nursery.cancel_scope.cancel()


async def test_a_hostile_neighbours_garbage_in_the_book_costs_a_failed_dial_not_discovery() -> None:
    """What a neighbour said of itself is dialed on our next start: addresses that do not
    parse, name a port out of range or point nowhere are each one failed dial, and the
    peers behind them are still found."""
    with trio.fail_after(20):
        async with AsyncExitStack() as stack:
            b = await stack.enter_async_context(open_host(Identity.generate()))
            liar = Identity.generate().peer_id
            garbage = PeerAddrs(liar, (f"/not/a/multiaddr/p2p/{liar}", f"/ip4/127.0.0.1/tcp/99999/p2p/{liar}",
                                       f"/ip4/127.0.0.1/tcp/1/p2p/{liar}", "x" * 500 + f"/p2p/{liar}"))  # fmt: skip
            book = MemoryBook([garbage, PeerAddrs(b.peer_id, tuple(b.multiaddrs()))])
            a = await stack.enter_async_context(open_host(Identity.generate()))
            nursery = await stack.enter_async_context(trio.open_nursery())
            await nursery.start(partial(run_discovery, a, [], FAST, book=book))
            while b.peer_id not in a.connected_peers():
                await trio.sleep(0.05)
            await trio.sleep(1.0)  # every garbage address dialed, and failed, meanwhile
            assert a.connected_peers() == [b.peer_id]
            nursery.cancel_scope.cancel()


@pytest.mark.swarm
@pytest.mark.slow
def test_a_first_peer_killed_and_restarted_finds_its_swarm_again(tmp_path: Path) -> None:
    """Restarted, the first peer takes its old p2p port, so b's ``--bootstrap`` is right again;
    where that port is taken, it comes back on another with no ``--bootstrap`` and dials b,
    which it met before. Before the peer book it came back on a random port and stayed alone:
    b kept dialing an address nobody listened on."""
    with Swarm(tmp_path) as swarm:
        a = swarm.start("a")
        b = swarm.start("b", bootstrap=a)
        b_id = swarm.wait_ready(b)["peer_id"]
        swarm.wait_ready(a)

        def a_knows_b() -> bool:
            with sqlite3.connect(a.data_dir / peer_book.FILENAME) as db:
                return db.execute("SELECT 1 FROM peers WHERE peer_id = ?", [b_id]).fetchone() is not None

        def restart(a: PeerProcess, squatter: socket.socket | None = None) -> PeerProcess:
            swarm.signal(a, signal.SIGKILL)
            a.process.wait(10)
            if squatter is not None:  # someone else listens on a's port meanwhile
                squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past a's closed connections
                squatter.bind(("127.0.0.1", int(first_addr.split("/tcp/")[1].split("/")[0])))
                squatter.listen()
            return swarm.start("a")  # the same data directory, no --bootstrap

        def sees_b(a: PeerProcess) -> bool:
            return any(n["peer_id"] == b_id for n in a.get("/nodes"))

        swarm.wait(a_knows_b, 30, "a to meet b", a)
        first_addr = swarm.multiaddr(a)
        a = restart(a)
        assert swarm.multiaddr(a) == first_addr
        swarm.wait(lambda: sees_b(a), 30, "a to see b again on its old port", a)
        with socket.socket() as squatter:
            a = restart(a, squatter)
            assert swarm.multiaddr(a) != first_addr
            swarm.wait(lambda: sees_b(a), 30, "a to see b again from a new port", a)
