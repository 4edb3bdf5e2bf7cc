"""A real peer that plays by the wire format but misbehaves quietly, for adversarial tests.

Put this directory first on a peer process's ``PYTHONPATH`` and set ``QUIET_PEER_MODE``:

- ``drop``: take every forward frame (but rebuild-only ones) and say nothing; the peer
  still answers pings, gossips its record and holds its links;
- ``delay:SECONDS``: hold every such frame that long, then serve it;
- ``error:CODE``: answer every such frame with an error of that code, in its own name;
- ``blame_next``: answer every such frame that has a hop after this one with
  ``unreachable`` naming that hop (which is alive and well);
- ``frame:nan``, ``frame:gap``: serve every frame, but send the hop after this one input it
  must refuse: hidden states of NaN, or the frame one position further on than the session
  holds there (the hop after it answers ``invalid_batch`` in its own name).

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

if _MODE.startswith("frame:"):
    import dataclasses

    import numpy as np

    from inclavate import tensors
    from p2p import forward as _framing, wire as _wire

    _send = _framing.ForwardService.send

    def _framed(msg):  # type: ignore[no-untyped-def]
        """``msg`` as the framer sends it on: refused by the hop it goes to."""
        if _MODE == "frame:gap":
            return dataclasses.replace(msg, start_pos=msg.start_pos + 1)
        nan = np.full(msg.hidden.shape, np.nan, dtype=np.float32)
        return dataclasses.replace(msg, hidden=tensors.EncodedTensor("f32", tuple(msg.hidden.shape), nan.tobytes()))

    async def _send_framed(self, peer, msg, *, wait_for_room=True):  # type: ignore[no-untyped-def]
        if isinstance(msg, _wire.Forward) and msg.hidden is not None and peer != self.me:
            msg = _framed(msg)
        return await _send(self, peer, msg, wait_for_room=wait_for_room)

    _framing.ForwardService.send = _send_framed
