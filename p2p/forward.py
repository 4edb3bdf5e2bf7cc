"""The forward protocol service: hidden states from stage to stage, tokens home.

Routing is server to server. The entry peer sends ``forward`` to the first hop with the
rest of the route; each stage runs its range and passes ``forward`` to the next; the last
stage samples and sends ``result`` straight to the entry peer. Any stage that fails sends
``error`` to the entry peer. ``close`` follows the same route and frees the session on
every hop.

Each direction between two peers uses one long-lived stream (opening one costs 3-5 ms),
written by one sender task per peer (:class:`_Link`) so frames for a session stay in order
and a slow neighbour back-pressures only the work headed to it. Every write has a deadline;
a stream that misses it is reset on both sides and the failure goes to the entry peer as
an ``error`` message, never a silent hang.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol, cast

import trio

from inclavate import tensors
from inclavate.turns import send_or_wait
from inclavate.types import NodeId, PeerId, SessionId
from inclavate.untrusted import DropCounter
from node.engine import BatchItem
from node.errors import ContextFull, InvalidBatch, SessionEvicted, SessionLimitReached
from node.kept_outputs import MAX_REPLAYS, STRANGER_REPLAYS
from node.slot_share import relayed
from node.stage import Job, Stage, StageResult
from p2p import forward_checks, wire
from p2p.admission import Admission, AdmissionLimits, held_bytes
from p2p.asked import AskedRequests
from p2p.direct import DirectLinks
from p2p.errors import LinkFull, P2PError, StreamError
from p2p.failover import replay_plan
from p2p.forward_checks import FrameReason, FrameRejected, RecordOf
from p2p.inbox import Alarm, Inbox
from p2p.framing import DEFAULT_MAX_FRAME_SIZE, FramedStream
from p2p.host import P2PHost
from p2p.records import NodeRecord, legacy_owner
from p2p.routing import Hop
from p2p.sealed import SealedStream
from p2p.ticks import sleep_to_tick

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Timeouts:
    connect: float = 5.0
    """Opening a stream to the next hop."""
    direct: float = 2.0
    """Trying a direct connection first (then the libp2p stream gets ``connect``)."""
    send_base: float = 10.0
    """Any frame gets at least this long to be written..."""
    send_bytes_per_s: float = 1_000_000.0
    """...plus its size at this (pessimistic, home-uplink) rate."""
    idle: float = 3600.0
    """An inbound stream with no frame for this long (to within a tenth) is reset; the
    sender reopens one (:meth:`ForwardService._reset_idle_streams`)."""
    close_retry: tuple[float, ...] = (10.0, 20.0, 40.0, 80.0)
    """Our own close that could not be delivered is sent again after each of these waits,
    while the hop is still registered: one that stalled and came back (a stopped process, a
    slow machine) frees the session then, not at its idle timeout ten minutes on."""

    def send(self, nbytes: int) -> float:
        return self.send_base + nbytes / self.send_bytes_per_s


_REJECTION_CODES: dict[FrameReason, wire.ErrorCode] = {
    FrameReason.ROUTE_GAP: "wrong_route",
    FrameReason.ROUTE_INCOMPLETE: "wrong_route",
    FrameReason.ROUTE_REPEATS: "wrong_route",
    FrameReason.ROUTE_UNREGISTERED: "wrong_route",
    FrameReason.WRONG_INPUT: "invalid_batch",
    FrameReason.NOT_FINITE: "invalid_batch",
    FrameReason.TOKEN_OUT_OF_RANGE: "invalid_batch",
    FrameReason.SESSION_QUOTA: "session_limit",
    FrameReason.STRANGER_AT_RELAY: "session_limit",
    FrameReason.REPLAY_REFUSED: "protocol",
    FrameReason.TOO_LARGE: "protocol",
    FrameReason.QUEUE_FULL: "protocol",  # as a frame over its sender's budget is answered
}


async def _ignore(_: StageResult) -> None:
    return None


def _feeds(record: NodeRecord, model_id: str | None, start: int) -> bool:
    """Whether ``record``'s node is a live previous hop, on some route, of a range of
    ``model_id`` (None: of any model) that starts at layer ``start``."""
    return record.end_layer == start and record.state != "Dead" and model_id in (None, record.model_id)


def _speaks_for(remote: PeerId, origin: PeerId) -> bool:
    """Whether ``remote`` may send an error in ``origin``'s name: its own, or a legacy node's
    it relays (whose id is namespaced under the relaying peer's)."""
    return origin == remote or legacy_owner(origin) == remote


def _source(msg: wire.Forward, remote: PeerId) -> str:
    """Whom a session's slot counts against (``node.slot_share``): its entry, as authenticated
    (token ids come from the entry itself), or as the previous hop passes it on. Keyed by the
    previous hop alone, every session of a first stage would count as that stage's at the
    next, the hoarder's and everyone else's alike."""
    return remote if msg.tokens is not None else relayed(remote, msg.reply_to)


def error_code_for(exc: BaseException) -> wire.ErrorCode:
    if isinstance(exc, SessionLimitReached):
        return "session_limit"
    if isinstance(exc, SessionEvicted):
        return "session_evicted"
    if isinstance(exc, ContextFull):
        return "context_full"
    if isinstance(exc, InvalidBatch):
        return "invalid_batch"
    if isinstance(exc, StreamError):
        return "unreachable"
    return "engine_error"


class _Flush:
    """Queued after a frame written in place in part: the link's task writes the rest."""


_FLUSH = _Flush()


class _Link:
    """The outbound stream to one peer and the task that writes it, in order.

    A frame for an idle link (this task waits on an empty queue) is written in place by
    whoever sends it (:meth:`write_now`): a decode step then leaves in the sender's own turn
    instead of waiting for this task's, ~0.15-0.4 ms a hop in a 3-peer chain on loopback.
    What the kernel does not take at once is left to this task, so a neighbour that stops
    reading still holds back only the work headed to it, never the sender."""

    def __init__(self, service: ForwardService, peer: PeerId) -> None:
        self.peer = peer
        self._service = service
        self.send_channel, self._receive = trio.open_memory_channel[wire.Message | _Flush](_LINK_QUEUE)
        self._stream: FramedStream | SealedStream | None = None
        self._watching = trio.CancelScope()
        self._ended = False
        self._parked = False
        """This task waits on an empty queue and holds nothing unwritten. Whoever queues a
        message clears it first: a message handed straight to the waiting task leaves the
        queue's buffer empty, and a write in place must not overtake it."""
        self._partial: wire.Message | None = None
        """The message written in place in part (its rest is in the stream, a flush queued)."""
        self._retired = False

    def retire(self) -> None:
        """No more messages: what is queued is written on the stream it has (or answered
        with errors) and the task ends; nothing is written in place any more, and no new
        stream is opened (its peer is gone or unreachable). A retired link that opened a
        stream for what was queued behind a failed write raced the link that replaced it:
        a session's first frame arrived after its close, sent later on the new link, and
        opened the session at the next hops for good (until their idle timeout; an audit,
        2026-12-08)."""
        self._parked = False
        self._retired = True
        self.send_channel.close()

    async def queue(self, msg: wire.Message) -> None:
        """Queue ``msg`` for this task; waits only for room (raises ClosedResourceError once
        the link is retired)."""
        self._parked = False
        await send_or_wait(self.send_channel, msg)  # no scheduler turn: see _burst

    def queue_nowait(self, msg: wire.Message) -> bool:
        """Queue ``msg`` if there is room: False when the queue is full (raises
        ClosedResourceError once the link is retired)."""
        self._parked = False
        try:
            self.send_channel.send_nowait(msg)
        except trio.WouldBlock:
            return False
        return True

    def write_now(self, msg: wire.Message) -> bool:
        """Write ``msg`` in place if the link is idle: True when it is committed to the
        stream (the kernel took it, or the rest is queued for this task to write), False
        when nothing was written (queue it)."""
        stream = self._stream
        if stream is None or not self._parked or self._ended or self._partial is not None:
            return False
        if not stream.send_nowait(wire.encode(msg)):
            return False
        if stream.has_unsent:
            self._partial = msg
            self._parked = False
            self.send_channel.send_nowait(_FLUSH)  # the queue was empty: there is room
        return True

    async def run(self) -> None:
        try:
            await self._send_all()
        except BaseException:
            self._end()
            if self._stream is not None:  # cancelled: a direct link's socket must not leak
                await self._stream.reset()
            raise
        self._end()
        if self._stream is not None:
            await self._stream.close()

    def _end(self) -> None:
        self._ended = True
        self._watching.cancel()

    def watch(self, nursery: trio.Nursery, stream: FramedStream | SealedStream) -> None:
        stream.max_receive_size = 0  # nothing comes back on a link: any frame is refused on its prefix
        self._watching = trio.CancelScope()
        nursery.start_soon(self._watch, stream, self._watching)

    async def _watch(self, stream: FramedStream | SealedStream, scope: trio.CancelScope) -> None:
        """Wait for the end of ``stream``'s other direction. The receiving peer never writes
        on it, and keeps it open while it lives (its idle timeout is an hour), so an end or
        a reset means the peer is gone: a ``kill -9`` is seen here at once, where the libp2p
        connection's loss is seen a few hundred ms later."""
        with scope:
            try:
                await stream.receive(timeout=math.inf)
            except (P2PError, trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass
            if self._stream is stream and not self._ended:
                self._service.link_lost(self.peer, self)

    async def _send_all(self) -> None:
        async with self._receive:
            while True:
                self._parked = not self._receive.statistics().current_buffer_used
                try:
                    first = await self._receive.receive()
                except trio.EndOfChannel:
                    return
                finally:
                    self._parked = False
                await self._write(await self._burst(first))

    async def _write(self, queued: list[wire.Message | _Flush]) -> None:
        partial: wire.Message | None = None
        if any(m is _FLUSH for m in queued):
            partial, self._partial = self._partial, None
        burst = cast(list[wire.Message], [partial if m is _FLUSH else m for m in queued])
        for attempt in (1, 2):
            fresh = self._stream is None
            # The stream holds the rest of ``partial``; a fresh stream needs it whole.
            payloads = [wire.encode(m) for m in burst if fresh or m is not partial]
            try:
                if self._stream is None:
                    if self._retired:
                        raise P2PError(f"the link to {self.peer} was given up")
                    self._stream = await self._service.open_stream(self.peer)
                    self.watch(self._service.nursery, self._stream)
                await self._stream.send_many(payloads, timeout=self._service.timeouts.send(sum(map(len, payloads))))
                return
            except P2PError as exc:
                if self._stream is not None:
                    await self._stream.reset()
                    self._stream = None
                # A stream idle long enough may have been dropped by the other side;
                # one retry on a fresh stream tells that apart from a dead peer.
                if fresh or attempt == 2:
                    for lost in burst:
                        await self._service.undeliverable(lost, self.peer, exc, self)
                    return

    async def _burst(self, first: wire.Message | _Flush) -> list[wire.Message | _Flush]:
        """``first`` and the messages queued right behind it. A stage queues a batch's
        results without yielding, so they are all here when this task runs; while more keep
        coming (several producers), yielding lets them join the write, and the batch arrives
        at the next stage together. A lone message (one session decoding) leaves at once:
        a scheduler turn here is a turn of other tasks' work ahead of the next hop."""
        burst = [first]
        while len(burst) < _BURST_MAX:
            more = len(burst)
            while len(burst) < _BURST_MAX:
                try:
                    burst.append(self._receive.receive_nowait())
                except (trio.WouldBlock, trio.EndOfChannel):  # ended: the link was retired
                    break
            if len(burst) == more:
                return burst
            await trio.sleep(0)
        return burst


_LINK_QUEUE = 64
"""Messages a link holds unwritten: at the defaults (8 sessions, prompts of 4 chunks) more
than a stage has in flight to one neighbour."""

_BURST_MAX = _LINK_QUEUE
"""Most messages one write carries."""

_INBOX_SIZE = 256
"""Answers a session's inbox holds unread (a full one refuses more: the hops of its route
cannot grow it)."""
_MAX_CLOSE_RETRIES = 256
"""Undelivered closes of ours being sent again (a close is a few hundred bytes)."""
_ONWARD_SLACK = 4
"""``ForwardService._onward`` is pruned once it holds this many entries per session slot."""
_close_ids = itertools.count(1)


class RelayedNodes(Protocol):
    """The legacy nodes this peer vouches for (:class:`p2p.legacy.LegacyNodes`), whose hops
    it carries over HTTP."""

    def serves(self, node_id: str) -> bool: ...

    async def relay(self, msg: wire.Forward | wire.Close) -> None: ...


class ForwardService:
    def __init__(
        self,
        host: P2PHost,
        *,
        node_id: NodeId,
        stage: Stage | None,
        wire_dtype: tensors.WireDType = "f16",
        timeouts: Timeouts = Timeouts(),
        admission: AdmissionLimits = AdmissionLimits(),
        max_frame_bytes: int = DEFAULT_MAX_FRAME_SIZE,
        direct_port: int | None = 0,
    ) -> None:
        self.host = host
        self.direct = DirectLinks(host, port=direct_port) if direct_port is not None else None
        """The direct data plane (:mod:`p2p.direct`) on ``direct_port`` (0: any free port);
        None: libp2p streams only."""
        self.me = host.peer_id
        self.node_id = node_id
        self._stage: Stage | None = None
        self._onward: dict[SessionId, tuple[tuple[Hop, ...], PeerId]] = {}
        """For each session this stage passes on: the rest of its route and its entry (what
        closing it after an eviction needs). Pruned to what the stage holds when it grows
        past ``_ONWARD_SLACK`` x its slots."""
        self._sent_as: dict[SessionId, SessionId] = {}
        """For a session adopted here under a new id and not sent on since: the id the hops
        after this one still hold it under (a row of ``_onward``). Closed there when the
        session goes on under its new id or is freed here (:meth:`_close_sent_as`)."""
        self.wire_dtype = wire_dtype
        self.timeouts = timeouts
        self.max_frame_bytes = max_frame_bytes
        """Largest inbound frame: what the model needs (see :func:`p2p.wire.max_frame_bytes`)."""
        self._links: dict[PeerId, _Link] = {}
        self._waiting: dict[FramedStream | SealedStream, float] = {}
        """Inbound streams being read, with when their reader began to wait for the next
        frame (infinity while it handles one): one row per live stream."""
        self._inboxes: dict[SessionId, Inbox[wire.Message]] = {}
        self._alarm = Alarm()
        """Times the waits of the sessions this peer drives (:mod:`p2p.inbox`)."""
        self._inbox_peers: dict[SessionId, frozenset[PeerId]] = {}
        self._asked = AskedRequests(self.me)
        """The requests sent for sessions this peer drives (:meth:`ask`), and who may answer each."""
        self._nursery: trio.Nursery | None = None
        self.relayed: RelayedNodes | None = None
        """The legacy nodes this peer relays (set by the peer): a hop of theirs is carried
        here only if this peer vouches for it (:meth:`_relayed_for`), never for a record anyone
        can publish naming a ``forward_url``."""
        self.record_of: RecordOf | None = None
        """The registry's record of a node (set by the peer): routes are checked against it,
        and peers it lists are "known" to admission control. None trusts every route."""
        self.records_signed_by: Callable[[PeerId], Iterable[NodeRecord]] | None = None
        """Every record a peer signs, its node's and its legacy nodes' (set by the peer): a
        frame of hidden states gets a known peer's quota only from a peer that signs a live
        record of this model ending where this stage starts (:meth:`_may_feed`)."""
        self.registry_table: Callable[[], object] | None = None
        """The registry's current table (set by the peer): a new object whenever any record
        changes. The route checks of a step context are run once per table (:meth:`_passed`)."""
        self._passed_routes: dict[tuple[bytes, PeerId], bool] = {}
        """Step contexts (their bytes) and senders whose route and sender checks passed against
        ``_passed_table`` and the current stage, with the sender's verdict (a known peer or
        not). Emptied when either changes; at most ``wire.CONTEXT_CACHE_ENTRIES`` rows."""
        self._passed_table: object = None
        self.admission = Admission(admission, is_known=self._is_known, fed_by=self._fed_by)
        self.drops = DropCounter()
        """Frames refused, by :class:`~p2p.forward_checks.FrameReason`."""
        self.leaving = False
        """Set when the peer leaves: frames for its stage are answered ``shutting_down``."""
        self._close_attempts: dict[tuple[PeerId, SessionId, int], int] = {}
        """Our closes that could not be delivered, by (hop, session, request): how many times
        they were sent again (bounded by ``_MAX_CLOSE_RETRIES``)."""
        self.stage = stage

    @property
    def stage(self) -> Stage | None:
        return self._stage

    @stage.setter
    def stage(self, stage: Stage | None) -> None:
        self._stage = stage
        self._onward.clear()
        self._sent_as.clear()
        self._passed_routes.clear()
        if stage is not None:
            stage.on_evict = self._on_evicted
        self.admission.reset_in_flight()

    async def _on_evicted(self, session_id: SessionId) -> None:
        """The stage gave ``session_id``'s slot to another source: forget its opener, and close
        it on the hops after this one too (:meth:`_close_onward`)."""
        self.admission.closed(session_id)
        await self._close_onward(session_id)

    async def _close_onward(self, session_id: SessionId) -> None:
        """Close a session this stage freed on its own on the hops after it, which hold it
        too: a known peer's session there (this stage is their known previous hop) would
        otherwise keep its slot until their idle timeout (10 minutes), so that one stranger
        identity per slot, each allowed one session here, held every later stage's slots."""
        await self._close_sent_as(session_id)
        onward = self._onward.pop(session_id, None)
        if onward is None:
            return
        route, entry = onward
        with trio.move_on_after(self.timeouts.connect):
            try:  # queued now, ahead of the new session's frames (it runs in the stage's worker)
                await self.send(route[0].peer_id, wire.Close(next(_close_ids), session_id, route, entry), wait_for_room=False)
            except P2PError as exc:
                log.info("cannot close session %s onward at %s: %s", session_id, route[0].peer_id, exc)

    async def _close_sent_as(self, session_id: SessionId) -> None:
        """Close the id the hops after this one hold an adopted session under, now that it
        goes on under its new id (or is freed here). The hop that adopted it and fed them is
        the one that knows: an honest entry closes its old leg itself (its close along the
        route takes the row first), but anyone who may adopt a session, its stranger opener
        among them, renamed it here again and again, and each new id went on to the next hop
        beside the last: one stranger session here held every slot of the next stage
        (2026-12-07, an audit; ``tests/adversary/test_edge_rules.py -k left_at_the_next_hop``)."""
        old = self._sent_as.pop(session_id, None)
        if old is not None:
            await self._close_onward(old)

    async def _going_on(self, session_id: SessionId, route: tuple[Hop, ...], entry: PeerId) -> None:
        """``session_id`` goes on along ``route``: first close where the hops after this one
        hold it and will not be fed it again (an adopted session's old id; this id on a route
        that is neither part of nor longer than the one it took), then note the route.

        An honest session goes on along one route per id (a rebuild frame along the first
        hops of it, then its steps along all of it), so only what a stranger sends is closed:
        its one session here, sent on along one route and then another, then adopted and sent
        on again, left an id at every turn (2026-12-07, an audit)."""
        if self._sent_as:
            await self._close_sent_as(session_id)
        row = self._onward.get(session_id)
        if row is not None and row[0] != route:
            took = row[0]
            if took[: len(route)] == route:
                return  # part of the route it took: the longer one reaches every hop that holds it
            if route[: len(took)] != took:
                await self._close_onward(session_id)
        self._note_onward(session_id, route, entry)

    def _renamed(self, old: SessionId, new: SessionId) -> None:
        """``old`` was adopted here as ``new``: the hops after this one hold it under the id
        it last went on with, until it goes on again (:meth:`_close_sent_as`)."""
        sent_as = self._sent_as.pop(old, old)
        if sent_as in self._onward:
            self._sent_as[new] = sent_as
            self._prune_onward()

    def _note_onward(self, session_id: SessionId, route: tuple[Hop, ...], entry: PeerId) -> None:
        self._onward[session_id] = (route, entry)
        self._prune_onward()

    def _prune_onward(self) -> None:
        """Keep ``_onward`` and ``_sent_as`` to the sessions the stage holds (and the ids
        their next hops hold them under) once they grow past ``_ONWARD_SLACK`` x its slots."""
        stage = self._stage
        limit = _ONWARD_SLACK * stage.engine.config.max_sessions if stage is not None else 0
        if stage is None or (len(self._onward) <= limit and len(self._sent_as) <= limit):
            return
        held = set(stage.engine.sessions())
        self._sent_as = {new: old for new, old in self._sent_as.items() if new in held}
        keep = held | set(self._sent_as.values())
        for sid in [sid for sid in self._onward if sid not in keep]:
            del self._onward[sid]

    def _is_known(self, peer: PeerId) -> bool:
        if peer == self.me or self.record_of is None:
            return True
        record = self.record_of(NodeId(peer))
        return record is not None and record.state != "Dead"

    def _fed_by(self, session_id: SessionId) -> tuple[str, ...]:
        """The peers that opened ``session_id`` at this stage: the sender of its frames and
        the entry they named (``reply_to``), as the stage recorded them. They may close it
        whatever the registry says of them now (:meth:`Admission.may_close`)."""
        stage = self._stage
        return stage.fed_by(session_id) if stage is not None else ()

    def _may_feed(self, remote: PeerId, msg: wire.Forward, stage: Stage) -> bool:
        """Whether ``remote`` gets a known peer's session quota for ``msg`` at ``stage``.

        Any registered peer may be an entry (token ids for the first range); hidden states
        come only from the previous hop of a route, which signs a live record of this model
        ending where this stage starts. A record costs nothing to publish: without the second
        rule, any identity that gossiped one about itself could hold every slot of every
        stage (and feed any session whose id it learnt)."""
        if msg.tokens is not None or self.records_signed_by is None or remote == self.me:
            return self._is_known(remote)
        return self._feeds_range(remote, stage.engine.info.model_id, stage.engine.info.layers.start)

    def _feeds_range(self, remote: PeerId, model_id: str | None, start: int) -> bool:
        """Whether ``remote`` signs a live record of a previous hop of a range of ``model_id``
        starting at ``start`` (its own node, or a legacy node it relays)."""
        own = self.record_of(NodeId(remote)) if self.record_of is not None else None
        if own is not None and _feeds(own, model_id, start):  # the usual case: one lookup
            return True
        signed = self.records_signed_by(remote) if self.records_signed_by is not None else ()
        return any(_feeds(record, model_id, start) for record in signed)

    def _refusal_goes_to(self, msg: wire.Forward, remote: PeerId) -> PeerId:
        """Where a refusal of ``msg``, received from ``remote``, is sent: to the session's
        entry (``reply_to``) if ``remote`` acts for the session (the entry itself, or a live
        previous hop of the route's first range), else back to ``remote``.

        Anyone may name any entry: a refusal sent there arrives in this peer's name, and the
        entry fails the request or fails over and avoids this peer (or the hop before it): a
        stranger who learnt a session id could end it, or steer its traffic, through honest
        hops (an audit, 2026-12-05)."""
        if remote in (msg.reply_to, self.me) or self.record_of is None:
            return msg.reply_to
        hop = self.record_of(msg.route[0].node_id)  # a relayed node's model may not be our stage's
        model_id = hop.model_id if hop is not None else self.stage.engine.info.model_id if self.stage is not None else None
        return msg.reply_to if self._feeds_range(remote, model_id, msg.route[0].layers.start) else remote

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            # A neighbour sends on one stream (its link to us); 4 lets it replace a link
            # while the old stream's end has not reached us, more than once in a row.
            self.host.set_stream_handler(wire.PROTOCOL, self._serve_stream, max_streams_per_peer=4)
            if self.direct is not None:
                self.direct.set_handler(wire.PROTOCOL, self._serve_stream)
                await nursery.start(self.direct.run)
            await nursery.start(self._alarm.run)
            nursery.start_soon(self._free_idle_stranger_sessions)
            nursery.start_soon(self._reset_idle_streams)
            task_status.started()
            await trio.sleep_forever()

    # ---------------------------------------------------------------- outbound

    async def send(self, peer: PeerId, msg: wire.Message, *, wait_for_room: bool = True) -> None:
        """Queue ``msg`` for ``peer`` (or handle it here if the peer is us).

        ``wait_for_room=False`` is for what a stage's job sends on (its hidden states, its
        token, its error, a close): where the link's queue is full, the message is
        undeliverable at once (the entry hears ``unreachable`` and fails over) instead of
        waiting, so that a peer that stops reading holds back only the work headed to it,
        never the stage's other sessions."""
        if peer == self.me:
            await self._dispatch(msg, self.me)
            return
        link = self._links.get(peer)
        if link is not None and link.write_now(msg):
            return
        while True:
            link = self._links.get(peer)
            if link is None:
                assert self._nursery is not None, "ForwardService.run has not started"
                link = self._links[peer] = _Link(self, peer)
                self._nursery.start_soon(link.run)
            try:
                if wait_for_room:
                    await link.queue(msg)
                elif not link.queue_nowait(msg):
                    await self.undeliverable(msg, peer, LinkFull(f"{_LINK_QUEUE} frames already wait for the link to {peer}"))
                return
            except trio.ClosedResourceError:
                continue  # the link failed while we waited for room in it: use a fresh one

    async def ask(self, peer: PeerId, msg: wire.Forward | wire.Close | wire.Adopt) -> None:
        """Send a request of a session this peer drives (:meth:`open_inbox`): its answers are
        then taken only from the hops it reaches (:mod:`p2p.asked`)."""
        self._asked.asked(msg)
        await self.send(peer, msg)

    async def open_stream(self, peer: PeerId) -> FramedStream | SealedStream:
        """The outbound stream of a link: a direct connection where one can be made (a
        decode step costs a fraction of what it costs through libp2p), else libp2p."""
        if self.direct is not None:
            try:
                return await self.direct.open(peer, wire.PROTOCOL, timeout=min(self.timeouts.direct, self.timeouts.connect))
            except P2PError as exc:
                log.info("forwarding to %s over libp2p: %s", peer, exc)
        return await self.host.new_stream(peer, wire.PROTOCOL, timeout=self.timeouts.connect)

    @property
    def nursery(self) -> trio.Nursery:
        assert self._nursery is not None, "ForwardService.run has not started"
        return self._nursery

    def link_lost(self, peer: PeerId, link: _Link) -> None:
        """``peer``'s end of our link closed: retire the link (what is queued on it is
        answered with errors) and tell every session this peer drives through ``peer`` now,
        with an ``unreachable`` error naming it, instead of waiting for the connection's grace."""
        log.warning("the link to %s ended: the peer is gone", peer)
        self._retire(peer, link)
        for session_id, peers in self._inbox_peers.items():
            if peer in peers and session_id in self._inboxes:
                lost = wire.Error(0, session_id, "unreachable", f"peer {peer} closed its link", self.me, peer)
                try:
                    self._inboxes[session_id].send_nowait(lost)
                except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
                    pass  # a full inbox: the connection's loss is seen soon after anyway

    def _retire(self, peer: PeerId, link: _Link) -> None:
        if self._links.get(peer) is link:
            del self._links[peer]
            link.retire()

    async def undeliverable(self, msg: wire.Message, peer: PeerId, exc: BaseException, link: _Link | None = None) -> None:
        # A close that cannot reach a dead hop is routine after a failover (and retried).
        level = logging.INFO if isinstance(msg, wire.Close) else logging.WARNING
        log.log(level, "cannot deliver %s for session %s to %s: %s", msg.TYPE, msg.session_id, peer, exc)
        if link is not None:
            # The peer is gone or unreachable: retire its link. Its task answers what is still
            # queued (each with an error to the entry) and ends, instead of waiting forever.
            self._retire(peer, link)
        if isinstance(msg, wire.Close) and msg.reply_to == self.me:
            self._close_again_later(msg, peer)
        if isinstance(msg, (wire.Forward, wire.Close)) and msg.reply_to != peer:
            await self.send(msg.reply_to, wire.Error(
                msg.req_id, msg.session_id, "unreachable", f"peer {peer} is unreachable: {exc}", self.me, peer),
                wait_for_room=False)  # fmt: skip

    def _close_again_later(self, msg: wire.Close, peer: PeerId) -> None:
        key = (peer, msg.session_id, msg.req_id)
        attempt = self._close_attempts.pop(key, 0)
        if attempt >= len(self.timeouts.close_retry) or self._nursery is None:
            return
        if len(self._close_attempts) >= _MAX_CLOSE_RETRIES:
            del self._close_attempts[next(iter(self._close_attempts))]  # the oldest: it has had most of its tries
        self._close_attempts[key] = attempt + 1
        self._nursery.start_soon(self._close_again, msg, peer, self.timeouts.close_retry[attempt])

    async def _close_again(self, msg: wire.Close, peer: PeerId, wait: float) -> None:
        await trio.sleep(wait)
        if self._is_known(peer):  # gone from the registry, or Dead: its sessions went with it
            await self.send(peer, msg, wait_for_room=False)

    # ----------------------------------------------------------------- inbound

    async def _serve_stream(self, stream: FramedStream | SealedStream, remote: PeerId) -> None:
        """Read ``remote``'s frames until the stream ends (or :meth:`_reset_idle_streams`
        resets it). Its receives have no deadline of their own: a cancel scope per frame
        costs ~7 us, more on the caches an engine call left cold, at every hop of a step."""
        stream.max_frame_size = self.max_frame_bytes
        waiting = self._waiting
        try:
            while True:
                waiting[stream] = trio.current_time()
                payload = await stream.receive(timeout=math.inf)
                waiting[stream] = math.inf  # handling a frame is not idling
                try:
                    msg = wire.decode(payload)
                except P2PError as exc:
                    self.drops.count(FrameReason.MALFORMED)  # counted; a flood of them logs nothing
                    log.debug("dropping a malformed frame from %s: %s", remote, exc)
                    continue
                try:
                    await self._dispatch(msg, remote)
                except Exception:  # noqa: BLE001 - one frame's failure must not end the stream
                    log.exception("handling a %s frame from %s failed", msg.TYPE, remote)
        finally:
            waiting.pop(stream, None)

    async def _reset_idle_streams(self) -> None:
        """Reset inbound streams that brought no frame for ``timeouts.idle`` (within a tenth
        of it): their sender opens a fresh one when it has something to send."""
        while True:
            await sleep_to_tick(max(0.05, self.timeouts.idle / 10))
            cutoff = trio.current_time() - self.timeouts.idle
            for stream in [s for s, since in self._waiting.items() if since < cutoff]:
                del self._waiting[stream]
                try:
                    await stream.reset()
                except Exception:  # noqa: BLE001 - one stream's failure must not end this task
                    log.exception("resetting an idle inbound stream failed")

    async def _dispatch(self, msg: wire.Message, remote: PeerId) -> None:
        if isinstance(msg, wire.Forward):
            await self._on_forward(msg, remote)
        elif isinstance(msg, wire.Close):
            await self._on_close(msg, remote)
        elif isinstance(msg, wire.Adopt):
            await self._on_adopt(msg, remote)
        else:
            inbox = self._inboxes.get(msg.session_id)
            if inbox is not None and remote not in self._inbox_peers.get(msg.session_id, (remote,)):
                # Only a peer on the session's route may answer for it: anyone else who learnt
                # the id could otherwise hand the entry tokens, errors or a false "closed".
                self.drops.count(FrameReason.FOREIGN_REPLY)
                return
            refusal = self._asked.refusal(msg, remote) if inbox is not None else None
            if refusal is not None:  # a hop of the route answering a request that never reached it
                self.drops.count(refusal)
                return
            if isinstance(msg, wire.Error) and not _speaks_for(remote, msg.origin):
                # An error is the sender's word: it may not put it in another hop's mouth (the
                # entry would avoid that hop).
                self.drops.count(FrameReason.FOREIGN_ORIGIN)
                msg = dataclasses.replace(msg, origin=remote)
            elif isinstance(msg, wire.Adopted):  # the entry takes it only from the hop it asked
                msg = dataclasses.replace(msg, sender=remote)
            if inbox is not None:
                try:
                    inbox.send_nowait(msg)
                except (trio.WouldBlock, trio.ClosedResourceError):
                    log.warning("entry inbox of session %s is not being read", msg.session_id)

    def _serves(self, hop: Hop) -> Stage | None:
        stage = self._stage
        if stage is not None and hop.node_id == self.node_id and hop.layers == stage.engine.info.layers:
            return stage
        return None

    def _n_layers(self, hop: Hop) -> int | None:
        """The model's layers, as the registry says of ``hop``'s node (a hop this peer relays)."""
        record = self.record_of(hop.node_id) if self.record_of is not None else None
        return record.n_layers if record is not None else None

    def _relayed_for(self, hop: Hop) -> RelayedNodes | None:
        """The relay carrying ``hop``, if it is a legacy node this peer vouches for. A record
        naming a ``forward_url`` costs anyone nothing to publish: carrying every such hop let
        a stranger have this peer refuse frames to any entry it named, in this peer's name,
        and open sessions at the nodes it does relay past every stage rule (an audit,
        2026-12-07)."""
        relayed = self.relayed
        if relayed is None or not hop.forward_url or not relayed.serves(hop.node_id):
            return None
        return relayed

    def _check_relayed_sender(self, msg: wire.Forward, remote: PeerId) -> None:
        """Raise :class:`FrameRejected` unless ``remote`` acts for the sessions of the relayed
        hop ``msg.route[0]``: a registered entry (token ids) or a live previous hop of the
        node's range (hidden states). A stranger gets no session there, not even the bounded
        share a stage gives it: this peer cannot see the node's slots, nor which session
        is whose."""
        if remote == self.me or self.record_of is None:
            return
        hop = msg.route[0]
        if msg.tokens is not None:
            acts = self._is_known(remote)
        else:
            record = self.record_of(hop.node_id)
            acts = record is not None and self._feeds_range(remote, record.model_id, hop.layers.start)
        if not acts:
            raise FrameRejected(FrameReason.STRANGER_AT_RELAY,
                                f"{hop.node_id} is relayed here only for its sessions' entries and previous hops")  # fmt: skip

    async def _on_forward(self, msg: wire.Forward, remote: PeerId) -> None:
        if msg.tokens is not None and msg.reply_to != remote:
            # Token ids come from the entry itself, where every answer goes. One naming another
            # peer would have the swarm answer a third party, and would let its sender pass
            # downstream for as many sources as it names (``_source``). Not answered either.
            self.drops.count(FrameReason.TOKENS_NOT_FROM_ENTRY)
            log.info("dropping token ids from %s that name %s as their entry", remote, msg.reply_to)
            return
        known = self._passed(msg, remote)
        relayed: RelayedNodes | None = None
        if known is None:
            hop = msg.route[0]
            stage = self._serves(hop)
            relayed = None if stage is not None else self._relayed_for(hop)
            if stage is None and relayed is None:
                to = self._refusal_goes_to(msg, remote)
                if self.leaving and hop.node_id == self.node_id:
                    await self._fail(msg, "shutting_down", f"{self.me} has left the swarm", to=to, refused=True)
                    return
                await self._fail(msg, "wrong_route", f"{self.me} does not serve {hop.node_id} layers {hop.layers}", to=to, refused=True)
                return
        else:
            stage = self._stage
        # Each check below runs at every hop of every token, on caches the engine call left
        # cold: what only some frames need is asked only of them (a relayed hop's registry
        # lookup, a stranger's session ownership, a replay), and what a step context decides
        # once per registry table (:meth:`_passed`).
        try:
            if known is None:
                n_layers = stage.engine.info.n_layers if stage is not None else self._n_layers(hop)
                complete_at = None if msg.discard else n_layers or msg.route[-1].layers.end
                forward_checks.check_route(msg.route, complete_at, self.record_of)
            item = self._item(msg, stage) if stage is not None else None
            if stage is not None:
                if known is None:
                    known = self._may_feed(remote, msg, stage)
                    self._note_passed(msg, remote, known)
                # Whether the stage holds the session (its first job may still wait here:
                # someone's) decides only a stranger's frame.
                held = not known and stage.holds(msg.session_id)
                self.admission.admit(remote, msg.session_id, held=held, max_sessions=stage.engine.config.max_sessions,
                                     known=known)  # fmt: skip
                if msg.replay is not None:
                    self._check_replay(msg, stage)
                # A lone step computed in place holds its frame for no time anyone else can
                # see (no checkpoint until it is delivered): it takes no share of the budget.
                if item is not None and await stage.step_now(item, msg.sampling, msg.lane, functools.partial(self._after_stage, msg)):
                    return
            else:
                self._check_relayed_sender(msg, remote)
            decoded = item.hidden.nbytes if item is not None and item.hidden is not None else 0
            release = await self.admission.reserve(remote, held_bytes(msg.nbytes, decoded))
        except FrameRejected as exc:
            self.drops.count(exc.reason)
            await self._fail(msg, _REJECTION_CODES.get(exc.reason, "protocol"), str(exc), to=self._refusal_goes_to(msg, remote),
                             refused=True)  # fmt: skip
            return
        if stage is None or item is None:
            assert relayed is not None  # no stage here: the hop is a node this peer relays
            try:
                await relayed.relay(msg)
            finally:
                release()
            return

        async def deliver(result: StageResult) -> None:
            release()
            await self._after_stage(msg, result)

        try:
            job = Job(item, msg.session_id, deliver, msg.sampling, lane=msg.lane, source=_source(msg, remote))
            await stage.submit(job, in_place=False)  # step_now said no above
        except BaseException:
            release()  # never queued, or run in place and cut short: nothing holds the frame
            raise

    def _passed(self, msg: wire.Forward, remote: PeerId) -> bool | None:
        """Whether ``remote`` is a known peer for ``msg``, when a frame of the same step
        context from the same sender already passed the checks that context decides (this
        stage serves its first hop, its route is a registered chain, the sender may feed this
        stage) against the registry's current table; None: run them.

        Those checks read only the context's bytes, the sender, the stage and the table, so
        a frame passes them as its predecessor did until one of these changes. They cost ~20
        Python calls a frame in registry lookups alone, on caches the engine call left cold."""
        table = self.registry_table() if self.registry_table is not None else None
        if table is not self._passed_table:
            self._passed_routes.clear()
            self._passed_table = table
            return None
        return self._passed_routes.get((msg.context, remote)) if msg.context is not None else None

    def _note_passed(self, msg: wire.Forward, remote: PeerId, known: bool) -> None:
        """Remember that ``msg``'s context from ``remote`` passed (see :meth:`_passed`); the
        caller checked it against the table :meth:`_passed` just compared, with no turn since."""
        if msg.context is None:  # only step frames carry one (never a rebuild or a replay)
            return
        routes = self._passed_routes
        if len(routes) >= wire.CONTEXT_CACHE_ENTRIES:
            del routes[next(iter(routes))]
        routes[(msg.context, remote)] = known

    def _check_replay(self, msg: wire.Forward, stage: Stage) -> None:
        """A replay this hop must send: only what it kept, once per adopt (it consumes the
        permission the adopt gave), and a stranger's session fewer times over its life."""
        replay = msg.replay
        if replay is None or not forward_checks.check_replay(msg.route, replay.at, replay.until):
            return
        kept = stage.kept
        limit = STRANGER_REPLAYS if self.admission.opened_by_stranger(msg.session_id) else MAX_REPLAYS
        if kept is None or kept.length(msg.session_id) < replay.positions or not kept.take_replay(msg.session_id, limit):
            raise FrameRejected(FrameReason.REPLAY_REFUSED, f"no replay of session {msg.session_id} is due here")

    @staticmethod
    def _item(msg: wire.Forward, stage: Stage) -> BatchItem:
        info = stage.engine.info
        forward_checks.check_positions(msg.n_tokens, stage.engine.config.context_length)  # before decoding anything
        if msg.tokens is not None:
            forward_checks.check_tokens(msg.tokens, info)
            return BatchItem(msg.session_id, msg.start_pos, tokens=msg.tokens)
        if msg.hidden is None:
            raise FrameRejected(FrameReason.WRONG_INPUT, "a forward carries tokens or hidden states")
        return BatchItem(msg.session_id, msg.start_pos, hidden=forward_checks.decoded_hidden(msg.hidden, info))

    async def _after_stage(self, msg: wire.Forward, result: StageResult) -> None:
        if result.error is not None:
            await self._fail(msg, error_code_for(result.error), str(result.error), wait_for_room=False)
            return
        assert result.output is not None
        if len(msg.route) > 1:
            hidden = result.output.hidden
            assert hidden is not None
            route, row = msg.route[1:], self._onward.get(msg.session_id)
            if msg.session_id in self._sent_as or (row is not None and row[0] != route):  # rare: no coroutine a step
                await self._going_on(msg.session_id, route, msg.reply_to)  # its closes go ahead of its frames
            else:
                self._note_onward(msg.session_id, route, msg.reply_to)
            replay = msg.replay
            if replay is not None and msg.route[0].layers.end == replay.at:
                if not await self._send_replay(msg, replay):
                    return
                replay = None
            nxt = msg.onward(result.sent or tensors.encode(hidden, self.wire_dtype, half=result.output.half), replay)
            await self.send(nxt.route[0].peer_id, nxt, wait_for_room=False)
        elif msg.sampling is not None:
            await self.send(msg.reply_to, wire.Result(msg.req_id, msg.session_id, result.token), wait_for_room=False)

    async def _send_replay(self, msg: wire.Forward, replay: wire.Replay) -> bool:
        """Send the kept outputs of positions ``[0, k)`` into the replaced span, in the frames
        that built them, before the step itself (the same link keeps the order).

        The frames are this stage's own plan (:func:`~p2p.failover.replay_plan` of the frames
        it sent), not the request's: the frames a replay named were the sender's choice, and
        a stranger had 500 kept rows re-sent as 500 one-row frames, filling this stage's
        link to the next hop in its own name until every honest step on it was refused
        (2026-12-07, an audit). An honest entry plans the same frames from the same steps.

        The frames wait for room on the link (a replay may be longer than its queue), and
        this runs in the stage's worker: the whole replay has one deadline, what the link
        gives its bytes. Frame by frame, a next hop that never reads held the worker, and
        every other session at this stage, a link deadline per queueful of frames."""
        kept = self.stage.kept if self.stage is not None else None
        ends = [hop.layers.end for hop in msg.route]
        span = msg.route[1 : ends.index(replay.until) + 1]
        try:
            if kept is None:
                raise KeyError("this stage keeps no outputs")
            plan = replay_plan(kept.shapes(msg.session_id, replay.positions))
            frames = [(start, kept.rows(msg.session_id, start, n)) for start, n in plan]
        except (KeyError, IndexError) as exc:
            await self._fail(msg, "engine_error", f"cannot replay session {msg.session_id}: {exc}", wait_for_room=False)
            return False
        with trio.move_on_after(self.timeouts.send(sum(rows.nbytes for _, rows in frames))):
            for start, rows in frames:
                await self.send(span[0].peer_id, wire.Forward(msg.req_id, msg.session_id, start, span, msg.reply_to, None,
                                                              hidden=rows, discard=True))  # fmt: skip
            return True
        await self._fail(msg, "unreachable", f"the replay of session {msg.session_id} to {span[0].peer_id} missed its deadline",
                         wait_for_room=False)  # fmt: skip
        return False

    def _admits_control(self, msg: wire.Adopt | wire.Close, remote: PeerId, kind: str) -> bool:
        """A close or adopt acts on a session: only its own peers may send one, along a
        registered route; anything else is counted and dropped without an answer."""
        try:
            if not self.admission.may_close(remote, msg.session_id):
                raise FrameRejected(FrameReason.SESSION_NOT_YOURS, f"only the session's own peers may {kind} it")
            forward_checks.check_route(msg.route, None, self.record_of)
        except FrameRejected as exc:
            self.drops.count(exc.reason)
            log.debug("refusing a %s from %s: %s", kind, remote, exc)  # counted: a stranger's flood is no log flood
            return False
        return True

    async def _on_adopt(self, msg: wire.Adopt, remote: PeerId) -> None:
        """Rename a session to a failover's new leg, in order with its other jobs; answer
        with the positions kept (0 when this hop holds nothing for it)."""
        if not self._admits_control(msg, remote, "adopt"):
            return
        stage = self._serves(msg.route[0])
        if stage is None or not stage.holds(msg.session_id):
            # Nothing kept here, answered to whoever asked (an entry asks its hops itself): an
            # answer sent to the ``reply_to`` a frame names would let anyone put "nothing
            # kept" in this peer's mouth, to any entry, for a request it learnt the id of.
            # Answered without a job: a stage runs a close or adopt ahead of every step, and
            # a registered peer's adopts of made-up ids, ~2,000 a second, kept every session
            # here waiting (2026-12-07, an audit).
            await self.send(remote, wire.Adopted(msg.req_id, msg.new_id, 0))
            return

        async def deliver(result: StageResult) -> None:
            if result.length:
                self.admission.renamed(msg.session_id, msg.new_id)
                self._renamed(msg.session_id, msg.new_id)
            await self.send(msg.reply_to, wire.Adopted(msg.req_id, msg.new_id, result.length or 0), wait_for_room=False)

        await stage.submit(Job(None, msg.session_id, deliver, rename_to=msg.new_id))

    async def _on_close(self, msg: wire.Close, remote: PeerId) -> None:
        hop = msg.route[0]
        if not self._admits_control(msg, remote, "close"):
            return
        if self.stage is None or hop.node_id != self.node_id:
            relayed = self._relayed_for(hop)
            if relayed is not None:
                await relayed.relay(msg)
                return
            self._close_off_route(msg, remote, "its first hop is not this node's stage")
            return
        if not self.stage.holds(msg.session_id):
            # Nothing of it here: no job (one would run ahead of every step: see _on_adopt).
            await self._close_here(msg, remote, held=False)
            return

        async def deliver(_: StageResult) -> None:
            await self._close_here(msg, remote, held=True)

        await self.stage.submit(Job(None, msg.session_id, deliver))

    async def _close_here(self, msg: wire.Close, remote: PeerId, *, held: bool) -> None:
        """The session is closed here (``held``: its job just ran): pass the close on.

        Passed on, it is this peer's word, which the next hops honour, so it goes only where
        this stage sent the session; a known peer's close of a session held here goes on as
        before (it may close a session at any hop itself), so an entry whose session failed
        here still hears ``closed`` from the last hop at once. One of a session this stage
        holds nothing of goes nowhere else, whoever asks: a registered peer's closes of
        made-up ids went on to any registered hops it named, filling this peer's links to
        them (2026-12-07, an audit). Its entry, asking itself, is told at once, and closes
        each hop directly (it waited out its close timeout, 5 s, before: a review)."""
        self.admission.closed(msg.session_id)
        if held:  # the id the next hops still hold it under, if it was adopted here since
            await self._close_sent_as(msg.session_id)
        onward = self._onward.get(msg.session_id)
        along = onward is not None and onward[0] == msg.route[1:]
        if along or not held:
            self._onward.pop(msg.session_id, None)
        else:
            # Freed here, and the close does not follow it to the hops this stage sent it to
            # (a close of this hop alone, or along another route): this stage closes it there.
            # Its stranger opener closed it here alone, opened another, and so on: each
            # session it had left at the next hop took a slot there (2026-12-07, an audit).
            await self._close_onward(msg.session_id)
        if len(msg.route) == 1 or along or (held and self._is_known(remote)):
            await self._pass_close(msg, wait_for_room=False)
            return
        self._close_off_route(msg, remote, "this stage did not send the session on to those hops")
        if not held and remote == msg.reply_to and self._is_known(remote):
            await self.send(remote, wire.Error(msg.req_id, msg.session_id, "wrong_route",
                                               f"{self.me} holds nothing of session {msg.session_id} to close", self.me))  # fmt: skip

    def _close_off_route(self, msg: wire.Close, remote: PeerId, why: str) -> None:
        self.drops.count(FrameReason.CLOSE_OFF_ROUTE)
        log.debug("not passing on a close of session %s from %s: %s", msg.session_id, remote, why)

    async def _free_idle_stranger_sessions(self) -> None:
        period = max(0.5, self.admission.limits.stranger_idle_s / 4)
        while True:
            await sleep_to_tick(period)
            for session_id in self.admission.idle_stranger_sessions():
                stage = self.stage
                if stage is not None:
                    log.info("freeing session %s: opened by a peer outside the registry, now idle", session_id)
                    await stage.submit(Job(None, session_id, functools.partial(self._freed, session_id)))

    async def _freed(self, session_id: SessionId, _: StageResult) -> None:
        await self._close_onward(session_id)

    async def _pass_close(self, msg: wire.Close, *, wait_for_room: bool = True) -> None:
        if len(msg.route) > 1:
            nxt = wire.Close(msg.req_id, msg.session_id, msg.route[1:], msg.reply_to)
            await self.send(nxt.route[0].peer_id, nxt, wait_for_room=wait_for_room)
        else:
            await self.send(msg.reply_to, wire.Closed(msg.req_id, msg.session_id), wait_for_room=wait_for_room)

    async def _fail(self, msg: wire.Forward, code: wire.ErrorCode, message: str, *, to: PeerId | None = None,
                    wait_for_room: bool = True, refused: bool = False) -> None:  # fmt: skip
        """Answer ``msg``'s entry (or ``to``) with an error. Where a frame's own reader
        answers, it waits for room: a sender that floods refused frames and reads no answer is
        then no longer read either (see :meth:`send` for a stage's answers, which never wait).
        ``refused``: a frame refused on arrival, which any sender can make as fast as it
        writes: logged at debug (the refusal is counted, and answered)."""
        log.log(logging.DEBUG if refused else logging.INFO, "session %s failed at %s: %s", msg.session_id, self.me, message)
        await self.send(to or msg.reply_to, wire.Error(msg.req_id, msg.session_id, code, message, self.me),
                        wait_for_room=wait_for_room)  # fmt: skip

    # -------------------------------------------------------------- entry side

    def open_inbox(self, session_id: SessionId, route_peers: Iterable[PeerId] | None = None) -> Inbox[wire.Message]:
        """Results, errors and close acknowledgements for a session this peer drives, taken
        only from ``route_peers`` and this peer itself, each for a request sent with
        :meth:`ask` and only from a hop that request reached (None: from anyone)."""
        inbox = self._inboxes[session_id] = Inbox[wire.Message](_INBOX_SIZE, self._alarm)
        if route_peers is not None:
            self._inbox_peers[session_id] = frozenset((*route_peers, self.me))
            self._asked.track(session_id)
        return inbox

    def close_inbox(self, session_id: SessionId) -> None:
        self._inbox_peers.pop(session_id, None)
        self._asked.forget(session_id)
        inbox = self._inboxes.pop(session_id, None)
        if inbox is not None:
            inbox.close()
