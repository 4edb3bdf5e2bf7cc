"""Asking many peers the same question (a swarm-wide listing, a usage total) at a cost that
does not grow with the number of identities in the registry.

Identities and registry records are free (up to 4,096), so "ask every live peer at once and
keep every answer" lets a flood of them make one listing hold gigabytes and keep hundreds of
asks in flight. A :class:`FanOut` asks peers in turns instead:

- at most :data:`MAX_ASKS_PER_FANOUT` of one fan-out's asks at a time, and at most
  :data:`MAX_ASKS_IN_FLIGHT` for all fan-outs of this peer together (one semaphore, shared
  by every :class:`FanOut` made with :meth:`FanOut.sibling`: artifact and job listings);
- each answer is handed to the caller as it arrives and nothing is kept here, so the caller
  merges it into what it keeps (:func:`keep_best`) and drops it;
- peers that had rows on a recent page first, then the rest in a fresh random order
  (:meth:`FanOut.order`), so a flood can neither choose (by grinding ids) nor fix which
  honest peers are left out when not all can be asked in time;
- an ask begun while others wait for a turn has :data:`ASK_PATIENCE_S`, so peers that stall
  cannot hold every turn until the deadline.

Used by :mod:`inclavate.artifact_swarm` and :mod:`inclavate.generations`.
"""

from __future__ import annotations

import logging
import random
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

import trio

from inclavate.errors import InclavateError

log = logging.getLogger(__name__)

MAX_ASKS_PER_FANOUT = 16
"""A fan-out asks at most this many peers at a time; the rest wait their turn. Asking every
live peer at once let a registry of free identities (up to 4 096 records) each answering
20 000 keys (~1.2 MB) make one listing hold gigabytes."""
MAX_ASKS_IN_FLIGHT = 32
"""All of this peer's fan-outs together ask at most this many peers at a time: several
listings at once (any HTTP client may start one) share these, so what this peer receives at
once is at most this many answers."""
ASK_PATIENCE_S = 1.0
"""How long an ask may take while other peers still wait for a turn: peers that stall
cannot hold every turn until the deadline. The last asks of a fan-out wait until its deadline."""
RECENT_PEERS = 64
"""How many peers that had rows on recent pages are remembered, to be asked first."""

T = TypeVar("T")
E = TypeVar("E")


class FanOut:
    """One kind of swarm-wide question: its own memory of the peers that had rows on recent
    pages, and this peer's shared limit on asks in flight."""

    def __init__(self, what: str, in_flight: trio.Semaphore | None = None) -> None:
        """``what`` names the question in logs; ``in_flight`` is shared by siblings."""
        self.what = what
        self._in_flight = in_flight if in_flight is not None else trio.Semaphore(MAX_ASKS_IN_FLIGHT)
        self._recent: OrderedDict[str, None] = OrderedDict()

    def sibling(self, what: str) -> FanOut:
        """Another question of this peer's: the same asks-in-flight limit, its own memory
        (peers with rows on recent job pages say nothing about artifact pages)."""
        return FanOut(what, self._in_flight)

    def order(self, peers: Iterable[str]) -> list[str]:
        """Peers that had rows on a recent page first (most recent first), then the rest in
        a fresh random order: when a flood of identities leaves no time to ask them all, the
        peers asked are neither the flood's choice (a sorted order is one it can grind ids
        for) nor the same ones every time."""
        wanted = set(peers)
        recent = [p for p in reversed(self._recent) if p in wanted]
        rest = list(wanted.difference(recent))
        _shuffle(rest)
        return recent + rest

    def remember(self, peers: Iterable[str]) -> None:
        """Note peers that had rows on a page, most recent last, at most :data:`RECENT_PEERS`."""
        for peer in peers:
            self._recent[peer] = None
            self._recent.move_to_end(peer)
        while len(self._recent) > RECENT_PEERS:
            self._recent.popitem(last=False)

    async def ask(self, peers: list[str], ask: Callable[[str], Awaitable[T]],
                  take: Callable[[str, T], None], deadline: float) -> None:  # fmt: skip
        """Ask ``peers`` in their order, at most :data:`MAX_ASKS_PER_FANOUT` at a time and
        this peer's fan-outs together at most :data:`MAX_ASKS_IN_FLIGHT`, handing each
        answer to ``take`` as it arrives (none is kept here). Peers that fail (any
        :class:`InclavateError`, from ``ask`` or ``take``), answer late, or are not reached
        by ``deadline`` (on trio's clock) are left out (logged)."""
        waiting = deque(peers)

        async def worker(peer: str) -> None:
            while True:
                await self._ask_one(peer, ask, take, deadline, patient=bool(waiting))
                if not waiting or trio.current_time() >= deadline:
                    return
                peer = waiting.popleft()

        async with trio.open_nursery() as nursery:
            for _ in range(min(MAX_ASKS_PER_FANOUT, len(peers))):  # each its first peer now: "others wait" is then true
                nursery.start_soon(worker, waiting.popleft())
        if waiting:
            log.warning("%s: %d peers left out: not asked before the deadline", self.what, len(waiting))

    async def _ask_one(self, peer: str, ask: Callable[[str], Awaitable[T]], take: Callable[[str, T], None],
                       deadline: float, patient: bool) -> None:  # fmt: skip
        with trio.move_on_at(deadline):
            async with self._in_flight:
                until = min(deadline, trio.current_time() + ASK_PATIENCE_S) if patient else deadline
                with trio.move_on_at(until):
                    try:
                        take(peer, await ask(peer))
                    except InclavateError as exc:  # nothing may escape the nursery as a group
                        log.warning("%s: peer %s left out: %s", self.what, peer, exc)
                    return
        log.warning("%s: peer %s left out: no answer in time", self.what, peer)


def keep_best(kept: list[E], new: Iterable[E], size: int, *, descending: bool,
              key: Callable[[E], Any] | None = None) -> bool:  # fmt: skip
    """Merge ``new`` into ``kept`` (both in the listing's order; in place) and keep the best
    ``size``: what a listing holds stays O(``size``) however many peers answer. True when an
    entry fell past ``size`` (there are more rows than the window)."""
    kept.extend(new)
    kept.sort(key=key, reverse=descending)  # two sorted runs: one merge pass
    if len(kept) <= size:
        return False
    del kept[size:]
    return True


def _shuffle(peers: list[str]) -> None:
    random.SystemRandom().shuffle(peers)
