"""Keeping a peer connected to the swarm: bootstrap, re-dial, peer exchange, mDNS.

A peer starts from one or more bootstrap multiaddrs and must end up with several
neighbours, not just the bootstrap node, and must find its way back after losing all
of them. :func:`run_discovery` combines:

* **Dialing with capped exponential backoff and jitter** (:class:`Backoff`): bootstrap
  addresses and every peer address we have learned are retried while we are below the
  target degree, each on its own schedule, so a dead address costs one dial per
  ``max_delay`` and a swarm that restarts together does not dial in lockstep. Losing
  every connection is just "below target": the same loop re-dials known peers.
* **Peer exchange** on ``/inclavate/peers/1``: on every new connection we send the peer
  our own addresses and it answers with the peers it knows (itself included), one JSON
  frame each way. We remember them all and dial a few, up to the target degree. Sending
  our own addresses first matters: an inbound connection shows only the remote's
  ephemeral port, so without it a peer that dialed in could never be recommended.
  While below target we also re-ask a random neighbour now and then, since what it
  knew when we met grows as peers join after us: every 10 s while that teaches us
  someone, up to every 160 s while it does not (:class:`ExchangeSchedule`).
* **What outlives a restart** (an :class:`AddressBook`, :mod:`inclavate.peer_book` in a
  peer): each neighbour's own addresses, dialed after the bootstrap addresses on the next
  start, so a peer whose bootstrap moved or left still finds the swarm.

:func:`run_mdns` (started by ``open_host(enable_mdns=True)``) connects peers announced on
the local network; without multicast it logs and the peer relies on bootstrap addresses.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import trio
from libp2p.discovery.events.peerDiscovery import peerDiscovery
from libp2p.discovery.mdns.mdns import create_mdns_discovery
from libp2p.peer.peerinfo import PeerInfo

from inclavate.errors import ConfigError
from inclavate.types import PeerId
from inclavate.untrusted import Malformed, as_dict, as_str, parse_json, read_list, read_str
from p2p.errors import DialError, P2PError, ProtocolError
from p2p.framing import FramedStream
from p2p.host import MAX_ADDRS_PER_PEER
from p2p.ticks import sleep_to_tick

if TYPE_CHECKING:
    from p2p.host import P2PHost

logger = logging.getLogger(__name__)

PEERS_PROTOCOL = "/inclavate/peers/1"
# A peer entry is ~150 bytes; this bounds what a hostile peer can make us parse.
_MAX_PEER_LIST_BYTES = 256 * 1024
_MAX_ID = 128
_MAX_ADDR = 512
_MAX_KNOWN_PEERS = 1024
_MAX_BACKOFF_ENTRIES = 4096
"""Dial schedules kept (one per address); beyond it the table is rebuilt from what is known."""
_MDNS_STOP_TIMEOUT = 1.0


@dataclass(frozen=True)
class DiscoveryConfig:
    target_degree: int = 8
    """Keep dialing known peers while connected to fewer than this many. Gossip wants
    D=6 mesh neighbours; a couple more leaves room for churn."""
    min_delay: float = 0.5
    """Backoff after the first failed dial of an address, doubling per failure..."""
    max_delay: float = 30.0
    """...up to this: a dead address then costs one dial per 30 s."""
    jitter: float = 0.25
    """Each delay is scaled by a random factor in [1 - jitter, 1 + jitter]."""
    check_interval: float = 1.0
    """How often the degree is checked and due dials are made."""
    exchange_interval: float = 10.0
    """While below target, how often a random neighbour is asked again for peers..."""
    exchange_max_interval: float = 160.0
    """...doubling after each re-ask that teaches nobody new, up to this (back to
    ``exchange_interval`` on any connection or loss): below target is the steady state of a
    swarm smaller than ``target_degree``, where each re-ask (a stream opened, negotiated,
    answered and closed) was ~60 trio steps every 10 s on each side and taught nothing."""
    exchange_timeout: float = 5.0
    max_shared_peers: int = 32
    dial_concurrency: int = 4

    def __post_init__(self) -> None:
        if self.target_degree < 1 or self.max_shared_peers < 1 or self.dial_concurrency < 1:
            raise ConfigError("discovery degree, shared peers and concurrency must be >= 1")
        if not 0 < self.min_delay <= self.max_delay or not 0 <= self.jitter < 1:
            raise ConfigError("discovery backoff needs 0 < min_delay <= max_delay, 0 <= jitter < 1")
        if not 0 < self.exchange_interval <= self.exchange_max_interval:
            raise ConfigError("discovery needs 0 < exchange_interval <= exchange_max_interval")


@dataclass
class ExchangeSchedule:
    """When to re-ask a neighbour for peers: every ``exchange_interval`` while that teaches
    us someone, twice as long after each re-ask that does not (up to
    ``exchange_max_interval``), and soon again once a connection comes or goes, since then
    what the neighbours know may have changed. The clock is passed in."""

    config: DiscoveryConfig
    last: float = 0.0
    period: float = field(init=False)

    def __post_init__(self) -> None:
        self.period = self.config.exchange_interval

    def due(self, now: float) -> bool:
        return now - self.last >= self.period

    def asked(self, now: float) -> None:
        self.last = now

    def learned(self, fresh: int) -> None:
        """A re-ask's outcome: ``fresh`` peers we were not connected to."""
        self.period = self.config.exchange_interval if fresh else min(2 * self.period, self.config.exchange_max_interval)

    def connections_changed(self) -> None:
        self.period = self.config.exchange_interval


