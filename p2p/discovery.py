"""Keeping a peer connected to the swarm: bootstrap, re-dial, peer exchange, mDNS.

A peer starts from one or more bootstrap multiaddrs and must end up with several
neighbours, not just the bootstrap node, and must find its way back after losing all
of them. Three mechanisms, all run by :func:`run_discovery`:

* **Dialing with capped exponential backoff and jitter** (:class:`Backoff`): bootstrap
  addresses and every peer address we have learned are retried while we are below the
  target degree, each on its own schedule, so a dead address costs one dial per
  ``max_delay`` and a swarm that restarts together does not dial in lockstep.
* **Peer exchange** on ``/inclavate/peers/1``: on every new connection we send the peer
  our own addresses and it answers with the peers it knows (itself included), as one
  JSON frame each way. We remember them all and dial a few, up to the target degree.
  Sending our own addresses first matters: an inbound connection shows only the remote's
  ephemeral port, so without it a peer that dialed in could never be recommended.
* **mDNS** (:func:`run_mdns`, started by ``open_host(enable_mdns=True)``): peers on the
  local network announce themselves and are connected; if multicast is unavailable the
  peer logs it and runs without.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import trio
from libp2p.discovery.events.peerDiscovery import peerDiscovery
from libp2p.discovery.mdns.mdns import create_mdns_discovery
from libp2p.peer.peerinfo import PeerInfo

from inclavate.types import PeerId
from p2p.errors import DialError, P2PError, ProtocolError
from p2p.framing import FramedStream

if TYPE_CHECKING:
    from p2p.host import P2PHost

logger = logging.getLogger(__name__)

PEERS_PROTOCOL = "/inclavate/peers/1"
# A peer list is ~100 bytes per peer; this bounds what a hostile peer can make us parse.
_MAX_PEER_LIST_BYTES = 256 * 1024
_MDNS_STOP_TIMEOUT = 1.0


@dataclass(frozen=True)
class DiscoveryConfig:
    target_degree: int = 8
    """Keep dialing known peers while connected to fewer than this many."""
    min_delay: float = 0.5
    max_delay: float = 30.0
    jitter: float = 0.25
    """Each delay is scaled by a random factor in [1 - jitter, 1 + jitter]."""
    check_interval: float = 1.0
    """How often the degree is checked (and due dials made)."""
    exchange_timeout: float = 5.0
    max_shared_peers: int = 32
    dial_concurrency: int = 4


@dataclass
class Backoff:
    """Capped exponential backoff with jitter for one dial target (pure; clock injected)."""

    config: DiscoveryConfig
    rng: random.Random = field(default_factory=random.Random)
    failures: int = 0
    next_attempt: float = 0.0

    def due(self, now: float) -> bool:
        return now >= self.next_attempt

    def failed(self, now: float) -> None:
        delay = min(self.config.max_delay, self.config.min_delay * 2.0**self.failures)
        spread = self.config.jitter
        self.next_attempt = now + delay * self.rng.uniform(1.0 - spread, 1.0 + spread)
        self.failures += 1

    def succeeded(self) -> None:
        self.failures = 0
        self.next_attempt = 0.0


@dataclass(frozen=True)
class PeerAddrs:
    """One entry of a peer-exchange message."""

    peer_id: PeerId
    addrs: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"id": self.peer_id, "addrs": list(self.addrs)}

    @classmethod
    def from_json(cls, obj: Any) -> PeerAddrs:
        if (not isinstance(obj, dict) or not isinstance(obj.get("id"), str)
                or not isinstance(obj.get("addrs"), list)
                or not all(isinstance(a, str) for a in obj["addrs"])):
            raise ProtocolError(f"malformed peer entry: {obj!r:.200}")
        return cls(PeerId(obj["id"]), tuple(obj["addrs"]))


def encode_peers(peers: Sequence[PeerAddrs]) -> bytes:
    return json.dumps({"peers": [p.to_json() for p in peers]}).encode()


def decode_peers(frame: bytes) -> list[PeerAddrs]:
    try:
        body = json.loads(frame)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"peer list is not JSON: {exc}") from exc
    if not isinstance(body, dict) or not isinstance(body.get("peers"), list):
        raise ProtocolError("peer list must be an object with a 'peers' list")
    return [PeerAddrs.from_json(entry) for entry in body["peers"]]


def _self_entry(host: P2PHost) -> PeerAddrs:
    return PeerAddrs(host.peer_id, tuple(host.multiaddrs()))


def _shared_peers(host: P2PHost, limit: int, exclude: PeerId) -> list[PeerAddrs]:
    """Ourselves, then connected peers with known addresses, in random order."""
    others = [p for p in host.connected_peers() if p != exclude]
    random.shuffle(others)
    entries = [_self_entry(host)]
    for peer in others:
        addrs = host.known_addrs(peer)
        if addrs:
            entries.append(PeerAddrs(peer, tuple(addrs)))
        if len(entries) >= limit:
            break
    return entries


def _remember(host: P2PHost, peers: Sequence[PeerAddrs]) -> list[PeerAddrs]:
    """Store peers' addresses; return the ones we are not yet connected to."""
    new = []
    for entry in peers:
        if entry.peer_id == host.peer_id:
            continue
        try:
            host.add_addrs(entry.peer_id, entry.addrs)
        except DialError:  # not a peer id
            continue
        if not host.is_connected(entry.peer_id):
            new.append(entry)
    return new


