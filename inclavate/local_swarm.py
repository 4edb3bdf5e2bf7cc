"""Peers as child processes on this machine: the local swarm, its tests and benchmarks.

Each peer is ``python -m inclavate peer`` with its own data directory and log file, talking
to the others over libp2p on 127.0.0.1 exactly as peers on different machines would. Leaving
the context terminates every child (SIGTERM, then SIGKILL), so nothing outlives its owner.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from inclavate.errors import InclavateError
from inclavate.http_client import request_json
from inclavate.types import LayerRange
from node import COLOCATED_ENV
from node.engine import default_threads

T = TypeVar("T")

RUN_MARKER = "--- run started"
"""Written to a peer's log before each start: its log is appended to, and a tail shown when it
fails must not mix in earlier runs' lines (a killed peer showed the last run's polite stop)."""


class SwarmError(InclavateError):
    """A child peer exited, or did not become ready in time."""


@dataclass(frozen=True)
class CoreSplit:
    """How peers started together on one machine (``inclavate swarm``) share its cores."""

    threads: int
    """Engine threads while a peer holds one session: every core. One stream through a
    chain computes at one stage at a time (its decode steps: ``step``)."""
    shared: int
    """Engine threads while it holds more (``--shared-threads``): the cores split evenly
    between the peers, at least one. Several sessions' steps run at every stage at once."""
    step: int
    """Engine threads for a one-token decode step (``--step-threads``): every core but one
    for each other peer, at least one. A step at several threads meets its partners at ~300
    barriers, and the other peers' hand-offs (the Python around each hop) land on the same
    cores: on the 2-core VM 3 peers decoded one stream 9-24% faster with one thread a step
    than with two (2026-12-07, ``scripts/bench_swarm``'s paired ratio 1.087-1.17 in four
    runs), 2 peers within the noise, while a prompt's chunks gain 1.5-1.6x from every core."""


