"""Failover policy, as pure pieces the entry peer's pipeline (``p2p.chain``) composes.

- :class:`FailoverPolicy`: how many failovers a request may use, how long a step may take.
- :class:`StepDeadline`: the adaptive per-step deadline. A hop that stops answering is
  noticed within seconds, not a fixed two minutes, because the deadline follows measured
  step times: ``max(min_step_s, factor x expected)``, where ``expected`` is the decode step
  time for a one-token step and tokens x per-token time for a prefill, both moving averages
  of this entry's own answers. Before anything is measured the ceiling applies.
- :class:`PeerHealth`: peers that failed this entry's sessions are avoided for a while
  (capped exponential backoff, like Petals' ``on_request_failure``) and their measured
  reliability divides their routing weight; peers seen gone for certain are left out of
  every route for a short while; peers that served a session of this entry to its end are
  *proven* (:meth:`PeerHealth.proven`), which routing prefers (``p2p.chain``: probation).
- :func:`hop_trouble`: what the registry says about one hop of a live route.

Everything here takes the time as an argument, so the rules are unit-tested without sleeping.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from inclavate.types import PeerId
from p2p.registry import NodeView
from p2p.routing import Hop


@dataclass(frozen=True)
class FailoverPolicy:
    max_failovers: int = 3
    """Route changes after a failure, per request; one more failure is the client's error."""
    max_step_s: float = 120.0
    """Deadline of a step before anything has been measured, and the ceiling after."""
    min_step_s: float = 5.0
    """Floor of the adaptive deadline: a busy stage (another session's long prefill batched
    before our step, a GC pause) must not look dead."""
    step_factor: float = 10.0
    """Deadline = this many times the expected time of the step."""
    poll_s: float = 0.1
    """While a step is out, how often the registry and connections are looked at."""
    disconnect_grace_s: float = 0.3
    """A hop we were connected to is failed once its connection is gone this long (a quick
    reconnect is reported before the old connection's close)."""
    probe_timeout_s: float = 2.0
    """After a deadline: hops that do not answer a ping within this are the stalled ones."""
    no_route_wait_s: float = 5.0
    """A failover that finds no route re-reads the registry this long before giving up: a
    starved event loop sees every record as stale for a moment, and a gap may be healing."""
    avoid_s: float = 10.0
    """A failed peer is avoided for new routes this long, doubling per further failure..."""
    avoid_max_s: float = 300.0
    """...up to this."""
    gone_s: float = 10.0
    """A peer seen gone for certain (our link or connection to it ended, a stream to it could
    not be opened) is left out of every route this long, even where no route exists without
    it (an avoided peer is only a last choice): the registry calls a killed peer Degraded only
    ~6 s after its last heartbeat, and until then it still looks Ready."""
    span_replay: bool = True
    """Rebuild only the replaced span from the outputs kept by the hop before it, keeping the
    cache of every other hop; False replays every processed token through the whole new route."""
    adopt_timeout_s: float = 5.0
    """How long the kept hops get to confirm what they hold before the whole route is replayed."""
    slow_factor: float = 8.0
    """A decode step is *slow* when it takes more than this many times what its route's hops
    say it costs (``p2p.pace``)... Measured (``scripts/bench_pace``): honest steps of a
    loaded chain stray far from their records only while a long prompt is prefilled on a
    CPU the stages share (then nothing under ~49x is safe); a smaller factor moved more of
    those sessions and nothing else, so it stays."""
    slow_floor_s: float = 0.25
    """...and more than this. Measured: an honest 3-peer chain sharing one core, 1 or 8
    sessions streaming, never had 3 steps of 8 over 0.25 s; its steps over it were single
    (start-up, another session's prompt). Lower, a home link's jitter (tens, rarely hundreds
    of ms) could add up to a verdict. Was 1 s: a hop adding 0.9 s to each 15 ms step went free."""
    slow_settle_steps: int = 4
    """A leg's first this many decode steps are held to ``slow_settle_floor_s`` instead: they
    queue behind the prompts of sessions that arrived with them, and the records lag a
    heartbeat behind a load change. Measured: 8 sessions arriving at once on a chain sharing
    one core, one's first steps took 750, 772 and 604 ms (its route claimed 33 ms); past its
    first 4, no 8 steps of any session held 3 over 284 ms."""
    slow_settle_floor_s: float = 1.0
    """The floor of those first steps (as before 2026-12-06 for every step)."""
    slow_steps: int = 3
    """A session whose last ``slow_window`` decode steps hold this many slow ones moves to
    another route, if one exists, blaming the route's hops as a guess..."""
    slow_window: int = 8
    slow_moves: int = 2
    """...at most this many times (not failovers: a route that is merely slow still serves)."""
    trial_share: float = 1 / 8
    """Probation: while a route through peers that have served this entry exists, a new
    session goes through a peer that has not (a volunteer new to this entry, or a stranger's
    fresh identity) only this share of the time. Not 0: an honest newcomer must still get
    sessions to prove itself (one session it serves to the end does), and replicas share
    load only once proven. Not 1: a record of a fresh identity claiming the whole model is
    always the cheapest route (one hop), and drew every chat of the entry (an audit,
    2026-12-07). A failover always tries proven peers first (:meth:`PeerHealth.proven`)."""

    def __post_init__(self) -> None:
        if self.max_failovers < 0:
            raise ValueError("max_failovers must be at least 0")
        if not 0 < self.min_step_s <= self.max_step_s:
            raise ValueError("need 0 < min_step_s <= max_step_s")
        if not 0 < self.slow_steps <= self.slow_window:
            raise ValueError("need 0 < slow_steps <= slow_window")
        if self.slow_settle_steps < 0 or self.slow_settle_floor_s < self.slow_floor_s:
            raise ValueError("need slow_settle_steps >= 0 and slow_settle_floor_s >= slow_floor_s")
        if not 0 <= self.trial_share <= 1:
            raise ValueError("trial_share must be between 0 and 1")


