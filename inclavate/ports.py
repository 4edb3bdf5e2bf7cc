"""Refusing a port something already listens on, before any work starts."""

from __future__ import annotations

import argparse
import socket
from collections.abc import Callable

MAX_PORT = 65535


def port_arg(*, lowest: int = 0) -> Callable[[str], int]:
    """An argparse ``type`` for a TCP port, ``lowest``..65535: a port out of range is a usage
    error naming the flag, where it was a bind's ``OverflowError`` traceback (or, for
    ``--direct-port``, a peer that quietly ran without its direct links)."""

    def parse(text: str) -> int:
        try:
            port = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
        if not lowest <= port <= MAX_PORT:
            raise argparse.ArgumentTypeError(f"{port} is not a port: use {lowest}..{MAX_PORT}")
        return port

    return parse


def port_in_use(host: str, port: int) -> OSError | None:
    """The error a plain bind gets on ``host:port``, or None if the port is free.

    A plain bind without SO_REUSEPORT fails if anyone listens there, which is the point:
    libp2p binds with SO_REUSEPORT, so a second peer on the same port would silently
    *share* it. (A race with a process binding between this probe and the real listen
    remains; it needs the same mistake twice.)
    """
    if port == 0:
        return None
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # ignore TIME_WAIT
        try:
            probe.bind((host, port))
        except OSError as exc:
            return exc
    return None
