"""The forward protocol over real libp2p hosts on loopback: large tensors arrive intact, and
a stage that stops reading produces a clear error at the sender, not a hang."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import numpy as np
import pytest
import trio
import trio.testing

from inclavate import tensors
from inclavate.types import LayerRange, NodeId, PeerId, SessionId
from p2p import wire
from p2p.errors import P2PError
from p2p.forward import ForwardService, Timeouts
from p2p.host import open_host
from p2p.identity import Identity
from p2p.routing import Hop


class Recording(ForwardService):
    """A forward service that records what reaches it instead of running a stage."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.received: trio.MemorySendChannel[wire.Forward]
        self.received, self.inbox = trio.open_memory_channel(16)

    async def _on_forward(self, msg: wire.Forward, remote: PeerId) -> None:
        await self.received.send(msg)


def _forward(to: PeerId, reply_to: PeerId, nbytes: int) -> wire.Forward:
    rows = nbytes // (512 * 2)
    x = np.random.default_rng(nbytes).normal(size=(rows, 512)).astype(np.float32)
    hop = Hop(NodeId(to), to, LayerRange(10, 20))
    return wire.Forward(1, SessionId("s"), 0, (hop,), reply_to, None, hidden=tensors.encode(x, "f16"))


@pytest.mark.parametrize("nbytes", [64 * 1024, 4 * 1024 * 1024, 32 * 1024 * 1024])
async def test_tensors_cross_intact(nbytes: int) -> None:
    with trio.fail_after(60):
        async with open_host(Identity.generate()) as a, open_host(Identity.generate()) as b, trio.open_nursery() as n:
            sender = ForwardService(a, node_id=NodeId(a.peer_id), stage=None)
            receiver = Recording(b, node_id=NodeId(b.peer_id), stage=None)
            await n.start(sender.run)
            await n.start(receiver.run)
            await a.connect(b.multiaddrs()[0])
            msg = _forward(b.peer_id, a.peer_id, nbytes)
            await sender.send(b.peer_id, msg)
            got = await receiver.inbox.receive()
            assert got.hidden is not None and got.hidden.nbytes == nbytes
            assert got.hidden.data == msg.hidden.data and got.hidden.shape == msg.hidden.shape
            n.cancel_scope.cancel()


@asynccontextmanager
async def _sending_to_a_peer_that_never_reads(send_base: float) -> AsyncIterator[tuple[ForwardService, PeerId]]:
    """A forward service (no stage) connected to a peer whose forward streams are never
    read; yields it and that peer's id. The service's session ``s`` has an inbox."""
    async with open_host(Identity.generate()) as a, open_host(Identity.generate()) as b, trio.open_nursery() as n:
        timeouts = Timeouts(send_base=send_base, send_bytes_per_s=1e12)
        sender = ForwardService(a, node_id=NodeId(a.peer_id), stage=None, timeouts=timeouts)
        await n.start(sender.run)

        async def never_reads(stream, remote) -> None:
            await trio.sleep_forever()

        b.set_stream_handler(wire.PROTOCOL, never_reads)
        await a.connect(b.multiaddrs()[0])
        yield sender, b.peer_id
        n.cancel_scope.cancel()


async def test_a_stage_that_stops_reading_fails_the_sender_within_its_deadline() -> None:
    with trio.fail_after(30):
        async with _sending_to_a_peer_that_never_reads(send_base=1.0) as (sender, b):
            inbox = sender.open_inbox(SessionId("s"))
            started = time.monotonic()
            await sender.send(b, _forward(b, sender.me, 32 * 1024 * 1024))
            error = await inbox.receive()
            assert isinstance(error, wire.Error) and error.code == "unreachable"
            assert "deadline" in error.message
            assert time.monotonic() - started < 5.0


