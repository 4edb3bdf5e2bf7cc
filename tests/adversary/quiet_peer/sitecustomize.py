"""A real peer that plays by the wire format but misbehaves quietly, for adversarial tests.

Put this directory first on a peer process's ``PYTHONPATH`` and set ``QUIET_PEER_MODE``:

- ``drop``: take every forward frame (but rebuild-only ones) and say nothing; the peer
  still answers pings, gossips its record and holds its links;
- ``delay:SECONDS``: hold every such frame that long, then serve it;
- ``error:CODE``: answer every such frame with an error of that code, in its own name;
- ``blame_next``: answer every such frame that has a hop after this one with
  ``unreachable`` naming that hop (which is alive and well).

Python imports ``sitecustomize`` at startup, so the peer is otherwise the real one."""

from __future__ import annotations

import os

_MODE = os.environ.get("QUIET_PEER_MODE", "")

if _MODE:
    import trio

    from p2p import forward as _forward

    _serve = _forward.ForwardService._on_forward

    async def _on_forward(self, msg, remote):  # type: ignore[no-untyped-def]
        if msg.discard:
            return await _serve(self, msg, remote)
        if _MODE == "drop":
            return None
        kind, _, arg = _MODE.partition(":")
        if kind == "delay":
            await trio.sleep(float(arg))
            return await _serve(self, msg, remote)
        if kind == "blame_next" and len(msg.route) > 1:
            from p2p import wire

            nxt = msg.route[1].peer_id
            error = wire.Error(msg.req_id, msg.session_id, "unreachable", f"peer {nxt} is unreachable", self.me, nxt)
            return await self.send(msg.reply_to, error)
        if kind == "error":
            return await self._fail(msg, arg, "a quiet peer refuses")
        return await _serve(self, msg, remote)

    _forward.ForwardService._on_forward = _on_forward
