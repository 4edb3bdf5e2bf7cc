"""Probation: peers that never served this entry get routes only as a trial share of new
sessions while proven ones can serve, and a failover goes through proven peers first.

A record of a fresh identity claiming the whole model is always the cheapest route (one
hop); four of them that swallow every frame took a request's every failover, a 503 after
20 s, and rotating identities made every chat of the entry one (an audit, 2026-12-07)."""

from __future__ import annotations

import random

import pytest
import trio
from trio.testing import MockClock
from registry_helpers import MODEL, view
from test_failover_policy import _Service

from inclavate.types import PeerId, SessionId
from node.sampling import SamplingParams
from p2p import failover, wire
from p2p.chain import SwarmPipeline, _Session
from p2p.failover import FailoverPolicy, PeerHealth
from p2p.routing import NoRoute, choose_route

STRANGERS = ("e1", "e2", "e3", "e4")
SWARM = [view("a", 0, 10), view("b", 10, 30), *(view(e, 0, 30) for e in STRANGERS)]
"""``a`` (the entry) and ``b`` the honest chain; each stranger claims the whole model."""


def test_a_route_can_be_held_to_proven_peers_and_relayed_nodes_count_by_their_id() -> None:
    assert [h.node_id for h in choose_route(SWARM, MODEL, PeerId("a"))] in ([e] for e in STRANGERS)
    assert [h.node_id for h in choose_route(SWARM, MODEL, PeerId("a"), proven={"a", "b"})] == ["a", "b"]
    with pytest.raises(NoRoute):
        choose_route(SWARM, MODEL, PeerId("a"), proven={"a"})
    legacy = view("z:1", 10, 30, peer_id=PeerId("z"), relayed=True, forward_url="http://z:9/forward")
    views = [view("a", 0, 10), legacy]
    assert [h.node_id for h in choose_route(views, MODEL, PeerId("a"), proven={"a", "z:1"})] == ["a", "z:1"]
    with pytest.raises(NoRoute):  # the relaying peer's word does not prove the node it relays
        choose_route(views, MODEL, PeerId("a"), proven={"a", "z"})


def test_peers_that_served_are_proven_and_the_set_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(failover, "_MAX_PROVEN", 3)
    health = PeerHealth()
    assert health.proven() == set()
    health.failed(PeerId("x"), now=0.0)
    assert health.proven() == set()  # failing proves nothing
    health.served([PeerId("x"), PeerId("p1")])
    assert health.proven() == {"x", "p1"}
    health.served([PeerId("p2")])
    health.served([PeerId("x")])  # served again: the latest
    health.served([PeerId("p3")])
    assert health.proven() == {"x", "p2", "p3"}  # the one that served longest ago is forgotten


class _QuietStrangers(_Service):
    """The entry's forward service where every stranger takes frames and never answers (it
    still answers pings); every other last hop answers each step with a token."""

    def __init__(self) -> None:
        super().__init__("a", held=None)

    async def send(self, peer: PeerId, msg: object) -> None:
        self.sent.append((peer, msg))
        if isinstance(msg, wire.Forward) and msg.sampling is not None and not {h.peer_id for h in msg.route} & set(STRANGERS):
            self._inboxes[msg.session_id].send_nowait(wire.Result(msg.req_id, msg.session_id, 7))

    ask = send


def _pipeline(policy: FailoverPolicy, proven: tuple[str, ...] = ("b",), seed: int = 1) -> SwarmPipeline:
    """The entry ``a``, to which the peers ``proven`` served a session before."""

    async def answers(_peer: PeerId) -> bool:
        return True

    health = PeerHealth(policy)
    health.served(PeerId(p) for p in proven)
    return SwarmPipeline(_QuietStrangers(), MODEL, lambda: SWARM, 512, {v.record.node_id: v for v in SWARM}.get,  # type: ignore[arg-type]
                         probe=answers, policy=policy, health=health, rng=random.Random(seed))  # fmt: skip


def test_swallowing_strangers_cost_a_request_at_most_its_first_route() -> None:
    """Worst case: every new session tries a stranger (``trial_share`` 1). The first one's
    deadline passes, and the failover goes to the proven chain at once; before, it went to
    the next stranger, and the next, until ``max_failovers`` were spent."""
    policy = FailoverPolicy(trial_share=1.0)
    pipeline = _pipeline(policy)
    greedy = SamplingParams(temperature=0.0)

    async def main() -> None:
        for i in range(len(STRANGERS)):
            began = trio.current_time()
            assert await pipeline.step(SessionId(f"s{i}"), 0, [1, 2, 3], greedy) == 7
            assert trio.current_time() - began <= policy.max_step_s + policy.probe_timeout_s + 1  # one deadline
            assert [h.node_id for h in pipeline.route_of(SessionId(f"s{i}")) or ()] == ["a", "b"]
            assert pipeline._sessions[SessionId(f"s{i}")].failovers <= 1

    trio.run(main, clock=MockClock(autojump_threshold=0))


def test_new_sessions_try_unproven_peers_only_as_a_trial_share() -> None:
    """With a proven chain, about ``trial_share`` of new sessions take the strangers' cheaper
    route; in a fresh swarm (only the entry proven) every session takes the cheapest, as before."""
    routes: dict[str, list[bool]] = {}

    async def main() -> None:
        for case, proven in (("proven chain", ("b",)), ("fresh", ())):
            pipeline = _pipeline(FailoverPolicy(), proven=proven, seed=7)
            firsts = [pipeline._first_route(_Session(SessionId(f"s{i}"))) for i in range(400)]
            routes[case] = [[h.node_id for h in r] != ["a", "b"] for r in firsts]

    trio.run(main)
    share = sum(routes["proven chain"]) / 400
    assert 0.06 < share < 0.2, share  # 1/8 expected
    assert all(routes["fresh"])
