"""A stranger's connections to a peer's libp2p port (``p2p.connection_guard``).

A real peer limited to 256 descriptors (its inbound libp2p share 32, handshakes 8) on
127.0.0.1; the flood comes from 127.0.0.2, the honest peer from 127.0.0.1. Before the guard
(``scripts/probe_p2p_flood.py``): 400 silent or stalled connections took all 256 descriptors
until the library's 10 s handshake deadline closed them (``accept returned EMFILE``), and
fresh identities through Noise and yamux were kept for as long as they stayed; every
connection, however many a second, got multistream and a Noise responder step (CPU).
"""

from __future__ import annotations

import contextlib
import os
import resource
import sys
import threading
from collections.abc import Iterator

import pytest
import trio
from p2p_flood import STALLED_HELLO, answered, closed_by_peer, fresh_identity_flood, in_background, open_quietly, paced_flood
from swarm import PeerProcess, Swarm

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts the peer's descriptors in /proc")

_NOFILE = 256
_INBOUND, _HANDSHAKES = 32, 8
"""``p2p.connection_guard``'s bounds at 256 descriptors (written out: the test states them)."""
_BURST = 16
"""``p2p.accept_rate.SOURCE_BURST``: new connections one source may open at once."""


@contextlib.contextmanager
def _most_descriptors(pid: int) -> Iterator[list[int]]:
    """The most descriptors ``pid`` held, sampled every 0.1 s while the block runs."""
    most = [0]

    def sample(done: threading.Event) -> None:
        while not done.wait(0.1):
            with contextlib.suppress(OSError):
                most[0] = max(most[0], len(os.listdir(f"/proc/{pid}/fd")))

    with in_background(sample):
        yield most


def _limited_peer(s: Swarm) -> tuple[PeerProcess, int, str]:
    """A ready peer under a 256-descriptor limit: it, its libp2p port and its peer id."""
    peer = s.start("a")
    health = s.wait_ready(peer)
    resource.prlimit(peer.process.pid, resource.RLIMIT_NOFILE, (_NOFILE, _NOFILE))
    return peer, int(health["multiaddrs"][0].split("/tcp/")[1].split("/")[0]), health["peer_id"]


def _assert_an_honest_peer_joins(s: Swarm, a: PeerProcess, a_id: str, within: float = 90) -> None:
    """A second peer bootstraps through ``a`` while the flood is held; each lists the other
    ``within`` seconds of its answering."""
    b = s.start("b", bootstrap=a)
    b_id = s.wait(lambda: b.get("/health")["peer_id"], 60, "b to answer", b)
    s.wait(lambda: b_id in {n["node_id"] for n in a.get("/nodes")}, within, "a to list b", a)
    s.wait(lambda: a_id in {n["node_id"] for n in b.get("/nodes")}, within, "b to list a", b)


@pytest.mark.parametrize("hello", [b"", STALLED_HELLO], ids=["silent", "stalled_in_noise"])
def test_a_flood_of_unfinished_handshakes_leaves_the_peer_its_descriptors(tmp_path, hello: bytes) -> None:
    """400 connections that send nothing, or stall after Noise's first message: the peer
    keeps at most 8 of them in the handshake (each newcomer closes the flood's oldest), so
    it never nears its limit, ``/health`` answers and an honest peer joins through it.
    Before: all 256 descriptors held, ``EMFILE`` ten times a second, each kept 10 s."""
    with Swarm(tmp_path) as s:
        a, port, a_id = _limited_peer(s)
        flood = []
        try:
            with _most_descriptors(a.process.pid) as most:
                flood = open_quietly(port, "127.0.0.2", 400, hello)
                s.wait(lambda: sum(map(closed_by_peer, flood)) >= 400 - _HANDSHAKES, 60, "the flood's surplus closed", a)
                assert a.get("/health")["ok"]
                _assert_an_honest_peer_joins(s, a, a_id)
            assert most[0] < _NOFILE - 64, f"the peer held {most[0]} descriptors, its limit {_NOFILE}"
            assert "EMFILE" not in a.log_path.read_text(errors="replace")
        finally:
            for sock in flood:
                sock.close()


