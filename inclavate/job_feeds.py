"""Watching this peer's jobs (``GET /v1/generations/:id/events``): one read per job change,
whatever the number of watchers, and a bounded number of watchers.

Each watched job has a :class:`_Feed`: the job's record as the API sends it (serialized
once), a version, and an event its watchers wait on. :class:`~inclavate.job_runner.JobRunner`
calls :meth:`JobFeeds.changed` after each write to a job with the row the write returned;
that serializes it once (if anyone watches it) and wakes that job's watchers only, who send
the stored payload. Only where no row is at hand (an erasure, a write that matched nothing)
does it read the job back.

Before (an audit, 2026-12-07): every watcher waited on one peer-wide event, and re-read its
job from SQLite and re-serialized it (params up to 64 KiB) at every write of *any* job and
at every 1 s tick, on the event loop, with no bound on watchers: 1,500 of them made every
``/health`` time out for minutes and the swarm marked the peer Dead.

A feed lives while it has watchers: the last one leaving (the job ended, or it
disconnected) removes it, so the table holds at most :data:`MAX_WATCHERS` entries.

Each stream also counts against its client's source (``inclavate.source_table.source_of``:
an IPv4 address, an IPv6 /64), at most :data:`MAX_WATCHERS_PER_SOURCE` (a review,
2026-12-07: one address could hold all 256 places, and every other client's watch was a 429).
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import AsyncGenerator, Callable

import trio

from inclavate.errors import InclavateError
from inclavate.jobs import Job, JobStoreError
from inclavate.key_counts import KeyCounts
from inclavate.places import Place

log = logging.getLogger(__name__)

MAX_WATCHERS_PER_JOB = 16
"""Event streams one job may have open here. An honest job has a few: a tab or two, and the
peers relaying for their clients (each relays at most
:data:`~inclavate.peer_http.MAX_EVENT_STREAMS_PER_OWNER` = 16 of one owner's streams, the
same number). Past it, one client is multiplying sends of the same record."""
MAX_WATCHERS = 256
"""Event streams all of this peer's jobs may have open here: the default queue's 32 live
jobs (``RunnerConfig.max_active``) with 8 watchers each. Each holds a connection and gets a
send of its job's record (up to ``MAX_RECORD_BYTES``) per change; unbounded, one client
held the API's whole connection share."""
MAX_WATCHERS_PER_SOURCE = 32
"""Of :data:`MAX_WATCHERS`, the event streams one source (an IPv4 address, an IPv6 /64) may
hold here. 32 is ``RunnerConfig.max_active``: one client may watch every live job of this
peer once. A peer relaying for its clients is one source too, and holds at most
:data:`~inclavate.peer_http.MAX_EVENT_STREAMS_PER_OWNER` = 16 of this peer's streams (its
own cap per owner), so an honest relay never meets this bound and leaves as many again to
the clients, or another peer, behind the same address. Relayed streams are not exempt:
the forwarded header grants nothing (anyone may send it), and exempting it would give any
client the whole peer back. Several relays behind one address past 32 (a NAT, a local swarm
on one host) get the 429, and their relays fall back to polling the job
(:meth:`~inclavate.generations.GenerationService.events`): late by a second, not lost.
It takes 8 sources to fill the peer."""
RETRY_AFTER_S = 2
"""A watcher's place frees when a job ends or a watcher leaves; jobs take seconds."""

DONE = "[DONE]"


class WatchersFull(InclavateError):
    """This job, this peer, or this client's address has as many event streams open as it
    may (429: retry, or poll ``GET /v1/generations/:id``)."""

    retry_after_s = RETRY_AFTER_S


class _Feed:
    """One watched job: its latest payload, bumped ``version`` per change a client sees."""

    __slots__ = ("payload", "version", "ended", "watchers", "moved")

    def __init__(self, payload: str, ended: bool) -> None:
        self.payload = payload
        self.version = 0
        self.ended = ended
        """The job finished or was erased: no change comes any more."""
        self.watchers = 0
        self.moved = trio.Event()
        """Set (and replaced) at each change; a watcher waits on its own job's only."""

    def publish(self, payload: str | None, ended: bool) -> None:
        """A new state (None: the job is gone); wakes the watchers if a client sees it."""
        if payload is not None and payload != self.payload:  # a write that changed nothing a client sees is no event
            self.payload = payload
            self.version += 1
        elif not ended or self.ended:
            return
        self.ended = ended
        self.moved.set()
        self.moved = trio.Event()