async def test_a_full_link_fails_a_stage_s_message_at_once_instead_of_holding_the_stage() -> None:
    """A peer that stops reading: its link's task is stuck writing, and the link's queue
    fills. What a stage's job sends on (``wait_for_room=False``) must not wait for room:
    waiting held the stage's worker, and every other session at that stage, until the
    link's send deadline. The message is undeliverable at once and the entry hears why."""
    with trio.fail_after(30):
        async with _sending_to_a_peer_that_never_reads(send_base=20.0) as (sender, b):  # the stuck write outlasts the test
            inbox = sender.open_inbox(SessionId("s"))
            await sender.send(b, _forward(b, sender.me, 32 * 1024 * 1024))  # its link's task is stuck on this
            await trio.testing.wait_all_tasks_blocked()
            for i in range(64):  # the queue's room
                await sender.send(b, wire.Result(i, SessionId("other"), 1))
            with trio.fail_after(2):
                await sender.send(b, _forward(b, sender.me, 64 * 1024), wait_for_room=False)
            error = await inbox.receive()
            assert isinstance(error, wire.Error) and error.code == "unreachable" and error.failed_peer == b
            assert "wait for the link" in error.message


async def test_a_replay_to_a_peer_that_never_reads_gives_up_at_one_deadline() -> None:
    """A replay's frames wait for room on the link, in the stage's worker. Frame by frame,
    a next hop that never reads held the worker a link deadline per queueful of frames (a
    replay may name 4,096); the whole replay now has the deadline of its bytes, and the
    entry hears that the hop after this one failed."""
    class Kept:
        def shapes(self, session: SessionId, positions: int) -> list[int]:
            return [33] * (positions // 33)  # prefill chunks: each replayed in its own frame

        def rows(self, session: SessionId, start: int, n: int) -> tensors.EncodedTensor:
            return tensors.encode(np.zeros((16, 1024), np.float32), "f32")  # 64 KiB a frame

    class Keeping:
        kept = Kept()

    with trio.fail_after(20):
        async with _sending_to_a_peer_that_never_reads(send_base=2.0) as (sender, b):
            sender._stage = Keeping()  # type: ignore[assignment]
            inbox = sender.open_inbox(SessionId("s"))
            route = (Hop(NodeId(sender.me), sender.me, LayerRange(0, 10)), Hop(NodeId(b), b, LayerRange(10, 20)))
            frames = tuple((i * 33, 33) for i in range(1500))  # ~94 MiB: far more than the link and the socket hold
            replay = wire.Replay(at=10, until=20, frames=frames)
            step = wire.Forward(9, SessionId("s"), replay.positions, route, sender.me, None,
                                hidden=tensors.encode(np.zeros((1, 8), np.float32)), replay=replay)  # fmt: skip
            assert not await sender._send_replay(step, replay)
            error = await inbox.receive()
            assert isinstance(error, wire.Error) and error.code == "unreachable" and "replay" in error.message


async def test_a_close_a_hop_missed_while_unreachable_reaches_it_when_it_is_back() -> None:
    """A hop that stalled (a stopped process) missed the close of a leg that failed over:
    it held the session until its idle timeout, ten minutes. Our own closes are sent again
    for a while, and it frees the session when it answers again."""
    back = Identity.generate()
    received: list[wire.Message] = []
    with trio.fail_after(30):
        async with open_host(Identity.generate()) as a, trio.open_nursery() as n:
            sender = ForwardService(a, node_id=NodeId(a.peer_id), stage=None, direct_port=None,
                                    timeouts=Timeouts(connect=1.0, close_retry=(0.5, 0.5, 0.5, 0.5)))  # fmt: skip
            await n.start(sender.run)
            hop = Hop(NodeId(back.peer_id), back.peer_id, LayerRange(10, 20))
            close = wire.Close(7, SessionId("old-leg"), (hop,), sender.me)
            await sender.send(back.peer_id, close)  # nobody there yet: undeliverable
            await trio.sleep(0.2)
            async with open_host(back) as b:

                async def keep(stream, remote) -> None:
                    while True:
                        received.append(wire.decode(await stream.receive(timeout=60)))

                b.set_stream_handler(wire.PROTOCOL, keep)
                await a.connect(b.multiaddrs()[0])
                while not received:
                    await trio.sleep(0.05)
            assert received == [close]
            n.cancel_scope.cancel()


def test_messages_round_trip_through_the_codec() -> None:
    hop = Hop(NodeId("n"), PeerId("p"), LayerRange(0, 5), "")
    from node.sampling import SamplingParams

    forward = wire.Forward(7, SessionId("s"), 3, (hop,), PeerId("e"), SamplingParams(0.5, 0.9, 42), tokens=np.array([1, 2], np.int32))
    back = wire.decode(wire.encode(forward))
    assert isinstance(back, wire.Forward) and back.sampling == forward.sampling and back.route == forward.route
    assert back.tokens.tolist() == [1, 2] and back.start_pos == 3
    for msg in (wire.Result(1, SessionId("s"), 5), wire.Closed(2, SessionId("s")),
                wire.Error(3, SessionId("s"), "context_full", "full", PeerId("p")),
                wire.Error(5, SessionId("s"), "unreachable", "gone", PeerId("p"), PeerId("q")),
                wire.Close(4, SessionId("s"), (hop,), PeerId("e"))):  # fmt: skip
        assert wire.decode(wire.encode(msg)) == msg


def test_malformed_frames_are_protocol_errors() -> None:
    from p2p.errors import ProtocolError

    for bad in (b"", b"\0\0\0\5{}", b"\0\0\0\2{}", b'\0\0\0\x10{"type":"nope"}  '):
        with pytest.raises(ProtocolError):
            wire.decode(bad)
    header = b'{"type":"forward","req":1,"session":"s","start_pos":0,"route":[["p","n",0,1,""]],"reply_to":"e","sampling":null,"input":{"kind":"hidden","dtype":"f16","shape":[2,4]}}'
    with pytest.raises(ProtocolError):  # 2x4 f16 needs 16 bytes, 3 given
        wire.decode(len(header).to_bytes(4, "big") + header + b"abc")


async def test_latency_monitor_measures_round_trips() -> None:
    from p2p.latency import UNREACHABLE_MS, LatencyMonitor

    with trio.fail_after(30):
        async with open_host(Identity.generate()) as a, open_host(Identity.generate()) as b, trio.open_nursery() as n:
            monitor_b = LatencyMonitor(b, lambda: [])
            await n.start(monitor_b.run)  # serves the echo
            monitor = LatencyMonitor(a, lambda: [b.peer_id])
            await a.connect(b.multiaddrs()[0])
            rtts = [await monitor.measure(b.peer_id) for _ in range(3)]
            assert all(0 < r < 100 for r in rtts)
            assert 0 < monitor.link_ms()[b.peer_id] < 50
            assert await monitor.measure(PeerId(Identity.generate().peer_id)) == UNREACHABLE_MS
            n.cancel_scope.cancel()


async def test_a_link_to_a_peer_that_is_gone_is_retired_and_its_task_ends() -> None:
    """After a peer dies, the entry is told which peer it was, and nothing of the link to it
    stays behind (no task waiting forever on a queue nobody writes)."""
    with trio.fail_after(30):
        async with open_host(Identity.generate()) as a, trio.open_nursery() as n:
            sender = ForwardService(a, node_id=NodeId(a.peer_id), stage=None, timeouts=Timeouts(connect=2.0))
            await n.start(sender.run)
            async with open_host(Identity.generate()) as b:
                await a.connect(b.multiaddrs()[0])
                gone = b.peer_id
            tasks = len(sender._nursery.child_tasks)
            inbox = sender.open_inbox(SessionId("s"))
            await sender.send(gone, _forward(gone, a.peer_id, 4096))
            error = await inbox.receive()
            assert isinstance(error, wire.Error) and error.code == "unreachable" and error.failed_peer == gone
            with trio.fail_after(5):
                while len(sender._nursery.child_tasks) > tasks:
                    await trio.sleep(0.05)
            assert gone not in sender._links
            n.cancel_scope.cancel()


class _Recorded:
    """A stream to a peer that wakes late: records what is written on it, in order."""

    def __init__(self, n: int, written: list[tuple[int, str]]) -> None:
        self.n, self.written, self.has_unsent, self.max_receive_size = n, written, False, 0

    def send_nowait(self, payload: bytes) -> bool:
        self.written.append((self.n, wire.decode(payload).TYPE))
        return True

    async def send_many(self, payloads, timeout) -> None:  # type: ignore[no-untyped-def]
        for payload in payloads:
            self.send_nowait(payload)

    async def receive(self, timeout: float) -> bytes:
        await trio.sleep_forever()
        raise AssertionError

    async def reset(self) -> None: ...

    async def close(self) -> None: ...


class _FrozenThenWoken(ForwardService):
    """Opening a stream to the peer fails once (it is frozen), then waits until it wakes."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.opens, self.woke, self.written = 0, trio.Event(), []

    async def open_stream(self, peer):  # type: ignore[no-untyped-def]
        self.opens += 1
        n = self.opens
        if n == 1:
            await trio.sleep(0.3)
            raise P2PError("opening /inclavate/forward/2 timed out")
        await self.woke.wait()
        if n == 2:
            await trio.sleep(0.05)
        return _Recorded(n, self.written)


async def test_a_frame_queued_behind_a_failed_write_never_follows_a_later_close() -> None:
    """A link whose stream would not open was retired, and its task opened another stream for
    the session frame queued behind: the entry's close of that session, sent after its
    failover on the link that replaced it, reached the peer first, and the late frame opened
    the session there and at the hops after it until their idle timeout (an audit from
    outside, 2026-12-08: KV slots held after a chaos run). The frame is undeliverable now."""
    with trio.fail_after(20):
        async with open_host(Identity.generate()) as a, trio.open_nursery() as n:
            sender = _FrozenThenWoken(a, node_id=NodeId(a.peer_id), stage=None, direct_port=None,
                                      timeouts=Timeouts(close_retry=()))  # fmt: skip
            await n.start(sender.run)
            frozen = PeerId(Identity.generate().peer_id)
            route = (Hop(NodeId(frozen), frozen, LayerRange(10, 20)),)
            inbox = sender.open_inbox(SessionId("X"))
            await sender.send(frozen, wire.Close(1, SessionId("older"), route, a.peer_id))  # opens the link
            await trio.sleep(0.05)
            await sender.send(frozen, _forward(frozen, a.peer_id, 4096))  # queued behind, session "s"
            await trio.sleep(0.5)  # the open failed: the link is retired
            await sender.send(frozen, wire.Close(3, SessionId("s"), route, a.peer_id))  # the close, on a new link
            await trio.sleep(0.1)
            sender.woke.set()
            await trio.sleep(0.5)
            assert [kind for _, kind in sender.written] == ["close"], sender.written
            n.cancel_scope.cancel()


async def test_the_end_of_a_link_tells_the_sessions_through_that_peer_at_once() -> None:
    """A peer that dies (here: its service and host stop) closes the other end of our link:
    every session this peer drives through it is told at once with an ``unreachable`` error
    naming it, without anything more being sent, and the link is retired."""
    with trio.fail_after(30):
        async with open_host(Identity.generate()) as a, trio.open_nursery() as n:
            sender = ForwardService(a, node_id=NodeId(a.peer_id), stage=None)
            await n.start(sender.run)
            async with open_host(Identity.generate()) as b, trio.open_nursery() as nb:
                receiver = ForwardService(b, node_id=NodeId(b.peer_id), stage=None)
                await nb.start(receiver.run)
                await a.connect(b.multiaddrs()[0])
                gone = b.peer_id
                through, elsewhere = SessionId("s"), SessionId("t")
                inbox = sender.open_inbox(through, [gone])
                other = sender.open_inbox(elsewhere, [PeerId(Identity.generate().peer_id)])
                await sender.send(gone, wire.Closed(1, SessionId("x")))
                while gone not in sender._links or sender._links[gone]._stream is None:
                    await trio.sleep(0.01)
                nb.cancel_scope.cancel()
            error = await inbox.receive()
            assert isinstance(error, wire.Error) and error.code == "unreachable" and error.failed_peer == gone
            assert gone not in sender._links
            with pytest.raises(trio.WouldBlock):
                other.receive_nowait()
            n.cancel_scope.cancel()


async def test_only_peers_on_a_session_route_may_answer_for_it() -> None:
    """A stranger who learnt a session id cannot hand the entry tokens (or a false error or
    ``closed``): replies are taken from the peers of the session's route only."""
    with trio.fail_after(30):
        async with (open_host(Identity.generate()) as entry, open_host(Identity.generate()) as hop,
                    open_host(Identity.generate()) as stranger, trio.open_nursery() as n):  # fmt: skip
            services = [ForwardService(h, node_id=NodeId(h.peer_id), stage=None) for h in (entry, hop, stranger)]
            for service in services:
                await n.start(service.run)
            await hop.connect(entry.multiaddrs()[0])
            await stranger.connect(entry.multiaddrs()[0])
            session = SessionId("s")
            inbox = services[0].open_inbox(session, [hop.peer_id])
            # A close the hop (holding no stage) drops: it answers below, as a last hop would.
            await services[0].ask(hop.peer_id, wire.Close(7, session, (Hop(NodeId(hop.peer_id), hop.peer_id, LayerRange(0, 30)),),
                                                          entry.peer_id))  # fmt: skip
            await services[2].send(entry.peer_id, wire.Result(7, session, 999))
            await services[2].send(entry.peer_id, wire.Closed(7, session))
            await services[1].send(entry.peer_id, wire.Closed(7, session))
            got = await inbox.receive()
            assert isinstance(got, wire.Closed) and got.req_id == 7
            with trio.move_on_after(0.3):
                extra = await inbox.receive()
                raise AssertionError(f"a second reply arrived: {extra}")
            n.cancel_scope.cancel()


async def test_a_link_gathers_a_burst_and_ends_cleanly_when_retired() -> None:
    """Frames queued behind each other leave together; a link retired (its queue closed)
    while it gathers ends its burst instead of raising (it once took the peer down)."""
    from p2p.forward import _Link

    link = _Link(None, PeerId("next"))  # type: ignore[arg-type]
    messages = [wire.Result(i, SessionId("s"), i) for i in range(3)]
    for msg in messages[1:]:
        link.send_channel.send_nowait(msg)
    link.send_channel.close()
    assert await link._burst(messages[0]) == messages


async def test_a_lone_frame_leaves_its_link_without_a_scheduler_turn() -> None:
    """One session decoding: nothing else is coming, so its frame must not wait a turn of
    the other tasks' work before it is written (every hop of every token pays that turn)."""
    from p2p.forward import _Link

    link = _Link(None, PeerId("next"))  # type: ignore[arg-type]
    msg = wire.Result(1, SessionId("s"), 1)
    with trio.testing.assert_no_checkpoints():
        assert await link._burst(msg) == [msg]


async def test_an_inbound_stream_idle_past_the_timeout_is_reset_and_a_busy_one_is_not() -> None:
    """The receiver resets a stream that brought no frame for ``Timeouts.idle`` (the sender
    sees its link end and opens a fresh one for its next frame); frames keep it open."""
    with trio.fail_after(30):
        async with open_host(Identity.generate()) as a, open_host(Identity.generate()) as b, trio.open_nursery() as n:
            sender = ForwardService(a, node_id=NodeId(a.peer_id), stage=None)
            receiver = ForwardService(b, node_id=NodeId(b.peer_id), stage=None, timeouts=Timeouts(idle=0.6))
            await n.start(sender.run)
            await n.start(receiver.run)
            await a.connect(b.multiaddrs()[0])
            await sender.send(b.peer_id, wire.Closed(1, SessionId("x")))
            while b.peer_id not in sender._links or sender._links[b.peer_id]._stream is None:
                await trio.sleep(0.01)
            link = sender._links[b.peer_id]
            for _ in range(8):  # 1.6 s of a frame every 0.2 s: never idle for 0.6 s
                await trio.sleep(0.2)
                await sender.send(b.peer_id, wire.Closed(1, SessionId("x")))
                assert sender._links.get(b.peer_id) is link
            started = time.monotonic()
            while sender._links.get(b.peer_id) is link:
                await trio.sleep(0.01)
            assert 0.5 < time.monotonic() - started < 2.0
            assert not receiver._waiting  # nothing of the reset stream stays behind
            await sender.send(b.peer_id, wire.Closed(2, SessionId("x")))  # a fresh link carries the next frame
            while b.peer_id not in sender._links or sender._links[b.peer_id]._stream is None:
                await trio.sleep(0.01)
            n.cancel_scope.cancel()


async def test_a_frame_trickled_a_byte_at_a_time_does_not_hold_its_stream_past_the_idle_timeout() -> None:
    """A hostile sender that starts a frame and then sends one byte now and then never
    completes a frame: its stream is reset after the idle timeout like a silent one."""
    with trio.fail_after(30):
        async with open_host(Identity.generate()) as evil, open_host(Identity.generate()) as b, trio.open_nursery() as n:
            receiver = ForwardService(b, node_id=NodeId(b.peer_id), stage=None, timeouts=Timeouts(idle=0.6),
                                      direct_port=None)  # fmt: skip
            await n.start(receiver.run)
            await evil.connect(b.multiaddrs()[0])
            stream = await evil.new_stream(b.peer_id, wire.PROTOCOL, timeout=5)
            raw = stream._raw  # under the framing: an honest FramedStream only writes whole frames
            await raw.write(b"\x00\x00\x01\x00")  # a 256-byte frame is coming...
            while not receiver._waiting:
                await trio.sleep(0.01)
            started = time.monotonic()
            with pytest.raises((P2PError, trio.BrokenResourceError, trio.ClosedResourceError)):
                for _ in range(100):  # ...one byte every 0.1 s: 25 s to finish it
                    await raw.write(b"x")
                    await trio.sleep(0.1)
                    if not receiver._waiting:
                        await stream.receive(timeout=5)  # the reset reaches us as an error
            assert time.monotonic() - started < 3.0
            assert not receiver._waiting
            n.cancel_scope.cancel()


async def test_a_frame_sent_back_on_a_link_is_refused_on_its_length_prefix() -> None:
    """A link carries frames one way; its back channel only tells the sender the peer is
    gone. A hostile next hop announced a frame of up to 256 MiB there, and the sender took it
    in as it came, for as long as the link lived. Now any frame there is refused on its
    prefix: the link is retired at once and the sessions through that peer hear why."""
    with trio.fail_after(30):
        async with open_host(Identity.generate()) as a, open_host(Identity.generate()) as b, trio.open_nursery() as n:
            sender = ForwardService(a, node_id=NodeId(a.peer_id), stage=None, direct_port=None)
            await n.start(sender.run)

            async def talks_back(stream, remote) -> None:
                await stream.receive(timeout=10)
                await stream._raw.write((200 * 1024 * 1024).to_bytes(4, "big") + b"x" * 1024)
                await trio.sleep_forever()

            b.set_stream_handler(wire.PROTOCOL, talks_back)
            await a.connect(b.multiaddrs()[0])
            inbox = sender.open_inbox(SessionId("s"), [b.peer_id])
            await sender.send(b.peer_id, _forward(b.peer_id, sender.me, 1024))
            error = await inbox.receive()
            assert isinstance(error, wire.Error) and error.code == "unreachable" and "closed its link" in error.message
            n.cancel_scope.cancel()
