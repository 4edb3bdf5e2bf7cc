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
  takes no token from its source.
* **Fair in all, under overload**: first come, first served, a stranger flooding from 8 or
  more addresses (at 4 a second each) kept the bucket of all empty, and an honest newcomer
  found it empty almost every time it dialled. Now its last :data:`RESERVE` tokens are for
  *quiet* sources only: a source is quiet while it holds a *quiet token*, of which it has
  :data:`QUIET_BURST`, refilled at :data:`QUIET_PER_S` (one each 16 s) and spent by every
  connection let in, whichever way. A source that is not quiet takes from the bucket of all
  only above the reserve. So under a flood the bucket's refill goes to quiet sources first
  (a neighbour reconnecting, a peer joining: a connection or two a minute) and only the rest
  to the busy ones, max-min fair in two classes: whoever asks for little gets all it asks,
  the flood shares what is left. A source's own bucket could not tell: an address opening 4
  a second keeps it full, and a refusal in all takes nothing from it; the quiet tokens count
  what got in, on a time scale a flood cannot fill.

  What a stranger with N addresses gets from the reserve: each address's first
  :data:`QUIET_BURST` connections, once (up to ``2 N`` at once: 40 addresses empty a full
  reserve of 16 and the next two seconds' refill), then ``N * QUIET_PER_S`` a second;
  the refill of all (32 a second) goes first to quiet sources, so to keep honest newcomers
  out for good it needs ``N * QUIET_PER_S >= TOTAL_PER_S``: 512 addresses (IPv4 addresses or
  IPv6 /64s; a /48 holds 65,536 of the latter, so an IPv6 stranger can: what a per-source
  scheme cannot help), and then the newcomer is back to first come, first served, as before.
  The flood's addresses that keep the bucket of all dry spend their quiet tokens on the
  connections they get in, so they never qualify. The bound in all is unchanged: the
  reserve is part of the bucket of all, not added to it. Quiet is per source, so honest
  peers behind one address (NAT, a local swarm on loopback) share its two quiet tokens, and a
  stranger behind that address spends them: those compete above the reserve, as before.

The table of buckets is bounded (:data:`MAX_SOURCES`; a stranger chooses how many sources it
shows): a bucket refilled to full, quiet tokens included, is forgotten (a new source starts
full anyway: about 32 s after its last connection), and past the bound the least recently
used goes first. Forgetting a bucket that was not full lets that source start again full and
quiet; only a stranger cycling through more than :data:`MAX_SOURCES` addresses within half a
minute can do that (it has the 512 above anyway), and the bucket of all still holds.

No allowance for addresses we hold an authenticated connection from: a TCP source cannot be
spoofed past Noise, but identities are free, so a stranger would connect once from each of
its addresses, hold that connection, and flood the reserve from all of them at their own
rate (8 such addresses, 32 a second: the reserve gone). A neighbour reconnecting is quiet
anyway.
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

RESERVE = 16
"""The last tokens of the bucket of all, for quiet sources only: as many of them may get in at
once while a flood holds the rest (a quarter of the burst: neighbours reconnecting together
after a restart of ours)."""

QUIET_BURST, QUIET_PER_S = 2, 1.0 / 16
"""A source is quiet while it has had fewer than this many connections let in lately: an honest
peer opens a connection or two to us per join, a neighbour one per reconnect."""

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


@dataclass
class SourceBuckets:
    """A source's two buckets, both as of ``at``: the connections it may still open now, and
    its quiet tokens (connections let in lately, on a slower clock)."""

    tokens: float
    quiet: float
    at: float

    def levels(self, now: float, rate: AcceptRate) -> tuple[float, float]:
        """Both levels at ``now``, each refilled at its rate and at most its burst."""
        elapsed = max(0.0, now - self.at)
        return (min(rate.burst, self.tokens + elapsed * rate.per_s),
                min(rate.quiet_burst, self.quiet + elapsed * rate.quiet_per_s))  # fmt: skip

    def full(self, now: float, rate: AcceptRate) -> bool:
        """Whether it says no more than a new source's would (then it can be forgotten)."""
        mine, quiet = self.levels(now, rate)
        return mine >= rate.burst and quiet >= rate.quiet_burst


class AcceptRate:
    """Whether a new connection from a source enters the handshake (:meth:`take`)."""

    def __init__(self, burst: int = SOURCE_BURST, per_s: float = SOURCE_PER_S,
                 total_burst: int = TOTAL_BURST, total_per_s: float = TOTAL_PER_S,
                 max_sources: int = MAX_SOURCES, clock: Callable[[], float] = time.monotonic,
                 reserve: int = RESERVE, quiet_burst: int = QUIET_BURST, quiet_per_s: float = QUIET_PER_S) -> None:  # fmt: skip
        self.burst, self.per_s = float(burst), per_s
        self.total_burst, self.total_per_s = float(total_burst), total_per_s
        self.reserve = float(min(reserve, total_burst))
        self.quiet_burst, self.quiet_per_s = float(quiet_burst), quiet_per_s
        self.max_sources = max(1, max_sources)
        self._clock = clock
        self._total = Bucket(self.total_burst, clock())
        self._by_source: dict[str, SourceBuckets] = {}
        """Least recently used first (a source taken is moved to the end)."""
        self.refused_by_source = 0
        self.refused_in_all = 0
        """Connections refused, by which bucket was empty (counters for tests and metrics)."""
        self.let_in_quiet = 0
        """Connections let in from the reserve: a busy source would have been refused there."""

    def __len__(self) -> int:
        return len(self._by_source)

    def take(self, source: str) -> bool:
        """Whether a new connection from ``source`` may start its handshake; if so it has
        taken a token from the source's bucket, a quiet token if it had one, and a token from
        the bucket of all (below the reserve only if it was quiet)."""
        now = self._clock()
        buckets = self._by_source.pop(source, None) or SourceBuckets(self.burst, self.quiet_burst, now)
        self._forget_full(now)
        self._by_source[source] = buckets  # most recently used: last
        self._bound()
        mine, quiet = buckets.levels(now, self)
        total = self._total.level(now, self.total_burst, self.total_per_s)
        floor = 1.0 if quiet >= 1.0 else 1.0 + self.reserve
        allowed = mine >= 1.0 and total >= floor
        if allowed:
            self.let_in_quiet += total < 1.0 + self.reserve
            mine, quiet, total = mine - 1.0, max(0.0, quiet - 1.0), total - 1.0
        else:
            self.refused_by_source += mine < 1.0
            self.refused_in_all += mine >= 1.0
        buckets.tokens, buckets.quiet, buckets.at = mine, quiet, now
        self._total.tokens, self._total.at = total, now
        return allowed

    def _forget_full(self, now: float) -> None:
        """Drop the least recently used buckets that have refilled (a new one starts full):
        amortized O(1), and the table holds only sources seen in the last half minute."""
        while self._by_source:
            oldest = next(iter(self._by_source))
            if not self._by_source[oldest].full(now, self):
                return
            del self._by_source[oldest]

    def _bound(self) -> None:
        while len(self._by_source) > self.max_sources:
            del self._by_source[next(iter(self._by_source))]
