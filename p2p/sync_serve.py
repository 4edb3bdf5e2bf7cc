"""Who gets one of the few registry-sync answers this peer sends at once, and for how long.

Any number of identities may ask for our table, so answers are sent :data:`SERVES_AT_ONCE`
at a time in all. An answer lasts as long as its asker takes to read it (each page within
the sender's per-page timeout, the whole within the asker's own limit): askers that read
slowly, and asked again as soon as they were cut off, held every serve for good, and every
other asker was refused at once. So (:class:`ServeTurns`):

* an asker that finds every serve taken **waits** for one, in order of arrival, up to
  :data:`SERVE_WAIT_S`, rather than being refused: whoever asks again after it queues behind;
* while anyone waits, the serves that have run longest are **held to a turn**
  (:data:`SERVE_TURN_S`), as many as there are waiters, so a slot frees within one turn for
  every waiter; an answer cut off has still delivered its first pages, smallest records
  first, which the asker has applied;
* a peer has **one answer at a time**, sent or awaited (an honest asker asks one at a time).

Nothing here reads or encodes the answer: a waiter holds its stream and an event.
"""

from __future__ import annotations

import contextlib
import enum
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import trio

from inclavate.types import PeerId

SERVES_AT_ONCE = 4
"""Sync answers sent at once, to all askers together: each holds a page encoded (up to
2 MiB) and a share of our uplink."""
WAITING_AT_ONCE = SERVES_AT_ONCE
"""Askers waiting for a serve: as many as the serves running can make room for within one
turn, so each one waiting is served within its wait; one more is refused at once."""
SERVE_TURN_S = 15.0
"""How long an answer runs before it gives way to a waiting asker (only when one waits).
At 1 Mbit/s that is ~1.8 MB, the full records and heartbeats of ~200 nodes, smallest
first; a longer answer cut off has delivered those."""
SERVE_WAIT_S = SERVE_TURN_S + 5.0
"""How long an asker waits for a serve: one turn, and a margin for the answer that gave way
to be reset. The asker waits longer for its first page (``p2p.gossip._SYNC_FIRST_PAGE_S``)."""


class ServeRefused(Exception):
    """An asker gets no answer now; ``reason`` is a drop-counter key."""

    def __init__(self, reason: ServeDrop) -> None:
        super().__init__(reason.value)
        self.reason = reason


class ServeDrop(enum.Enum):
    """Why an asker got no answer, or not all of it (drop-counter keys)."""

    SERVES_BUSY = "sync_serves_busy"
    """Every serve and every waiting place was taken, or the wait ran out."""
    PEER_BUSY = "sync_serve_peer_busy"
    """The asker was already being answered, or waiting for an answer."""
    TURN_OVER = "sync_serve_turn_over"
    """An answer was cut off after its turn, for an asker that was waiting."""


@dataclass
class _Serve:
    """One answer being sent: when it started, and the scope that cuts it off."""

    started: float
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    held: bool = False
    """Held to its turn: someone waits."""

    def hold(self, held: bool, turn_s: float) -> None:
        self.held = held
        self.scope.deadline = self.started + turn_s if held else math.inf


class ServeTurns:
    """Slots for sync answers: handed out in order of arrival, and taken back from the
    longest-running answers while others wait (module docstring)."""

    def __init__(self, slots: int = SERVES_AT_ONCE, waiting: int = WAITING_AT_ONCE,
                 turn_s: float = SERVE_TURN_S, wait_s: float = SERVE_WAIT_S) -> None:  # fmt: skip
        self.free, self.waiting_places, self.turn_s, self.wait_s = slots, waiting, turn_s, wait_s
        self._serving: dict[PeerId, _Serve] = {}
        self._waiting: dict[PeerId, trio.Event] = {}
        """Waiting askers in order of arrival, each with the event that hands it a slot."""

    @contextlib.asynccontextmanager
    async def turn(self, peer: PeerId) -> AsyncIterator[trio.CancelScope]:
        """A slot for one answer to ``peer``, waited for if need be; run the answer in the
        scope yielded, which is cancelled when its turn goes to a waiting asker.
        Raises :class:`ServeRefused`."""
        if peer in self._serving or peer in self._waiting:
            raise ServeRefused(ServeDrop.PEER_BUSY)
        await self._take_slot(peer)
        serve = self._serving[peer] = _Serve(trio.current_time())
        self._rebalance()
        try:
            yield serve.scope
        finally:
            del self._serving[peer]
            self._give_slot()

    async def _take_slot(self, peer: PeerId) -> None:
        if self.free:
            self.free -= 1
            return
        if len(self._waiting) >= self.waiting_places:
            raise ServeRefused(ServeDrop.SERVES_BUSY)
        handed = self._waiting[peer] = trio.Event()
        self._rebalance()
        try:
            with trio.move_on_after(self.wait_s):
                await handed.wait()
        except BaseException:
            if handed.is_set():  # handed a slot as we were cancelled: pass it on
                self._give_slot()
            raise
        finally:
            if self._waiting.pop(peer, None) is not None:
                self._rebalance()
        if not handed.is_set():
            raise ServeRefused(ServeDrop.SERVES_BUSY)

    def _give_slot(self) -> None:
        """A slot is free: to the asker that has waited longest, if any."""
        if self._waiting:
            first = next(iter(self._waiting))
            self._waiting.pop(first).set()
        else:
            self.free += 1
        self._rebalance()

    def _rebalance(self) -> None:
        """Hold as many answers to their turn as askers wait, the longest-running first (so
        each waiter has one to follow), and let the others run their course."""
        by_age = sorted(self._serving.values(), key=lambda serve: serve.started)
        for rank, serve in enumerate(by_age):
            held = rank < len(self._waiting)
            if held != serve.held:
                serve.hold(held, self.turn_s)
