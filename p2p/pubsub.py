"""GossipSub for the registry: configured on purpose, with the library's silent drops removed.

py-libp2p 0.8.1's defaults would lose registry records without a word: a 120 s heartbeat,
a 10 msg/s spam limit per forwarder and topic, and two 32-slot queues that drop when full.
:class:`GossipConfig` sets each from the swarm it serves (the arithmetic is beside each
field); :class:`SwarmPubsub` replaces the queues. Only ``p2p.host`` uses this module.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

import libp2p.pubsub.gossipsub
import libp2p.pubsub.pubsub
import trio
from libp2p.abc import IHost, INetStream
from libp2p.host.basic_host import BasicHost
from libp2p.peer.id import ID
from libp2p.pubsub.gossipsub import (
    PROTOCOL_ID,
    PROTOCOL_ID_V11,
    PROTOCOL_ID_V12,
    PROTOCOL_ID_V13,
    PROTOCOL_ID_V14,
    PROTOCOL_ID_V20,
    GossipSub,
)
from libp2p.pubsub.pb import rpc_pb2
from libp2p.pubsub.pubsub import Pubsub

from inclavate.errors import ConfigError
from inclavate.types import PeerId
from p2p.stream_quota import InboundStreams

logger = logging.getLogger(__name__)

PUBSUB_STREAMS = 4
"""Inbound pubsub streams of one peer at once: an honest one opens one per connection, and a
reconnect's new stream may arrive before the old one's end is seen."""

# The GossipSub defaults are sized for this swarm: a 100-peer swarm beats every 2 s
# (p2p.registry.Cadence keeps larger swarms near 20 records/s), 1-8 KB each.
_SWARM_PEERS = 100
_RECORD_PERIOD_S = 2.0
_MARGIN = 4


@dataclass(frozen=True)
class GossipConfig:
    """GossipSub parameters, chosen for the swarm above rather than left to the library."""

    heartbeat_interval: float = 1.0
    """Mesh maintenance and IHAVE gossip cadence. The library's 120 s default would leave
    a new peer outside the mesh (and missing messages) for two minutes."""
    degree: int = 3
    degree_low: int = 2
    degree_high: int = 4
    """Mesh degree (library default 6, 4..12). Every message reaches a peer about once per
    mesh neighbour, and on this stack each copy costs a Noise frame, a yamux window update
    and a protobuf parse in Python: the mesh degree multiplies what every record costs every
    peer. Links are symmetric, so a peer grafting ``degree`` others ends up with up to
    ``degree_high``; 3..4 still leaves each record several paths (a 1,000-peer mesh is ~6
    hops deep), and IHAVE/IWANT gossip and anti-entropy mend what a broken path loses."""
    max_messages_per_topic_per_second: float = _SWARM_PEERS / _RECORD_PERIOD_S * _MARGIN
    """Spam limit, per forwarding peer and topic, applied to *forwarding*: above it the
    library drops messages without a word. One mesh neighbour can relay every record in
    the swarm to us, so it must pass peers / record period = 100 / 2 s = 50 msg/s;
    x4 margin for bursts (peers restarting together, gossip catch-up) gives 200."""
    subscription_queue_size: int = 2048
    """Messages buffered per subscriber before they are dropped (and counted, and logged).
    2048 at 50 msg/s is 40 s of a stalled consumer. Replaces the library's 32."""
    outbound_queue_size: int = 512
    """RPCs queued per neighbour before the library drops them. The gossip stream shares
    the TCP connection with bulk hidden-state transfers, so its writer can stall: 512 at
    50 msg/s rides out ~10 s. Replaces the library's 32."""
    seen_ttl: int = 120
    """Seconds a message id is remembered to suppress duplicates; must far exceed how long
    a message circulates (gossip history is 5 heartbeats = 5 s)."""
    max_message_size: int = 256 * 1024
    """Largest payload :meth:`P2PHost.publish` accepts (the wire limit per RPC is 1 MiB)."""

    def __post_init__(self) -> None:
        if not 0 < self.degree_low <= self.degree <= self.degree_high:
            raise ConfigError("gossip degrees must satisfy 0 < low <= degree <= high")
        if self.heartbeat_interval <= 0 or self.max_messages_per_topic_per_second <= 0:
            raise ConfigError("gossip heartbeat and spam limit must be positive")
        if min(self.subscription_queue_size, self.outbound_queue_size, self.seen_ttl) < 1:
            raise ConfigError("gossip queue sizes and seen_ttl must be positive")


