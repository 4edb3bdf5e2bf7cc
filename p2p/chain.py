"""The entry peer's side of a session: a :class:`~inclavate.pipeline.Pipeline` over the swarm.

The route is chosen once, on a session's first step, from the registry as it is then. Prefill
chunks are sent without waiting (the stages pipeline them: the first stage computes chunk 2
while the second computes chunk 1); the step that samples waits for its token, or for an
``error`` from any stage, within ``step_timeout``.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import trio

from inclavate.types import ModelId, SessionId
from node.sampling import SamplingParams
from p2p import wire
from p2p.errors import P2PError
from p2p.forward import ForwardService
from p2p.routing import Hop

log = logging.getLogger(__name__)

_request_ids = itertools.count(1)


class StageFailed(P2PError):
    """A stage of the chain reported an error (``code`` says which kind, ``origin`` where)."""

    def __init__(self, code: str, message: str, origin: str) -> None:
        self.code = code
        self.origin = origin
        super().__init__(f"{message} (at peer {origin})")


class ContextExceeded(StageFailed):
    """A stage has no room left in the session's context (the client asked for too much)."""


def stage_failure(code: str, message: str, origin: str) -> StageFailed:
    cls = ContextExceeded if code == "context_full" else StageFailed
    return cls(code, message, origin)


class ChainTimeout(P2PError):
    """The chain did not answer in time; a peer on the route is stalled or gone."""


@dataclass
class _Session:
    route: list[Hop]
    inbox: trio.MemoryReceiveChannel[wire.Message]
    failed: StageFailed | None = None


@dataclass
class SwarmPipeline:
    """Sessions of one model driven from this peer through routes the router picks."""

    service: ForwardService
    model_id: ModelId
    route_for: Callable[[], list[Hop]]
    """Picks a route from the current registry; raises ``NoRoute``."""
    context_length: int
    step_timeout: float = 120.0
    close_timeout: float = 5.0
    _sessions: dict[SessionId, _Session] = field(default_factory=dict)

    def route_of(self, session_id: SessionId) -> list[Hop] | None:
        session = self._sessions.get(session_id)
        return session.route if session else None

    async def step(
        self,
        session_id: SessionId,
        start_pos: int,
        tokens: Sequence[int],
        sampling: SamplingParams | None,
    ) -> int | None:
        session = self._sessions.get(session_id)
        if session is None:
            route = self.route_for()
            session = self._sessions[session_id] = _Session(route, self.service.open_inbox(session_id))
            log.debug("session %s routed through %s", session_id, " -> ".join(f"{h.peer_id[-6:]}[{h.layers}]" for h in route))
        if session.failed is not None:
            raise session.failed
        req = next(_request_ids)
        msg = wire.Forward(
            req, session_id, start_pos, tuple(session.route), self.service.me, sampling, tokens=np.asarray(tokens, dtype=np.int32)
        )
        await self.service.send(session.route[0].peer_id, msg)
        if sampling is None:
            return None
        with trio.move_on_after(self.step_timeout) as scope:
            while True:
                reply = await session.inbox.receive()
                if isinstance(reply, wire.Error):
                    session.failed = stage_failure(reply.code, reply.message, reply.origin)
                    raise session.failed
                if isinstance(reply, wire.Result) and reply.req_id == req:
                    assert reply.token is not None
                    return reply.token
        assert scope.cancelled_caught
        raise ChainTimeout(f"no answer from the chain of {self.model_id} within {self.step_timeout:g} s")

    async def close_session(self, session_id: SessionId) -> None:
        """Free the session on every hop.

        The close travels the route like the session's own frames, so it arrives after
        any frame still in flight (a close that overtook a prefill chunk would let that
        chunk open the session again). If the chain is broken, every hop is then told
        directly, best effort; a hop that cannot be reached frees the session when it
        has been idle for the stage's idle timeout.
        """
        session = self._sessions.pop(session_id, None)
        if session is None:
            return
        try:
            req = next(_request_ids)
            route = tuple(session.route)
            await self.service.send(route[0].peer_id, wire.Close(req, session_id, route, self.service.me))
            if await self._await_closed(session.inbox, {req}):
                return
            direct = {}
            for hop in route:
                direct[next(_request_ids)] = hop
            for hop_req, hop in direct.items():
                await self.service.send(hop.peer_id, wire.Close(hop_req, session_id, (hop,), self.service.me))
            await self._await_closed(session.inbox, set(direct))
        finally:
            self.service.close_inbox(session_id)

    async def _await_closed(self, inbox: trio.MemoryReceiveChannel[wire.Message], pending: set[int]) -> bool:
        """Wait for ``closed`` of every request in ``pending``; False on an error or timeout."""
        with trio.move_on_after(self.close_timeout):
            async for reply in inbox:
                if reply.req_id not in pending:
                    continue
                if isinstance(reply, wire.Error):
                    return False
                if isinstance(reply, wire.Closed):
                    pending.discard(reply.req_id)
                    if not pending:
                        return True
        return False

    @property
    def open_sessions(self) -> list[SessionId]:
        return list(self._sessions)
