"""Event streams of local jobs (``GET /v1/generations/:id/events``) over a real job runner and
the real speech generators: one read and one serialization per change of a job, whatever
its watchers, none at other jobs' changes; bounded watchers (429 with Retry-After); nothing
left behind when watchers leave (an audit, 2026-12-07: 1,500 watchers, each re-reading its
job at every write of any job, starved the event loop until the swarm marked the peer Dead).
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from generation_harness import Served, serve_generations

from inclavate.jobs import Job, JobStore
from node.generators.base import GenerationCancelled, GenerationTask, Generator, GeneratorOutput

pytestmark = pytest.mark.slow

LONG_TEXT = " ".join(f"This is sentence number {n} of a long reading." for n in range(1, 40))
PER_JOB = 16
"""``inclavate.job_feeds.MAX_WATCHERS_PER_JOB`` (named here so the test reads, and fails on
a tree without the cap, at the assertion)."""
PAD = {"text": "Short.", "junk": "x" * 30_000}
"""A queued job's params with 30 KB that its generator ignores (what each read re-parses)."""


class Held:
    """A real generator whose runs wait until stopped (then end as cancelled), so the jobs
    behind the first one stay queued for as long as a test needs."""

    def __init__(self, inner: Generator, stop: threading.Event) -> None:
        self.inner, self.stop = inner, stop

    def __getattr__(self, name: str) -> Any:  # what the service reads of it: the real one's
        return getattr(self.inner, name)

    def run(self, task: GenerationTask, cancelled: Any, progress: Any) -> GeneratorOutput:
        while not (self.stop.wait(0.05) or cancelled()):
            pass
        raise GenerationCancelled()

    def close(self) -> None:
        pass


async def stop_at_exit(stop: threading.Event) -> None:
    """Lets held runs end when the test does, failed or not (a held thread blocks shutdown)."""
    try:
        await trio.sleep_forever()
    finally:
        stop.set()


class Counts:
    """Reads of job rows, serializations of job records (by job id) and progress writes."""

    def __init__(self) -> None:
        self.reads: Counter[str] = Counter()
        self.serialized: Counter[str] = Counter()
        self.progress = 0

    def reset(self) -> None:
        self.reads.clear()
        self.serialized.clear()
        self.progress = 0


@pytest.fixture
def counts(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counts]:
    """Counting wrappers, set on the classes before a runner captures any bound method."""
    seen = Counts()
    get, to_json, progress = JobStore.get, Job.to_json, JobStore.progress

    def counted_get(self: JobStore, job_id: str) -> Job | None:
        seen.reads[job_id] += 1
        return get(self, job_id)

    def counted_to_json(self: Job) -> dict:
        seen.serialized[self.id] += 1
        return to_json(self)

    def counted_progress(self: JobStore, *args: object, **kwargs: object) -> object:
        seen.progress += 1
        return progress(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(JobStore, "get", counted_get)
    monkeypatch.setattr(Job, "to_json", counted_to_json)
    monkeypatch.setattr(JobStore, "progress", counted_progress)
    yield seen


class Watcher:
    """One client holding a job's event stream; ``leave`` disconnects it."""

    def __init__(self, url: str, job_id: str) -> None:
        self.url, self.job_id = url, job_id
        self.events: list[str] = []
        self.first = trio.Event()
        self.status = 0
        self.headers: httpx.Headers | None = None
        self.body = b""
        self._scope = trio.CancelScope()

    async def run(self, http: httpx.AsyncClient) -> None:
        with self._scope:
            async with http.stream("GET", f"{self.url}/v1/generations/{self.job_id}/events") as stream:
                self.status, self.headers = stream.status_code, stream.headers
                if stream.status_code != 200:
                    self.body = await stream.aread()
                    self.first.set()
                    return
                async for line in stream.aiter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[6:])
                        self.first.set()

    def leave(self) -> None:
        self._scope.cancel()

    def states(self) -> list[str]:
        return [json.loads(e)["state"] if e != "[DONE]" else e for e in self.events]


async def watch(nursery: trio.Nursery, http: httpx.AsyncClient, s: Served, job_id: str, n: int) -> list[Watcher]:
    """``n`` watchers of ``job_id``, each past its first answer (an event, or an error)."""
    watchers = [Watcher(s.url, job_id) for _ in range(n)]
    for w in watchers:
        nursery.start_soon(w.run, http)
    with trio.fail_after(60):
        for w in watchers:
            await w.first.wait()
    return watchers


