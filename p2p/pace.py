"""Whether a session's route serves as fast as its hops say it should.

A hop that holds every step for just under the step deadline fails nothing the other checks
see: it answers pings, errs never, and its answers raised the shared deadline with it (a
2 s delay made an 8-token chat take 16 s, and the next session was routed through it
again). Its record still claims its engine's honest speed, since the delay is outside the
engine. So the entry holds each leg's decode steps to what the route's records and links
say a step costs (:func:`p2p.routing.route_step_ms`): a step slower than
``max(slow_floor_s, slow_factor x expected)`` is slow (``slow_settle_floor_s`` instead of
``slow_floor_s`` for a leg's first ``slow_settle_steps``: they queue behind the prompts of
the sessions that arrived with them); a leg with ``slow_steps`` slow ones
among its last ``slow_window`` decode steps is left at the next step boundary when another
route exists (``SwarmPipeline._leave_slow``). A slow step teaches the shared deadline only
that limit, so a dawdler cannot stretch every session's deadline to ten times its delay.

Prefill and replay steps (more than ``DECODE_TOKENS`` tokens) are never judged: records
claim decode steps only. Nor are steps when nothing was measured (``expected`` None)."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from p2p.failover import DECODE_TOKENS, FailoverPolicy

log = logging.getLogger(__name__)


def tracing() -> bool:
    """Whether every step is logged against what its route should cost (``INCLAVATE_DEBUG=p2p.pace``):
    what ``scripts/bench_pace.py`` measures honest routes' ratios from. Off, a step costs no lookup."""
    return log.isEnabledFor(logging.DEBUG)


def trace(session: str, tokens: int, seconds: float, expected: float | None) -> None:
    """One answered step: its tokens, its seconds, and what the route's records say a decode step costs."""
    log.debug("pace session=%s tokens=%d seconds=%.6f expected=%s", session, tokens, seconds,
              "none" if expected is None else f"{expected:.6f}")  # fmt: skip


@dataclass
class Pace:
    """One leg's recent decode steps: slow or not."""

    policy: FailoverPolicy = field(default_factory=FailoverPolicy)
    _slow: deque[bool] = field(init=False)
    _steps: int = 0
    """Decode steps judged since the leg began (or the last reset): the first few settle."""

    def __post_init__(self) -> None:
        self._slow = deque(maxlen=self.policy.slow_window)

    def judge(self, tokens: int, seconds: float, expected_s: Callable[[], float | None]) -> float:
        """Note a step of ``tokens`` answered after ``seconds``; returns the seconds the shared
        step deadline may learn from it (capped at the slow limit). ``expected_s`` (what the
        route says a step costs) is asked only about a step slower than the floor: the fast
        steps of an honest route cost no lookup."""
        if tokens > DECODE_TOKENS:
            return seconds
        floor = self.floor_s
        self._steps += 1
        expected = expected_s() if seconds > floor else None
        if expected is None:
            self._slow.append(False)
            return seconds
        limit = max(floor, self.policy.slow_factor * expected)
        self._slow.append(seconds > limit)
        return min(seconds, limit)

    @property
    def floor_s(self) -> float:
        """The next decode step's floor: ``slow_settle_floor_s`` for a leg's first
        ``slow_settle_steps`` ones (they queue behind the prompts that arrived with them),
        ``slow_floor_s`` after."""
        p = self.policy
        return p.slow_settle_floor_s if self._steps < p.slow_settle_steps else p.slow_floor_s

    @property
    def too_slow(self) -> bool:
        return sum(self._slow) >= self.policy.slow_steps

    def reset(self) -> None:
        """A new leg (or a decision taken on this one's steps): judge afresh, settling again."""
        self._slow.clear()
        self._steps = 0
