"""Failover's pure rules: route from the failed boundary, spreading, avoidance and backoff,
the adaptive step deadline, what the registry says about a live hop."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest
import trio
from trio.testing import MockClock
from registry_helpers import MODEL, view

from inclavate.types import LayerRange, NodeId, PeerId, SessionId
from p2p import wire
from p2p.chain import least_used_lane
from p2p.failover import FailoverPolicy, PeerHealth, StepDeadline, hop_trouble, replay_plan
from p2p.records import NodeRecord
from p2p.registry import NodeView
from p2p.inbox import Alarm, Inbox
from p2p.legs import Leg, LegWatch, seen_gone
from p2p.latency import UNREACHABLE_MS, usable_link_ms
from p2p.routing import NEAR_EQUAL, CostModel, Hop, NoRoute, choose_route


def ranges(route) -> list[tuple[str, LayerRange]]:
    return [(h.node_id, h.layers) for h in route]


SWARM = [view("a", 0, 10), view("b", 10, 20), view("c", 10, 20), view("d", 20, 30)]


def test_a_route_can_start_at_a_boundary_and_leave_peers_out() -> None:
    route = choose_route(SWARM, MODEL, PeerId("a"), start=10, exclude={PeerId("b")})
    assert ranges(route) == [("c", LayerRange(10, 20)), ("d", LayerRange(20, 30))]
    # A replacement split differently still meets the boundary.
    split = [view("a", 0, 10), view("e", 10, 15), view("f", 15, 20), view("d", 20, 30)]
    assert [h.layers for h in choose_route(split, MODEL, PeerId("a"), start=10)] == [
        LayerRange(10, 15), LayerRange(15, 20), LayerRange(20, 30)]  # fmt: skip


def test_no_route_after_exclusion_names_the_layers_left_without_a_holder() -> None:
    with pytest.raises(NoRoute, match="layers 10-20 have no Ready node"):
        choose_route(SWARM, MODEL, PeerId("a"), exclude={PeerId("b"), PeerId("c")})
    with pytest.raises(NoRoute, match="layers 0-30 have no Ready node"):
        choose_route([view("w", 0, 30)], MODEL, PeerId("a"), exclude={PeerId("w")})
    with pytest.raises(NoRoute, match="layers 15-20 have no Ready node"):
        choose_route([view("a", 0, 15), view("d", 20, 30)], MODEL, PeerId("a"), start=15)


def test_one_record_cannot_set_the_model_s_shape_or_context_for_everyone() -> None:
    """A record costs nothing to publish. The largest ``n_layers`` any record stated decided
    the model's: one claiming 100,000 layers made every chat a 503; one claiming 31 and
    holding all of them drew every route. The least context any record stated was every
    chat's: one saying 2 refused every prompt (an audit, 2026-12-07)."""
    from types import SimpleNamespace

    from inclavate.errors import InclavateError
    from inclavate.peer import Peer
    from p2p.coverage import agreed

    honest = [view(n, s, e, context_length=8192) for n, s, e in
              [("a", 0, 10), ("b", 10, 20), ("c", 20, 30), ("a2", 0, 10), ("b2", 10, 20), ("c2", 20, 30)]]  # fmt: skip
    for evil in (view("evil", 0, 1, n_layers=100_000), view("evil", 0, 31, n_layers=31, context_length=8192),
                 view("evil", 0, 10, context_length=2)):  # fmt: skip
        swarm = [*honest, evil]
        for _ in range(20):
            assert "evil" not in [h.node_id for h in choose_route(swarm, MODEL, PeerId("x"), min_context=8192)]
            assert "evil" not in [h.node_id for h in choose_route(swarm, MODEL, PeerId("x"), n_layers=30, min_context=8192)]

        def catalog() -> None:
            raise InclavateError("not in this peer's catalog")

        peer = SimpleNamespace(shutting_down=False, forward=SimpleNamespace(me=PeerId("x")), _spec=None, _pipelines={},
                               host=SimpleNamespace(is_connected=lambda _peer: True), views=lambda: list(swarm),
                               view_of={v.record.node_id: v for v in swarm}.get, latency=None, _catalog=catalog,
                               _measured_step_ms=lambda _model: 0.0, metrics=SimpleNamespace(record_request=lambda _model: None),
                               config=SimpleNamespace(failover=FailoverPolicy(), decode_lanes=4, engine=SimpleNamespace(context_length=512)),
                               _peer_health=PeerHealth(FailoverPolicy()))  # fmt: skip
        peer._model_facts = lambda model: Peer._model_facts(peer, model)  # type: ignore[attr-defined]
        peer._catalog_shape = lambda model: Peer._catalog_shape(peer, model)  # type: ignore[attr-defined]
        peer._chain_context = lambda *args: Peer._chain_context(peer, *args)  # type: ignore[attr-defined]
        peer.peer_id = "x"

        async def entry() -> tuple[int | None, int]:
            pipeline = Peer.pipeline(peer, MODEL)  # type: ignore[arg-type]  # its route checked (a 503 was raised)
            return pipeline.n_layers, pipeline.context_length

        assert trio.run(entry) == (30, 8192)
        # A peer serving the model holds chains to what most peers state, no more than its own.
        peer._spec = SimpleNamespace(model_id=MODEL)
        for own, expected in ((4096, 4096), (16384, 8192)):
            peer.config.engine.context_length = own
            assert trio.run(entry) == (30, expected)
        peer._spec = None
        peer.config.engine.context_length = 512
    # An honest swarm whose only holder of a span runs a shorter context: chains hold that much.
    swarm = [*honest[:2], *honest[3:5], view("c", 20, 30, context_length=2048)]
    assert trio.run(entry) == (30, 2048)
    # Each peer counts once, whatever number of records it signs; the smaller on a tie.
    assert agreed([view("p", 0, 1, n_layers=9).record] * 5 + [view("q", 0, 1).record], lambda r: r.n_layers) == 9
    many = [view(f"p:{i}", 0, 1, peer_id=PeerId("p"), n_layers=9).record for i in range(5)]
    assert agreed([*many, view("q", 0, 1).record, view("r", 0, 1).record], lambda r: r.n_layers) == 30


def _entry_context(swarm: list[NodeView], own: int, serving: bool) -> tuple[int | None, int]:
    """(n_layers, context_length) of the pipeline a peer ``x`` hands a chat of ``MODEL`` to,
    its route checked (a 503 is raised), with ``swarm`` as its registry."""
    from types import SimpleNamespace

    from inclavate.errors import InclavateError
    from inclavate.peer import Peer

    def catalog() -> None:
        raise InclavateError("not in this peer's catalog")

    peer = SimpleNamespace(shutting_down=False, forward=SimpleNamespace(me=PeerId("x")), _pipelines={},
                           _spec=SimpleNamespace(model_id=MODEL) if serving else None,
                           host=SimpleNamespace(is_connected=lambda _peer: True), views=lambda: list(swarm),
                           view_of={v.record.node_id: v for v in swarm}.get, latency=None, _catalog=catalog,
                           _measured_step_ms=lambda _model: 0.0, metrics=SimpleNamespace(record_request=lambda _model: None),
                           config=SimpleNamespace(failover=FailoverPolicy(), decode_lanes=4, engine=SimpleNamespace(context_length=own)),
                           _peer_health=PeerHealth(FailoverPolicy()), peer_id="x")  # fmt: skip
    peer._model_facts = lambda model: Peer._model_facts(peer, model)  # type: ignore[attr-defined]
    peer._catalog_shape = lambda model: Peer._catalog_shape(peer, model)  # type: ignore[attr-defined]
    peer._chain_context = lambda *args: Peer._chain_context(peer, *args)  # type: ignore[attr-defined]

    async def entry() -> tuple[int | None, int]:
        pipeline = Peer.pipeline(peer, MODEL)  # type: ignore[arg-type]
        return pipeline.n_layers, pipeline.context_length

    return trio.run(entry)


