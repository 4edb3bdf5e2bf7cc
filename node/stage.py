"""A stage: one engine serving every session routed through it, batched.

Work arrives as jobs (one session's tokens or hidden states) on a queue. The worker takes
the first job, then every other job already waiting, up to ``max_batch_tokens`` and one job
per session, and runs them as one engine call: decode steps of concurrent sessions share a
pass over the weights. A session's jobs are run in arrival order (a later one waits for the
next batch), which is what lets a prefill arrive as several chunks. A close runs as soon as
nothing of its session is queued before it, ahead of other sessions' work, so that the slot
it frees is not held behind another peer's backlog.

A long job does not hold the engine while other sessions stream: when another session has
used the stage recently, a job is computed in slices of ``prefill_slice_tokens`` (fewer where
that many take longer than ``prefill_slice_s`` at the measured prefill speed), and each round
runs the decode steps that are due first (one engine call, delivered at once), then one slice
of each long job. A decoding session then waits at most one slice for its next token, however
long the prompt another session sends (alone, a job runs whole: slicing costs prefill speed).

With several sessions active, a round first lets this process's runnable tasks run (bounded
by ``gather_s``), so that steps about to be queued join the same call, then waits briefly for
the steps of other decoding sessions expected soon (bounded by half their period and
``align_s``): in a chain, steps arrive one frame at a time from the previous stage, and
without that wait the sessions split into small groups that never meet again.

A stage of a chain (not one holding the whole model) runs the decode steps of one *lane* per
engine call (at most ``decode_lanes``; the entry spreads its sessions over one lane per stage
of their route): with all sessions in one call, one group goes round the chain and only one
stage computes at a time; with a lane per stage, the groups go round out of phase and every
stage computes at once, each call on a part of the batch. Rounds take the lanes in turn (a
step of another lane waits for the calls before it), and the waits above wait only for
sessions of the round's lane.

A lone session's decode step on an idle stage skips the queue: it is computed and delivered
in the submitting task (the forward service's reader, or the entry's generation loop), so a
hop does not pay a scheduler turn and the worker's batching on caches the last engine call
left cold (:meth:`Stage.step_now`).

Results leave through each job's ``deliver`` callback, awaited in order; the network layer
uses it to pass hidden states on or send the sampled token home. The stage knows nothing
of the network. Sessions idle for ``session_idle_s`` are freed, so an entry peer that died
mid-generation does not pin KV cache forever.

With ``keep_outputs`` (a wire dtype), a stage that is not the last keeps what it sent on for
every session (``node.kept_outputs``) and hands the encoded frame to the network layer, so a
failover can replay only the span after it. An *adopt* job renames a session (its cache and
kept outputs) to a failover's new leg id, in order with the session's other jobs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np
import trio
import trio.testing

from inclavate import tensors
from inclavate.errors import InclavateError
from inclavate.turns import send_or_wait
from inclavate.types import SessionId
from node.engine import BatchItem, LayerEngine, StageOutput
from node.engine_thread import EngineThread
from node.errors import DecodeFailed, EngineError, InvalidBatch, SessionEvicted, SessionLimitReached
from node.kept_outputs import KeptOutputs
from node.sampling import SamplingParams, sample
from node.slot_share import fair_victim, hop_of, parties
from p2p.ticks import sleep_to_tick

log = logging.getLogger(__name__)

_MAX_EVICTED = 256


@dataclass(eq=False, slots=True)
class StageResult:
    """What a job produced: hidden states to pass on, or (last range) the sampled token.
    Treated as immutable once delivered (``Stage._keep`` sets ``sent`` before); not frozen,
    for its cost (``node.engine.BatchItem``)."""

    output: StageOutput | None = None
    token: int | None = None
    error: InclavateError | None = None
    sent: tensors.EncodedTensor | None = None
    """The hidden states encoded for the next hop (when the stage keeps its outputs)."""
    length: int | None = None
    """For an adopt: the positions the renamed session holds (0: nothing kept)."""


Deliver = Callable[[StageResult], Awaitable[None]]


@dataclass(eq=False)
class Job:
    item: BatchItem | None
    """None for a close request (or an adopt, with ``rename_to``)."""
    session_id: SessionId
    deliver: Deliver
    sampling: SamplingParams | None = None
    rename_to: SessionId | None = None
    """With no item: continue ``session_id``'s cache under this id (a failover's adopt)."""
    lane: int = 0
    """The entry's lane for the session (any small number; the stage folds it onto its own)."""
    source: str = ""
    """Whose the session is (its entry, or ``slot_share.relayed`` by the previous hop): slots
    are shared fairly between sources when they run out (``node.slot_share``)."""
    enqueued: float = field(default_factory=time.monotonic)
    done: int = 0
    """Positions of ``item`` already computed (a job computed in slices)."""
    hidden_parts: list[np.ndarray] = field(default_factory=list)
    """Hidden states of the slices computed so far (a range that is not the last)."""
    pending_in: dict[SessionId, int] | None = field(default=None, repr=False)
    """The table of the stage that holds this job undelivered (see :meth:`Stage.holds`)."""

    @property
    def remaining(self) -> int:
        return self.item.n_tokens - self.done if self.item is not None else 0

    def piece(self, limit: int) -> BatchItem:
        """The next ``limit`` positions of the item, as an item of their own."""
        assert self.item is not None
        lo, hi = self.done, min(self.item.n_tokens, self.done + limit)
        if lo == 0 and hi == self.item.n_tokens:
            return self.item
        tokens = self.item.tokens[lo:hi] if self.item.tokens is not None else None
        hidden = self.item.hidden[lo:hi] if self.item.hidden is not None else None
        return BatchItem(self.session_id, self.item.start_pos + lo, tokens=tokens, hidden=hidden)


