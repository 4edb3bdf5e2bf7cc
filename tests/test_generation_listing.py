"""The swarm-wide job listing (``GET /v1/generations``) among many and hostile peers, in
process: fake peers answer the forwarded HTTP listing as a real peer's route would, or as a
hostile one might. What the asking peer keeps, asks at once, and hands its client."""

from __future__ import annotations

import functools
import json
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
from fixed_answer import answering
from owner_grinding import ground
from registry_helpers import view
from test_generation_service import job_row

from inclavate.artifact_swarm import SwarmArtifacts
from inclavate.artifacts import ArtifactStore
from inclavate.fan_out import MAX_ASKS_IN_FLIGHT, MAX_ASKS_PER_FANOUT
from inclavate.generations import LIST_MAX_LIMIT, LIST_TIMEOUT_S, GenerationService, listing_answer_bytes
from inclavate.job_rows import decode_job_row
from inclavate.job_runner import JobRunner
from inclavate.jobs import (MAX_ERROR_MESSAGE_CHARS, MAX_MODEL_CHARS, MAX_PARAMS_BYTES, MAX_RECORD_BYTES, MAX_STAGE_CHARS,
                            JobStore, NewJob)
from inclavate.owner_ids import Owners, new_id
from inclavate.peer_http import MAX_ANSWER_BYTES, PeerHttp, PeerUnreachable
from inclavate.untrusted import Reason

ME = "12D3KooWme"
Answer = Callable[[int], Any]
"""``limit -> body`` of one fake peer's listing."""


class _Raw(bytearray):
    """An answer's bytes, whose liveness on the asking peer is counted (weakly), with its rows."""

    rows = 0


class FakePeers:
    """Other peers answering ``GET /v1/generations`` after ``delay`` (forever for ``stall``),
    counting asks in flight at once and the most of their listed rows alive on the asker (in
    answers not yet dropped)."""

    def __init__(self, answers: dict[str, Answer], delay: float = 0.1, stall: frozenset[str] = frozenset()) -> None:
        self.answers, self.delay, self.stall = answers, delay, stall
        self.in_flight = self.most_in_flight = self.most_rows_alive = 0
        self.max_bytes: dict[str, int] = {}
        """The answer size each peer was last held to (``PeerHttp.read`` enforces it)."""
        self._answers: list[weakref.ref[_Raw]] = []

    async def read(self, base_url: str, method: str, path: str, *, body: Any = None, params: Any = None,
                   max_bytes: int = MAX_ANSWER_BYTES, owner: str | None = None) -> tuple[int, bytes]:  # fmt: skip
        peer = base_url.removeprefix("http://")
        assert owner == peer  # its share of requests is the owner's, not its URL's
        assert (method, path) == ("GET", "/v1/generations")
        self.max_bytes[peer] = max_bytes
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await trio.sleep(1000 if peer in self.stall else self.delay)
            answer = self.answers[peer](params["limit"])
            raw = _Raw(json.dumps(answer).encode())
            listed = answer.get("generations") if isinstance(answer, dict) else None
            raw.rows = len(listed) if isinstance(listed, list) else 0
            self._answers.append(weakref.ref(raw))
            alive = sum(held.rows for ref in self._answers if (held := ref()) is not None)
            self.most_rows_alive = max(self.most_rows_alive, alive)
            return 200, raw  # type: ignore[return-value]  # bytes-like, as PeerHttp.read's
        finally:
            self.in_flight -= 1

    async def aclose(self) -> None:
        pass


def listing_of(rows: list[dict[str, Any]]) -> Answer:
    """An honest peer's route: its newest ``limit`` rows, and whether it has more."""
    return lambda limit: {"generations": [dict(r) for r in rows[:limit]], "truncated": len(rows) > limit}


@contextmanager
def service_with(tmp_path: Path, peers: FakePeers) -> Iterator[GenerationService]:
    store = ArtifactStore(tmp_path, ME)
    runner = JobRunner(JobStore.in_dir(tmp_path), store, {}, ME, read_input=None)  # type: ignore[arg-type]
    views = [view(p, 0, 30, api_url=f"http://{p}") for p in sorted(peers.answers)]
    try:
        yield GenerationService(ME, runner, SwarmArtifacts(store), lambda: views, peers)  # type: ignore[arg-type]
    finally:
        store.close()