class GossipMessage(NamedTuple):
    """A delivered pubsub message: its signed originator (not the forwarder) and body."""

    from_peer: PeerId
    data: bytes


class Broadcast:
    """Fan-out of events to any number of trio channels that never blocks the producer.

    libp2p calls our hooks inline on its connection path; a blocking send there would
    stall the swarm, so a full channel drops the event and says so in the log.
    """

    def __init__(self, what: str) -> None:
        self._what = what
        self._channels: list[trio.MemorySendChannel[Any]] = []
        self.dropped = 0

    def open(self, size: int) -> trio.MemoryReceiveChannel[Any]:
        send, receive = trio.open_memory_channel[Any](size)
        self._channels.append(send)
        return receive

    def send(self, item: object) -> None:
        for channel in list(self._channels):
            try:
                channel.send_nowait(item)
            except trio.WouldBlock:
                self.dropped += 1
                logger.warning("%s consumer is full; dropped one (%d so far)", self._what,
                               self.dropped)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self._channels.remove(channel)  # the consumer closed its end: detach

    def close(self) -> None:
        for channel in self._channels:
            channel.close()
        self._channels.clear()


_READ_AHEAD = 64 * 1024
"""Most bytes a pubsub stream's reader takes from yamux at once (and holds unread)."""


class ReadAhead:
    """A pubsub stream whose reads are served from one read-ahead buffer.

    py-libp2p reads each RPC's length prefix one byte at a time, and every ``read`` of a
    yamux stream takes the stream's lock, a checkpoint and a window update: ~60 of an
    idle chain peer's ~180 trio task steps a second, a share of every hop's time on a
    shared core (docs/ARCHITECTURE.md, "Open in issue 10"). Here one ``read`` takes what
    yamux holds (up to ``_READ_AHEAD`` bytes, so what a sender can park here is bounded),
    and the prefix's bytes and the message after it come from that. Everything else is the
    stream's own."""

    def __init__(self, stream: INetStream) -> None:
        self._stream = stream
        self._ahead = bytearray()

    async def read(self, n: int | None = None) -> bytes:
        if not self._ahead:
            if n is not None and n >= _READ_AHEAD:
                return await self._stream.read(n)
            self._ahead += await self._stream.read(_READ_AHEAD)
        if n is None or n < 0 or n >= len(self._ahead):
            data = bytes(self._ahead)
            self._ahead.clear()
            return data
        data = bytes(self._ahead[:n])
        del self._ahead[:n]
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


_HELD_KEPT = 4096
"""(neighbour, message id) pairs remembered by :class:`Held`: ~2 s of a 1,000-peer swarm's
records from 4 mesh neighbours; an evicted pair only costs one copy sent as before."""


class Held:
    """Which neighbour sent us which message: a forward to a peer that sent us the message
    itself is a copy it drops unread.

    In a full mesh each message reached every peer twice: from its author (which sends its
    own to every neighbour) and forwarded by the third peer, whose forward crossed the
    other's on the wire. A copy received from a neighbour now stops the copy still queued
    for it (docs/ARCHITECTURE.md, "The crossing forward" in Gossip). Only the connection a
    copy came on names who holds it, so a neighbour can only ever stop forwards to itself,
    whatever it sends (a forged copy included: it then misses that message, as if it had
    dropped it). Bounded: the oldest pair goes first (then that copy is sent, as before)."""

    def __init__(self, kept: int = _HELD_KEPT) -> None:
        self._kept = kept
        self._pairs: dict[tuple[ID, bytes], None] = {}

    def __len__(self) -> int:
        return len(self._pairs)

    def add(self, peer: ID, msg_id: bytes) -> None:
        pairs = self._pairs
        if len(pairs) >= self._kept:
            del pairs[next(iter(pairs))]
        pairs[(peer, msg_id)] = None

    def has(self, peer: ID, msg_id: bytes) -> bool:
        return (peer, msg_id) in self._pairs