@dataclass
class Backoff:
    """Capped exponential backoff with jitter for one dial target (the clock is passed in)."""

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


class AddressBook(Protocol):
    """What discovery keeps between runs: peers' own addresses (:mod:`inclavate.peer_book`)."""

    def recall(self) -> list[PeerAddrs]:
        """Peers met in earlier runs, to dial after the bootstrap addresses."""
        ...

    def met(self, entry: PeerAddrs) -> None:
        """``entry`` is a peer's own word about its addresses, over a connection to it."""
        ...


# -- the peer-exchange message ------------------------------------------------------


@dataclass(frozen=True)
class PeerAddrs:
    """One entry of a peer-exchange message: a peer and its full ``/p2p/`` multiaddrs."""

    peer_id: PeerId
    addrs: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"id": self.peer_id, "addrs": list(self.addrs)}

    @classmethod
    def from_json(cls, obj: Any) -> PeerAddrs:
        try:
            entry = as_dict(obj, "peers", max_len=8)
            peer = read_str(entry, "id", max_len=_MAX_ID)
            addrs = read_list(entry, "addrs", max_len=MAX_ADDRS_PER_PEER)
            return cls(PeerId(peer), tuple(as_str(a, "addrs", max_len=_MAX_ADDR) for a in addrs))
        except Malformed as exc:
            raise ProtocolError(f"malformed peer entry: {exc}") from None


def encode_peers(peers: Sequence[PeerAddrs]) -> bytes:
    return json.dumps({"peers": [p.to_json() for p in peers]}).encode()


def decode_peers(frame: bytes, max_peers: int = 64) -> list[PeerAddrs]:
    """A peer-exchange frame, typed; raises :class:`ProtocolError` (never anything else)."""
    try:
        body = parse_json(frame, max_bytes=_MAX_PEER_LIST_BYTES, max_depth=4)
        entries = read_list(body, "peers", max_len=max_peers)
    except Malformed as exc:
        raise ProtocolError(f"malformed peer list: {exc}") from None
    return [PeerAddrs.from_json(entry) for entry in entries]


def _self_entry(host: P2PHost) -> PeerAddrs:
    return PeerAddrs(host.peer_id, tuple(host.multiaddrs()[:MAX_ADDRS_PER_PEER]))


