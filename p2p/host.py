"""The libp2p host of one peer, behind the small API the rest of Inclavate uses.

Nothing outside ``p2p/`` touches libp2p: :func:`open_host` builds the host, runs it and
its pubsub and gossipsub services in the caller's trio context, and yields a
:class:`P2PHost` that speaks PeerId strings, multiaddr strings,
:class:`~p2p.framing.FramedStream` and our error tree. Leaving the ``async with``
stops all of it (well under a second on loopback).

Choices made on purpose (py-libp2p 0.8.1, measured; see NOTES.md):

* **Security: Noise only.** The library's default also offers SECIO and *plaintext*;
  a host that offers plaintext can be downgraded by anyone in the middle.
* **Muxer: yamux only.** mplex silently drops data after a 5 s idle reader.
* **No 250 ms connect delay.** ``Swarm.dial_peer`` starts a dial per address class and
  then waits 250 ms (happy eyeballs) unless a dial *fails*, so every successful connect
  paid the full 250 ms. :meth:`P2PHost.connect` dials the one address it was given with
  the public ``Swarm.dial_addr`` instead. For the dials the library makes on its own
  (through ``dial_peer``), ``max_connections_per_peer=1`` ends that wait at the first
  success: the wait sits in a scope that is cancelled once the per-peer limit is reached.
  One connection per peer is what we want anyway; yamux carries every stream on it.
* **No hidden retries.** ``RetryConfig(max_retries=0)`` and the swarm's 60 s "recently
  failed" cache cleared before each explicit dial: retry policy (capped backoff with
  jitter) lives in :mod:`p2p.discovery`, in one place.
* **GossipSub sized for the swarm** (:class:`GossipConfig`): heartbeat 1 s (library
  default 120 s), spam limit raised, adaptive gossip off (it can stretch the heartbeat to
  30-60 s), and the two 32-slot queues that silently drop messages enlarged (see
  :class:`SwarmPubsub`). Both live in :mod:`p2p.pubsub`.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import multiaddr
import trio
import libp2p.transport.tcp.tcp as libp2p_tcp
from libp2p import new_swarm
from libp2p.abc import INetConn, INetStream, INetwork, INotifee
from libp2p.crypto.x25519 import create_new_key_pair as create_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.exceptions import BaseLibp2pError
from libp2p.host.basic_host import BasicHost
from libp2p.network.auto_connector import AutoConnector
from libp2p.network.config import ConnectionConfig, RetryConfig
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr
from libp2p.peer.peerstore import PeerStoreError
from libp2p.protocol_muxer.exceptions import MultiselectClientError, ProtocolNotSupportedError
from libp2p.pubsub.pb import rpc_pb2
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import Yamux
from libp2p.tools.anyio_service import background_trio_service
from libp2p.utils.address_validation import expand_wildcard_address

from inclavate.types import PeerId
from p2p.connection_guard import HANDSHAKE_S, ConnectionGuard
from p2p.outbound_guard import OutboundGuard
from p2p.errors import DialError, ListenError, P2PError, PublishRejected
from p2p.framing import DEFAULT_MAX_FRAME_SIZE, FramedStream
from inclavate.ports import port_in_use
from p2p.identity import Identity
from p2p import yamux_credit, yamux_window
from p2p.stream_quota import InboundStreams
from p2p.pubsub import Broadcast, GossipConfig, GossipMessage, SwarmPubsub, build_gossip

logger = logging.getLogger(__name__)

if not os.environ.get("LIBP2P_DEBUG"):
    # Importing libp2p set its logger ``propagate = False`` with no handler, so its warnings
    # went to logging's last-resort handler (bare, unstamped, several lines each); through
    # the root's, a peer's log carries them as its own lines (``inclavate.cli``).
    logging.getLogger("libp2p").propagate = True

DEFAULT_DIAL_TIMEOUT = 10.0
# libp2p's peerstore keeps one TTL per peer, refreshed by every add: an hour after we
# last heard of a peer we forget its addresses. Long enough to re-dial a peer that
# restarts, short enough to stop dialing one that left for good.
ADDR_TTL_SECONDS = 3600
MAX_ADDRS_PER_PEER = 16
"""Addresses kept for one peer (a peer-exchange entry carries at most as many)."""
# See _build_libp2p_host: a libp2p 0.8.1 bug makes this a lifetime total, not a limit.
_INBOUND_CONNECTIONS_PER_LIFETIME = 1_000_000
# Budget for closing connections and listeners when the host exits.
_SHUTDOWN_TIMEOUT = 1.0
# Connection events are tiny; a consumer this far behind is broken, so we drop and log.
_EVENT_QUEUE_SIZE = 1024

@dataclass(frozen=True)
class ConnectionEvent:
    """``connected``: a new connection to ``peer`` is up (it may be a reconnect, or the
    peer may have restarted: resynchronise). ``not connected``: its last one closed.

    A quick reconnect can arrive before the old connection's close is reported (libp2p
    reports closes 100 ms late); then no disconnect is reported at all, only the connect.
    """

    peer: PeerId
    connected: bool


StreamHandler = Callable[[FramedStream, PeerId], Awaitable[None]]
TopicValidator = Callable[[PeerId, bytes], bool]


def _peer_id(peer: ID) -> PeerId:
    return PeerId(peer.to_base58())


@functools.lru_cache(maxsize=4096)
def _parse_peer(peer: str) -> ID:
    """The libp2p ID of ``peer``, remembered: decoding base58 is pure Python (~30-50 us on a
    cold cache), and a session's entry asks whether each hop is connected every 0.1 s
    (``LegWatch.trouble``), the re-dialer asks of every known peer. Bounded: a stranger's
    garbage ids raise and are not kept; at most 4,096 valid ones are."""
    try:
        return ID.from_base58(peer)
    except Exception as exc:  # base58/multihash errors vary
        raise DialError(f"not a peer id: {peer!r}") from exc


def parse_peer_addr(addr: str) -> tuple[PeerId, str]:
    """The peer id and the address before it of ``/ip4/HOST/tcp/PORT/p2p/PEER_ID``.

    The one reading of a peer's multiaddr: what :meth:`P2PHost.connect` dials is what
    ``inclavate peer --bootstrap`` accepted at the command line, so a flag that passed
    never fails later as unparsable. Raises :class:`DialError`.
    """
    try:
        info = info_from_p2p_addr(multiaddr.Multiaddr(addr))
    except Exception as exc:  # multiaddr raises a zoo of types
        raise DialError(f"not a dialable /p2p/ multiaddr: {addr!r}") from exc
    address = str(info.addrs[0])
    if not address:  # a bare /p2p/PEER_ID names nobody to dial
        raise DialError(f"not a dialable /p2p/ multiaddr: {addr!r}")
    return _peer_id(info.peer_id), address


class _ConnectionNotifee(INotifee):
    """Turns libp2p's per-connection callbacks into the per-peer :class:`ConnectionEvent`."""

    def __init__(self, events: Broadcast, on_connected: Callable[[], None] = lambda: None) -> None:
        self._events = events
        self._on_connected = on_connected
        self._open: dict[ID, set[int]] = {}  # peer -> ids of its connections we saw open

    async def connected(self, network: INetwork, conn: INetConn) -> None:
        self._on_connected()
        peer = conn.muxed_conn.peer_id
        self._open.setdefault(peer, set()).add(id(conn))
        self._events.send(ConnectionEvent(_peer_id(peer), connected=True))

    async def disconnected(self, network: INetwork, conn: INetConn) -> None:
        peer = conn.muxed_conn.peer_id
        conns = self._open.get(peer)
        if conns is None or id(conn) not in conns:
            return
        conns.discard(id(conn))
        if not conns:
            del self._open[peer]
            self._events.send(ConnectionEvent(_peer_id(peer), connected=False))

    async def opened_stream(self, network: INetwork, stream: INetStream) -> None:
        pass

    async def closed_stream(self, network: INetwork, stream: INetStream) -> None:
        pass

    async def listen(self, network: INetwork, maddr: multiaddr.Multiaddr) -> None:
        pass

    async def listen_close(self, network: INetwork, maddr: multiaddr.Multiaddr) -> None:
        pass