async def _serve_peers(host: P2PHost, config: DiscoveryConfig, stream: FramedStream,
                       remote: PeerId) -> None:
    asked = decode_peers(await stream.receive(config.exchange_timeout))
    _remember(host, [p for p in asked if p.peer_id == remote])  # only its own addresses
    await stream.send(encode_peers(_shared_peers(host, config.max_shared_peers, remote)),
                      config.exchange_timeout)


async def exchange_peers(host: P2PHost, peer: PeerId,
                         config: DiscoveryConfig = DiscoveryConfig()) -> list[PeerAddrs]:
    """Ask ``peer`` for the peers it knows (telling it our addresses); remember them all.

    Returns the ones we are not connected to. Raises :class:`P2PError` on failure.
    """
    stream = await host.new_stream(peer, PEERS_PROTOCOL, timeout=config.exchange_timeout,
                                   max_frame_size=_MAX_PEER_LIST_BYTES)
    async with stream:
        await stream.send(encode_peers([_self_entry(host)]), config.exchange_timeout)
        answer = decode_peers(await stream.receive(config.exchange_timeout))
    return _remember(host, answer)


class _Connector:
    """The dialing side of discovery: who to dial next, and the backoff of each target."""

    def __init__(self, host: P2PHost, bootstrap: Sequence[str], config: DiscoveryConfig,
                 rng: random.Random) -> None:
        self._host = host
        self._bootstrap = list(bootstrap)
        self._config = config
        self._rng = rng
        self._backoff: dict[str, Backoff] = {}  # keyed by multiaddr
        self._dialing: set[str] = set()

    def _missing(self) -> int:
        return self._config.target_degree - len(self._host.connected_peers())

    def _candidates(self, now: float) -> list[str]:
        """Due addresses of peers we are not connected to: bootstrap first, then learned."""
        seen_peers: set[str] = set()
        out = []
        learned = [a for p in self._host.known_peers() for a in self._host.known_addrs(p)]
        self._rng.shuffle(learned)
        for addr in self._bootstrap + learned:
            peer = addr.rsplit("/p2p/", 1)[-1]
            if peer in seen_peers or addr in self._dialing or peer == self._host.peer_id:
                continue
            if self._host.is_connected(peer):
                self._backoff.pop(addr, None)
                continue
            seen_peers.add(peer)  # one address per peer per round
            if self._backoff.setdefault(addr, Backoff(self._config, self._rng)).due(now):
                out.append(addr)
        return out

    async def dial_round(self, nursery: trio.Nursery) -> None:
        missing = self._missing()
        if missing <= 0:
            return
        now = trio.current_time()
        for addr in self._candidates(now)[: min(missing, self._config.dial_concurrency)]:
            self._dialing.add(addr)
            nursery.start_soon(self._dial, addr)

    async def dial_some(self, nursery: trio.Nursery, peers: Sequence[PeerAddrs]) -> None:
        """Dial freshly learned peers right away (not waiting for the next round)."""
        picks = list(peers)
        self._rng.shuffle(picks)
        for entry in picks[: max(0, self._missing())]:
            if entry.addrs and entry.addrs[0] not in self._dialing:
                self._dialing.add(entry.addrs[0])
                nursery.start_soon(self._dial, entry.addrs[0])

    async def _dial(self, addr: str) -> None:
        backoff = self._backoff.setdefault(addr, Backoff(self._config, self._rng))
        try:
            await self._host.connect(addr)
        except DialError as exc:
            backoff.failed(trio.current_time())
            logger.debug("dial %s failed (%d in a row): %s", addr, backoff.failures, exc)
        else:
            backoff.succeeded()
        finally:
            self._dialing.discard(addr)


