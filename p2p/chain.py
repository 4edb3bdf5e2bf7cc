"""The entry peer's side of a session: a :class:`~inclavate.pipeline.Pipeline` over the swarm
that survives peers leaving.

A session's route is chosen on its first step. Prefill chunks are sent without waiting (the
stages pipeline them); the step that samples waits for its token. The entry keeps every token
the session has processed, so when any hop of the route fails the session moves to a new
route whose hops rebuild their KV cache by *replaying* those tokens, and the step goes on: the
caller sees a stall, never an error, until ``max_failovers`` is spent or no live node holds
some layers (``NoRoute``, naming them).

A hop has failed when a stage reports an error (its own, or that the next hop is
unreachable), when the registry stops calling it Ready with the same layers (Dead, Degraded,
gone, moved), when our connection to it drops, or when the step misses its adaptive deadline
(``p2p.failover.StepDeadline``; then the hops that do not answer a ping are blamed, or all of
them when each answers). A hop
that is draining or idle is still serving: its sessions move at the next step boundary, if
another route exists.

The replay rebuilds only what was lost when it can (*span replay*, see docs/ARCHITECTURE.md,
"Failover"): the new route keeps the hops before the failed span (prefix) and after it
(suffix), which *adopt* the session under the new leg id with their caches; the hop before
the span re-sends the hidden states it kept into the replacement hops, which discard their
output; then the interrupted steps go on through the whole route. When that is not possible
(no replacement ends where the failed span did, a kept hop does not confirm, or the policy
says so), every processed token is replayed through the whole new route from position 0.

Each route is a *leg* (``p2p.legs``) with its own wire session id. Frames still in flight on
an old route (a stalled hop that wakes up) then carry an id nobody continues, so they can
neither rewind nor corrupt the new leg; the old leg is closed on every hop that may hold it.
"""

from __future__ import annotations

import logging
import random
import secrets
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import trio

from inclavate.types import LayerRange, ModelId, NodeId, PeerId, SessionId
from node.sampling import SamplingParams
from p2p import wire
from p2p.errors import P2PError
from p2p.failover import FailoverPolicy, PeerHealth, StepDeadline, hop_trouble, replay_plan
from p2p.latency import usable_link_ms
from p2p.legs import Leg, LegWatch, blame, refusal_suspects, seen_gone, speaker
from p2p.forward import ForwardService
from p2p.forward_checks import FrameReason
from p2p.inbox import Inbox
from p2p import pace
from p2p.pace import Pace
from p2p.records import legacy_owner
from p2p.registry import NodeView
from p2p.routing import CostModel, Hop, NoRoute, choose_route, route_step_ms

log = logging.getLogger(__name__)


def new_request_id() -> int:
    """A request id no other peer can guess: 53 random bits (an integer any JSON reader holds
    exactly, where a frame goes as JSON; never 0, the id of the entry's own "link ended").
    Counted from 1, the ids of the requests a hop saw told it those of the requests it did
    not: a peer that feeds a hop's range could aim a refusal through that honest hop at the
    entry for the next one."""
    return secrets.randbits(53) or 1


_CLOSE_OLD_LEG_S = 1.0
"""How long a cancelled failover may spend sending the old leg's closes (they are queued,
not awaited)."""
_NO_TOKENS = np.zeros(0, np.int32)
"""The input of a frame made only to learn its step context."""

LEFT_CLOSE_S = 0.5
"""How long a session's close may take once this peer leaves at once: a close goes to each
other hop directly, no answer is awaited (the chained close would start at the peer's own
stage, gone). Each session's close waited
its 5 s twice, and a second Ctrl-C took 11 s with a chat streaming (an audit, 2026-12-08);
hops a close missed free the session at their idle timeout."""
OWN_PAUSE_S = 1.0
"""A token's wait that woke this much later than it asked was this peer not running (stopped,
swapped out, its event loop blocked): the step's deadline and its pace move past that time.
An entry stopped for 8 s had missed every deadline when it woke, and failed its sessions over
blaming hops whose answers sat unread in its own sockets (an audit, 2026-12-08)."""
CLIENT_ERRORS = frozenset({"context_full", "invalid_batch"})
"""Error codes that refuse a hop's input: the request's fault (another route would fail the
same way) only where that input is the request itself (:meth:`SwarmPipeline._refused_input`)."""


class StageFailed(P2PError):
    """A stage of the chain reported an error (``code`` says which kind, ``origin`` where)."""

    def __init__(self, code: str, message: str, origin: str) -> None:
        self.code = code
        self.origin = origin
        super().__init__(f"{message} (at peer {origin})")


class ContextExceeded(StageFailed):
    """A stage has no room left in the session's context (the client asked for too much)."""


def stage_failure(code: str, message: str, origin: str) -> StageFailed:
    cls = ContextExceeded if code == "context_full" else StageFailed
    return cls(code, message, origin)


class ChainTimeout(P2PError):
    """The chain did not answer in time; a peer on the route is stalled or gone."""


class FailoverExhausted(P2PError):
    """The session's route failed again after every failover it was allowed."""

    def __init__(self, failovers: int, cause: P2PError) -> None:
        self.cause = cause
        super().__init__(f"the chain failed again after {failovers} failover(s): {cause}")


def least_used_lane(lanes_in_use: Iterable[int], lanes: int) -> int:
    """The lane for a new session, of ``lanes``: the one fewest sessions use (the lowest on
    a tie). Sessions decoding through a chain then go round it in separate lanes, so that
    several stages compute at once (``node.stage``), and are spread evenly over them."""
    used = [0] * max(1, lanes)
    for lane in lanes_in_use:
        used[lane % len(used)] += 1
    return used.index(min(used))


