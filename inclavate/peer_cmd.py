"""``inclavate peer``: run one peer of the swarm until Ctrl-C or SIGTERM."""

from __future__ import annotations

import argparse
import logging
import os
import signal
from collections.abc import Mapping
from pathlib import Path

import trio

from inclavate.config import ADMIN_TOKEN_ENV, inclavate_home
from inclavate.errors import ConfigError, InclavateError
from inclavate.peer import Peer
from inclavate.peer_config import PeerConfig
from inclavate.ports import port_arg
from inclavate.tensors import WIRE_DTYPES
from inclavate.types import LayerRange, ModelId
from node.engine import EngineConfig, default_threads
from node.engines import ENGINE_CHOICES, resolve_engine
from p2p.errors import DialError
from p2p.failover import FailoverPolicy

log = logging.getLogger(__name__)

JOIN_TOKEN_ENV = "INCLAVATE_JOIN_TOKEN"


DEFAULT_DRAIN_S = 30.0
"""How long a stopped peer drains its sessions (``--drain-timeout``'s default)."""

def add_peer_command(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "peer",
        help="join the swarm: hold a range of a model's layers and serve the REST API",
        description="Pull the model if needed, join the swarm (bootstrap addresses, mDNS), hold a "
        "range of its layers (chosen from the registry unless --layers is given) and serve the "
        "REST API. Ctrl-C or SIGTERM leaves politely: the peer stops taking new sessions, lets "
        "entry peers move its sessions to other holders (up to --drain-timeout), then leaves; a "
        "second Ctrl-C leaves at once.",
    )
    p.add_argument("--model", required=True, help="model id, e.g. smollm2:135m")
    p.add_argument("--layers", type=_layers, help="layers to hold, A-B, 0-based, end exclusive (e.g. 0-10)")
    p.add_argument("--max-layers", type=int, help="hold at most this many layers (default: what memory allows)")
    p.add_argument("--memory-mb", type=int, help="memory budget for weights and KV cache (default: half of what is free)")
    p.add_argument("--api-host", default="127.0.0.1", help="REST API bind address (default 127.0.0.1)")
    p.add_argument("--api-port", type=port_arg(), default=8001, help="REST API port (default 8001)")
    p.add_argument("--p2p-host", default="0.0.0.0", help="libp2p listen address (default 0.0.0.0)")
    p.add_argument("--p2p-port", type=port_arg(), default=0,
                   help="libp2p port (default: the port of this data dir's last run where free, else any)")
    p.add_argument("--bootstrap", action="append", default=[], metavar="MULTIADDR", type=_bootstrap,
                   help="a peer to join through (its /health lists its multiaddrs); repeatable")  # fmt: skip
    p.add_argument("--data-dir", type=Path, help="identity and state (default $INCLAVATE_HOME/peer-<api port>)")
    p.add_argument("--admin-token", help="enables admin routes with this X-Admin-Token (default: admin off); "
                   f"visible to every local user in `ps`: prefer ${ADMIN_TOKEN_ENV} or --admin-token-file")  # fmt: skip
    p.add_argument("--admin-token-file", type=Path, metavar="PATH",
                   help="read the admin token from this file (first line)")  # fmt: skip
    p.add_argument("--admin-peer", action="append", default=[], metavar="PEER_ID",
                   help="trust admin commands signed by this peer; repeatable")  # fmt: skip
    p.add_argument("--join-token", metavar="TOKEN",
                   help="legacy nodes must present this token to register (X-Inclavate-Join-Token); with --legacy, "
                   f"the token to present. Also ${JOIN_TOKEN_ENV}, which keeps it out of `ps`")  # fmt: skip
    p.add_argument("--allow-host", action="append", default=[], metavar="HOST",
                   help="with the API on loopback, also accept requests whose Host header names HOST "
                   "(a name or name:port; repeatable). Others are refused against DNS rebinding")  # fmt: skip
    p.add_argument("--no-mdns", action="store_true", help="do not discover peers on the LAN")
    p.add_argument("--engine", choices=ENGINE_CHOICES, default="auto",
                   help="what runs the layers: mlx (Apple Silicon), llamacpp, or auto (default: "
                   "mlx on macOS arm64, llamacpp elsewhere)")  # fmt: skip
    p.add_argument("--no-generators", action="store_true",
                   help="offer no media generators, even for speech models pulled with `pull --speech`")
    p.add_argument("--threads", type=int, default=default_threads(), help="llama.cpp threads (default: all cores)")
    p.add_argument("--shared-threads", type=int, metavar="N",
                   help="llama.cpp threads while this peer holds more than one session (default: "
                   "--threads). For peers sharing one machine's cores: their share here, all cores in "
                   "--threads, since a lone stream computes at one stage at a time (inclavate swarm does this)")  # fmt: skip
    p.add_argument("--exact-steps", action="store_true",
                   help="run one-token steps past position 256 on one thread, so that greedy (or seeded) text "
                        "does not change with --threads, with who else is served or after a failover. At more "
                        "threads llama.cpp's split-KV attention sums those steps in another order; one thread "
                        "costs a lone stream ~1.5x a step there at 2 threads (scripts/bench_exact_steps.py)")  # fmt: skip
    p.add_argument("--step-threads", type=int, metavar="N",
                   help="llama.cpp threads for a one-token decode step, at most --threads (default: --threads; "
                        "prompts and batches keep --threads, like llama.cpp's -t beside -tb). For peers sharing "
                        "a machine's cores: inclavate swarm gives theirs the cores the other peers leave")  # fmt: skip
    p.add_argument("--context", type=int, default=2048, help="positions per session (default 2048)")
    p.add_argument("--max-sessions", type=int, default=8, help="concurrent sessions (default 8)")
    p.add_argument("--wire-dtype", choices=WIRE_DTYPES, default="f16",
                   help="hidden-state precision on outgoing links (default f16; f32 is bit-exact)")  # fmt: skip
    p.add_argument("--direct-port", type=port_arg(lowest=-1), default=0, metavar="PORT",
                   help="TCP port for direct, sealed links to neighbours (default: any free port; -1: "
                   "forward over libp2p streams only, 5-10x the CPU per hop)")  # fmt: skip
    p.add_argument("--decode-lanes", type=int, default=PeerConfig.decode_lanes, metavar="N",
                   help="most groups of concurrent sessions that go round a chain out of phase, one per stage "
                   "of the route, so that its stages compute at once, each on one group's steps (default 4; "
                   "1: every session's step in one call)")  # fmt: skip
    p.add_argument("--max-failovers", type=int, default=FailoverPolicy.max_failovers,
                   help="times a request may move to a new route when a peer fails (default 3)")  # fmt: skip
    p.add_argument("--min-step-deadline", type=float, default=FailoverPolicy.min_step_s, metavar="SECONDS",
                   help="floor of the adaptive deadline after which a silent chain is failed over (default 5; "
                        "a hung peer then stalls its streams ~7.5 s: the deadline, a ping, the replay)")  # fmt: skip
    p.add_argument("--trial-share", type=float, default=FailoverPolicy.trial_share, metavar="SHARE",
                   help="share of new sessions that may go through peers that never served this entry while a "
                        "route through peers that have exists (default 0.125; 1: the cheapest route always)")  # fmt: skip
    p.add_argument("--failover-replay", choices=("span", "whole"), default="span",
                   help="after a failover, rebuild only the replaced span (default) or replay the whole new route")  # fmt: skip
    p.add_argument("--drain-timeout", type=float, default=DEFAULT_DRAIN_S, metavar="SECONDS",
                   help="on Ctrl-C/SIGTERM, wait at most this long for sessions to move away or finish (default 30)")  # fmt: skip
    p.add_argument("--legacy", action="store_true",
                   help="run without libp2p: register with --orchestrator over HTTP and serve forwards")  # fmt: skip
    p.add_argument("--orchestrator", metavar="URL", help="with --legacy: the peer to register with")
    p.add_argument("--advertise-url", metavar="URL",
                   help="with --legacy: the URL the orchestrator reaches this node at (default http://API_HOST:API_PORT)")  # fmt: skip
    p.set_defaults(handler=run_peer_command, log_timestamps=True)