def test_free_records_outvoting_the_honest_peers_cannot_shrink_the_context() -> None:
    """Three records of fresh identities on layers 0-1 (no route uses them) saying 2 outvoted
    three honest peers stating 512, and every chat on every peer was a 400 "context holds 2"
    (an audit, 2026-12-07). A chain's context is now the most a complete chain holds: records
    stating less only leave themselves out of routes."""
    honest = [view("a", 0, 10, context_length=512), view("b", 10, 20, context_length=512),
              view("c", 20, 30, context_length=512)]  # fmt: skip
    for claimed in ((0, 1), (0, 10), (10, 20)):  # useless ranges, and ranges routes could use
        strangers = [view(f"s{i}", *claimed, context_length=2) for i in range(3)]
        swarm = [*honest, *strangers]
        for own, serving in ((512, True), (2048, False), (512, False)):
            assert _entry_context(swarm, own, serving) == (30, 512), (claimed, own, serving)
        for _ in range(20):
            route = choose_route(swarm, MODEL, PeerId("x"), min_context=512)
            assert {h.node_id for h in route} == {"a", "b", "c"}
    from p2p.routing import chain_context

    # Many records stating distinct contexts: still the honest chain's (found by bisection).
    many = [view(f"z{i}", 0, 1, context_length=i + 1) for i in range(300)]
    assert chain_context([*honest, *many], MODEL, PeerId("x"), 2048) == 512
    # A record claiming the whole model and a huge context is held to the cap: not the only route.
    huge = [*honest, view("w", 0, 30, context_length=1_000_000)]
    assert chain_context(huge, MODEL, PeerId("x"), 512) == 512
    assert _entry_context(huge, 512, True) == (30, 512)
    # An honest replica running a shorter context is routed round, and used when it must be.
    mixed = [*honest, view("b2", 10, 20, context_length=256)]
    assert _entry_context(mixed, 512, True) == (30, 512)
    assert all("b2" not in {h.node_id for h in choose_route(mixed, MODEL, PeerId("x"), min_context=512)} for _ in range(20))
    assert _entry_context([v for v in mixed if v.record.node_id != "b"], 512, True) == (30, 256)
    # No chain at all: the least context, so the route check names the missing layers.
    with pytest.raises(NoRoute, match="layers 10-20 have no Ready node"):
        _entry_context([honest[0], honest[2], view("s", 0, 1, context_length=2)], 512, True)


def test_one_identity_s_many_records_get_one_vote_on_the_speed_reference() -> None:
    """An entry that runs none of the model holds speed claims to their median; seven legacy
    records of one identity claiming 0.001 ms a layer outvoted six honest nodes, and every
    route went through them (an audit, 2026-12-07). A peer's records now vote once."""
    honest = [view(n, s, e, step_ms_per_layer=1.0) for n, s, e in
              [("a", 0, 10), ("a2", 0, 10), ("b", 10, 20), ("b2", 10, 20), ("c", 20, 30), ("c2", 20, 30)]]  # fmt: skip
    fakes = [view(f"z:{i}", 10, 20, peer_id=PeerId("z"), relayed=True, forward_url="http://z:9/forward",
                  step_ms_per_layer=0.001) for i in range(7)]  # fmt: skip
    middles = Counter(choose_route([*honest, *fakes], MODEL, PeerId("x"), rng=random.Random(i))[1].peer_id for i in range(100))
    assert middles[PeerId("b")] + middles[PeerId("b2")] > 0, middles  # held to the honest median, not theirs


def test_draining_nodes_get_no_new_routes() -> None:
    views = [view("a", 0, 30, draining=True), view("b", 0, 30)]
    assert {choose_route(views, MODEL, PeerId("x"))[0].node_id for _ in range(20)} == {"b"}


def test_sessions_spread_over_replicas_by_load_even_when_measured_costs_differ() -> None:
    views = [view("a", 0, 10), view("b", 10, 20), view("c", 10, 20), view("d", 20, 30)]
    links = {PeerId("b"): 0.4, PeerId("c"): 0.6}
    load: Counter[PeerId] = Counter()
    for _ in range(8):
        route = choose_route(views, MODEL, PeerId("a"), CostModel(link_ms=links, load=load))
        load.update(h.peer_id for h in route)
    assert load[PeerId("b")] == load[PeerId("c")] == 4
    # A replica twice as far still takes a share, smaller.
    links, load = {PeerId("b"): 2.0, PeerId("c"): 24.0}, Counter()
    for _ in range(8):
        route = choose_route(views, MODEL, PeerId("a"), CostModel(link_ms=links, load=load))
        load.update(h.peer_id for h in route)
    assert load[PeerId("b")] > load[PeerId("c")] > 0


def test_unreliable_peers_weigh_more() -> None:
    views = [view("a", 0, 30), view("b", 0, 30)]
    costs = CostModel(reliability={PeerId("a"): 0.5})
    assert {choose_route(views, MODEL, PeerId("x"), costs, random.Random(i))[0].node_id for i in range(20)} == {"b"}


def test_a_failed_peer_is_avoided_with_capped_exponential_backoff() -> None:
    health = PeerHealth(FailoverPolicy(avoid_s=10, avoid_max_s=25))
    p = PeerId("p")
    health.failed(p, now=100.0)
    assert health.avoided(109.9) == {p} and health.avoided(110.1) == set()
    health.failed(p, now=200.0)
    assert health.avoided(219.9) == {p} and not health.avoided(220.1)
    health.failed(p, now=300.0)  # 40 s, capped at 25
    assert health.avoided(324.9) == {p} and not health.avoided(325.1)
    low = health.reliability()[p]
    assert low < 0.6
    health.served([p])
    assert low < health.reliability()[p] < 1.0
    health.failed(p, now=400.0)  # served reset the strikes: back to the base backoff
    assert not health.avoided(410.1)


def test_the_step_deadline_follows_measured_step_times() -> None:
    policy = FailoverPolicy(min_step_s=2.0, max_step_s=120.0, step_factor=10.0)
    deadline = StepDeadline(policy)
    assert deadline.seconds(1) == deadline.seconds(300) == 120.0  # nothing measured yet
    for _ in range(20):
        deadline.observe(1, 0.03)
    assert deadline.seconds(1) == 2.0  # 10 x 30 ms, floored
    assert deadline.seconds(300) == 120.0  # a prefill's time per token is still unknown
    deadline.observe(400, 4.0)
    assert deadline.seconds(300) == pytest.approx(10 * (300 * 0.01 + 0.03))
    for _ in range(30):
        deadline.observe(1, 0.5)
    assert deadline.seconds(1) == pytest.approx(5.0, rel=0.05)


def test_what_the_registry_says_about_a_hop() -> None:
    hop = Hop(NodeId("b"), PeerId("b"), LayerRange(10, 20))
    assert hop_trouble(hop, view("b", 10, 20)) is None
    assert hop_trouble(hop, None) == "failed"
    assert hop_trouble(hop, view("b", 10, 20, "Dead")) == "failed"
    assert hop_trouble(hop, view("b", 10, 20, "Degraded")) == "failed"
    assert hop_trouble(hop, view("b", 0, 10)) == "failed"  # moved to other layers
    assert hop_trouble(hop, view("b", 10, 20, draining=True)) == "leaving"
    assert hop_trouble(hop, view("b", 10, 20, idle=True)) == "leaving"


def test_an_entry_that_did_not_run_past_the_deadline_waits_on_for_the_token() -> None:
    """The entry stopped (SIGSTOP, swapped out) for 20 s while a token was out: when it runs
    again its wait wakes 20 s late, every deadline behind it, the answer maybe unread in its
    own socket. That time is no hop's: the deadline moves past it and the token comes.
    Before, the session failed over at once, blaming every hop (an audit, 2026-12-08)."""
    from p2p.chain import SwarmPipeline, _Session

    views = [view("a", 0, 10), view("b", 10, 30)]
    service = _Service("a", held=None)
    policy = FailoverPolicy()
    pipeline = SwarmPipeline(service, MODEL, lambda: views, 512, {v.record.node_id: v for v in views}.get,  # type: ignore[arg-type]
                             policy=policy, health=PeerHealth(policy), rng=random.Random(1))  # fmt: skip
    clock = MockClock()

    async def main() -> None:
        session = _Session(SessionId("s"))
        pipeline._sessions[session.session_id] = session
        pipeline._open_leg(session, choose_route(views, MODEL, PeerId("a")))
        leg = session.leg
        assert leg is not None
        pipeline.deadline.observe(1, 0.05)  # steps measured: the deadline is its floor, 5 s
        session.flight_since, session.flight_tokens = trio.current_time(), 1
        outcome: list[object] = []

        async def wait() -> None:
            outcome.append(await pipeline._await_token(session, 7))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait)
            await trio.testing.wait_all_tasks_blocked()
            clock.jump(20.0)  # the whole process stopped: the waiting task wakes late
            await trio.testing.wait_all_tasks_blocked()
            assert outcome == [], outcome  # no Broken: still waiting
            leg.inbox.send_nowait(wire.Result(7, leg.wire_id, 42))
        assert outcome == [42]

    trio.run(main, clock=clock)


def test_a_legs_health_asks_the_registry_only_about_its_own_hops() -> None:
    """Every session polls its route every ``poll_s``: the answer must come from lookups of
    the route's nodes, not from listing a registry that may hold thousands."""
    registry = {v.record.node_id: v for v in [*SWARM, view("b2", 10, 20, "Dead"), *(view(f"x{i}", 0, 30) for i in range(500))]}
    asked: list[NodeId] = []

    def view_of(node_id: NodeId):
        asked.append(node_id)
        return registry.get(node_id)

    watch = LegWatch(PeerId("a"), view_of, lambda _peer: True, None, FailoverPolicy())
    route = (Hop(NodeId("a"), PeerId("a"), LayerRange(0, 10)), Hop(NodeId("b2"), PeerId("b2"), LayerRange(10, 20)),
             Hop(NodeId("d"), PeerId("d"), LayerRange(20, 30)))  # fmt: skip
    leg = Leg(SessionId("s"), route, trio.open_memory_channel[object](1)[1])

    async def check() -> tuple[frozenset[PeerId], frozenset[PeerId], frozenset[PeerId]]:
        return watch.trouble(leg)

    assert trio.run(check) == (frozenset({PeerId("b2")}), frozenset(), frozenset())  # Dead: failed, not seen gone
    assert sorted(asked) == ["a", "b2", "d"]


