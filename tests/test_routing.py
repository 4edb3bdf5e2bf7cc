"""Route choice: cheapest chain of meeting ranges, fewer hops, random among equals."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from registry_helpers import MODEL, view

from inclavate.types import LayerRange, PeerId
from p2p.routing import CostModel, NoRoute, choose_route


def ranges(route) -> list[LayerRange]:
    return [h.layers for h in route]


def test_a_simple_chain() -> None:
    views = [view("a", 0, 10), view("b", 10, 20), view("c", 20, 30)]
    assert ranges(choose_route(views, MODEL, PeerId("a"))) == [LayerRange(0, 10), LayerRange(10, 20), LayerRange(20, 30)]


def test_fewer_hops_win_between_equal_compute() -> None:
    views = [view("a", 0, 10), view("b", 10, 20), view("c", 20, 30), view("d", 10, 30)]
    assert ranges(choose_route(views, MODEL, PeerId("x"))) == [LayerRange(0, 10), LayerRange(10, 30)]


def test_faster_nodes_and_closer_links_win() -> None:
    views = [view("a", 0, 30, step_ms_per_layer=2.0), view("b", 0, 30, step_ms_per_layer=0.5)]
    assert choose_route(views, MODEL, PeerId("x"))[0].node_id == "b"
    views = [view("a", 0, 30), view("b", 0, 30)]
    costs = CostModel(link_ms={PeerId("a"): 50.0, PeerId("b"): 1.0})
    assert choose_route(views, MODEL, PeerId("x"), costs)[0].node_id == "b"
    # The entry peer's own range has no link cost at all.
    assert choose_route(views, MODEL, PeerId("a"), costs)[0].node_id == "a"


def test_ties_are_broken_at_random_so_load_spreads() -> None:
    views = [view("a", 0, 30), view("b", 0, 30), view("c", 0, 30)]
    rng = random.Random(0)
    picks = Counter(choose_route(views, MODEL, PeerId("x"), rng=rng)[0].node_id for _ in range(300))
    assert set(picks) == {"a", "b", "c"} and min(picks.values()) > 60


def test_only_ready_and_active_nodes_are_routed() -> None:
    views = [view("a", 0, 30, "Degraded"), view("b", 0, 30, idle=True), view("c", 0, 30, "Joining"), view("d", 0, 30)]
    assert choose_route(views, MODEL, PeerId("x"))[0].node_id == "d"


def test_no_route_names_the_missing_layers() -> None:
    with pytest.raises(NoRoute, match="layers 10-20 have no Ready node"):
        choose_route([view("a", 0, 10), view("b", 20, 30)], MODEL, PeerId("x"))
    with pytest.raises(NoRoute, match="ranges meet"):
        choose_route([view("a", 0, 12), view("b", 10, 30)], MODEL, PeerId("x"))
    with pytest.raises(NoRoute, match="no node serves it"):
        choose_route([], MODEL, PeerId("x"))


def test_a_claim_of_being_faster_cannot_draw_every_session() -> None:
    # A record claiming 0.0001 ms per layer (10,000x faster) is believed only as fast as the
    # reference: sessions keep spreading over the honest replicas.
    views = [view("a", 0, 30, step_ms_per_layer=1.0), view("b", 0, 30, step_ms_per_layer=1.0),
             view("liar", 0, 30, step_ms_per_layer=0.0001)]  # fmt: skip
    rng = random.Random(0)
    picks = Counter(choose_route(views, MODEL, PeerId("x"), rng=rng)[0].node_id for _ in range(300))
    assert set(picks) == {"a", "b", "liar"} and max(picks.values()) < 150
    # What this peer measured itself is the reference when it has one.
    costs = CostModel(measured_step_ms=3.0)
    slow = [view("a", 0, 30, step_ms_per_layer=9.0), view("liar", 0, 30, step_ms_per_layer=0.0001), view("b", 0, 30)]
    picks = Counter(choose_route(slow, MODEL, PeerId("x"), costs, rng=rng)[0].node_id for _ in range(200))
    assert "a" not in picks and min(picks.values()) > 60


def test_the_latency_monitor_pings_a_bounded_number_of_peers_a_round_each_in_turn() -> None:
    """Every routable peer every 10 s was ~400 pings a second, and a stream and a connection
    to each, at 4,096 peers: past ``max_per_round`` the targets take turns, every one still
    measured every few rounds; a small swarm is pinged whole every round, as before."""
    from p2p.latency import LatencyMonitor

    monitor = LatencyMonitor(None, lambda: [], max_per_round=64)  # type: ignore[arg-type]
    small = [PeerId(f"p{i:02d}") for i in range(10)]
    assert monitor.this_round(small) == small and monitor.this_round(small) == small
    many = [PeerId(f"p{i:04d}") for i in range(200)]
    rounds = [monitor.this_round(many) for _ in range(4)]  # ceil(200 / 64)
    assert all(len(batch) == 64 for batch in rounds)
    assert set().union(*rounds) == set(many)


def test_the_latency_monitor_pings_a_measured_peer_every_refresh_a_new_or_failed_one_every_round() -> None:
    """Pinging every route candidate every 10 s was a fifth of an idle chain peer's CPU: an
    answering peer is pinged every ``refresh`` (30 s); one never measured, or whose last
    ping failed, still every round."""
    from p2p.latency import UNREACHABLE_MS, LatencyMonitor

    monitor = LatencyMonitor(None, lambda: [], interval=10.0, refresh=30.0)  # type: ignore[arg-type]
    fresh, answering, failed = PeerId("fresh"), PeerId("answering"), PeerId("failed")
    monitor.rtt_ms = {answering: 1.5, failed: UNREACHABLE_MS}
    monitor._measured_at = {answering: 100.0, failed: 100.0}
    due = [[p for p in (fresh, answering, failed) if monitor.due(p, 100.0 + 10 * k)] for k in range(1, 4)]
    assert due == [[fresh, failed], [fresh, failed], [fresh, answering, failed]]