async def run_discovery(
    host: P2PHost,
    bootstrap: Sequence[str] = (),
    config: DiscoveryConfig = DiscoveryConfig(),
    *,
    rng: random.Random | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Keep ``host`` connected until cancelled (start it with ``nursery.start``)."""
    rng = rng or random.Random()
    connector = _Connector(host, bootstrap, config, rng)

    async def serve(stream: FramedStream, remote: PeerId) -> None:
        await _serve_peers(host, config, stream, remote)

    host.set_stream_handler(PEERS_PROTOCOL, serve, max_frame_size=_MAX_PEER_LIST_BYTES)
    events = host.connection_events()

    async def exchange_with(nursery: trio.Nursery, peer: PeerId) -> None:
        try:
            fresh = await exchange_peers(host, peer, config)
        except P2PError as exc:
            logger.debug("peer exchange with %s failed: %s", peer, exc)
            return
        await connector.dial_some(nursery, fresh)

    async with trio.open_nursery() as nursery:
        async def on_events() -> None:
            async with events:
                async for event in events:
                    if event.connected:
                        nursery.start_soon(exchange_with, nursery, event.peer)

        nursery.start_soon(on_events)
        for peer in host.connected_peers():  # connected before we started listening
            nursery.start_soon(exchange_with, nursery, peer)
        task_status.started()
        while True:
            await connector.dial_round(nursery)
            # Below target with neighbours to ask: ask one again, since what it knew
            # when we met may have grown (peers that joined after us).
            connected = host.connected_peers()
            if connected and len(connected) < config.target_degree:
                nursery.start_soon(exchange_with, nursery, rng.choice(connected))
            await trio.sleep(config.check_interval)


async def run_mdns(host: P2PHost, *,
                   task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Announce ``host`` on the local network and connect every peer that answers.

    Never fails: without multicast (containers, some Wi-Fi) it logs and returns, and the
    peer relies on bootstrap addresses instead. zeroconf runs its own threads; discovered
    peers cross into trio through a channel.
    """
    token = trio.lowlevel.current_trio_token()
    found_send, found_recv = trio.open_memory_channel[list[str]](64)

    def on_found(info: PeerInfo) -> None:  # called on a zeroconf thread
        addrs = [f"{addr}/p2p/{info.peer_id}" for addr in info.addrs]
        try:
            trio.from_thread.run_sync(found_send.send_nowait, addrs, trio_token=token)
        except (trio.RunFinishedError, trio.WouldBlock, trio.BrokenResourceError,
                trio.ClosedResourceError):
            pass  # shutting down, or a flood of announcements: mDNS repeats them

    port = int(host.multiaddrs()[0].split("/")[4])
    try:
        mdns = await trio.to_thread.run_sync(_start_mdns, host, port)
    except Exception as exc:  # noqa: BLE001 - zeroconf/socket errors of every kind
        logger.warning("mDNS discovery unavailable, continuing without it: %r", exc)
        task_status.started()
        return
    peerDiscovery.register_peer_discovered_handler(on_found)
    task_status.started()
    try:
        async for addrs in found_recv:
            for addr in addrs:
                try:
                    await host.connect(addr)
                    break
                except DialError as exc:
                    logger.debug("mDNS peer %s not dialable: %s", addr, exc)
    finally:
        peerDiscovery.unregister_peer_discovered_handler(on_found)
        with trio.CancelScope(shield=True), trio.move_on_after(_MDNS_STOP_TIMEOUT):
            await trio.to_thread.run_sync(mdns.stop, abandon_on_cancel=True)


def _start_mdns(host: P2PHost, port: int) -> Any:
    network = host.libp2p_host.get_network()
    mdns = create_mdns_discovery(network, port=port, host=host.libp2p_host)
    mdns.start()
    return mdns
