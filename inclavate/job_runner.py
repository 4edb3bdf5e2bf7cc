"""Runs this peer's generation jobs: a bounded queue, worker tasks, deadlines, cancels.

The queue *is* the job table (:mod:`inclavate.jobs`): a submission is a row, workers claim
the oldest queued row of a model they have, so a restart resumes exactly what was waiting.
Each worker runs one generator call at a time in a thread (``trio.to_thread``), so the event
loop never blocks and at most ``workers`` generations run at once. A generator checks its
cancel flag between frames; cancelling a job or passing its deadline sets that flag, and
the job then settles as ``cancelled`` or ``expired`` with nothing published.

A finished generation is published as a ``kind: generated`` artifact in this peer's
artifact store, then the job completes with that artifact's id. Input artifacts (the clip a
transcription reads) are fetched through ``read_input``, which may reach another peer.

Every state change wakes :meth:`JobRunner.wait_changed` (the workers, cancels and sync
waits), and a change to one job hands the row its write returned to that job's event
streams (:mod:`inclavate.job_feeds`; read back only where no write returned one), so a
watcher sees what is stored, not what was announced, at no read of its own.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

import trio

from inclavate.artifact_types import ArtifactError, ArtifactNotFound, ArtifactNotReady, ArtifactTooLarge
from inclavate.artifacts import ArtifactStore
from inclavate.errors import InclavateError
from inclavate.job_feeds import JobFeeds
from inclavate.jobs import Job, JobStore, NewJob, now_ms
from inclavate.owner_ids import new_id
from node.generators.base import (
    GenerationCancelled,
    GenerationFailed,
    GenerationTask,
    Generator,
    InputMedia,
)
from p2p.ticks import next_tick, sleep_to_tick

log = logging.getLogger(__name__)

MAX_INPUT_BYTES = 64 * 1024 * 1024
"""The spec's cap on each input artifact of a job."""

PROGRESS_INTERVAL_S = 0.25
"""Progress writes per job are throttled to this (each is a row write and an event)."""

CANCEL_SETTLE_S = 10.0
"""How long ``DELETE /v1/generations/:id`` waits for a running generator to stop, so the
answer usually shows the settled state; generators stop between frames (~1 s)."""

InputReader = Callable[[str, int], Awaitable[InputMedia]]
"""``(artifact id, max bytes) -> media``; raises ArtifactError subclasses."""


class JobFinished(InclavateError):
    """The job already ended; it cannot be cancelled (409)."""


class JobNotFound(InclavateError):
    """No such job on this peer (404)."""


class JobActive(InclavateError):
    """The job is queued or running; cancel it before erasing it (409)."""


@dataclass(frozen=True)
class RunnerConfig:
    workers: int = 1
    """Generations running at once on this peer (each holds a CPU core while it runs)."""
    max_active: int = 32
    """Queued plus running jobs accepted before submissions get 429."""
    poll_s: float = 1.0
    history_max: int = 10_000
    """Finished job records kept; older ones are forgotten (the table cannot grow forever)."""


