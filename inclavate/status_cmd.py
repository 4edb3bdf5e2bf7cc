"""``inclavate status``: the swarm in the terminal, once or refreshed with ``--watch``."""

from __future__ import annotations

import argparse
import sys
import time

from inclavate.errors import ConfigError
from inclavate.peer_api import DEFAULT_API, PeerApi, PeerRefused, PeerUnreachable
from inclavate.swarm_view import render_status, shapes_of

CLEAR = "\x1b[H\x1b[2J"


def add_status_command(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "status",
        help="show the swarm: models, coverage per layer, peers with state, range and tok/s",
        description="Ask any peer's API for the registry and show it: per model the replicas of "
        "every layer (gaps marked !), and every node with its state, range and throughput.",
    )
    parser.add_argument("--api", default=DEFAULT_API, help=f"any peer's API address (default {DEFAULT_API})")
    parser.add_argument("--watch", action="store_true", help="refresh until Ctrl-C")
    parser.add_argument("--interval", type=float, default=2.0, metavar="SECONDS", help="refresh period with --watch (default 2)")
    parser.set_defaults(handler=_status)


def snapshot(api: PeerApi, *, color: bool) -> str:
    nodes = api.get("/nodes")
    try:
        shapes = shapes_of(api.get("/api/models"))
    except PeerRefused:  # drawn from the records alone, as before the models' shapes were asked
        shapes = {}
    return render_status(nodes, api.base, color=color, shapes=shapes)


def _status(args: argparse.Namespace) -> int:
    if args.interval <= 0:
        raise ConfigError("--interval must be a positive number of seconds")
    api = PeerApi(args.api)
    color = sys.stdout.isatty()
    if not args.watch:
        print(snapshot(api, color=color))
        return 0
    try:
        while True:
            try:
                screen = snapshot(api, color=color)
            except (PeerUnreachable, PeerRefused) as exc:
                # A peer restarting is what --watch is for: say so and keep trying.
                screen = f"error: {exc}\n(retrying every {args.interval:g} s; Ctrl-C to stop)"
            print((CLEAR if color else "") + screen + f"\n\nrefreshed {time.strftime('%H:%M:%S')}", flush=True)
            time.sleep(args.interval)
    except KeyboardInterrupt:
        print()
        return 0
