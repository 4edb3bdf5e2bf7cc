"""Generation jobs, durable in SQLite (``<data_dir>/jobs.db``): the record every route reads.

A job is created ``queued`` (the 202 means it is on disk), moves to ``running`` when a
worker claims it and ends in exactly one terminal state::

    queued ──> running ──> completed | failed | cancelled | expired
       └──────────────────> cancelled | expired

Writes are synchronous on the trio thread (one row per write, WAL, ``synchronous=NORMAL``:
durable across a process crash). Every write bumps ``version``, which is how an event
stream notices a change without an in-process subscription. Nothing here knows generators
or HTTP; :mod:`inclavate.job_runner` drives the state machine.

Restart (:meth:`JobStore.recover`): a job found ``running`` was interrupted mid-generation.
Generators publish nothing until they finish, so running it again from the start is safe;
it is re-queued once (``attempts`` counts starts) and a second interruption fails it with
``error_code: "interrupted"`` rather than looping on a job that kills its peer. A job whose
deadline passed while the peer was down becomes ``expired``. Nothing is left ``running``.

Errors::

    JobStoreError(InclavateError)     the database cannot be used
    ├── QueueFull                      too many queued/running jobs (429, retryable)
    └── IdempotencyConflict            a key raced with another submission (409)
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from inclavate.errors import InclavateError

FILENAME = "jobs.db"
SCHEMA_VERSION = 1

JobState = Literal["queued", "running", "completed", "failed", "cancelled", "expired"]
ACTIVE: tuple[JobState, ...] = ("queued", "running")
TERMINAL: tuple[JobState, ...] = ("completed", "failed", "cancelled", "expired")

MAX_ATTEMPTS = 2
"""Starts a job gets across restarts before it is failed as ``interrupted``."""

# What a job record holds at most. The API refuses a submission whose model, params or
# inputs exceed theirs (``api/generation_request.py``), the store clips the texts a generator or an exception
# writes, and another peer's listing rows are held to all of them
# (:mod:`inclavate.job_rows`), so an honest peer's row always passes there.
MAX_MODEL_CHARS = 200
MAX_PARAMS_BYTES = 64 * 1024
"""``params`` is stored with the job and returned by every read and listing: kept small
(measured as ``len(json.dumps(params))``)."""
MAX_INPUT_ARTIFACTS = 16
MAX_OUTPUT_ARTIFACTS = 16
"""A job publishes one output today; room for generators that publish a few."""
MAX_STAGE_CHARS = 200
MAX_ERROR_CODE_CHARS = 64
MAX_ERROR_MESSAGE_CHARS = 4096
"""An error message is often ``str(exc)``: clipped here rather than left unbounded."""
MAX_RECORD_BYTES = (MAX_PARAMS_BYTES
                    + 12 * (MAX_MODEL_CHARS + MAX_STAGE_CHARS + MAX_ERROR_CODE_CHARS + MAX_ERROR_MESSAGE_CHARS)
                    + 40 * (MAX_INPUT_ARTIFACTS + MAX_OUTPUT_ARTIFACTS) + 1024)  # fmt: skip
"""The most bytes one job record takes in JSON (``Job.to_json`` as the API sends it): the
params as measured, each text character at most 12 bytes (a surrogate pair escaped), each
artifact id quoted, and the fixed fields. A listing's answer is held to its row count times
this (``inclavate.generations``), so an honest peer's answer always fits."""


class JobStoreError(InclavateError):
    """The job database cannot be opened, read or written."""


class QueueFull(JobStoreError):
    """As many jobs are queued or running as the peer accepts; retry later (429 with
    ``Retry-After: 5``: a generation runs for seconds at least)."""

    retry_after_s = 5


class IdempotencyConflict(JobStoreError):
    """Another submission with the same idempotency key is being created right now."""


@dataclass(frozen=True)
class NewJob:
    """A validated submission, before it has an id."""

    modality: str
    model: str
    params: Mapping[str, Any]
    seed: int | None = None
    input_artifacts: tuple[str, ...] = ()
    idempotency_key: str | None = None
    deadline_s: float = 600.0


@dataclass(frozen=True)
class Job:
    id: str
    state: JobState
    modality: str
    model: str
    params: Mapping[str, Any]
    seed: int | None
    input_artifacts: tuple[str, ...]
    output_artifacts: tuple[str, ...]
    progress_stage: str | None
    progress_fraction: float | None
    error_code: str | None
    error_message: str | None
    created_ms: int
    started_ms: int | None
    completed_ms: int | None
    expires_ms: int
    idempotency_key: str | None
    attempts: int
    cancel_requested: bool
    version: int

    @property
    def finished(self) -> bool:
        return self.state in TERMINAL

    def to_json(self) -> dict[str, Any]:
        """The spec's job record (``GET /v1/generations/:id``)."""
        return {
            "id": self.id,
            "state": self.state,
            "modality": self.modality,
            "model": self.model,
            "seed": self.seed,
            "params": dict(self.params),
            "input_artifacts": list(self.input_artifacts),
            "output_artifacts": list(self.output_artifacts) if self.state == "completed" else [],
            "progress_stage": self.progress_stage,
            "progress_fraction": self.progress_fraction,
            "error_code": self.error_code,
            "error_message": self.error_message,
            "created_at": rfc3339(self.created_ms),
            "started_at": rfc3339(self.started_ms),
            "completed_at": rfc3339(self.completed_ms),
            "expires_at": rfc3339(self.expires_ms),
            "artifacts_deleted": 0,
        }


