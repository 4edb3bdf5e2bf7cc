"""A session's route as the entry peer drives it (a *leg*), and how the entry tells that a
hop of it has failed.

Each route of a session is a leg with its own wire session id: frames still in flight on an
old route (a stalled hop that wakes up) then carry an id nobody continues. :class:`LegWatch`
reads a leg's health from the registry (Dead, Degraded, gone, moved: failed; draining or
idle: leaving), from our connections (a hop we were connected to and no longer are, for
``disconnect_grace_s``: failed), and, after a missed deadline, from pings; :func:`blame`
reads which hop an ``error`` frame points at.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import trio

from inclavate.types import NodeId, PeerId, SessionId
from p2p import wire
from p2p.failover import FailoverPolicy, hop_trouble
from p2p.inbox import Inbox
from p2p.records import legacy_owner
from p2p.registry import NodeView
from p2p.routing import Hop


@dataclass(eq=False)
class Leg:
    wire_id: SessionId
    route: tuple[Hop, ...]
    inbox: Inbox[wire.Message]
    seen: set[PeerId] = field(default_factory=set)
    """Hops we have been connected to: losing that connection means the hop died."""
    lost: dict[PeerId, float] = field(default_factory=dict)
    """When a seen hop's connection was first missed."""

    @property
    def peers(self) -> frozenset[PeerId]:
        return frozenset(h.peer_id for h in self.route)

    @property
    def blame_ids(self) -> frozenset[PeerId]:
        """Its hops as a failure blames them (:attr:`~p2p.routing.Hop.blame_id`)."""
        return frozenset(PeerId(h.blame_id) for h in self.route)


def seen_gone(blamed: frozenset[PeerId], error: wire.Error, me: PeerId) -> frozenset[PeerId]:
    """The blamed hop an ``unreachable`` error of our own names as the peer we could not
    reach (our link to it ended, a stream to it could not be opened): gone for certain,
    unlike the other blames (a stage's own error: it still answers; a missed deadline: a
    guess). Only our own: a hop's report is its word, and a lying hop would keep its
    successor out of every route of ours for ``gone_s`` per lie."""
    if error.code != "unreachable" or error.failed_peer is None or error.origin != me:
        return frozenset()
    return blamed & {error.failed_peer}


def blame(leg: Leg, error: wire.Error, me: PeerId) -> frozenset[PeerId]:
    """The hop an error points at: for ``unreachable``, the hop it names or else the one
    after its reporter; for anything else, the reporter. ``origin`` is the peer the frame
    came from (the forward service sets it so on arrival), or a legacy node it relays, and
    only hops of the route can be blamed. A hop's report may name only the hop after it (the
    only one it sends to; naming another, it blames itself), so a lying stage can get itself
    avoided, never a hop of its choosing; our own (``me``: a link of ours that ended) names
    any hop. A hop is blamed by its :attr:`~p2p.routing.Hop.blame_id`: a relayed legacy
    node alone, not the peer relaying it; a peer named unreachable, with all its hops."""
    route = leg.route
    at = _hop_of(leg, error.origin)
    reporter = frozenset({PeerId(route[at].blame_id)}) if at is not None else frozenset()
    if error.code != "unreachable":
        return reporter
    successor = route[at + 1 : at + 2] if at is not None else route[:1]
    if error.failed_peer is None:
        # the last hop has no one after it: its own failure
        return frozenset(PeerId(h.blame_id) for h in successor) or reporter
    if error.origin == me or error.failed_peer in {h.peer_id for h in successor}:
        return frozenset({error.failed_peer}) & leg.peers
    return reporter


def refusal_suspects(leg: Leg, origin: PeerId, me: PeerId) -> frozenset[PeerId] | None:
    """Whom a hop's refusal of its input (``invalid_batch``, ``context_full``) blames: None
    when the input was the request's own (the route's first hop refused the token ids this
    entry sent; or ``origin`` is on no hop), else that hop and the one before it, which
    produced the input (its hidden states, and the position it sent them at), never ``me``.

    Past the first hop, input is what the hop before made of the request: treated as the
    request's fault, a hop on the route that sent its successor NaN, or a position past what
    the session holds there, had that honest successor blamed and every chat through it
    failed as the client's error, itself never blamed (an audit, 2026-12-07). The refusal is
    the reporter's word, which the entry cannot check (hidden states never travel back): a
    lying reporter would have its honest predecessor avoided. So both are suspects, as a
    guess, and the one that is in every such failure is the one that keeps losing trust."""
    at = _hop_of(leg, origin)
    if not at:
        return None
    return frozenset(PeerId(h.blame_id) for h in leg.route[at - 1 : at + 1] if h.peer_id != me)


