"""``p2p.pace`` against steps measured on an honest busy chain, and against a sub-second dawdler."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from p2p.failover import FailoverPolicy
from p2p.pace import Pace

HONEST = Path(__file__).parent / "data" / "pace_honest_8_sessions.csv"
OLD = FailoverPolicy(slow_floor_s=1.0, slow_settle_steps=0)
"""The thresholds before 2026-12-06: 1 s for every step."""


def honest_sessions() -> list[list[tuple[float, float]]]:
    """Each session's decode steps (seconds, what its route's records predicted), in order."""
    sessions: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for line in HONEST.read_text().splitlines()[3:]:
        session, seconds, expected = line.split(",")
        sessions[int(session)].append((float(seconds), float(expected)))
    return list(sessions.values())


def moved(policy: FailoverPolicy, steps: list[tuple[float, float]]) -> bool:
    pace = Pace(policy)
    for seconds, expected in steps:
        pace.judge(1, seconds, lambda e=expected: e)
        if pace.too_slow:
            return True
    return False


def test_an_honest_busy_route_is_not_left() -> None:
    """8 sessions arriving at once on a chain whose three peers share one core: a session's
    first steps queue behind the others' prompts (750, 772, 604 ms against a claimed 33 ms),
    which the 0.25 s floor alone would take for a dawdler; the settling steps' 1 s floor
    does not, and past them no session comes near a verdict."""
    sessions = honest_sessions()
    assert len(sessions) == 8 and all(len(s) > 100 for s in sessions)
    assert not any(moved(FailoverPolicy(), s) for s in sessions)
    assert any(moved(FailoverPolicy(slow_settle_steps=0), s) for s in sessions)  # why the first steps settle
    assert not any(moved(FailoverPolicy(), s[4:]) for s in sessions)


def test_a_hop_adding_under_a_second_to_every_step_is_judged_slow() -> None:
    """A hop holding each step of a route that costs 25 ms (records and all) for 0.6 s more:
    24x slower, and under the old 1 s floor never slow. Now the leg is judged slow after
    its settling steps and three more."""
    dawdled = [(0.025 + 0.6, 0.025)] * 16
    assert not moved(OLD, dawdled)
    pace = Pace(FailoverPolicy())
    verdict = None
    for i, (seconds, expected) in enumerate(dawdled, start=1):
        assert pace.judge(1, seconds, lambda e=expected: e) == (seconds if i <= 4 else 0.25)  # the deadline learns the limit
        if pace.too_slow:
            verdict = i
            break
    assert verdict == 4 + 3
    # A hop holding every step past the settling floor is still judged on its first steps.
    pace = Pace(FailoverPolicy())
    for _ in range(3):
        pace.judge(1, 1.5, lambda: 0.025)
    assert pace.too_slow
    # A reset (a new leg) settles again.
    pace.reset()
    for _ in range(4):
        pace.judge(1, 0.6, lambda: 0.025)
    assert not pace.too_slow
