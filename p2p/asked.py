"""Which peer may answer which request of a session this peer drives (the entry's filter).

The entry takes a session's answers only from the hops of its route (``open_inbox``), and
each answer only from a hop that the request it names reached:

    error     from any hop of the request's own route (its frame passed through them; a hop
              that cannot reach the next one reports with the request's id)
    result    from the last hop of a ``forward`` that samples (never from a rebuild frame)
    closed    from the last hop of a ``close``
    adopted   from the one hop asked to adopt

Anything else is counted (``FOREIGN_REQUEST``; ``FOREIGN_ADOPTED`` for an ``adopted``) and
dropped before the session sees it. Request ids are one counter for the whole process, so a
hop sees the ids of requests that never reach it: taking any hop's answer for any of them
let a middle hop hand the entry the step's token ahead of the last stage, fail a frame it
never received, or acknowledge a close that had not reached the last hop. Our own word
(``me``: an undeliverable frame, a link that ended) is always taken.

An answer that settles a request (a token, ``closed``, ``adopted``) forgets it; what is never
answered (prefill chunks, rebuild frames, lost closes) is forgotten oldest first past
:data:`MAX_ASKED` per session, and everything at ``forget``.
"""

from __future__ import annotations

from dataclasses import dataclass

from inclavate.types import PeerId, SessionId
from p2p import wire
from p2p.forward_checks import FrameReason
from p2p.routing import Hop

MAX_ASKED = 2 * wire.MAX_REPLAY_FRAMES
"""Unanswered requests remembered per session: more than a failover's rebuild frames (at most
``MAX_REPLAY_FRAMES``) plus a prefill's chunks."""

Request = wire.Forward | wire.Close | wire.Adopt
_SETTLES: dict[type, type] = {wire.Forward: wire.Result, wire.Close: wire.Closed, wire.Adopt: wire.Adopted}


@dataclass(frozen=True)
class _Asked:
    route: tuple[Hop, ...]
    """The hops the request's frame reaches (the one it was sent to first)."""
    settled_by: type | None
    """The answer its last hop gives (None: none, e.g. a frame that does not sample)."""


class AskedRequests:
    """The requests this peer sent for the sessions it drives, by session (wire id)."""

    def __init__(self, me: PeerId) -> None:
        self.me = me
        self._by_session: dict[SessionId, dict[int, _Asked]] = {}

    def track(self, session_id: SessionId) -> None:
        """Answers for ``session_id`` are taken only for requests recorded by :meth:`asked`."""
        self._by_session.setdefault(session_id, {})

    def forget(self, session_id: SessionId) -> None:
        self._by_session.pop(session_id, None)

    def asked(self, msg: Request) -> None:
        """Remember ``msg``, a request of a tracked session, and who may answer it."""
        session_id = msg.new_id if isinstance(msg, wire.Adopt) else msg.session_id  # adopted: under the new leg's id
        requests = self._by_session.get(session_id)
        if requests is None:
            return
        settled_by = _SETTLES[type(msg)]
        if isinstance(msg, wire.Forward) and (msg.sampling is None or msg.discard):
            settled_by = None
        requests[msg.req_id] = _Asked(msg.route, settled_by)
        if len(requests) > MAX_ASKED:
            del requests[next(iter(requests))]

    def refusal(self, msg: wire.Result | wire.Closed | wire.Error | wire.Adopted, remote: PeerId) -> FrameReason | None:
        """Why ``remote`` may not give ``msg`` for its request (None: it may; an answer that
        settles the request forgets it)."""
        requests = self._by_session.get(msg.session_id)
        if requests is None:
            return None
        request = requests.get(msg.req_id)
        if remote != self.me and not _may_answer(request, msg, remote):
            return FrameReason.FOREIGN_ADOPTED if isinstance(msg, wire.Adopted) else FrameReason.FOREIGN_REQUEST
        if request is not None and type(msg) is request.settled_by:
            del requests[msg.req_id]
        return None


def _may_answer(request: _Asked | None, msg: wire.Message, remote: PeerId) -> bool:
    if request is None:
        return False
    if isinstance(msg, wire.Error):
        return any(hop.peer_id == remote for hop in request.route)
    return type(msg) is request.settled_by and remote == request.route[-1].peer_id
