"""One process, one budget of file descriptors: the share each table a stranger can fill takes.

Every connection a stranger can open costs the peer a descriptor, and ``RLIMIT_NOFILE`` is
one budget for all of them and for the peer's own needs (outbound dials, the engine's model
files, SQLite). So each table that holds strangers' connections is bounded by a share of
the soft limit, read at each newcomer (``prlimit`` may change it while the peer runs; the
peer raises it towards the hard limit at start, ``inclavate/peer_cmd.py``):

==============================  ========  ===========  ====================================
table                           share     bounds       where
==============================  ========  ===========  ====================================
HTTP connections                1/4       16-4,096     ``api/connection_table.py``
inbound libp2p connections      1/8       16-1,024     ``p2p/connection_guard.py``
libp2p handshakes under way     1/32      4-64         ``p2p/connection_guard.py``
idle outbound libp2p            1/8       16-1,024     ``p2p/outbound_guard.py``
direct links, each protocol     1/32      16-512       ``p2p/direct.py`` (two protocols)
direct hellos awaiting a ticket 1/64      4-64         ``p2p/direct.py``
==============================  ========  ===========  ====================================

Outbound connections count because strangers choose whom we dial (free records: every
listing asks each live registry peer). At most 1/4 + 1/8 + 1/32 + 1/8 + 2/32 + 1/64 (~61%)
of the descriptors go to strangers (outbound: the idle ones; asks in flight, at most 32,
come on top), and at a 1,024 limit ~400 stay the peer's own, where the fixed direct-link
bounds (1,088 links and hellos) could take them all.
"""

from __future__ import annotations

try:
    import resource
except ImportError:  # Windows: no descriptor limit to read
    resource = None  # type: ignore[assignment]

__all__ = ["share", "soft_limit"]


def soft_limit() -> int | None:
    """The process's soft descriptor limit now; None where there is none to read."""
    if resource is None:
        return None
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else soft


def share(divisor: int, low: int, high: int, *, unknown: int | None = None) -> int:
    """One ``divisor``-th of the soft limit, within ``low``..``high``: a table must hold some
    connections however few descriptors there are, and each costs a task and buffers however
    many. ``unknown`` (default ``high``) where the limit cannot be read or is infinite."""
    soft = soft_limit()
    if soft is None:
        return high if unknown is None else unknown
    return max(low, min(high, soft // divisor))