def split_cores(peers: int, cores: int | None = None) -> CoreSplit:
    """The split ``inclavate swarm`` gives its ``peers`` (``cores``: what a lone peer would
    use here, the cores this process may run on).

    Either way the peers' threads computing at once have about a core each (a long
    prompt's chunks overlap across stages only a little; where the peers outnumber the
    cores they get one thread each, with no barrier to wait at), so they may spin a while
    at a barrier like a lone peer's: telling them to sleep at once instead ran a 2-thread
    peer at 0.36x (docs/ARCHITECTURE.md, "Thread wait policy")."""
    cores = cores or default_threads()
    peers = max(1, peers)
    return CoreSplit(cores, max(1, cores // peers), max(1, cores - (peers - 1)))


_handed_out: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on now, for a child to bind a moment later.

    Chosen below the kernel's ephemeral range: a port the kernel handed out for ``bind(0)``
    (what this used to do) can be handed out again to the next ``bind(0)`` before the child
    binds it, and a benchmark's peer once found its API port taken by another peer's libp2p
    listener. Listeners bound to port 0 never land below that range, and this process
    never hands a port out twice.
    """
    low, _ = _ephemeral_range()
    lowest = max(1024, low - 16384)
    for _ in range(200):
        port = random.randrange(lowest, low) if low - lowest >= 1024 else 0
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            port = int(s.getsockname()[1])
        _handed_out.add(port)
        return port
    raise OSError(f"no free port on {host} below {low}")


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 49152, 65535  # IANA's dynamic range: what BSDs and macOS use


def _die_with_parent() -> None:
    """Linux: the child gets SIGTERM if its parent dies, so no peer is ever orphaned."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


@dataclass
class PeerProcess:
    name: str
    api_port: int
    process: subprocess.Popen[bytes]
    log_path: Path
    data_dir: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    def get(self, path: str, timeout: float = 10.0, headers: dict[str, str] | None = None) -> Any:
        status, body = request_json("GET", self.url + path, timeout=timeout, headers=headers)
        if status >= 400:
            raise SwarmError(f"GET {path} on {self.name}: {status} {body}")
        return body

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` of this run's log: the file is appended to across runs (a crash's
        story stays), so the tail starts at this run's :data:`RUN_MARKER` line."""
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        starts = [i for i, line in enumerate(text) if line.startswith(RUN_MARKER)]
        return "\n".join(text[starts[-1] if starts else 0:][-lines:])


@dataclass
class LocalSwarm:
    workdir: Path
    """Data directories and logs of the children."""
    peer_args: Sequence[str] = ()
    """Arguments every child gets."""
    env: dict[str, str] = field(default_factory=dict)
    colocated: bool = True
    """Tell children their engine threads may outnumber the cores (they sleep at once at a
    barrier rather than spin a while); False when each thread computing has a core of its
    own (a benchmark of one lone peer, ``inclavate swarm``: :func:`split_cores`)."""
    peers: list[PeerProcess] = field(default_factory=list)

    def __enter__(self) -> LocalSwarm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()

    def start(self, name: str, model: str, *args: str, bootstrap: PeerProcess | None = None,
              api_port: int | None = None, env: dict[str, str] | None = None) -> PeerProcess:  # fmt: skip
        port = api_port or free_port()
        data_dir = self.workdir / name
        log_path = self.workdir / f"{name}.log"
        self.workdir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "inclavate", "peer", "--model", model, "--api-port", str(port),
               "--data-dir", str(data_dir), *self.peer_args, *args]  # fmt: skip
        if bootstrap is not None:
            cmd += ["--bootstrap", self.multiaddr(bootstrap)]
        child_env = {**os.environ, "PYTHONUNBUFFERED": "1", COLOCATED_ENV: "1" if self.colocated else "0",
                     **self.env, **(env or {})}  # fmt: skip
        with open(log_path, "ab") as log:
            log.write(f"{RUN_MARKER} {time.strftime('%Y-%m-%d %H:%M:%S')} ---\n".encode())
            log.flush()
            # A session of its own: a terminal's Ctrl-C reaches whoever started the swarm, which
            # asks each peer once (``stop_all``). In the terminal's process group each peer had
            # the Ctrl-C, then stop_all's SIGTERM as a second signal: "leave now", no drain
            # (an audit from outside, 2026-12-08).
            process = subprocess.Popen(cmd, env=child_env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent,
                                       start_new_session=True)  # fmt: skip
        peer = PeerProcess(name, port, process, log_path, data_dir)
        self.peers.append(peer)
        return peer

    def wait(self, probe: Callable[[], T], timeout: float, what: str, peer: PeerProcess | None = None) -> T:
        """Poll ``probe`` until it returns something truthy; fail fast if ``peer`` died."""
        deadline = time.monotonic() + timeout
        last: object = None
        while time.monotonic() < deadline:
            if peer is not None and not peer.alive():
                raise SwarmError(f"{peer.name} exited ({peer.process.returncode}) while waiting for {what}:\n{peer.log_tail()}")
            try:
                result = probe()
                if result:
                    return result
                last = result
            except (OSError, ValueError, KeyError, TypeError, SwarmError) as exc:
                last = exc
            time.sleep(0.2)
        raise SwarmError(f"timed out after {timeout:g} s waiting for {what} (last: {last!r})")

    def multiaddr(self, peer: PeerProcess, timeout: float = 60.0) -> str:
        health = self.wait(lambda: peer.get("/health"), timeout, f"{peer.name} to answer /health", peer)
        return str(health["multiaddrs"][0])

    def wait_ready(self, peer: PeerProcess, timeout: float = 120.0) -> dict[str, Any]:
        """Until the peer has loaded its layers (its /health names them)."""
        def ready() -> dict[str, Any] | None:
            health = peer.get("/health")
            return health if health.get("layers") else None

        return self.wait(ready, timeout, f"{peer.name} to load its layers", peer)

    def start_chain(self, model: str, ranges: Sequence[LayerRange], *args: str, prefix: str = "",
                    ready_timeout: float = 120.0) -> list[PeerProcess]:  # fmt: skip
        """A chain of peers holding ``ranges`` (``args`` each), the entry first and the rest
        bootstrapped to it, once every peer is Ready and the entry sees the chain complete."""
        chain = [self.start(f"{prefix}chain-1", model, "--layers", str(ranges[0]), *args)]
        chain += [self.start(f"{prefix}chain-{i + 1}", model, "--layers", str(r), *args, bootstrap=chain[0])
                  for i, r in enumerate(ranges[1:], start=1)]  # fmt: skip
        for peer in chain:
            self.wait_ready(peer, timeout=ready_timeout)
        self.wait(lambda: chain[0].get("/api/models")[0]["chain_complete"], 30, "a complete chain")
        return chain

    def signal(self, peer: PeerProcess, sig: int) -> None:
        if peer.alive():
            peer.process.send_signal(sig)

    def stop(self, peer: PeerProcess, timeout: float = 10.0) -> int:
        self.signal(peer, signal.SIGTERM)
        try:
            return peer.process.wait(timeout)
        except subprocess.TimeoutExpired:
            peer.process.kill()
            peer.process.wait(5)
            raise SwarmError(f"{peer.name} did not exit within {timeout:g} s of SIGTERM") from None

    def stop_all(self, timeout: float = 8.0) -> None:
        for peer in self.peers:
            self.signal(peer, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for peer in self.peers:
            try:
                peer.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                peer.process.kill()
                peer.process.wait(5)
