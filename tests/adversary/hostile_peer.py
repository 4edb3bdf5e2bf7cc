"""A stranger's libp2p peer, built on the project's own stack, for adversarial tests.

It speaks every Inclavate protocol but says whatever a test scripts: arbitrary replies on
``/inclavate/registry-sync/2`` and ``/inclavate/peers/1``, signed or unsigned gossip
envelopes on the registry topic, admin commands, and raw frames on any protocol (the forward
protocol included). Nothing here validates anything: that is the point.

    async with hostile_peer(target_multiaddr, sync_reply=b'{"records":1}') as evil:
        await evil.publish_record(record)            # signed with evil.identity
        answer = await evil.request(victim, "/inclavate/admin/1", raw_bytes)

The target sees an ordinary peer: Noise, yamux, gossipsub, its own PeerID.
"""

from __future__ import annotations

import base64
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import trio

from inclavate.types import ModelId, NodeId, PeerId
from p2p.admin import PROTOCOL as ADMIN_PROTOCOL
from p2p.admin import AdminCommand, encode_command
from p2p.discovery import PEERS_PROTOCOL
from p2p.framing import FramedStream
from p2p.gossip import SYNC_PROTOCOL, TOPIC
from p2p.host import P2PHost, open_host
from p2p.identity import Identity
from p2p.records import NodeRecord, SignedRecord, canonical_bytes, now_ms

Reply = bytes | Callable[[bytes, PeerId], Awaitable[bytes | None]]
"""What a scripted protocol answers: fixed bytes, or a function of the request (None: say
nothing and hold the stream until the asker gives up)."""

_BIG_FRAME = 64 * 1024 * 1024


@dataclass
class HostilePeer:
    host: P2PHost
    identity: Identity
    target: PeerId
    asked: dict[str, list[bytes]] = field(default_factory=dict)
    """Every request a scripted protocol received, by protocol (oldest first)."""

    @property
    def peer_id(self) -> PeerId:
        return self.identity.peer_id

    # -- scripted answers ----------------------------------------------------------

    def serve(self, protocol: str, reply: Reply) -> None:
        """Answer every inbound ``protocol`` stream: read one frame, send ``reply``."""

        async def handler(stream: FramedStream, remote: PeerId) -> None:
            request = await stream.receive(timeout=10.0)
            self.asked.setdefault(protocol, []).append(request)
            answer = reply if isinstance(reply, bytes) else await reply(request, remote)
            if answer is None:
                await trio.sleep(30)
                return
            await stream.send(answer, timeout=10.0)

        self.host.set_stream_handler(protocol, handler, max_frame_size=_BIG_FRAME)

    # -- gossip ----------------------------------------------------------------------

    async def wait_gossip_mesh(self, timeout: float = 15.0) -> None:
        """Until the target is in our gossipsub mesh for the registry topic: before that a
        publish reaches nobody (knowing it subscribes is not enough; the mesh is built at
        the next heartbeat). Peeks at the router: a test harness may."""
        router = self.host._pubsub.router  # noqa: SLF001
        with trio.fail_after(timeout):
            while self.target not in {p.to_base58() for p in router.mesh.get(TOPIC, ())}:
                await trio.sleep(0.05)

    async def publish_raw(self, data: bytes) -> None:
        """Any bytes on the registry topic, signed by libp2p (as every message is) but not
        necessarily a valid record envelope."""
        await self.host.publish(TOPIC, data)

    async def publish_record(self, record: NodeRecord, *, signer: Identity | None = None) -> None:
        """``record`` in a registry envelope signed by ``signer`` (default: us) whatever the
        record claims about its publisher: the receiver must notice a mismatch."""
        key = signer or self.identity
        payload = canonical_bytes(record)
        await self.publish_raw(SignedRecord(record, payload, key.sign(payload)).encode())

    async def publish_json(self, record_json: dict[str, Any], *, signer: Identity | None = None) -> None:
        """A record given as raw JSON (any field of any type), validly signed."""
        key = signer or self.identity
        payload = json.dumps(record_json, sort_keys=True, separators=(",", ":")).encode()
        await self.publish_raw(envelope(payload, key))

    # -- requests --------------------------------------------------------------------

    async def request(self, peer: PeerId, protocol: str, data: bytes, *, timeout: float = 10.0,
                      max_frame_size: int = _BIG_FRAME) -> bytes:
        """Send one frame on a new stream to ``peer`` and return its one-frame answer."""
        stream = await self.host.new_stream(peer, protocol, timeout=timeout, max_frame_size=max_frame_size)
        async with stream:
            await stream.send(data, timeout=timeout)
            return await stream.receive(timeout=timeout)

    async def send_admin(self, peer: PeerId, command: AdminCommand | bytes, *, signer: Identity | None = None) -> dict[str, Any]:
        """An admin command (signed by ``signer``, default us) or raw bytes on
        ``/inclavate/admin/1``; returns the peer's JSON answer."""
        data = command if isinstance(command, bytes) else encode_command(command, signer or self.identity)
        return json.loads(await self.request(peer, ADMIN_PROTOCOL, data))

    async def send_raw_pubsub(self, peer: PeerId, rpc: bytes) -> None:
        """Bytes that claim to be a gossipsub RPC (varint-prefixed, as the library frames
        them) on a fresh ``/meshsub/1.1.0`` stream: below our own API, like a stranger's
        own libp2p implementation would send them."""
        from libp2p.custom_types import TProtocol
        from libp2p.peer.id import ID
        from libp2p.utils.varint import encode_varint_prefixed

        stream = await self.host.libp2p_host.new_stream(ID.from_base58(peer), [TProtocol("/meshsub/1.1.0")])
        try:
            await stream.write(encode_varint_prefixed(rpc))
            await trio.sleep(0.5)
        finally:
            with contextlib.suppress(Exception):
                await stream.reset()

    async def open_stream(self, peer: PeerId, protocol: str, *, max_frame_size: int = _BIG_FRAME) -> FramedStream:
        """A raw framed stream (e.g. ``/inclavate/forward/1``); the caller closes it."""
        return await self.host.new_stream(peer, protocol, timeout=10.0, max_frame_size=max_frame_size)