@dataclass(eq=False)
class _Work:
    """One job's share of a round: the whole job, or its next slice."""

    job: Job
    item: BatchItem | None
    """None for a close request."""

    @property
    def final(self) -> bool:
        if self.item is None or self.job.item is None:
            return True
        return self.job.done + self.item.n_tokens == self.job.item.n_tokens

    @property
    def is_step(self) -> bool:
        return self.item is not None and self.item.n_tokens == 1


@dataclass
class StageStats:
    """Counters the peer gossips: tokens through this range and the step time per layer."""

    tokens: int = 0
    batches: int = 0
    errors: int = 0
    adopted: int = 0
    """Sessions kept across a failover (renamed to a new leg with their cache)."""
    evicted: int = 0
    """Sessions whose slot went to another source's new session (``node.slot_share``)."""
    recomputed: int = 0
    """Positions computed again after a rewind (a replay, or a step re-sent after a failover)."""
    step_ms_per_layer: float = 0.0
    """Moving average of a decode step's time per layer: what routing costs a hop at."""
    steps: int = 0
    step_rounds: int = 0
    """Engine calls that ran decode steps (one position per session)."""
    step_jobs: int = 0
    """Decode steps those calls ran: ``step_jobs / step_rounds`` is how many sessions a
    step call batched, on average (what concurrent sessions gain from sharing a call)."""
    step_seconds: float = 0.0
    """Time those calls took, sampling included: a benchmark subtracts it from a token's
    time to see what a chain adds outside the engines, whatever the engines' speed."""
    inline_cpu_seconds: float = 0.0
    """Time of engine calls run on the event loop's thread: a benchmark subtracts it from
    that thread's CPU to see the event loop's own. Wall-clock time, which is the call's CPU
    unless the thread is preempted meanwhile: reading the thread's CPU clock is a system
    call, two per hop."""
    step_rounds_by_lane: list[int] = field(default_factory=lambda: [0])
    """``step_rounds`` by the lane whose steps they ran (one entry per lane of the stage)."""
    _ema_alpha: float = 0.2

    @property
    def mean_step_batch(self) -> float:
        return self.step_jobs / self.step_rounds if self.step_rounds else 0.0

    def record(self, tokens: int, seconds: float, layers: int, *, decode: bool = True, steps: int = 0,
               lane: int = 0) -> None:  # fmt: skip
        """``decode``: the batch was single-token steps. Only those move ``step_ms_per_layer``:
        a prefill chunk's seconds are not a step's, and used to make a replica that last ran
        one claim to be 100x slower, so that routing sent every session elsewhere.
        ``steps``: the call ran nothing but this many decode steps (of ``lane``), counted as
        a step round. Every counter in one call: a lone step pays it at every hop."""
        self.tokens += tokens
        self.batches += 1
        if steps:
            self.step_rounds += 1
            self.step_jobs += steps
            self.step_seconds += seconds
            self.step_rounds_by_lane[lane] += 1
        if not decode:
            return
        self.steps += 1
        per_layer = seconds * 1000 / max(1, layers)
        self.step_ms_per_layer = (
            per_layer if self.steps == 1 else (1 - self._ema_alpha) * self.step_ms_per_layer + self._ema_alpha * per_layer
        )