async def until(check, what: str) -> None:  # type: ignore[no-untyped-def]
    """Wait (polling, bounded only against a hang) for ``check()``."""
    with trio.fail_after(60):
        while not check():
            await trio.sleep(0.02)


async def submit(http: httpx.AsyncClient, params: dict) -> str:
    response = await http.post("/v1/generations", json={"model": "piper:joe", "modality": "audio", "params": params})
    assert response.status_code == 202, response.text
    return response.json()["id"]


def client(s: Served, *, address: str | None = None, relay: bool = False) -> httpx.AsyncClient:
    """A client of ``s`` (from ``address``, a loopback address of its own, when given; with
    the header a peer relaying for its clients sends, when ``relay``)."""
    from inclavate.peer_http import FORWARDED_HEADER

    limits = httpx.Limits(max_connections=64, max_keepalive_connections=8)
    transport = httpx.AsyncHTTPTransport(local_address=address, limits=limits) if address else None
    headers = {FORWARDED_HEADER: "1"} if relay else None
    return httpx.AsyncClient(base_url=s.url, timeout=60, limits=limits, transport=transport, headers=headers)


async def test_a_change_is_read_and_serialized_once_whatever_the_watchers(
        tmp_path: Path, speech_generators: dict, counts: Counts) -> None:  # fmt: skip
    watchers_n = 12
    async with serve_generations(tmp_path, speech_generators) as s, client(s) as http, trio.open_nursery() as nursery:
        running = await submit(http, {"text": LONG_TEXT})
        await until(lambda: counts.progress > 0, "the first job runs")
        queued = await submit(http, PAD)  # waits behind it (one worker)
        unwatched = await submit(http, PAD)
        watchers = await watch(nursery, http, s, queued, watchers_n)
        assert all(w.states() == ["queued"] for w in watchers)
        # Another job's writes: no read of this one (each woke every watcher, who re-read it).
        counts.reset()
        await until(lambda: counts.progress >= 3, "the running job reports progress")
        assert counts.reads[queued] == 0 and counts.serialized[queued] == 0
        # Its own change: serialized once for all its watchers and read not at all (the feed
        # gets the row the cancel's write returned), on top of what the cancel itself costs
        # (measured on an unwatched job); each watcher gets it, in order.
        counts.reset()
        assert (await http.delete(f"/v1/generations/{unwatched}")).json()["state"] == "cancelled"
        alone = counts.reads[unwatched], counts.serialized[unwatched]
        assert (await http.delete(f"/v1/generations/{queued}")).json()["state"] == "cancelled"
        await until(lambda: all(w.events[-1:] == ["[DONE]"] for w in watchers), "every watcher sees the end")
        assert (counts.reads[queued], counts.serialized[queued]) == (alone[0], alone[1] + 1), counts.reads
        assert all(w.states() == ["queued", "cancelled", "[DONE]"] for w in watchers)
        # Nothing left behind once its watchers are gone.
        await until(lambda: s.runner.feeds.watchers == 0, "every watcher's place is given back")
        assert len(s.runner.feeds) == 0
        await http.delete(f"/v1/generations/{running}")


async def test_a_watched_job_s_writes_cost_no_read_beyond_the_write_s_own(
        tmp_path: Path, speech_generators: dict, counts: Counts) -> None:  # fmt: skip
    """The runner handed each watched job's change to its feed as a job id, and the feed read
    back the row the store's write had just returned: two reads per progress write of a
    watched job (a review, 2026-12-07). Now the write's row is passed on: one, the write's own."""
    async with serve_generations(tmp_path, speech_generators) as s, client(s) as http, trio.open_nursery() as nursery:
        running = await submit(http, {"text": LONG_TEXT})
        await until(lambda: counts.progress > 0, "the job runs")
        watcher = (await watch(nursery, http, s, running, 1))[0]
        counts.reset()
        await until(lambda: counts.progress >= 3, "the watched job reports progress")
        assert counts.reads[running] == counts.progress, (counts.reads[running], counts.progress)
        await until(lambda: len(watcher.events) > 1, "its watcher sees a change")
        assert json.loads(watcher.events[-1])["state"] == "running"
        await http.delete(f"/v1/generations/{running}")
        await until(lambda: watcher.events[-1:] == ["[DONE]"], "its watcher sees the end")
        assert watcher.states()[-2:] == ["cancelled", "[DONE]"]