def newest_first(answers: dict[str, list[dict[str, Any]]]) -> list[str]:
    rows = [r for rs in answers.values() for r in rs]
    return [r["id"] for r in sorted(rows, key=lambda r: (r["created_at"], r["id"]), reverse=True)]


async def test_a_job_listing_among_many_peers_asks_and_keeps_a_bounded_number(
        tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:  # fmt: skip
    """200 identities each answer a full window (100 rows): the listing asks at most
    MAX_ASKS_PER_FANOUT at a time and keeps no answer past its merge, and the page is still
    the swarm's newest rows. Before, all 200 were asked at once and all 20 000 rows kept."""
    rows = {f"p{i:03}": [job_row(f"p{i:03}", 10_000_000 + 1000 * i - j) for j in range(100)] for i in range(200)}
    peers = FakePeers({p: listing_of(r) for p, r in rows.items()})
    with service_with(tmp_path, peers) as service:
        page, truncated = await service.list(50, 50, local_only=False)
    assert [r["id"] for r in page] == newest_first(rows)[50:100] and truncated
    assert peers.most_in_flight <= MAX_ASKS_PER_FANOUT
    assert peers.most_rows_alive <= MAX_ASKS_PER_FANOUT * 100


async def test_job_listings_of_a_peer_together_ask_a_bounded_number_of_peers(
        tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:  # fmt: skip
    """Any HTTP client may start listings: four at once over 100 peers have at most
    MAX_ASKS_IN_FLIGHT asks in flight together (before: 400), the limit artifact listings
    share (one semaphore per peer)."""
    peers = FakePeers({f"p{i:03}": listing_of([job_row(f"p{i:03}", 1000 + i)]) for i in range(100)})
    with service_with(tmp_path, peers) as service:
        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(functools.partial(service.list, 20, 0, local_only=False))
        assert MAX_ASKS_PER_FANOUT < peers.most_in_flight <= MAX_ASKS_IN_FLIGHT
        assert service._fan_out._in_flight is service.artifacts.fan_out._in_flight


async def test_peers_that_stall_do_not_keep_an_honest_peer_out_of_a_job_listing(
        tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:  # fmt: skip
    """40 identities that never answer and one honest peer: its rows are shown, within
    LIST_TIMEOUT_S. (It passes on the tree before too, which asked everyone at once and
    waited 10 s on each: it pins that asking in turns keeps this.)"""
    honest = [job_row("honest", 1000 - i) for i in range(3)]
    stalling = {f"s{i:03}": listing_of([job_row(f"s{i:03}", 5000)]) for i in range(40)}
    peers = FakePeers({**stalling, "honest": listing_of(honest)}, stall=frozenset(stalling))
    with service_with(tmp_path, peers) as service:
        began = trio.current_time()
        page, _ = await service.list(10, 0, local_only=False)
        assert trio.current_time() - began <= LIST_TIMEOUT_S
    assert [r["id"] for r in page] == [r["id"] for r in honest]


async def test_a_peer_cannot_list_or_override_another_owners_jobs(tmp_path: Path) -> None:
    """A hostile peer lists the honest peer's job under its real id (newer, failed) and a
    job the honest peer never ran under the honest peer's tag. Before, its rows were taken
    whatever their ids (the last answer won the id dedupe); now a peer lists only ids with
    its own owner tag, and one that lists others' is left out."""
    real = job_row("honest", 1000)
    forged = {**real, "state": "failed", "error_message": "forged", "created_at": "2099-01-01T00:00:00.000Z"}
    invented = job_row("honest", 2000, state="completed", output_artifacts=[new_id("honest")])
    peers = FakePeers({"honest": listing_of([real]),
                       "hostile": listing_of([invented, forged, job_row("hostile", 500)])}, delay=0)  # fmt: skip
    with service_with(tmp_path, peers) as service:
        page, _ = await service.list(10, 0, local_only=False)
        assert page == [real] and service.listing_drops[Reason.BAD_VALUE] == 1



async def test_a_peer_ground_to_an_owners_32_bit_tag_cannot_list_its_jobs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """An identity ground to the honest peer's 32-bit tag lists a job the honest peer never
    ran, under an id carrying the honest peer's tag. Before, a row had to carry only the
    answering peer's 32 bits, so it was taken; now it must carry its whole 60-bit tag (an id
    whose tag names another known peer is not a legacy id), and the peer is left out."""
    ground(monkeypatch, "honest", "hostile")
    real = job_row("honest", 1000)
    invented = job_row("honest", 2000, state="failed", error_message="forged")
    peers = FakePeers({"honest": listing_of([real]), "hostile": listing_of([invented])}, delay=0)
    with service_with(tmp_path, peers) as service:
        page, _ = await service.list(10, 0, local_only=False)
        assert page == [real] and service.listing_drops[Reason.BAD_VALUE] == 1

def _mutated(field: str, value: Any) -> Answer:
    row = job_row("odd", 2000)
    return listing_of([{**row, field: value}, job_row("odd", 1000)])


@pytest.mark.parametrize(("field", "value"), [
    ("created_at", 12345), ("created_at", "9999-99-99T99:99:99.999Z"), ("created_at", "2026-01-01"),
    ("expires_at", None), ("state", "pwned"), ("modality", "x" * 10_000), ("model", "m" * 201),
    ("params", "not an object"), ("params", {"text": "x" * 70_000}), ("seed", -1), ("seed", True),
    ("progress_fraction", 2.0), ("error_message", "e" * (MAX_ERROR_MESSAGE_CHARS + 1)),
    ("input_artifacts", ["not-a-uuid"]), ("input_artifacts", [new_id("x")] * 17),
    ("output_artifacts", [new_id("odd")]), ("artifacts_deleted", "1"), ("id", None), ("id", ["a"]),
])  # fmt: skip
async def test_a_malformed_job_row_leaves_its_peer_out_of_the_page(tmp_path: Path, field: str, value: Any) -> None:
    """A row unlike any this peer produces (Job.to_json): a wrong type, an unbounded text, a
    date in another format (rows sort on created_at as text), outputs on a queued job. Before,
    rows were handed to the client as the peer sent them; now the peer is left out (counted)."""
    honest = [job_row("honest", 1500)]
    peers = FakePeers({"honest": listing_of(honest), "odd": _mutated(field, value)}, delay=0)
    with service_with(tmp_path, peers) as service:
        page, truncated = await service.list(10, 0, local_only=False)
        assert (page, truncated) == (honest, False)
        assert service.listing_drops.total() == 1


async def test_a_job_row_is_rebuilt_from_the_spec_s_fields_only(tmp_path: Path) -> None:
    """A field the job record does not have never reaches the client (before: any blob)."""
    row = job_row("odd", 1000)
    peers = FakePeers({"odd": listing_of([{**row, "blob": "x" * 100_000, "__proto__": {}}])}, delay=0)
    with service_with(tmp_path, peers) as service:
        page, _ = await service.list(10, 0, local_only=False)
    assert page == [row]


async def test_more_rows_than_asked_or_an_empty_truncated_claim_do_not_distort_the_page(tmp_path: Path) -> None:
    """One peer answers more rows than the window it was asked for; another claims more
    past a page it did not fill. Before, the first's extra rows were taken and the second
    made every listing ``truncated``; now the first is left out, the claim is ignored."""
    honest = [job_row("honest", 1000 - i) for i in range(3)]
    flood = [job_row("flood", 5000 - i) for i in range(30)]
    peers = FakePeers({"honest": listing_of(honest), "flood": lambda limit: {"generations": flood, "truncated": True},
                       "claims": lambda limit: {"generations": [], "truncated": True}}, delay=0)  # fmt: skip
    with service_with(tmp_path, peers) as service:
        assert await service.list(10, 0, local_only=False) == (honest, False)
        assert service.listing_drops[Reason.TOO_LONG] == 1


async def test_a_full_job_listing_answer_is_decoded_while_other_tasks_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """A peer answers a full window (1,000 rows, ~0.5 MB): the asker parses it and checks its
    rows in steps, and other tasks (a chat stream's) run between the steps, where the whole
    answer was decoded in one go in the fan-out's ``take`` (~26 ms of event loop on a busy
    core, and 16 answers arriving together held it for their sum). Ordering, not timing: a
    task that runs at every chance sees the decode part-way (some of the rows' ids checked
    against their owner, not all)."""
    asked = [0]
    carries_owner = Owners.carries_owner

    def counting(self: Owners, id_: str, peer: str) -> bool:
        asked[0] += 1
        return carries_owner(self, id_, peer)

    monkeypatch.setattr(Owners, "carries_owner", counting)
    rows = [job_row("wide", 10_000_000 - i) for i in range(LIST_MAX_LIMIT)]
    peers = FakePeers({"wide": listing_of(rows)}, delay=0)
    seen: list[int] = []

    async def other_task() -> None:
        while True:
            seen.append(asked[0])
            await trio.lowlevel.checkpoint()

    with trio.fail_after(60), service_with(tmp_path, peers) as service:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(other_task)
            page, truncated = await service.list(LIST_MAX_LIMIT, 0, local_only=False)
            nursery.cancel_scope.cancel()
    assert page == rows and not truncated
    assert asked[0] >= LIST_MAX_LIMIT
    assert any(0 < n < asked[0] for n in seen), "the other task never ran while the rows were decoded"


async def test_a_peer_whose_api_url_httpx_refuses_is_left_out(tmp_path: Path) -> None:
    """A record's api_url is self-declared: one httpx cannot parse (a NUL in the host) was
    ``httpx.InvalidURL``, not an HTTPError, and escaped a forwarded request as a 500."""
    http = PeerHttp()
    with pytest.raises(PeerUnreachable):
        await http.json("http://\x00", "GET", "/v1/generations")
    await http.aclose()


def test_every_row_this_peer_writes_is_one_another_peer_takes(tmp_path: Path) -> None:
    """The bounds rows are held to are what this peer writes: a job that failed with a huge
    exception text (the store clips it) still passes."""
    jobs = JobStore.in_dir(tmp_path)
    job, _ = jobs.create(new_id(ME), NewJob("audio", "piper:joe", {"text": "hi"}), max_active=10, now=1000)
    jobs.finish(job.id, "failed", 2000, error_code="inference_failed", error_message="x" * 100_000)
    failed = jobs.get(job.id)
    owns = functools.partial(Owners([ME]).carries_owner, peer=ME)
    assert failed is not None and decode_job_row(failed.to_json(), owns) == failed.to_json()


async def test_a_peer_s_listing_answer_is_held_to_what_its_rows_can_take(tmp_path: Path) -> None:
    """A 10-row page asked each peer for up to 32 MiB, parsed whole, 16 peers at once; the
    answer is now held to 10 of the largest records an honest peer writes."""
    honest = [job_row(new_id("12D3KooWhonest"), i) for i in range(3)]
    peers = FakePeers({"12D3KooWhonest": listing_of(honest)})
    with service_with(tmp_path, peers) as service:
        await service.list(10, 0, local_only=False)
    assert peers.max_bytes["12D3KooWhonest"] == listing_answer_bytes(10) == 10 * MAX_RECORD_BYTES + 1024
    assert listing_answer_bytes(10) < MAX_ANSWER_BYTES // 20


def test_the_largest_record_this_peer_writes_fits_its_bound(tmp_path: Path) -> None:
    """Every text at its limit, in characters JSON escapes the longest (a surrogate pair: 12
    bytes), the params at their measured limit: the record still fits ``MAX_RECORD_BYTES``."""
    jobs = JobStore.in_dir(tmp_path)
    wide = "\U0001f600"
    params = {"text": wide * ((MAX_PARAMS_BYTES - 16) // 12)}
    assert len(json.dumps(params)) <= MAX_PARAMS_BYTES
    inputs = tuple(new_id(ME) for _ in range(16))
    job, _ = jobs.create(new_id(ME), NewJob("audio", wide * MAX_MODEL_CHARS, params, seed=2**63 - 1, input_artifacts=inputs),
                         max_active=10, now=1000)  # fmt: skip
    jobs.start(job.id, 1500)
    jobs.progress(job.id, wide * MAX_STAGE_CHARS, 0.5)
    jobs.finish(job.id, "failed", 2000, error_code="e" * 64, error_message=wide * 100_000)
    record = jobs.get(job.id)
    assert record is not None
    assert len(json.dumps(record.to_json())) <= MAX_RECORD_BYTES


# httpx's nested body generators are finalized by the collector when a read stops early
# (the response, and its connection, are closed by ``stream``'s context): a warning, not a leak.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
async def test_peer_http_refuses_an_answer_past_the_bound_its_caller_gives(tmp_path: Path) -> None:
    http_client = PeerHttp()
    try:
        with answering({"generations": [], "junk": "x" * 100_000}) as url, trio.fail_after(10):
            with pytest.raises(PeerUnreachable, match="more than 50000 bytes"):
                await http_client.json(url, "GET", "/v1/generations", max_bytes=50_000)
            assert (await http_client.json(url, "GET", "/v1/generations"))[0] == 200  # the default ceiling
    finally:
        await http_client.aclose()