def _shared_peers(host: P2PHost, limit: int, exclude: PeerId) -> list[PeerAddrs]:
    """Ourselves, then connected peers with known addresses, in random order."""
    others = [p for p in host.connected_peers() if p != exclude]
    random.shuffle(others)
    entries = [_self_entry(host)]
    for peer in others:
        if len(entries) >= limit:
            break
        addrs = host.known_addrs(peer)
        if addrs:
            entries.append(PeerAddrs(peer, tuple(addrs[:MAX_ADDRS_PER_PEER])))
    return entries


_LOOPBACK, _PRIVATE, _PUBLIC = 0, 1, 2


def _scope(ip: str) -> int | None:
    """How far an IP address reaches: loopback, a private network (RFC 1918, link-local,
    unique-local), the internet; None for one no peer is at (unspecified, multicast,
    reserved) or that is no IP address."""
    try:
        address = ipaddress.ip_address(ip)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if address.is_unspecified or address.is_multicast:
        return None
    if address.is_loopback:  # before is_reserved: ::1 is in the reserved ::/8
        return _LOOPBACK
    if address.is_private or address.is_link_local:
        return _PRIVATE
    return None if address.is_reserved else _PUBLIC


def believable(entry: PeerAddrs, informant_ip: str | None) -> PeerAddrs:
    """``entry`` with only the addresses its informant (the peer we learnt it from, reached at
    ``informant_ip``) can speak for: IP addresses no nearer to us than the informant itself.
    A peer on the internet names only internet addresses; one on our network, ours too; one
    on this machine, loopback too. Every address learnt is dialled, again and again: a
    stranger naming hosts and ports on our loopback or LAN made every honest peer a port
    scanner of its own network (an audit, 2026-12-07). Names (``/dns``) are hearsay left out."""
    floor = _scope(informant_ip) if informant_ip is not None else None
    floor = _PUBLIC if floor is None else floor
    kept = []
    for addr in entry.addrs:
        parts = addr.split("/")
        scope = _scope(parts[2]) if len(parts) > 2 and parts[1] in ("ip4", "ip6") else None
        if scope is not None and scope >= floor:
            kept.append(addr)
    return PeerAddrs(entry.peer_id, tuple(kept))


def _remember(host: P2PHost, peers: Sequence[PeerAddrs], informant: PeerId) -> list[PeerAddrs]:
    """Store peers' addresses, those ``informant`` can speak for (:func:`believable`); return
    the peers we are not connected to.

    Strangers choose these entries, so the address book is capped: past
    ``_MAX_KNOWN_PEERS`` new peers are not remembered (known ones are still refreshed, by
    their own word only: a peer's addresses are kept at most 16, the newest first, and
    hearsay of 16 made-up ones pushed its real ones out; a review, 2026-12-07)."""
    known = set(host.known_peers())
    informant_ip = host.remote_ip(informant)
    new = []
    for entry in peers:
        entry = believable(entry, informant_ip)
        if entry.peer_id == host.peer_id or not entry.addrs:
            continue
        if entry.peer_id not in known and len(known) >= _MAX_KNOWN_PEERS:
            continue
        hearsay_of_a_known_peer = entry.peer_id != informant and entry.peer_id in known
        known.add(entry.peer_id)
        try:
            if not hearsay_of_a_known_peer:
                host.add_addrs(entry.peer_id, entry.addrs)
        except DialError:  # not a peer id
            continue
        if not host.is_connected(entry.peer_id):
            new.append(entry)
    return new


async def _serve_peers(host: P2PHost, config: DiscoveryConfig, stream: FramedStream,
                       remote: PeerId, book: AddressBook | None = None) -> None:
    asked = decode_peers(await stream.receive(config.exchange_timeout), max_peers=4)
    # Only the asker's own addresses are taken: it has no say about anyone else's.
    own = [believable(p, host.remote_ip(remote)) for p in asked if p.peer_id == remote]
    _remember(host, own, remote)
    if book is not None and own and own[0].addrs:
        book.met(own[0])
    await stream.send(encode_peers(_shared_peers(host, config.max_shared_peers, remote)),
                      config.exchange_timeout)


