"""Healing a gap: which peer moves to layers nobody serves any more. Pure, like placement.

A *gap* is a run of layers no serving holder covers (:func:`p2p.placement.holders`: Ready or
Joining, not idle, not draining; a silent peer stops counting once it is Degraded). A peer
is *spare* when it is Ready and every layer it holds has at least one other Ready holder:
it can leave without opening a new gap (legacy HTTP nodes never move: their range is fixed
at registration). Of the spare peers, the one whose span is the most
replicated moves (ties: the lowest node id), to the largest gap (ties: the lowest start):
every peer that sees the same table elects the same mover, so one gap gets one mover.

Why the swarm cannot oscillate: a move needs a gap and never opens one, so every move
strictly shrinks the uncovered layers; healing never rebalances a complete swarm. Around
that, three guards absorb the moments when peers' tables disagree:

* *settle* (:class:`Settle`): a plan acts only after it stood unchanged for a while, so a
  peer that missed a few heartbeats and comes back moves nobody;
* *one mover at a time*: while a spare peer is draining (a mover on its way, or a volunteer
  leaving a replicated span) nobody else moves;
* *cooldown*: a peer that moved does not move again for a while (the healer's loop).

A record costs nothing, so a peer elected to move, or draining a replicated span, may never
move: the healer's loop passes such a peer over (``passed_over``: left out of the table
here, its layers, its replicas and its election) once it has stood in the way too long.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from inclavate.types import LayerRange, NodeId
from p2p.coverage import uncovered
from p2p.placement import holders, largest_gap
from p2p.registry import NodeView


@dataclass(frozen=True)
class HealPlan:
    gap: LayerRange
    """The layers nobody serves (the largest such run)."""
    mover: NodeId
    """The peer elected to move there."""


def replicas(views: Iterable[NodeView], n_layers: int) -> list[int]:
    """Ready serving holders per layer."""
    count = [0] * n_layers
    for v in holders(views, n_layers):
        if v.state == "Ready":
            for layer in range(v.record.start_layer, min(v.record.end_layer, n_layers)):
                count[layer] += 1
    return count


def _spare(view: NodeView, count: Sequence[int]) -> bool:
    """Every layer of ``view`` has another Ready holder (``count`` includes ``view``)."""
    return min(count[view.record.start_layer : view.record.end_layer]) >= 2


def in_motion(views: Sequence[NodeView], n_layers: int) -> list[NodeId]:
    """Ready peers draining a span that others also hold: movers on their way (or volunteers
    leaving a replicated span). Their targets are not announced yet, so wait for them."""
    count = replicas(views, n_layers)
    return [
        v.record.node_id for v in views
        if v.state == "Ready" and v.record.draining and not v.record.idle and v.record.n_layers == n_layers
        and not v.record.relayed  # a legacy node never moves: one "draining" is nobody on the way
        and min(count[v.record.start_layer : v.record.end_layer]) >= 1
    ]  # fmt: skip


def waited_on(views: Sequence[NodeView], n_layers: int, passed_over: Collection[NodeId] = frozenset()) -> list[NodeId]:
    """While a gap is open: the peers every other peer waits for (those :func:`in_motion`, or
    else the elected mover)."""
    views = [v for v in views if v.record.node_id not in passed_over]
    if not _gaps(holders(views, n_layers), n_layers):
        return []
    moving = in_motion(views, n_layers)
    if moving:
        return moving
    plan = plan_heal(views, n_layers)
    return [plan.mover] if plan is not None else []


def plan_heal(views: Sequence[NodeView], n_layers: int, passed_over: Collection[NodeId] = frozenset()) -> HealPlan | None:
    """The gap to heal and the peer that should move there, or None (no gap, nobody spare,
    or a move already under way). Peers ``passed_over`` count for nothing."""
    views = [v for v in views if v.record.node_id not in passed_over]
    serving = holders(views, n_layers)
    gaps = _gaps(serving, n_layers)
    if not gaps or in_motion(views, n_layers):
        return None
    # Only peers' own nodes make another spare: anyone may register a legacy node for a peer to
    # relay, and one on an honest sole holder's span had that holder drain and move, then
    # vanished, leaving a real gap, span after span (an audit, 2026-12-07).
    count = replicas([v for v in views if not v.record.relayed], n_layers)
    spare = [v for v in serving if v.state == "Ready" and not v.record.relayed and _spare(v, count)]
    if not spare:
        return None
    mover = min(spare, key=lambda v: (-min(count[v.record.start_layer : v.record.end_layer]), v.record.node_id))
    return HealPlan(largest_gap(gaps), mover.record.node_id)


def _gaps(serving: Iterable[NodeView], n_layers: int) -> list[LayerRange]:
    """The layers no view in ``serving`` covers, each distinct range marked once: the healer
    asks twice a second, and marking every record's layers (a range object each) took ~4 ms
    of the event loop per ask at 4,096 records (tests/test_healing.py::test_gaps_mark_each_distinct_range_once)."""
    spans = {(v.record.start_layer, v.record.end_layer) for v in serving}
    return uncovered((LayerRange(start, end) for start, end in spans), n_layers)


def heal_target(plan: HealPlan, capacity: int) -> LayerRange:
    """The layers the mover takes: the gap from its start, as much as the mover can hold
    (a gap wider than that stays partly open and elects the next mover)."""
    if capacity < 1:
        raise ValueError("a peer must be able to hold at least one layer")
    return LayerRange(plan.gap.start, min(plan.gap.end, plan.gap.start + capacity))


class Settle:
    """Acts on a plan only once it has stood unchanged for ``settle_s`` (pure: the caller
    passes the clock). Any change (another gap, another mover, no plan) starts over."""

    def __init__(self, settle_s: float) -> None:
        self.settle_s = settle_s
        self._plan: HealPlan | None = None
        self._since = 0.0

    def observe(self, plan: HealPlan | None, now: float) -> HealPlan | None:
        if plan != self._plan:
            self._plan, self._since = plan, now
        if plan is not None and now - self._since >= self.settle_s:
            return plan
        return None

    def reset(self) -> None:
        self._plan = None