def _refused(exc: BaseException) -> bool:
    """The peer answered "na": it does not serve the protocol, and the connection is fine.
    Retried, each of a stranger's refusals dialled a replacement connection: identities that
    refuse the peer exchange and the registry sync asked on every new connection kept their
    asker dialling them (``scripts/probe_outbound_flood.py``, before this and the outbound
    bound: 48 such identities held 227 of their asker's 256 descriptors)."""
    seen = 0
    while exc is not None and seen < 8:  # py-libp2p wraps it (StreamFailure from a multiselect error)
        if isinstance(exc, ProtocolNotSupportedError) or (
                isinstance(exc, MultiselectClientError) and str(exc).startswith("protocols not supported")):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1  # type: ignore[assignment]
    return False


def _expand_wildcards(addrs: list[multiaddr.Multiaddr]) -> list[multiaddr.Multiaddr]:
    """Advertise each interface's address instead of an undialable ``0.0.0.0``.

    Loopback goes last: useless to a remote peer (a dial there reaches some other process
    and Noise rejects its identity), but it is how peers on one machine find each other.
    """
    expanded: list[multiaddr.Multiaddr] = []
    for addr in addrs:
        text = str(addr)
        if not text.startswith("/ip4/0.0.0.0/"):
            expanded.append(addr)
            continue
        expanded.extend(a for a in expand_wildcard_address(addr)
                        if not str(a).startswith("/ip4/127."))
        expanded.append(multiaddr.Multiaddr(text.replace("/ip4/0.0.0.0/", "/ip4/127.0.0.1/", 1)))
    return expanded


