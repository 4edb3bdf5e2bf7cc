"""``inclavate status``: the swarm in the terminal, once or refreshed with ``--watch``."""

from __future__ import annotations

import argparse
import math
import sys
import time

from inclavate.errors import ConfigError
from inclavate.peer_api import DEFAULT_API, PeerApi, PeerRefused, PeerUnreachable, malformed
from inclavate.swarm_view import render_status, shapes_of

CLEAR = "\x1b[H\x1b[2J"
MIN_INTERVAL_S = 0.1
"""``--interval 1e-300`` polled the peer as fast as it could; ``nan`` and ``inf`` were a
traceback from ``time.sleep`` after the first screen (an audit from outside, 2026-12-08)."""


def add_status_command(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "status",
        help="show the swarm: models, coverage per layer, peers with state, range and tok/s",
        description="Ask any peer's API for the registry and show it: per model the replicas of "
        "every layer (gaps marked !), and every node with its state, range and throughput.",
    )
    parser.add_argument("--api", default=DEFAULT_API, help=f"any peer's API address (default {DEFAULT_API})")
    parser.add_argument("--watch", action="store_true", help="refresh until Ctrl-C")
    parser.add_argument("--interval", type=float, default=2.0, metavar="SECONDS",
                        help=f"refresh period with --watch (default 2, at least {MIN_INTERVAL_S:g})")  # fmt: skip
    parser.set_defaults(handler=_status)


def snapshot(api: PeerApi, *, color: bool) -> str:
    """The screen, or :class:`PeerRefused` when ``/nodes`` is no list of objects (a dict, a
    number, a list of strings: a traceback before); a stray row that is not an object is
    left out by :func:`render_status`."""
    nodes = api.get("/nodes")
    if not isinstance(nodes, list) or (nodes and not any(isinstance(node, dict) for node in nodes)):
        raise malformed(f"{api.base}/nodes", "an Inclavate node list")
    try:
        shapes = shapes_of(api.get("/api/models"))
    except PeerRefused:  # drawn from the records alone, as before the models' shapes were asked
        shapes = {}
    return render_status(nodes, api.base, color=color, shapes=shapes)


def _status(args: argparse.Namespace) -> int:
    if not (math.isfinite(args.interval) and args.interval >= MIN_INTERVAL_S):
        raise ConfigError(f"--interval must be a number of seconds, at least {MIN_INTERVAL_S:g}")
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