async def exchange_peers(host: P2PHost, peer: PeerId, config: DiscoveryConfig = DiscoveryConfig(),
                         book: AddressBook | None = None) -> list[PeerAddrs]:  # fmt: skip
    """Ask ``peer`` for the peers it knows (telling it our addresses); remember them all,
    and ``peer``'s own entry in ``book``.

    Returns the ones we are not connected to. Raises :class:`P2PError` on failure.
    """
    stream = await host.new_stream(peer, PEERS_PROTOCOL, timeout=config.exchange_timeout,
                                   max_frame_size=_MAX_PEER_LIST_BYTES)
    async with stream:
        await stream.send(encode_peers([_self_entry(host)]), config.exchange_timeout)
        answer = decode_peers(await stream.receive(config.exchange_timeout), config.max_shared_peers)
    if book is not None:
        for entry in answer:
            if entry.peer_id == peer:  # its own word about itself; the rest is hearsay
                entry = believable(entry, host.remote_ip(peer))
                if entry.addrs:
                    book.met(entry)
                break
    return _remember(host, answer, peer)


# -- dialing ------------------------------------------------------------------------


class _Connector:
    """Who to dial next, and the backoff of every address we dial."""

    def __init__(self, host: P2PHost, bootstrap: Sequence[str], config: DiscoveryConfig,
                 rng: random.Random) -> None:
        self._host = host
        self._bootstrap = list(bootstrap)
        """Bootstrap addresses, then those of the peers met in earlier runs."""
        self._config = config
        self._rng = rng
        self._backoff: dict[str, Backoff] = {}  # by multiaddr
        self._dialing: set[str] = set()

    def missing(self) -> int:
        return self._config.target_degree - len(self._host.connected_peers())

    def _due_addresses(self, now: float) -> list[str]:
        """One due address per unconnected peer: bootstrap first, then learned ones."""
        learned = [a for p in self._host.known_peers() for a in self._host.known_addrs(p)]
        if len(self._backoff) > _MAX_BACKOFF_ENTRIES:  # forget schedules of forgotten addresses
            keep = set(self._bootstrap) | set(learned)
            self._backoff = {a: b for a, b in self._backoff.items() if a in keep}
        self._rng.shuffle(learned)
        seen: set[str] = {self._host.peer_id}
        due = []
        for addr in self._bootstrap + learned:
            peer = addr.rsplit("/p2p/", 1)[-1]
            if peer in seen or addr in self._dialing or self._host.is_connected(peer):
                continue
            if self._backoff.setdefault(addr, Backoff(self._config, self._rng)).due(now):
                seen.add(peer)
                due.append(addr)
        return due

    def dial_due(self, nursery: trio.Nursery) -> None:
        budget = min(self.missing(), self._config.dial_concurrency)
        if budget > 0:
            for addr in self._due_addresses(trio.current_time())[:budget]:
                self._start(nursery, addr)

    def dial_fresh(self, nursery: trio.Nursery, peers: Sequence[PeerAddrs]) -> None:
        """Dial some just-learned peers now rather than at the next check."""
        picks = [p for p in peers if p.addrs]
        self._rng.shuffle(picks)
        for entry in picks[: max(0, self.missing())]:
            self._start(nursery, entry.addrs[0])

    def _start(self, nursery: trio.Nursery, addr: str) -> None:
        if addr not in self._dialing:
            self._dialing.add(addr)
            nursery.start_soon(self._dial, addr)

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
    book: AddressBook | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Keep ``host`` connected until cancelled; start it with ``nursery.start``. ``book``
    keeps peers' own addresses between runs: those it recalls are dialed after ``bootstrap``."""
    rng = rng or random.Random()
    remembered = [addr for entry in book.recall() for addr in entry.addrs] if book is not None else []
    connector = _Connector(host, [*bootstrap, *remembered], config, rng)

    async def serve(stream: FramedStream, remote: PeerId) -> None:
        await _serve_peers(host, config, stream, remote, book)

    schedule = ExchangeSchedule(config)

    async def exchange_with(nursery: trio.Nursery, peer: PeerId, *, periodic: bool = False) -> None:
        try:
            fresh = await exchange_peers(host, peer, config, book)
        except P2PError as exc:
            logger.debug("peer exchange with %s failed: %s", peer, exc)
            return
        except Exception:  # a bug must cost one exchange, never the peer
            logger.exception("peer exchange with %s failed unexpectedly", peer)
            return
        if periodic:
            schedule.learned(len(fresh))
        connector.dial_fresh(nursery, fresh)

    async def on_connections(nursery: trio.Nursery,
                             events: trio.MemoryReceiveChannel[Any]) -> None:
        async with events:
            async for event in events:
                schedule.connections_changed()
                if event.connected:
                    nursery.start_soon(exchange_with, nursery, event.peer)

    # A neighbour asks once per connect and once per exchange period: 2 covers an overlap.
    host.set_stream_handler(PEERS_PROTOCOL, serve, max_frame_size=_MAX_PEER_LIST_BYTES, max_streams_per_peer=2)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(on_connections, nursery, host.connection_events())
            for peer in host.connected_peers():  # connected before we were listening
                nursery.start_soon(exchange_with, nursery, peer)
            task_status.started()
            schedule.asked(trio.current_time())
            while True:
                connector.dial_due(nursery)
                connected = host.connected_peers()
                now = trio.current_time()
                if connected and connector.missing() > 0 and schedule.due(now):
                    schedule.asked(now)
                    nursery.start_soon(partial(exchange_with, nursery, rng.choice(connected), periodic=True))
                await sleep_to_tick(config.check_interval)
    finally:
        host.remove_stream_handler(PEERS_PROTOCOL)


