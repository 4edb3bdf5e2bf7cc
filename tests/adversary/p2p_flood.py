"""A stranger's floods of a peer's libp2p port, for the adversarial tests and
``scripts/probe_p2p_flood.py``.

Three kinds, cheapest first: TCP connections that send nothing; connections that start the
negotiation (multistream header, ``/noise``, Noise's first message) and stall; and
connections that finish Noise and yamux, each under a fresh identity (an Ed25519 key costs
microseconds), then sit idle. And the other way round (:func:`listening_identities`):
identities the peer is made to dial, each listening in the attacker's process. All of them open from a chosen source address on 127.0.0.0/8,
so a test can tell the flood's address from an honest one.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field

import trio
from hostile_peer import HostilePeer, honest_record, hostile_peer
from libp2p.crypto.x25519 import create_new_key_pair as create_x25519_key_pair
from libp2p.network.connection.raw_connection import RawConnection
from libp2p.peer.id import ID
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import Yamux
from libp2p.transport.tcp.tcp import TrioTCPStream
from libp2p.transport.upgrader import TransportUpgrader

from p2p.artifact_wire import PROTOCOL as ARTIFACTS_PROTOCOL
from p2p.artifact_wire import encode
from p2p.discovery import PeerAddrs, encode_peers
from p2p.framing import FramedStream
from p2p.host import P2PHost, open_host
from p2p.identity import Identity

_MULTISTREAM = b"\x13/multistream/1.0.0\n"
_NOISE = b"\x07/noise\n"
STALLED_HELLO = _MULTISTREAM + _NOISE + b"\x00\x20" + os.urandom(32)
"""What a stalled connection sends: the multistream header, ``/noise``, and Noise XX's first
message (an ephemeral key); the peer answers with its second and waits for the third."""

FLOODED_PEER_ARGS = ["--threads", "1", "--context", "512", "--max-sessions", "4", "--no-mdns", "--p2p-host", "127.0.0.1"]
"""The peer a probe floods (``scripts/probe_*_flood.py``): one thread, a small context, loopback."""


def descriptors_of(pid: int) -> int:
    """Open descriptors of process ``pid`` (-1 once it is gone)."""
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


def open_quietly(port: int, source: str, n: int, hello: bytes = b"") -> list[socket.socket]:
    """``n`` connections to 127.0.0.1:``port`` from ``source``, each sending ``hello`` (maybe
    nothing) and then nothing more; opened 50 at a time, each batch in the peer's listen
    queue before the next (past the queue the kernel drops a handshake, and its retries back
    off for a minute)."""
    opened: list[socket.socket] = []
    for start in range(0, n, 50):
        batch = [socket.socket() for _ in range(min(50, n - start))]
        opened += batch
        for sock in batch:
            sock.bind((source, 0))
            sock.setblocking(False)
            sock.connect_ex(("127.0.0.1", port))
        poller = select.poll()
        for sock in batch:
            poller.register(sock, select.POLLOUT)
        waiting = {sock.fileno() for sock in batch}
        deadline = time.monotonic() + 30
        while waiting and time.monotonic() < deadline:
            waiting -= {fd for fd, _ in poller.poll(1000)}
        if hello:
            for sock in batch:
                try:
                    sock.send(hello)
                except OSError:
                    pass  # refused or reset: counted as closed by the caller
    return opened


def answered(port: int, source: str, hello: bytes, wait: float = 10.0) -> tuple[bool, socket.socket]:
    """One connection from ``source`` sending ``hello``: whether the peer answered (a byte
    came back) or closed it unanswered (end of stream, reset); raises ``TimeoutError`` when
    it did neither within ``wait`` seconds. Returns the socket too, open (the caller closes it)."""
    sock = socket.socket()
    sock.bind((source, 0))
    sock.settimeout(wait)
    try:
        sock.connect(("127.0.0.1", port))
        sock.sendall(hello)
        got = sock.recv(1)
    except TimeoutError:
        sock.close()
        raise
    except OSError:  # reset before or after our hello
        got = b""
    return bool(got), sock


def closed_by_peer(sock: socket.socket) -> bool:
    """The peer closed (or reset) ``sock``; bytes it sent are read and dropped."""
    try:
        while True:
            chunk = sock.recv(65536, socket.MSG_DONTWAIT)
            if not chunk:
                return True
    except BlockingIOError:
        return False
    except OSError:  # reset, or never connected
        return True


@dataclass
class PacedFlood:
    """What :func:`paced_flood` opened so far."""

    opened: int = 0
    failed: int = 0
    """Connects that did not complete within 0.2 s (the peer's listen queue full) or failed."""


@contextlib.contextmanager
def paced_flood(port: int, sources: list[str], per_s: float, hello: bytes = b"") -> Iterator[PacedFlood]:
    """While the block runs, a thread opens ``per_s`` connections a second to 127.0.0.1:``port``,
    from each of ``sources`` in turn (each at ``per_s / len(sources)``), each sending ``hello``
    and closing at once: whatever the peer lets in fails its handshake on the spot, so the flood
    spends the peer's accept rate, not its tables."""
    counts = PacedFlood()

    def run(stop: threading.Event) -> None:
        started, turn = time.monotonic(), 0
        while not stop.is_set():
            while turn < (time.monotonic() - started) * per_s and not stop.is_set():
                counts.opened += _open_and_close(port, sources[turn % len(sources)], hello)
                counts.failed = turn + 1 - counts.opened
                turn += 1
            time.sleep(0.002)

    with in_background(run):
        yield counts


@contextlib.contextmanager
def in_background(loop: Callable[[threading.Event], None]) -> Iterator[None]:
    """``loop`` in a daemon thread while the block runs; it returns once the event it is
    given is set, which the block's end does before joining it."""
    stop = threading.Event()
    thread = threading.Thread(target=loop, args=(stop,), daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _open_and_close(port: int, source: str, hello: bytes) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.2)
        try:
            sock.bind((source, 0))
            sock.connect(("127.0.0.1", port))
            if hello:
                sock.sendall(hello)
        except OSError:
            return False
    return True


async def open_with_fresh_identity(port: int, target: str, source: str) -> tuple[object, socket.socket]:
    """One connection through Noise and yamux as a new identity; the muxer is never run, so
    the peer's streams get no answer (an idle, unhelpful neighbour). Returns the muxed
    connection and its socket (for :func:`closed_by_peer`; closing it ends the connection)."""
    identity = Identity.generate()
    upgrader = TransportUpgrader(
        {NOISE_PROTOCOL_ID: NoiseTransport(identity.key_pair, noise_privkey=create_x25519_key_pair().private_key)},
        {YAMUX_PROTOCOL_ID: Yamux},
    )
    plain = socket.socket()  # the caller's handle on the one descriptor (no duplicate to leak)
    plain.bind((source, 0))
    sock = trio.socket.from_stdlib_socket(plain)
    await sock.connect(("127.0.0.1", port))
    raw = RawConnection(TrioTCPStream(trio.SocketStream(sock)), True)
    peer = ID.from_base58(target)
    secured = await upgrader.upgrade_security(raw, True, peer)
    muxed = await upgrader.upgrade_connection(secured, peer)
    return muxed, plain


async def fresh_identity_flood(port: int, target: str, source: str, n: int, concurrency: int = 20,
                               timeout: float = 10.0) -> tuple[list[tuple[object, socket.socket]], int]:  # fmt: skip
    """``n`` connections under as many identities, ``concurrency`` at a time; returns the
    ones that got through and how many failed (refused, reset or past ``timeout``)."""
    done: list[tuple[object, socket.socket]] = []
    failed = 0
    limiter = trio.CapacityLimiter(concurrency)

    async def one() -> None:
        nonlocal failed
        async with limiter:
            try:
                with trio.fail_after(timeout):
                    done.append(await open_with_fresh_identity(port, target, source))
            except (OSError, trio.TooSlowError, Exception):  # noqa: BLE001 - any failure counts
                failed += 1

    async with trio.open_nursery() as nursery:
        for _ in range(n):
            nursery.start_soon(one)
    return done, failed


# -- identities a peer is made to dial ------------------------------------------------


@dataclass
class Listeners:
    """Identities listening in the attacker's process, known to a target peer by their
    records and addresses: each swarm-wide listing the target runs dials every one."""

    hosts: list[P2PHost]
    asked: set[str] = field(default_factory=set)
    """The identities the target asked for a listing (at least once)."""
    publisher: HostilePeer | None = None

    async def publish(self) -> None:
        """A fresh record signed by each identity (the target ages records that stop beating)."""
        assert self.publisher is not None
        for host in self.hosts:
            await self.publisher.publish_record(honest_record(host.identity), signer=host.identity)

    def ports(self) -> set[int]:
        """Their listening ports: the target's connections to these are ones it dialled."""
        return {int(host.multiaddrs()[0].split("/tcp/")[1].split("/")[0]) for host in self.hosts}


@asynccontextmanager
async def listening_identities(target: str, k: int, per_introducer: int = 24) -> AsyncIterator[Listeners]:
    """``k`` fresh identities, each a libp2p host on 127.0.0.1 answering an empty artifact
    listing, made known to the peer at multiaddr ``target``: hostile introducers hand it
    their addresses when it asks for peers (``per_introducer`` each: the exchange takes
    32), and one publishes a record signed by each (records are free). The caller then
    starts listings through the target's HTTP API."""
    victim = target.rsplit("/p2p/", 1)[-1]
    async with AsyncExitStack() as stack:
        listeners = Listeners([await stack.enter_async_context(open_host(Identity.generate())) for _ in range(k)])

        def answer_for(host: P2PHost):  # noqa: ANN202
            async def answer(stream: FramedStream, remote: str) -> None:
                await stream.receive(timeout=10.0)
                listeners.asked.add(host.peer_id)
                await stream.send(encode({"ok": True, "keys": [], "truncated": False}), timeout=10.0)

            return answer

        for host in listeners.hosts:
            host.set_stream_handler(ARTIFACTS_PROTOCOL, answer_for(host))
        entries = [PeerAddrs(h.peer_id, tuple(h.multiaddrs())) for h in listeners.hosts]
        introducers = []
        for start in range(0, k, per_introducer):
            reply = encode_peers(entries[start:start + per_introducer])
            introducers.append(await stack.enter_async_context(hostile_peer(target, peers_reply=reply)))
        listeners.publisher = introducers[0]
        assert victim == listeners.publisher.target
        await listeners.publish()
        yield listeners


def sockets_to(pid: int, ports: set[int]) -> int:
    """Established TCP connections of process ``pid`` to any of ``ports`` on 127.0.0.1 (its
    own descriptors, from ``/proc``: the ground truth, whatever either side's libp2p thinks)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    count = 0
    with open(f"/proc/{pid}/net/tcp") as table:
        next(table)
        for row in table:
            fields = row.split()
            remote_port = int(fields[2].split(":")[1], 16)
            if fields[3] == "01" and remote_port in ports and fields[9] in inodes:
                count += 1
    return count