def test_a_hop_whose_connection_is_lost_is_seen_gone_and_one_that_moved_is_not() -> None:
    """Only our own connection's end is certain: the registry may lag, and a hop serving
    other layers now (it moved to heal a gap) is alive and may be routed through there."""
    registry = {v.record.node_id: v for v in [view("a", 0, 10), view("b", 0, 10), view("d", 20, 30)]}
    connected = {PeerId("b"), PeerId("d")}
    policy = FailoverPolicy()
    watch = LegWatch(PeerId("a"), registry.get, lambda peer: peer in connected, None, policy)
    route = (Hop(NodeId("a"), PeerId("a"), LayerRange(0, 10)), Hop(NodeId("b"), PeerId("b"), LayerRange(10, 20)),
             Hop(NodeId("d"), PeerId("d"), LayerRange(20, 30)))  # fmt: skip
    leg = Leg(SessionId("s"), route, trio.open_memory_channel[object](1)[1])

    async def main() -> None:
        assert watch.trouble(leg) == ({PeerId("b")}, set(), set())  # b moved to 0-10
        connected.discard(PeerId("d"))
        assert watch.trouble(leg) == ({PeerId("b")}, set(), set())  # within the grace
        await trio.sleep(policy.disconnect_grace_s)
        assert watch.trouble(leg) == ({PeerId("b"), PeerId("d")}, set(), {PeerId("d")})

    trio.run(main, clock=MockClock(autojump_threshold=0))


def test_the_draining_flag_parses_tolerantly() -> None:
    base = view("b", 10, 20).record.to_json()
    assert NodeRecord.from_json(base).draining is False
    assert NodeRecord.from_json({**base, "draining": True}).draining is True
    for odd in ("yes", 1, None, [True]):
        assert NodeRecord.from_json({**base, "draining": odd}).draining is False


def test_the_replay_plan_keeps_prefill_shapes_and_coalesces_small_steps() -> None:
    assert replay_plan([]) == []
    assert replay_plan([256, 74, 1, 1, 1]) == [(0, 256), (256, 74), (330, 3)]
    # Decode steps (and a forced 3-token tag) merge into frames of at most 32 tokens.
    assert replay_plan([256, 256, 10, *[1] * 40, 3, *[1] * 5]) == [(0, 256), (256, 256), (512, 32), (544, 26)]
    assert replay_plan([20, *[1] * 20]) == [(0, 32), (32, 8)]


def test_a_span_replay_rebuilds_up_to_a_step_boundary_and_resends_the_rest() -> None:
    from p2p.chain import _Session

    session = _Session(SessionId("s"))
    for start, tokens in ((0, [1] * 256), (256, [1] * 74), *((330 + i, [2]) for i in range(5))):
        session.record(start, tokens)
    # The kept hops confirm 333 and 334 positions: 333 is a step boundary, before the last step.
    assert session.shape_boundary(333) == 333 and session.shape_boundary(300) == 256
    assert session.split_replay(333) == ([(0, 256), (256, 74), (330, 3)], [(333, 2)])
    assert session.split_replay(256) == ([(0, 256)], [(256, 74), (330, 5)])
    session.record(300, [7, 7])  # a rewind keeps the shapes of what stays
    assert session.history == [1] * 300 + [7, 7] and session.shapes == [256, 44, 2]
    session.record(302, [8])
    assert session.split_replay(302) == ([(0, 256), (256, 44), (300, 2)], [(302, 1)])


def test_a_prefill_batch_does_not_move_the_claimed_step_time() -> None:
    """Routing costs a hop at its claimed decode step time; a prompt chunk's seconds used to
    count as a step and make a replica look ~100x slower."""
    from node.stage import StageStats

    stats = StageStats()
    stats.record(1, 0.010, 10)
    stats.record(256, 1.0, 10, decode=False)
    assert stats.step_ms_per_layer == pytest.approx(1.0) and stats.tokens == 257 and stats.batches == 2


def test_a_missed_ping_from_a_connected_peer_does_not_decide_the_route() -> None:
    """Under load, pings of healthy peers time out (the 1000 ms penalty); a peer we hold a
    live connection to is then costed as an unknown link, so replicas still share sessions."""
    links = usable_link_ms({PeerId("b"): 0.4, PeerId("c"): UNREACHABLE_MS / 2, PeerId("x"): UNREACHABLE_MS / 2},
                           lambda peer: peer != PeerId("x"))  # fmt: skip
    assert links == {PeerId("b"): 0.4, PeerId("c"): 0.4, PeerId("x"): UNREACHABLE_MS / 2}  # the slowest measured
    # A peer that stays connected and answers no ping is no nearer than the slowest honest
    # link: at the default 5 ms it drew every route from honest peers 20 ms away.
    far = usable_link_ms({PeerId("b"): 20.0, PeerId("c"): 20.0, PeerId("e"): UNREACHABLE_MS / 2}, lambda peer: True)
    assert far[PeerId("e")] == 20.0 and usable_link_ms({}, lambda peer: True) == {}
    views = [view("a", 0, 10), view("b", 10, 20), view("c", 10, 20), view("d", 20, 30)]
    load: Counter[PeerId] = Counter()
    for _ in range(8):
        load.update(h.peer_id for h in choose_route(views, MODEL, PeerId("a"), CostModel(link_ms=links, load=load)))
    assert load[PeerId("b")] > 0 and load[PeerId("c")] > 0


def test_near_equal_routes_are_drawn_at_random() -> None:
    views = [view("a", 0, 30), view("b", 0, 30)]
    costs = CostModel(link_ms={PeerId("a"): 1.0, PeerId("b"): 1.0 + 30 * NEAR_EQUAL / 2})
    picks = Counter(choose_route(views, MODEL, PeerId("x"), costs, random.Random(i))[0].node_id for i in range(200))
    assert min(picks["a"], picks["b"]) > 50
    costs = CostModel(link_ms={PeerId("a"): 1.0, PeerId("b"): 1.0 + 40 * NEAR_EQUAL})
    assert {choose_route(views, MODEL, PeerId("x"), costs, random.Random(i))[0].node_id for i in range(50)} == {"a"}


def test_new_sessions_are_spread_evenly_over_the_lanes() -> None:
    lanes: list[int] = []
    for _ in range(5):
        lanes.append(least_used_lane(lanes, 2))
    assert lanes == [0, 1, 0, 1, 0]
    assert least_used_lane([0, 0, 2, 1], 3) == 1  # the fewest first, the lowest on a tie
    assert least_used_lane([1, 3, 1], 2) == 0  # lanes fold onto the entry's count
    assert least_used_lane([0, 1, 2], 1) == 0


def test_a_draining_holder_is_the_last_resort_and_a_move_off_it_avoids_failed_peers() -> None:
    """b failed a moment ago (still Ready in the registry), c drains: a failover goes through
    c rather than fail; moving off c again is voluntary and must not go back to b."""
    from types import SimpleNamespace

    from p2p.chain import Broken, SwarmPipeline, _Session
    from p2p.errors import P2PError

    views = [view("a", 0, 10), view("b", 10, 20), view("c", 10, 20, draining=True), view("d", 20, 30)]
    pipeline = SwarmPipeline(SimpleNamespace(me=PeerId("a")), MODEL, lambda: views, 512, lambda _: None)  # type: ignore[arg-type]
    old = choose_route(views, MODEL, PeerId("a"))
    assert ranges(old)[1][0] == "b"  # c, draining, is not routable

    async def main() -> None:
        pipeline.health.failed(PeerId("b"), trio.current_time())
        session = _Session(SessionId("s"))
        broken = Broken(frozenset({PeerId("b")}), P2PError("b is gone"))
        with pytest.raises(NoRoute):
            pipeline._reroute(old, broken.peers, session)
        route = pipeline._through_draining(old, broken, session)
        assert route is not None and [h.node_id for h in route] == ["a", "c", "d"]
        # On c, at the next step boundary: b is avoided, so there is nowhere to move.
        with pytest.raises(NoRoute):
            pipeline._reroute(route, frozenset({PeerId("c")}), session, voluntary=True)
        assert pipeline._span_route(route, frozenset({PeerId("c")}), session, voluntary=True) is None
        # A failover (not voluntary) may still try b once nothing else is left.
        assert [h.node_id for h in pipeline._reroute(route, frozenset({PeerId("c")}), session)] == ["a", "b", "d"]

    trio.run(main)


