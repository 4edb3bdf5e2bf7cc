"""The direct data plane: the sealed record codec, the ticket handshake over libp2p, and the
forward service using a direct link (or libp2p when the other side offers none)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing
from direct_helpers import ECHO, direct_pair

from inclavate import tensors
from inclavate.types import LayerRange, NodeId, PeerId, SessionId
from p2p import wire
from p2p.direct import Grant
from p2p.errors import DialError, FrameTooLarge, ProtocolError, StreamClosed, StreamError
from p2p.forward import ForwardService
from p2p.framing import FramedStream
from p2p.host import open_host
from p2p.identity import Identity
from p2p.routing import Hop
from p2p.sealed import SealedStream, Sealer


def test_sealed_frames_open_in_order_and_only_in_order() -> None:
    key = os.urandom(32)
    out, back = Sealer(key, dialer_to_acceptor=True), Sealer(key, dialer_to_acceptor=True)
    first, second = out.seal(b"one"), out.seal(b"two")
    assert back.open(first) == b"one" and back.open(second) == b"two"
    replayed = Sealer(key, dialer_to_acceptor=True)
    replayed.open(first)
    with pytest.raises(ProtocolError):
        replayed.open(first)  # the same frame twice
    with pytest.raises(ProtocolError):
        Sealer(key, dialer_to_acceptor=True).open(second)  # out of order


def test_forged_reflected_or_foreign_frames_fail_authentication() -> None:
    key = os.urandom(32)
    sealed = Sealer(key, dialer_to_acceptor=True).seal(b"hidden states")
    tampered = bytearray(sealed)
    tampered[3] ^= 1
    for bad, opener in ((bytes(tampered), Sealer(key, dialer_to_acceptor=True)),
                        (sealed, Sealer(key, dialer_to_acceptor=False)),  # reflected back at its sender
                        (sealed, Sealer(os.urandom(32), dialer_to_acceptor=True)),
                        (sealed[:10], Sealer(key, dialer_to_acceptor=True))):  # fmt: skip
        with pytest.raises(ProtocolError):
            opener.open(bad)
    with pytest.raises(ValueError):
        Sealer(b"short", dialer_to_acceptor=True)


def test_the_record_layer_is_ietf_chacha20_poly1305_with_counted_nonces() -> None:
    """The wire format, pinned: peers built on another ChaCha20-Poly1305 library (libsodium
    here) open our frames and we open theirs, nonce = direction (4 bytes) + frame number (u64 LE)."""
    from nacl.bindings import crypto_aead_chacha20poly1305_ietf_decrypt, crypto_aead_chacha20poly1305_ietf_encrypt

    key = os.urandom(32)
    ours = Sealer(key, dialer_to_acceptor=True)
    ours.seal(b"frame 0")
    nonce_1 = b"\x01\0\0\0" + (1).to_bytes(8, "little")
    assert crypto_aead_chacha20poly1305_ietf_decrypt(ours.seal(b"frame 1"), None, nonce_1, key) == b"frame 1"
    back = Sealer(key, dialer_to_acceptor=False)
    theirs = crypto_aead_chacha20poly1305_ietf_encrypt(b"reply 0", None, b"\x02\0\0\0" + bytes(8), key)
    assert back.open(theirs) == b"reply 0"


def test_grants_round_trip_and_refusals_are_dial_errors() -> None:
    grant = Grant(4242, os.urandom(16), os.urandom(32))
    assert Grant.decode(grant.encode()) == grant
    for refusal in (b"\0no direct handler", b"", b"\1" + b"x" * 10, Grant(0, bytes(16), bytes(32)).encode()):
        with pytest.raises(DialError):
            Grant.decode(refusal)


def _sealed_pair() -> tuple[SealedStream, SealedStream]:
    left, right = trio.testing.memory_stream_pair()
    key = os.urandom(32)
    return (SealedStream(FramedStream.over_trio(left), key, dialer=True, remote_peer=PeerId("b")),
            SealedStream(FramedStream.over_trio(right), key, dialer=False, remote_peer=PeerId("a")))


async def test_sealed_streams_carry_payloads_both_ways() -> None:
    a, b = _sealed_pair()
    with trio.fail_after(10):
        for size in (0, 1, 1500, 3 * 1024 * 1024):
            payload = os.urandom(size)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(a.send, payload, 10.0)
                assert await b.receive(10.0) == payload
        await b.send(b"reply", 10.0)
        assert await a.receive(10.0) == b"reply"


async def test_an_oversized_payload_is_refused_without_spending_a_nonce() -> None:
    a, b = _sealed_pair()
    a.max_frame_size = 100
    with pytest.raises(FrameTooLarge):
        await a.send(b"x" * 101, 10.0)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(a.send, b"fits", 10.0)
            assert await b.receive(10.0) == b"fits"  # the stream is still in step


async def test_a_send_cancelled_after_sealing_fails_the_stream_at_once() -> None:
    """A burst is sealed under the sealed stream's lock, then waits for the framed stream's
    own lock (held here as a close holds it while it writes). Cancelled there, it had spent
    nonces on frames never written: the stream went on, and its next frame reached the peer
    under a nonce the peer did not expect, failed authentication there and reset the link
    from the far side. The stream now fails where the nonces were lost."""
    a, b = _sealed_pair()
    with trio.fail_after(10):
        async with a._inner._send_lock:
            with trio.move_on_after(0.1):
                await a.send(b"never written", 10.0)
        with pytest.raises(StreamError):
            await a.send(b"next", 10.0)
        with pytest.raises(StreamError):
            await b.receive(1.0)


async def test_a_sealed_write_in_place_that_fails_says_so() -> None:
    """A frame written in place to a peer that is gone is reported unsent (False), so the
    caller's usual send raises the failure at once instead of waiting for an answer that
    cannot come."""
    s1, s2 = trio.socket.socketpair()
    key = os.urandom(32)
    a = SealedStream(FramedStream.over_socket(trio.SocketStream(s1)), key, dialer=True, remote_peer=PeerId("b"))
    b = SealedStream(FramedStream.over_socket(trio.SocketStream(s2)), key, dialer=False, remote_peer=PeerId("a"))
    with trio.fail_after(5):
        assert a.send_nowait(b"x" * 1200)
        assert await b.receive(1.0) == b"x" * 1200
        s1.close()  # the socket fails under the writer: the very next write in place
        assert not a.send_nowait(b"x" * 1200)
        with pytest.raises(StreamError):
            await a.send(b"y", 1.0)
        await a.reset()
        await b.reset()


async def test_an_unsealed_frame_resets_the_stream() -> None:
    left, right = trio.testing.memory_stream_pair()
    plain = FramedStream.over_trio(left)
    sealed = SealedStream(FramedStream.over_trio(right), os.urandom(32), dialer=False, remote_peer=PeerId("a"))
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(plain.send, b"x" * 64, 10.0)
            with pytest.raises(ProtocolError):
                await sealed.receive(10.0)
        assert sealed.is_broken
        with pytest.raises(StreamClosed):
            await plain.receive(10.0)  # the other end was told


async def test_a_direct_link_is_bound_to_the_noise_authenticated_dialer() -> None:
    with trio.fail_after(30):
        async with direct_pair() as (a, b, links_a, _):
            stream = await links_a.open(b.peer_id, ECHO, timeout=5)
            async with stream:
                assert stream.remote_peer == b.peer_id
                for size in (1, 1500, 2 * 1024 * 1024):
                    payload = os.urandom(size)
                    await stream.send(payload, timeout=10)
                    assert await stream.receive(timeout=10) == a.peer_id.encode() + b":" + payload


async def test_no_handler_fails_fast_and_is_remembered() -> None:
    with trio.fail_after(30):
        async with direct_pair() as (a, b, links_a, _):
            with pytest.raises(DialError, match="no direct handler"):
                await links_a.open(b.peer_id, "/test/unknown/1", timeout=5)
            with pytest.raises(DialError, match="failed recently"):
                await links_a.open(b.peer_id, "/test/unknown/1", timeout=5)
            # Remembered for that protocol only: an older peer lacking one protocol's handler
            # (artifacts) still gets direct links for the others (forward).
            echo = await links_a.open(b.peer_id, ECHO, timeout=5)
            await echo.close()
            stranger = PeerId(Identity.generate().peer_id)
            with pytest.raises(DialError, match="not connected"):
                await links_a.open(stranger, ECHO, timeout=5)


class _Recording(ForwardService):
    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.got: list[tuple[wire.Message, PeerId]] = []
        self.arrived = trio.Event()

    async def _dispatch(self, msg: wire.Message, remote: PeerId) -> None:
        self.got.append((msg, remote))
        self.arrived.set()


@asynccontextmanager
async def two_services(receiver: type[ForwardService], **receiver_args: Any) -> AsyncIterator[tuple[ForwardService, Any]]:
    """A sender's forward service and a ``receiver``'s, on two connected hosts."""
    async with open_host(Identity.generate()) as a, open_host(Identity.generate()) as b, trio.open_nursery() as n:
        services = (ForwardService(a, node_id=NodeId(a.peer_id), stage=None),
                    receiver(b, node_id=NodeId(b.peer_id), stage=None, **receiver_args))  # fmt: skip
        for service in services:
            await n.start(service.run)
        await a.connect(b.multiaddrs()[0])
        yield services
        n.cancel_scope.cancel()


@pytest.mark.parametrize("receiver_direct", [True, False])
async def test_forward_frames_take_the_direct_link_or_fall_back_to_libp2p(receiver_direct: bool) -> None:
    with trio.fail_after(30):
        async with two_services(_Recording, direct_port=0 if receiver_direct else None) as (sender, receiver):
            await sender.send(receiver.me, wire.Result(3, SessionId("s"), 42))
            await receiver.arrived.wait()
            assert receiver.got == [(wire.Result(3, SessionId("s"), 42), sender.me)]
            link_stream = sender._links[receiver.me]._stream
            assert isinstance(link_stream, SealedStream) is receiver_direct


async def test_a_forward_for_a_stage_not_loaded_is_answered_wrong_route() -> None:
    """The entry hears why at once (a missing attribute used to turn this into a logged
    exception and a silent wait)."""
    with trio.fail_after(30):
        async with two_services(ForwardService) as (entry, idle):
            inbox = entry.open_inbox(SessionId("s"), [idle.me])
            hop = Hop(NodeId(idle.me), idle.me, LayerRange(0, 30))
            await entry.ask(idle.me, wire.Forward(1, SessionId("s"), 0, (hop,), entry.me, None, tokens=np.array([1, 2], np.int32)))
            error = await inbox.receive()
            assert isinstance(error, wire.Error) and error.code == "wrong_route" and error.origin == idle.me


async def test_a_frame_for_an_idle_direct_link_is_written_in_place() -> None:
    """Once the link is open and idle, a decode step leaves in the sender's own turn: no
    queue, no wait for the link's task (a hop's cost in a chain)."""
    with trio.fail_after(30):
        async with two_services(_Recording) as (sender, receiver):
            await sender.send(receiver.me, wire.Result(1, SessionId("s"), 1))  # opens the link
            await receiver.arrived.wait()
            await trio.testing.wait_all_tasks_blocked()
            with trio.testing.assert_no_checkpoints():
                await sender.send(receiver.me, wire.Result(2, SessionId("s"), 2))
            while len(receiver.got) < 2:
                await trio.sleep(0.01)
            assert [msg for msg, _ in receiver.got] == [wire.Result(i, SessionId("s"), i) for i in (1, 2)]


async def test_frames_written_in_place_never_overtake_queued_ones() -> None:
    """Frames too large to write in place are queued; a small one sent right after must wait
    its turn behind them, even while they are handed to the link's task and not yet written
    (the queue then looks empty). A prefill's chunks and steps stay in order."""
    hop = Hop(NodeId("next"), PeerId("next"), LayerRange(10, 20))

    def big(req: int) -> wire.Forward:
        hidden = tensors.encode(np.full((64, 576), req, np.float32), "f32")  # 144 KiB: queued
        return wire.Forward(req, SessionId("s"), req, (hop,), PeerId("entry"), None, hidden=hidden)

    with trio.fail_after(30):
        async with two_services(_Recording) as (sender, receiver):
            await sender.send(receiver.me, wire.Result(0, SessionId("s"), 0))
            await receiver.arrived.wait()
            await trio.testing.wait_all_tasks_blocked()
            order = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
            for req in order:
                await sender.send(receiver.me, big(req) if req % 3 == 1 else wire.Result(req, SessionId("s"), req))
            while len(receiver.got) < 1 + len(order):
                await trio.sleep(0.01)
            assert [msg.req_id for msg, _ in receiver.got] == [0, *order]


async def test_a_retired_link_writes_nothing_in_place() -> None:
    """Once its peer is judged gone, a frame for it must take the path that opens a fresh
    link (or reports the peer unreachable), not vanish into the old socket."""
    with trio.fail_after(30):
        async with two_services(_Recording) as (sender, receiver):
            await sender.send(receiver.me, wire.Result(1, SessionId("s"), 1))
            await receiver.arrived.wait()
            await trio.testing.wait_all_tasks_blocked()
            link = sender._links[receiver.me]
            assert link.write_now(wire.Result(2, SessionId("s"), 2))
            sender._retire(receiver.me, link)
            assert not link.write_now(wire.Result(3, SessionId("s"), 3))
            await sender.send(receiver.me, wire.Result(4, SessionId("s"), 4))  # on a fresh link
            while len(receiver.got) < 3:
                await trio.sleep(0.01)
            assert [msg.req_id for msg, _ in receiver.got] == [1, 2, 4]