class SwarmPubsub(Pubsub):
    """libp2p Pubsub with its two silent 32-slot drops replaced by sized queues.

    * Delivery: the library pushes each message into a 32-slot channel per topic with
      ``send_nowait`` and drops it when full; a burst of forwarded messages processed in
      one scheduler batch overflows it before any consumer runs. We override the hook
      that feeds it (``notify_subscriptions``) to deliver straight into our own channels.
    * Outbound: each neighbour gets an ``RpcQueue`` of 32 RPCs, dropped when full (logged
      at debug level only). The library offers no parameter, so the queue's capacity is
      raised right after it is created (:meth:`_handle_new_peer`); a test pins this.
    """

    def __init__(self, host: BasicHost, router: SwarmGossipSub, config: GossipConfig,
                 topics: dict[str, Broadcast], inbound: InboundStreams) -> None:
        super().__init__(host, router, seen_ttl=config.seen_ttl)
        self._config = config
        self.held = router.held
        """The router's table (it decides the forwards); filled here, where copies arrive."""
        self._topics = topics
        # The library registered our reader for each of its protocol versions; a peer's
        # streams of all versions count together against one cap.
        for protocol in router.get_protocols():
            host.set_stream_handler(protocol, inbound.guard_protocol("pubsub", self.stream_handler, PUBSUB_STREAMS))

    def notify_subscriptions(self, publish_message: rpc_pb2.Message) -> None:
        message = GossipMessage(_peer_id(ID(publish_message.from_id)), publish_message.data)
        for topic in publish_message.topicIDs:
            if topic in self._topics:
                self._topics[topic].send(message)

    async def push_msg(self, msg_forwarder: ID, msg: rpc_pb2.Message) -> None:
        """Remember that the neighbour who sent this message holds it (see :class:`Held`),
        then take it as the library does (a copy already seen is dropped there, before its
        signature is checked)."""
        if msg_forwarder != self.my_id:
            self.held.add(msg_forwarder, self._msg_id_constructor(msg))
        await super().push_msg(msg_forwarder, msg)

    async def write_msg(self, stream: INetStream, rpc_msg: rpc_pb2.RPC) -> bool:
        """Send an RPC, unless it only carries messages its receiver sent us since it was
        queued (a forward queued before the receiver's own copy of it reached us)."""
        if self._held_by(stream.muxed_conn.peer_id, rpc_msg):
            return True
        return await super().write_msg(stream, rpc_msg)

    def _held_by(self, peer: ID, rpc: rpc_pb2.RPC) -> bool:
        if not rpc.publish or rpc.subscriptions or rpc.HasField("control"):
            return False
        held, msg_id = self.held, self._msg_id_constructor
        return all(held.has(peer, msg_id(message)) for message in rpc.publish)

    async def stream_handler(self, stream: INetStream) -> None:
        """The library's reader, with every failure confined to the sender's stream.

        py-libp2p catches only its own stream and parse errors here; protobuf's
        ``DecodeError`` (any bytes that are not an RPC) and whatever else one message can
        provoke escaped into the swarm's nursery and ended the peer: one stranger's
        malformed RPC killed its victim. Now it costs that stranger its stream."""
        try:
            await super().stream_handler(cast(INetStream, ReadAhead(stream)))
        except Exception as exc:  # a foreign library's zoo of errors, all from one sender
            peer_id = stream.muxed_conn.peer_id
            logger.debug("dropping the pubsub stream of %s: %r", peer_id, exc)
            with contextlib.suppress(Exception):
                await stream.reset()
            self._handle_dead_peer(peer_id)

    async def _handle_new_peer(self, peer_id: ID) -> None:
        await super()._handle_new_peer(peer_id)
        queue = self.peer_queues.get(peer_id)
        inner = getattr(queue, "_queue", None)
        if inner is not None and hasattr(inner, "max_size"):
            inner.max_size = max(inner.max_size, self._config.outbound_queue_size)
        elif queue is not None:
            logger.warning("libp2p RpcQueue changed shape; outbound queue left at default")


_DEFER_MIN_S = 0.1
"""A deferred forward waits at least this long (then until a gossipsub heartbeat) for its
receiver's own copy: one process's read, check and write of a record, on a loaded core."""
_DEFERRED_KEPT = 1024
"""Forwards waiting at once; beyond, a forward goes at once, as before."""


