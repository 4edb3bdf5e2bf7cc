"""One budget of request-body bytes a peer holds at once, over all its HTTP requests.

Each body has its own ceiling (24 MiB for JSON routes), but Quart buffers a body as it
arrives, concurrently with the handler, and nothing bounded how many such bodies a peer
held: 40 connections each sending most of a 24 MiB chat body raised a peer's RSS by ~940 MB
(and 40 to ``POST /nodes`` by ~1.2 GB), more connections more. Every body now reserves its
bytes here as they arrive and gives them back when a streaming reader takes them (an upload
goes on to disk) or when its request ends, however it ends; so the budget bounds the bytes
buffered, and the copies handlers make of bodies they read whole.

When a chunk does not fit, the bodies still arriving that hold more than the newcomer would
are refused first, the largest first (a stranger sending large bodies cannot lock out a
smaller one: it can only displace bodies larger than its own); if that frees too little,
the newcomer is refused. A refused body's handler sees :class:`BodyBudgetFull` (503).
"""

from __future__ import annotations

from typing import Protocol

from api.errors import ServiceUnavailable

MIB = 1024 * 1024


class BodyBudgetFull(ServiceUnavailable):
    """The peer holds its limit of request bodies; a client can retry (a smaller body gets
    in first). ``Retry-After: 1``: bodies arrive at network speed, so the budget frees in
    seconds, and the ``openai`` SDK's automatic retry waits what the header says."""

    retry_after_s = 1


class Holder(Protocol):
    """A body that holds part of the budget and can be refused while it still arrives."""

    held: int

    def arriving(self) -> bool: ...

    def refuse(self, error: BodyBudgetFull) -> None: ...


class BodyBudget:
    """Bytes reserved by request bodies; ``peak`` is the most ever held at once (for tests
    and metrics), ``high_since_trim`` the most since the heap was last trimmed
    (:mod:`api.heap_trim`), ``trims`` how often it was. Trio-only: every call runs on the
    event loop, so no lock is needed."""

    def __init__(self, limit: int) -> None:
        if limit <= 0:
            raise ValueError(f"a body budget must be positive, got {limit}")
        self.limit = limit
        self.held = 0
        self.peak = 0
        self.refused = 0
        self.high_since_trim = 0
        self.trims = 0
        self._holders: set[Holder] = set()

    def reserve(self, holder: Holder, nbytes: int) -> bool:
        """Reserve ``nbytes`` more for ``holder``; False (and nothing reserved) if they do
        not fit even after refusing the larger bodies still arriving."""
        self._make_room(holder, nbytes)
        if self.held + nbytes > self.limit:
            self.refused += 1
            return False
        holder.held += nbytes
        self.held += nbytes
        self.peak = max(self.peak, self.held)
        self.high_since_trim = max(self.high_since_trim, self.held)
        self._holders.add(holder)
        return True

    def release(self, holder: Holder, nbytes: int | None = None) -> None:
        """Give back ``nbytes`` of ``holder``'s (all of them by default)."""
        nbytes = holder.held if nbytes is None else min(nbytes, holder.held)
        holder.held -= nbytes
        self.held -= nbytes
        if holder.held == 0:
            self._holders.discard(holder)

    def _make_room(self, newcomer: Holder, nbytes: int) -> None:
        wanted = newcomer.held + nbytes
        while self.held + nbytes > self.limit:
            larger = [h for h in self._holders if h is not newcomer and h.held > wanted and h.arriving()]
            if not larger:
                return
            victim = max(larger, key=lambda h: h.held)
            self.refused += 1
            victim.refuse(self.full_error())
            self.release(victim)

    def full_error(self) -> BodyBudgetFull:
        return BodyBudgetFull(
            f"this peer is holding its limit of request bodies ({self.limit // MIB} MiB over "
            "all requests); retry later, or with a smaller body"
        )