# -- mDNS ---------------------------------------------------------------------------


async def run_mdns(host: P2PHost, *,
                   task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Announce ``host`` on the local network and connect every peer that answers.

    Never fails: without multicast (containers, some Wi-Fi) it logs and returns. zeroconf
    runs its own threads; discovered peers cross into trio through a channel.
    """
    token = trio.lowlevel.current_trio_token()
    found_send, found_recv = trio.open_memory_channel[list[str]](64)

    def on_found(info: PeerInfo) -> None:  # called on a zeroconf thread
        # The handler registry is process-wide: we also hear other hosts' finds, ourselves
        # included.
        if str(info.peer_id) == host.peer_id:
            return
        addrs = [f"{addr}/p2p/{info.peer_id}" for addr in info.addrs]
        # Shutting down, or a flood of announcements: mDNS repeats them, drop this one.
        with contextlib.suppress(trio.RunFinishedError, trio.WouldBlock,
                                 trio.BrokenResourceError, trio.ClosedResourceError):
            trio.from_thread.run_sync(found_send.send_nowait, addrs, trio_token=token)

    port = int(host.multiaddrs()[0].split("/tcp/")[1].split("/")[0])
    # Registered first: zeroconf starts browsing (and finding peers) while it announces.
    peerDiscovery.register_peer_discovered_handler(on_found)
    try:
        mdns = await trio.to_thread.run_sync(_start_mdns, host, port)
    except Exception as exc:  # zeroconf/socket errors of every kind
        peerDiscovery.unregister_peer_discovered_handler(on_found)
        logger.warning("mDNS discovery unavailable, continuing without it: %r", exc)
        task_status.started()
        return
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
    """Create and announce the mDNS service; blocking (zeroconf), so run in a thread.

    ``MDNSDiscovery.start`` is not used: it registers on the calling thread (blocking the
    trio loop while zeroconf probes) and spawns a trio system task, which a worker thread
    cannot. What we skip is its 60 s sweep of stale entries; the peerstore TTL covers it.
    """
    mdns = create_mdns_discovery(host.libp2p_host.get_network(), port=port,
                                 host=host.libp2p_host)
    mdns.broadcaster.register()
    return mdns