_KEPT_QUIET = ("Failed to open TCP stream", "Failed to open stream to peer")


def _dial_failure_kept_quiet(record: logging.LogRecord) -> bool:
    """py-libp2p logs every failed TCP dial, and every stream a peer would not open, at error
    level, then raises it to the caller, which decides what it means: redialling a peer that
    died is routine (one peer's log held 119 such lines in 25 minutes of failover tests), and
    a stranger's identity that refuses our protocols cost each honest peer 6-9 lines of
    ~450 characters, even peers it never dialled, which dialled it from its record (an
    audit, 2026-12-07: 12 identities, 72-119 lines a peer). They show at debug level only."""
    if record.levelno >= logging.ERROR and record.getMessage().startswith(_KEPT_QUIET):
        return logger.isEnabledFor(logging.DEBUG)
    return True


def _build_libp2p_host(identity: Identity, listen: multiaddr.Multiaddr, dial_timeout: float,
                       inbound: InboundStreams, guard: ConnectionGuard) -> BasicHost:
    yamux_credit.install()
    yamux_window.install()
    for library_log in (logging.getLogger(libp2p_tcp.__name__), logging.getLogger(BasicHost.__module__)):
        if _dial_failure_kept_quiet not in library_log.filters:
            library_log.addFilter(_dial_failure_kept_quiet)
    key_pair = identity.key_pair
    swarm = new_swarm(
        key_pair=key_pair,
        sec_opt={NOISE_PROTOCOL_ID: NoiseTransport(
            key_pair, noise_privkey=create_x25519_key_pair().private_key)},
        muxer_opt={YAMUX_PROTOCOL_ID: Yamux},
        listen_addrs=[listen],
        retry_config=RetryConfig(max_retries=0),
        connection_config=ConnectionConfig(
            max_connections_per_peer=1,
            dial_timeout=dial_timeout,
            # Each accepted connection holds one of (max - min) "inbound slots" until the
            # swarm stops, not until the connection closes (its handler then waits on
            # the swarm's end): with the default 300 - 50 a peer refuses every inbound
            # connection after its 250th, however many are open. Measured with a cap of
            # 3: the 4th sequential connect fails. Live connections stay bounded by the
            # pruner's high watermark (300); this only pushes the leak out of reach
            # (a million accepted connections) until the library is fixed. The guard's
            # handler below replaces the one that holds the slots: inbound connections
            # are bounded there (p2p.connection_guard), from the descriptor limit.
            max_connections=_INBOUND_CONNECTIONS_PER_LIFETIME,
            inbound_upgrade_timeout=HANDSHAKE_S,
        ),
    )
    guard.install(swarm)
    # Connectivity policy belongs to p2p.discovery. The library's auto-connector would
    # dial every peer in the peerstore up to 150 connections (a full mesh in our swarm,
    # ignoring the target degree), and its dial deadlines cancel handshakes midway,
    # which leaks their sockets.
    swarm.auto_connector = _InertAutoConnector(swarm=swarm)
    host = BasicHost(network=swarm, addrs_factory=_expand_wildcards)
    # Every inbound stream, from before its negotiation, counts against its peer's cap.
    swarm.set_stream_handler(inbound.guard_peer(host._swarm_stream_handler))
    return host