class Stage:
    def __init__(
        self,
        engine: LayerEngine,
        *,
        max_batch_tokens: int = 1024,
        queue_size: int = 256,
        session_idle_s: float = 600.0,
        admission_timeout_s: float = 60.0,
        on_batch: Callable[[int, float], None] | None = None,
        on_error: Callable[[], None] | None = None,
        engine_thread: EngineThread | None = None,
        inline_tokens: int = 0,
        inline_max_s: float = 0.1,
        prefill_slice_tokens: int = 64,
        interleave_window_s: float = 2.0,
        gather_s: float = 0.005,
        prefill_slice_s: float = 0.15,
        keep_outputs: tensors.WireDType | None = None,
        align_s: float = 0.25,
        decode_lanes: int = 4,
        evict_interval_s: float = 10.0,
    ) -> None:
        self.engine = engine
        info = engine.info
        self.kept: KeptOutputs | None = None
        """What this stage sent on, per session (None: last range, or not kept)."""
        if keep_outputs is not None and not info.is_last:
            self.kept = KeptOutputs(max_sessions=engine.config.max_sessions, context_length=engine.config.context_length,
                                    d_model=info.d_model, wire_dtype=keep_outputs)  # fmt: skip
        self.prefill_slice_tokens = prefill_slice_tokens
        """Most positions of one job computed per round while other sessions are active."""
        self.interleave_window_s = interleave_window_s
        """A session that used the stage this recently counts as active (streaming)."""
        self.prefill_slice_s = prefill_slice_s
        """Time budget of one slice: slices shrink (to 16 positions at least) on a machine or
        a context length where ``prefill_slice_tokens`` positions take longer."""
        self._prefill_s_per_token: float | None = None
        self.gather_s = gather_s
        """With several sessions active, how long a round may wait for this process's other
        runnable tasks (the sessions' next steps) before it starts."""
        self.align_s = align_s
        """With decode steps queued, the longest a round waits for the next steps of the
        other sessions decoding here, so that they share the call (see :meth:`_align`)."""
        self.decode_lanes = 1 if info.is_first and info.is_last else max(1, decode_lanes)
        """Lanes whose decode steps run in separate calls (1: every step shares one). One on a
        stage holding the whole model: with nothing to overlap with, halving its batch only
        costs throughput."""
        self._lane_of: dict[SessionId, int] = {}
        """The lane of each session decoding here (its last step's)."""
        self._last_step: dict[SessionId, float] = {}
        """When each decoding session's last step arrived."""
        self._step_period: dict[SessionId, float] = {}
        self.engine_thread = engine_thread or EngineThread()
        """Where calls into the engine run (one OS thread: see ``node.engine_thread``)."""
        self.inline_tokens = inline_tokens if engine.callable_from_any_thread else 0
        """Batches this small run on the event-loop thread instead, skipping two thread
        hand-offs (and the GIL hand-overs that come with them): only where the engine says
        the calling thread does not matter (one compute thread, or a thread-wait policy
        under which a second OpenMP team waits like the first)."""
        self.inline_max_s = inline_max_s
        """...and only while the stage's decode steps take less than this: an inline call
        blocks the event loop (HTTP, gossip, pings, other streams), so a range whose steps
        are slow (a large model, a slow machine) keeps them on the engine thread."""
        self._n_layers = len(info.layers)
        self._inline_ms_per_layer = 1000 * inline_max_s / self._n_layers
        """``inline_max_s`` as the most ``stats.step_ms_per_layer`` an inline step may take:
        this and ``_n_layers`` are read at every step, and computed once."""
        self.on_batch = on_batch
        """Told (tokens, milliseconds) after every batch: the peer's metrics recorder."""
        self.on_error = on_error
        self.on_evict: Callable[[SessionId], Awaitable[None]] | None = None
        """Told the session a new one took the slot of (:meth:`_evict_for`), before the new
        one runs: the wire layer closes it on the hops after this one, which hold it too (and
        the close goes ahead of the new session's frames on the link they share)."""
        self.admission_timeout_s = admission_timeout_s
        self.max_batch_tokens = max_batch_tokens
        self.session_idle_s = session_idle_s
        self.stats = StageStats(step_rounds_by_lane=[0] * self.decode_lanes)
        self._send, self._receive = trio.open_memory_channel[Job](queue_size)
        self._deferred: list[Job] = []
        self._control_ran = False
        """The last round ran a close or adopt (see :meth:`_steps_of_held_sessions`)."""
        self._pending: dict[SessionId, int] = {}
        """Jobs submitted and not yet delivered, by session (an adopt's under its new id too)."""
        self._last_used: dict[SessionId, float] = {}
        self._source_of: dict[SessionId, str] = {}
        """Each held session's source (one entry per slot)."""
        self.evict_interval_s = evict_interval_s
        """A source loses at most one session to another's newcomer per this many seconds
        (``node.slot_share``: eviction must not become a way to make an entry replay)."""
        self._evicted_at: dict[str, float] = {}
        """When each source last lost a session (pruned past the interval)."""
        self._evicted: dict[SessionId, None] = {}
        """Sessions evicted lately (at most ``_MAX_EVICTED``, oldest forgotten first): their
        next frames are answered ``SessionEvicted``, not a confusing position error."""
        self._parked = False
        """The worker waits on an empty queue, with nothing deferred, and nobody has handed it
        a job since (a submitter clears this before it queues)."""
        self._running_now = False
        """A step is being run in its submitter's task (see :meth:`step_now`)."""

    async def submit(self, job: Job, *, in_place: bool = True) -> None:
        """Queue a job; waits only when the queue is full (backpressure on the sender). No
        scheduler turn otherwise: the caller goes on with its next frame, the stage starts
        this one at the next turn.

        A lone session's decode step on an idle stage runs here instead, in the caller's task,
        and this returns once it is delivered (see :meth:`step_now`); ``in_place=False``: the
        caller already asked :meth:`step_now`, and was told no."""
        if in_place and job.item is not None and await self.step_now(job.item, job.sampling, job.lane, job.deliver):
            return
        _track(job, self._pending)
        try:
            self._parked = False
            await send_or_wait(self._send, job)
        except BaseException:
            _settle(job)  # never queued: no longer this stage's
            raise

    def holds(self, session_id: SessionId) -> bool:
        """Whether ``session_id`` is someone's here: the engine holds it, or a job of it is
        submitted and not yet delivered (a first job queued or waiting for a slot, an adopt
        onto it). The wire layer lets no stranger claim such a session as its own."""
        return session_id in self._pending or self.engine.session_length(session_id) > 0

    def fed_by(self, session_id: SessionId) -> tuple[str, ...]:
        """The peers that opened ``session_id`` here, as its source names them
        (``slot_share.parties``: its previous hop and entry, or its entry), while the engine
        holds it; () otherwise. What the stage saw, whatever the registry says now."""
        source = self._source_of.get(session_id)
        if not source or self.engine.session_length(session_id) == 0:
            return ()
        return parties(source)

    def _may_step_now(self, item: BatchItem) -> int:
        """Whether ``item`` can skip the queue: a decode step of a session this stage already
        holds, small enough to compute on the event loop's thread, while the worker waits for
        work and no other session has used the stage within the interleave window. The
        session's length here when it may (step_now counts what it recomputes from it, and
        asks the engine once), 0 when not.

        Handing a step to the worker costs a scheduler turn and the worker's batching, each on
        caches the engine call before it left cold: ~0.2 ms per hop in a 3-peer chain
        (docs/ARCHITECTURE.md, "A lone step skips the stage's queue"). Nothing is lost by
        skipping them alone: there is no one to batch with, and a step computed inline runs
        with no checkpoint between its start and its end, so the worker, woken meanwhile,
        never shares the engine with it."""
        if item.n_tokens != 1 or not self._parked or self._running_now or self._deferred or not self._may_run_inline(1):
            return 0
        length = self.engine.session_length(item.session_id)
        if length == 0:
            return 0  # a new session takes a slot: the worker's admission decides
        if len(self._last_used) > 1:
            cutoff = time.monotonic() - self.interleave_window_s
            if any(used >= cutoff for sid, used in self._last_used.items() if sid != item.session_id):
                return 0
        return length

    def _may_run_inline(self, tokens: int) -> bool:
        """Whether a batch of ``tokens`` may run on the event loop's thread: small enough,
        and the stage's decode steps known to be quick enough (the first runs on the engine
        thread, which is what teaches the stage how long a step takes)."""
        if tokens > self.inline_tokens or self.stats.steps == 0:
            return False
        return self.stats.step_ms_per_layer <= self._inline_ms_per_layer

    async def step_now(self, item: BatchItem, sampling: SamplingParams | None, lane: int, deliver: Deliver) -> bool:
        """Compute ``item`` here, in the caller's task, and deliver it, if it may skip the
        queue (:meth:`_may_step_now`); False, having done nothing, when it must be submitted.

        The worker's path with everything a lone step does not need left out: no job to
        track (the engine already holds the session, which is what :meth:`holds` asks), no
        slices, no batch, no thread hand-off. A hop's Python runs on caches the engine call
        left cold, so every call skipped counts (0.025-0.054 ms a hop against the same
        bookkeeping done through a job: docs/ARCHITECTURE.md, "A lone step skips the stage's
        queue")."""
        length = self._may_step_now(item)
        if not length:
            return False
        self._running_now = True
        try:
            session_id = item.session_id
            started = time.monotonic()
            self.stats.recomputed += max(0, length - item.start_pos)
            try:
                try:
                    (out,) = self.engine.forward([item])
                except Exception as exc:  # noqa: BLE001 - the engine's failure is this step's
                    result = _failed(exc)
                    now = time.monotonic()
                else:
                    now = time.monotonic()  # the engine's time, as the worker's path counts it
                    if out.logits is not None and sampling is not None:
                        result = _sampled(out, sampling, item)
                    else:
                        result = self._keep(session_id, item.start_pos, StageResult(output=out))
            except Exception as exc:  # noqa: BLE001 - a bug fails this step, never the stage
                log.exception("stage step failed")
                result = StageResult(error=DecodeFailed(f"stage failure: {exc}"))
                now = time.monotonic()
            self.stats.inline_cpu_seconds += now - started
            if result.error is None:
                self._last_used[session_id] = now
                self._note_step(session_id, started, lane)
            else:
                self._count_error()
            try:
                await deliver(result)
            except Exception:  # noqa: BLE001 - the network side's failure is this step's alone
                log.exception("delivering the result of session %s failed", session_id)
            if result.error is None:  # counted after the result left: the next stage computes meanwhile
                elapsed = now - started
                self.stats.record(1, elapsed, self._n_layers, steps=1, lane=lane % self.decode_lanes)
                if self.on_batch is not None:
                    self.on_batch(1, elapsed * 1000)
        finally:
            self._running_now = False
        return True

    @property
    def sessions(self) -> int:
        """Sessions holding KV cache in the engine right now."""
        return self.engine.memory().sessions

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._expire_idle_sessions)
            task_status.started()
            while True:
                batch = await self._next_batch()
                if batch:
                    await self._run_safely(batch)

    async def _run_safely(self, batch: list[_Work]) -> None:
        try:
            await self._run_batch(batch)
        except Exception as exc:  # noqa: BLE001 - a bug fails this batch, never the stage
            log.exception("stage batch failed")
            for work in batch:
                await _deliver(work.job, StageResult(error=DecodeFailed(f"stage failure: {exc}")))

    async def _next_batch(self) -> list[_Work]:
        """The next work to run together; may be empty when every waiting job awaits a slot."""
        waiting = self._deferred
        self._deferred = []
        if not waiting:
            self._parked = True
            try:
                waiting.append(await self._receive.receive())
            finally:
                self._parked = False
        self._drain(waiting)
        control = _first_ready_control(waiting)
        if control is not None and not (self._control_ran and self._steps_of_held_sessions(waiting)):
            self._control_ran = True
            self._deferred = [job for job in waiting if job is not control]
            return [_Work(control, None)]
        self._control_ran = False
        if len(self._streaming_sessions(waiting)) > 1 and self.gather_s > 0:
            await self._gather(waiting)
        self._drain(waiting)
        await self._align(waiting)
        batch: list[_Work] = []
        blocked: set[SessionId] = set()  # sessions whose earlier job waits: keep their order
        tokens = 0
        free_slots = self.engine.config.max_sessions - self.engine.memory().sessions
        streaming = self._streaming_sessions(waiting)
        run_lane: int | None = None  # the lane of the first step taken is the round's
        for job in waiting:
            lane = self._step_lane(job)
            if job.session_id in blocked or (lane is not None and run_lane is not None and lane != run_lane):
                self._deferred.append(job)
                blocked.add(job.session_id)
                continue
            if job.item is not None and job.session_id in self._evicted:
                await _deliver(job, StageResult(error=SessionEvicted(
                    f"session {job.session_id} gave its slot of {self.engine.info.layers} to another source's session")))
                continue
            new = job.item is not None and self.engine.session_length(job.session_id) == 0
            others_streaming = bool(streaming - {job.session_id})
            limit = self._slice_tokens() if others_streaming else job.remaining
            n = min(limit, job.remaining)
            fits = not (batch and tokens + n > self.max_batch_tokens)
            # Evict only for a newcomer that runs in this batch: one deferred for room left the
            # freed slot to the jobs ahead of it next round (the hoarder's own new session).
            if new and free_slots <= 0 and fits and await self._evict_for(job, blocked):
                free_slots += 1
            if new and free_slots <= 0:
                # Every slot is taken: wait for a session to close rather than fail, within
                # the admission timeout; later jobs of other sessions go ahead.
                if time.monotonic() - job.enqueued > self.admission_timeout_s:
                    await _deliver(job, StageResult(error=SessionLimitReached(
                        f"all {self.engine.config.max_sessions} session slots of {self.engine.info.model_id} "
                        f"{self.engine.info.layers} stayed busy for {self.admission_timeout_s:g} s")))  # fmt: skip
                    continue
            if job.item is None or (new and free_slots <= 0) or not fits:
                self._deferred.append(job)
                blocked.add(job.session_id)
                continue
            batch.append(_Work(job, job.piece(limit)))
            run_lane = lane if run_lane is None else run_lane
            blocked.add(job.session_id)
            if new:
                self._note_source(job, blocked)
            tokens += n
            free_slots -= new
        if not batch and self._deferred:
            # Nothing can run until something arrives (a close frees a slot) or a waiting
            # job's admission times out.
            with trio.move_on_after(0.5):
                self._deferred.append(await self._receive.receive())
        return batch

    def _steps_of_held_sessions(self, waiting: list[Job]) -> bool:
        """Whether work waits that could run now without a slot: a job of a session the
        engine holds, with nothing of its session queued before it. A close or adopt goes
        first, but not twice in a row past such work: a registered peer's adopts, one after
        another, kept every step waiting (2026-12-07, an audit). Work for new sessions does
        not count (it may wait for the slot a close frees), nor work behind a close of its
        own session (it waits for that close: the round would run nothing)."""
        earlier: set[SessionId] = set()
        for job in waiting:
            if job.item is not None and job.session_id not in earlier and self.engine.session_length(job.session_id) > 0:
                return True
            earlier.update(_ids(job))
        return False

    async def _gather(self, waiting: list[Job]) -> None:
        """Let the other sessions' next steps join this call. They are usually a few scheduler
        turns away (their token being handed back, their next step being queued): wait until
        every session decoding here has a job queued, or no task of this process can run, or
        ``gather_s``. Not waiting for the whole process to go idle once every step is here
        lets the engine compute while the event loop streams the last tokens out."""
        self._drain(waiting)
        if not self._steps_missing(waiting):
            return
        with trio.move_on_after(self.gather_s):
            async with trio.open_nursery() as nursery:

                async def until_idle() -> None:
                    await trio.testing.wait_all_tasks_blocked()
                    nursery.cancel_scope.cancel()

                nursery.start_soon(until_idle)
                while self._steps_missing(waiting):
                    waiting.append(await self._receive.receive())
                    self._drain(waiting)
                nursery.cancel_scope.cancel()

    def _steps_missing(self, waiting: list[Job]) -> bool:
        """Whether a session decoding here (a step seen, not closed since) has no job queued."""
        here, lane = {job.session_id for job in waiting}, self._first_lane(waiting)
        return any(sid not in here and self._in_lane(sid, lane) for sid in self._last_step)

    def _drain(self, waiting: list[Job]) -> None:
        while True:
            try:
                waiting.append(self._receive.receive_nowait())
            except trio.WouldBlock:
                return

    async def _align(self, waiting: list[Job]) -> None:
        """Wait a little for the next steps of the other sessions decoding here.

        In a chain, a stage's steps come from the previous stage (or from the entry's
        generation loops) one frame at a time; running whatever is queued would split the
        sessions into small calls, and they would stay split, each group going round the
        chain on its own. Every decoding session comes back about once per its *period*
        (the time between its last two steps here), so its next arrival is predictable:
        the round waits for the sessions expected within half the period of the steps
        already queued (at most ``align_s``). Of two groups going round, one always finds
        the other within that window, so they merge and then stay together (a stage hands
        the next one a whole batch at once). A session that is overdue (a slow client, a
        generation that ended) is not waited for, so it costs nothing."""
        periods = [self._step_period.get(job.session_id) for job in waiting if _is_step(job)]
        known = [p for p in periods if p is not None]
        if self.align_s <= 0 or not known:
            return
        budget = min(self.align_s, 0.5 * min(known))
        now = time.monotonic()
        deadline = now + budget
        while True:
            here, lane = {job.session_id for job in waiting}, self._first_lane(waiting)
            expected = [
                self._last_step[sid] + period for sid, period in self._step_period.items()
                if sid not in here and sid in self._last_step and self._in_lane(sid, lane)
            ]  # fmt: skip
            if not any(now - budget <= at <= deadline for at in expected):
                return
            with trio.move_on_after(max(0.0, deadline - now)):
                waiting.append(await self._receive.receive())
                self._drain(waiting)
                now = time.monotonic()
                continue
            return

    def _note_arrival(self, job: Job, is_step: bool) -> None:
        if is_step:
            self._note_step(job.session_id, job.enqueued, job.lane)
            return
        self._last_step.pop(job.session_id, None)
        self._step_period.pop(job.session_id, None)
        self._lane_of.pop(job.session_id, None)

    def _note_step(self, sid: SessionId, arrived: float, lane: int) -> None:
        """Learn each decoding session's period: the time between its steps' arrivals."""
        last = self._last_step.get(sid)
        self._last_step[sid] = arrived
        self._lane_of[sid] = lane % self.decode_lanes
        if last is not None:
            period = arrived - last
            known = self._step_period.get(sid)
            self._step_period[sid] = period if known is None else 0.7 * known + 0.3 * period

    def _slice_tokens(self) -> int:
        """Positions of one prefill slice: ``prefill_slice_tokens``, fewer if that would take
        longer than ``prefill_slice_s`` at the prefill speed measured last."""
        most = self.prefill_slice_tokens
        if self._prefill_s_per_token is None:
            return most
        fits = int(self.prefill_slice_s / max(self._prefill_s_per_token, 1e-9))
        return max(min(16, most), min(most, fits))

    def _step_lane(self, job: Job) -> int | None:
        """The lane ``job`` runs in: None for anything but a decode step (a round runs those
        whatever its lane), or when this stage runs one lane."""
        return job.lane % self.decode_lanes if self.decode_lanes > 1 and _is_step(job) else None

    def _first_lane(self, waiting: list[Job]) -> int | None:
        """The lane the round will run, for its waits: that of the first decode step waiting
        (a round defers the other lanes' steps, which come first in the next round, so the
        lanes take turns). None: one lane for all."""
        return next((lane for lane in map(self._step_lane, waiting) if lane is not None), None)

    def _in_lane(self, session_id: SessionId, lane: int | None) -> bool:
        """Whether a round running ``lane`` (None: every lane) waits for ``session_id``'s
        next step (see :meth:`_gather`, :meth:`_align`)."""
        return lane is None or self._lane_of.get(session_id, 0) == lane

    def _streaming_sessions(self, waiting: list[Job]) -> set[SessionId]:
        """Sessions with work waiting or that used the stage within the interleave window."""
        cutoff = time.monotonic() - self.interleave_window_s
        recent = {sid for sid, used in self._last_used.items() if used >= cutoff}
        return recent | {job.session_id for job in waiting if job.item is not None}

    async def _run_batch(self, batch: list[_Work]) -> None:
        if batch[0].item is None:
            job = batch[0].job
            if job.rename_to is not None:
                await _deliver(job, StageResult(length=await self._adopt(job.session_id, job.rename_to)))
                return
            closed = await self.engine_thread.run(self.engine.close_session, job.session_id)
            self._forget(job.session_id)
            self._evicted.pop(job.session_id, None)
            log.debug("closed session %s (%s)", job.session_id, "freed" if closed else "none held")
            await _deliver(job, StageResult())
            return
        # Decode steps first, answered before any prefill slice runs: a streaming session's
        # next token must not wait behind another session's prompt.
        steps = [w for w in batch if w.is_step]
        rest = [w for w in batch if not w.is_step]
        continued: list[Job] = []
        for group in (steps, rest):
            if group:
                continued += await self._run_group(group)
        self._deferred[:0] = continued

    def _forget(self, session_id: SessionId) -> None:
        """Drop what the stage tracks of a session whose slot was freed."""
        for table in (self._last_used, self._last_step, self._step_period, self._lane_of, self._source_of):
            table.pop(session_id, None)
        if self.kept is not None:
            self.kept.drop(session_id)

    def _note_source(self, job: Job, batched: set[SessionId]) -> None:
        """Remember who opened ``job``'s new session. A new session whose first job fails
        leaves its entry behind: pruned when the table grows."""
        self._source_of[job.session_id] = job.source
        if len(self._source_of) > 2 * self.engine.config.max_sessions:
            self._prune_sources(batched)

    def _prune_sources(self, batched: set[SessionId]) -> None:
        """Keep the sessions the engine holds and those ``batched`` in the round being built
        (new ones, not computed yet)."""
        self._source_of = {sid: s for sid, s in self._source_of.items()
                           if sid in batched or self.engine.session_length(sid) > 0}  # fmt: skip

    async def _evict_for(self, job: Job, busy: set[SessionId]) -> bool:
        """Free a slot for ``job``'s new session if fair shares say a session of another
        source must give it up (``node.slot_share``); whether one was freed. Not for a job
        that cannot open a session (it starts past position 0, or holds no position or more
        than a context: a stale frame of a closed session, or a peer's way to evict sessions
        while it never holds a slot)."""
        item = job.item
        if item is None or item.start_pos != 0 or not 0 < item.n_tokens <= self.engine.config.context_length:
            return False
        self._prune_sources(busy)  # only a session the engine holds frees a slot
        now = time.monotonic()
        self._evicted_at = {s: at for s, at in self._evicted_at.items() if now - at < self.evict_interval_s}
        victim = fair_victim(self._source_of, self._last_used, job.source, busy, spared=self._evicted_at)
        if victim is None:
            return False
        source = self._source_of[victim]
        # Its hop too: entries behind one previous hop are sources of their own, and a peer
        # opening and closing a session over and over took one from each in turn.
        self._evicted_at[source] = self._evicted_at[hop_of(source)] = now
        log.warning("evicting session %s of a source holding %d of %d slots, for a session of another", victim,
                    sum(1 for s in self._source_of.values() if s == self._source_of[victim]), self.engine.config.max_sessions)  # fmt: skip
        await self.engine_thread.run(self.engine.close_session, victim)
        self._forget(victim)
        if self.on_evict is not None:
            await self.on_evict(victim)
        self._evicted[victim] = None
        if len(self._evicted) > _MAX_EVICTED:
            del self._evicted[next(iter(self._evicted))]
        self.stats.evicted += 1
        return True

    async def _adopt(self, old: SessionId, new: SessionId) -> int:
        """Rename a session and what it keeps; the positions the new id can be trusted with:
        its cache, and for a stage that keeps outputs, no more than it can send again."""
        length = await self.engine_thread.run(self.engine.rename_session, old, new)
        if length == 0:
            return 0
        self.stats.adopted += 1
        self._last_used[new] = self._last_used.pop(old, time.monotonic())
        for timing in (self._last_step, self._step_period, self._lane_of, self._source_of):
            if old in timing:
                timing[new] = timing.pop(old)
        if self.kept is None:
            return length if self.engine.info.is_last else 0
        self.kept.rename(old, new)
        return min(length, self.kept.length(new))

    async def _run_group(self, group: list[_Work]) -> list[Job]:
        """One engine call for ``group``; delivers finished jobs, returns those with slices left."""
        for work in group:
            self._count_recomputed(work)
        started = time.monotonic()
        inline = self._may_run_inline(sum(w.item.n_tokens for w in group))
        if inline:
            results = self._compute(group)
        else:
            results = await self.engine_thread.run(self._compute, group)
        now = time.monotonic()
        elapsed = now - started
        if inline:
            self.stats.inline_cpu_seconds += elapsed
        continued: list[Job] = []
        for work, result in zip(group, results):
            finished = self._finish(work, result, now)
            if finished is None:
                continued.append(work.job)
            else:
                await _deliver(work.job, finished)
        # Counted after the results left: in a chain the next stage is computing meanwhile.
        self._count(group, results, elapsed)
        return continued

    def _count_recomputed(self, work: _Work) -> None:
        if work.job.done == 0 and work.item is not None:
            self.stats.recomputed += max(0, self.engine.session_length(work.job.session_id) - work.item.start_pos)

    def _finish(self, work: _Work, result: StageResult, now: float) -> StageResult | None:
        """Book one computed work: None when its job has slices left (it is continued),
        else what to deliver (a finished job's whole output, kept; or its error)."""
        job = work.job
        if result.error is not None:
            self._count_error()
            return result
        self._last_used[job.session_id] = now
        if not work.final:
            if result.output is not None and result.output.hidden is not None:
                job.hidden_parts.append(result.output.hidden)
            job.done += work.item.n_tokens
            return None
        self._note_arrival(job, work.is_step)
        assert job.item is not None, "only a job with an item is computed"
        return self._keep(job.session_id, job.item.start_pos, _whole_job_result(job, result))

    def _count_error(self) -> None:
        self.stats.errors += 1
        if self.on_error is not None:
            self.on_error()

    def _count(self, group: list[_Work], results: list[StageResult], elapsed: float) -> None:
        computed = [w for w, r in zip(group, results) if r.error is None]
        if not computed:
            return
        tokens = sum(w.item.n_tokens for w in computed)
        if not any(w.is_step for w in computed):
            per_token = elapsed / tokens
            last = self._prefill_s_per_token
            self._prefill_s_per_token = per_token if last is None else 0.7 * last + 0.3 * per_token
            self._record(tokens, elapsed)
        elif all(w.is_step for w in computed):
            self._record(tokens, elapsed, steps=len(computed), lane=self._step_lane(computed[0].job))
        else:
            self._record(tokens, elapsed)

    def _record(self, tokens: int, elapsed: float, *, steps: int = 0, lane: int | None = None) -> None:
        """Count one engine call of ``tokens`` positions; ``steps``: the decode steps it ran,
        when it ran nothing else (in ``lane``)."""
        self.stats.record(tokens, elapsed, self._n_layers, decode=steps > 0, steps=steps, lane=lane or 0)
        if self.on_batch is not None:
            self.on_batch(tokens, elapsed * 1000)

    def _keep(self, session_id: SessionId, start_pos: int, result: StageResult) -> StageResult:
        """Encode a finished job's hidden states for the wire once, and keep them; ``result``
        (made for this job, not delivered yet) with them as ``sent``. Set on it rather than
        on a copy: a second result object a hop was a call on cold caches."""
        output = result.output
        if self.kept is None or output is None or output.hidden is None:
            return result
        result.sent = sent = tensors.encode(output.hidden, self.kept.wire_dtype, half=output.half)
        self.kept.put(session_id, start_pos, sent, lambda sid: self.engine.session_length(sid) > 0)
        return result

    def _compute(self, group: list[_Work]) -> list[StageResult]:
        """One engine call, then sampling on the last range (on the engine thread, or inline)."""
        return self._forward([w.item for w in group], [w.job.sampling if w.final else None for w in group])

    def _forward(self, items: list[BatchItem], samplings: list[SamplingParams | None]) -> list[StageResult]:
        try:
            outputs = self.engine.forward(items)
        except Exception as exc:  # noqa: BLE001 - a bug must fail the batch, not kill the peer
            if isinstance(exc, EngineError) and len(items) > 1:
                # One bad item must not fail its neighbours: retry each alone.
                return [r for item, sampling in zip(items, samplings) for r in self._forward([item], [sampling])]
            return [_failed(exc)] * len(items)
        return [_sampled(out, sampling, item) for item, sampling, out in zip(items, samplings, outputs)]

    async def _expire_idle_sessions(self) -> None:
        period = min(60.0, max(1.0, self.session_idle_s / 4))
        while True:
            await sleep_to_tick(period)
            cutoff = time.monotonic() - self.session_idle_s
            for session_id, used in list(self._last_used.items()):
                if used < cutoff:
                    log.info("freeing session %s: idle for %.0f s", session_id, self.session_idle_s)
                    await self.submit(Job(None, session_id, _ignore))

    async def close_engine(self) -> None:
        """Free the engine (on its thread, after every call queued there), then end the thread."""
        try:
            await self.engine_thread.run(self.engine.close)
        finally:
            self.engine_thread.close()

    async def fail_pending(self, error: EngineError) -> None:
        """Answer every queued job with ``error`` (the stage is going away), so the peers
        waiting on them hear why instead of timing out."""
        pending, self._deferred = self._deferred, []
        while True:
            try:
                pending.append(self._receive.receive_nowait())
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                break
        for job in pending:
            await _deliver(job, StageResult(error=error) if job.item is not None else StageResult())