def test_a_source_past_its_rate_is_closed_before_the_handshake(tmp_path) -> None:
    """100 connections from one address, one after another, each sending multistream,
    ``/noise`` and Noise's first message: the peer answers its burst (16) and closes the
    rest unread, without a byte of multistream or Noise, until its bucket refills (4 a
    second); an honest peer from another address still joins. Before: the peer answered
    every one (multistream and a Noise responder step each: its CPU, the stranger's bytes)."""
    with Swarm(tmp_path) as s:
        a, port, a_id = _limited_peer(s)
        replies: list[bool] = []
        socks = []
        try:
            for _ in range(100):
                reply, sock = answered(port, "127.0.0.2", STALLED_HELLO)
                replies.append(reply)
                socks.append(sock)
            assert replies[:_BURST] == [True] * _BURST  # a new source starts with its burst
            assert replies.count(False) > 0, "every connection past the burst was answered"
            health = a.get("/health")
            assert health["ok"]
            assert health["connections"]["refused_by_source"] > 0  # an operator sees the flood
            _assert_an_honest_peer_joins(s, a, a_id)
        finally:
            for sock in socks:
                sock.close()


def test_idle_neighbours_under_fresh_identities_are_bounded(tmp_path) -> None:
    """Connections through Noise and yamux, each a new identity (free to make), that then
    sit idle, opened in rounds of the source's burst (its rate refuses more at once) until
    over 40 got through: the peer keeps at most 32 inbound connections, the source holding
    the most losing its oldest, so the flood rotates its own and an honest peer still joins.
    Before: every one kept for as long as the stranger liked (230 took all 256 descriptors;
    ``/health`` and the honest peer's dial went unanswered)."""
    with Swarm(tmp_path) as s:
        a, port, a_id = _limited_peer(s)
        held: list = []

        async def flood() -> None:
            for _round in range(20):
                done, _failed = await fresh_identity_flood(port, a_id, "127.0.0.2", _BURST, concurrency=4)
                held.extend(done)
                if len(held) > _INBOUND + 8:
                    return
                await trio.sleep(_BURST / 4)  # the source's bucket refills

        try:
            trio.run(flood)
            socks = [sock for _, sock in held]
            assert len(socks) > _INBOUND  # enough got through to pass the bound
            s.wait(lambda: len(socks) - sum(map(closed_by_peer, socks)) <= _INBOUND, 30, "the surplus closed", a)
            assert a.get("/health")["ok"]
            _assert_an_honest_peer_joins(s, a, a_id)
        finally:
            for _, sock in held:
                sock.close()


_FLOOD_SOURCES = [f"127.0.0.{i}" for i in range(2, 41)]
"""Linux routes all of 127.0.0.0/8 to ``lo``: 39 source addresses, none of them the honest
peer's (127.0.0.1)."""


def test_a_flood_from_many_addresses_leaves_a_newcomer_its_way_in(tmp_path) -> None:
    """39 addresses opening 1,000 connections a second in all (each sends a Noise hello and
    closes at once) keep the peer's bucket of all (32 a second) empty (a refusal there takes
    nothing from the source's own bucket, so each address keeps its own). A newcomer's
    connection from each of four other addresses is answered, and an honest peer from
    127.0.0.1 joins within 30 s of answering: let in from the reserve that only quiet sources
    may take. Before: first come, first served, the flood took each token as it came; each
    newcomer's connection found none but by luck (~3 in 100: the bucket's 32 a second over the
    flood's 1,000) and the honest peer's dials, on discovery's backoff, mostly did not get in
    within 30 s (``scripts/probe_p2p_flood.py --kind paced``: never)."""
    with Swarm(tmp_path) as s:
        a, port, a_id = _limited_peer(s)
        newcomers = []
        with paced_flood(port, _FLOOD_SOURCES, 1000.0, STALLED_HELLO) as flood:
            try:
                spent = lambda: a.get("/health")["connections"]["refused_in_all"] > 1000  # noqa: E731
                s.wait(spent, 30, "the flood to keep the bucket of all empty", a)
                newcomers = [answered(port, f"127.0.0.{i}", STALLED_HELLO) for i in range(41, 45)]
                assert [reply for reply, _ in newcomers] == [True] * 4, "a newcomer's connection was closed unread"
                _assert_an_honest_peer_joins(s, a, a_id, within=30)
                counters = a.get("/health")["connections"]
            finally:
                for _, sock in newcomers:
                    sock.close()
        assert flood.opened > 1000 and flood.failed < flood.opened // 10
        assert counters["refused_by_source"] < counters["refused_in_all"] // 10  # refused in all, not by source
        assert counters["let_in_quiet"] >= 4
