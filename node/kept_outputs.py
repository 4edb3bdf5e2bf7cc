"""The hidden states a stage sent on, kept per session, so that a failover can rebuild a
replaced span from them instead of replaying the whole route.

A stage that is not the last keeps, for every session, exactly what the next hop received
for each position: the encoded tensors of the frames it sent (the objects already built for
the wire, so keeping them costs no copy and no extra network bytes). When the hop after it
dies, the entry asks this stage to send positions ``[0, k)`` again into the replacement
(``p2p.forward``); re-sent rows decode to the same float32 values the original frames did,
which is what keeps the replacement's KV cache bit-identical.

Bounded: one entry per session the engine holds (at most ``max_sessions``), each at most
``context_length`` positions; freed with the session. A rewind (a step at a position the
session already passed) truncates first, as the engine's cache does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from inclavate import tensors
from inclavate.types import SessionId

_ROW_DTYPES = {"f16": np.float16, "bf16": np.uint16, "f32": np.float32}

MAX_REPLAYS = 16
"""Replays one session may have from a stage over its life. An honest entry moves a session
a few times a request (three failovers at most, and moves off leaving or slow hops); anyone
who may adopt a session (its stranger opener among them) got one re-sending of everything
kept per adopt, a ~300-byte frame each (2026-12-07, an audit)."""
STRANGER_REPLAYS = 6
"""Replays of a session a peer outside the registry opened here: its own moves, which it
can make as often as it likes (adopt, close and open again), and each replay recomputes
everything kept at the next stage. With 16 of 500 positions a session, an honest chat
through that stage took 28 s against 6 (2026-12-07, a fix's own measurement). Six cover
an unregistered entry's honest moves of one request: three failovers, two moves off a slow
hop (``FailoverPolicy.slow_moves``) and one off a leaving hop (reviews: two and four did not)."""


@dataclass
class _Kept:
    chunks: list[tensors.EncodedTensor] = field(default_factory=list)
    length: int = 0
    replay_allowed: bool = False
    """Set when the session is adopted under a new leg: one replay may read it (a stage
    re-sends a session's states only when the entry just moved it, not on any frame's word)."""
    replays: int = 0
    """Replays the session has had from here, under any of its ids (:data:`MAX_REPLAYS`)."""

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.chunks)


def _rows(t: tensors.EncodedTensor) -> np.ndarray:
    """The encoded rows as an array of the wire dtype (no decoding, no copy)."""
    return np.frombuffer(t.data, dtype=_ROW_DTYPES[t.dtype]).reshape(t.shape)


def _encoded(dtype: tensors.WireDType, rows: np.ndarray) -> tensors.EncodedTensor:
    rows = np.ascontiguousarray(rows)
    return tensors.EncodedTensor(dtype, (int(rows.shape[0]), int(rows.shape[1])), rows.tobytes())


class KeptOutputs:
    """Per-session outputs of a stage, as sent (see the module docstring)."""

    def __init__(self, *, max_sessions: int, context_length: int, d_model: int, wire_dtype: tensors.WireDType) -> None:
        self.max_sessions = max_sessions
        self.context_length = context_length
        self.d_model = d_model
        self.wire_dtype = wire_dtype
        self._sessions: dict[SessionId, _Kept] = {}

    @property
    def reserved_bytes(self) -> int:
        """The most this can hold (every slot at full context, f32 fallback aside)."""
        itemsize = 4 if self.wire_dtype == "f32" else 2
        return self.max_sessions * self.context_length * self.d_model * itemsize

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes for k in self._sessions.values())

    def __len__(self) -> int:
        return len(self._sessions)

    def length(self, session_id: SessionId) -> int:
        kept = self._sessions.get(session_id)
        return kept.length if kept else 0

    def put(self, session_id: SessionId, start_pos: int, sent: tensors.EncodedTensor, held: Callable[[SessionId], bool]) -> None:
        """Positions ``start_pos...`` were sent as ``sent``. ``held``: whether the engine holds
        a session now (entries of others are dropped when room is needed: nothing outlives
        its session)."""
        rows = int(sent.shape[0])
        if len(sent.shape) != 2 or sent.shape[1] != self.d_model or start_pos + rows > self.context_length:
            self._sessions.pop(session_id, None)
            return
        kept = self._sessions.get(session_id)
        if kept is None:
            if len(self._sessions) >= self.max_sessions:
                self.retain(held)
            if len(self._sessions) >= self.max_sessions:
                return
            kept = self._sessions[session_id] = _Kept()
        if start_pos > kept.length:
            # A gap (an earlier output was never kept): these rows cannot be replayed.
            del self._sessions[session_id]
            return
        if kept.length > start_pos:  # a rewind; asked here, not in a call, at every hop of every token
            self._truncate(kept, start_pos)
        kept.chunks.append(sent)
        kept.length = start_pos + rows

    def _truncate(self, kept: _Kept, length: int) -> None:
        if kept.length <= length:
            return
        pos, chunks = 0, []
        for chunk in kept.chunks:
            n = int(chunk.shape[0])
            if pos + n <= length:
                chunks.append(chunk)
            elif pos < length:
                chunks.append(_encoded(chunk.dtype, _rows(chunk)[: length - pos]))  # type: ignore[arg-type]
            pos += n
        kept.chunks, kept.length = chunks, length

    def rows(self, session_id: SessionId, start: int, n: int) -> tensors.EncodedTensor:
        """Positions ``[start, start + n)`` as one tensor the next hop decodes to the same
        float32 values it decoded from the original frames. KeyError/IndexError when not held."""
        kept = self._sessions[session_id]
        if start < 0 or n < 1 or start + n > kept.length:
            raise IndexError(f"positions [{start}, {start + n}) of {kept.length} kept")
        parts: list[tuple[str, np.ndarray]] = []
        pos = 0
        for chunk in kept.chunks:
            size = int(chunk.shape[0])
            lo, hi = max(start, pos), min(start + n, pos + size)
            if lo < hi:
                parts.append((chunk.dtype, _rows(chunk)[lo - pos : hi - pos]))
            pos += size
        dtypes = {d for d, _ in parts}
        if len(dtypes) == 1:
            (dtype,) = dtypes
            return _encoded(dtype, np.concatenate([r for _, r in parts]))  # type: ignore[arg-type]
        # Frames that fell back to a wider dtype (an f16 overflow): f32 holds every value exactly.
        decoded = [tensors.decode(_encoded(d, r)) for d, r in parts]  # type: ignore[arg-type]
        return _encoded("f32", np.concatenate(decoded))

    def shapes(self, session_id: SessionId, positions: int) -> list[int]:
        """The lengths of the frames that carried positions ``[0, positions)`` to the next
        hop, in order (the last cut at ``positions``). KeyError/IndexError when not held."""
        kept = self._sessions[session_id]
        if positions < 1 or positions > kept.length:
            raise IndexError(f"{positions} positions of {kept.length} kept")
        shapes, pos = [], 0
        for chunk in kept.chunks:
            if pos >= positions:
                break
            n = min(int(chunk.shape[0]), positions - pos)
            shapes.append(n)
            pos += n
        return shapes

    def rename(self, old: SessionId, new: SessionId) -> None:
        """The session continues under a new id (a failover adopted it); one replay allowed,
        up to :data:`MAX_REPLAYS` over the session's life (counted in :meth:`take_replay`:
        a hop after the replaced span is adopted too, and sends none)."""
        kept = self._sessions.pop(old, None)
        if kept is not None:
            kept.replay_allowed = True
            self._sessions[new] = kept

    def take_replay(self, session_id: SessionId, limit: int = MAX_REPLAYS) -> bool:
        """Whether a replay of this session may be sent now (consumes the permission);
        ``limit``: the session's replays over its life (:data:`STRANGER_REPLAYS` for one a
        stranger opened)."""
        kept = self._sessions.get(session_id)
        if kept is None or not kept.replay_allowed or kept.replays >= limit:
            return False
        kept.replay_allowed = False
        kept.replays += 1
        return True

    def drop(self, session_id: SessionId) -> None:
        self._sessions.pop(session_id, None)

    def retain(self, held: Callable[[SessionId], bool]) -> None:
        for session_id in [s for s in self._sessions if not held(s)]:
            del self._sessions[session_id]
