"""Generations this peer drives as entry: their turns, and ``DELETE /sessions/:id``.

Cancelling a generation's scope ends its loop, and the loop's own cleanup closes the
session on every stage of its chain: there is one path that frees KV cache, whichever way
a generation ends.

Turns. An entry drives at most ``max_running`` generations at once (a peer's
``--max-sessions``: what each stage of a chain holds). Driving more made the extra ones
queue for session slots at the stages, silent past the entry's step deadline, so the entry
blamed healthy peers, failed over and ended them (and other clients' chats) in 503s.
The others wait here, in order, for a turn; a request that finds every turn and
``max_waiting`` places taken is refused with 429 by :meth:`ActiveSessions.admitting`,
before its body is parsed or its prompt tokenized.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

import trio

from api.errors import ApiError, Conflict
from api.limits import RequestLimits
from inclavate.types import SessionId


class SessionClosed(Conflict):
    """The generation was stopped by ``DELETE /sessions/:id`` before it finished (409)."""


class Busy(ApiError):
    """Every turn and waiting place of this entry is taken (429: retry, or ask another peer).
    ``Retry-After`` says when a place should be free (:meth:`ActiveSessions.retry_after_s`):
    the ``openai`` SDK's automatic retry waits what the header says."""

    status = 429

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


TURN_S_PRIOR = 2.0
"""What a turn is taken to last before any has ended here."""
MAX_RETRY_AFTER_S = 60
"""The ``openai`` SDKs ignore a ``Retry-After`` above 60 s (and fall back to their own short
backoff), so a longer estimate would be read as none."""
_TURN_WEIGHT = 0.2
"""The weight of the latest turn in the running mean of turns' lengths."""


class ActiveSessions:
    def __init__(self, max_running: int = 8, max_waiting: int = 32, wait_s: float = 120.0) -> None:
        self._scopes: dict[SessionId, trio.CancelScope] = {}
        self._closed: set[SessionId] = set()
        self._turns = trio.Semaphore(max_running)
        self._max_running = max_running
        self._max_waiting = max_waiting
        self._wait_s = wait_s
        self._preparing = 0
        self._turn_s = TURN_S_PRIOR
        """Running mean of how long a turn is held (a generation, start to end)."""

    @classmethod
    def for_limits(cls, limits: RequestLimits) -> ActiveSessions:
        return cls(limits.max_generations, limits.max_waiting_generations, limits.generation_wait_s)

    @contextmanager
    def admitting(self) -> Iterator[None]:
        """Around a chat request's preparation: a 429 at once when the generations running,
        waiting and being prepared fill every turn and waiting place."""
        if self._preparing + len(self._scopes) >= self._max_running + self._max_waiting:
            raise Busy(
                f"this peer is driving {self._max_running} generations with {self._max_waiting} more waiting "
                "their turn; retry shortly, or ask another peer", self.retry_after_s()
            )
        self._preparing += 1
        try:
            yield
        finally:
            self._preparing -= 1

    @asynccontextmanager
    async def track(self, session_id: SessionId) -> AsyncIterator[trio.CancelScope]:
        """Wait for a turn (429 past ``wait_s``), then hold it while the generation runs;
        :class:`SessionClosed` when ``DELETE /sessions/:id`` ended it, waiting or running."""
        try:
            with trio.CancelScope() as scope:
                self._scopes[session_id] = scope
                try:
                    with trio.move_on_after(self._wait_s) as waited:
                        await self._turns.acquire()
                    if waited.cancelled_caught:
                        raise Busy(f"no turn to generate came free on this peer within {self._wait_s:g} s; retry",
                                   self.retry_after_s())  # fmt: skip
                    taken = trio.current_time()
                    try:
                        yield scope
                        # Turns that ran to their end only: cut short (the client left, a
                        # DELETE, an error), cheap connect-and-leave chats pulled the mean,
                        # and the Retry-After with it, down to 1 s (a review, 2026-12-07).
                        self._turn_s += _TURN_WEIGHT * (trio.current_time() - taken - self._turn_s)
                    finally:
                        self._turns.release()
                finally:
                    del self._scopes[session_id]
        finally:
            # Forgotten however the block ends: a DELETE landing as the client left (the
            # outer cancel) left its id here for good, one per round (an audit, 2026-12-07).
            closed = session_id in self._closed
            self._closed.discard(session_id)
        if closed:
            raise SessionClosed(f"session {session_id} was closed by DELETE /sessions/{session_id}")

    def retry_after_s(self) -> int:
        """Whole seconds until the generations running, waiting and being prepared now should
        have had their turns: rounds of ``max_running`` at the mean turn's length, 1 to
        :data:`MAX_RETRY_AFTER_S`. A fixed 2 s had a burst's refused chats retry twice, 2 and 4
        s later, while the first admitted one ran 5.6 s: every retry met a full queue and
        failed, though the whole burst was served in 27 s (an audit, 2026-12-07)."""
        rounds = (self._preparing + len(self._scopes)) / self._max_running
        return max(1, min(MAX_RETRY_AFTER_S, math.ceil(rounds * self._turn_s)))

    def close(self, session_id: SessionId) -> bool:
        scope = self._scopes.get(session_id)
        if scope is None:
            return False
        self._closed.add(session_id)
        scope.cancel()
        return True

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._scopes

    def __len__(self) -> int:
        return len(self._scopes)