def _layers(text: str) -> LayerRange:
    try:
        return LayerRange.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _bootstrap(text: str) -> str:
    """A peer's multiaddr, ``/ip4/HOST/tcp/PORT/p2p/PEER_ID`` (what its ``/health`` lists)."""
    from p2p.host import parse_peer_addr  # here, not at the top: every command builds this parser

    try:
        parse_peer_addr(text)  # what the peer will dial, read the same way
    except DialError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a peer's multiaddr, like /ip4/127.0.0.1/tcp/PORT/p2p/PEER_ID "
            "(the peer's /health lists its \"multiaddrs\")") from None
    return text


def admin_token(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> str | None:
    """The admin token from ``--admin-token``, ``--admin-token-file`` or ``$INCLAVATE_ADMIN_TOKEN``
    (in that order). Only the first shows in the process list; the others keep it out of argv."""
    if args.admin_token:
        return str(args.admin_token)
    if args.admin_token_file is not None:
        try:
            lines = args.admin_token_file.read_text().splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read --admin-token-file: {exc}") from exc
        token = lines[0].strip() if lines else ""
        if not token:
            raise ConfigError(f"--admin-token-file {args.admin_token_file} is empty")
        return token
    return environ.get(ADMIN_TOKEN_ENV) or None


def config_from_args(args: argparse.Namespace) -> PeerConfig:
    home = inclavate_home()
    if args.step_threads is not None and not 1 <= args.step_threads <= args.threads:
        raise ConfigError(f"--step-threads must be between 1 and --threads ({args.threads})")
    try:
        engine = EngineConfig(n_threads=args.threads, n_threads_shared=args.shared_threads, context_length=args.context,
                              max_sessions=args.max_sessions, exact_steps=args.exact_steps,
                              step_threads=args.step_threads)  # fmt: skip
        failover = FailoverPolicy(max_failovers=args.max_failovers, min_step_s=args.min_step_deadline,
                                  span_replay=args.failover_replay == "span", trial_share=args.trial_share)  # fmt: skip
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    return PeerConfig(
        model_id=ModelId(args.model),
        home=home,
        data_dir=args.data_dir or home / f"peer-{args.api_port}",
        layers=args.layers,
        max_layers=args.max_layers,
        memory_mb=args.memory_mb,
        api_host=args.api_host,
        api_port=args.api_port,
        p2p_host=args.p2p_host,
        p2p_port=args.p2p_port,
        bootstrap=tuple(args.bootstrap),
        mdns=not args.no_mdns,
        admin_token=admin_token(args),
        admin_peers=tuple(args.admin_peer),
        engine=engine,
        engine_kind=resolve_engine(args.engine),
        wire_dtype=args.wire_dtype,
        direct_port=None if args.direct_port < 0 else args.direct_port,
        generators=not args.no_generators,
        join_token=args.join_token or os.environ.get(JOIN_TOKEN_ENV) or None,
        allowed_hosts=tuple(args.allow_host),
        failover=failover,
        drain_s=args.drain_timeout,
        decode_lanes=args.decode_lanes,
    )


OPEN_FILES_CEILING = 65536
"""The soft descriptor limit a peer raises itself to, at most (its hard limit may be lower)."""


def raise_open_files_limit(ceiling: int = OPEN_FILES_CEILING) -> int:
    """Raise the soft ``RLIMIT_NOFILE`` towards the hard one; returns the soft limit now.

    Desktops often start processes at 1,024 descriptors with a far higher hard limit, and a
    peer's descriptors are shared by libp2p, direct links, stores, model files and the HTTP
    API (which takes at most a quarter: ``api.connection_table``). Raising is what the hard
    limit is for; the ceiling keeps the API's share, and its tasks, reasonable."""
    try:
        import resource
    except ImportError:  # Windows: no such limit
        return -1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = ceiling if hard == resource.RLIM_INFINITY else min(hard, ceiling)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError):  # a sandbox may refuse: the limit stays what it was
            log.info("could not raise the open-files limit from %d", soft)
    return soft


