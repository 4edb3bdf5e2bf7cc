"""Sessions at a first stage from entries it cannot vouch for: whose they are, and that a
session the stage frees on its own is closed on the hops after it too.

Over real libp2p hosts on loopback, a real first stage (SmolLM2 layers 0-10) and a next hop
that records what reaches it. The hops after a stage hold each session it passes on as a
known peer's (this stage is their previous hop), so a session freed here and not there kept
its slot there for their idle timeout (10 minutes)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass

import numpy as np
import trio
from conftest import smollm2_engine
from registry_helpers import view

from inclavate.types import LayerRange, NodeId, PeerId, SessionId
from node.llamacpp_engine import LlamaCppEngine
from node.stage import Stage
from p2p import wire
from p2p.admission import AdmissionLimits
from p2p.forward import ForwardService
from p2p.forward_checks import FrameReason
from p2p.host import P2PHost, open_host
from p2p.identity import Identity
from p2p.routing import Hop


class NextHop(ForwardService):
    """Records the forwards and closes that reach it, in order."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.got: list[tuple[wire.Message, PeerId]] = []

    async def _on_forward(self, msg: wire.Forward, remote: PeerId) -> None:
        self.got.append((msg, remote))

    async def _on_close(self, msg: wire.Close, remote: PeerId) -> None:
        self.got.append((msg, remote))


@dataclass
class Chain:
    stage: Stage
    first: ForwardService
    next_hop: NextHop
    route: tuple[Hop, ...]
    entries: list[ForwardService]

    async def open(self, entry: int, session: str, reply_to: PeerId | None = None) -> None:
        """A session through the route, opened by ``entries[entry]`` (discarding its output)."""
        sender = self.entries[entry]
        msg = wire.Forward(1, SessionId(session), 0, self.route, reply_to or sender.me, None,
                           tokens=np.array([1, 2, 3], np.int32), discard=True)  # fmt: skip
        await sender.send(self.route[0].peer_id, msg)

    async def next_hop_got(self, n: int) -> list[tuple[str, str]]:
        """(type, session) of the first ``n`` frames the next hop received."""
        with trio.fail_after(20):
            while len(self.next_hop.got) < n:
                await trio.sleep(0.02)
        return [(msg.TYPE, msg.session_id) for msg, _ in self.next_hop.got[:n]]


def _hop(host: P2PHost, layers: LayerRange) -> Hop:
    return Hop(NodeId(host.peer_id), host.peer_id, layers)


@asynccontextmanager
async def chain(engine: LlamaCppEngine, *, known_entries: int, strangers: int, limits: AdmissionLimits) -> AsyncIterator[Chain]:
    """Layers 0-10 (``engine``) then a recording next hop of 10-20; entries with a record of
    their own (known) and without (strangers), each connected to the first stage."""
    async with AsyncExitStack() as hosts_open:
        a, b, *hosts = [await hosts_open.enter_async_context(open_host(Identity.generate()))
                        for _ in range(2 + known_entries + strangers)]  # fmt: skip
        async with trio.open_nursery() as nursery:
            yield await _start(nursery, engine, limits, a, b, hosts, known_entries)
            nursery.cancel_scope.cancel()


async def _start(nursery: trio.Nursery, engine: LlamaCppEngine, limits: AdmissionLimits, a: P2PHost, b: P2PHost,
                 hosts: list[P2PHost], known_entries: int) -> Chain:  # fmt: skip
    stage = Stage(engine)
    first = ForwardService(a, node_id=NodeId(a.peer_id), stage=stage, admission=limits, direct_port=None)
    records = {a.peer_id: view(a.peer_id, 0, 10).record, b.peer_id: view(b.peer_id, 10, 20).record}
    records.update({h.peer_id: view(h.peer_id, 0, 1).record for h in hosts[:known_entries]})
    first.record_of = lambda node: records.get(PeerId(node))
    next_hop = NextHop(b, node_id=NodeId(b.peer_id), stage=None, direct_port=None)
    entries = [ForwardService(h, node_id=NodeId(h.peer_id), stage=None, direct_port=None) for h in hosts]
    await nursery.start(stage.run)
    for service in (first, next_hop, *entries):
        await nursery.start(service.run)
    await a.connect(b.multiaddrs()[0])
    for h in hosts:
        await h.connect(a.multiaddrs()[0])
    return Chain(stage, first, next_hop, (_hop(a, LayerRange(0, 10)), _hop(b, LayerRange(10, 20))), entries)


