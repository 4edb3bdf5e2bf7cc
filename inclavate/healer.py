"""The peer's healer: watches the registry and moves this peer to a gap when elected.

The decision is :func:`p2p.healing.plan_heal` (pure, unit-tested); this loop adds time: a
plan must stand for ``settle_s`` before anyone acts, the elected peer drains (entry peers move
its sessions to the other holders of its span), checks that it is still the one elected,
then reloads on the gap. A peer that moved waits ``cooldown_s`` before it may move again.

Everyone waits for the elected mover, and for a peer draining a replicated span (a mover on
its way), and both are only records: one that never moves (a stranger's record with the
lowest id on a replicated span, or one saying it drains) held every gap of the model open
for as long as it was published. A peer waited on for ``stuck_s`` is passed over for
``pass_over_s`` (:func:`p2p.healing.plan_heal` leaves it out), so the next one is elected.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import trio

from inclavate.types import LayerRange, NodeId
from p2p.healing import Settle, heal_target, plan_heal, waited_on
from p2p.registry import NodeView

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HealConfig:
    enabled: bool = True
    settle_s: float = 4.0
    """How long a gap and its elected mover must stand unchanged before the mover acts: a
    peer that missed a few heartbeats (Degraded) and comes back moves nobody."""
    cooldown_s: float = 60.0
    """After moving, this peer stays put at least this long."""
    drain_s: float = 10.0
    """How long the mover waits for entry peers to move its sessions before it reloads."""
    check_s: float = 1.0
    stuck_s: float = 60.0
    """A peer others wait for (elected, or draining a replicated span) this long without the
    gap closing is passed over: an honest mover drains within ``drain_s`` after ``settle_s``,
    then announces Joining on the gap, which closes it."""
    pass_over_s: float = 600.0
    """How long a peer passed over counts for nothing in the election."""


MoveFn = Callable[[LayerRange, Callable[[], bool]], Awaitable[bool]]
"""Drain, confirm with the callable that this peer is still elected, reload on the range;
True when the peer moved."""


@dataclass
class Healer:
    me: NodeId
    n_layers: int
    capacity: int
    views: Callable[[], list[NodeView]]
    """This model's registry views."""
    can_move: Callable[[], bool]
    """False while this peer is stopping, reloading, idle or without a stage."""
    move: MoveFn
    config: HealConfig = HealConfig()
    _waiting: dict[NodeId, tuple[float, float]] = field(default_factory=dict)
    """Peers waited on: when first, and when last (a peer that stops and starts again within
    ``stuck_s`` keeps its first time)."""
    _passed_over: dict[NodeId, float] = field(default_factory=dict)
    """Peers passed over, until when."""

    def passed_over(self, now: float) -> frozenset[NodeId]:
        self._passed_over = {node: until for node, until in self._passed_over.items() if until > now}
        return frozenset(self._passed_over)

    def _watch(self, views: list[NodeView], now: float) -> None:
        """Time the peers everyone waits for; pass over those waited on ``stuck_s``."""
        for node in waited_on(views, self.n_layers, self.passed_over(now)):
            if node == self.me:
                continue
            first, last = self._waiting.get(node, (now, now))
            if now - last > self.config.stuck_s:
                first = now
            self._waiting[node] = (first, now)
            if now - first >= self.config.stuck_s:
                log.warning("peer %s was waited on for %.0f s to heal a gap; passing it over", node, now - first)
                self._passed_over[node] = now + self.config.pass_over_s
                del self._waiting[node]
        self._waiting = {n: (f, last) for n, (f, last) in self._waiting.items() if now - last <= self.config.stuck_s}

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        settle = Settle(self.config.settle_s)
        task_status.started()
        while True:
            await trio.sleep(self.config.check_s)
            now = trio.current_time()
            views = self.views()
            self._watch(views, now)
            if not self.can_move():
                settle.reset()
                continue
            plan = settle.observe(plan_heal(views, self.n_layers, self.passed_over(now)), now)
            if plan is None or plan.mover != self.me:
                continue
            target = heal_target(plan, self.capacity)
            log.info("layers %s have no holder; this peer is elected to move there (layers %s)", plan.gap, target)
            moved = await self.move(target, lambda: self.still_elected(target))
            settle.reset()
            if moved:
                await trio.sleep(self.config.cooldown_s)

    def still_elected(self, target: LayerRange) -> bool:
        """After draining: the gap is still open and this peer still the mover (its own
        draining flag, which makes others wait, is not held against it)."""
        views = [
            NodeView(v.record.replace(draining=False), v.state) if v.record.node_id == self.me else v
            for v in self.views()
        ]  # fmt: skip
        plan = plan_heal(views, self.n_layers, self.passed_over(trio.current_time()))
        return plan is not None and plan.mover == self.me and plan.gap.contains(target)
