"""Admission control for the forward protocol: what one remote peer may make this peer hold.

Two budgets, both keyed by the *authenticated* remote PeerID (Noise proves it), never by
anything a frame claims:

* **Work in flight.** Each remote peer may have at most ``jobs_per_peer`` frames and
  ``bytes_per_peer`` bytes queued at the stage. A peer over budget waits, and since each
  inbound stream is read by one task, only that peer's stream stops being read (libp2p flow
  control then pushes back on it): a flood from one peer cannot fill the stage queue that
  every other peer shares. All peers together may hold at most ``bytes_total``: identities
  cost nothing, and the stage keeps every queued job (a new session waits up to a minute
  for a slot), so per-peer budgets alone let memory grow with the number of senders. A
  frame over the total is refused, not held: a waiting frame is already in memory. Bytes
  are what the frame holds here (:func:`held_bytes`), not what it took on the wire. Small
  frames (decode steps) count against a total of their own (``small_bytes_total``), so a
  flood of large frames from a few free identities, which fills ``bytes_total``, does not
  stop the sessions already decoding here; and each peer's small frames may hold at most
  ``small_bytes_per_peer`` of it (more waits, as over its own budget), so that filling it
  takes many identities whatever size of small frame they send.
* **Sessions opened by strangers.** A *known* peer is one the registry lists (it holds layers,
  so it is a chain member or an entry peer); for a frame of hidden states, only one that signs
  a live record of the model ending where the stage starts (its previous hop on any honest
  route: ``ForwardService``), since a record costs nothing to publish. Anyone else is a stranger: it may open at most
  ``stranger_sessions_per_peer`` sessions here, strangers together at most
  ``stranger_session_share`` of the slots, and a stranger's session idle for
  ``stranger_idle_s`` is freed (a known peer's idles out after the stage's own, longer,
  timeout). A stranger cannot touch a session it did not open. Without this, eight
  one-token frames would hold every KV slot for the stage's ten-minute idle timeout. The
  peers that fed a session here (its previous hop, its entry) may close it even once the
  registry has dropped them (:meth:`Admission.may_close`).

Only strangers' sessions are tracked, so the tables are bounded by the quota; the in-flight
table holds a row per peer with work queued.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import trio

from inclavate.types import PeerId, SessionId
from p2p.forward_checks import FrameReason, FrameRejected

MIB = 1024 * 1024
FRAME_OVERHEAD_BYTES = 4096
"""Charged per frame on top of its arrays: the decoded message, its route, the stage's job
and batch item (measured ~1.5 KiB for a one-hop route, ~4.3 KiB for eight hops). It also
bounds how many frames the total budget lets all peers queue."""


def held_bytes(body: int, decoded: int = 0) -> int:
    """What a queued frame holds at this peer: its ``body`` as received (the job's delivery
    keeps the frame, to pass it on), the ``decoded`` float32 copy the stage computes on (for
    hidden states: twice the body's size for f16, as much again for f32), and
    :data:`FRAME_OVERHEAD_BYTES`. Counting the body alone understated an f16 frame by 3x."""
    return body + decoded + FRAME_OVERHEAD_BYTES


@dataclass(frozen=True)
class AdmissionLimits:
    jobs_per_peer: int = 64
    """Frames one peer may have queued at the stage (a chain neighbour carries every
    session's decode step plus prefill chunks)."""
    bytes_per_peer: int = 256 * MIB
    """Memory one peer's queued frames may hold at the stage (:func:`held_bytes`)."""
    bytes_total: int = 1024 * MIB
    """Memory all peers' queued frames together may hold at the stage. Four peers' full
    budgets: far more than honest traffic queues (a stage's hidden states come from its
    previous hops, a decode step is a few KiB, a 256-position prefill chunk of f16 states
    holds 6 x 256 x ``d_model`` bytes: 0.9 MiB at 576, 12 MiB at 8192), and small beside the
    weights and KV cache of any model worth serving. Without it, each free identity pinned
    another 256 MiB (2026-12, from an audit)."""
    small_frame_bytes: int = 512 * 1024
    """Frames holding at most this are counted apart (``small_bytes_total``): a decode step
    of up to 8 tokens in f16 at ``d_model`` 8192 holds ~400 KiB here."""
    small_bytes_total: int = 64 * MIB
    """Memory all peers' small frames together may hold. Four free identities' large
    frames fill ``bytes_total``, after which every frame was refused (service denied, memory
    safe); filling this too takes 16,000 frames of a one-token step (four KiB each), 256
    identities at ``jobs_per_peer``, while honest traffic queues a step or two per session.
    A flooder picks the size, though: frames just under ``small_frame_bytes`` filled it with
    129 frames from three identities (2026-12-06, a review), hence ``small_bytes_per_peer``."""
    small_bytes_per_peer: int = 4 * MIB
    """Memory one peer's small frames may hold (more waits, like a frame over
    ``bytes_per_peer``): filling ``small_bytes_total`` then takes 16 identities whatever the
    frames' size. A chain neighbour's one-token decode steps at ``d_model`` 8192 hold ~52 KiB
    each, so ``jobs_per_peer`` of them fit; only a neighbour queueing many multi-token steps
    of a large model waits for the stage to take some first."""
    stranger_sessions_per_peer: int = 1
    stranger_session_share: float = 0.5
    """Of the stage's slots, the most that all strangers together may hold."""
    stranger_idle_s: float = 30.0


@dataclass
class _InFlight:
    jobs: int = 0
    bytes: int = 0
    small: int = 0
    """Of ``bytes``, what its small frames hold (:attr:`AdmissionLimits.small_frame_bytes`)."""
    waiters: int = 0
    changed: trio.Event | None = None
    """Set at the next release; made only when a frame waits (most never do: a frame at
    every hop would otherwise make and drop one)."""


class Admission:
    def __init__(
        self,
        limits: AdmissionLimits,
        *,
        is_known: Callable[[PeerId], bool],
        fed_by: Callable[[SessionId], Iterable[str]] = lambda _: (),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limits = limits
        self.is_known = is_known
        self.fed_by = fed_by
        """The peers that opened a session here (its previous hop and its entry, as the stage
        saw them), whatever the registry says of them now."""
        self.clock = clock
        self._strangers: dict[SessionId, tuple[PeerId, float]] = {}
        """Sessions opened here by strangers: opener, last used."""
        self._in_flight: dict[PeerId, _InFlight] = {}
        self._total = _InFlight()
        """All peers' large frames in flight together (its ``changed`` and ``waiters`` unused)."""
        self._small_total = _InFlight()
        """All peers' small frames in flight together (:attr:`AdmissionLimits.small_frame_bytes`)."""
        self._generation = 0
        """Bumped by :meth:`reset_in_flight`: releases of reservations made before are no-ops."""

    # ------------------------------------------------------------ sessions

    def admit(self, remote: PeerId, session_id: SessionId, *, held: bool, max_sessions: int, known: bool | None = None) -> None:
        """Raise :class:`FrameRejected` unless ``remote`` may send work for ``session_id``.

        ``held``: the stage already holds the session (so it is someone's). ``known``: the
        caller's verdict on ``remote`` for this frame (None: :attr:`is_known`'s)."""
        if known is None:
            known = self.is_known(remote)
        owner = self._strangers.get(session_id)
        if owner is not None:
            if owner[0] != remote and not known:
                raise FrameRejected(FrameReason.SESSION_NOT_YOURS, "the session belongs to another peer")
            self._strangers[session_id] = (owner[0], self.clock())
            return
        if known:
            return
        if held:
            raise FrameRejected(FrameReason.SESSION_NOT_YOURS, "the session belongs to another peer")
        mine = sum(1 for opener, _ in self._strangers.values() if opener == remote)
        if mine >= self.limits.stranger_sessions_per_peer:
            raise FrameRejected(FrameReason.SESSION_QUOTA, f"a peer outside the registry may hold {mine} session(s) here")
        if len(self._strangers) >= math.floor(max_sessions * self.limits.stranger_session_share):
            raise FrameRejected(FrameReason.SESSION_QUOTA, "the slots open to peers outside the registry are taken")
        self._strangers[session_id] = (remote, self.clock())

    def may_close(self, remote: PeerId, session_id: SessionId) -> bool:
        """A close (or adopt) is honoured from any known peer, from the stranger that opened
        the session, and from the peers that fed it here: its previous hop and its entry
        (:attr:`fed_by`), even once the registry has let them lapse. A peer that was stopped
        (SIGSTOP, a frozen VM) for over a minute wakes with every other record dropped and
        reads the closes queued meanwhile before any heartbeat: refused, they left the
        session's slot taken for its ten-minute idle timeout (2026-12, a chaos audit)."""
        owner = self._strangers.get(session_id)
        if self.is_known(remote) or (owner is not None and owner[0] == remote):
            return True
        return remote in self.fed_by(session_id)

    def opened_by_stranger(self, session_id: SessionId) -> bool:
        """Whether a peer outside the registry opened the session here."""
        return session_id in self._strangers

    def renamed(self, old: SessionId, new: SessionId) -> None:
        """A failover adopted the session under a new id: its opener keeps it."""
        owner = self._strangers.pop(old, None)
        if owner is not None:
            self._strangers[new] = owner

    def closed(self, session_id: SessionId) -> None:
        self._strangers.pop(session_id, None)

    def idle_stranger_sessions(self) -> list[SessionId]:
        """Strangers' sessions idle past ``stranger_idle_s``, forgotten here (free them)."""
        cutoff = self.clock() - self.limits.stranger_idle_s
        idle = [s for s, (_, used) in self._strangers.items() if used < cutoff]
        for session_id in idle:
            del self._strangers[session_id]
        return idle

    # -------------------------------------------------------- work in flight

    async def reserve(self, remote: PeerId, nbytes: int) -> Callable[[], None]:
        """Wait until ``remote`` has room for one more frame holding ``nbytes``; returns its
        release, to call once the frame's work is done (again, or after
        :meth:`reset_in_flight`, it does nothing). A frame larger than the peer's whole
        budget, or one that would take all peers' frames of its size past their total
        (``bytes_total``, ``small_bytes_total``), is refused at once (:class:`FrameRejected`)."""
        if nbytes > self.limits.bytes_per_peer:
            raise FrameRejected(FrameReason.TOO_LARGE, f"a frame of {nbytes} bytes exceeds the per-peer budget")
        row = self._in_flight.get(remote)
        if row is None:
            row = self._in_flight[remote] = _InFlight()
        row.waiters += 1
        try:
            while self._over_budget(row, nbytes):
                if row.changed is None:
                    row.changed = trio.Event()
                await row.changed.wait()
            total, cap = self._pool(nbytes)
            if total.bytes + nbytes > cap:
                raise FrameRejected(FrameReason.QUEUE_FULL, f"a frame of {nbytes} bytes exceeds what this stage may queue "
                                    f"for all peers ({total.bytes} of {cap} held)")  # fmt: skip
        except BaseException:
            row.waiters -= 1
            self._forget_if_idle(remote, row)
            raise
        row.waiters -= 1
        row.jobs += 1
        row.bytes += nbytes
        if total is self._small_total:
            row.small += nbytes
        total.jobs += 1
        total.bytes += nbytes
        generation, released = self._generation, False

        def release() -> None:
            nonlocal released
            if not released and generation == self._generation:
                self._give_back(remote, row, nbytes)
            released = True

        return release

    def _over_budget(self, row: _InFlight, nbytes: int) -> bool:
        """Whether one more frame holding ``nbytes`` takes ``row``'s peer past its budgets."""
        if row.jobs >= self.limits.jobs_per_peer or row.bytes + nbytes > self.limits.bytes_per_peer:
            return True
        small = nbytes <= self.limits.small_frame_bytes
        return small and row.small > 0 and row.small + nbytes > self.limits.small_bytes_per_peer  # one always fits

    def _pool(self, nbytes: int) -> tuple[_InFlight, int]:
        """The total a frame holding ``nbytes`` counts against, and its cap."""
        if nbytes <= self.limits.small_frame_bytes:
            return self._small_total, self.limits.small_bytes_total
        return self._total, self.limits.bytes_total

    def _give_back(self, remote: PeerId, row: _InFlight, nbytes: int) -> None:
        total, _ = self._pool(nbytes)
        total.jobs = max(0, total.jobs - 1)
        total.bytes = max(0, total.bytes - nbytes)
        row.jobs = max(0, row.jobs - 1)
        row.bytes = max(0, row.bytes - nbytes)
        if total is self._small_total:
            row.small = max(0, row.small - nbytes)
        if row.changed is not None:
            row.changed.set()
            row.changed = None
        self._forget_if_idle(remote, row)

    def _forget_if_idle(self, remote: PeerId, row: _InFlight) -> None:
        if row.jobs == 0 and row.waiters == 0 and self._in_flight.get(remote) is row:
            del self._in_flight[remote]

    def in_flight(self, remote: PeerId) -> tuple[int, int]:
        row = self._in_flight.get(remote)
        return (row.jobs, row.bytes) if row else (0, 0)

    def in_flight_total(self) -> tuple[int, int]:
        """Frames and bytes (:func:`held_bytes`) queued here by all peers together."""
        return self._total.jobs + self._small_total.jobs, self._total.bytes + self._small_total.bytes

    def reset_in_flight(self) -> None:
        """The stage was replaced: jobs of the old one will never be delivered."""
        rows, self._in_flight = self._in_flight, {}
        self._total, self._small_total = _InFlight(), _InFlight()
        self._generation += 1
        for row in rows.values():
            row.jobs = row.bytes = row.small = 0  # waiters on these rows proceed, counted afresh
            if row.changed is not None:
                row.changed.set()