def _first_ready_control(waiting: list[Job]) -> Job | None:
    """The first close (or adopt) with nothing of its session queued before it. It runs
    alone and at once, ahead of other sessions' work: it is cheap, and it may free the slot
    a new session waits for. Left in line instead, it waited behind every job queued before
    it, however many another peer (a stranger's flood: admission lets it keep 64) kept
    there, and no slot was freed meanwhile."""
    earlier: set[SessionId] = set()
    for job in waiting:
        if job.item is None and job.session_id not in earlier:
            return job
        earlier.add(job.session_id)
    return None


def _is_step(job: Job) -> bool:
    return job.item is not None and job.item.n_tokens == 1


def _track(job: Job, pending: dict[SessionId, int]) -> None:
    job.pending_in = pending
    for session_id in _ids(job):
        pending[session_id] = pending.get(session_id, 0) + 1


def _settle(job: Job) -> None:
    """The job is no longer the stage's (delivered, or never queued); once per job."""
    pending, job.pending_in = job.pending_in, None
    if pending is None:
        return
    for session_id in _ids(job):
        left = pending.get(session_id, 1) - 1
        if left > 0:
            pending[session_id] = left
        else:
            pending.pop(session_id, None)


def _ids(job: Job) -> tuple[SessionId, ...]:
    return (job.session_id,) if job.rename_to is None else (job.session_id, job.rename_to)


