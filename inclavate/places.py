"""A place taken in a bounded table, given back exactly once, even by a stream never read.

A streamed answer's place (an event stream's share of a peer's streams) is given back in
its generator's ``finally``. A generator never iterated (its client left between the route
and the first read) never runs that ``finally``, so the place is also given back when the
:class:`Place` is collected: on the event loop, whatever thread the cycle collector runs on,
since the tables are the loop's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

log = logging.getLogger(__name__)


class Place:
    """``give_back`` runs once: at :meth:`release`, or when the place is collected unreleased.
    Made on the event loop (it takes the loop's token)."""

    def __init__(self, give_back: Callable[[], None], what: str) -> None:
        self._loop = trio.lowlevel.current_trio_token()  # first: nothing is held if this fails
        self._give_back: Callable[[], None] | None = give_back
        self.what = what

    def release(self) -> None:
        if self._give_back is not None:
            give_back, self._give_back = self._give_back, None
            give_back()

    def __del__(self) -> None:
        if self._give_back is not None:
            try:
                self._loop.run_sync_soon(self._release_quietly)
            except trio.RunFinishedError:
                pass

    def _release_quietly(self) -> None:
        """:meth:`release` from the event loop's callback queue, where an exception would
        cancel every task of the peer: logged instead."""
        try:
            self.release()
        except Exception:  # noqa: BLE001 - a bookkeeping slip must not stop the peer
            log.exception("giving back the place of %s", self.what)
