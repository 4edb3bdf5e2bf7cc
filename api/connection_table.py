"""How many HTTP connections the peer holds open at once, and which one goes past that.

Every connection costs the peer a file descriptor and a task, and descriptors are one
budget of the whole process (``RLIMIT_NOFILE``): libp2p's dials and accepts, direct links,
SQLite stores and model files take from it too. Nothing counted connections before: 1,100
idle connections to the API of a peer limited to 1,024 descriptors took every one of them
for 30 s at a time (hypercorn's keep-alive), the API answered nobody, and a peer that
bootstrapped through it then found nobody answering its dial.

The API holds at most :func:`capacity` connections, a quarter of the descriptors (the
shares of the others: ``inclavate/descriptors.py``). Which connection goes past the bound is
``inclavate/source_table.py``'s rule (the source holding the most loses its oldest idle one),
so a flood from one address cannot lock out another address's clients.
"""

from __future__ import annotations

from inclavate.descriptors import share
from inclavate.source_table import ConnectionTable, Held, source_of

__all__ = ["ConnectionTable", "Held", "capacity", "source_of"]

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
    each newcomer: ``prlimit`` may change it while the peer runs; ``inclavate/descriptors.py``)."""
    return share(SHARE_OF_DESCRIPTORS, MIN_CONNECTIONS, MAX_CONNECTIONS, unknown=UNKNOWN_LIMIT_CONNECTIONS)