DECODE_TOKENS = 4
"""Steps this short are decode steps: their time is per step, not per token."""
_ALPHA = 0.2


@dataclass
class StepDeadline:
    """Seconds to wait for a step's answer, from this entry's measured step times."""

    policy: FailoverPolicy = field(default_factory=FailoverPolicy)
    step_s: float | None = None
    """Moving average of a decode step's round trip."""
    token_s: float | None = None
    """Moving average of the time per token of multi-token steps (prefill, replay)."""

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= DECODE_TOKENS:
            self.step_s = _ema(self.step_s, seconds)
        else:
            self.token_s = _ema(self.token_s, seconds / tokens)

    def seconds(self, tokens: int) -> float:
        """The deadline for a step with ``tokens`` unanswered tokens in flight."""
        expected = self.step_s if tokens <= DECODE_TOKENS else None
        if tokens > DECODE_TOKENS and self.token_s is not None:
            expected = tokens * self.token_s + (self.step_s or 0.0)
        if expected is None:
            return self.policy.max_step_s
        p = self.policy
        return min(p.max_step_s, max(p.min_step_s, p.step_factor * expected))


def _ema(previous: float | None, sample: float) -> float:
    return sample if previous is None else (1 - _ALPHA) * previous + _ALPHA * sample


_MAX_TRACKED = 4096
"""Peers remembered; beyond that, the ones fully recovered are forgotten first."""
_MAX_PROVEN = 4096
"""Proven peers remembered; beyond that, the one that served longest ago is forgotten (it
is on probation again, no worse). Only a peer this entry routed a whole session through
gets in, so a stranger grows the set no faster than sessions end through its identities."""


@dataclass
class _Record:
    reliability: float = 1.0
    strikes: int = 0
    avoid_until: float = 0.0
    gone_until: float = 0.0
    gone_started_ms: int | None = None
    """The ``started_ms`` of the peer's record when it was seen gone: a record that names
    another start is the peer restarted, back before ``gone_s`` is over."""


def _restarted(peer: PeerId, rec: _Record, started_ms: Mapping[PeerId, int]) -> bool:
    now_started = started_ms.get(peer)
    return None not in (rec.gone_started_ms, now_started) and now_started != rec.gone_started_ms