class _InertAutoConnector(AutoConnector):
    """An auto-connector that never dials (bookkeeping hooks are inherited)."""

    async def run_background_task(self, nursery: trio.Nursery) -> None:
        return

    async def maybe_connect(self) -> None:
        return


class P2PHost:
    """One running peer. Create it with :func:`open_host`; all methods need that context."""

    def __init__(self, identity: Identity, host: BasicHost, pubsub: SwarmPubsub,
                 gossip: GossipConfig, topics: dict[str, Broadcast],
                 connection_events: Broadcast, dial_timeout: float, inbound: InboundStreams,
                 listen_host: str = "127.0.0.1", connection_guard: ConnectionGuard | None = None) -> None:
        self.identity = identity
        self.connection_guard = connection_guard or ConnectionGuard()
        """Bounds inbound connections; set its ``valued`` to keep known peers' longest."""
        self.outbound_guard = OutboundGuard(host.get_network(), self._all_mesh_peers)
        """Bounds idle outbound connections (``p2p.outbound_guard``)."""
        self.listen_host = listen_host
        """The interface the host listens on (the direct data plane listens there too)."""
        self.peer_id: PeerId = identity.peer_id
        self._host = host
        self._network = host.get_network()
        self._pubsub = pubsub
        self._gossip = gossip
        self._topics = topics
        self._connection_events = connection_events
        self._dial_timeout = dial_timeout
        self._dials: dict[ID, trio.Event] = {}
        self._validators: dict[str, TopicValidator] = {}
        self.inbound = inbound
        """Live inbound streams per peer and protocol, and what was refused (tests read it)."""

    @property
    def libp2p_host(self) -> BasicHost:
        """The libp2p host underneath, for other modules of ``p2p/`` only."""
        return self._host

    # -- addresses and connections -------------------------------------------------

    def multiaddrs(self) -> list[str]:
        """Our dialable addresses, ``/ip4/<ip>/tcp/<port>/p2p/<peer id>``."""
        return [str(addr) for addr in self._host.get_addrs()]

    def listen_port(self) -> int | None:
        """The TCP port we listen on (None when not listening)."""
        for addr in self._host.get_addrs():
            try:
                return int(addr.value_for_protocol("tcp"))
            except (ValueError, multiaddr.exceptions.ProtocolLookupError):
                continue
        return None

    def connected_peers(self) -> list[PeerId]:
        return [_peer_id(peer) for peer, conns in self._network.connections.items() if conns]

    def is_connected(self, peer: str) -> bool:
        return bool(self._network.connections.get(_parse_peer(peer)))

    def remote_ip(self, peer: str) -> str | None:
        """The IP address our live connection to ``peer`` reaches it at, or None."""
        for conn in self._network.connections.get(_parse_peer(peer), ()):
            address = conn.muxed_conn.get_remote_address()
            if address:
                return str(address[0])
        return None

    def known_addrs(self, peer: str) -> list[str]:
        """Full multiaddrs (with ``/p2p/``) we know for ``peer``; empty if none."""
        peer_id = _parse_peer(peer)
        try:
            addrs = self._host.get_peerstore().addrs(peer_id)
        except PeerStoreError:  # unknown, or its addresses expired
            return []
        # Addresses arrive both bare (our dials) and with /p2p/ (identify stores them so).
        full: list[str] = []
        for addr in map(str, addrs):
            if "/p2p/" not in addr:
                addr = f"{addr}/p2p/{peer}"
            elif not addr.endswith(f"/p2p/{peer}"):
                continue  # relay or foreign suffix: not a direct address of this peer
            if addr not in full:
                full.append(addr)
        return full

    def known_peers(self) -> list[PeerId]:
        """Every other peer we hold unexpired addresses for, connected or not."""
        peers = self._host.get_peerstore().peers_with_addrs()
        return [_peer_id(p) for p in peers if p != self._host.get_id()]

    def add_addrs(self, peer: str, addrs: Iterable[str], ttl: int = ADDR_TTL_SECONDS) -> None:
        """Remember addresses for ``peer`` (``/p2p/`` suffix optional; others' ignored), at most
        :data:`MAX_ADDRS_PER_PEER` of them, these first."""
        peer_id = _parse_peer(peer)
        parsed = []
        for addr in addrs:
            try:
                address = addr
                if "/p2p/" in addr:
                    owner, address = parse_peer_addr(addr)
                    if owner != _peer_id(peer_id):
                        logger.debug("ignoring %s: not an address of %s", addr, peer)
                        continue
                maddr = multiaddr.Multiaddr(address)
            except Exception:  # multiaddr raises a zoo of types; ours, DialError
                logger.debug("ignoring malformed multiaddr %r for %s", addr, peer)
                continue
            parsed.append(maddr)
        if not parsed or peer_id == self._host.get_id():
            return
        # At most MAX_ADDRS_PER_PEER a peer, the newest first: the peerstore appends every new
        # one, and one identity's exchanges left 19,000 of its own, walked every second (the
        # event loop stalled for a second and a half: an audit, 2026-12-07).
        store = self._host.get_peerstore()
        try:
            held = list(store.addrs(peer_id))
        except PeerStoreError:
            held = []
        kept = list(dict.fromkeys([*parsed, *held]))[:MAX_ADDRS_PER_PEER]
        store.clear_addrs(peer_id)
        store.add_addrs(peer_id, kept, ttl)

    async def connect(self, addr: str) -> PeerId:
        """Connect to the peer at ``addr`` (which must end in ``/p2p/<peer id>``).

        Returns at once if already connected. Raises :class:`DialError`.
        """
        peer, address = parse_peer_addr(addr)
        info = PeerInfo(_parse_peer(peer), [multiaddr.Multiaddr(address)])
        if info.peer_id == self._host.get_id():
            raise DialError("refusing to dial ourselves")
        # Concurrent dials to one peer would open two connections; later callers wait
        # for the first and only dial themselves if it failed.
        while (pending := self._dials.get(info.peer_id)) is not None:
            await pending.wait()
        if self.is_connected(peer):
            self._host.get_peerstore().add_addrs(info.peer_id, info.addrs, ADDR_TTL_SECONDS)
            return peer
        self._dials[info.peer_id] = done = trio.Event()
        try:
            self._network.unblock_peer(info.peer_id)  # our backoff, not the library's
            with trio.fail_after(self._dial_timeout):
                await self._network.dial_addr(info.addrs[0], info.peer_id)
        except trio.TooSlowError:
            raise DialError(f"dial to {addr} timed out after {self._dial_timeout:g}s") from None
        except (BaseLibp2pError, OSError, ValueError) as exc:
            raise DialError(f"dial to {addr} failed: {exc}") from exc
        finally:
            del self._dials[info.peer_id]
            done.set()
        self._host.get_peerstore().add_addrs(info.peer_id, info.addrs, ADDR_TTL_SECONDS)
        return peer

    async def disconnect(self, peer: str) -> None:
        """Close every connection to ``peer``.

        Not ``BasicHost.disconnect``: its ``Swarm.close_peer`` awaits the closes (100 ms
        each) and then drops the peer's whole entry, including a connection the peer
        re-dialed meanwhile, which is orphaned open while the peer thinks it is in use.
        """
        await _close_connections(self._network.get_connections(_parse_peer(peer)))

    def connection_events(self) -> trio.MemoryReceiveChannel[ConnectionEvent]:
        """A channel of :class:`ConnectionEvent` from now on; close it to unsubscribe.

        Events already past are not replayed: read :meth:`connected_peers` after opening.
        """
        return self._connection_events.open(_EVENT_QUEUE_SIZE)

    # -- streams ---------------------------------------------------------------------

    async def new_stream(self, peer: str, protocol: str, *, timeout: float | None = None,
                         max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> FramedStream:
        """Open a framed stream to ``peer`` (dialing known addresses if not connected)."""
        peer_id = _parse_peer(peer)
        limit = self._dial_timeout if timeout is None else timeout
        try:
            with trio.fail_after(limit):
                stream = await self._open_negotiated(peer_id, TProtocol(protocol))
        except trio.TooSlowError:
            raise DialError(f"opening {protocol} to {peer} timed out after {limit:g}s") from None
        except (BaseLibp2pError, OSError, ValueError) as exc:
            raise DialError(f"cannot open {protocol} to {peer}: {exc}") from exc
        return FramedStream.over_libp2p(stream, remote_peer=PeerId(peer),
                                        max_frame_size=max_frame_size)

    async def _open_negotiated(self, peer_id: ID, protocol: TProtocol) -> INetStream:
        """Retries, within the caller's deadline: on a busy machine py-libp2p's protocol
        negotiation on a fresh yamux stream now and then fails at once ("handshake read
        failed") over a connection that is fine, and the second stream goes through; or it
        leaves the connection unusable, and a fresh connection is dialled for the third. A
        protocol refused ("na") is asked once more on the same connection (a peer may set its
        handler a moment after it connects), never on a fresh one (:func:`_refused`)."""
        for attempt in range(3):
            try:
                return await self._host.new_stream(peer_id, [protocol])
            except BaseLibp2pError as exc:
                if attempt == 2 or (attempt == 1 and _refused(exc)) or not self.is_connected(str(peer_id)):
                    raise
            await trio.sleep(0.05)
            if attempt == 1:
                # The failed negotiation can leave py-libp2p holding only a connection it
                # now deems invalid ("No valid connections available"), which new_stream
                # never replaces by itself: dial a fresh one.
                await self._network.dial_peer_replacement(peer_id)
        raise AssertionError("unreachable")

    def set_stream_handler(self, protocol: str, handler: StreamHandler, *,
                           max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
                           max_streams_per_peer: int | None = None) -> None:
        """Serve ``protocol``: ``handler(stream, remote_peer)`` runs once per inbound stream.

        The stream is closed when the handler returns and reset if it raises; a handler's
        exception is logged and stays contained to its stream. One remote peer holds at
        most ``max_streams_per_peer`` of these streams at once (default
        :data:`p2p.stream_quota.DEFAULT_PROTOCOL_STREAMS`); more are reset on arrival.
        """

        async def on_stream(stream: INetStream) -> None:
            remote = _peer_id(stream.muxed_conn.peer_id)
            framed = FramedStream.over_libp2p(stream, remote_peer=remote,
                                              max_frame_size=max_frame_size)
            try:
                async with framed:
                    await handler(framed, remote)
            except P2PError as exc:
                logger.debug("%s stream from %s ended: %s", protocol, remote, exc)
            except Exception:
                logger.exception("%s handler failed on a stream from %s", protocol, remote)

        guarded = self.inbound.guard_protocol(protocol, on_stream, max_streams_per_peer)
        self._host.set_stream_handler(TProtocol(protocol), guarded)

    def remove_stream_handler(self, protocol: str) -> None:
        """Stop serving ``protocol`` (new streams for it are reset; open ones go on).

        The handler is replaced rather than removed: py-libp2p's multiselect looks the
        protocol up twice with an await between, so a stream negotiating while a handler is
        deleted raised ``KeyError`` out of the connection's nursery and ended the host."""

        async def refuse(stream: INetStream) -> None:
            await stream.reset()

        self._host.set_stream_handler(TProtocol(protocol), refuse)

    # -- pubsub ----------------------------------------------------------------------

    async def subscribe(self, topic: str) -> trio.MemoryReceiveChannel[GossipMessage]:
        """A channel of :class:`GossipMessage` on ``topic``, our own publishes included.

        Each call gets its own channel; close it to stop receiving.
        """
        channel = self._topics.setdefault(topic, Broadcast(f"topic {topic!r}")).open(
            self._gossip.subscription_queue_size)
        if topic not in self._pubsub.topic_ids:
            await self._pubsub.subscribe(topic)
        return channel

    def set_topic_validator(self, topic: str, validator: TopicValidator) -> None:
        """Only messages with ``validator(originator, data)`` true are delivered or forwarded.

        It runs on every message we receive, on the trio thread: keep it fast. One that
        raises counts as a rejection.
        """

        def validate(_forwarder: ID, message: rpc_pb2.Message) -> bool:
            return self._check(topic, validator, _peer_id(ID(message.from_id)), message.data)

        self._validators[topic] = validator
        self._pubsub.set_topic_validator(topic, validate, is_async_validator=False)

    async def publish(self, topic: str, data: bytes) -> None:
        """Publish ``data`` on ``topic``; raises :class:`PublishRejected` if our own
        validator refuses it (libp2p would drop it silently) or it is too large."""
        if len(data) > self._gossip.max_message_size:
            raise PublishRejected(f"{len(data)} bytes exceeds the gossip limit of "
                                  f"{self._gossip.max_message_size}")
        validator = self._validators.get(topic)
        if validator is not None and not self._check(topic, validator, self.peer_id, data):
            raise PublishRejected(f"our own validator for {topic!r} rejected the message")
        try:
            await self._pubsub.publish(topic, data)
        except BaseLibp2pError as exc:
            raise P2PError(f"publish on {topic!r} failed: {exc}") from exc

    @staticmethod
    def _check(topic: str, validator: TopicValidator, origin: PeerId, data: bytes) -> bool:
        try:
            return bool(validator(origin, data))
        except Exception:
            logger.exception("validator for %r raised; treating the message as invalid", topic)
            return False

    def gossip_peers(self, topic: str) -> list[PeerId]:
        """Connected peers known to subscribe to ``topic`` (publishing before any exist
        reaches nobody but ourselves)."""
        return [_peer_id(p) for p in self._pubsub.peer_topics.get(topic, ())]

    def mesh_peers(self, topic: str) -> list[PeerId]:
        """The peers a message published on ``topic`` now is pushed to (the gossip mesh).
        A peer known to subscribe (:meth:`gossip_peers`) joins it at the next gossip
        heartbeat or when it grafts us; until then it learns of our messages only from the
        heartbeat's gossip, later and not always all of a burst."""
        return [_peer_id(p) for p in self._pubsub.router.mesh.get(topic, ())]  # type: ignore[attr-defined]

    def _all_mesh_peers(self) -> list[PeerId]:
        """Our gossip mesh neighbours, every topic together."""
        mesh = self._pubsub.router.mesh  # type: ignore[attr-defined]
        return [_peer_id(p) for peers in list(mesh.values()) for p in peers]

    def _close_channels(self) -> None:
        self._connection_events.close()
        for broadcast in self._topics.values():
            broadcast.close()


def _listen_multiaddr(listen_host: str, listen_port: int) -> multiaddr.Multiaddr:
    family = "ip6" if ":" in listen_host else "ip4"
    try:
        return multiaddr.Multiaddr(f"/{family}/{listen_host}/tcp/{int(listen_port)}")
    except Exception as exc:  # multiaddr raises a zoo of types
        raise ListenError(f"cannot listen on {listen_host}:{listen_port}: {exc}") from exc


def _ensure_port_free(listen_host: str, listen_port: int) -> None:
    """Refuse a fixed port in use: with SO_REUSEPORT two peers would share it silently."""
    error = port_in_use(listen_host, listen_port)
    if error is not None:
        raise ListenError(f"cannot listen on {listen_host}:{listen_port}: {error}") from error


@asynccontextmanager
async def open_host(
    identity: Identity,
    *,
    listen_port: int = 0,
    listen_host: str = "127.0.0.1",
    enable_mdns: bool = False,
    gossip: GossipConfig = GossipConfig(),
    dial_timeout: float = DEFAULT_DIAL_TIMEOUT,
) -> AsyncIterator[P2PHost]:
    """Run a peer's host for the duration of the ``async with`` block.

    ``listen_port=0`` picks a free port (read it back from :meth:`P2PHost.multiaddrs`).
    With ``enable_mdns`` peers found on the local network are connected; if multicast is
    unavailable that is logged and the host runs without it. Raises :class:`ListenError`.
    """
    listen = _listen_multiaddr(listen_host, listen_port)
    _ensure_port_free(listen_host, listen_port)
    inbound = InboundStreams()
    guard = ConnectionGuard()
    libp2p_host = _build_libp2p_host(identity, listen, dial_timeout, inbound, guard)
    topics: dict[str, Broadcast] = {}
    pubsub, router = build_gossip(libp2p_host, gossip, topics, inbound)
    events = Broadcast("connection events")
    host = P2PHost(identity, libp2p_host, pubsub, gossip, topics, events, dial_timeout, inbound, listen_host, guard)
    libp2p_host.get_network().register_notifee(_ConnectionNotifee(events, host.outbound_guard.wake))
    try:
        async with libp2p_host.run([listen]):
            try:
                if not libp2p_host.get_transport_addrs():
                    raise ListenError(f"could not listen on {listen}")
                async with background_trio_service(pubsub), background_trio_service(router):
                    await pubsub.wait_until_ready()
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(host.outbound_guard.run)
                        if enable_mdns:
                            from p2p.discovery import run_mdns  # builds on this module

                            nursery.start_soon(run_mdns, host)  # zeroconf is slow to start
                        yield host
                        nursery.cancel_scope.cancel()
            finally:
                with trio.CancelScope(shield=True), trio.move_on_after(_SHUTDOWN_TIMEOUT):
                    await _close_network(libp2p_host)
    except BaseExceptionGroup as group:
        # Six nested library nurseries would wrap an error from the caller's block (or
        # ours) in as many groups; a lone error is re-raised as itself.
        leaf = _sole_error(group)
        if leaf is None:
            raise
        raise leaf from None
    finally:
        host._close_channels()


def _sole_error(group: BaseExceptionGroup[BaseException]) -> BaseException | None:
    leaves: list[BaseException] = []
    pending: list[BaseException] = [group]
    while pending:
        item = pending.pop()
        if isinstance(item, BaseExceptionGroup):
            pending.extend(item.exceptions)
        else:
            leaves.append(item)
    return leaves[0] if len(leaves) == 1 else None


async def _close_connections(conns: Iterable[INetConn]) -> None:
    """Close connections concurrently: each close sleeps 100 ms in ``SwarmConn._cleanup``."""

    async def close(conn: INetConn) -> None:
        try:
            await conn.close()
        except Exception as exc:  # closing anyway; the peer may be gone
            logger.debug("error closing a connection: %r", exc)

    async with trio.open_nursery() as nursery:
        for conn in list(conns):
            nursery.start_soon(close, conn)


async def _close_network(host: BasicHost) -> None:
    """Close every connection, then the host.

    Left to the library, connections are closed one after another (100 ms each) and only
    on an explicit ``Swarm.close``: stopping its service closes them under cancellation,
    which leaks their sockets.
    """
    connections = host.get_network().connections
    await _close_connections([c for conns in list(connections.values()) for c in conns])
    await host.close()
