"""Connections held by source, oldest first, under a bound: which one goes past it.

Shared by the HTTP API (``api/connection_table.py``: a quarter of the descriptors) and the
libp2p listener (``p2p/connection_guard.py``). A newcomer is always taken; past the bound
the source holding the most connections (the newcomer's own on a tie) loses its oldest idle
one, else its oldest: a flood from one address cannot lock out another address's
connections, and a source's own surplus only rotates its own.
"""

from __future__ import annotations

import ipaddress
import itertools
from collections.abc import Callable
from typing import Protocol


def source_of(host: str | None) -> str:
    """Whom a connection counts against: its IPv4 address, or its IPv6 /64 (one
    subscriber's usual allocation: addresses inside it are free to its holder)."""
    try:
        address = ipaddress.ip_address(host or "")
    except ValueError:
        return host or "?"
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is None:
        return str(ipaddress.ip_network(f"{address}/64", strict=False))
    return str(address.ipv4_mapped or address) if isinstance(address, ipaddress.IPv6Address) else str(address)


class Held(Protocol):
    """A connection as the table sees it."""

    idle: bool
    """No request under way (none yet, or between keep-alive requests)."""

    def evict(self) -> None:
        """End the connection (soon; the table has already forgotten it)."""


class ConnectionTable:
    """The live connections by source, oldest first; bounded by ``limit()``."""

    def __init__(self, limit: Callable[[], int]) -> None:
        self._limit = limit
        self._by_source: dict[str, dict[int, Held]] = {}
        self._where: dict[int, str] = {}
        self._order = itertools.count()
        self.evicted = 0
        """Connections ended to make room (a counter for tests and metrics)."""

    def __len__(self) -> int:
        return len(self._where)

    def admit(self, source: str, held: Held) -> int:
        """Take ``held`` (always) and make room for it; returns its key for :meth:`release`."""
        key = next(self._order)
        self._by_source.setdefault(source, {})[key] = held
        self._where[key] = source
        while len(self._where) > max(1, self._limit()):
            self._evict_one(prefer=source)
        return key

    def release(self, key: int) -> None:
        """Forget a connection that ended (idempotent: an evicted one is forgotten already)."""
        source = self._where.pop(key, None)
        if source is None:
            return
        held = self._by_source[source]
        del held[key]
        if not held:
            del self._by_source[source]

    def _evict_one(self, prefer: str) -> None:
        source = max(self._by_source, key=lambda s: (len(self._by_source[s]), s == prefer))
        held = self._by_source[source]
        key = next((k for k, h in held.items() if h.idle), next(iter(held)))
        victim = held[key]
        self.release(key)
        self.evicted += 1
        victim.evict()
