"""Which layers a peer without ``--layers`` takes: a pure function of the registry.

First the largest uncovered gap (as much of it as the peer can hold); when nothing is
uncovered, the span where the swarm is weakest: fewest Ready replicas, then least
throughput, like Petals' block selection. Peers that join at the same moment see the same
table and may pick the same gap; :func:`should_move` detects that and moves all but one
(the deterministic tie-break: Ready peers and lower peer ids keep their place).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from inclavate.types import LayerRange, NodeId
from p2p.coverage import uncovered
from p2p.registry import NodeView

_HOLDS_LAYERS = ("Ready", "Joining")


def holders(views: Iterable[NodeView], model_n_layers: int) -> list[NodeView]:
    """Nodes that hold (or are loading) their layers and will keep serving them: not idle,
    not draining (a draining node is leaving its layers), not silent (Degraded or Dead)."""
    return [
        v for v in views
        if v.state in _HOLDS_LAYERS and not v.record.idle and not v.record.draining
        and v.record.n_layers == model_n_layers
    ]  # fmt: skip


def largest_gap(gaps: Iterable[LayerRange]) -> LayerRange:
    """The gap to fill first: the widest, the lowest among equals."""
    return max(gaps, key=lambda g: (len(g), -g.start))


def choose_range(views: Iterable[NodeView], n_layers: int, capacity: int) -> LayerRange:
    """The range a newcomer able to hold ``capacity`` layers should take."""
    if capacity < 1:
        raise ValueError("a peer must be able to hold at least one layer")
    width = min(capacity, n_layers)
    serving = holders(views, n_layers)
    gaps = uncovered((v.record.layers for v in serving), n_layers)
    if gaps:
        gap = largest_gap(gaps)
        return LayerRange(gap.start, min(gap.end, gap.start + width))
    replicas = [0] * n_layers
    throughput = [0.0] * n_layers
    for v in serving:
        for layer in range(v.record.start_layer, v.record.end_layer):
            replicas[layer] += v.state == "Ready"
            throughput[layer] += v.record.throughput_tps
    # Compare windows by their *sorted* per-layer strength, lexicographically (Petals'
    # rule): the window whose weakest layers are weakest wins, and among windows equally
    # weak at their worst, the one with more weak layers.
    best = min(
        range(n_layers - width + 1),
        key=lambda s: (sorted(replicas[s : s + width]), sorted(throughput[s : s + width]), s),
    )
    return LayerRange(best, best + width)


def should_move(
    views: Sequence[NodeView], me: NodeId, mine: LayerRange, n_layers: int, capacity: int
) -> LayerRange | None:
    """A better range for a joining peer whose choice collided with others, or None.

    A peer moves only when everything it holds is also held by *senior* nodes (Ready ones,
    and joining ones with a lower id) while some layers are held by nobody: then its
    layers are redundant and the gap is not. Of several peers on one gap exactly one (the
    most senior) stays; the others re-run placement without themselves, so they fan out.
    """
    others = [v for v in holders(views, n_layers) if v.record.node_id != me]
    if not uncovered((v.record.layers for v in others), n_layers):
        return None
    senior = [v.record.layers for v in others if v.state == "Ready" or v.record.node_id < me]
    if any(gap.overlaps(mine) for gap in uncovered(senior, n_layers)):
        return None
    moved = choose_range(others, n_layers, capacity)
    return moved if moved != mine else None
