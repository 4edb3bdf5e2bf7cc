"""``inclavate swarm``: a whole swarm on this machine, one process per peer, until Ctrl-C.

The quickest way to see Inclavate work: N peers split the model's layers evenly, find each
other through the first one, and every one of them serves the full REST API. With
``--replicas`` each range has that many holders and the swarm goes on when peers exit: a
``kill -9`` shows failover, and killing every holder of a range shows healing (a peer of a
range held twice moves there).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from inclavate.catalog import Catalog
from inclavate.config import ADMIN_TOKEN_ENV, inclavate_home
from inclavate.errors import ConfigError
from inclavate.generate_cmd import split_evenly
from inclavate.local_swarm import LocalSwarm, PeerProcess, SwarmError, split_cores
from inclavate.peer_cmd import DEFAULT_DRAIN_S
from inclavate.ports import MAX_PORT, port_arg, port_in_use
from inclavate.progress import Progress
from inclavate.store import ModelStore
from inclavate.tensors import WIRE_DTYPES
from p2p.identity import load_or_create_identity

log = logging.getLogger(__name__)


def add_swarm_command(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "swarm",
        help="run a local swarm: several peers on this machine, each holding part of the model",
        description="Start PEERS x REPLICAS peers as separate processes on 127.0.0.1: the model's "
        "layers in PEERS equal ranges, each held by REPLICAS peers, connected over libp2p. Every "
        "peer serves the REST API "
        "(ports API_PORT, API_PORT+1, ...). Runs until Ctrl-C; with one replica, until a peer exits "
        "too (nothing can take its layers over).",
    )
    p.add_argument("--model", default="smollm2:135m", help="model id (default smollm2:135m)")
    p.add_argument("--peers", type=int, default=3, help="number of layer ranges, each held by its own peer(s) (default 3)")
    p.add_argument("--replicas", type=int, default=1, choices=range(1, 5), metavar="{1..4}",
                   help="peers holding each range (default 1); with 2 or more the swarm outlives its "
                        "peers: kill one (the pids are printed) and its streams carry on through the "
                        "others; kill every holder of a range and a spare moves there")  # fmt: skip
    p.add_argument("--api-port", type=port_arg(lowest=1), default=8001, help="API port of the first peer (default 8001)")
    p.add_argument("--wire-dtype", choices=WIRE_DTYPES, default="f32",
                   help="hidden-state precision between the local peers (default f32: loopback has "
                        "bandwidth to spare, and f32 reproduces the whole model exactly)")  # fmt: skip
    p.add_argument("--admin-token", help="enable admin routes on every peer with this token")
    p.add_argument("--exact-steps", action="store_true",
                   help="every peer runs one-token steps past position 256 on one thread, so that greedy "
                        "text does not change with concurrency or after a failover (slower: see `peer --help`)")  # fmt: skip
    p.add_argument("--step-threads", type=int, metavar="N",
                   help="every peer's threads for a one-token decode step (default: the cores less one for "
                        "each other peer, at least 1; see `peer --help`). scripts/bench_swarm measures the "
                        "default against the other choice")  # fmt: skip
    p.set_defaults(handler=_swarm)


def _swarm(args: argparse.Namespace) -> int:
    home = inclavate_home()
    spec = Catalog.load(home).get(args.model)
    # Before anything is printed or computed from it: before, --peers 0 printed "starting 0
    # peers", then blamed --ranges (a flag of `generate`), and --peers 1000000 a negative --api-port.
    if not 1 <= args.peers <= spec.n_layers:
        raise ConfigError(f"--peers must be between 1 and {spec.n_layers} (the layers of {spec.model_id})")
    count = args.peers * args.replicas
    if args.api_port + count - 1 > MAX_PORT:
        raise ConfigError(f"{count} peers need API ports {args.api_port}..{args.api_port + count - 1}: "
                          f"choose an --api-port of at most {MAX_PORT - count + 1}")  # fmt: skip
    cores = split_cores(count).threads
    if args.step_threads is not None and not 1 <= args.step_threads <= cores:
        raise ConfigError(f"--step-threads must be between 1 and the {cores} cores each peer gets")
    ModelStore(home).pull(spec, Progress(sys.stderr))  # once, before the peers race for it
    # The children read the token from their environment: on their command line every local
    # user could read it in `ps`.
    env = {ADMIN_TOKEN_ENV: args.admin_token} if args.admin_token else {}
    workdir = swarm_workdir(home, args.api_port)
    print(f"starting {count} peers for {spec.model_id} (logs in {workdir})", file=sys.stderr)
    with open_swarm(workdir, count, args.wire_dtype, env, exact_steps=args.exact_steps,
                    step_threads=args.step_threads) as swarm:  # fmt: skip
        try:
            peers = start_peers(swarm, spec.model_id, spec.n_layers, args.peers, args.api_port,
                                report=lambda line: print(line, file=sys.stderr), replicas=args.replicas)  # fmt: skip
        except SwarmError as exc:
            raise ConfigError(f"the local swarm did not start: {exc}") from exc
        _print_usage(peers[0].url, spec.model_id)
        return _serve_until_interrupted(swarm, stop_on_exit=args.replicas == 1)


def swarm_workdir(home: Path, api_port: int) -> Path:
    """The peers' data dirs and logs, one per first API port: two swarms of one
    ``$INCLAVATE_HOME`` on other ports each run (before, both used ``swarm/``, and the second
    failed on the first's data-dir locks with 40 lines of old logs and advice to pass a
    ``--data-dir`` that swarm does not have). The same port twice is refused by the port check."""
    return home / f"swarm-{api_port}"


def open_swarm(workdir: Path, peers: int, wire_dtype: str, env: dict[str, str], cores: int | None = None,
               *, exact_steps: bool = False, step_threads: int | None = None) -> LocalSwarm:  # fmt: skip
    """The local swarm as this command runs it: a lone stream on every core (its decode steps
    on the cores the other peers leave, or ``step_threads``), several on the cores split
    evenly between ``peers`` (``cores``: this machine's; see
    :func:`~inclavate.local_swarm.split_cores`), threads spinning a while at a barrier."""
    split = split_cores(peers, cores)
    args = [*local_peer_args(split.threads, wire_dtype), "--shared-threads", str(split.shared),
            "--step-threads", str(step_threads or split.step)]  # fmt: skip
    if exact_steps:
        args.append("--exact-steps")
    return LocalSwarm(workdir, args, env, colocated=False)


def local_peer_args(threads: int, wire_dtype: str) -> list[str]:
    """What every peer of a local swarm is started with: loopback only, no LAN discovery."""
    return ["--p2p-host", "127.0.0.1", "--no-mdns", "--threads", str(threads), "--wire-dtype", wire_dtype]


def start_peers(swarm: LocalSwarm, model_id: str, n_layers: int, peers: int, api_port: int | None,
                report: Callable[[str], None] = lambda _: None, replicas: int = 1) -> list[PeerProcess]:  # fmt: skip
    """Start ``replicas`` peers for each of ``peers`` equal shares of the layers (a range's
    holders one after the other), the first one the others' bootstrap (API ports from
    ``api_port`` up; None: free ports), and wait until they cover the model.

    The peers are one operator's, so each trusts the others' admin commands: an admin
    request to any of them reaches a node another one holds."""
    layout = [r for r in split_evenly(n_layers, peers) for _ in range(replicas)]
    names = [f"peer-{i + 1}" for i in range(len(layout))]
    if api_port is not None:
        _refuse_taken_ports(range(api_port, api_port + len(layout)))
    ids = {name: load_or_create_identity(swarm.workdir / name).peer_id for name in names}

    def start(i: int, bootstrap: PeerProcess | None = None) -> PeerProcess:
        trust = [arg for name in names if name != names[i] for arg in ("--admin-peer", ids[name])]
        return swarm.start(names[i], model_id, "--layers", str(layout[i]), *trust, bootstrap=bootstrap,
                           api_port=None if api_port is None else api_port + i)  # fmt: skip

    first = start(0)
    started = [first] + [start(i, first) for i in range(1, len(layout))]
    for peer, layers in zip(started, layout):
        swarm.wait_ready(peer)
        report(f"  {peer.name}: layers {layers} ready, API {peer.url}, pid {peer.process.pid}")
    swarm.wait(lambda: first.get("/api/models")[0]["chain_complete"], 30, "a complete chain")
    return started


def _refuse_taken_ports(ports: range) -> None:
    """Before any peer starts: a peer whose API port is taken exits, but only after the
    readiness probe, asking that port, may have found another swarm's peer there."""
    for port in ports:
        if (exc := port_in_use("127.0.0.1", port)) is not None:
            raise SwarmError(f"API port {port} is taken ({exc.strerror}): is another swarm running? "
                             f"Choose other ports with --api-port")  # fmt: skip


