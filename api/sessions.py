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
    ``Retry-After: 2``: a generation takes seconds, and the ``openai`` SDK's automatic retry
    waits what the header says."""

    status = 429
    retry_after_s = 2


class ActiveSessions:
    def __init__(self, max_running: int = 8, max_waiting: int = 32, wait_s: float = 120.0) -> None:
        self._scopes: dict[SessionId, trio.CancelScope] = {}
        self._closed: set[SessionId] = set()
        self._turns = trio.Semaphore(max_running)
        self._max_running = max_running
        self._max_waiting = max_waiting
        self._wait_s = wait_s
        self._preparing = 0

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
                "their turn; retry shortly, or ask another peer"
            )
        self._preparing += 1
        try:
            yield
        finally:
            self._preparing -= 1

    @asynccontextmanager
    async def track(self, session_id: SessionId) -> AsyncIterator[trio.CancelScope]:
        """Wait for a turn (429 past ``wait_s``), then hold it while the generation runs."""
        with trio.CancelScope() as scope:
            self._scopes[session_id] = scope
            try:
                with trio.move_on_after(self._wait_s) as waited:
                    await self._turns.acquire()
                if waited.cancelled_caught:
                    raise Busy(f"no turn to generate came free on this peer within {self._wait_s:g} s; retry")
                try:
                    yield scope
                finally:
                    self._turns.release()
            finally:
                del self._scopes[session_id]
        if session_id in self._closed:
            self._closed.discard(session_id)
            raise SessionClosed(f"session {session_id} was closed by DELETE /sessions/{session_id}")

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