async def _deliver(job: Job, result: StageResult) -> None:
    """Hand a result on; a failing callback (the network side) is this job's problem alone."""
    _settle(job)
    try:
        await job.deliver(result)
    except Exception:  # noqa: BLE001 - one job's delivery must not end the stage worker
        log.exception("delivering the result of session %s failed", job.session_id)


async def _ignore(_: StageResult) -> None:
    return None


def _failed(exc: Exception) -> StageResult:
    """An engine call's failure as its job's result: the engine's own errors as they are,
    anything else (a bug) logged and as DecodeFailed. Call it in the ``except`` block."""
    if isinstance(exc, EngineError):
        return StageResult(error=exc)
    log.exception("engine call failed")
    return StageResult(error=DecodeFailed(f"engine failure: {exc}"))


def _sampled(out: StageOutput, sampling: SamplingParams | None, item: BatchItem) -> StageResult:
    """``out``, with the token sampled from it where it has logits and its job asks for one."""
    if out.logits is None or sampling is None:
        return StageResult(output=out)
    try:
        return StageResult(output=out, token=sample(out.logits, sampling, item.start_pos + item.n_tokens))
    except ValueError as exc:  # NaN logits from corrupt upstream input: this job only
        return StageResult(error=InvalidBatch(str(exc)))


def _whole_job_result(job: Job, last: StageResult) -> StageResult:
    """A job computed in slices answers as if computed at once: all its hidden states."""
    if not job.hidden_parts or last.output is None or last.output.hidden is None:
        return last
    hidden = np.concatenate([*job.hidden_parts, last.output.hidden])
    job.hidden_parts = []
    return StageResult(output=StageOutput(job.session_id, hidden=hidden), token=last.token)
