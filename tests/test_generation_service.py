"""The swarm-wide generation service without a network: which peer a submission or an id
goes to, capabilities merged from the registry, and the idempotency race (409)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
from owner_grinding import ground
from registry_helpers import view

from inclavate.artifact_swarm import SwarmArtifacts
from inclavate.artifacts import ArtifactStore
from inclavate.errors import RelayedError
from inclavate.generations import LIST_MAX_LIMIT, GenerationService, ListingTooDeep, NoGenerator
from inclavate.job_runner import JobNotFound, JobRunner
from inclavate.jobs import MAX_RECORD_BYTES, IdempotencyConflict, Job, JobStore, NewJob
from inclavate.owner_ids import new_id
from inclavate.peer_http import PeerUnreachable
from inclavate.places import Place

ME, OTHER = "12D3KooWme", "12D3KooWother"
REMOTE_ENTRY = {"modality": "audio", "model": "piper:joe", "builtin_voices": ["joe"], "requires_speaker": False}


class FakeHttp:
    """Answers forwarded requests like the owning peer would, slowly (the peer at
    ``http://<PeerID>``, or OTHER at ``http://other``)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str, Any]] = []

    async def json(self, base_url: str, method: str, path: str, *, body: Any = None, params: Any = None,
                   max_bytes: int | None = None, owner: str | None = None) -> tuple[int, Any]:  # fmt: skip
        self.calls.append((base_url, method, path, body))
        await trio.sleep(0.2)
        asked = path.removeprefix("/v1/generations").strip("/")  # a job's own path names it
        peer = OTHER if base_url == "http://other" else base_url.removeprefix("http://")
        return 202, {"id": asked or new_id(peer), "state": "queued"}  # a submission's: a job of its own

    async def aclose(self) -> None:
        pass


@pytest.fixture
def service(tmp_path: Path) -> GenerationService:
    store = ArtifactStore(tmp_path, ME)
    runner = JobRunner(JobStore.in_dir(tmp_path), store, {}, ME, read_input=None)  # type: ignore[arg-type]
    views = [
        view(OTHER, 0, 30, generators=(REMOTE_ENTRY,), api_url="http://other"),
        view("12D3KooWdead", 0, 30, state="Dead", generators=({**REMOTE_ENTRY, "model": "gone:tts"},), api_url="http://dead"),
    ]
    return GenerationService(ME, runner, SwarmArtifacts(store), lambda: views, FakeHttp())  # type: ignore[arg-type]


def test_capabilities_come_from_live_peers_only(service: GenerationService) -> None:
    assert service.capabilities() == [REMOTE_ENTRY]
    assert service.local_capabilities() == []


async def test_a_submission_goes_to_the_peer_with_the_generator(service: GenerationService) -> None:
    job = await service.submit(NewJob("audio", "piper:joe", {"text": "hi"}), local_only=False, known_chat_model=False)
    assert job["state"] == "queued"
    assert service.http.calls[0][:3] == ("http://other", "POST", "/v1/generations")  # type: ignore[attr-defined]
    with pytest.raises(NoGenerator):  # forwarded requests never forward again
        await service.submit(NewJob("audio", "piper:joe", {"text": "hi"}), local_only=True, known_chat_model=False)
    with pytest.raises(NoGenerator):  # only a Dead peer had it
        await service.submit(NewJob("audio", "gone:tts", {"text": "hi"}), local_only=False, known_chat_model=False)


async def test_the_same_key_racing_to_another_peer_is_409(service: GenerationService) -> None:
    outcomes: list[str] = []

    async def submit() -> None:
        try:
            await service.submit(NewJob("audio", "piper:joe", {"text": "hi"}, idempotency_key="k"),
                                 local_only=False, known_chat_model=False)  # fmt: skip
            outcomes.append("queued")
        except IdempotencyConflict:
            outcomes.append("409")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(submit)
        await trio.sleep(0.05)
        nursery.start_soon(submit)
    assert sorted(outcomes) == ["409", "queued"]


class _LocalSpeech:
    """A generator as the service sees it before a job runs: its modality, and checks that pass."""

    modality = "audio"

    def capabilities(self) -> dict[str, Any]:
        return REMOTE_ENTRY

    def check(self, modality: str, params: Any, n_inputs: int) -> None:
        pass


async def test_a_keyed_submission_runs_on_one_peer_whichever_peer_with_the_generator_is_asked(tmp_path: Path) -> None:
    """Every peer holding the generator ran a keyed submission itself, so the same key retried
    through another peer queued a second job (the spec: the first job is returned; an audit,
    2026-12-07). The key now has one home among those peers, the same from either side."""

    def peer(me: str, other: str) -> GenerationService:
        store = ArtifactStore(tmp_path / me, me)
        runner = JobRunner(JobStore.in_dir(tmp_path / me), store, {"piper:joe": _LocalSpeech()}, me, read_input=None)  # type: ignore[arg-type, dict-item]
        views = [view(other, 0, 30, generators=(REMOTE_ENTRY,), api_url=f"http://{other}")]
        return GenerationService(me, runner, SwarmArtifacts(store), lambda: views, FakeHttp())  # type: ignore[arg-type]

    me, other = peer(ME, OTHER), peer(OTHER, ME)
    homes = []
    for i in range(16):
        new = NewJob("audio", "piper:joe", {"text": "hi"}, idempotency_key=f"key{i}")
        homes.append(ME if me._key_home(new) is None else OTHER)
        assert (other._key_home(new) is None) == (homes[-1] == OTHER)  # both sides agree
        for service, name in ((me, ME), (other, OTHER)):
            asked = len(service.http.calls)  # type: ignore[attr-defined]
            await service.submit(new, local_only=False, known_chat_model=False)
            assert len(service.http.calls) == asked + (homes[-1] != name)  # type: ignore[attr-defined]
    assert set(homes) == {ME, OTHER}  # keys spread over the peers
    unkeyed = NewJob("audio", "piper:joe", {"text": "hi"})
    forwarded = NewJob("audio", "piper:joe", {"text": "hi"}, idempotency_key=f"key{homes.index(OTHER)}")
    for new, local_only in ((unkeyed, False), (forwarded, True)):  # no key, or forwarded here already: run here
        asked = len(me.http.calls)  # type: ignore[attr-defined]
        await me.submit(new, local_only=local_only, known_chat_model=False)
        assert len(me.http.calls) == asked  # type: ignore[attr-defined]


class _Answering(FakeHttp):
    """An owner that answers every forwarded request with ``body``; the bounds asked, kept."""

    def __init__(self, body: Any) -> None:
        super().__init__()
        self.body = body
        self.max_bytes: list[int | None] = []

    async def json(self, base_url: str, method: str, path: str, *, body: Any = None, params: Any = None,
                   max_bytes: int | None = None, owner: str | None = None) -> tuple[int, Any]:  # fmt: skip
        self.calls.append((base_url, method, path, body))
        self.max_bytes.append(max_bytes)
        return 200, self.body


async def test_an_owner_answers_only_for_the_job_asked_about_and_an_erase_goes_to_the_id_s_owner(tmp_path: Path) -> None:
    """A peer's answer about a job was taken whatever job it named: a peer that alone offered a
    model answered a submission with another peer's job, whose audio the speech route served
    as this client's (and cancelled when the client left); the admin's erase went to
    whichever peer sorted first among those claiming the owner's ``api_url``; an erase
    answer's count that was no number was a 500 (an audit, 2026-12-07)."""
    store = ArtifactStore(tmp_path, ME)
    runner = JobRunner(JobStore.in_dir(tmp_path), store, {}, ME, read_input=None)  # type: ignore[arg-type]
    copycat = "12D3KooWaaa"  # sorts before OTHER, claims OTHER's api_url
    views = [view(OTHER, 0, 30, generators=(REMOTE_ENTRY,), api_url="http://other"),
             view(copycat, 0, 30, api_url="http://other")]  # fmt: skip
    erased: list[str] = []

    async def erase_remote(peer: str, job_id: str, artifacts: bool) -> dict[str, Any]:
        erased.append(peer)
        return {"artifacts_deleted": erase_answer}

    theirs, someone_elses = new_id(OTHER), new_id(ME)
    http = _Answering({"id": someone_elses, "state": "completed"})
    service = GenerationService(ME, runner, SwarmArtifacts(store), lambda: views, http, erase_remote)  # type: ignore[arg-type]
    with pytest.raises(PeerUnreachable, match="not the one asked for"):
        await service.submit(NewJob("audio", "piper:joe", {"text": "hi"}), local_only=False, known_chat_model=False)
    for call in (service.get, service.cancel):
        with pytest.raises(PeerUnreachable, match="not the one asked for"):
            await call(theirs, local_only=False)
    assert set(http.max_bytes) == {MAX_RECORD_BYTES}  # an answer about one job is one record's size at most
    http.body = {"id": theirs, "state": "completed"}
    assert (await service.get(theirs, local_only=False))["id"] == theirs
    erase_answer: Any = 2
    assert await service.erase(theirs, artifacts=True) == {"id": theirs, "artifacts_deleted": 2}
    assert erased == [OTHER]
    erase_answer = "x"
    with pytest.raises(PeerUnreachable):
        await service.erase(theirs, artifacts=True)


async def test_a_relayed_event_stream_carries_only_records_of_the_job_watched(tmp_path: Path) -> None:
    """The owner's ``data:`` lines were relayed as they came, whatever they held (an audit,
    2026-12-07): now each is a record of the job watched, or the stream ends there."""
    theirs = new_id(OTHER)
    lines = [f"data: {json.dumps({'id': theirs, 'state': 'running'})}", "",
             f"data: {json.dumps({'id': new_id(OTHER), 'state': 'completed'})}", "data: [DONE]"]

    class Streaming(_Answering):
        def reserve_stream(self, owner: str, source: str = "?") -> Place:
            return Place(lambda: None, "a test's stream")

        @asynccontextmanager
        async def stream_lines(self, base_url: str, path: str, *, max_line_bytes: int, owner: str | None = None,
                               place: Place | None = None) -> AsyncIterator[AsyncIterator[str]]:  # fmt: skip
            async def each() -> AsyncIterator[str]:
                for line in lines:
                    yield line

            async with aclosing(each()) as relayed:
                yield relayed

    store = ArtifactStore(tmp_path, ME)
    runner = JobRunner(JobStore.in_dir(tmp_path), store, {}, ME, read_input=None)  # type: ignore[arg-type]
    views = [view(OTHER, 0, 30, api_url="http://other")]
    http = Streaming({"id": theirs, "state": "running"})
    service = GenerationService(ME, runner, SwarmArtifacts(store), lambda: views, http)  # type: ignore[arg-type]
    got: list[str] = []
    with pytest.raises(PeerUnreachable, match="not the one asked for"):
        async for payload in await service.events(theirs, local_only=False):
            got.append(payload)
    assert [json.loads(p)["id"] for p in got] == [theirs]


async def test_ids_route_by_their_owner_tag(service: GenerationService) -> None:
    theirs = new_id(OTHER)
    await service.get(theirs, local_only=False)
    assert service.http.calls[-1][:3] == ("http://other", "GET", f"/v1/generations/{theirs}")  # type: ignore[attr-defined]
    with pytest.raises(JobNotFound):
        await service.get(new_id(ME), local_only=False)
    with pytest.raises(JobNotFound):  # a tag no peer in the registry carries
        await service.get(new_id("12D3KooWstranger"), local_only=False)
    with pytest.raises(PeerUnreachable):  # its owner is known but Dead: the job may exist
        await service.get(new_id("12D3KooWdead"), local_only=False)



async def test_a_peer_ground_to_an_owners_32_bit_tag_is_not_asked_for_its_jobs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """An identity ground to OTHER's 32-bit tag, whose PeerID sorts first: a request for
    OTHER's job went to it (the first live candidate's API), which could answer any record
    it liked, or cancel nothing. Now the job's 60-bit tag names OTHER alone."""
    hostile = "12D3KooWAhostile"
    ground(monkeypatch, OTHER, hostile)
    store = ArtifactStore(tmp_path, ME)
    runner = JobRunner(JobStore.in_dir(tmp_path), store, {}, ME, read_input=None)  # type: ignore[arg-type]
    views = [view(hostile, 0, 30, api_url="http://hostile"), view(OTHER, 0, 30, api_url="http://other")]
    http = FakeHttp()
    service = GenerationService(ME, runner, SwarmArtifacts(store), lambda: views, http)  # type: ignore[arg-type]
    theirs = new_id(OTHER)
    await service.get(theirs, local_only=False)
    await service.cancel(theirs, local_only=False)
    assert [c[0] for c in http.calls] == ["http://other", "http://other"]
    store.close()


async def test_a_relayed_owner_s_jobs_do_not_fall_back_to_its_ground_twin(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """A relayed owner is not asked (its ids are 404 here), but it still counts when choosing
    the owner: left out of the choice, its new ids matched no known whole tag and fell back
    to a peer carrying their first 32 bits, its ground twin."""
    hostile = "12D3KooWAhostile"
    ground(monkeypatch, OTHER, hostile)
    store = ArtifactStore(tmp_path, ME)
    runner = JobRunner(JobStore.in_dir(tmp_path), store, {}, ME, read_input=None)  # type: ignore[arg-type]
    views = [view(hostile, 0, 30, api_url="http://hostile"), view(OTHER, 0, 30, api_url="http://other", relayed=True)]
    http = FakeHttp()
    service = GenerationService(ME, runner, SwarmArtifacts(store), lambda: views, http)  # type: ignore[arg-type]
    with pytest.raises(JobNotFound):
        await service.get(new_id(OTHER), local_only=False)
    assert http.calls == []
    store.close()

def job_row(owner: str, created_ms: int, **fields: Any) -> dict[str, Any]:
    """A row as ``owner`` lists it: a job record (``Job.to_json``) with an id it minted."""
    job = Job(id=new_id(owner), state="queued", modality="audio", model="piper:joe", params={"text": "hi"},
              seed=None, input_artifacts=(), output_artifacts=(), progress_stage=None, progress_fraction=None,
              error_code=None, error_message=None, created_ms=created_ms, started_ms=None, completed_ms=None,
              expires_ms=created_ms + 600_000, idempotency_key=None, attempts=0, cancel_requested=False, version=1)  # fmt: skip
    return {**job.to_json(), **fields}


class PagingPeer:
    """Another peer holding ``n`` jobs, answering ``GET /v1/generations`` as the route does:
    its newest ``limit`` (at most LIST_MAX_LIMIT, else 400) and whether it has more."""

    def __init__(self, n: int) -> None:
        self.rows = [job_row(OTHER, 1_000_000 - i) for i in range(n)]

    async def read(self, base_url: str, method: str, path: str, *, body: Any = None, params: Any = None,
                   max_bytes: int | None = None, owner: str | None = None) -> tuple[int, bytes]:  # fmt: skip
        limit = params["limit"]
        if limit > LIST_MAX_LIMIT:
            raise RelayedError(400, {"error": "limit must be 1-1000"})
        return 200, json.dumps({"generations": self.rows[:limit], "truncated": len(self.rows) > limit}).encode()


async def test_a_swarm_listing_never_silently_misses_another_peers_rows(tmp_path: Path) -> None:
    """Other peers send one page (1000 rows at most) from offset 0: a window past that used to
    come back short (rows 950-999 of 1050 asked for, truncated false), never an error."""
    store = ArtifactStore(tmp_path, ME)
    runner = JobRunner(JobStore.in_dir(tmp_path), store, {}, ME, read_input=None)  # type: ignore[arg-type]
    peer = PagingPeer(1500)
    views = [view(OTHER, 0, 30, api_url="http://other")]
    service = GenerationService(ME, runner, SwarmArtifacts(store), lambda: views, peer)  # type: ignore[arg-type]
    rows, truncated = await service.list(100, 900, local_only=False)
    assert [r["id"] for r in rows] == [r["id"] for r in peer.rows[900:1000]] and truncated  # it has 500 more
    with pytest.raises(ListingTooDeep):
        await service.list(100, 950, local_only=False)
    assert await service.list(100, 10**15, local_only=True) == ([], False)  # this peer alone: any depth


async def test_a_watch_the_owner_refuses_with_429_falls_back_to_polls(service: GenerationService) -> None:
    """The owner now caps its watchers (16 a job, 256 in all) and answers 429; the relay
    caught only its own cap's refusal, so a client watching through another peer got a 200
    that ended with no event and no ``[DONE]``, and that peer's log a traceback (a review,
    2026-12-07). The owner's 429 is read like the relay's own: the job's states from polls."""

    class BusyOwner(FakeHttp):
        def reserve_stream(self, owner: str, source: str = "?") -> Place:
            return Place(lambda: None, "a test's stream")

        @asynccontextmanager
        async def stream_lines(self, base_url: str, path: str, **_: Any) -> AsyncIterator[AsyncIterator[str]]:
            raise RelayedError(429, {"error": "this job has as many event streams open as it may"})
            yield  # pragma: no cover - an async generator that refuses at once

        async def json(self, base_url: str, method: str, path: str, **_: Any) -> tuple[int, Any]:
            return 200, {"id": path.removeprefix("/v1/generations/"), "state": "completed"}

    service.http = BusyOwner()  # type: ignore[assignment]
    job_id = new_id(OTHER)
    with trio.fail_after(10):
        async with aclosing(await service.events(job_id, local_only=False)) as events:
            payloads = [payload async for payload in events]
    assert payloads == [json.dumps({"id": job_id, "state": "completed"}), "[DONE]"]