@dataclass(frozen=True)
class Broken:
    """Why a leg cannot go on: the peers to blame (possibly none) and the error to report
    when no failover is left."""

    peers: frozenset[PeerId]
    cause: P2PError
    certain: bool = True
    """False when the blame is a guess (hops that did not answer a ping after a deadline):
    they are then used again if no route exists without them."""
    gone: frozenset[PeerId] = frozenset()
    """Those of ``peers`` seen gone for certain (our link or connection to them ended, a
    stream to them could not be opened): no route goes through them for ``gone_s``, not
    even a last-resort one (``PeerHealth.gone``)."""
    reporter: PeerId | None = None
    """Set when ``peers`` are blamed on another hop's word: it reported them unreachable
    (:meth:`SwarmPipeline._check_report` asks them before they are blamed)."""
    excused: PeerId | None = None
    """The hop that sent an error blaming nobody (``session_evicted``, or one of
    :data:`CLIENT_ERRORS`): believed once per session (:meth:`SwarmPipeline._excuse`)."""


@dataclass(frozen=True)
class _Span:
    """A new route that keeps the old hops around a replaced span: ``route[lo:hi]`` is new."""

    route: list[Hop]
    lo: int
    hi: int

    @property
    def kept(self) -> list[Hop]:
        return self.route[: self.lo] + self.route[self.hi :]

    @property
    def middle(self) -> list[Hop]:
        return self.route[self.lo : self.hi]