def test_a_hop_s_session_evicted_is_a_replay_that_blames_nobody() -> None:
    """Any hop may answer ``session_evicted``: the entry replays without blaming (an honest
    stage's fair share is no fault) the first time that hop evicts the session; each one
    spends a failover (bounded by ``--max-failovers``), and a second eviction by the same
    hop blames it (``-k blaming_nobody``)."""
    from types import SimpleNamespace

    from p2p import wire
    from p2p.chain import SwarmPipeline

    views = [view("a", 0, 10), view("b", 10, 20), view("d", 20, 30)]
    pipeline = SwarmPipeline(SimpleNamespace(me=PeerId("a")), MODEL, lambda: views, 512, lambda _: None)  # type: ignore[arg-type]
    route = tuple(choose_route(views, MODEL, PeerId("a")))
    leg = Leg(SessionId("s"), route, trio.open_memory_channel[object](1)[1])
    evicted = wire.Error(1, SessionId("s"), "session_evicted", "gave its slot", PeerId("b"))
    broken = pipeline._on_reply(leg, evicted, 1)
    assert broken is not None and not isinstance(broken, int)
    assert broken.peers == frozenset() and "gave its slot" in str(broken.cause)
    other = pipeline._on_reply(leg, wire.Error(1, SessionId("s"), "engine_error", "boom", PeerId("b")), 1)
    assert other is not None and not isinstance(other, int) and other.peers == frozenset({PeerId("b")})


class _Service:
    """The entry's forward service, as far as a failover uses it: frames sent are recorded,
    and every hop asked to adopt a session says it holds ``held`` positions."""

    def __init__(self, me: str, held: int | None) -> None:
        self.me = PeerId(me)
        self.held = held
        self.sent: list[tuple[PeerId, object]] = []
        self._inboxes: dict[str, Inbox[object]] = {}
        self.alarm = Alarm()
        """Times the inboxes' waits once a test runs it (else each wait takes a cancel scope)."""

    async def send(self, peer: PeerId, msg: object) -> None:
        from p2p import wire

        self.sent.append((peer, msg))
        if isinstance(msg, wire.Adopt) and self.held is not None:  # None: the hops never answer
            self._inboxes[msg.new_id].send_nowait(wire.Adopted(msg.req_id, msg.new_id, self.held, sender=peer))

    ask = send

    def open_inbox(self, session_id: SessionId, route_peers=None):
        inbox = self._inboxes[session_id] = Inbox[object](256, self.alarm)
        return inbox

    def close_inbox(self, session_id: SessionId) -> None:
        self._inboxes.pop(session_id, None)


def test_a_failover_cancelled_while_the_kept_hops_adopt_closes_the_old_leg() -> None:
    """The client leaves while a failover waits for the kept hops' ``adopted``: the old leg's
    inbox stayed open for good (one per cancelled failover) and its hops were never told
    to close it. Both happen now, the cancellation going on as before."""
    from p2p import wire
    from p2p.chain import SwarmPipeline, _Session

    views = [view("a", 0, 10), view("b", 10, 20), view("c", 10, 20), view("d", 20, 30)]
    service = _Service("a", held=None)
    policy = FailoverPolicy()
    pipeline = SwarmPipeline(service, MODEL, lambda: views, 512, {v.record.node_id: v for v in views}.get,  # type: ignore[arg-type]
                             policy=policy, health=PeerHealth(policy), rng=random.Random(1))  # fmt: skip

    async def main() -> None:
        session = _Session(SessionId("s"))
        for start, tokens in ((0, [1, 2, 3]), (3, [4])):
            session.record(start, tokens)
        pipeline._sessions[session.session_id] = session
        pipeline._open_leg(session, choose_route(views, MODEL, PeerId("a"), exclude={PeerId("c")}))
        old = session.leg
        assert old is not None and [h.node_id for h in old.route] == ["a", "b", "d"]
        lost = wire.Error(0, old.wire_id, "unreachable", "peer b closed its link", PeerId("a"), PeerId("b"))
        broken = pipeline._on_reply(old, lost, 1)
        assert broken is not None and not isinstance(broken, int)
        with trio.move_on_after(1.0):  # adopts wait up to adopt_timeout_s (5 s)
            await pipeline._fail_over(session, broken, None)
        assert old.wire_id not in service._inboxes
        closes = [(peer, msg) for peer, msg in service.sent if isinstance(msg, wire.Close) and msg.session_id == old.wire_id]
        assert {peer for peer, _ in closes} >= {PeerId("a"), PeerId("d")}, closes

    trio.run(main, clock=MockClock(autojump_threshold=0))


def test_holders_seen_gone_for_certain_are_not_tried_again() -> None:
    """Both holders of 10-20 killed within a millisecond while a stream runs through b (the
    audit's case): b's link closes, the failover goes to c, c cannot be reached either. Both
    are still Ready in the registry for seconds, but neither may be tried again: the failover
    waits for a route as documented, then fails with the 503 naming the layers (it used to
    bounce b, c, b, ... and report libp2p's negative cache); new requests from this entry get
    that answer at once for a short while, and route through them again after it."""
    from p2p import wire
    from p2p.chain import SwarmPipeline, _Session

    views = [view("a", 0, 10), view("b", 10, 20), view("c", 10, 20), view("d", 20, 30)]
    by_node = {v.record.node_id: v for v in views}
    service = _Service("a", held=5)
    policy = FailoverPolicy()
    pipeline = SwarmPipeline(service, MODEL, lambda: views, 512, by_node.get, policy=policy,  # type: ignore[arg-type]
                             health=PeerHealth(policy), rng=random.Random(1))  # fmt: skip
    a, b, c = PeerId("a"), PeerId("b"), PeerId("c")

    async def main() -> None:
        session = _Session(SessionId("s"))
        for start, tokens in ((0, [1, 2, 3]), (3, [4]), (4, [5])):
            session.record(start, tokens)
        pipeline._sessions[session.session_id] = session
        pipeline._open_leg(session, [h for h in choose_route(views, MODEL, a, exclude={c})])
        assert session.leg is not None and [h.node_id for h in session.leg.route] == ["a", "b", "d"]
        # b's link ends: the entry's own forward service tells the session (p2p.forward.link_lost).
        lost = wire.Error(0, session.leg.wire_id, "unreachable", "peer b closed its link", a, b)
        broken = pipeline._on_reply(session.leg, lost, 1)
        assert broken is not None and not isinstance(broken, int)
        await pipeline._fail_over(session, broken, None)
        assert [h.node_id for h in session.leg.route] == ["a", "c", "d"]
        # The replay into c cannot open a stream to it.
        refused = wire.Error(0, session.leg.wire_id, "unreachable",
                             "peer c is unreachable: cannot open /inclavate/forward/2 to c: Peer c recently failed "
                             "all addresses (negative cache)", a, c)  # fmt: skip
        broken = pipeline._on_reply(session.leg, refused, 1)
        assert broken is not None and not isinstance(broken, int)
        failed_leg = session.leg.wire_id
        sent_before = len(service.sent)
        began = trio.current_time()
        with pytest.raises(NoRoute, match="layers 10-20 have no Ready node"):
            await pipeline._fail_over(session, broken, None)
        assert trio.current_time() - began >= policy.no_route_wait_s  # the documented wait for a route
        # No new leg was tried: only the closes of the one that failed went out.
        after = [msg for _, msg in service.sent[sent_before:]]
        assert after and all(isinstance(msg, wire.Close) and msg.session_id == failed_leg for msg in after), after
        # A new request from this entry, a moment later: the same answer, at once.
        with pytest.raises(NoRoute, match="layers 10-20 have no Ready node"):
            pipeline.check_route()
        # Seconds later (the registry would call them Degraded by now; here they are still
        # Ready, as if back): routable again.
        await trio.sleep(policy.gone_s)
        assert ranges(pipeline.check_route())[1][0] in ("b", "c")

    trio.run(main, clock=MockClock(autojump_threshold=0))


def _sole_holder_lost(no_route_wait_s: float) -> tuple[list[NodeView], Any, Any, Any]:
    """a 0-10, b 10-20 (the only holder), d 20-30; a session through them whose link to b
    has just ended (gone for certain): the views, the pipeline, the session, the breakage."""
    from p2p import wire
    from p2p.chain import SwarmPipeline, _Session

    views = [view("a", 0, 10, started_ms=1000), view("b", 10, 20, started_ms=2000), view("d", 20, 30, started_ms=3000)]
    policy = FailoverPolicy(max_failovers=1, no_route_wait_s=no_route_wait_s)
    pipeline = SwarmPipeline(_Service("a", held=5), MODEL, lambda: views, 512,  # type: ignore[arg-type]
                             {v.record.node_id: v for v in views}.get, policy=policy, health=PeerHealth(policy),
                             rng=random.Random(1))  # fmt: skip
    session = _Session(SessionId("s"))
    session.record(0, [1, 2, 3])
    pipeline._sessions[session.session_id] = session
    pipeline._open_leg(session, choose_route(views, MODEL, PeerId("a")))
    assert session.leg is not None
    lost = wire.Error(0, session.leg.wire_id, "unreachable", "peer b closed its link", PeerId("a"), PeerId("b"))
    broken = pipeline._on_reply(session.leg, lost, 1)
    assert broken is not None and not isinstance(broken, int)
    return views, pipeline, session, broken