def _print_usage(url: str, model_id: str) -> None:
    print(f"\nInclavate swarm serving {model_id}. OpenAI-compatible API: {url}/v1")
    print(f"Dashboard: {url}/ (every peer serves it)\n")
    print("Try:")
    print(f"  curl {url}/v1/chat/completions -H 'content-type: application/json' \\")
    print(f"    -d '{{\"model\": \"{model_id}\", \"messages\": [{{\"role\": \"user\", \"content\": \"What is the capital of France?\"}}]}}'")
    print(f"\nAny peer answers; see {url}/nodes and {url}/api/models. Ctrl-C stops the swarm.", flush=True)


def _serve_until_interrupted(swarm: LocalSwarm, *, stop_on_exit: bool) -> int:
    """Until Ctrl-C or SIGTERM (0), or until a peer exits if ``stop_on_exit`` (every range
    held once: its layers are gone for good), else until every peer has (1). An exit the
    swarm outlives is reported: its sessions fail over, and a range left without a holder
    is healed by a spare."""
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    reported: set[str] = set()
    try:
        while not stop["now"]:
            for peer in swarm.peers:
                if not peer.alive() and peer.name not in reported:
                    reported.add(peer.name)
                    print(f"{peer.name} exited; its log:\n{peer.log_tail()}", file=sys.stderr)
                    if stop_on_exit:
                        return 1
            if len(reported) == len(swarm.peers):
                return 1
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    _stop_politely(swarm)
    return 0


def _stop_politely(swarm: LocalSwarm) -> None:
    """Each peer told once: it drains its sessions (up to its ``--drain-timeout``) and
    leaves; a second Ctrl-C tells them again, and they leave at once."""
    print("\nstopping the swarm: the peers finish their chats (Ctrl-C again to stop at once)...", file=sys.stderr)
    try:
        swarm.stop_all(timeout=DEFAULT_DRAIN_S + 10)  # the peers drain at their default
    except KeyboardInterrupt:
        print("stopping at once...", file=sys.stderr)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the second signal is sent: a third must not abandon them
        swarm.stop_all()
