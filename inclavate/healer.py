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

A look lists the model's views and runs the election: ~10 ms of the event loop at the
registry's 4,096 records, each second, idle or not. So a look keeps its answers with the
registry's heal key (:meth:`p2p.gossip.Registry.heal_key`, which heartbeats leave alone) and
the peers passed over, and works them out again only when one of those changed; the timers
(settle, stuck, pass over, cooldown) still run on every look.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import trio

from inclavate.types import LayerRange, NodeId
from p2p.healing import HealPlan, Settle, heal_target, plan_heal, waited_on
from p2p.registry import NodeView
from p2p.ticks import sleep_to_tick

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
    version: Callable[[], Hashable] | None = None
    """A key that changes whenever :attr:`views` may read differently for healing
    (:meth:`p2p.gossip.Registry.heal_key`): while it stands, a look reuses the last answers
    instead of listing the registry. None: every look lists it."""
    _answers: dict[str, tuple[Hashable, object]] = field(default_factory=dict)
    """The last look's answers (who is waited on, the plan), each with the key it was
    worked out under (two rows)."""
    _listed: tuple[Hashable, list[NodeView]] = (None, [])
    """The last views listed, with the key they were listed under."""
    _waiting: dict[NodeId, tuple[float, float]] = field(default_factory=dict)
    """Peers waited on: when first, and when last (a peer that stops and starts again within
    ``stuck_s`` keeps its first time)."""
    _passed_over: dict[NodeId, float] = field(default_factory=dict)
    """Peers passed over, until when."""

    def passed_over(self, now: float) -> frozenset[NodeId]:
        self._passed_over = {node: until for node, until in self._passed_over.items() if until > now}
        return frozenset(self._passed_over)

    def _watch(self, waited: list[NodeId], now: float) -> None:
        """Time the peers everyone waits for (``waited``, now); pass over those waited on
        ``stuck_s``."""
        for node in waited:
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

    def check(self, settle: Settle, now: float) -> HealPlan | None:
        """One look at ``now``: time the peers waited on, then the plan this peer should act
        on (it stood for ``settle_s`` and elects this peer), or None. The registry is listed
        at most once, and only when its heal key or the peers passed over changed since the
        answer they give was worked out."""
        key = self.version() if self.version is not None else None
        views = functools.cache(lambda: self._listing(key))
        passed_over = self.passed_over(now)
        self._watch(self._answer("waited", waited_on, key, views, passed_over), now)
        if not self.can_move():
            settle.reset()
            return None
        plan = settle.observe(self._answer("plan", plan_heal, key, views, self.passed_over(now)), now)
        return plan if plan is not None and plan.mover == self.me else None

    def _listing(self, key: Hashable) -> list[NodeView]:
        """The views, or those listed under the same key (one look asks for the plan with
        a peer just passed over, the next for who is waited on without it)."""
        if key is None or self._listed[0] != key:
            self._listed = (key, self.views())
        return self._listed[1]

    def _answer(self, name: str, ask: Callable[..., object], key: Hashable, views: Callable[[], list[NodeView]],
                passed_over: frozenset[NodeId]) -> Any:  # fmt: skip
        """``ask(views, n_layers, passed_over)``, or the answer it gave under the same key."""
        held = self._answers.get(name)
        if key is not None and held is not None and held[0] == (key, passed_over):
            return held[1]
        answer = ask(views(), self.n_layers, passed_over)
        self._answers[name] = ((key, passed_over), answer)
        return answer

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        settle = Settle(self.config.settle_s)
        task_status.started()
        while True:
            await sleep_to_tick(self.config.check_s)
            plan = self.check(settle, trio.current_time())
            if plan is None:
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