def test_a_sole_holder_restarted_is_routed_through_again_at_once() -> None:
    """The only holder of 10-20 is killed (our link to it ends: gone for certain) and its
    volunteer restarts it at once. Its new record names a new start: requests route through
    it again as soon as that record arrives, not ``gone_s`` later (they were refused with a
    503 for the rest of the 10 s). The same record, unchanged, keeps it out."""

    async def main() -> None:
        views, pipeline, session, broken = _sole_holder_lost(no_route_wait_s=0.5)
        with pytest.raises(NoRoute, match="layers 10-20 have no Ready node"):
            await pipeline._fail_over(session, broken, None)
        with pytest.raises(NoRoute):  # b's old record, still Ready for seconds: still gone
            pipeline.check_route()
        views[1] = view("b", 10, 20, started_ms=9000)  # b restarted, and said so
        assert ranges(pipeline.check_route())[1][0] == "b"

    trio.run(main, clock=MockClock(autojump_threshold=0))


def test_a_sole_holder_restarted_during_a_failover_carries_its_session_on() -> None:
    """The only holder of 10-20 is killed mid-stream and its volunteer restarts it at once
    (Ready ~2 s later, a new start in its record). The failover waiting for a route
    (``no_route_wait_s``) must take it: before, it left the blamed peer out of every pass
    whatever its record said, and the stream ended with "layers 10-20 have no Ready node"
    3 s after that node said Ready."""

    async def main() -> None:
        views, pipeline, session, broken = _sole_holder_lost(no_route_wait_s=5.0)

        async def restart_b() -> None:
            await trio.sleep(2.0)
            views[1] = view("b", 10, 20, started_ms=9000)

        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(restart_b)
            await pipeline._fail_over(session, broken, None)
        assert [hop.peer_id for hop in session.leg.route] == ["a", "b", "d"]
        assert trio.current_time() - start < 3.0

    trio.run(main, clock=MockClock(autojump_threshold=0))


def test_only_our_own_unreachable_marks_a_peer_gone_for_certain() -> None:
    """Gone for certain keeps a peer out of every route for ``gone_s``: a hop's report that
    its successor is unreachable is its word (a liar would keep an honest hop out per lie),
    so only our own link's end or failed dial marks it."""
    me, hop, nxt = PeerId("me"), PeerId("hop"), PeerId("next")
    ours = wire.Error(1, SessionId("s"), "unreachable", "link ended", me, nxt)
    theirs = wire.Error(1, SessionId("s"), "unreachable", "cannot reach", hop, nxt)
    blamed = frozenset({nxt})
    assert seen_gone(blamed, ours, me) == {nxt}
    assert seen_gone(blamed, theirs, me) == frozenset()
    assert seen_gone(blamed, wire.Error(1, SessionId("s"), "engine_error", "boom", me), me) == frozenset()


class _QuietHop(_Service):
    """The entry's forward service on a swarm where peer ``quiet`` takes frames and never
    answers (it still answers pings); every other last hop answers each step with a token."""

    def __init__(self, me: str, quiet: str) -> None:
        super().__init__(me, held=None)
        self.quiet = PeerId(quiet)

    async def send(self, peer: PeerId, msg: object) -> None:
        from p2p import wire

        self.sent.append((peer, msg))
        if isinstance(msg, wire.Forward) and msg.sampling is not None and self.quiet not in {h.peer_id for h in msg.route}:
            self._inboxes[msg.session_id].send_nowait(wire.Result(msg.req_id, msg.session_id, 7))

    ask = send


def test_a_hop_that_swallows_frames_but_answers_pings_is_blamed_and_routed_around() -> None:
    """A peer holding the whole model (the cheapest route: one hop) takes every frame and
    says nothing, while answering pings. After a missed deadline the hops that miss a ping
    are blamed, and there were none: every failover took the same route through it again
    and the request failed after ``max_failovers`` deadlines, as did every new request (a
    live swarm: 503 after 20 s, every time). Now every hop is blamed without certainty: the
    failover goes round it, and so do new sessions."""
    from node.sampling import SamplingParams
    from p2p.chain import SwarmPipeline

    views = [view("a", 0, 10), view("e", 0, 30), view("b", 10, 30)]
    assert ranges(choose_route(views, MODEL, PeerId("a")))[0][0] == "e"  # one hop is cheapest
    service = _QuietHop("a", quiet="e")
    policy = FailoverPolicy()

    async def answers(_peer: PeerId) -> bool:
        return True

    pipeline = SwarmPipeline(service, MODEL, lambda: views, 512, {v.record.node_id: v for v in views}.get,  # type: ignore[arg-type]
                             probe=answers, policy=policy, health=PeerHealth(policy), rng=random.Random(1))  # fmt: skip
    greedy = SamplingParams(temperature=0.0)

    async def main() -> None:
        began = trio.current_time()
        assert await pipeline.step(SessionId("s1"), 0, [1, 2, 3], greedy) == 7
        assert trio.current_time() - began <= policy.max_step_s + policy.probe_timeout_s + 1  # one deadline
        assert [h.node_id for h in pipeline.route_of(SessionId("s1")) or ()] == ["a", "b"]
        assert PeerId("e") in pipeline.health.avoided(trio.current_time())
        # A new session, once the avoidance is over: its lowered reliability keeps it out.
        await trio.sleep(policy.avoid_s + 1)
        assert await pipeline.step(SessionId("s2"), 0, [1, 2, 3], greedy) == 7
        assert [h.node_id for h in pipeline.route_of(SessionId("s2")) or ()] == ["a", "b"]

    trio.run(main, clock=MockClock(autojump_threshold=0))


class _AnsweringHops(_Service):
    """The entry's forward service on a swarm whose routes answer each step with a token,
    unless :meth:`refusal` gives what a hop on the step's route answers instead."""

    def refusal(self, msg: wire.Forward, peers: list[PeerId]) -> wire.Error | None:
        return None

    async def send(self, peer: PeerId, msg: object) -> None:
        await super().send(peer, msg)
        if not isinstance(msg, wire.Forward) or msg.sampling is None:
            return
        refusal = self.refusal(msg, [h.peer_id for h in msg.route])
        self._inboxes[msg.session_id].send_nowait(refusal or wire.Result(msg.req_id, msg.session_id, 7))

    ask = send


class _BlamingHop(_AnsweringHops):
    """Peer ``liar`` answers every frame it gets with "the hop after me is unreachable" (it
    still answers pings, and so does that hop)."""

    def __init__(self, me: str, liar: str) -> None:
        super().__init__(me, held=None)
        self.liar = PeerId(liar)

    def refusal(self, msg: wire.Forward, peers: list[PeerId]) -> wire.Error | None:
        if self.liar not in peers:
            return None
        nxt = peers[peers.index(self.liar) + 1]
        return wire.Error(msg.req_id, msg.session_id, "unreachable", f"peer {nxt} is unreachable", self.liar, nxt)


def test_a_hop_that_blames_the_hop_after_it_is_blamed_when_that_hop_answers_us() -> None:
    """``e`` (10-20, on the cheapest route) answers every frame with ``unreachable`` naming
    ``b``, the only holder of 20-30, which is alive and answers pings. Taken at its word,
    ``b`` was blamed for certain, left out of the failover's routes, and the request was a
    503 naming 20-30 (every request through ``e``, in a live swarm); ``e`` was never
    blamed. Now ``b`` is asked: it answers, so the reporter is blamed and the step goes
    round it."""
    from node.sampling import SamplingParams
    from p2p.chain import SwarmPipeline

    views = [view("a", 0, 10), view("e", 10, 20), view("c", 10, 15), view("f", 15, 20), view("b", 20, 30)]
    assert [h.node_id for h in choose_route(views, MODEL, PeerId("a"))] == ["a", "e", "b"]  # one hop fewer
    service = _BlamingHop("a", liar="e")
    policy = FailoverPolicy()

    async def answers(_peer: PeerId) -> bool:
        return True

    pipeline = SwarmPipeline(service, MODEL, lambda: views, 512, {v.record.node_id: v for v in views}.get,  # type: ignore[arg-type]
                             probe=answers, policy=policy, health=PeerHealth(policy), rng=random.Random(1))  # fmt: skip

    async def main() -> None:
        assert await pipeline.step(SessionId("s1"), 0, [1, 2, 3], SamplingParams(temperature=0.0)) == 7
        assert [h.node_id for h in pipeline.route_of(SessionId("s1")) or ()] == ["a", "c", "f", "b"]
        assert pipeline.health.avoided(trio.current_time()) == {PeerId("e")}

    trio.run(main, clock=MockClock(autojump_threshold=0))


