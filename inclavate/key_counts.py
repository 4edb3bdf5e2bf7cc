"""How many of something each key holds now, each at most a bound: a refusing per-key cap.

Shared by the relayed requests and event streams per owner (``inclavate/peer_http.py``) and
the event streams per source address (``inclavate/job_feeds.py``). A row lives only while
its key holds something, so the table holds at most as many rows as things held (a
stranger's keys leave nothing behind). Unlike ``inclavate/source_table.py``, which always
takes a newcomer and ends another connection to make room, a full key here is refused:
the caller asks :meth:`KeyCounts.full` first and answers its own error.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class KeyCounts:
    """Things held by key, each key at most ``limit`` (checked by the caller: :meth:`full`)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._held: dict[str, int] = {}

    def __len__(self) -> int:
        """Keys holding something now."""
        return len(self._held)

    def count(self, key: str) -> int:
        return self._held.get(key, 0)

    def full(self, key: str) -> bool:
        return self._held.get(key, 0) >= self.limit

    def take(self, key: str) -> None:
        self._held[key] = self._held.get(key, 0) + 1

    def give(self, key: str) -> None:
        """One thing of ``key`` given back (the row goes with its last one)."""
        left = self._held.pop(key) - 1
        if left:
            self._held[key] = left

    @contextmanager
    def held(self, key: str) -> Iterator[None]:
        """One thing of ``key`` held for the block."""
        self.take(key)
        try:
            yield
        finally:
            self.give(key)
