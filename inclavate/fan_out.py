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
  cannot hold every turn until the deadline;
- what one fan-out takes in is bounded by an :class:`AskBudget` (keys or rows in all): each
  ask reserves the most its answer may hold before it is sent, so fast peers answering full
  windows cannot keep the event loop decoding for the whole deadline;
- at most :data:`MAX_LISTINGS_AT_ONCE` listings of this peer run at once (a
  :class:`ListingGate` shared by siblings); a few more wait a short while, the rest are
  refused with :class:`ListingsBusy` (503 with ``Retry-After``);
- an ask has two phases (:meth:`FanOut.ask`): fetching the peer's raw answer, within the
  ask's patience, then decoding it, within the fan-out's deadline: one answer at a time is
  decoded (the process's one decode turn), in steps with a checkpoint between them
  (:func:`in_steps`), so however many answers arrive at once the event loop runs other
  tasks (chat streams) between every step, and an answer waiting for its turn waits for
  this peer's decoding, not for its peer.

Used by :mod:`inclavate.artifact_swarm` and :mod:`inclavate.generations`.
"""

from __future__ import annotations

import enum
import logging
import random
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Iterable
from contextlib import asynccontextmanager
from typing import Any, Generic, TypeVar, overload

import trio

from inclavate.errors import InclavateError
from inclavate.untrusted import DropCounter

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")
E = TypeVar("E")

MAX_ASKS_PER_FANOUT = 16
"""A fan-out asks at most this many peers at a time; the rest wait their turn. Asking every
live peer at once let a registry of free identities (up to 4 096 records) each answering
20 000 keys (~1.2 MB) make one listing hold gigabytes."""
MAX_ASKS_IN_FLIGHT = 32
"""All of this peer's fan-outs together ask at most this many peers at a time: several
listings at once (any HTTP client may start one) share these, so what this peer receives at
once is at most this many answers."""
ASK_PATIENCE_S = 1.0
"""How long an ask's peer may take to answer while other peers still wait for a turn: peers
that stall cannot hold every turn until the deadline. The last asks of a fan-out wait until
its deadline, and so does the decoding of an answer that arrived (:meth:`FanOut.ask`)."""
RECENT_PEERS = 64
"""How many peers that had rows on recent pages are remembered, to be asked first."""
MAX_LISTINGS_AT_ONCE = 4
"""Swarm-wide listings (artifacts, Files, jobs together) this peer runs at once. Two
listings already fill :data:`MAX_ASKS_IN_FLIGHT`; four leave an honest dashboard and a
client room, while a client starting listings in parallel keeps at most four listings'
decoding (each bounded by its :class:`AskBudget`) on the event loop."""
MAX_LISTINGS_WAITING = 16
"""Listings that may wait for a turn (four per turn); one more is refused at once, so
waiting requests cannot pile up either."""
LISTING_WAIT_S = 5.0
"""How long a listing waits for a turn: an artifact listing holds one at most
``PEER_TIMEOUT_S`` (5 s), so one behind four of them at their slowest still gets a turn."""
LISTING_RETRY_AFTER_S = 5
"""The ``Retry-After`` of a listing refused for want of a turn."""
MIN_LISTING_BUDGET = 65_536
"""The fewest keys (or rows) a listing may take in, whatever its window: a small page of a
swarm of a few hundred honest peers with full windows is still exact."""


class LeftOut(enum.Enum):
    """Why a peer was left out of a fan-out without an answer of its being refused."""

    DEADLINE = "deadline"
    """Not asked, or not answered, before the fan-out's deadline."""
    BUDGET = "budget"
    """Not asked: the fan-out had taken in its budget of keys or rows."""


class ListingsBusy(InclavateError):
    """This peer runs :data:`MAX_LISTINGS_AT_ONCE` listings and no turn came free in time
    (503 with ``Retry-After``: another peer, or this one in a moment, can answer)."""

    retry_after_s = LISTING_RETRY_AFTER_S


class ListingGate:
    """Turns for swarm-wide listings: at most ``at_once`` run, at most ``waiting`` wait (each
    at most ``wait_s``), any other is refused at once. Any HTTP client may start listings;
    unbounded, parallel ones kept the event loop decoding keys the whole time."""

    def __init__(self, at_once: int = MAX_LISTINGS_AT_ONCE, waiting: int = MAX_LISTINGS_WAITING,
                 wait_s: float = LISTING_WAIT_S) -> None:  # fmt: skip
        self._turns = trio.Semaphore(at_once)
        self._at_once = at_once
        self._most_waiting, self._wait_s = waiting, wait_s
        self.waiting = 0
        self.refused = 0

    @property
    def running(self) -> int:
        """Listings holding a turn now."""
        return self._at_once - self._turns.value

    @asynccontextmanager
    async def turn(self) -> AsyncIterator[None]:
        """Hold a turn for one listing, or raise :class:`ListingsBusy`."""
        try:
            self._turns.acquire_nowait()
        except trio.WouldBlock:
            await self._wait_for_turn()
        try:
            yield
        finally:
            self._turns.release()

    async def _wait_for_turn(self) -> None:
        if self.waiting >= self._most_waiting:
            self._refuse(f"{self.waiting} more wait for a turn")
        self.waiting += 1
        try:
            with trio.move_on_after(self._wait_s) as waited:
                await self._turns.acquire()
        finally:
            self.waiting -= 1
        if waited.cancelled_caught:
            self._refuse(f"no turn came free in {self._wait_s:g} s")

    def _refuse(self, why: str) -> None:
        self.refused += 1
        raise ListingsBusy(f"this peer is busy listing ({self.running} swarm-wide listings at once, {why}); "
                           f"retry in {LISTING_RETRY_AFTER_S} s or ask another peer")  # fmt: skip


class AskBudget(Generic[T]):
    """What one fan-out may take in: ``units`` (keys or rows) in all. Each ask reserves
    ``per_ask`` (the most one answer may hold: its size is bounded by its request) before it
    is sent; ``used`` says how many an answer held, and the rest is given back. A peer whose
    turn finds the budget spent is left out, as one the deadline leaves out. An answer that
    failed counts in full (it may have been decoded); one cut off by a deadline counts none
    (it was never decoded: a decode, once it has the decode turn, is shielded and ends)."""

    def __init__(self, units: int, per_ask: int, used: Callable[[T], int]) -> None:
        self.units, self.per_ask, self.used = units, per_ask, used
        self.spent = self.reserved = 0
        self._changed = trio.Event()

    async def reserve(self) -> bool:
        """Room for one more answer (waiting for asks in flight to give theirs back); False
        once the budget is spent."""
        while self.spent + self.reserved + self.per_ask > self.units:
            if self.reserved == 0:
                return False
            await self._changed.wait()
        self.reserved += self.per_ask
        return True

    def settle(self, used: int) -> None:
        """An ask ended having taken in ``used`` units."""
        self.reserved -= self.per_ask
        self.spent += min(used, self.per_ask)
        self._changed.set()
        self._changed = trio.Event()


def listing_budget(window: int) -> int:
    """The keys (or rows) a listing of ``window`` per peer takes in at most: as many full
    answers as one fan-out asks at once, at least :data:`MIN_LISTING_BUDGET`."""
    return max(MAX_ASKS_PER_FANOUT * window, MIN_LISTING_BUDGET)


class FanOut:
    """One kind of swarm-wide question: its own memory of the peers that had rows on recent
    pages, and this peer's shared limit on asks in flight."""

    def __init__(self, what: str, in_flight: trio.Semaphore | None = None, gate: ListingGate | None = None) -> None:
        """``what`` names the question in logs; ``in_flight`` and ``gate`` are shared by siblings."""
        self.what = what
        self._in_flight = in_flight if in_flight is not None else trio.Semaphore(MAX_ASKS_IN_FLIGHT)
        self.gate = gate if gate is not None else ListingGate()
        """Turns for this peer's listings (artifacts, Files, jobs): :meth:`ListingGate.turn`."""
        self._recent: OrderedDict[str, None] = OrderedDict()
        self.left_out = DropCounter()
        """Peers left out without an answer, by :class:`LeftOut` reason."""

    def sibling(self, what: str) -> FanOut:
        """Another question of this peer's: the same asks-in-flight limit and listing turns,
        its own memory (peers with rows on recent job pages say nothing about artifact pages)."""
        return FanOut(what, self._in_flight, self.gate)

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

    @overload
    async def ask(self, peers: list[str], ask: Callable[[str], Awaitable[T]], take: Callable[[str, T], None],
                  deadline: float, budget: AskBudget[T] | None = None) -> None: ...  # fmt: skip

    @overload
    async def ask(self, peers: list[str], ask: Callable[[str], Awaitable[R]], take: Callable[[str, T], None],
                  deadline: float, budget: AskBudget[T] | None = None, *,
                  decode: Callable[[str, R], Awaitable[T]]) -> None: ...  # fmt: skip

    async def ask(self, peers: list[str], ask: Callable[[str], Awaitable[Any]], take: Callable[[str, Any], None],
                  deadline: float, budget: AskBudget[Any] | None = None, *,
                  decode: Callable[[str, Any], Awaitable[Any]] | None = None) -> None:  # fmt: skip
        """Ask ``peers`` in their order, at most :data:`MAX_ASKS_PER_FANOUT` at a time and
        this peer's fan-outs together at most :data:`MAX_ASKS_IN_FLIGHT`, handing each
        answer to ``take`` as it arrives (none is kept here). Peers that fail (any
        :class:`InclavateError`, from ``ask``, ``decode`` or ``take``), answer late, are not
        reached by ``deadline`` (on trio's clock), or find ``budget`` spent are left out
        (logged; counted in :attr:`left_out` unless they failed).

        An ask has two phases. ``ask`` fetches the peer's answer, and may take
        :data:`ASK_PATIENCE_S` while other peers wait for a turn (patience is for peers that
        stall). ``decode``, where given, then turns that raw answer into what ``take``
        takes, in this process's one decode turn (:func:`_decode_turn`), bounded by
        ``deadline`` only: an answer that arrived waits for this peer's own decoding, not
        for its peer (under the patience, answers already received ran out of it while they
        queued for the turn, and their peers were left out).
        Without ``decode``, ``ask``'s answer is taken as it is (small answers, decoded as
        they are read: usage totals, rows asked a bounded part at a time)."""
        waiting = deque(peers)
        spent = False

        async def worker(peer: str) -> None:
            nonlocal spent
            while True:
                if not await self._ask_one(peer, ask, decode, take, deadline, patient=bool(waiting), budget=budget):
                    spent = True
                    waiting.appendleft(peer)
                    return
                if not waiting or trio.current_time() >= deadline or spent:
                    return
                peer = waiting.popleft()

        async with trio.open_nursery() as nursery:
            for _ in range(min(MAX_ASKS_PER_FANOUT, len(peers))):  # each its first peer now: "others wait" is then true
                nursery.start_soon(worker, waiting.popleft())
        if waiting:
            reason = LeftOut.BUDGET if spent else LeftOut.DEADLINE
            for _ in waiting:
                self.left_out.count(reason)
            log.warning("%s: %d peers left out: not asked (%s)", self.what, len(waiting), reason.value)

    async def _ask_one(self, peer: str, ask: Callable[[str], Awaitable[Any]],
                       decode: Callable[[str, Any], Awaitable[Any]] | None, take: Callable[[str, Any], None],
                       deadline: float, patient: bool, budget: AskBudget[Any] | None) -> bool:  # fmt: skip
        """One peer asked; False (nothing asked) when ``budget`` is spent."""
        with trio.move_on_at(deadline):
            async with self._in_flight:  # held while the answer waits for its decode: at most this many held
                if budget is not None and not await budget.reserve():
                    return False
                used = 0
                try:
                    answered, answer = await self._fetched(peer, ask, deadline, patient)
                    if answered:
                        if decode is not None:
                            answer = await _decoded(decode, peer, answer)
                        used = budget.used(answer) if budget is not None else 0
                        take(peer, answer)
                        return True
                except InclavateError as exc:  # nothing may escape the nursery as a group
                    used = budget.per_ask if budget is not None else 0  # it may have been decoded
                    log.warning("%s: peer %s left out: %s", self.what, peer, exc)
                    return True
                finally:
                    if budget is not None:
                        budget.settle(used)
        self.left_out.count(LeftOut.DEADLINE)
        log.warning("%s: peer %s left out: no answer in time", self.what, peer)
        return True

    @staticmethod
    async def _fetched(peer: str, ask: Callable[[str], Awaitable[R]], deadline: float,
                       patient: bool) -> tuple[bool, R | None]:  # fmt: skip
        """Phase one: ``(True, answer)``, or ``(False, None)`` when the peer ran out of
        :data:`ASK_PATIENCE_S` (``patient``: others wait for a turn) before it answered."""
        until = min(deadline, trio.current_time() + ASK_PATIENCE_S) if patient else deadline
        with trio.move_on_at(until):
            return True, await ask(peer)
        return False, None


_DECODING = trio.Lock()
"""One per process, as the event loop it guards: a peer runs one."""


async def _decoded(decode: Callable[[str, R], Awaitable[T]], peer: str, raw: R) -> T:
    """Phase two: ``raw`` decoded in :func:`_decode_turn`. Nothing may checkpoint between the
    turn's end and the answer's ``take``: a decode begun is taken and counted even when the
    deadline passed during it."""
    async with _decode_turn():
        return await decode(peer, raw)


@asynccontextmanager
async def _decode_turn() -> AsyncIterator[None]:
    """Hold the one turn to decode an answer to a fan-out (waiting for it may be cancelled;
    what runs in it may not, so an answer begun is decoded whole and counted in its
    :class:`AskBudget`). Up to :data:`MAX_ASKS_IN_FLIGHT` answers arrive at once, and trio
    runs every task woken together before it looks at the clock again: 16 answers decoded
    side by side, even in steps, held the loop for their steps' sum, every chat stream on
    the peer waiting (``scripts/bench_listing_fanout.py``: the longest stall)."""
    async with _DECODING:
        with trio.CancelScope(shield=True):
            yield


async def in_steps(steps: Generator[None, Any, T]) -> T:
    """Run a decoder that yields between its steps (``p2p.artifact_wire.decode_keys_in_steps``)
    to its result, letting other tasks run between each step and the next."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        await trio.lowlevel.checkpoint()


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
