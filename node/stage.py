"""A stage: one engine serving every session routed through it, batched.

Work arrives as jobs (one session's tokens or hidden states) on a queue. The worker takes
the first job, then every other job already waiting, up to ``max_batch_tokens`` and one job
per session, and runs them as one engine call: decode steps of concurrent sessions share a
pass over the weights. A session's jobs are run in arrival order (a later one waits for the
next batch), which is what lets a prefill arrive as several chunks.

Results leave through each job's ``deliver`` callback, awaited in order; the network layer
uses it to pass hidden states on or send the sampled token home. The stage knows nothing
of the network. Sessions idle for ``session_idle_s`` are freed, so an entry peer that died
mid-generation does not pin KV cache forever.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import trio

from inclavate.errors import InclavateError
from inclavate.types import SessionId
from node.engine import BatchItem, LayerEngine, StageOutput
from node.errors import DecodeFailed, EngineError, InvalidBatch, SessionLimitReached
from node.sampling import SamplingParams, sample

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StageResult:
    """What a job produced: hidden states to pass on, or (last range) the sampled token."""

    output: StageOutput | None = None
    token: int | None = None
    error: InclavateError | None = None


Deliver = Callable[[StageResult], Awaitable[None]]


@dataclass(eq=False)
class Job:
    item: BatchItem | None
    """None for a close request."""
    session_id: SessionId
    deliver: Deliver
    sampling: SamplingParams | None = None
    enqueued: float = field(default_factory=time.monotonic)


@dataclass
class StageStats:
    """Counters the peer gossips: tokens through this range and the step time per layer."""

    tokens: int = 0
    batches: int = 0
    errors: int = 0
    step_ms_per_layer: float = 0.0
    _ema_alpha: float = 0.2

    def record(self, tokens: int, seconds: float, layers: int) -> None:
        self.tokens += tokens
        self.batches += 1
        per_layer = seconds * 1000 / max(1, layers)
        self.step_ms_per_layer = (
            per_layer if self.batches == 1 else (1 - self._ema_alpha) * self.step_ms_per_layer + self._ema_alpha * per_layer
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
        inline_tokens: int = 0,
    ) -> None:
        self.engine = engine
        self.inline_tokens = inline_tokens
        """Batches this small run on the event loop thread instead of a worker thread."""
        self.on_batch = on_batch
        """Told (tokens, milliseconds) after every batch: the peer's metrics recorder."""
        self.on_error = on_error
        self.admission_timeout_s = admission_timeout_s
        self.max_batch_tokens = max_batch_tokens
        self.session_idle_s = session_idle_s
        self.stats = StageStats()
        self._send, self._receive = trio.open_memory_channel[Job](queue_size)
        self._deferred: list[Job] = []
        self._last_used: dict[SessionId, float] = {}

    async def submit(self, job: Job) -> None:
        """Queue a job; waits only when the queue is full (backpressure on the sender)."""
        await self._send.send(job)

    def try_submit(self, job: Job) -> bool:
        try:
            self._send.send_nowait(job)
            return True
        except trio.WouldBlock:
            return False

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
                if not batch:
                    continue
                try:
                    await self._run_batch(batch)
                except Exception as exc:  # noqa: BLE001 - a bug fails this batch, never the stage
                    log.exception("stage batch failed")
                    for job in batch:
                        await _deliver(job, StageResult(error=DecodeFailed(f"stage failure: {exc}")))

    async def _next_batch(self) -> list[Job]:
        """The next jobs to run together; may be empty when every waiting job awaits a slot."""
        waiting = self._deferred
        self._deferred = []
        if not waiting:
            waiting.append(await self._receive.receive())
        while True:
            try:
                waiting.append(self._receive.receive_nowait())
            except trio.WouldBlock:
                break
        batch: list[Job] = []
        blocked: set[SessionId] = set()  # sessions whose earlier job waits: keep their order
        tokens = 0
        free_slots = self.engine.config.max_sessions - self.engine.memory().sessions
        for index, job in enumerate(waiting):
            if job.session_id in blocked:
                self._deferred.append(job)
                continue
            if job.item is None and not batch:
                self._deferred.extend(waiting[index + 1 :])
                return [job]  # a close runs alone, in order with its session's other jobs
            n = job.item.n_tokens if job.item is not None else 0
            new = job.item is not None and self.engine.session_length(job.session_id) == 0
            if new and free_slots <= 0:
                # Every slot is taken: wait for a session to close rather than fail, within
                # the admission timeout; later jobs of other sessions go ahead.
                if time.monotonic() - job.enqueued > self.admission_timeout_s:
                    await _deliver(job, StageResult(error=SessionLimitReached(
                        f"all {self.engine.config.max_sessions} session slots of {self.engine.info.model_id} "
                        f"{self.engine.info.layers} stayed busy for {self.admission_timeout_s:g} s")))  # fmt: skip
                    continue
            if job.item is None or (new and free_slots <= 0) or (batch and tokens + n > self.max_batch_tokens):
                self._deferred.append(job)
                blocked.add(job.session_id)
                continue
            batch.append(job)
            blocked.add(job.session_id)
            tokens += n
            free_slots -= new
        if not batch and self._deferred:
            # Nothing can run until something arrives (a close frees a slot) or a waiting
            # job's admission times out.
            with trio.move_on_after(0.5):
                self._deferred.append(await self._receive.receive())
        return batch

    async def _run_batch(self, batch: list[Job]) -> None:
        if batch[0].item is None:
            closed = await trio.to_thread.run_sync(self.engine.close_session, batch[0].session_id)
            self._last_used.pop(batch[0].session_id, None)
            log.debug("closed session %s (%s)", batch[0].session_id, "freed" if closed else "none held")
            await _deliver(batch[0], StageResult())
            return
        started = time.monotonic()
        if sum(j.item.n_tokens for j in batch if j.item) <= self.inline_tokens:
            # A decode step is a few ms of engine time; handing it to a worker thread and
            # back costs two thread switches on the latency path of every hop.
            results = self._compute(batch)
        else:
            results = await trio.to_thread.run_sync(self._compute, batch)
        elapsed = time.monotonic() - started
        computed = [j for j, r in zip(batch, results) if r.error is None]
        if computed:
            tokens = sum(j.item.n_tokens for j in computed if j.item)
            self.stats.record(tokens, elapsed, len(self.engine.info.layers))
            if self.on_batch is not None:
                self.on_batch(tokens, elapsed * 1000)
        now = time.monotonic()
        for job, result in zip(batch, results):
            if result.error is None:
                self._last_used[job.session_id] = now
            else:
                self.stats.errors += 1
                if self.on_error is not None:
                    self.on_error()
            await _deliver(job, result)

    def _compute(self, batch: list[Job]) -> list[StageResult]:
        """Runs in a worker thread: one engine call, then sampling on the last range."""
        try:
            outputs = self.engine.forward([j.item for j in batch if j.item is not None])
        except EngineError as exc:
            if len(batch) == 1:
                return [StageResult(error=exc)]
            # One bad item must not fail its neighbours: retry each alone.
            return [r for job in batch for r in self._compute([job])]
        except Exception as exc:  # noqa: BLE001 - a bug must fail the batch, not kill the peer
            log.exception("engine call failed")
            return [StageResult(error=DecodeFailed(f"engine failure: {exc}"))] * len(batch)
        results = []
        for job, out in zip(batch, outputs):
            token = None
            if out.logits is not None and job.sampling is not None and job.item is not None:
                try:
                    token = sample(out.logits, job.sampling, job.item.start_pos + job.item.n_tokens)
                except ValueError as exc:  # NaN logits from corrupt upstream input: this job only
                    results.append(StageResult(error=InvalidBatch(str(exc))))
                    continue
            results.append(StageResult(output=out, token=token))
        return results

    async def _expire_idle_sessions(self) -> None:
        period = min(60.0, max(1.0, self.session_idle_s / 4))
        while True:
            await trio.sleep(period)
            cutoff = time.monotonic() - self.session_idle_s
            for session_id, used in list(self._last_used.items()):
                if used < cutoff:
                    log.info("freeing session %s: idle for %.0f s", session_id, self.session_idle_s)
                    await self.submit(Job(None, session_id, _ignore))

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


async def _deliver(job: Job, result: StageResult) -> None:
    """Hand a result on; a failing callback (the network side) is this job's problem alone."""
    try:
        await job.deliver(result)
    except Exception:  # noqa: BLE001 - one job's delivery must not end the stage worker
        log.exception("delivering the result of session %s failed", job.session_id)


async def _ignore(_: StageResult) -> None:
    return None