class JobRunner:
    def __init__(
        self,
        store: JobStore,
        artifacts: ArtifactStore,
        generators: Mapping[str, Generator],
        owner: str,
        read_input: InputReader,
        config: RunnerConfig = RunnerConfig(),
        fallback: Callable[[str], Generator | None] = lambda model: None,
    ) -> None:
        self.store = store
        self.artifacts = artifacts
        self.generators = dict(generators)
        self.owner = owner
        self.config = config
        self._read_input = read_input
        self._fallback = fallback
        self._changed = trio.Event()
        self.feeds = JobFeeds(store.get)
        """Event streams of this peer's jobs, one read per job change (not per watcher)."""
        self._cancel_flags: dict[str, threading.Event] = {}
        self._expired: set[str] = set()
        self._history_changed = True
        """A job was created, started, finished or erased since :meth:`_forget_old_history`
        last looked (True at first: the history may be over the limit already)."""

    # -- service -------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        requeued = self.store.recover(now_ms())
        if requeued:
            log.info("resuming %d generation job(s) interrupted by the last shutdown", len(requeued))
        async with trio.open_nursery() as nursery:
            for _ in range(max(1, self.config.workers)):
                nursery.start_soon(self._worker)
            nursery.start_soon(self._deadlines)
            task_status.started()

    def submit(self, new: NewJob) -> tuple[Job, bool]:
        """Queue a validated job for a local generator; ``(job, created)``."""
        job, created = self.store.create(new_id(self.owner), new, max_active=self.config.max_active, now=now_ms())
        if created:
            self._notify()
        return job, created

    async def cancel(self, job_id: str) -> Job:
        job = self._get(job_id)
        if job.finished:
            raise JobFinished(f"job {job_id} already {job.state}")
        if job.state == "queued" and (cancelled := self.store.finish(job_id, "cancelled", now_ms())) is not None:
            self._notify(job_id, cancelled)
            return self._get(job_id)
        if (asked := self.store.request_cancel(job_id)) is not None:
            flag = self._cancel_flags.get(job_id)
            if flag is not None:
                flag.set()
            self._notify(job_id, asked)
        with trio.move_on_after(CANCEL_SETTLE_S):
            while not (job := self._get(job_id)).finished:
                await self.wait_changed(1.0)
        return self._get(job_id)

    async def erase(self, job_id: str, *, artifacts: bool) -> int:
        """Delete a finished job's record, and its output artifacts unless told not to;
        returns how many artifacts were deleted (a missing one is not an error)."""
        job = self._get(job_id)
        if not job.finished:
            raise JobActive(f"job {job_id} is {job.state}; cancel it first")
        deleted = 0
        if artifacts:
            for artifact_id in job.output_artifacts:
                try:
                    await self.artifacts.delete(artifact_id)
                    deleted += 1
                except ArtifactNotFound:
                    pass
        self.store.delete(job_id)
        self._notify(job_id)
        return deleted

    async def wait_changed(self, timeout: float) -> None:
        """Return at the next job change on this peer, or at the next tick of ``timeout``
        seconds (at most that long; :mod:`p2p.ticks`: idle pollers wake together)."""
        with trio.move_on_at(next_tick(trio.current_time(), timeout)):
            await self._changed.wait()

    def _get(self, job_id: str) -> Job:
        job = self.store.get(job_id)
        if job is None:
            raise JobNotFound(f"no generation job {job_id}")
        return job

    def _forget_old_history(self) -> None:
        """Prune finished records past ``history_max`` once they exceed it by a tenth, and
        look only after a change. Pruning sorts every finished record: run every second,
        a peer holding the default 10,000 spent ~11 ms of its event loop each second at
        idle, forever, and one configured for millions stalled it for seconds."""
        if not self._history_changed:
            return
        self._history_changed = False
        keep = self.config.history_max
        if self.store.finished_count() > keep + keep // 10 and self.store.prune_finished(keep):
            self._notify()
            self._history_changed = False  # our own pruning is no news to this check

    def _notify(self, job_id: str | None = None, job: Job | None = None) -> None:
        """A job changed (``job_id``, whose watchers then get ``job``, the row the write
        returned, or where there is none one read of it; None: a new job or pruned finished
        ones, which nobody watches)."""
        self._history_changed = True
        if job_id is not None:
            self.feeds.changed(job_id, job)  # a row that cannot be read back ends its watchers' streams, nothing else
        self._changed.set()
        self._changed = trio.Event()

    # -- workers -------------------------------------------------------------------------

    async def _worker(self) -> None:
        while True:
            job = self.store.next_queued()
            if job is None:
                await self.wait_changed(self.config.poll_s)
                continue
            started = self.store.start(job.id, now_ms())
            if started is None:
                continue  # another worker claimed it
            self._notify(job.id, started)
            try:
                await self._execute(started)
            except Exception:  # noqa: BLE001 - one job's bug must not stop the worker
                log.exception("generation job %s crashed", job.id)
                self._settle(job.id, "failed", error_code="inference_failed", error_message="internal error")

    def generator(self, model: str) -> Generator | None:
        """The generator that runs ``model`` here (a loaded one, else the fallback's)."""
        return self.generators.get(model) or self._fallback(model)

    async def _execute(self, job: Job) -> None:
        flag = self._cancel_flags[job.id] = threading.Event()
        try:
            generator = self.generator(job.model)
            if generator is None:  # e.g. its model was removed while the job waited
                raise GenerationFailed("inference_failed", f"no generator for {job.model} on this peer any more")
            task = await self._task(job)
            if task is None:
                return
            output = await trio.to_thread.run_sync(generator.run, task, flag.is_set,
                                                   self._progress_reporter(job.id))  # fmt: skip
            writer = None
            try:
                writer = self.artifacts.begin(media_type=output.media_type, kind="generated", pending=True)
                async with writer:
                    await writer.write(output.data)
                    meta = await writer.commit()
            except BaseException as exc:
                # No job names the row (a shutdown cancels the write once the generator has
                # finished): a failed row left here would stay for good.
                if writer is not None:
                    with trio.CancelScope(shield=True):
                        await self._forget(writer.id)
                if not isinstance(exc, ArtifactError):
                    raise
                self._settle(job.id, "failed", error_code="publish_failed", error_message=str(exc))
                return
            if not self._settle(job.id, "completed", outputs=(meta.id,)):
                await self.artifacts.delete(meta.id)  # the job ended meanwhile: keep nothing
        except GenerationCancelled:
            if job.id in self._expired:
                self._settle(job.id, "expired", error_code="deadline_exceeded",
                             error_message="the job's deadline passed while it ran")  # fmt: skip
            else:
                self._settle(job.id, "cancelled")
        except GenerationFailed as exc:
            self._settle(job.id, "failed", error_code=exc.code, error_message=exc.message)
        finally:
            self._cancel_flags.pop(job.id, None)
            self._expired.discard(job.id)

    async def _forget(self, artifact_id: str) -> None:
        try:
            await self.artifacts.delete(artifact_id)
        except (ArtifactError, OSError) as exc:  # gone already, or the disk failed: nothing more to do
            log.debug("could not delete the unfinished output %s: %s", artifact_id, exc)

    async def _task(self, job: Job) -> GenerationTask | None:
        """Read the inputs; an understanding job's missing prompt or inputs fail it here."""
        if job.modality == "text":
            prompt = job.params.get("prompt")
            if not isinstance(prompt, str) or not prompt.strip():
                self._settle(job.id, "failed", error_code="no_prompt", error_message="params.prompt is empty or absent")
                return None
            if not job.input_artifacts:
                self._settle(job.id, "failed", error_code="no_input", error_message="no input_artifacts were given")
                return None
        # An input named again is the same bytes, read once: a job may name one 16 times (the
        # spec keeps their order), and each was read into a copy of its own (a chat-model job
        # grew its peer by 2.8 GB from one 16 MiB upload; an audit, 2026-12-07).
        read: dict[str, InputMedia] = {}
        for artifact_id in job.input_artifacts:
            if artifact_id in read:
                continue
            try:  # refused on the artifact's size before its bytes are read
                read[artifact_id] = await self._read_input(artifact_id, MAX_INPUT_BYTES)
            except ArtifactTooLarge as exc:
                self._settle(job.id, "failed", error_code="input_too_large", error_message=str(exc))
                return None
            except (ArtifactError, ArtifactNotReady, InclavateError) as exc:
                self._settle(job.id, "failed", error_code="input_unreadable", error_message=str(exc))
                return None
        inputs = tuple(read[artifact_id] for artifact_id in job.input_artifacts)
        return GenerationTask(job.id, job.model, job.modality, job.params, job.seed, inputs)  # type: ignore[arg-type]

    def _progress_reporter(self, job_id: str) -> Callable[[str, float], None]:
        token = trio.lowlevel.current_trio_token()
        last: list[object] = [None, 0.0]

        def report(stage: str, fraction: float) -> None:  # runs in the generator's thread
            now = time.monotonic()
            if stage == last[0] and now - float(last[1]) < PROGRESS_INTERVAL_S and fraction < 1.0:  # type: ignore[arg-type]
                return
            last[0], last[1] = stage, now
            try:
                trio.from_thread.run_sync(self._progress, job_id, stage, fraction, trio_token=token)
            except trio.RunFinishedError:
                pass

        return report

    def _progress(self, job_id: str, stage: str, fraction: float) -> None:
        if (job := self.store.progress(job_id, stage, max(0.0, min(1.0, fraction)))) is not None:
            self._notify(job_id, job)

    def _settle(self, job_id: str, state: str, **fields: object) -> bool:
        job = self.store.finish(job_id, state, now_ms(), **fields)  # type: ignore[arg-type]
        self._notify(job_id, job)  # None (it had ended already): read back, as before
        return job is not None

    # -- deadlines -----------------------------------------------------------------------

    async def _deadlines(self) -> None:
        while True:
            self._forget_old_history()
            for job in self.store.overdue(now_ms()):
                if job.state == "queued":
                    self._settle(job.id, "expired", error_code="deadline_exceeded",
                                 error_message="the job's deadline passed before it started")  # fmt: skip
                elif job.id in self._cancel_flags:
                    self._expired.add(job.id)
                    self._cancel_flags[job.id].set()
            await sleep_to_tick(self.config.poll_s)
