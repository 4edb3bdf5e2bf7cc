"""Driving the forward protocol as a stranger: connect a hostile libp2p peer to a live peer,
write frames, and collect whatever the swarm sends back."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import numpy as np
import trio
from hostile_peer import HostilePeer, hostile_peer
from swarm import PeerProcess, Swarm

from inclavate import tensors
from inclavate.types import LayerRange, NodeId, PeerId, SessionId
from node.sampling import SamplingParams
from p2p import wire
from p2p.framing import FramedStream
from p2p.routing import Hop


def peer_id(peer: PeerProcess) -> PeerId:
    return PeerId(peer.get("/health")["peer_id"])


def hop(peer: PeerProcess, layers: str) -> Hop:
    pid = peer_id(peer)
    return Hop(NodeId(pid), pid, LayerRange.parse(layers))


Attack = Callable[[HostilePeer, FramedStream, list[wire.Message]], Awaitable[None]]


def attack(peer: PeerProcess, swarm: Swarm, run: Attack, *, settle: float = 1.0, gossip: bool = False) -> list[wire.Message]:
    """Connect a stranger to ``peer``, let ``run`` write frames on a forward stream, and
    return what the swarm sent back to the stranger (errors, results) within ``settle`` s.
    ``gossip``: the stranger joins the registry's topic first (``run`` may publish)."""
    replies: list[wire.Message] = []

    async def main() -> None:
        async with hostile_peer(swarm.multiaddr(peer), gossip=gossip) as evil:
            async def collect(stream: FramedStream, remote: PeerId) -> None:
                while True:
                    replies.append(wire.decode(await stream.receive(timeout=60)))

            evil.host.set_stream_handler(wire.PROTOCOL, collect)
            stream = await evil.open_stream(evil.target, wire.PROTOCOL)
            await run(evil, stream, replies)
            await trio.sleep(settle)
            await stream.reset()

    trio.run(main)
    return replies


def forward(evil: HostilePeer, route: tuple[Hop, ...], *, session: str = "s1", hidden: np.ndarray | None = None,
            tokens: list[int] | None = None, sampling: SamplingParams | None = None, start_pos: int = 0,
            half: bool = False) -> bytes:  # fmt: skip
    """``half``: the hidden states as float16 bits, whatever they hold (an honest sender's
    encode would widen an infinity to float32): the receiving hop's native decode reads them."""
    encoded = None
    if hidden is not None:
        encoded = tensors.EncodedTensor("f16", hidden.shape, hidden.astype(np.float16).tobytes()) if half else tensors.encode(hidden, "f32")
    arr = np.asarray(tokens, dtype=np.int32) if tokens is not None else None
    return wire.encode(wire.Forward(1, SessionId(session), start_pos, route, evil.peer_id, sampling, tokens=arr, hidden=encoded))