class PeerHealth:
    """This entry's experience of other peers: who to avoid, how far to trust each."""

    def __init__(self, policy: FailoverPolicy = FailoverPolicy()) -> None:
        self.policy = policy
        self._peers: dict[PeerId, _Record] = {}
        self._proven: dict[PeerId, None] = {}
        """Peers that served a session to its end, the latest last (an ordered set)."""

    def failed(self, peer: PeerId, now: float, *, gone: bool = False, started_ms: int | None = None) -> None:
        """``peer`` failed a session; ``gone``: it was seen gone for certain (see :meth:`gone`),
        while its record said it had started at ``started_ms``."""
        rec = self._peers.setdefault(peer, _Record())
        rec.strikes += 1
        rec.reliability *= 1 - _ALPHA
        backoff = self.policy.avoid_s * 2 ** min(rec.strikes - 1, 16)
        rec.avoid_until = now + min(self.policy.avoid_max_s, backoff)
        if gone:
            rec.gone_until = now + self.policy.gone_s
            rec.gone_started_ms = started_ms
        self._bound(now)

    def served(self, peers: Iterable[PeerId]) -> None:
        """A session ended normally through these peers: trust them a little more, and
        count them proven (:meth:`proven`)."""
        for peer in peers:
            self._proven.pop(peer, None)
            self._proven[peer] = None
            if len(self._proven) > _MAX_PROVEN:
                del self._proven[next(iter(self._proven))]
            rec = self._peers.get(peer)
            if rec is not None:
                rec.strikes = 0
                rec.gone_until = 0.0
                rec.reliability += _ALPHA * (1 - rec.reliability)

    def proven(self) -> frozenset[PeerId]:
        """Peers (relayed nodes by their ids, :attr:`p2p.routing.Hop.blame_id`) that served
        a session of this entry to its end at least once. A fresh identity costs nothing
        and starts trusted in every other respect (reliability 1, never avoided); having
        served is what it cannot fake without carrying sessions, so routing prefers these
        (probation, ``p2p.chain``). A proven peer that later fails is avoided as before."""
        return frozenset(self._proven)

    def avoided(self, now: float) -> frozenset[PeerId]:
        """Peers to route around while a route exists without them."""
        return frozenset(p for p, r in self._peers.items() if r.avoid_until > now)

    def gone(self, now: float, started_ms: Mapping[PeerId, int] | None = None) -> frozenset[PeerId]:
        """Peers seen gone for certain less than ``gone_s`` ago: never routed through, not even
        when no route exists without them (then the answer is the 503 naming the layers).

        ``started_ms`` (each peer's start as its current record says) lets a peer restarted
        since back in at once: a volunteer who restarts the only holder of a range should not
        find every request refused for seconds after it says Ready. Only the peer itself
        signs its start, so a false one brings back no one but its signer."""
        started_ms = started_ms or {}
        return frozenset(p for p, r in self._peers.items() if r.gone_until > now and not _restarted(p, r, started_ms))

    def restarted(self, peers: Iterable[PeerId], started_ms: Mapping[PeerId, int]) -> frozenset[PeerId]:
        """Those of ``peers`` seen gone for certain whose current record names another start
        than the one they had then: restarted since, so no longer to be left out for failing."""
        return frozenset(p for p in peers if (r := self._peers.get(p)) is not None and _restarted(p, r, started_ms))

    def reliability(self) -> dict[PeerId, float]:
        return {p: r.reliability for p, r in self._peers.items() if r.reliability < 1.0}

    def _bound(self, now: float) -> None:
        if len(self._peers) <= _MAX_TRACKED:
            return
        by_trust = sorted(self._peers.items(), key=lambda item: (max(item[1].avoid_until, item[1].gone_until) > now,
                                                                 -item[1].reliability))  # fmt: skip
        for peer, _ in by_trust[: len(self._peers) - _MAX_TRACKED]:
            del self._peers[peer]


EXACT_BATCH = 32
"""Replay coalesces small steps into frames of at most this many tokens. Measured on
llama.cpp's CPU backend (SmolLM2 Q4_1): any batch of fewer than 64 tokens leaves the same KV
bits as the same tokens fed one per step, while a batch of 64 or more takes another kernel
path and does not (tests/test_replay.py asserts the half we rely on)."""


def replay_plan(shapes: Sequence[int], exact_batch: int = EXACT_BATCH) -> list[tuple[int, int]]:
    """Frames ``(start, length)`` that rebuild a session's cache bit for bit.

    ``shapes`` are the lengths of the steps that built it, in order. A step longer than
    ``exact_batch`` (a prefill chunk) is replayed in its own shape, since only the same
    shape reproduces its bits; runs of shorter steps (decode steps, forced tags) are merged
    into frames of up to ``exact_batch`` tokens, which reproduce theirs.
    """
    frames: list[tuple[int, int]] = []
    pending_start = pending = pos = 0
    for n in shapes:
        if n <= exact_batch and pending + n <= exact_batch:
            pending += n
        else:
            if pending:
                frames.append((pending_start, pending))
            if n <= exact_batch:
                pending_start, pending = pos, n
            else:
                frames.append((pos, n))
                pending = 0
        pos += n
        if not pending:
            pending_start = pos
    if pending:
        frames.append((pending_start, pending))
    return frames


Trouble = Literal["failed", "leaving"]


def hop_trouble(hop: Hop, view: NodeView | None) -> Trouble | None:
    """What the registry says about a hop of a live route.

    ``failed``: gone from the registry, Dead or Degraded (silent), or now serving other
    layers (it moved): its sessions must move at once. ``leaving``: draining or set idle:
    still serving, so its sessions move at the next step boundary, when another route exists.
    """
    if view is None or view.state != "Ready" or view.record.layers != hop.layers:
        return "failed"
    if view.record.draining or view.record.idle:
        return "leaving"
    return None