async def test_watchers_past_a_job_s_or_the_peer_s_cap_get_429_then_room_when_one_leaves(
        tmp_path: Path, speech_generators: dict, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    per_job = PER_JOB
    stop = threading.Event()
    held_generators = {model: Held(g, stop) for model, g in speech_generators.items()}
    async with serve_generations(tmp_path, held_generators) as s, client(s) as http, trio.open_nursery() as nursery:
        nursery.start_soon(stop_at_exit, stop)
        await submit(http, {"text": LONG_TEXT})  # holds the one worker: the next two stay queued
        first, second = await submit(http, PAD), await submit(http, PAD)
        held = await watch(nursery, http, s, first, per_job)
        assert all(w.status == 200 for w in held)
        refused = (await watch(nursery, http, s, first, 1))[0]
        assert refused.status == 429 and refused.headers is not None and refused.headers["retry-after"] == "2"
        assert isinstance(json.loads(refused.body)["error"], str)
        other = (await watch(nursery, http, s, second, 1))[0]
        assert other.status == 200  # another job has room of its own
        # The peer's cap, over all jobs: the next stream of any job is refused.
        from inclavate import job_feeds

        assert job_feeds.MAX_WATCHERS_PER_JOB == PER_JOB
        monkeypatch.setattr(job_feeds, "MAX_WATCHERS", per_job + 1)
        assert (await watch(nursery, http, s, second, 1))[0].status == 429
        # A watcher leaving gives its place back at once (not when its stream is collected).
        held[0].leave()
        await until(lambda: s.runner.feeds.watchers == per_job, "the leaver's place is given back")
        assert (await watch(nursery, http, s, second, 1))[0].status == 200
        nursery.cancel_scope.cancel()
    assert s.runner.feeds.watchers == 0 and len(s.runner.feeds) == 0


async def test_one_address_past_its_share_gets_429_others_and_relays_do_not(
        tmp_path: Path, speech_generators: dict) -> None:  # fmt: skip
    """One source held all 256 places and every other client's watch was a 429 (a review,
    2026-12-07). Now a source holds at most ``MAX_WATCHERS_PER_SOURCE``; a peer relaying
    for its clients (its own cap: 16 streams per owner) fits in it with room to spare."""
    from inclavate import job_feeds
    from inclavate.peer_http import MAX_EVENT_STREAMS_PER_OWNER

    share = 32  # job_feeds.MAX_WATCHERS_PER_SOURCE, named here so the test fails at the 429 on a tree without it
    assert share == 2 * MAX_EVENT_STREAMS_PER_OWNER == 2 * PER_JOB and share < job_feeds.MAX_WATCHERS
    stop = threading.Event()
    held_generators = {model: Held(g, stop) for model, g in speech_generators.items()}
    async with (serve_generations(tmp_path, held_generators) as s, client(s) as http, client(s, relay=True) as relay,
                client(s, address="127.0.0.2") as stranger, trio.open_nursery() as nursery):  # fmt: skip
        nursery.start_soon(stop_at_exit, stop)
        await submit(http, {"text": LONG_TEXT})  # holds the one worker: the next ones stay queued
        first, second, third = await submit(http, PAD), await submit(http, PAD), await submit(http, PAD)
        # A relaying peer's whole share of this owner's streams, from 127.0.0.1: all taken.
        relayed = await watch(nursery, relay, s, first, MAX_EVENT_STREAMS_PER_OWNER)
        assert [w.status for w in relayed] == [200] * MAX_EVENT_STREAMS_PER_OWNER
        # Clients behind the same address fill the rest of its share (another job: its own cap is 16).
        local = await watch(nursery, http, s, second, share - MAX_EVENT_STREAMS_PER_OWNER)
        assert all(w.status == 200 for w in local)
        # Past the address's share: a 429, though the job and the peer have room.
        refused = (await watch(nursery, http, s, third, 1))[0]
        assert refused.status == 429 and refused.headers is not None and refused.headers["retry-after"] == "2"
        assert "address" in json.loads(refused.body)["error"]
        assert s.runner.feeds.watchers == share
        # Another address is unaffected.
        assert (await watch(nursery, stranger, s, third, 1))[0].status == 200
        # One of 127.0.0.1's streams leaving gives that address its place back.
        local[0].leave()
        await until(lambda: s.runner.feeds.watchers == share, "the leaver's place is given back")
        assert (await watch(nursery, http, s, third, 1))[0].status == 200
        nursery.cancel_scope.cancel()
    assert s.runner.feeds.watchers == 0 and len(s.runner.feeds.of_source) == 0


async def test_an_ended_job_leaves_no_feed_and_its_watchers_see_the_end_in_order(
        tmp_path: Path, speech_generators: dict) -> None:  # fmt: skip
    async with serve_generations(tmp_path, speech_generators) as s, client(s) as http, trio.open_nursery() as nursery:
        job = await submit(http, {"text": "One sentence. And another one."})
        watchers = await watch(nursery, http, s, job, 3)
        await until(lambda: all(w.events[-1:] == ["[DONE]"] for w in watchers), "the job ends")
        for w in watchers:
            states = w.states()
            assert states[0] in ("queued", "running") and states[-2:] == ["completed", "[DONE]"]
            assert "running" in states
            final = json.loads(w.events[-2])
            assert final["progress_stage"] == "publishing" and final["progress_fraction"] == 1.0
        await until(lambda: len(s.runner.feeds) == 0, "the ended job's feed goes with its watchers")
        assert s.runner.feeds.watchers == 0


async def test_a_row_that_cannot_be_read_back_ends_its_watchers_streams_and_nothing_else(tmp_path: Path) -> None:
    """The runner reads a watched job back after each write; a failing read raised out of the
    worker that wrote it, ending every worker and the peer's nursery (the first fix caught
    ``sqlite3.Error``, which the store never raises: a review, 2026-12-07). The watchers'
    streams end instead, and the place each held is given back."""
    from inclavate.job_feeds import JobFeeds
    from inclavate.jobs import JobStoreError, NewJob
    from inclavate.owner_ids import new_id

    store = JobStore.in_dir(tmp_path)
    try:
        job, _ = store.create(new_id("12D3KooWme"), NewJob("audio", "piper:joe", {"text": "Hi."}), max_active=4, now=0)
        failing = [False]

        def read(job_id: str) -> Job | None:
            if failing[0]:
                raise JobStoreError("disk I/O error")
            return store.get(job_id)

        feeds = JobFeeds(read)
        with trio.fail_after(10):
            stream = feeds.watch(job)
            first = await stream.__anext__()
            failing[0] = True
            feeds.changed(job.id)  # does not raise
            assert [first, *[payload async for payload in stream]] == [json.dumps(job.to_json()), "[DONE]"]
        assert feeds.watchers == 0 and len(feeds) == 0
    finally:
        store.close()


async def test_a_change_with_its_row_reads_nothing_an_erasure_reads_once(tmp_path: Path) -> None:
    """``changed(job_id, job)`` publishes the row its writer has (no read); with no row at
    hand (an erasure) it reads the job back once, and a job gone ends its watchers' streams."""
    from inclavate.job_feeds import JobFeeds
    from inclavate.jobs import NewJob
    from inclavate.owner_ids import new_id

    store = JobStore.in_dir(tmp_path)
    try:
        job, _ = store.create(new_id("12D3KooWme"), NewJob("audio", "piper:joe", {"text": "Hi."}), max_active=4, now=0)
        reads: list[str] = []

        def read(job_id: str) -> Job | None:
            reads.append(job_id)
            return store.get(job_id)

        feeds = JobFeeds(read)
        with trio.fail_after(10):
            stream = feeds.watch(job)
            assert json.loads(await stream.__anext__())["state"] == "queued"
            started = store.start(job.id, 1)
            assert started is not None
            feeds.changed(job.id, started)
            assert reads == []
            assert json.loads(await stream.__anext__())["state"] == "running"
            finished = store.finish(job.id, "cancelled", 2)
            assert finished is not None
            store.delete(job.id)
            feeds.changed(job.id, finished)  # the row as written, though it is gone meanwhile
            assert reads == []
            assert json.loads(await stream.__anext__())["state"] == "cancelled"
            assert [payload async for payload in stream] == ["[DONE]"]
            # An erasure while watched: no row at hand, one read, and the stream ends.
            again, _ = store.create(new_id("12D3KooWme"), NewJob("audio", "piper:joe", {"text": "Hi."}), max_active=4, now=3)
            stream = feeds.watch(again)
            await stream.__anext__()
            store.delete(again.id)
            feeds.changed(again.id)
            assert reads == [again.id]
            assert [payload async for payload in stream] == ["[DONE]"]
        assert feeds.watchers == 0 and len(feeds) == 0
    finally:
        store.close()
