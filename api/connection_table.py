"""How many HTTP connections the peer holds open at once, and which one goes past that.

Every connection costs the peer a file descriptor and a task, and descriptors are one
budget of the whole process (``RLIMIT_NOFILE``): libp2p's dials and accepts, direct links,
SQLite stores and model files take from it too. Nothing counted connections before: 1,100
idle connections to the API of a peer limited to 1,024 descriptors took every one of them
for 30 s at a time (hypercorn's keep-alive), the API answered nobody, and a peer that
bootstrapped through it then found nobody answering its dial.

The API holds at most :func:`capacity` connections, a quarter of the descriptors (the rest
is the peer's own). A newcomer is always taken; past the bound the source holding the most
connections (the newcomer's own on a tie) loses its oldest idle one, else its oldest: a
flood from one address cannot lock out another address's clients, and a client's own
surplus only rotates its own connections (a newcomer whose source holds the most, all of
them busy, is the one closed: it is the only idle one).
"""

from __future__ import annotations

import ipaddress
import itertools
from collections.abc import Callable
from typing import Protocol

try:
    import resource
except ImportError:  # Windows: no descriptor limit to read
    resource = None  # type: ignore[assignment]

MAX_CONNECTIONS = 4096
"""At most this many, whatever the descriptors allow: each costs a task and its buffers."""

MIN_CONNECTIONS = 16
"""At least this many, however few descriptors there are: an API must serve someone."""

SHARE_OF_DESCRIPTORS = 4
"""The API may hold one descriptor in this many."""

UNKNOWN_LIMIT_CONNECTIONS = 512
"""Where the process has no descriptor limit to read (Windows)."""


def capacity() -> int:
    """Connections the API may hold now, from the process's soft descriptor limit (read at
    each newcomer: ``prlimit`` may change it while the peer runs)."""
    if resource is None:
        return UNKNOWN_LIMIT_CONNECTIONS
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS
    return max(MIN_CONNECTIONS, min(MAX_CONNECTIONS, soft // SHARE_OF_DESCRIPTORS))


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

    def __init__(self, limit: Callable[[], int] = capacity) -> None:
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