class SwarmGossipSub(GossipSub):
    """GossipSub without IDONTWANT, and with the crossing forward of a full mesh deferred.

    py-libp2p 0.8.1 (gossipsub >= 1.2) sends an IDONTWANT to every mesh neighbour for every
    message it receives, whatever its size; go-libp2p sends it only above 1 KiB, where it
    saves a large duplicate. Registry records are 1-8 KB and CPU, not bandwidth, is what an
    idle swarm spends: the notice cost as much as the duplicate it might spare (one extra
    RPC per message and neighbour, each a Noise frame and a loopback send).

    A message received from its author itself is forwarded at once only to neighbours with
    a higher PeerID; to one with a lower PeerID it goes at the first gossipsub heartbeat at
    least ``_DEFER_MIN_S`` later (within ~1.1 s), and only if that neighbour has not sent
    it to us meanwhile (:class:`Held`). Two neighbours of the author both forwarded its
    message to each other, each copy crossing the other; now the lower one's copy goes at
    once and stops the higher one's: 3 RPCs a message in a full 3-mesh, not 4. Nobody's
    word decides a skip, only a copy received on that neighbour's own connection; a
    neighbour that does not hear the author gets the message up to ~1.1 s later, only on
    the first hop after the author."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deferred: list[tuple[float, ID, bytes]] = []
        self.held = Held()

    async def _emit_idontwant_for_message(self, msg_id: bytes, topic_ids: Iterable[str]) -> None:
        return None

    def _defer_crossing(self, peers: set[ID], msg_id: bytes) -> set[ID]:
        """The forwards of an author's message to lower neighbours, kept for later."""
        pubsub = self.pubsub
        if pubsub is None or len(self._deferred) + len(peers) > _DEFERRED_KEPT:
            return peers
        me = pubsub.my_id.to_bytes()
        later = {peer for peer in peers if peer.to_bytes() < me}
        if later:
            now = time.monotonic()
            self._deferred.extend((now, peer, msg_id) for peer in later)
        return peers - later

    def fanout_heartbeat(self) -> None:
        """The library's fanout upkeep, then the deferred forwards that are due (on the
        heartbeat's own wake-up: no timer of ours)."""
        super().fanout_heartbeat()
        self.send_deferred(time.monotonic() - _DEFER_MIN_S)

    def send_deferred(self, queued_by: float) -> None:
        """Send each forward deferred before ``queued_by`` whose receiver has not sent us
        the message meanwhile."""
        pubsub = self.pubsub
        due = [entry for entry in self._deferred if entry[0] <= queued_by]
        if not due or pubsub is None:
            return
        self._deferred = [entry for entry in self._deferred if entry[0] > queued_by]
        for _, peer, msg_id in due:
            message = self.mcache.get(msg_id)
            if message is None or peer not in pubsub.peers or self.held.has(peer, msg_id):
                continue
            rpc = rpc_pb2.RPC(publish=[message])
            rpc.senderRecord = libp2p.pubsub.gossipsub.env_to_send_in_RPC(pubsub.host)[0]
            self.send_rpc(peer, rpc)

    def _get_peers_to_send(self, topic_ids: Iterable[str], msg_forwarder: ID, origin: ID,
                           msg_id: bytes | None = None) -> Iterable[ID]:  # fmt: skip
        """Our own messages go to every neighbour subscribed to the topic, not only to the
        mesh (go-libp2p's ``floodPublish``, its default; py-libp2p 0.8.1 has none).

        A peer's heartbeats are how the swarm knows it is alive. Sent to the mesh alone they
        reached nobody while the mesh was empty: after kills and restarts, GRAFT backoffs
        kept live peers out of each other's meshes for minutes (an outside audit,
        2026-12-06), their records went stale, entries dropped them from routes and healers
        moved healthy peers. A neighbour now hears each of our messages from us, whatever
        the mesh; what others publish still travels the mesh. Costs one more copy per
        neighbour outside our mesh, a few in a swarm's worth of records."""
        peers = set(super()._get_peers_to_send(topic_ids, msg_forwarder, origin, msg_id))
        pubsub = self.pubsub
        if pubsub is None or not origin == msg_forwarder == pubsub.my_id:
            if msg_id is None:
                return peers
            peers = {peer for peer in peers if not self.held.has(peer, msg_id)}  # it sent it to us
            return self._defer_crossing(peers, msg_id) if msg_forwarder == origin else peers
        for topic in topic_ids:
            peers.update(p for p in pubsub.peer_topics.get(topic, ()) if p in self.peer_protocol)
        peers.discard(origin)
        return peers