def envelope(payload: bytes, signer: Identity) -> bytes:
    """A registry envelope around arbitrary (signed) bytes."""
    return json.dumps({"v": 1, "record": payload.decode(), "sig": base64.b64encode(signer.sign(payload)).decode()}).encode()


def honest_record(identity: Identity, *, node_id: str | None = None, start: int = 0, end: int = 1,
                  n_layers: int = 30, model: str = "smollm2:135m", **fields: Any) -> NodeRecord:
    """A well-formed, currently dated record (fields may be overridden to lie); by default
    a SmolLM2-shaped one, as a live swarm in the tests serves."""
    ts = now_ms()
    base: dict[str, Any] = dict(
        node_id=NodeId(node_id or identity.peer_id), peer_id=identity.peer_id, model_id=ModelId(model),
        start_layer=start, end_layer=end, n_layers=n_layers, d_model=576, state="Ready", seq=ts, ts_ms=ts,
    )  # fmt: skip
    base.update(fields)
    return NodeRecord(**base)


@asynccontextmanager
async def hostile_peer(
    target: str,
    *,
    identity: Identity | None = None,
    sync_reply: Reply | None = None,
    peers_reply: Reply | None = None,
    gossip: bool = True,
) -> AsyncIterator[HostilePeer]:
    """Connect a hostile peer to the live peer at multiaddr ``target``.

    ``sync_reply`` / ``peers_reply`` script what the target gets when it asks us for our
    registry (it does on every new connection) or our peers; unscripted, we answer like an
    empty honest peer. With ``gossip`` we join the registry topic and wait until the
    target's mesh includes us."""
    me = identity or Identity.generate()
    async with open_host(me, listen_host="127.0.0.1") as host:
        evil = HostilePeer(host, me, PeerId(target.rsplit("/p2p/", 1)[-1]))
        evil.serve(SYNC_PROTOCOL, sync_reply if sync_reply is not None else b'{"records":[]}')
        evil.serve(PEERS_PROTOCOL, peers_reply if peers_reply is not None else b'{"peers":[]}')
        await host.connect(target)
        if gossip:
            await host.subscribe(TOPIC)
            await evil.wait_gossip_mesh()
        yield evil