def speaker(leg: Leg, origin: PeerId) -> PeerId:
    """Whom an error's ``origin`` blames on this leg (:attr:`~p2p.routing.Hop.blame_id`):
    itself when it names a hop; the hop of the peer it is namespaced under when it names a
    relayed node that is on no hop of the leg (a peer may speak for its own legacy nodes, so
    a hop naming one it made up blamed nobody, and failed every request sent through it
    unavoided: an audit, 2026-12-07); anyone else as it is."""
    at = _hop_of(leg, origin)
    return PeerId(leg.route[at].blame_id) if at is not None else origin


def _hop_of(leg: Leg, origin: PeerId) -> int | None:
    """The hop of the leg that ``origin`` speaks as: its own, or its peer's first."""
    ids = [h.blame_id for h in leg.route]
    if origin in ids:
        return ids.index(origin)
    peers = [h.peer_id for h in leg.route]
    owner = origin if origin in peers else legacy_owner(origin)
    return peers.index(PeerId(owner)) if owner in peers else None


@dataclass
class LegWatch:
    me: PeerId
    view_of: Callable[[NodeId], NodeView | None]
    """One node's registry view. Asked per hop, not listed whole: every session asks every
    ``poll_s``, and listing (and sorting) a registry of thousands of nodes that often was
    work on every token's path that grew with the swarm."""
    is_connected: Callable[[PeerId], bool]
    probe: Callable[[PeerId], Awaitable[bool]] | None
    policy: FailoverPolicy

    def trouble(self, leg: Leg) -> tuple[frozenset[PeerId], frozenset[PeerId], frozenset[PeerId]]:
        """(failed, leaving, gone) hops of a leg, from the registry and our connections.
        ``gone``: the failed ones whose connection we lost, gone for certain (the registry's
        word may lag, or name a hop that merely moved to other layers)."""
        now = trio.current_time()
        failed: set[PeerId] = set()
        leaving: set[PeerId] = set()
        gone: set[PeerId] = set()
        for hop in leg.route:
            trouble = hop_trouble(hop, self.view_of(hop.node_id))
            if trouble == "failed":
                failed.add(PeerId(hop.blame_id))  # a relayed node's record speaks for that node alone
            elif trouble == "leaving":
                leaving.add(PeerId(hop.blame_id))
            peer = hop.peer_id
            if peer == self.me:
                continue
            if self.is_connected(peer):
                leg.seen.add(peer)
                leg.lost.pop(peer, None)
            elif peer in leg.seen and now - leg.lost.setdefault(peer, now) >= self.policy.disconnect_grace_s:
                failed.add(peer)
                gone.add(peer)
        return frozenset(failed), frozenset(leaving - failed), frozenset(gone)

    async def stalled(self, leg: Leg) -> frozenset[PeerId]:
        """After a missed deadline: the hops that do not answer a ping; when every hop answers
        (or none can be asked), every hop but this peer. A hop that takes frames and says
        nothing answers pings like any other, and blaming nobody let it keep every session:
        each failover chose the same cheapest route through it again, and so did every new
        request, each failing after ``max_failovers`` deadlines. The blame is a guess (the
        caller marks it so): honest hops of the route are avoided only while a route
        exists without them, and recover with the next session they serve, while the hop
        that never answers keeps losing reliability and is routed around."""
        others = leg.peers - {self.me}
        if self.probe is None:
            return others
        probe = self.probe
        silent: set[PeerId] = set()

        async def check(peer: PeerId) -> None:
            with trio.move_on_after(self.policy.probe_timeout_s):
                if await probe(peer):
                    return
            silent.add(peer)

        async with trio.open_nursery() as nursery:
            for peer in others:
                nursery.start_soon(check, peer)
        return frozenset(silent) or others