def run_peer_command(args: argparse.Namespace) -> int:
    if logging.getLogger().level > logging.INFO:
        logging.getLogger().setLevel(logging.INFO)  # a long-running service narrates its life
    config = config_from_args(args)
    raise_open_files_limit()
    try:
        if args.legacy:
            if not args.orchestrator:
                raise ConfigError("--legacy needs --orchestrator URL (a peer's API address)")
            from inclavate.legacy_node import run_legacy_until_signal

            trio.run(run_legacy_until_signal, config, args.orchestrator, args.advertise_url)
        else:
            trio.run(run_until_signal, config)
    except BaseExceptionGroup as group:
        # trio wraps even a lone error in a group; a user's mistake (a busy port, an
        # unknown model) should read as one line, not a traceback.
        leaves = _leaves(group)
        if len(leaves) == 1 and isinstance(leaves[0], InclavateError):
            raise leaves[0] from None
        raise
    return 0


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return out


async def run_until_signal(config: PeerConfig) -> None:
    """Run the peer; the first SIGINT/SIGTERM starts the polite stop, a second one exits at
    once (after a bounded announcement that this peer is gone)."""
    peer = Peer(config)
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:

            async def leave() -> None:
                await peer.shutdown()
                nursery.cancel_scope.cancel()

            async def on_signal() -> None:
                stopping = False
                async for signum in signals:
                    name = signal.Signals(signum).name
                    if stopping:
                        log.warning("%s received again: leaving now", name)
                        await peer.leave_now()
                        nursery.cancel_scope.cancel()
                        return
                    stopping = True
                    log.info("%s received: stopping", name)
                    nursery.start_soon(leave)

            nursery.start_soon(on_signal)
            await peer.run()
            nursery.cancel_scope.cancel()
