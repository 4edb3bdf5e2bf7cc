"""Generations in flight on this peer, so ``DELETE /sessions/:id`` can stop one.

Cancelling a generation's scope ends its loop, and the loop's own cleanup closes the
session on every stage of its chain: there is one path that frees KV cache, whichever way
a generation ends.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import trio

from api.errors import Conflict
from inclavate.types import SessionId


class SessionClosed(Conflict):
    """The generation was stopped by ``DELETE /sessions/:id`` before it finished (409)."""


class ActiveSessions:
    def __init__(self) -> None:
        self._scopes: dict[SessionId, trio.CancelScope] = {}
        self._closed: set[SessionId] = set()

    @contextmanager
    def track(self, session_id: SessionId) -> Iterator[trio.CancelScope]:
        with trio.CancelScope() as scope:
            self._scopes[session_id] = scope
            try:
                yield scope
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
