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

import logging
from collections.abc import Callable
from dataclasses import dataclass

import trio

from inclavate import tensors
from inclavate.types import NodeId, PeerId, SessionId
from node.engine import BatchItem
from node.errors import ContextFull, InvalidBatch, SessionLimitReached
from node.stage import Job, Stage, StageResult
from p2p import wire
from p2p.errors import P2PError, StreamError
from p2p.framing import FramedStream
from p2p.host import P2PHost

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Timeouts:
    connect: float = 5.0
    """Opening a stream to the next hop."""
    send_base: float = 10.0
    """Any frame gets at least this long to be written..."""
    send_bytes_per_s: float = 1_000_000.0
    """...plus its size at this (pessimistic, home-uplink) rate."""
    idle: float = 3600.0
    """An inbound stream with no frame for this long is reset; the sender reopens one."""

    def send(self, nbytes: int) -> float:
        return self.send_base + nbytes / self.send_bytes_per_s


def error_code_for(exc: BaseException) -> wire.ErrorCode:
    if isinstance(exc, SessionLimitReached):
        return "session_limit"
    if isinstance(exc, ContextFull):
        return "context_full"
    if isinstance(exc, InvalidBatch):
        return "invalid_batch"
    if isinstance(exc, StreamError):
        return "unreachable"
    return "engine_error"


class _Link:
    """The outbound stream to one peer and the task that writes it, in order."""

    def __init__(self, service: ForwardService, peer: PeerId) -> None:
        self.peer = peer
        self._service = service
        self.send_channel, self._receive = trio.open_memory_channel[wire.Message](64)

    async def run(self) -> None:
        stream: FramedStream | None = None
        async with self._receive:
            async for msg in self._receive:
                payload = wire.encode(msg)
                for attempt in (1, 2):
                    fresh = stream is None
                    try:
                        if stream is None:
                            stream = await self._service.host.new_stream(
                                self.peer, wire.PROTOCOL, timeout=self._service.timeouts.connect
                            )
                        await stream.send(payload, timeout=self._service.timeouts.send(len(payload)))
                        break
                    except P2PError as exc:
                        if stream is not None:
                            await stream.reset()
                            stream = None
                        # A stream idle long enough may have been dropped by the other side;
                        # one retry on a fresh stream tells that apart from a dead peer.
                        if fresh or attempt == 2:
                            await self._service.undeliverable(msg, self.peer, exc, self)
                            break
        if stream is not None:
            await stream.close()


