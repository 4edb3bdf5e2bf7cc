"""Self-placement: a pure function of the registry table."""

from __future__ import annotations

from registry_helpers import view

from inclavate.types import LayerRange, NodeId
from p2p.placement import choose_range, should_move


def test_first_peer_takes_the_start_of_the_model() -> None:
    assert choose_range([], 30, 12) == LayerRange(0, 12)
    assert choose_range([], 30, 100) == LayerRange(0, 30)


def test_the_largest_gap_is_filled_first() -> None:
    views = [view("a", 0, 5), view("b", 10, 12)]  # gaps 5-10 and 12-30
    assert choose_range(views, 30, 12) == LayerRange(12, 24)
    assert choose_range(views, 30, 100) == LayerRange(12, 30)


def test_joining_peers_count_as_holders_and_idle_or_dead_do_not() -> None:
    assert choose_range([view("a", 0, 12, "Joining")], 30, 12) == LayerRange(12, 24)
    assert choose_range([view("a", 0, 12, "Dead")], 30, 12) == LayerRange(0, 12)
    assert choose_range([view("a", 0, 12, idle=True)], 30, 12) == LayerRange(0, 12)


def test_without_gaps_the_weakest_span_gets_help() -> None:
    # Layers 20-30 have one replica, the rest two: reinforce the end.
    views = [view("a", 0, 20), view("b", 0, 20), view("c", 20, 30)]
    assert choose_range(views, 30, 10) == LayerRange(20, 30)
    # Equal replicas: least throughput wins.
    views = [view("a", 0, 15, throughput_tps=50.0), view("b", 15, 30, throughput_tps=5.0)]
    assert choose_range(views, 30, 15) == LayerRange(15, 30)


def test_three_peers_joining_at_once_fan_out_to_cover_everything() -> None:
    """Each round every peer sees the others' Joining records and applies should_move."""
    ranges = {NodeId(n): choose_range([], 30, 12) for n in ("p1", "p2", "p3")}
    for _ in range(5):
        table = [view(n, r.start, r.end, "Joining") for n, r in ranges.items()]
        moves = {n: should_move(table, n, r, 30, 12) for n, r in ranges.items()}
        ranges = {n: moves[n] or r for n, r in ranges.items()}
    covered = sorted(ranges.values())
    assert covered == [LayerRange(0, 12), LayerRange(12, 24), LayerRange(24, 30)]


def test_a_peer_with_unique_layers_or_no_gap_elsewhere_stays() -> None:
    table = [view("p1", 0, 12, "Joining"), view("p2", 12, 24, "Joining")]
    assert should_move(table, NodeId("p2"), LayerRange(12, 24), 30, 12) is None
    full = [view("p1", 0, 30), view("p2", 0, 30, "Joining")]
    assert should_move(full, NodeId("p2"), LayerRange(0, 30), 30, 30) is None


def test_the_senior_peer_keeps_its_place() -> None:
    table = [view("p1", 0, 12, "Joining"), view("p2", 0, 12, "Joining")]
    assert should_move(table, NodeId("p1"), LayerRange(0, 12), 30, 12) is None
    assert should_move(table, NodeId("p2"), LayerRange(0, 12), 30, 12) == LayerRange(12, 24)
    # A Ready peer is senior whatever its id.
    table = [view("z9", 0, 12, "Ready"), view("a1", 0, 12, "Joining")]
    assert should_move(table, NodeId("a1"), LayerRange(0, 12), 30, 12) == LayerRange(12, 24)
