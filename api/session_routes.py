"""Which peers a recent session went through, for ``GET /sessions/:id`` (read-only).

The route is chosen inside the pipeline on the session's first step (and may change if a
hop fails over), after the response headers have gone out, so it cannot travel in a header.
The entry peer instead notes the route as the generation runs and keeps the last
:data:`CAPACITY` sessions, so a client (the dashboard's Chat page, ``inclavate chat``) can ask
afterwards. Bounded: a stranger opening sessions only pushes old entries out.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from inclavate.types import SessionId
from p2p.routing import Hop

CAPACITY = 256


@dataclass(frozen=True)
class SessionRoute:
    session_id: SessionId
    model_id: str
    hops: tuple[Hop, ...]
    active: bool
    answer_id: str | None = None
    """The id the client was given (None: the chat completion's, ``chatcmpl-``)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.answer_id or f"chatcmpl-{self.session_id}",
            "session_id": self.session_id,
            "model": self.model_id,
            "active": self.active,
            "route": [
                {"node_id": h.node_id, "peer_id": h.peer_id, "start_layer": h.layers.start, "end_layer": h.layers.end}
                for h in self.hops
            ],
        }


class RouteBook:
    """The routes of this peer's most recent sessions, oldest dropped first."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        self._capacity = capacity
        self._entries: OrderedDict[SessionId, SessionRoute] = OrderedDict()

    def note(self, session_id: SessionId, model_id: str, hops: Sequence[Hop] | None, *, active: bool = True,
             answer_id: str | None = None) -> None:  # fmt: skip
        """Record (or update) a session; ``hops`` None keeps what was known."""
        known = self._entries.get(session_id)
        route = tuple(hops) if hops is not None else (known.hops if known else ())
        if known is not None and known.hops == route and known.active == active:
            return
        self._entries[session_id] = SessionRoute(session_id, model_id, route, active, answer_id)
        self._entries.move_to_end(session_id)
        while len(self._entries) > self._capacity:
            self._entries.popitem(last=False)

    def get(self, session_id: SessionId) -> SessionRoute | None:
        return self._entries.get(session_id)

    def __len__(self) -> int:
        return len(self._entries)