class ForwardService:
    def __init__(
        self,
        host: P2PHost,
        *,
        node_id: NodeId,
        stage: Stage | None,
        wire_dtype: tensors.WireDType = "f16",
        timeouts: Timeouts = Timeouts(),
    ) -> None:
        self.host = host
        self.me = host.peer_id
        self.node_id = node_id
        self.stage = stage
        self.wire_dtype = wire_dtype
        self.timeouts = timeouts
        self._links: dict[PeerId, _Link] = {}
        self._inboxes: dict[SessionId, trio.MemorySendChannel[wire.Message]] = {}
        self._nursery: trio.Nursery | None = None
        self.relay: Callable[[wire.Forward | wire.Close], object] | None = None
        """Handles hops that are relayed legacy nodes (set by the legacy-node service)."""
        self.leaving = False
        """Set when the peer leaves: frames for its stage are answered ``shutting_down``."""

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self.host.set_stream_handler(wire.PROTOCOL, self._serve_stream)
            task_status.started()
            await trio.sleep_forever()

    # ---------------------------------------------------------------- outbound

    async def send(self, peer: PeerId, msg: wire.Message) -> None:
        """Queue ``msg`` for ``peer`` (or handle it here if the peer is us)."""
        if peer == self.me:
            await self._dispatch(msg, self.me)
            return
        while True:
            link = self._links.get(peer)
            if link is None:
                assert self._nursery is not None, "ForwardService.run has not started"
                link = self._links[peer] = _Link(self, peer)
                self._nursery.start_soon(link.run)
            try:
                await link.send_channel.send(msg)
                return
            except trio.ClosedResourceError:
                continue  # the link failed while we waited for room in it: use a fresh one

    async def undeliverable(self, msg: wire.Message, peer: PeerId, exc: BaseException, link: _Link | None = None) -> None:
        log.warning("cannot deliver %s for session %s to %s: %s", msg.TYPE, msg.session_id, peer, exc)
        if link is not None and self._links.get(peer) is link:
            # The peer is gone or unreachable: retire its link. Its task answers what is still
            # queued (each with an error to the entry) and ends, instead of waiting forever.
            del self._links[peer]
            link.send_channel.close()
        if isinstance(msg, (wire.Forward, wire.Close)) and msg.reply_to != peer:
            await self.send(msg.reply_to, wire.Error(
                msg.req_id, msg.session_id, "unreachable", f"peer {peer} is unreachable: {exc}", self.me, peer))  # fmt: skip

    # ----------------------------------------------------------------- inbound

    async def _serve_stream(self, stream: FramedStream, remote: PeerId) -> None:
        while True:
            payload = await stream.receive(timeout=self.timeouts.idle)
            try:
                msg = wire.decode(payload)
            except P2PError as exc:
                log.warning("dropping a malformed frame from %s: %s", remote, exc)
                continue
            await self._dispatch(msg, remote)

    async def _dispatch(self, msg: wire.Message, remote: PeerId) -> None:
        if isinstance(msg, wire.Forward):
            await self._on_forward(msg)
        elif isinstance(msg, wire.Close):
            await self._on_close(msg)
        else:
            inbox = self._inboxes.get(msg.session_id)
            if inbox is not None:
                try:
                    inbox.send_nowait(msg)
                except (trio.WouldBlock, trio.ClosedResourceError):
                    log.warning("entry inbox of session %s is not being read", msg.session_id)

    async def _on_forward(self, msg: wire.Forward) -> None:
        hop = msg.route[0]
        if self.stage is None or hop.node_id != self.node_id or hop.layers != self.stage.engine.info.layers:
            if hop.forward_url and self.relay is not None:
                await self.relay(msg)  # type: ignore[func-returns-value]
                return
            if self.leaving and hop.node_id == self.node_id:
                await self._fail(msg, "shutting_down", f"{self.me} has left the swarm")
                return
            await self._fail(msg, "wrong_route", f"{self.me} does not serve {hop.node_id} layers {hop.layers}")
            return
        if msg.tokens is not None:
            item = BatchItem(msg.session_id, msg.start_pos, tokens=msg.tokens)
        else:
            assert msg.hidden is not None
            item = BatchItem(msg.session_id, msg.start_pos, hidden=tensors.decode(msg.hidden))

        async def deliver(result: StageResult) -> None:
            await self._after_stage(msg, result)

        await self.stage.submit(Job(item, msg.session_id, deliver, msg.sampling))

    async def _after_stage(self, msg: wire.Forward, result: StageResult) -> None:
        if result.error is not None:
            await self._fail(msg, error_code_for(result.error), str(result.error))
            return
        assert result.output is not None
        if len(msg.route) > 1:
            hidden = result.output.hidden
            assert hidden is not None
            nxt = wire.Forward(
                msg.req_id, msg.session_id, msg.start_pos, msg.route[1:], msg.reply_to, msg.sampling,
                hidden=tensors.encode(hidden, self.wire_dtype),
            )  # fmt: skip
            await self.send(nxt.route[0].peer_id, nxt)
        elif msg.sampling is not None:
            await self.send(msg.reply_to, wire.Result(msg.req_id, msg.session_id, result.token))

    async def _on_close(self, msg: wire.Close) -> None:
        hop = msg.route[0]
        if self.stage is None or hop.node_id != self.node_id:
            if hop.forward_url and self.relay is not None:
                await self.relay(msg)  # type: ignore[func-returns-value]
                return
            await self._pass_close(msg)
            return

        async def deliver(_: StageResult) -> None:
            await self._pass_close(msg)

        await self.stage.submit(Job(None, msg.session_id, deliver))

    async def _pass_close(self, msg: wire.Close) -> None:
        if len(msg.route) > 1:
            nxt = wire.Close(msg.req_id, msg.session_id, msg.route[1:], msg.reply_to)
            await self.send(nxt.route[0].peer_id, nxt)
        else:
            await self.send(msg.reply_to, wire.Closed(msg.req_id, msg.session_id))

    async def _fail(self, msg: wire.Forward, code: wire.ErrorCode, message: str) -> None:
        log.info("session %s failed at %s: %s", msg.session_id, self.me, message)
        await self.send(msg.reply_to, wire.Error(msg.req_id, msg.session_id, code, message, self.me))

    # -------------------------------------------------------------- entry side

    def open_inbox(self, session_id: SessionId) -> trio.MemoryReceiveChannel[wire.Message]:
        """Results, errors and close acknowledgements for a session this peer drives."""
        send, receive = trio.open_memory_channel[wire.Message](256)
        self._inboxes[session_id] = send
        return receive

    def close_inbox(self, session_id: SessionId) -> None:
        inbox = self._inboxes.pop(session_id, None)
        if inbox is not None:
            inbox.close()