class _DeadHop(_AnsweringHops):
    """The last hop of the first route the entry picks is killed then: the hop before it on
    any route reports it unreachable. The others keep what the session sent them."""

    def __init__(self, me: str) -> None:
        super().__init__(me, held=3)
        self.dead: PeerId | None = None

    def refusal(self, msg: wire.Forward, peers: list[PeerId]) -> wire.Error | None:
        self.dead = self.dead or peers[-1]
        if self.dead not in peers:
            return None
        before = peers[peers.index(self.dead) - 1]
        return wire.Error(msg.req_id, msg.session_id, "unreachable", f"peer {self.dead} is unreachable", before, self.dead)


def test_a_report_our_own_connection_agrees_with_is_taken_without_a_ping() -> None:
    """A killed hop is reported unreachable by the hop before it, and our connection to it
    ended too: pinging it first would add up to ``probe_timeout_s`` to the failover's stall
    where a dead host sends no reset."""
    from node.sampling import SamplingParams
    from p2p.chain import SwarmPipeline

    views = [view("a", 0, 10), view("e", 10, 20), view("b", 20, 30), view("g", 20, 30)]
    service = _DeadHop("a")
    pinged: list[PeerId] = []

    async def never_answers(peer: PeerId) -> bool:
        pinged.append(peer)
        await trio.sleep(FailoverPolicy().probe_timeout_s)
        return False

    pipeline = SwarmPipeline(service, MODEL, lambda: views, 512, {v.record.node_id: v for v in views}.get,  # type: ignore[arg-type]
                             is_connected=lambda peer: peer != service.dead, probe=never_answers, rng=random.Random(1))  # fmt: skip

    async def main() -> None:
        began = trio.current_time()
        assert await pipeline.step(SessionId("s1"), 0, [1, 2, 3], SamplingParams(temperature=0.0)) == 7
        assert service.dead is not None and pinged == [] and trio.current_time() - began < 0.5
        assert service.dead not in [h.node_id for h in pipeline.route_of(SessionId("s1")) or ()]

    trio.run(main, clock=MockClock(autojump_threshold=0))


def test_the_last_hop_reporting_unreachable_with_nobody_after_it_blames_itself() -> None:
    """Its report points at the hop after it, and there is none: it blamed nobody, so the
    failover took the same route again."""
    from p2p.legs import blame

    route = (Hop(NodeId("a"), PeerId("a"), LayerRange(0, 10)), Hop(NodeId("b"), PeerId("b"), LayerRange(10, 30)))
    leg = Leg(SessionId("s"), route, trio.open_memory_channel[object](1)[1])
    report = wire.Error(1, SessionId("s"), "unreachable", "someone is unreachable", PeerId("b"))
    assert blame(leg, report, PeerId("a")) == {PeerId("b")}


def test_a_failing_legacy_node_is_blamed_alone_not_the_peer_relaying_it() -> None:
    """Anyone may register a node for a peer to relay, and its failures blamed the relaying
    peer: entries routed round that peer's own layers and every node it relays (with the
    entry's own, every chat in flight failed with a 503: an audit, 2026-12-07). A peer that
    is itself unreachable is still blamed with all its hops."""
    from p2p.legs import blame, speaker

    url = "http://10.0.0.9:9/forward"
    full, tail = NodeId("p:full"), NodeId("p:tail")
    swarm = [view("p", 0, 15), view("q", 15, 30), view(full, 0, 30, peer_id=PeerId("p"), relayed=True, forward_url=url),
             view(tail, 15, 30, peer_id=PeerId("p"), relayed=True, forward_url=url)]  # fmt: skip
    me, s = PeerId("me"), SessionId("s")

    def leg(*hops: Hop) -> Leg:
        return Leg(s, hops, trio.open_memory_channel[object](1)[1])

    through_full = leg(Hop(full, PeerId("p"), LayerRange(0, 30), url))
    blamed = blame(through_full, wire.Error(1, s, "engine_error", "legacy node answered 404", PeerId(full)), me)
    assert blamed == {full}
    assert ranges(choose_route(swarm, MODEL, me, exclude=blamed))[0] == ("p", LayerRange(0, 15))  # the peer serves on
    own_then_tail = leg(Hop(NodeId("p"), PeerId("p"), LayerRange(0, 15)), Hop(tail, PeerId("p"), LayerRange(15, 30), url))
    assert blame(own_then_tail, wire.Error(2, s, "engine_error", "node failed", PeerId(tail)), me) == {tail}
    assert blame(own_then_tail, wire.Error(3, s, "unreachable", "cannot reach the next", PeerId("p")), me) == {tail}
    # A peer may speak for its own legacy nodes: one on no hop of the route is the peer's word.
    assert blame(own_then_tail, wire.Error(5, s, "engine_error", "boom", PeerId("p:made-up")), me) == {PeerId("p")}
    assert [speaker(own_then_tail, PeerId(o)) for o in ("p:made-up", tail, "p", "x:y")] == ["p", tail, "p", "x:y"]
    lost = blame(own_then_tail, wire.Error(4, s, "unreachable", "link lost", me, failed_peer=PeerId("p")), me)
    assert lost == {PeerId("p")}
    with pytest.raises(NoRoute):  # the peer is down: none of its nodes is routed through
        choose_route([v for v in swarm if v.record.node_id != "q"], MODEL, me, exclude=lost)
    # The registry's word on a relayed node (held out: Joining) is about that node alone.
    registry = {v.record.node_id: v for v in [*swarm, view(tail, 15, 30, "Joining", peer_id=PeerId("p"), relayed=True)]}
    watch = LegWatch(me, registry.get, lambda _peer: True, None, FailoverPolicy())
    assert trio.run(lambda: _trouble(watch, own_then_tail)) == ({tail}, set(), set())


def test_a_relayed_node_s_blame_reaches_its_cost_and_its_accuser_asks_its_peer() -> None:
    """Blamed by its node id (above), a relayed node's failures were recorded where its cost
    never looked (by PeerID), and a hop reporting it unreachable had the entry ping a node id,
    which no host can dial: the failover raised (a review, 2026-12-07)."""
    from p2p.chain import Broken, SwarmPipeline
    from p2p.errors import DialError, P2PError

    url = "http://10.0.0.9:9/forward"
    tail = view("p:tail", 15, 30, peer_id=PeerId("p"), relayed=True, forward_url=url).record
    costs = CostModel(reliability={PeerId("p:tail"): 0.25})
    assert costs.edge_ms(tail, PeerId("x"), 1.0) == pytest.approx(4 * CostModel().edge_ms(tail, PeerId("x"), 1.0))

    pinged: list[PeerId] = []

    def connected(peer: PeerId) -> bool:
        if ":" in peer:
            raise DialError(f"not a peer id: {peer}")
        return True

    async def probe(peer: PeerId) -> bool:
        connected(peer)
        pinged.append(peer)
        return True

    pipeline = SwarmPipeline(_AnsweringHops("a", held=None), MODEL, list, 512, lambda _node: None,  # type: ignore[arg-type]
                             is_connected=connected, probe=probe)  # fmt: skip
    broken = Broken(frozenset({PeerId("p:tail")}), P2PError("unreachable"), reporter=PeerId("q"))
    checked = trio.run(pipeline._check_report, broken)
    assert pinged == [PeerId("p")] and checked.peers == {PeerId("q")}  # it answers: its accuser is blamed


async def _trouble(watch: LegWatch, leg: Leg) -> tuple[frozenset[PeerId], frozenset[PeerId], frozenset[PeerId]]:
    return watch.trouble(leg)


class _ExcusingHop(_AnsweringHops):
    """Peer ``liar`` answers every frame through it with an error that blames nobody (the
    ``code`` given)."""

    def __init__(self, me: str, liar: str, code: str, speaks_as: str = "") -> None:
        super().__init__(me, held=None)
        self.liar, self.code, self.speaks_as = PeerId(liar), code, PeerId(speaks_as or liar)

    def refusal(self, msg: wire.Forward, peers: list[PeerId]) -> wire.Error | None:
        if self.liar not in peers:
            return None
        return wire.Error(msg.req_id, msg.session_id, self.code, "not me", self.speaks_as)  # type: ignore[arg-type]