# Every pubsub RPC carries the sender's signed peer record ("senderRecord"), and py-libp2p
# rebuilds it (re-reading every listen address as text) for every RPC sent, then parses and
# verifies it (protobuf + Ed25519 + a peerstore update), twice, for every RPC received. The
# record only changes with the addresses, so both ends do that work once per record here.
_SENDER_RECORD_TTL_S = 10.0
"""How long a built sender record is reused (a changed listen address shows up after it)."""
_CONSUMED_TTL_S = 300.0
"""How long an already consumed sender record is not consumed again (the peerstore keeps
it for 7200 s)."""
_CONSUMED_KEPT = 1024
_built: dict[bytes, tuple[float, tuple[bytes, bool]]] = {}
"""By the host's PeerID (a process may run several hosts, in tests)."""
_consumed: dict[tuple[bytes, bytes], float] = {}


def _cached_sender_record(build: Callable[[IHost], tuple[bytes, bool]]) -> Callable[[IHost], tuple[bytes, bool]]:
    def sender_record(host: IHost) -> tuple[bytes, bool]:
        now = time.monotonic()
        key = host.get_id().to_bytes()
        held = _built.get(key)
        if held is None or held[0] < now:
            held = (now + _SENDER_RECORD_TTL_S, build(host))
            _built[key] = held
        return held[1]

    return sender_record


def _consume_once(consume: Callable[..., bool]) -> Callable[..., bool]:
    def consume_sender_record(msg: rpc_pb2.RPC, host: IHost, peer_id: ID | None = None) -> bool:
        if peer_id is None or not msg.HasField("senderRecord"):
            return consume(msg, host, peer_id)
        key, now = (peer_id.to_bytes(), msg.senderRecord), time.monotonic()
        if _consumed.get(key, 0.0) > now:
            return True  # the same bytes from the same peer, already verified and stored
        ok = consume(msg, host, peer_id)
        if ok:
            while len(_consumed) >= _CONSUMED_KEPT:
                del _consumed[next(iter(_consumed))]
            _consumed[key] = now + _CONSUMED_TTL_S
        return ok

    return consume_sender_record


def _share_sender_records() -> None:
    """Install the two caches above where the pubsub modules look the functions up (once)."""
    for module in (libp2p.pubsub.pubsub, libp2p.pubsub.gossipsub):
        if not getattr(module, "_inclavate_cached", False):
            module.env_to_send_in_RPC = _cached_sender_record(module.env_to_send_in_RPC)  # type: ignore[attr-defined]
            module.maybe_consume_signed_record = _consume_once(module.maybe_consume_signed_record)  # type: ignore[attr-defined]
            module._inclavate_cached = True  # type: ignore[attr-defined]


def build_gossip(host: BasicHost, config: GossipConfig, topics: dict[str, Broadcast],
                 inbound: InboundStreams) -> tuple[SwarmPubsub, GossipSub]:
    _share_sender_records()
    router = SwarmGossipSub(
        protocols=[PROTOCOL_ID_V20, PROTOCOL_ID_V14, PROTOCOL_ID_V13, PROTOCOL_ID_V12,
                   PROTOCOL_ID_V11, PROTOCOL_ID],
        degree=config.degree,
        degree_low=config.degree_low,
        degree_high=config.degree_high,
        heartbeat_interval=config.heartbeat_interval,  # type: ignore[arg-type]  # int in stubs
        adaptive_gossip_enabled=False,
        max_messages_per_topic_per_second=config.max_messages_per_topic_per_second,
    )
    return SwarmPubsub(host, router, config, topics, inbound), router


def _peer_id(peer: ID) -> PeerId:
    return PeerId(peer.to_base58())
