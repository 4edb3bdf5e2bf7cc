"""How many new inbound libp2p connections a peer takes into the handshake, per source and
in all: token buckets, consulted at accept, before any protocol work.

Bounding the handshakes held (``p2p.connection_guard``) bounds descriptors, not CPU: each
connection a stranger opens costs it a connect and a few bytes, and costs the peer
py-libp2p's accept path and a Noise responder step (key generation, Diffie-Hellman,
signing) in Python. A connection past its source's bucket, or past the bucket of all
sources, is closed at once, unread and unanswered.

* **Per source** (IPv4 address, IPv6 /64: ``inclavate.source_table.source_of``): a burst of
  :data:`SOURCE_BURST`, refilled at :data:`SOURCE_PER_S` a second. A new source starts full,
  so an honest dialer's first connections are never refused.
* **In all**: a burst of :data:`TOTAL_BURST`, refilled at :data:`TOTAL_PER_S`, so a stranger
  with many addresses cannot buy unbounded handshake CPU either. A connection refused here
  takes no token from its source. Its share is first come, first served, but each source
  draws at most its own rate from it: a flood's share grows with its addresses, not with
  its connections.

The table of buckets is bounded (:data:`MAX_SOURCES`; a stranger chooses how many sources it
shows): a bucket refilled to full is forgotten (a new source starts full anyway), and past
the bound the least recently used goes first. Forgetting a bucket that was not full lets
that source start again full; only a stranger cycling through more than :data:`MAX_SOURCES`
addresses within a few seconds can do that, and the bucket of all sources still holds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

SOURCE_BURST, SOURCE_PER_S = 16, 4.0
"""An honest peer opens a connection or two to us per join; a machine running a local swarm
(``inclavate swarm``, all on loopback) up to one per other peer at once."""

TOTAL_BURST, TOTAL_PER_S = 64, 32.0
"""A handshake takes the peer a few milliseconds of Python (``scripts/probe_p2p_flood.py``
measures what a flood costs); 32 a second is a swarm of ~2,000 peers each reconnecting once
a minute."""

MAX_SOURCES = 4096
"""Buckets held; past it the least recently used is forgotten."""


@dataclass
class Bucket:
    """Tokens (connections) a source may still open now, as of ``at``."""

    tokens: float
    at: float

    def level(self, now: float, burst: float, per_s: float) -> float:
        """Tokens at ``now``: refilled at ``per_s`` since ``at``, at most ``burst``."""
        return min(burst, self.tokens + max(0.0, now - self.at) * per_s)


class AcceptRate:
    """Whether a new connection from a source enters the handshake (:meth:`take`)."""

    def __init__(self, burst: int = SOURCE_BURST, per_s: float = SOURCE_PER_S,
                 total_burst: int = TOTAL_BURST, total_per_s: float = TOTAL_PER_S,
                 max_sources: int = MAX_SOURCES, clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.burst, self.per_s = float(burst), per_s
        self.total_burst, self.total_per_s = float(total_burst), total_per_s
        self.max_sources = max(1, max_sources)
        self._clock = clock
        self._total = Bucket(self.total_burst, clock())
        self._by_source: dict[str, Bucket] = {}
        """Least recently used first (a source taken is moved to the end)."""
        self.refused_by_source = 0
        self.refused_in_all = 0
        """Connections refused, by which bucket was empty (counters for tests and metrics)."""

    def __len__(self) -> int:
        return len(self._by_source)

    def take(self, source: str) -> bool:
        """Whether a new connection from ``source`` may start its handshake; if so it has
        taken a token from the source's bucket and one from the bucket of all sources."""
        now = self._clock()
        bucket = self._by_source.pop(source, None) or Bucket(self.burst, now)
        self._forget_full(now)
        self._by_source[source] = bucket  # most recently used: last
        self._bound()
        mine = bucket.level(now, self.burst, self.per_s)
        total = self._total.level(now, self.total_burst, self.total_per_s)
        allowed = mine >= 1.0 and total >= 1.0
        if allowed:
            mine, total = mine - 1.0, total - 1.0
        else:
            self.refused_by_source += mine < 1.0
            self.refused_in_all += mine >= 1.0
        bucket.tokens, bucket.at = mine, now
        self._total.tokens, self._total.at = total, now
        return allowed

    def _forget_full(self, now: float) -> None:
        """Drop the least recently used buckets that have refilled (a new one starts full):
        amortized O(1), and the table holds only sources seen in the last few seconds."""
        while self._by_source:
            oldest = next(iter(self._by_source))
            if self._by_source[oldest].level(now, self.burst, self.per_s) < self.burst:
                return
            del self._by_source[oldest]

    def _bound(self) -> None:
        while len(self._by_source) > self.max_sources:
            del self._by_source[next(iter(self._by_source))]