@pytest.mark.parametrize("speaks_as", ["e", "e:made-up"])
@pytest.mark.parametrize("code", ["session_evicted", "context_full", "invalid_batch", "engine_error"])
def test_a_hop_that_answers_every_frame_with_an_error_blaming_nobody_is_routed_around(code: str, speaks_as: str) -> None:
    """``e`` holds the whole model (the cheapest route) and answers every frame with an
    error that blames nobody: an eviction (replayed on the same route until the failovers
    were spent: a 503) or the request's fault (the client's error at once: a 400 or 503).
    Nobody was blamed, so every new request went through it again. Now such an error is
    believed once per session: the session goes round ``e``, which is avoided. The same
    when ``e`` answers in the name of a legacy node of its own that is on no route (its
    word as a relay: it blamed nobody, whatever the code, until 2026-12-07)."""
    from node.sampling import SamplingParams
    from p2p.chain import SwarmPipeline

    views = [view("a", 0, 10), view("e", 0, 30), view("b", 10, 30)]
    service = _ExcusingHop("a", liar="e", code=code, speaks_as=speaks_as)
    policy = FailoverPolicy()
    pipeline = SwarmPipeline(service, MODEL, lambda: views, 512, {v.record.node_id: v for v in views}.get,  # type: ignore[arg-type]
                             policy=policy, health=PeerHealth(policy), rng=random.Random(1))  # fmt: skip

    async def main() -> None:
        assert await pipeline.step(SessionId("s1"), 0, [1, 2, 3], SamplingParams(temperature=0.0)) == 7
        assert [h.node_id for h in pipeline.route_of(SessionId("s1")) or ()] == ["a", "b"]
        assert pipeline.health.avoided(trio.current_time()) == {PeerId("e")}

    trio.run(main, clock=MockClock(autojump_threshold=0))


@pytest.mark.parametrize("code", ["context_full", "invalid_batch"])
def test_the_request_s_own_fault_is_the_client_s_error_when_another_route_says_so_too(code: str) -> None:
    """Every hop says the request is at fault (it is): after one route round the first
    sender, the client gets the error, as before."""
    from node.sampling import SamplingParams
    from p2p.chain import StageFailed, SwarmPipeline

    views = [view("e", 0, 30), view("b", 0, 30)]

    class Everyone(_ExcusingHop):
        async def send(self, peer: PeerId, msg: object) -> None:
            self.liar = msg.route[0].peer_id if isinstance(msg, wire.Forward) else self.liar  # type: ignore[attr-defined]
            await super().send(peer, msg)

        ask = send

    service = Everyone("a", liar="e", code=code)
    pipeline = SwarmPipeline(service, MODEL, lambda: views, 512, {v.record.node_id: v for v in views}.get,  # type: ignore[arg-type]
                             rng=random.Random(1))  # fmt: skip

    async def main() -> None:
        with pytest.raises(StageFailed) as raised:
            await pipeline.step(SessionId("s1"), 0, [1, 2, 3], SamplingParams(temperature=0.0))
        assert raised.value.code == code
        forwards = [peer for peer, msg in service.sent if isinstance(msg, wire.Forward)]
        assert len(set(forwards)) == 2  # one route each

    trio.run(main, clock=MockClock(autojump_threshold=0))


def test_a_route_is_held_to_what_its_records_and_links_say_a_step_costs() -> None:
    """Claims a hop makes of being fast (or none) count as the reference speed, as routing
    costs them; nothing measured anywhere: nothing to hold the route to."""
    from p2p.routing import route_step_ms

    def records(*claims: float) -> list[NodeRecord]:
        return [view(f"h{i}", 10 * i, 10 * i + 10, step_ms_per_layer=c).record for i, c in enumerate(claims)]

    links = {PeerId("h1"): 2.0, PeerId("h2"): 3.0}
    assert route_step_ms(records(0, 0, 0), PeerId("h0"), CostModel(link_ms=links)) is None
    honest = route_step_ms(records(1.0, 1.0, 1.0), PeerId("h0"), CostModel(link_ms=links))
    assert honest == pytest.approx(3 * 10 + 2 + 3 + 3 * 1.0)  # layers, links, each hop's own cost
    # A hop claiming nothing, or to be ten times faster, is held to the others' pace.
    assert route_step_ms(records(1.0, 0, 1.0), PeerId("h0"), CostModel(link_ms=links)) == honest
    assert route_step_ms(records(1.0, 0.1, 1.0), PeerId("h0"), CostModel(link_ms=links)) == honest
    # This peer's own measurement is the reference when it has one; a slow claim is believed.
    assert route_step_ms(records(0, 0, 0), PeerId("h0"), CostModel(link_ms=links, measured_step_ms=1.0)) == honest
    assert route_step_ms(records(1.0, 5.0, 1.0), PeerId("h0"), CostModel(link_ms=links)) == honest + 40


def test_slow_steps_are_judged_against_the_route_s_cost_and_only_several_decide() -> None:
    from p2p.pace import Pace

    policy = FailoverPolicy(slow_factor=8.0, slow_floor_s=1.0, slow_steps=3, slow_window=8)
    pace = Pace(policy)

    def unasked() -> float | None:
        raise AssertionError("a step under the floor needs no lookup")

    for _ in range(20):
        assert pace.judge(1, 0.05, unasked) == 0.05
    assert not pace.too_slow
    # An honest fast route's noise: a slow step now and then (a GC pause, a prefill batched
    # first) never adds up to a verdict.
    for _ in range(5):
        assert pace.judge(1, 4.0, lambda: 0.04) == 1.0  # over the limit: the deadline learns only the limit
        for _ in range(6):
            pace.judge(1, 0.05, unasked)
        assert not pace.too_slow
    # Prefill and replay steps are not judged, nor is a step when nothing was measured.
    for _ in range(8):
        assert pace.judge(300, 30.0, unasked) == 30.0
        assert pace.judge(1, 4.0, lambda: None) == 4.0
    assert not pace.too_slow
    # An honest slow chain, whose records say so, is not slow.
    for _ in range(8):
        assert pace.judge(1, 3.0, lambda: 0.5) == 3.0
    assert not pace.too_slow
    # A route held for 2 s a step, claiming 40 ms: three such steps of the last eight decide.
    pace.judge(1, 2.0, lambda: 0.04)
    pace.judge(1, 0.05, unasked)
    pace.judge(1, 2.0, lambda: 0.04)
    assert not pace.too_slow
    pace.judge(1, 2.0, lambda: 0.04)
    assert pace.too_slow
    pace.reset()
    assert not pace.too_slow


class _DawdlingHop(_Service):
    """The entry's forward service on a swarm where every step whose route goes through
    ``slow`` is answered ``delay`` seconds late (its record claims its engine's honest speed);
    every other step is answered at once."""

    def __init__(self, me: str, slow: str, delay: float) -> None:
        super().__init__(me, held=0)
        self.slow, self.delay = PeerId(slow), delay
        self.nursery: trio.Nursery | None = None

    async def send(self, peer: PeerId, msg: object) -> None:
        await super().send(peer, msg)
        if not isinstance(msg, wire.Forward) or msg.sampling is None:
            return
        inbox = self._inboxes[msg.session_id]
        delay = self.delay if self.slow in {h.peer_id for h in msg.route} else 0.01

        async def answer() -> None:
            await trio.sleep(delay)
            inbox.send_nowait(wire.Result(msg.req_id, msg.session_id, 7))

        assert self.nursery is not None
        self.nursery.start_soon(answer)

    ask = send


def _dawdling_swarm(views: list[NodeView], slow: str, delay: float) -> tuple[Any, _DawdlingHop, FailoverPolicy]:
    from p2p.chain import SwarmPipeline

    service = _DawdlingHop("a", slow=slow, delay=delay)
    policy = FailoverPolicy()
    links = {v.record.peer_id: 0.1 for v in views}
    pipeline = SwarmPipeline(service, MODEL, lambda: views, 512, {v.record.node_id: v for v in views}.get,  # type: ignore[arg-type]
                             link_ms=lambda: links, policy=policy, health=PeerHealth(policy), rng=random.Random(1))  # fmt: skip
    return pipeline, service, policy


def _chat(pipeline: Any, session: str, tokens: int) -> Any:
    """A session's prefill and ``tokens`` decode steps; returns when each step answered."""
    from node.sampling import SamplingParams

    async def run() -> list[float]:
        greedy, took = SamplingParams(temperature=0.0), []
        assert await pipeline.step(SessionId(session), 0, list(range(1, 9)), greedy) == 7
        for pos in range(8, 8 + tokens):
            began = trio.current_time()
            assert await pipeline.step(SessionId(session), pos, [7], greedy) == 7
            took.append(trio.current_time() - began)
        return took

    return run