@dataclass(eq=False)
class _Session:
    session_id: SessionId
    leg: Leg | None = None
    history: list[int] = field(default_factory=list)
    """Every token processed so far, by position: what a new route replays."""
    shapes: list[int] = field(default_factory=list)
    """Lengths of the steps that processed ``history``: a replay keeps their shapes."""
    legs: int = 0
    failovers: int = 0
    lane: int = 0
    """The lane its steps travel in (``p2p.wire``: stages of a chain run one lane per call)."""
    checked: float = 0.0
    flight_since: float | None = None
    """When the oldest unanswered frame was sent."""
    flight_tokens: int = 0
    client_errors: int = 0
    """Errors saying the request is at fault (:data:`CLIENT_ERRORS`) it has met: the second is the client's."""
    evicted_by: set[PeerId] = field(default_factory=set)
    """Hops that evicted it once (``session_evicted``): another eviction blames them."""
    failing_since: float | None = None
    """When the failover in progress began (the failure was seen): its timeline is logged
    from there to the step's token."""
    pace: Pace = field(default_factory=Pace)
    """Its leg's recent decode steps, against what the route should cost (``p2p.pace``)."""
    slow_moves: int = 0
    """Routes it left for being far slower than their hops claim (``policy.slow_moves``)."""
    context: tuple[Leg, SamplingParams | None, bytes | None] | None = None
    """The step context of its frames on a leg, for a sampling (``SwarmPipeline._context``)."""

    def record(self, start_pos: int, tokens: Sequence[int]) -> None:
        """Positions ``start_pos...`` now hold ``tokens`` (a step may rewind).

        Only a rewind walks the shapes: a step that appends (every decode step) must not
        cost the length of the generation so far, or a long stream slows down as it goes."""
        if start_pos < len(self.history):
            del self.history[start_pos:]
            kept = 0
            for i, n in enumerate(self.shapes):
                if kept + n > start_pos:
                    self.shapes[i:] = [start_pos - kept] if start_pos > kept else []
                    break
                kept += n
        self.history.extend(int(t) for t in tokens)
        self.shapes.append(len(tokens))

    def shape_boundary(self, limit: int) -> int:
        """The last step boundary at or before ``limit``: a replay must keep the steps' shapes."""
        pos = 0
        for n in self.shapes:
            if pos + n > limit:
                break
            pos += n
        return pos

    def split_replay(self, kept: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """Frames rebuilding ``[0, kept)`` (a step boundary) and frames of the steps after it,
        each in the shapes that built them (:func:`p2p.failover.replay_plan`)."""
        count = pos = 0
        while pos < kept:
            pos += self.shapes[count]
            count += 1
        rest = [(kept + start, n) for start, n in replay_plan(self.shapes[count:])]
        return replay_plan(self.shapes[:count]), rest


@dataclass
class SwarmPipeline:
    """Sessions of one model driven from this peer through routes it picks and repairs."""

    service: ForwardService
    model_id: ModelId
    views: Callable[[], Iterable[NodeView]]
    """The registry as it is now."""
    context_length: int
    """Positions a session may hold: routes go only through nodes stating at least this."""
    view_of: Callable[[NodeId], NodeView | None]
    """One node's view: what a session's health poll asks (``views`` is for re-routing)."""
    n_layers: int | None = None
    """The model's layers as this peer knows them (its catalog); None: as most peers state."""
    d_model: int | None = None
    """The model's width as this peer's catalog has it: nodes stating another are no hops of
    it; None (a model outside the catalog): any."""
    link_ms: Callable[[], Mapping[PeerId, float]] = dict
    measured_step_ms: Callable[[], float] = float
    """This peer's own ms per layer for the model (0: unmeasured): the reference against
    which other nodes' speed claims are trusted (:func:`p2p.routing.reference_step_ms`)."""
    is_connected: Callable[[PeerId], bool] = lambda _peer: True
    probe: Callable[[PeerId], Awaitable[bool]] | None = None
    """Whether a peer answers a ping now (used to find the stalled hop after a deadline)."""
    policy: FailoverPolicy = field(default_factory=FailoverPolicy)
    health: PeerHealth = field(default_factory=PeerHealth)
    close_timeout: float = 5.0
    left: Callable[[], bool] = lambda: False
    """Whether this peer is leaving at once (a second Ctrl-C): its own stage and forward
    service answer nothing more, so a close waits for no answer (:data:`LEFT_CLOSE_S`)."""
    lanes: int = 4
    """Most lanes new sessions are spread over (one per stage of their route, up to this),
    the least used first; 1: one lane for all."""
    rng: random.Random = field(default_factory=random.Random)
    deadline: StepDeadline = field(init=False)
    _sessions: dict[SessionId, _Session] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.deadline = StepDeadline(self.policy)
        self._watch = LegWatch(self.service.me, self.view_of, self.is_connected, self.probe, self.policy)

    def route_of(self, session_id: SessionId) -> tuple[Hop, ...] | None:
        """The session's route now: the same object until a failover moves the session."""
        session = self._sessions.get(session_id)
        return session.leg.route if session and session.leg else None

    def check_route(self) -> list[Hop]:
        """A route a new session would take now; raises ``NoRoute`` naming missing layers."""
        return self._reroute((), frozenset(), exclude_load=None, proven_first=False)

    @property
    def open_sessions(self) -> list[SessionId]:
        return list(self._sessions)

    # ------------------------------------------------------------------ steps

    async def step(
        self,
        session_id: SessionId,
        start_pos: int,
        tokens: Sequence[int],
        sampling: SamplingParams | None,
    ) -> int | None:
        session = self._sessions.get(session_id)
        if session is None:
            session = _Session(session_id, pace=Pace(self.policy))
            route = self._first_route(session)
            # One lane per stage of the route (up to ``lanes``): every stage can then compute
            # while the others do. A route of one hop (a whole peer) has one lane.
            session.lane = least_used_lane((s.lane for s in self._sessions.values()), min(self.lanes, len(route)))
            self._open_leg(session, route)
            self._sessions[session_id] = session
        if session.leg is None:
            raise P2PError(f"session {session_id} lost its route")
        if start_pos > len(session.history):
            raise ValueError(f"step at {start_pos} leaves a gap after {len(session.history)} positions")
        session.record(start_pos, tokens)

        req = await self._check_at_boundary(session, sampling)
        if req is None:
            req = await self._send(session, start_pos, tokens, sampling)
        if sampling is None:
            broken = self._pending_break(session)
            if broken is not None:
                await self._fail_over(session, broken, None)
            return None
        while True:
            outcome = await self._await_token(session, req)
            if isinstance(outcome, int):
                return outcome
            req = await self._fail_over(session, outcome, sampling)

    async def _check_at_boundary(self, session: _Session, sampling: SamplingParams | None) -> int | None:
        """Look at the route's health (at most every ``poll_s``): fail over from a failed hop,
        move away from a leaving one, or from a route far slower than its hops claim.
        Returns the request to wait for if the step was sent."""
        if session.pace.too_slow:
            req = await self._leave_slow(session, sampling)
            if req is not None:
                return req
        now = trio.current_time()
        if now - session.checked < self.policy.poll_s:
            return None
        session.checked = now
        assert session.leg is not None
        failed, leaving, gone = self._watch.trouble(session.leg)
        if failed:
            return await self._fail_over(session, _departed(failed, gone), sampling)
        if leaving:
            return await self._migrate(session, leaving, sampling)
        return None

    async def _send(self, session: _Session, start_pos: int, tokens: Sequence[int], sampling: SamplingParams | None,
                    *, route: Sequence[Hop] | None = None, replay: wire.Replay | None = None) -> int:  # fmt: skip
        """Send a frame along the leg, or (``route``) a rebuild-only frame into part of it."""
        leg = session.leg
        assert leg is not None
        req = new_request_id()
        hops = leg.route if route is None else tuple(route)
        msg = wire.Forward(req, leg.wire_id, start_pos, hops, self.service.me, sampling,
                           tokens=np.asarray(tokens, dtype=np.int32), discard=route is not None, replay=replay,
                           lane=session.lane, context=self._context(session, leg, sampling) if route is None and replay is None else None)  # fmt: skip
        if session.flight_since is None:
            session.flight_since = trio.current_time()
        session.flight_tokens += len(tokens)
        await self.service.ask(hops[0].peer_id, msg)
        return req

    def _context(self, session: _Session, leg: Leg, sampling: SamplingParams | None) -> bytes | None:
        """The step context of ``session``'s frames along ``leg`` (:func:`p2p.wire.step_context`),
        made once per leg and sampling: encoding a frame by its fields hashes the route's hops
        and the sampling in Python, at every token."""
        made = session.context
        if made is not None and made[0] is leg and made[1] is sampling:
            return made[2]
        probe = wire.Forward(0, leg.wire_id, 0, leg.route, self.service.me, sampling, tokens=_NO_TOKENS, lane=session.lane)
        context = wire.step_context(probe)
        session.context = (leg, sampling, context)
        return context

    async def _await_token(self, session: _Session, req: int) -> int | Broken:
        leg = session.leg
        assert leg is not None and session.flight_since is not None
        limit = self.deadline.seconds(session.flight_tokens)
        deadline_at = session.flight_since + limit
        while True:
            # The route's health is looked at every ``poll_s`` while the token is out; the
            # wait needs no cancel scope of its own (``p2p.inbox``: a token's hand-over).
            asked_at = trio.current_time()
            wake_at = min(asked_at + self.policy.poll_s, deadline_at)
            reply = await leg.inbox.receive_by(wake_at)
            # Late past a wake still ahead when asked: a deadline already behind us (a send
            # that waited for room: the route's own backpressure) is no pause of ours.
            late = trio.current_time() - max(wake_at, asked_at)
            if late > OWN_PAUSE_S:  # this peer did not run: that time is no hop's
                deadline_at += late
                session.flight_since += late
            if reply is not None:
                outcome = self._on_reply(leg, reply, req)
                if isinstance(outcome, int):
                    took = trio.current_time() - session.flight_since
                    learnt = session.pace.judge(session.flight_tokens, took, lambda: self._expected_step_s(leg))
                    if pace.tracing():
                        pace.trace(session.session_id, session.flight_tokens, took, self._expected_step_s(leg))
                    self.deadline.observe(session.flight_tokens, learnt)
                    if session.failing_since is not None:
                        log.info("session %s: failover: token %.3f s after the failure was seen",
                                 session.session_id, trio.current_time() - session.failing_since)  # fmt: skip
                        session.failing_since = None
                    session.flight_since, session.flight_tokens = None, 0
                    return outcome
                if outcome is not None:
                    return outcome
                continue
            failed, _, gone = self._watch.trouble(leg)
            if failed:
                return _departed(failed, gone)
            if trio.current_time() >= deadline_at:
                stalled = await self._watch.stalled(leg)
                cause = ChainTimeout(f"no answer from the chain of {self.model_id} within {limit:.1f} s")
                return Broken(stalled, cause, certain=False)

    def _on_reply(self, leg: Leg, reply: wire.Message, req: int) -> int | Broken | None:
        if isinstance(reply, wire.Error):
            failure = stage_failure(reply.code, reply.message, reply.origin)
            origin = speaker(leg, reply.origin)
            if reply.code in CLIENT_ERRORS or reply.code == "session_evicted":
                # The request's fault, or a fair share: no hop's, if the hop says true (_excuse).
                return Broken(frozenset(), failure, excused=origin)
            me = self.service.me
            blamed = blame(leg, reply, me)
            reported = reply.code == "unreachable" and origin != me and origin not in blamed
            return Broken(blamed, failure, gone=seen_gone(blamed, reply, me), reporter=origin if reported else None)
        if isinstance(reply, wire.Result) and reply.req_id == req:
            if reply.token is None:
                last = leg.route[-1].peer_id
                return Broken(frozenset({last}), StageFailed("protocol", "the last stage answered without a token", last))
            return reply.token
        return None

    def _pending_break(self, session: _Session) -> Broken | None:
        """An error already reported for frames sent without waiting (prefill chunks)."""
        leg = session.leg
        assert leg is not None
        while True:
            try:
                reply = leg.inbox.receive_nowait()
            except trio.WouldBlock:
                return None
            outcome = self._on_reply(leg, reply, -1)
            if isinstance(outcome, Broken):
                return outcome

    # ------------------------------------------------------------- re-routing

    async def _fail_over(self, session: _Session, broken: Broken, sampling: SamplingParams | None) -> int | None:
        """Blame, re-route, replay. Returns the request that will carry the step's token."""
        broken = await self._check_report(broken, session.leg)
        broken = self._excuse(session, broken)
        now = trio.current_time()
        started = _started_ms(self.views()) if broken.gone else {}
        for peer in broken.peers:
            self.health.failed(peer, now, gone=peer in broken.gone, started_ms=started.get(peer))
        if session.failovers >= self.policy.max_failovers:
            await self._retire(session, broken.peers)
            raise FailoverExhausted(session.failovers, broken.cause) from broken.cause
        session.failovers += 1
        session.failing_since = now
        log.warning("session %s: %s (blamed: %s); failover %d/%d", session.session_id, broken.cause,
                    ", ".join(sorted(p[-6:] for p in broken.peers)) or "nobody",
                    session.failovers, self.policy.max_failovers)  # fmt: skip
        assert session.leg is not None
        old = session.leg.route
        span = self._span_route(old, broken.peers, session) if broken.peers else None
        if span is not None:
            log.info("session %s: now through %s (span replay)", session.session_id, _describe(span.route))
            return await self._move_span(session, span, broken.peers, sampling)
        give_up = trio.current_time() + self.policy.no_route_wait_s
        while True:
            try:
                route = self._reroute(old, broken.peers, exclude_load=session, certain=broken.certain)
                break
            except NoRoute:
                route = self._through_draining(old, broken, session)
                if route is not None:
                    log.warning("session %s: only a draining peer still serves the layers: failing over onto it",
                                session.session_id)  # fmt: skip
                    break
                if trio.current_time() >= give_up:
                    await self._retire(session, broken.peers)
                    raise
                await trio.sleep(0.25)
        log.info("session %s: now through %s", session.session_id, _describe(route))
        await self._switch(session, route, broken.peers)
        return await self._replay(session, sampling)

    def _excuse(self, session: _Session, broken: Broken) -> Broken:
        """Errors that blame nobody are their sender's word, believed once per session.

        ``context_full`` and ``invalid_batch`` say the request is at fault, so another route
        would fail the same way: the session goes round the hop that said so (blamed, as a
        guess) and the error is the client's only when it comes again. ``session_evicted``
        (an honest stage's fair share) is replayed blaming nobody, and blames its sender
        when it evicts the session again. Believed every time, any of them let a hop on
        the cheapest route fail every request sent through it (a 400, or a 503 after its
        failovers) and never be avoided, since nobody was blamed. A refusal of input the
        request did not make itself (hidden states, positions a hop passed on) is no
        client's error at all: it blames whoever made that input (:meth:`_refused_input`)."""
        reporter = broken.excused
        if reporter is None:
            return broken
        if isinstance(broken.cause, StageFailed) and broken.cause.code in CLIENT_ERRORS:
            refused = self._refused_input(session, reporter, broken.cause)
            if refused is not None:
                return refused
            if session.client_errors or session.failovers >= self.policy.max_failovers:
                raise broken.cause
            session.client_errors += 1
            return Broken(frozenset({reporter}), broken.cause, certain=False)
        if reporter in session.evicted_by:
            return Broken(frozenset({reporter}), broken.cause, certain=False)
        session.evicted_by.add(reporter)
        return broken

    def _refused_input(self, session: _Session, reporter: PeerId, cause: StageFailed) -> Broken | None:
        """A hop refused its input: who is blamed when that input was not the request's own
        (:func:`p2p.legs.refusal_suspects`: the reporter and the hop before it, as a guess;
        only the hop before it, for certain, when the reporter is this peer); None when it
        was (token ids at the first hop, or positions past the chain's context, which this
        entry's own history holds). Either suspect is then out of the failover's prefix."""
        if session.leg is None or (cause.code == "context_full" and len(session.history) > self.context_length):
            return None
        me = self.service.me
        suspects = refusal_suspects(session.leg, reporter, me)
        if not suspects:
            return None
        return Broken(suspects, cause, certain=reporter == me)

    async def _check_report(self, broken: Broken, leg: Leg | None = None) -> Broken:
        """A hop reported the hop after it unreachable: its word against that hop's. When
        the accused answers our ping, the reporter is blamed instead, as a guess (it stays a
        last choice: it may really be cut off from its successor while we are not). Taken
        on its word, a hop on the cheapest route that answered every frame so got its
        honest successor avoided and kept every session: the sole holder of the next range
        was left out of the failover's route, and every request through the liar was a
        503 naming layers a live peer held.

        The ping is skipped only where our own connection to every accused ended on ``leg``
        (we held one since the leg began, and hold none now): it agrees with the report. Not
        being connected is also how a peer this entry never dialled looks (a middle hop past
        the latency round's targets, or one whose idle connection was closed), and was read
        as that agreement: the report was believed for certain without a ping, its honest
        successor left out of the failover's routes (an audit, 2026-12-07). The probe dials."""
        probe = self.probe
        if broken.reporter is None or probe is None or not broken.peers:
            return broken
        accused = {PeerId(legacy_owner(p) or p) for p in broken.peers}  # a relayed node answers through its peer
        if leg is not None and all(peer in leg.seen and not self.is_connected(peer) for peer in accused):
            return broken  # our own connection to the accused ended too: no ping to wait for
        answered: list[bool] = []
        with trio.move_on_after(self.policy.probe_timeout_s):
            for peer in accused:
                answered.append(await probe(peer))
        if len(answered) < len(accused) or not all(answered):
            return broken
        log.warning("peer %s reported %s unreachable, which answers us: blaming the reporter", broken.reporter[-6:],
                    ", ".join(sorted(p[-6:] for p in broken.peers)))  # fmt: skip
        return Broken(frozenset({broken.reporter}), broken.cause, certain=False)

    async def _leave_slow(self, session: _Session, sampling: SamplingParams | None) -> int | None:
        """The leg's steps stayed far slower than its hops say they cost (``p2p.pace``): one of
        them dawdles, and which one nobody can tell (every hop answers, and in time). Move
        off them like off leaving hops, when another route exists (a sole holder keeps
        serving: slow beats nothing), and blame the hops left behind as a guess, as a missed
        deadline does: the honest ones regain their reliability by serving, the dawdler is
        in every slow route and keeps losing it, so new sessions go round it. A hop the new
        route keeps (a sole holder) is not blamed: avoiding it is impossible, and while
        avoided it would bar every voluntary move through it. Not a failover; at most
        ``policy.slow_moves`` per session, so a swarm that is slow everywhere is not toured."""
        leg = session.leg
        assert leg is not None
        session.pace.reset()
        suspects = leg.blame_ids - {self.service.me}
        if session.slow_moves >= self.policy.slow_moves or not suspects:
            return None
        req = await self._migrate(session, suspects, sampling, why="slow")
        if session.leg is leg or session.leg is None:
            log.info("session %s: its route is slow and no other exists: staying", session.session_id)
            return req
        session.slow_moves += 1
        now = trio.current_time()
        for peer in suspects - session.leg.blame_ids:
            self.health.failed(peer, now)
        return req

    def _expected_step_s(self, leg: Leg) -> float | None:
        """What a decode step through the leg should take, from its hops' records now (None
        when one has left the registry, or nothing was measured yet)."""
        views = [self.view_of(hop.node_id) for hop in leg.route]
        if any(v is None for v in views):
            return None
        links = usable_link_ms(self.link_ms(), self.is_connected)
        costs = CostModel(link_ms=links, measured_step_ms=self.measured_step_ms())
        ms = route_step_ms([v.record for v in views if v is not None], self.service.me, costs)
        return None if ms is None else ms / 1000

    async def _migrate(self, session: _Session, leaving: frozenset[PeerId], sampling: SamplingParams | None,
                       why: str = "leaving") -> int | None:  # fmt: skip
        """Move off hops that are leaving (draining, idle; ``why`` names another reason in the
        log: a slow route's hops are left the same way), when another route exists (not a
        failure: not counted, nobody blamed here). The old leg is closed *before* the replay:
        a hop on both routes must not need two session slots, and the old KV is never
        reused anyway."""
        assert session.leg is not None
        span = self._span_route(session.leg.route, leaving, session, voluntary=True)
        if span is not None:
            log.info("session %s: moving off %s peer(s) %s to %s (span replay)", session.session_id, why,
                     ", ".join(sorted(p[-6:] for p in leaving)), _describe(span.route))  # fmt: skip
            return await self._move_span(session, span, frozenset(), sampling)
        try:
            route = self._reroute(session.leg.route, leaving, exclude_load=session, voluntary=True)
        except NoRoute:
            found = self._leave_some(session, leaving)
            if found is None:
                return None
            leaving, route = found
        log.info("session %s: moving off %s peer(s) %s to %s", session.session_id, why,
                 ", ".join(sorted(p[-6:] for p in leaving)), _describe(route))  # fmt: skip
        await self._switch(session, route, frozenset())
        return await self._replay(session, sampling)

    def _through_draining(self, old: Sequence[Hop], broken: Broken, session: _Session) -> list[Hop] | None:
        """Failover's last resort: a route through holders that are draining. A draining peer
        still serves until its ``--drain-timeout``, and its stop waits for the sessions it
        holds; refusing it would fail the stream with a 503 while it runs (the other holder
        of its span killed during its drain). At the next step boundary the session moves
        off it again if another holder has appeared (migration). Idle peers stay out: an
        admin set them so."""
        views = list(self.views())
        if not any(v.record.draining and not v.record.idle for v in views):
            return None
        try:
            return self._reroute(old, broken.peers, session, certain=broken.certain,
                                 views=_serving(views, lambda v: v.record.draining and not v.record.idle))  # fmt: skip
        except NoRoute:
            return None

    def _leave_some(self, session: _Session, leaving: frozenset[PeerId]) -> tuple[frozenset[PeerId], list[Hop]] | None:
        """When no route avoids every leaving hop, a route that leaves one of them and keeps
        the others (a leaving hop still serves the sessions it has). A peer moving to heal
        a gap that a stopping peer opens needs this: the mover's sessions must leave it
        while the stopping peer, the only other way through its layers, still serves."""
        assert session.leg is not None
        route_nodes = {hop.node_id for hop in session.leg.route}
        for hop in session.leg.route:
            if not hop.blamed_in(leaving):
                continue
            left = frozenset({PeerId(hop.blame_id)})
            kept = leaving - left
            views = _serving(self.views(), lambda v: (v.record.peer_id in kept or v.record.node_id in kept)
                             and v.record.node_id in route_nodes)  # fmt: skip
            try:
                route = self._reroute(session.leg.route, left, session, views=views, voluntary=True)
                return left, route
            except NoRoute:
                continue
        return None

    async def _switch(self, session: _Session, route: list[Hop], broken: frozenset[PeerId]) -> None:
        """Make ``route`` the session's leg, then close the old one. The new leg is in place
        before the first await, so sessions failing over at the same moment count it when
        they choose (that is what spreads them over replicas)."""
        old = session.leg
        self._open_leg(session, route)
        await self._close_leg(old, broken)

    def _proven(self) -> frozenset[str]:
        """Peers (relayed nodes by id) that served this entry, and the entry itself."""
        return self.health.proven() | {self.service.me}

    def _first_route(self, session: _Session) -> list[Hop]:
        """A new session's route, on probation: the cheapest one, unless it goes through a
        peer that never served this entry and a route through proven peers exists; then
        that one, but for ``policy.trial_share`` of the sessions (a newcomer must get some
        to prove itself). A fresh swarm, where no route is proven yet, routes as before."""
        route = self._reroute((), frozenset(), exclude_load=session, proven_first=False)
        proven = self._proven()
        if all(hop.blame_id in proven for hop in route) or self.rng.random() < self.policy.trial_share:
            return route
        return self._reroute((), frozenset(), exclude_load=session)

    def _reroute(self, old: Sequence[Hop], failed: frozenset[PeerId], exclude_load: _Session | None,
                 certain: bool = True, views: Sequence[NodeView] | None = None, voluntary: bool = False,
                 proven_first: bool = True) -> list[Hop]:  # fmt: skip
        """A new route without ``failed``: the old hops before the first failed one, then the
        cheapest way on from that boundary (a replacement may be split differently); failing
        that, the cheapest route from layer 0. Peers this entry avoids are left out when a
        route exists without them, and so are ``failed`` ones blamed without ``certain``ty;
        peers it saw gone for certain a moment ago (``PeerHealth.gone``) always are: they
        may still be Ready in the registry, and a failover that went back to them bounced
        between dead holders until its failovers were spent. A ``voluntary`` move (off a hop
        that still serves) never goes through avoided peers either.

        ``proven_first``: a route on through proven peers only (:meth:`_proven`), if one
        exists with the first pass's exclusions, comes before all that: each fresh identity
        of a stranger is unknown to the avoidance, and four of them claiming the whole model
        (the cheapest route) took every failover of a request, a 503 after 20 s, again and
        again (an audit, 2026-12-07). Now a stranger costs a request at most its first
        route; an honest newcomer gets failovers only where proven peers cannot serve."""
        index = next((i for i, h in enumerate(old) if h.blamed_in(failed)), None)
        keep = list(old[:index]) if index is not None else []
        start = old[index].layers.start if index is not None else 0
        costs = self._costs(exclude_load)
        views = list(self.views() if views is None else views)
        now = trio.current_time()
        started = _started_ms(views)
        gone = self.health.gone(now, started)
        # A failed peer seen gone and restarted since (its record names a new start) is back:
        # a sole holder restarted in place carries the session on (a new leg, replayed).
        back = self.health.restarted(failed, started)
        failed = failed - back
        avoided = (self.health.avoided(now) | failed) - back
        last: NoRoute | None = None
        passes = (avoided,) if voluntary else (avoided, failed) if certain else (avoided, failed, frozenset())
        # Peers a pass may let back in when no route exists without them: neither one seen
        # gone nor one failed for certain, and none on a voluntary move.
        spare = avoided if voluntary else gone | (failed if certain else frozenset())
        if proven_first:
            try:
                return self._route_without(views, costs, keep, start, passes[0] | gone, self._proven())
            except NoRoute:
                pass
        for exclude in passes:
            try:
                return self._route_without(views, costs, keep, start, exclude | gone)
            except NoRoute as exc:
                last = exc
            # Only the suspects no route can do without come back, not all of them: a guess
            # naming a framer and its successor, the sole holder of the next range, sent the
            # session straight back through the framer (and so did every new session while
            # the successor was avoided).
            needed = _holders(views, self.model_id, last.missing) & (exclude - spare)
            if needed:
                try:
                    return self._route_without(views, costs, keep, start, (exclude - needed) | gone)
                except NoRoute as exc:
                    last = exc
        assert last is not None
        raise last

    def _route_without(self, views: Sequence[NodeView], costs: CostModel, keep: list[Hop], start: int,
                       exclude: frozenset[PeerId], proven: frozenset[str] | None = None) -> list[Hop]:  # fmt: skip
        """The cheapest route through no peer of ``exclude`` (and only ``proven`` ones, when
        given): ``keep`` then on from boundary ``start``; failing that, from layer 0 (whose
        ``NoRoute`` says most: it is raised)."""
        attempts = [(keep, start), ([], 0)] if keep else [([], 0)]
        for prefix, boundary in attempts:
            try:
                return prefix + choose_route(views, self.model_id, self.service.me, costs, self.rng, start=boundary,
                                             exclude=exclude, n_layers=self.n_layers, d_model=self.d_model,
                                             min_context=self.context_length, proven=proven)  # fmt: skip
            except NoRoute:
                if boundary == 0:
                    raise
        raise AssertionError("the last attempt starts at layer 0")

    def _span_route(self, old: Sequence[Hop], failed: frozenset[PeerId], session: _Session,
                    voluntary: bool = False) -> _Span | None:  # fmt: skip
        """A route that replaces only the hops from the first to the last failed one, ending
        where they ended, so that the hops around them keep their caches; None when the
        policy says no, nothing around would be kept, a kept hop is itself in trouble, or no
        replacement ends at that boundary (through no avoided peer, for a ``voluntary`` move,
        and never through one seen gone: see :meth:`_reroute`). Through proven peers first,
        as :meth:`_reroute`."""
        index = [i for i, hop in enumerate(old) if hop.blamed_in(failed)]
        if not self.policy.span_replay or not index:
            return None
        prefix, suffix = list(old[: index[0]]), list(old[index[-1] + 1 :])
        if not prefix and not suffix:
            return None
        views = list(self.views())
        by_node = {v.record.node_id: v for v in views}
        if any(hop_trouble(hop, by_node.get(hop.node_id)) is not None for hop in prefix + suffix):
            return None
        costs = self._costs(session)
        kept = frozenset(hop.peer_id for hop in prefix + suffix)
        start, end = old[index[0]].layers.start, old[index[-1]].layers.end
        now = trio.current_time()
        gone = self.health.gone(now, _started_ms(views))
        strict = self.health.avoided(now) | failed | kept | gone
        passes = [(strict, self._proven()), (strict, None)] + ([] if voluntary else [(failed | kept | gone, None)])
        for exclude, proven in passes:
            try:
                middle = choose_route(views, self.model_id, self.service.me, costs, self.rng, start=start, end=end,
                                      exclude=exclude, n_layers=self.n_layers, d_model=self.d_model,
                                      min_context=self.context_length, proven=proven)  # fmt: skip
            except NoRoute:
                continue
            return _Span(prefix + middle + suffix, len(prefix), len(prefix) + len(middle))
        return None

    async def _move_span(self, session: _Session, span: _Span, broken: frozenset[PeerId],
                         sampling: SamplingParams | None) -> int | None:  # fmt: skip
        """Switch to ``span.route`` keeping the caches of the hops around the new span: they
        adopt the session under the new leg id (stale frames of the old leg still find
        nothing), say how many positions they hold, and the new span is rebuilt from there."""
        old = session.leg
        assert old is not None
        self._open_leg(session, span.route)
        leg = session.leg
        assert leg is not None
        try:
            held = await self._adopt(old, leg, span.kept)
        except BaseException:
            # Cancelled (the client left) while the kept hops adopt: the session's own close
            # frees the new leg, and nobody else would free the old one (its inbox stayed
            # open for good, and its hops held it until their idle timeout).
            with trio.CancelScope(shield=True), trio.move_on_after(_CLOSE_OLD_LEG_S):
                await self._close_leg(old, broken)
            raise
        if session.failing_since is not None:
            log.info("session %s: failover: adopts answered %.3f s after the failure was seen (%s)", session.session_id,
                     trio.current_time() - session.failing_since, held or "not all: whole route")  # fmt: skip
        await self._close_leg(old, broken)
        limit = min(held.values()) if held else 0
        kept = session.shape_boundary(min(limit, len(session.history) - session.shapes[-1]))
        rebuild, rest = session.split_replay(kept)
        if kept == 0 or len(rebuild) > wire.MAX_REPLAY_FRAMES:
            return await self._replay(session, sampling)
        return await self._replay_span(session, span, rebuild, rest, sampling)

    async def _adopt(self, old: Leg, new: Leg, hops: Sequence[Hop]) -> dict[PeerId, int]:
        """Ask each kept hop to continue ``old`` as ``new``; the positions each confirms
        (empty if any does not answer in time: the whole route is then replayed, and a hop
        that adopts late rewinds to position 0 like any other)."""
        pending: dict[int, PeerId] = {}
        for hop in hops:
            req = new_request_id()
            pending[req] = hop.peer_id
            await self.service.ask(hop.peer_id, wire.Adopt(req, old.wire_id, new.wire_id, (hop,), self.service.me))
        held: dict[PeerId, int] = {}
        with trio.move_on_after(self.policy.adopt_timeout_s):
            while pending:
                reply = await new.inbox.receive()
                if not isinstance(reply, wire.Adopted) or reply.req_id not in pending:
                    continue
                if reply.sender != pending[reply.req_id]:
                    # Another hop answering for a kept one (the forward service drops such
                    # answers first, p2p/asked.py; kept as a second guard): a false length would
                    # have the kept hop asked to replay what it does not keep, and blamed.
                    self.service.drops.count(FrameReason.FOREIGN_ADOPTED)
                    continue
                held[pending.pop(reply.req_id)] = reply.length
        return {} if pending else held

    async def _replay_span(self, session: _Session, span: _Span, rebuild: list[tuple[int, int]],
                           rest: list[tuple[int, int]], sampling: SamplingParams | None) -> int:  # fmt: skip
        """Rebuild the positions of ``rebuild`` in the new span only, then send the steps of
        ``rest`` through the whole route. The hop before the span re-sends its kept outputs
        (the ``replay`` of the first frame, sent ahead of that frame's own output); with no hop
        before it, this entry sends the tokens itself."""
        kept = rest[0][0]
        replay = None
        if span.lo == 0:
            for start, n in rebuild:
                await self._send(session, start, session.history[start : start + n], None, route=span.middle)
        else:
            replay = wire.Replay(span.route[span.lo - 1].layers.end, span.route[span.hi - 1].layers.end, tuple(rebuild))
            session.flight_tokens += kept  # the new span computes these before the first step's answer
        req = 0
        for i, (start, n) in enumerate(rest):
            last = i == len(rest) - 1
            req = await self._send(session, start, session.history[start : start + n], sampling if last else None,
                                   replay=replay if i == 0 else None)  # fmt: skip
        return req

    def _costs(self, excluding: _Session | None) -> CostModel:
        links = usable_link_ms(self.link_ms(), self.is_connected)
        return CostModel(link_ms=links, load=self._load(excluding), reliability=self.health.reliability(),
                         measured_step_ms=self.measured_step_ms())  # fmt: skip

    def _load(self, excluding: _Session | None) -> Counter[PeerId]:
        return Counter(
            hop.peer_id for s in self._sessions.values() if s is not excluding and s.leg is not None for hop in s.leg.route
        )

    def _open_leg(self, session: _Session, route: list[Hop]) -> None:
        wire_id = session.session_id if session.legs == 0 else leg_id(session.session_id, session.legs)
        session.legs += 1
        session.leg = Leg(wire_id, tuple(route), self.service.open_inbox(wire_id, (h.peer_id for h in route)))
        # Connected now: losing that connection later is the hop's going (``LegWatch.trouble``,
        # ``_check_report``), not a peer never dialled. Polled only every ``poll_s`` otherwise.
        session.leg.seen.update(h.peer_id for h in route if h.peer_id != self.service.me and self.is_connected(h.peer_id))
        session.flight_since, session.flight_tokens = None, 0
        session.pace.reset()
        session.checked = trio.current_time()
        if session.legs == 1:
            log.debug("session %s routed through %s", session.session_id, _describe(route))

    async def _replay(self, session: _Session, sampling: SamplingParams | None) -> int | None:
        """Rebuild the new leg's KV from every processed token, in frames that reproduce the
        cache bit for bit (:func:`p2p.failover.replay_plan`), sent without waiting so the
        stages pipeline them; the last frame samples when the step does."""
        frames = replay_plan(session.shapes)
        req = None
        for i, (start, n) in enumerate(frames):
            last = i == len(frames) - 1
            req = await self._send(session, start, session.history[start : start + n], sampling if last else None)
        return req

    async def _retire(self, session: _Session, broken: frozenset[PeerId]) -> None:
        """The session gives up its route for good (no failover left, or no route)."""
        leg, session.leg = session.leg, None
        await self._close_leg(leg, broken)

    async def _close_leg(self, leg: Leg | None, broken: frozenset[PeerId]) -> None:
        """Stop listening to a leg and free it on every hop that may hold it, without waiting
        for answers. The close follows the route (behind any frame still in flight, so a
        stalled hop that wakes up cannot reopen the session further on) and goes to each hop
        directly (the route may be cut); broken hops we lost are skipped."""
        if leg is None:
            return
        self.service.close_inbox(leg.wire_id)
        live = [h for h in leg.route if h.peer_id not in broken or self.is_connected(h.peer_id)]
        if live and live[0] == leg.route[0]:
            await self.service.ask(leg.route[0].peer_id, wire.Close(new_request_id(), leg.wire_id, leg.route, self.service.me))
        for hop in live:
            await self.service.ask(hop.peer_id, wire.Close(new_request_id(), leg.wire_id, (hop,), self.service.me))

    # -------------------------------------------------------------- closing

    async def leave(self) -> None:
        """This peer leaves at once (:attr:`left`): every session's hops are told now, each
        directly, and its generation's own close later finds nothing to do."""
        for session_id in list(self._sessions):
            await self.close_session(session_id)

    async def close_session(self, session_id: SessionId) -> None:
        """Free the session on every hop.

        The close travels the route like the session's own frames, so it arrives after
        any frame still in flight (a close that overtook a prefill chunk would let that
        chunk open the session again). If the chain is broken, every hop is then told
        directly, best effort; a hop that cannot be reached frees the session when it
        has been idle for the stage's idle timeout.
        """
        session = self._sessions.pop(session_id, None)
        if session is None or session.leg is None:
            return
        leg = session.leg
        try:
            if self.left():  # the chained close would start at this peer's own, gone, stage
                with trio.move_on_after(LEFT_CLOSE_S):
                    for hop in leg.route:
                        if hop.peer_id != self.service.me:
                            await self.service.ask(hop.peer_id, wire.Close(new_request_id(), leg.wire_id, (hop,), self.service.me))
                return
            req = new_request_id()
            await self.service.ask(leg.route[0].peer_id, wire.Close(req, leg.wire_id, leg.route, self.service.me))
            if await self._await_closed(leg.inbox, {req}):
                self.health.served(leg.blame_ids)  # as failures are recorded: a relayed node by its id
                return
            direct = {}
            for hop in leg.route:
                direct[new_request_id()] = hop
            for hop_req, hop in direct.items():
                await self.service.ask(hop.peer_id, wire.Close(hop_req, leg.wire_id, (hop,), self.service.me))
            await self._await_closed(leg.inbox, set(direct))
        finally:
            self.service.close_inbox(leg.wire_id)

    async def _await_closed(self, inbox: Inbox[wire.Message], pending: set[int]) -> bool:
        """Wait for ``closed`` of every request in ``pending``; False on an error or timeout."""
        with trio.move_on_after(self.close_timeout):
            async for reply in inbox:
                if reply.req_id not in pending:
                    continue
                if isinstance(reply, wire.Error):
                    return False
                if isinstance(reply, wire.Closed):
                    pending.discard(reply.req_id)
                    if not pending:
                        return True
        return False


def leg_id(session_id: SessionId, leg: int) -> SessionId:
    """The wire id of a session's ``leg``-th new route: ``<id>.<leg>.<16 random hex digits>``.

    Every hop of the session's route learns its id, the hop being failed over too. Were the
    next leg's id derived from it alone (``<id>.1``), such a peer could open that id first at
    a hop the failover keeps: the adopt (never onto an id already held) would keep nothing
    there, and the new leg would go on under an id the claimer holds and, as a registered
    peer, may feed. Only the hops of the new route learn its id, from the frames sent them."""
    return SessionId(f"{session_id}.{leg}.{secrets.token_hex(8)}")


def _serving(views: Iterable[NodeView], which: Callable[[NodeView], bool]) -> list[NodeView]:
    """``views`` with the draining and idle flags of ``which`` ones cleared: routable again."""
    return [NodeView(v.record.replace(draining=False, idle=False), v.state) if which(v) else v for v in views]


def _started_ms(views: Iterable[NodeView]) -> dict[PeerId, int]:
    """When each peer says it started, from the record of its own node (a relayed legacy
    node's start is its relay's business, not a sign of the peer's restart)."""
    return {v.record.peer_id: v.record.started_ms for v in views
            if v.record.node_id == v.record.peer_id and v.record.started_ms}  # fmt: skip


def _holders(views: Iterable[NodeView], model_id: ModelId, missing: Sequence[LayerRange]) -> frozenset[PeerId]:
    """The peers (and relayed nodes, by their ids) that hold any of ``missing`` layers of the
    model in a routable record: those a route cannot do without."""
    return frozenset(PeerId(who) for v in views if v.record.model_id == model_id and v.routable
                     and any(v.record.layers.start < m.end and m.start < v.record.layers.end for m in missing)
                     for who in (v.record.peer_id, v.record.node_id))  # fmt: skip


def _departed(failed: frozenset[PeerId], gone: frozenset[PeerId] = frozenset()) -> Broken:
    """Hops the registry or our connections say are gone (or moved to other layers);
    ``gone``: those whose connection we lost (certain, unlike the registry's word)."""
    cause = StageFailed("unreachable", "a hop of the route left the swarm", ",".join(sorted(failed)))
    return Broken(failed, cause, gone=gone & failed)


def _describe(route: Sequence[Hop]) -> str:
    return " -> ".join(f"{h.peer_id[-6:]}[{h.layers}]" for h in route)