def rfc3339(ms: int | None) -> str | None:
    if ms is None:
        return None
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%dT%H:%M:%S.") + f"{ms % 1000:03d}Z"


def _clip(text: str | None, limit: int) -> str | None:
    return text if text is None or len(text) <= limit else text[: limit - 3] + "..."


def now_ms() -> int:
    return int(time.time() * 1000)


_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    modality TEXT NOT NULL,
    model TEXT NOT NULL,
    params TEXT NOT NULL,
    seed INTEGER,
    input_artifacts TEXT NOT NULL,
    output_artifacts TEXT NOT NULL DEFAULT '[]',
    progress_stage TEXT,
    progress_fraction REAL,
    error_code TEXT,
    error_message TEXT,
    created_ms INTEGER NOT NULL,
    started_ms INTEGER,
    completed_ms INTEGER,
    expires_ms INTEGER NOT NULL,
    idempotency_key TEXT UNIQUE,
    attempts INTEGER NOT NULL DEFAULT 0,
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    version INTEGER NOT NULL DEFAULT 1
);
CREATE INDEX IF NOT EXISTS jobs_order ON jobs (created_ms DESC, id DESC);
CREATE INDEX IF NOT EXISTS jobs_state ON jobs (state, created_ms);
"""


class JobStore:
    def __init__(self, path: Path) -> None:
        self.path = path
        with _mapped():
            self._db = sqlite3.connect(path, isolation_level=None)
            self._db.row_factory = sqlite3.Row
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
            self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    @classmethod
    def in_dir(cls, data_dir: Path) -> JobStore:
        return cls(data_dir / FILENAME)

    def close(self) -> None:
        self._db.close()

    # -- reads ---------------------------------------------------------------------------

    def get(self, job_id: str) -> Job | None:
        with _mapped():
            row = self._db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return _job(row) if row else None

    def by_key(self, key: str) -> Job | None:
        with _mapped():
            row = self._db.execute("SELECT * FROM jobs WHERE idempotency_key = ?", (key,)).fetchone()
        return _job(row) if row else None

    def list(self, limit: int, offset: int) -> list[Job]:
        """Newest first; the id tie-break keeps pages stable for jobs of the same ms."""
        with _mapped():
            rows = self._db.execute(
                "SELECT * FROM jobs ORDER BY created_ms DESC, id DESC LIMIT ? OFFSET ?", (limit, offset)
            ).fetchall()
        return [_job(r) for r in rows]

    def active_count(self) -> int:
        with _mapped():
            return int(self._db.execute("SELECT COUNT(*) FROM jobs WHERE state IN ('queued', 'running')").fetchone()[0])

    def next_queued(self) -> Job | None:
        """The oldest queued job (first in, first out)."""
        with _mapped():
            row = self._db.execute("SELECT * FROM jobs WHERE state = 'queued' ORDER BY created_ms, id LIMIT 1").fetchone()
        return _job(row) if row else None

    def overdue(self, now: int) -> list[Job]:
        with _mapped():
            rows = self._db.execute(
                "SELECT * FROM jobs WHERE state IN ('queued', 'running') AND expires_ms <= ?", (now,)
            ).fetchall()
        return [_job(r) for r in rows]

    # -- writes --------------------------------------------------------------------------

    def create(self, job_id: str, new: NewJob, *, max_active: int, now: int) -> tuple[Job, bool]:
        """Insert a queued job; ``(job, True)``, or the first job of the same idempotency
        key and ``False``. Raises :class:`QueueFull` when ``max_active`` are waiting."""
        with self._transaction():
            if new.idempotency_key is not None:
                existing = self.by_key(new.idempotency_key)
                if existing is not None:
                    return existing, False
            if self.active_count() >= max_active:
                raise QueueFull(f"{max_active} generation jobs are already queued or running here; retry later")
            try:
                self._db.execute(
                    "INSERT INTO jobs (id, state, modality, model, params, seed, input_artifacts, created_ms,"
                    " expires_ms, idempotency_key) VALUES (?, 'queued', ?, ?, ?, ?, ?, ?, ?, ?)",
                    (job_id, new.modality, new.model, json.dumps(dict(new.params)), new.seed,
                     json.dumps(list(new.input_artifacts)), now, now + int(new.deadline_s * 1000),
                     new.idempotency_key),
                )  # fmt: skip
            except sqlite3.IntegrityError as exc:
                raise IdempotencyConflict(f"idempotency key {new.idempotency_key!r} is being used by another submission") from exc
        job = self.get(job_id)
        assert job is not None
        return job, True

    def start(self, job_id: str, now: int) -> Job | None:
        """queued -> running (a worker claimed it); None if it is no longer queued."""
        return self._update(job_id, "state = 'queued'", state="running", started_ms=now,
                            attempts_inc=True, progress_stage="loading", progress_fraction=0.0)  # fmt: skip

    def progress(self, job_id: str, stage: str, fraction: float) -> Job | None:
        return self._update(job_id, "state = 'running'", progress_stage=stage[:MAX_STAGE_CHARS],
                            progress_fraction=round(fraction, 4))  # fmt: skip

    def finish(self, job_id: str, state: JobState, now: int, *, outputs: tuple[str, ...] = (),
               error_code: str | None = None, error_message: str | None = None) -> Job | None:  # fmt: skip
        """Into a terminal state, once: a job already finished is left as it is (None)."""
        changes: dict[str, Any] = {"state": state, "completed_ms": now, "error_code": error_code,
                                   "error_message": _clip(error_message, MAX_ERROR_MESSAGE_CHARS),
                                   "output_artifacts": json.dumps(list(outputs))}  # fmt: skip
        if state == "completed":
            changes.update(progress_stage="publishing", progress_fraction=1.0)
        return self._update(job_id, "state IN ('queued', 'running')", **changes)

    def request_cancel(self, job_id: str) -> Job | None:
        return self._update(job_id, "state = 'running'", cancel_requested=1)

    def delete(self, job_id: str) -> bool:
        with _mapped():
            return self._db.execute("DELETE FROM jobs WHERE id = ?", (job_id,)).rowcount > 0

    def finished_count(self) -> int:
        """Finished job records held (through the state index: ~0.4 ms at 10,000 rows, where
        :meth:`prune_finished` sorts them all, ~11 ms)."""
        with _mapped():
            marks = ", ".join("?" * len(TERMINAL))
            return int(self._db.execute(f"SELECT count(*) FROM jobs WHERE state IN ({marks})", TERMINAL).fetchone()[0])

    def prune_finished(self, keep: int) -> int:
        """Forget the oldest finished jobs beyond the newest ``keep`` (their artifacts stay,
        under the artifact store's own retention); returns how many went."""
        with _mapped():
            return self._db.execute(
                "DELETE FROM jobs WHERE state NOT IN ('queued', 'running') AND id NOT IN ("
                " SELECT id FROM jobs WHERE state NOT IN ('queued', 'running')"
                " ORDER BY created_ms DESC, id DESC LIMIT ?)",
                (keep,),
            ).rowcount

    def recover(self, now: int) -> list[str]:
        """After a restart: expire what is overdue, re-queue or fail what was running.
        Returns the ids that were re-queued."""
        for job in self.overdue(now):
            self.finish(job.id, "expired", now, error_code="deadline_exceeded",
                        error_message="the job's deadline passed before it finished")  # fmt: skip
        requeued = []
        with _mapped():
            rows = self._db.execute("SELECT * FROM jobs WHERE state = 'running'").fetchall()
        for job in map(_job, rows):
            if job.cancel_requested:
                self.finish(job.id, "cancelled", now)
            elif job.attempts < MAX_ATTEMPTS:
                self._update(job.id, "state = 'running'", state="queued", progress_stage=None, progress_fraction=None)
                requeued.append(job.id)
            else:
                self.finish(job.id, "failed", now, error_code="interrupted",
                            error_message=f"the peer stopped while running this job {job.attempts} times; not retried")  # fmt: skip
        return requeued

    # -- internals -----------------------------------------------------------------------

    def _update(self, job_id: str, guard: str, *, attempts_inc: bool = False, **changes: Any) -> Job | None:
        sets = [f"{column} = ?" for column in changes] + ["version = version + 1"]
        if attempts_inc:
            sets.append("attempts = attempts + 1")
        with _mapped():
            cursor = self._db.execute(
                f"UPDATE jobs SET {', '.join(sets)} WHERE id = ? AND {guard}", (*changes.values(), job_id)
            )
        return self.get(job_id) if cursor.rowcount else None

    @contextmanager
    def _transaction(self) -> Iterator[None]:
        with _mapped():
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")


@contextmanager
def _mapped() -> Iterator[None]:
    # The one place sqlite3's errors become ours (a corrupt file, a full disk, a lock).
    try:
        yield
    except sqlite3.IntegrityError:
        raise
    except sqlite3.Error as exc:
        raise JobStoreError(f"job database: {exc}") from exc


def _job(row: sqlite3.Row) -> Job:
    return Job(
        id=row["id"], state=row["state"], modality=row["modality"], model=row["model"],
        params=json.loads(row["params"]), seed=row["seed"],
        input_artifacts=tuple(json.loads(row["input_artifacts"])),
        output_artifacts=tuple(json.loads(row["output_artifacts"])),
        progress_stage=row["progress_stage"], progress_fraction=row["progress_fraction"],
        error_code=row["error_code"], error_message=row["error_message"],
        created_ms=row["created_ms"], started_ms=row["started_ms"], completed_ms=row["completed_ms"],
        expires_ms=row["expires_ms"], idempotency_key=row["idempotency_key"], attempts=row["attempts"],
        cancel_requested=bool(row["cancel_requested"]), version=row["version"],
    )  # fmt: skip
