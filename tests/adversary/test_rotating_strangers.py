"""Strangers' fresh identities, each claiming the whole model, rotated to spend the entry's
failovers.

A record of a fresh identity stating ``smollm2 0-30 Ready`` is always the cheapest route
(one hop against the honest chain's three), and a stranger may sign as many as it likes.
Each identity here answers pings (its link measures ~0 ms) but takes every forward frame
and never answers. The entry avoids a peer only after it failed, by identity, and a
request may fail over three times: four never-seen identities took every failover of a
chat, a 503 after 20 s, and four new ones every round made every chat one (an audit,
2026-12-07: 0 of 6 answered). Now peers that served this entry (``PeerHealth.proven``) are
preferred: a new session meets a stranger only as a trial share, and a failover goes to
the proven chain at once: with ``--trial-share 1`` (every new session tries the cheapest
route, the strangers' worst case) each chat meets one stranger and fails over once. The
strangers live in this process, one libp2p host each."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import pytest
import trio
from hostile_peer import HostilePeer, honest_record, hostile_peer
from live_swarm import chat, three_peers
from swarm import PeerProcess, Swarm

from inclavate.types import PeerId
from p2p import wire
from p2p.framing import FramedStream
from p2p.latency import PROTOCOL as PING

pytestmark = [pytest.mark.swarm, pytest.mark.slow]
ROUNDS = 2
STRANGERS_PER_ROUND = 4
"""One more than the failovers a request may use (``FailoverPolicy.max_failovers``)."""
CHATS_PER_ROUND = 2
CHAT_S_EXPECTED = 15.0
"""A chat may meet one stranger (a trial share of sessions): one step deadline (5 s), a
ping round, the replay. Before, each chat that met them took 20 s and was a 503."""
READY_S = 90.0
"""Longest the entry may take to list a round's strangers as Ready: 30 s ran out once in a
full CI run on 2 loaded cores (four handshakes, records and pings)."""


@pytest.fixture(scope="module", params=["default", "1"], ids=["trial-share-default", "trial-share-1"])
def live(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Swarm, list[PeerProcess], bool]]:
    """The swarm, and whether its entry ``a`` tries the cheapest route for every session."""
    entry = [] if request.param == "default" else ["--trial-share", request.param]
    with three_peers(tmp_path_factory.mktemp("rotating-strangers"), per_peer={0: entry}) as (s, peers):
        yield s, peers, bool(entry)


async def _echo(stream: FramedStream, _remote: PeerId) -> None:
    while True:
        await stream.send(await stream.receive(timeout=3600.0), timeout=5.0)


async def _swallow(stream: FramedStream, _remote: PeerId) -> None:
    """Take every frame, answer none (the stream stays open: nothing looks gone)."""
    while True:
        await stream.receive(timeout=3600.0)


@asynccontextmanager
async def swallowing_strangers(target: str, k: int) -> AsyncIterator[list[HostilePeer]]:
    """``k`` fresh identities connected to the peer at ``target``, each publishing a record
    of the whole model every 2 s, answering pings and swallowing forward frames."""
    async with AsyncExitStack() as stack:
        strangers = []
        for _ in range(k):
            evil = await stack.enter_async_context(hostile_peer(target))
            evil.host.set_stream_handler(PING, _echo, max_frame_size=64)
            evil.host.set_stream_handler(wire.PROTOCOL, _swallow, max_frame_size=64 * 1024 * 1024)
            strangers.append(evil)

        async def publish() -> None:
            while True:
                for evil in strangers:
                    await evil.publish_record(honest_record(evil.identity, start=0, end=30, context_length=512,
                                                            heartbeat_ms=2000, multiaddrs=tuple(evil.host.multiaddrs())))  # fmt: skip
                await trio.sleep(2)

        nursery = await stack.enter_async_context(trio.open_nursery())  # closed before the hosts
        nursery.start_soon(publish)
        yield strangers
        nursery.cancel_scope.cancel()


def _ready_at(entry: PeerProcess, ids: set[str]) -> bool:
    return ids <= {n["node_id"] for n in entry.get("/nodes") if n["state"] == "Ready"}


def test_rotating_strangers_claiming_the_whole_model_do_not_fail_the_chats(live: tuple[Swarm, list[PeerProcess], bool]) -> None:
    s, (a, _b, _c), trying = live
    since = len(a.log_path.read_text(errors="replace"))
    status, body = chat(a)  # through the honest chain: b and c have served a
    assert status == 200, body
    expected = body["choices"][0]["message"]["content"]
    outcomes: list[tuple[int, float, Any]] = []

    async def attack() -> None:
        for _ in range(ROUNDS):
            async with swallowing_strangers(s.multiaddr(a), STRANGERS_PER_ROUND) as strangers:
                ids = {str(evil.peer_id) for evil in strangers}
                with trio.fail_after(READY_S):
                    while not await trio.to_thread.run_sync(_ready_at, a, ids):
                        await trio.sleep(0.5)
                await trio.sleep(12)  # a's latency round (10 s) measured them: the cheapest route
                for _ in range(CHATS_PER_ROUND):
                    began = time.monotonic()
                    status, body = await trio.to_thread.run_sync(lambda: chat(a, timeout=60))
                    outcomes.append((status, time.monotonic() - began, body))

    async def main() -> None:
        with trio.fail_after(ROUNDS * (READY_S + 20 + CHATS_PER_ROUND * 60)):  # the whole attack is bounded
            await attack()

    trio.run(main)
    answered = [(st, round(t, 1)) for st, t, body in outcomes
                if st == 200 and body["choices"][0]["message"]["content"] == expected]  # fmt: skip
    # Every chat answers the model's text (before: each a 503 after 20 s). How long each took
    # is printed, not asserted: a timed assertion reads the machine's load (CI, 2026-12-07).
    assert len(answered) == len(outcomes) == ROUNDS * CHATS_PER_ROUND, [(st, round(t, 1), b) for st, t, b in outcomes]
    print("seconds a chat:", [t for _, t in answered], f"(one step deadline and a replay: ~{CHAT_S_EXPECTED:g} s or less)")
    assert a.alive(), a.log_tail()
    failovers = [line for line in a.log_path.read_text(errors="replace")[since:].splitlines() if "; failover " in line]
    assert not [line for line in failovers if "; failover 1/" not in line], failovers  # never a second one
    if trying:  # every chat met a stranger, and left it for the proven chain at once
        assert len(failovers) == len(outcomes), failovers
