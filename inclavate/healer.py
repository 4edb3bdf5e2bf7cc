"""The peer's healer: watches the registry and moves this peer to a gap when elected.

The decision is :func:`p2p.healing.plan_heal` (pure, unit-tested); this loop adds time: a
plan must stand for ``settle_s`` before anyone acts, the elected peer drains (entry peers move
its sessions to the other holders of its span), checks that it is still the one elected,
then reloads on the gap. A peer that moved waits ``cooldown_s`` before it may move again.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio

from inclavate.types import LayerRange, NodeId
from p2p.healing import Settle, heal_target, plan_heal
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

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        settle = Settle(self.config.settle_s)
        task_status.started()
        while True:
            await trio.sleep(self.config.check_s)
            if not self.can_move():
                settle.reset()
                continue
            plan = settle.observe(plan_heal(self.views(), self.n_layers), trio.current_time())
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
        plan = plan_heal(views, self.n_layers)
        return plan is not None and plan.mover == self.me and plan.gap.contains(target)