def _engine(smollm2, slice_cache, max_sessions: int) -> LlamaCppEngine:
    return smollm2_engine(smollm2, slice_cache, (0, 10), context_length=64, max_sessions=max_sessions)


async def test_an_idle_stranger_session_freed_here_is_closed_on_the_next_hop(smollm2, slice_cache) -> None:
    """A stranger may hold one session here, freed once idle; the next hop, for which this
    stage is a known previous hop, used to keep it ten minutes: one free identity per slot
    held every later stage."""
    with _engine(smollm2, slice_cache, 2) as engine, trio.fail_after(60):
        async with chain(engine, known_entries=0, strangers=1, limits=AdmissionLimits(stranger_idle_s=0.5)) as c:
            await c.open(0, "stranger")
            assert await c.next_hop_got(2) == [("forward", "stranger"), ("close", "stranger")]
            close, sender = c.next_hop.got[1]
            assert sender == c.first.me and close.route == c.route[1:]
            assert engine.session_length(SessionId("stranger")) == 0


async def test_an_evicted_session_is_closed_on_the_next_hop_before_the_newcomer_arrives(smollm2, slice_cache) -> None:
    """The close goes ahead of the new session's frames on the link they share, so the next
    hop has the slot free when the newcomer gets there."""
    with _engine(smollm2, slice_cache, 2) as engine, trio.fail_after(60):
        async with chain(engine, known_entries=2, strangers=0, limits=AdmissionLimits()) as c:
            await c.open(0, "hoard0")
            await c.open(0, "hoard1")
            await c.next_hop_got(2)
            await c.open(1, "newcomer")
            got = await c.next_hop_got(4)
            assert got[2:] == [("close", "hoard0"), ("forward", "newcomer")], got
            assert c.stage.stats.evicted == 1
            assert set(engine.sessions()) == {SessionId("hoard1"), SessionId("newcomer")}


async def test_token_ids_that_name_another_peer_as_their_entry_are_dropped_unanswered(smollm2, slice_cache) -> None:
    """Token ids come from the entry itself. Naming another peer would have the swarm answer
    a third party, and let one sender pass downstream for as many entries as it names."""
    with _engine(smollm2, slice_cache, 2) as engine, trio.fail_after(60):
        async with chain(engine, known_entries=2, strangers=0, limits=AdmissionLimits()) as c:
            await c.open(0, "posing", reply_to=c.entries[1].me)
            await c.open(0, "honest")
            assert await c.next_hop_got(1) == [("forward", "honest")]
            assert c.first.drops[FrameReason.TOKENS_NOT_FROM_ENTRY] == 1
            assert engine.sessions() == [SessionId("honest")]


async def test_the_onward_routes_kept_stay_bounded_by_the_slots(smollm2, slice_cache) -> None:
    """Every session passed on leaves its onward route behind; sessions the stage no longer
    holds (refused, failed, freed elsewhere) are pruned, so a sender of many session ids
    grows the table no further than a few times the slots."""
    with _engine(smollm2, slice_cache, 2) as engine, trio.fail_after(60):
        async with chain(engine, known_entries=1, strangers=0, limits=AdmissionLimits()) as c:
            for i in range(40):
                c.first._note_onward(SessionId(f"s{i}"), c.route[1:], c.entries[0].me)
            assert len(c.first._onward) <= 4 * 2 + 1