def test_a_hop_that_holds_every_step_just_under_the_deadline_is_left_and_routed_around() -> None:
    """``e`` (10-20, on the cheapest route: one hop fewer) serves every step 2 s late, well
    under any deadline, and answers pings. Nothing blamed it: every step of every session
    through it took 2 s, and its answers raised the shared deadline to 20 s. Now the session
    moves to the route round it after three such steps, ``e`` is blamed as a guess (not
    ``a``, ``b``: the new route keeps them), new sessions go round it, and the deadline
    learns at most the slow limit from its steps."""
    views = [view("a", 0, 10, step_ms_per_layer=1.0), view("e", 10, 20, step_ms_per_layer=1.0),
             view("c", 10, 15, step_ms_per_layer=1.0), view("f", 15, 20, step_ms_per_layer=1.0),
             view("b", 20, 30, step_ms_per_layer=1.0)]  # fmt: skip
    pipeline, service, policy = _dawdling_swarm(views, slow="e", delay=2.0)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            service.nursery = nursery
            await nursery.start(service.alarm.run)  # the waits timed as a peer's are
            took = await _chat(pipeline, "s1", 12)()
            assert sum(t > 1.0 for t in took) == 3  # policy.slow_steps: then it moved
            assert [h.node_id for h in pipeline.route_of(SessionId("s1")) or ()] == ["a", "c", "f", "b"]
            assert pipeline.health.avoided(trio.current_time()) == {PeerId("e")}
            assert pipeline.deadline.seconds(1) <= 10.0  # step_factor x slow_floor_s
            took = await _chat(pipeline, "s2", 4)()
            assert max(took) < 0.1
            assert [h.node_id for h in pipeline.route_of(SessionId("s2")) or ()] == ["a", "c", "f", "b"]
            nursery.cancel_scope.cancel()

    trio.run(main, clock=MockClock(autojump_threshold=0))


def test_a_slow_sole_holder_or_an_honest_slow_chain_keeps_serving() -> None:
    """Nothing changes where no other route exists (the session stays, nobody is blamed:
    slow beats a 503) or where the hops' own records say they are that slow; a sole holder's
    late steps still cannot stretch the deadline past ten times the slow limit."""
    pipeline, service, policy = _dawdling_swarm([view("a", 0, 10, step_ms_per_layer=1.0),
                                                 view("e", 10, 30, step_ms_per_layer=1.0)], slow="e", delay=2.0)  # fmt: skip
    slow_cpu = [view("a", 0, 10, step_ms_per_layer=100.0), view("e", 10, 20, step_ms_per_layer=100.0),
                view("c", 10, 20, step_ms_per_layer=100.0), view("b", 20, 30, step_ms_per_layer=100.0)]  # fmt: skip
    honest, honest_service, _ = _dawdling_swarm(slow_cpu, slow="a", delay=2.5)  # every route: 2.5 s a step

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            service.nursery = honest_service.nursery = nursery
            took = await _chat(pipeline, "s1", 12)()
            assert min(took) >= 2.0
            assert [h.node_id for h in pipeline.route_of(SessionId("s1")) or ()] == ["a", "e"]
            assert pipeline._sessions[SessionId("s1")].legs == 1
            assert not pipeline.health.avoided(trio.current_time()) and not pipeline.health.reliability()
            assert pipeline.deadline.seconds(1) <= 10.0  # step_factor x slow_floor_s
            took = await _chat(honest, "s2", 12)()
            assert min(took) >= 2.5 and honest._sessions[SessionId("s2")].legs == 1  # never moved
            assert not honest.health.avoided(trio.current_time())
            assert honest.deadline.seconds(1) > 10 * 2.0  # learnt as measured

    trio.run(main, clock=MockClock(autojump_threshold=0))


class _FramingHop(_AnsweringHops):
    """Peer ``framer`` sends the hop after it input that hop must refuse (NaN hidden states,
    or a position past what the session holds there): that honest hop answers every frame
    that came through the framer with ``code`` in its own name."""

    def __init__(self, me: str, framer: str, code: str) -> None:
        super().__init__(me, held=None)
        self.framer, self.code = PeerId(framer), code

    def refusal(self, msg: wire.Forward, peers: list[PeerId]) -> wire.Error | None:
        if self.framer not in peers[:-1]:
            return None
        victim = peers[peers.index(self.framer) + 1]
        return wire.Error(msg.req_id, msg.session_id, self.code, "hidden states must be finite", victim)  # type: ignore[arg-type]


@pytest.mark.parametrize("code", ["invalid_batch", "context_full"])
def test_a_hop_that_frames_the_hop_after_it_is_blamed_and_routed_around(code: str) -> None:
    """``h`` (10-20, on the cheapest route) sends ``b`` (20-30, its only holder) input ``b``
    must refuse. The refusal was read as the request's fault: ``b`` was blamed as a guess,
    the failover kept ``h`` in its prefix, the second refusal was the client's error (a 503
    naming ``b``), and every new chat went through ``h`` again (an audit, 2026-12-07). Now
    ``h`` and ``b`` are suspects together (``b`` could be lying), the failover goes round
    every suspect a route can do without (``h``), and so does the next session."""
    from node.sampling import SamplingParams
    from p2p.chain import SwarmPipeline

    views = [view("a", 0, 10), view("h", 10, 20), view("c", 10, 15), view("f", 15, 20), view("b", 20, 30)]
    assert [h.node_id for h in choose_route(views, MODEL, PeerId("a"))] == ["a", "h", "b"]  # one hop fewer
    service = _FramingHop("a", framer="h", code=code)
    policy = FailoverPolicy()
    pipeline = SwarmPipeline(service, MODEL, lambda: views, 512, {v.record.node_id: v for v in views}.get,  # type: ignore[arg-type]
                             policy=policy, health=PeerHealth(policy), rng=random.Random(1))  # fmt: skip
    greedy = SamplingParams(temperature=0.0)

    async def main() -> None:
        assert await pipeline.step(SessionId("s1"), 0, [1, 2, 3], greedy) == 7
        assert [h.node_id for h in pipeline.route_of(SessionId("s1")) or ()] == ["a", "c", "f", "b"]
        assert PeerId("h") in pipeline.health.avoided(trio.current_time())
        sent = len(service.sent)
        assert await pipeline.step(SessionId("s2"), 0, [1, 2, 3], greedy) == 7  # round h from the start
        assert [h.node_id for h in pipeline.route_of(SessionId("s2")) or ()] == ["a", "c", "f", "b"]
        assert PeerId("h") not in {peer for peer, msg in service.sent[sent:] if isinstance(msg, wire.Forward)}

    trio.run(main, clock=MockClock(autojump_threshold=0))


def test_a_refusal_blames_whoever_made_the_refused_input() -> None:
    """Token ids at the first hop are the request's (None: the client's error path); past it,
    the input is the hop before's work: it and the reporter are the suspects, never the
    entry itself."""
    from p2p.legs import refusal_suspects

    route = tuple(Hop(NodeId(n), PeerId(n), LayerRange(s, e)) for n, s, e in (("a", 0, 10), ("h", 10, 20), ("b", 20, 30)))
    leg = Leg(SessionId("s"), route, trio.open_memory_channel[object](1)[1])
    assert refusal_suspects(leg, PeerId("a"), PeerId("x")) is None  # the first hop: the request's token ids
    assert refusal_suspects(leg, PeerId("stranger"), PeerId("x")) is None
    assert refusal_suspects(leg, PeerId("b"), PeerId("x")) == {PeerId("h"), PeerId("b")}
    assert refusal_suspects(leg, PeerId("h"), PeerId("a")) == {PeerId("h")}  # fed by this entry's own stage
    assert refusal_suspects(leg, PeerId("b"), PeerId("b")) == {PeerId("h")}  # our own refusal: only who fed us


def test_a_report_about_a_hop_we_never_connected_to_is_checked_with_a_ping() -> None:
    """``e`` (10-20) reports ``b`` (20-30, its only holder) unreachable, and this entry holds
    no connection to ``b``: it never dialled it (a middle hop, past the latency round's
    targets). That was read as our own connection to ``b`` having ended: the report was
    believed for certain without a ping, ``b`` left out of every route, and the request was
    a 503 naming 20-30 (an audit, 2026-12-07). Now ``b`` is pinged (the probe dials): it
    answers, so its accuser is blamed and the step goes round it."""
    from node.sampling import SamplingParams
    from p2p.chain import SwarmPipeline

    views = [view("a", 0, 10), view("e", 10, 20), view("c", 10, 15), view("f", 15, 20), view("b", 20, 30)]
    service = _BlamingHop("a", liar="e")
    pinged: list[PeerId] = []

    async def dials(peer: PeerId) -> bool:
        pinged.append(peer)
        return True

    policy = FailoverPolicy()
    pipeline = SwarmPipeline(service, MODEL, lambda: views, 512, {v.record.node_id: v for v in views}.get,  # type: ignore[arg-type]
                             is_connected=lambda peer: peer != PeerId("b"), probe=dials, policy=policy,
                             health=PeerHealth(policy), rng=random.Random(1))  # fmt: skip

    async def main() -> None:
        assert await pipeline.step(SessionId("s1"), 0, [1, 2, 3], SamplingParams(temperature=0.0)) == 7
        assert pinged == [PeerId("b")]
        assert [h.node_id for h in pipeline.route_of(SessionId("s1")) or ()] == ["a", "c", "f", "b"]
        assert pipeline.health.avoided(trio.current_time()) == {PeerId("e")}

    trio.run(main, clock=MockClock(autojump_threshold=0))