class JobFeeds:
    """This peer's watched jobs (see the module's docstring); ``read`` reads one job's row."""

    def __init__(self, read: Callable[[str], Job | None]) -> None:
        self._read = read
        self._feeds: dict[str, _Feed] = {}
        self.watchers = 0
        """Event streams open on this peer's jobs, all jobs together."""
        self.of_source = KeyCounts(MAX_WATCHERS_PER_SOURCE)
        """Event streams open, by source (rows only while a source holds some)."""

    def __len__(self) -> int:
        """Jobs watched now (each has at least one watcher)."""
        return len(self._feeds)

    def watch(self, job: Job, source: str = "?") -> AsyncGenerator[str, None]:
        """``job``'s SSE payloads: its current state at once, then one per change, then
        :data:`DONE`. ``source``: whom the stream counts against (``source_of`` the client's
        address; "?" where none is known). Raises :class:`WatchersFull` here, before any
        stream opens."""
        if job.finished:  # its outcome, then the end: nothing to wait for, no place taken
            return _ended(json.dumps(job.to_json()))
        feed = self._feeds.get(job.id)
        if self.watchers >= MAX_WATCHERS or (feed is not None and feed.watchers >= MAX_WATCHERS_PER_JOB):
            raise WatchersFull("this job or this peer has as many event streams open as it may; "
                               "retry later, or poll GET /v1/generations/:id")  # fmt: skip
        if self.of_source.full(source):
            raise WatchersFull(f"your address has {self.of_source.limit} event streams open here, as many as it may; "
                               "close one, retry later, or poll GET /v1/generations/:id")  # fmt: skip
        if feed is None:
            feed = _Feed(json.dumps(job.to_json()), ended=False)  # what can fail, before anything is held
        place = Place(functools.partial(self._leave, job.id, source), f"a stream of job {job.id}")  # before any count
        self._feeds[job.id] = feed
        feed.watchers += 1
        self.watchers += 1
        self.of_source.take(source)
        return _follow(feed, place)

    def changed(self, job_id: str, job: Job | None = None) -> None:
        """After a write to ``job_id``, whatever the watchers: ``job``, the row as the write
        left it (the store's writes return it), costs no read; without it (an erasure, a
        write that matched nothing) one read, if the job is watched. Before (a review,
        2026-12-07) every change read back the row its writer had just been handed."""
        feed = self._feeds.get(job_id)
        if feed is None:
            return
        if job is not None:
            feed.publish(json.dumps(job.to_json()), ended=job.finished)
            return
        try:
            job = self._read(job_id)
        except (JobStoreError, ValueError, KeyError):  # the row just written cannot be read back
            # Its watchers' streams end (they may poll); waiting on, one ending here would
            # never hear it. The runner, which called this after a write, goes on.
            log.exception("cannot read job %s back for its watchers: their streams end", job_id)
            job = None
        if job is None:  # erased by an admin while watched
            feed.publish(None, ended=True)
        else:
            feed.publish(json.dumps(job.to_json()), ended=job.finished)

    def _leave(self, job_id: str, source: str) -> None:
        self.watchers -= 1
        self.of_source.give(source)
        feed = self._feeds[job_id]
        feed.watchers -= 1
        if not feed.watchers:
            del self._feeds[job_id]


async def _ended(payload: str) -> AsyncGenerator[str, None]:
    yield payload
    yield DONE


async def _follow(feed: _Feed, place: Place) -> AsyncGenerator[str, None]:
    """The feed's payloads from its current one on; a watcher slower than the changes gets
    the latest state, never a stale one, and always the final one."""
    try:
        seen = feed.version
        yield feed.payload
        while True:
            if feed.version != seen:
                seen = feed.version
                yield feed.payload
            elif feed.ended:
                break
            else:
                await feed.moved.wait()
        yield DONE
    finally:
        place.release()
