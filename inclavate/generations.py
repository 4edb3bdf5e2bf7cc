"""Generation jobs across the swarm: what the API's generation and audio routes call.

A job lives on the peer that runs it: its id carries that peer's owner tag
(:mod:`inclavate.owner_ids`), its record is in that peer's job table, its output in that
peer's artifact store. This service, on every peer, answers for all of them:

- **capabilities**: this peer's generators, then those the registry advertises
  (``NodeRecord.generators``) for other live peers, one entry per model;
- **submit**: run here when this peer has the generator, else forward the submission to a
  live peer that advertises it (the lowest PeerID, so a retried idempotency key reaches the
  same peer and finds its first job);
- **read / cancel / events**: here when the id's tag is ours, else forwarded to the owner
  (:mod:`inclavate.peer_http`; one hop at most);
- **list**: this peer's jobs merged with every other live peer's, newest first (peers
  asked in turns, :mod:`inclavate.fan_out`; their rows checked, :mod:`inclavate.job_rows`).

A request that arrived forwarded (``local_only``) is answered from this peer alone.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import trio

from inclavate.artifact_swarm import SwarmArtifacts
from inclavate.artifact_types import ArtifactError, ArtifactNotFound
from inclavate.errors import InclavateError, RelayedError
from inclavate.fan_out import AskBudget, in_steps, keep_best, listing_budget
from inclavate.generation_settings import GenerationSettings
from inclavate.job_rows import Owns, PeerJobPage, decode_job_page_in_steps
from inclavate.job_runner import JobFinished, JobNotFound, JobRunner
from inclavate.jobs import MAX_RECORD_BYTES, IdempotencyConflict, Job, NewJob
from inclavate.owner_ids import MalformedId, Owners, owner_candidates, parse_id
from inclavate.peer_http import MAX_ANSWER_BYTES, PeerHttp, PeerUnreachable, parse_answer
from inclavate.places import Place
from inclavate.untrusted import DropCounter, Malformed, read_int
from node.generators.base import InputMedia
from p2p.registry import NodeView

log = logging.getLogger(__name__)

POLL_S = 0.5
"""How often a sync adapter polls a job that runs on another peer."""
BUSY_POLL_S = 1.0
"""How often an event stream polls the owner when no relayed stream was free."""
LIST_TIMEOUT_S = 10.0
"""The longest a swarm-wide job listing waits for other peers (each ask
:data:`~inclavate.fan_out.ASK_PATIENCE_S` while others wait their turn); peers not heard
from by then are left out of the page (logged)."""

EraseRemote = Callable[[str, str, bool], Awaitable[dict[str, Any]]]
"""``(owner peer id, job id, artifacts) -> answer``: an admin erase signed by this peer."""


MAX_ERASED = 1 << 20
"""The most artifacts an owner may say one erase deleted (a job publishes at most 16)."""
LIST_MAX_LIMIT = 1000
"""The most jobs one ``GET /v1/generations`` answers (the spec's largest ``limit``). A
swarm-wide listing asks every other peer for one such page, so this is also the deepest row
(offset + limit) it can serve without missing one of theirs."""


def listing_answer_bytes(window: int) -> int:
    """The most bytes another peer's answer to a listing of ``window`` rows may take: what
    that many of the largest records an honest peer writes take, within the forwarded
    answer's ceiling. A 20-row page was held to 32 MiB a peer, up to 16 peers at once."""
    return min(MAX_ANSWER_BYTES, window * MAX_RECORD_BYTES + 1024)


class NoGenerator(InclavateError):
    """No generator in the swarm produces this model/modality (422, never retryable)."""


class ListingTooDeep(InclavateError):
    """A swarm-wide page reaching past :data:`LIST_MAX_LIMIT` rows (400): the rows of other
    peers beyond their first page were never fetched, and would be missing without a word."""


class GenerationService:
    def __init__(self, me: str, runner: JobRunner, artifacts: SwarmArtifacts, views: Callable[[], list[NodeView]],
                 http: PeerHttp, erase_remote: EraseRemote | None = None,
                 settings: GenerationSettings = GenerationSettings(),
                 chat_models: Callable[[], Mapping[str, bool]] = dict) -> None:  # fmt: skip
        """``chat_models``: the chat models a text job may name (each read through the swarm
        by the runner's fallback reader), and whether each can serve now."""
        self.me = me
        self._chat_models = chat_models
        self.settings = settings
        self.runner = runner
        self.artifacts = artifacts
        self._views = views
        self.http = http
        self._erase_remote = erase_remote
        self._pending_keys: set[str] = set()
        self._fan_out = artifacts.fan_out.sibling("job listing")
        self.listing_drops = DropCounter()
        """Other peers' listing answers left out as malformed, by reason."""

    # -- discovery -----------------------------------------------------------------------

    def local_capabilities(self) -> list[dict[str, Any]]:
        return [g.capabilities() for g in self.runner.generators.values()]

    def capabilities(self) -> list[dict[str, Any]]:
        entries = {e["model"]: e for e in self.local_capabilities()}
        for view in self._live_peers():
            for entry in view.record.generators:
                advertised = dict(entry)
                if "ready" in advertised:  # understanding entries: servable only from a Ready peer
                    advertised["ready"] = bool(advertised["ready"]) and view.state == "Ready"
                current = entries.get(advertised["model"])
                if current is None or current.get("ready") is False:  # first, or better than unready
                    entries[advertised["model"]] = advertised
        for model, ready in self._chat_models().items():
            # A chat model reads text inputs as a job on any peer (the spec lists understanding
            # generators "like any other"); unlisted, a client asking capabilities never found
            # it, and one the registry knows but nobody serves was accepted, then failed
            # (2026-12-07, an audit from outside).
            entries.setdefault(model, {"modality": "text", "kind": "understand", "model": model, "ready": ready,
                                       "input_modalities": ["text"]})  # fmt: skip
        return list(entries.values())

    def _live_peers(self) -> list[NodeView]:
        """Other peers' own records (not relayed legacy nodes), alive, with an API URL."""
        seen: dict[str, NodeView] = {}
        for view in self._views():
            record = view.record
            if record.peer_id == self.me or record.relayed or view.state == "Dead":
                continue
            if not record.api_url.startswith(("http://", "https://")):
                continue  # requests are forwarded only to an HTTP API
            seen.setdefault(record.peer_id, view)
        return [seen[p] for p in sorted(seen)]

    def _generator_peers(self, model: str, modality: str) -> list[NodeView]:
        """Other live, Ready peers advertising a generator of ``model`` for ``modality``,
        by PeerID."""
        return [view for view in self._live_peers() if view.state == "Ready" and any(
            e.get("model") == model and e.get("modality") == modality for e in view.record.generators)]  # fmt: skip

    def _key_home(self, new: NewJob) -> NodeView | None:
        """Where a keyed submission runs when other peers have its generator too: the same
        peer whichever peer is asked (the highest hash of PeerID and key among them and this
        one), so a retry through another peer finds the first job in that peer's table
        rather than queueing a second (the spec's ``idempotency_key``; each peer ran it
        locally until 2026-12-07, an audit). None: this peer."""
        key = new.idempotency_key
        holders = self._generator_peers(new.model, new.modality) if key is not None else []
        if key is None or not holders:
            return None
        best = max(holders, key=lambda view: _key_rank(view.record.peer_id, key))
        return best if _key_rank(best.record.peer_id, key) > _key_rank(self.me, key) else None

    # -- submit --------------------------------------------------------------------------

    async def submit(self, new: NewJob, *, local_only: bool, known_chat_model: bool) -> dict[str, Any]:
        """Queue ``new`` where its generator is; the job record (spec shape)."""
        if self.check(new, n_inputs=len(new.input_artifacts)):
            home = None if local_only else self._key_home(new)
            if home is not None:
                try:
                    return await self._forward_submit(home, new)
                except PeerUnreachable as exc:  # run here: a duplicate beats no job
                    log.info("the home of idempotency key %r is unreachable (%s): submitting here", new.idempotency_key, exc)
            job, _ = self.runner.submit(new)
            return job.to_json()
        local = self.runner.generators.get(new.model)
        if not local_only and local is None:
            remotes = self._generator_peers(new.model, new.modality)
            if remotes:
                return await self._forward_submit(remotes[0], new)
        fallback = self.runner.generator(new.model) if local is None else None
        if new.modality == "text" and known_chat_model and fallback is not None:
            fallback.check(new.modality, new.params, len(new.input_artifacts))
            job, _ = self.runner.submit(new)
            return job.to_json()
        raise NoGenerator(
            f"no generator produces {new.modality} with model {new.model!r}; "
            "GET /v1/generations/capabilities lists what this swarm offers"
        )

    def check(self, new: NewJob, *, n_inputs: int) -> bool:
        """Whether this peer's own generator takes ``new``, after letting it refuse the params
        (``InvalidParams``, 400). A caller that stores inputs first calls this before storing:
        a submission refused after its upload was stored would leave that upload behind. A
        generator on another peer checks when the submission arrives."""
        local = self.runner.generators.get(new.model)
        if local is None or local.modality != new.modality:
            return False
        local.check(new.modality, new.params, n_inputs)
        return True

    async def _forward_submit(self, view: NodeView, new: NewJob) -> dict[str, Any]:
        key = new.idempotency_key
        if key is not None and key in self._pending_keys:
            # The first submission with this key is still on its way to the generator's peer:
            # its job does not exist yet, so it cannot be handed back.
            raise IdempotencyConflict(f"idempotency key {key!r} is being submitted right now; retry")
        if key is not None:
            self._pending_keys.add(key)
        try:
            _, body = await self.http.json(view.record.api_url, "POST", "/v1/generations", body=_submission(new),
                                           max_bytes=MAX_RECORD_BYTES, owner=view.record.peer_id)  # fmt: skip
        finally:
            if key is not None:
                self._pending_keys.discard(key)
        return _job_body(body, owner=view.record.peer_id)

    # -- one job -------------------------------------------------------------------------

    def _owner(self, job_id: str) -> NodeView | None:
        """None when the id is ours; the owner's view otherwise. An id whose tag names no
        peer in the registry is JobNotFound (404); an owner the registry knows but believes
        Dead is PeerUnreachable (503: the job may well exist). Relayed peers count when
        choosing the owner (their whole tag wins over another peer's 32 bits) but are not
        asked: an id of theirs is 404 here, as before."""
        views = self._views()
        known: dict[str, NodeView] = {}
        for view in views:
            if not view.record.relayed and view.record.peer_id != self.me:
                known.setdefault(view.record.peer_id, view)
        candidates = owner_candidates(job_id, [self.me, *(view.record.peer_id for view in views)])
        if self.me in candidates and (self.runner.store.get(job_id) is not None or len(candidates) == 1):
            return None
        others = [known[p] for p in candidates if p in known]
        for view in others:
            if view.state != "Dead" and view.record.api_url.startswith(("http://", "https://")):
                return view
        if others:
            raise PeerUnreachable(f"job {job_id} is held by peer {others[0].record.peer_id}, which is not reachable now")
        raise JobNotFound(f"no generation job {job_id}")

    async def get(self, job_id: str, *, local_only: bool) -> dict[str, Any]:
        job_id = parse_id(job_id)
        owner = None if local_only else self._owner(job_id)
        if owner is None:
            return self._local(job_id).to_json()
        return await self._remote_job(owner, "GET", job_id)

    async def cancel(self, job_id: str, *, local_only: bool) -> dict[str, Any]:
        job_id = parse_id(job_id)
        owner = None if local_only else self._owner(job_id)
        if owner is None:
            return (await self.runner.cancel(job_id)).to_json()
        return await self._remote_job(owner, "DELETE", job_id)

    async def _remote_job(self, owner: NodeView, method: str, job_id: str) -> dict[str, Any]:
        """The owner's answer about ``job_id``: that job's record, of a record's size at most."""
        _, body = await self.http.json(owner.record.api_url, method, f"/v1/generations/{job_id}", max_bytes=MAX_RECORD_BYTES,
                                       owner=owner.record.peer_id)  # fmt: skip
        return _job_body(body, job_id)

    async def erase(self, job_id: str, *, artifacts: bool) -> dict[str, Any]:
        """Admin: destroy the record (and by default the outputs) wherever the job lives. The
        signed command goes to the owner the id names: found by its ``api_url``, which any
        record may copy, it went to whichever peer sorted first (an audit, 2026-12-07)."""
        job_id = parse_id(job_id)
        owner = self._owner(job_id)
        if owner is None:
            deleted = await self.runner.erase(job_id, artifacts=artifacts)
            return {"id": job_id, "artifacts_deleted": deleted}
        await self._remote_job(owner, "GET", job_id)  # 404 if there is no such job
        if self._erase_remote is None:
            raise PeerUnreachable("admin commands to other peers are not available here")
        answer = await self._erase_remote(owner.record.peer_id, job_id, artifacts)
        try:
            deleted = read_int(answer, "artifacts_deleted", lo=0, hi=MAX_ERASED, default=0)
        except Malformed as exc:
            raise PeerUnreachable(f"peer {owner.record.peer_id} answered the erase with {exc}") from None
        return {"id": job_id, "artifacts_deleted": deleted}

    def _local(self, job_id: str) -> Job:
        job = self.runner.store.get(job_id)
        if job is None:
            raise JobNotFound(f"no generation job {job_id}")
        return job

    # -- listing -------------------------------------------------------------------------

    async def list(self, limit: int, offset: int, *, local_only: bool) -> tuple[list[dict[str, Any]], bool]:
        """``(rows, truncated)``, newest first over the whole swarm (this peer alone when
        ``local_only``); each owner resolves its own jobs' output artifacts.

        Another peer sends its newest ``offset + limit`` rows (one page: see
        :data:`LIST_MAX_LIMIT`, past which the listing is :class:`ListingTooDeep`), and says
        whether it has more, which makes the whole listing ``truncated``. Peers are asked in
        turns (:class:`~inclavate.fan_out.FanOut`, shared with artifact listings), each
        answer's rows checked (:mod:`inclavate.job_rows`: a peer lists only its own jobs, in
        the spec's shape) and merged into the best ``offset + limit`` as it arrives."""
        peers = [] if local_only else self._live_peers()
        if not peers:
            jobs = self.runner.store.list(limit + 1, offset)
            return [self._listed(job) for job in jobs[:limit]], len(jobs) > limit
        window = offset + limit
        if window > LIST_MAX_LIMIT:
            raise ListingTooDeep(
                f"offset + limit may reach at most {LIST_MAX_LIMIT} jobs in a swarm-wide listing "
                f"({len(peers)} other peers each send their newest {LIST_MAX_LIMIT} at most)"
            )
        async with self._fan_out.gate.turn():  # shared with artifact and Files listings
            return await self._list_swarm(peers, limit, offset, window)

    async def _list_swarm(self, peers: list[NodeView], limit: int, offset: int,
                          window: int) -> tuple[list[dict[str, Any]], bool]:  # fmt: skip
        kept = _JobWindow(window)
        own = self.runner.store.list(window + 1, 0)
        kept.add([self._listed(job) for job in own], None)
        truncated = False  # kept.overflow says whether this peer has more
        urls = {view.record.peer_id: view.record.api_url for view in peers}
        owners = Owners([self.me, *(view.record.peer_id for view in self._views())])  # whose ids a peer may list

        max_bytes = listing_answer_bytes(window)

        async def ask(peer: str) -> bytes:
            _, raw = await self.http.read(urls[peer], "GET", "/v1/generations", params={"limit": window},
                                          max_bytes=max_bytes, owner=peer)  # fmt: skip
            return raw

        async def decode(peer: str, raw: bytes) -> _JobAnswer:
            owns = functools.partial(owners.carries_owner, peer=peer)
            return await self._decode_listing(raw, urls[peer], peer, owns, window, max_bytes)

        def take(peer: str, answer: _JobAnswer) -> None:
            nonlocal truncated
            if answer.page is not None:
                truncated = truncated or answer.page.truncated
                kept.add(answer.page.rows, peer)

        deadline = trio.current_time() + LIST_TIMEOUT_S
        budget: AskBudget[_JobAnswer] = AskBudget(listing_budget(window), window, lambda answer: answer.rows_in)
        await self._fan_out.ask(self._fan_out.order(urls), ask, take, deadline, budget, decode=decode)
        rows = kept.entries[offset:]
        self._fan_out.remember(kept.peers_of(rows))
        return [row for _, row, _ in rows], truncated or kept.overflow

    async def _decode_listing(self, raw: bytes, url: str, peer: str, owns: Owns, window: int,
                              max_bytes: int) -> _JobAnswer:  # fmt: skip
        """``peer``'s listing answer, parsed and its rows checked in steps (the fan-out's
        second phase, in this process's one decode turn: :meth:`~inclavate.fan_out.FanOut.ask`):
        an answer of 1,000 rows is ~0.5 MB (~9 ms to parse, ~17 ms of checks), and up to 32
        arrive at once. What is not JSON raises :class:`PeerUnreachable` (the peer is left
        out, its ask counted in full); a page that is :class:`Malformed` leaves the peer out
        too, counted in :attr:`listing_drops`, its ask counted as the rows it holds."""
        body = parse_answer(raw, url, max_bytes)
        await trio.lowlevel.checkpoint()
        try:
            page = await in_steps(decode_job_page_in_steps(body, owns, window))
        except Malformed as exc:
            self.listing_drops.count(exc.reason)
            log.warning("job listing: peer %s left out: %s", peer, exc)
            page = None
        return _JobAnswer(_rows_in(body), page)

    def _listed(self, job: Job) -> dict[str, Any]:
        body = job.to_json()
        if job.state == "completed":
            alive = []
            for artifact_id in job.output_artifacts:
                try:
                    self.artifacts.store.meta(artifact_id)  # a job's outputs are in its own peer's store
                    alive.append(artifact_id)
                except ArtifactNotFound:
                    pass
            body["output_artifacts"] = alive
            body["artifacts_deleted"] = len(job.output_artifacts) - len(alive)
        return body

    # -- watching ------------------------------------------------------------------------

    async def events(self, job_id: str, *, local_only: bool, source: str = "?") -> AsyncGenerator[str, None]:
        """Checks the job exists and a stream has room (raising before anything is
        streamed), then returns the SSE ``data:`` payloads: the current state, one per
        change, ``[DONE]``. The caller closes it (``aclosing``) when its client leaves, which
        gives its place back at once. ``source``: the client's (``source_of`` its address),
        whose share of this peer's streams a local job's stream takes
        (:data:`~inclavate.job_feeds.MAX_WATCHERS_PER_SOURCE`)."""
        job_id = parse_id(job_id)
        owner = None if local_only else self._owner(job_id)
        if owner is None:  # one read per change of the job, for all its watchers; WatchersFull past the caps
            return self.runner.feeds.watch(self._local(job_id), source)
        place = self.http.reserve_stream(owner.record.peer_id, source)  # 429 before the stream opens
        try:
            await self._remote_job(owner, "GET", job_id)  # 404 before the stream opens
        except BaseException:
            place.release()
            raise
        return self._remote_events(owner, job_id, place)

    async def _remote_events(self, owner: NodeView, job_id: str, place: Place) -> AsyncGenerator[str, None]:
        """The owner's events, relayed, or its job's states from polls when the owner refuses
        the stream (its 429); ``place`` (of this peer's relayed streams) is held throughout."""
        url = owner.record.api_url
        try:
            # An event is a job record (at most MAX_RECORD_BYTES) after "data: ".
            async with self.http.stream_lines(url, f"/v1/generations/{job_id}/events", max_line_bytes=MAX_RECORD_BYTES + 64,
                                              owner=owner.record.peer_id, place=place) as lines:  # fmt: skip
                async for line in lines:
                    if not line.startswith("data: "):
                        continue
                    payload = line.removeprefix("data: ")
                    if payload != "[DONE]":  # the owner's word about this job, nothing else
                        _job_body(parse_answer(payload.encode(), url, MAX_RECORD_BYTES), job_id)
                    yield payload
                    if payload == "[DONE]":
                        return
        except RelayedError as exc:
            if exc.status != 429:
                raise
            # The owner's streams filled up (its watchers of the job, or of all its jobs: a
            # 429) after this one's response began: the same events, from polls of the owner,
            # rather than a stream cut short with a traceback in the log (a review, 2026-12-07:
            # the owner's cap is newer than this relay). This peer's own bounds were taken
            # with the place, before the response began.
            last = None
            while True:
                body = await self._remote_job(owner, "GET", job_id)
                payload = json.dumps(body)
                if payload != last:
                    last = payload
                    yield payload
                if body.get("state") in ("completed", "failed", "cancelled", "expired"):
                    yield "[DONE]"
                    return
                await trio.sleep(BUSY_POLL_S)
        finally:
            place.release()

    async def wait_finished(self, job_id: str, timeout: float) -> dict[str, Any] | None:
        """The job once it ended, or None when ``timeout`` ran out first (it keeps running)."""
        with trio.move_on_after(timeout):
            while True:
                job = await self.get(job_id, local_only=False)
                if job["state"] in ("completed", "failed", "cancelled", "expired"):
                    return job
                if self._owner(job_id) is None:
                    await self.runner.wait_changed(1.0)
                else:
                    await trio.sleep(POLL_S)
        return None

    # -- artifacts -----------------------------------------------------------------------

    async def read_artifact(self, artifact_id: str, max_bytes: int) -> InputMedia:
        """An artifact's bytes from whichever peer holds it (inputs, sync adapters)."""
        meta, data = await self.artifacts.read_all(artifact_id, max_bytes)
        return InputMedia(data, meta.media_type)

    async def store_upload(self, data: bytes, media_type: str) -> str:
        """Keep an uploaded clip (a transcription's input) as an ``uploaded`` artifact."""

        async def chunks() -> AsyncIterator[bytes]:
            yield data

        meta = await self.artifacts.store.create(chunks(), media_type=media_type, kind="uploaded", declared_size=len(data))
        return meta.id

    async def abandon(self, job_id: str) -> None:
        """A synchronous route's client left while it waited for ``job_id``, whose id it never
        got: cancel the job, and erase one of ours that finished meanwhile with its outputs.
        Nobody else knows the id, so anything kept would stay for good. Called while the
        request is being cancelled: a failure here is logged, not raised."""
        try:
            try:
                await self.cancel(job_id, local_only=False)
            except JobFinished:
                if self._owner(job_id) is None:
                    await self.runner.erase(job_id, artifacts=True)
        except (InclavateError, OSError) as exc:  # another peer's finished job keeps its output
            log.warning("could not cancel job %s after its client left: %s", job_id, exc)

    async def discard_upload(self, artifact_id: str) -> None:
        """Delete a clip kept by :meth:`store_upload` that no job will read (its submission
        was refused, or its job ended without output). Called while an error is on its way
        to the client, so a failure here is logged rather than raised over that error."""
        try:
            await self.artifacts.store.delete(artifact_id)
        except (ArtifactError, OSError) as exc:
            log.warning("could not delete the refused upload %s: %s", artifact_id, exc)


class _JobWindow:
    """The best ``size`` rows of a swarm-wide job listing so far (newest first), each with
    the peer that listed it (None: this peer), merged in as each answer arrives: a listing
    holds O(``size``) rows whatever the number of peers answering. An id already kept is
    not taken again (the first to list it wins: this peer's own rows come first)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.entries: list[tuple[tuple[str, str], dict[str, Any], str | None]] = []
        self.overflow = False
        """Whether a row fell past ``size``: there are more rows than the window."""

    def add(self, rows: list[dict[str, Any]], peer: str | None) -> None:
        held = {row["id"] for _, row, _ in self.entries}
        new = [((row["created_at"], row["id"]), row, peer) for row in rows if row["id"] not in held]
        if keep_best(self.entries, new, self.size, descending=True, key=lambda entry: entry[0]):
            self.overflow = True

    @staticmethod
    def peers_of(entries: list[tuple[tuple[str, str], dict[str, Any], str | None]]) -> list[str]:
        """The peers with rows among ``entries``, the first rows' peers last (remembered
        last, so asked first next time)."""
        peers = list(dict.fromkeys(peer for _, _, peer in entries if peer is not None))
        return peers[::-1]


@dataclass(frozen=True)
class _JobAnswer:
    """Another peer's listing answer, decoded."""

    rows_in: int
    """What it costs the listing's :class:`~inclavate.fan_out.AskBudget` (:func:`_rows_in`)."""
    page: PeerJobPage | None
    """None: refused (:class:`Malformed`), the peer left out."""


def _rows_in(body: Any) -> int:
    """The rows another peer's listing answer holds, as far as a glance can tell (its
    budget's use; :func:`~inclavate.job_rows.decode_job_page_in_steps` checks the rest)."""
    data = body.get("generations") if isinstance(body, dict) else None
    return len(data) if isinstance(data, list) else 0


def _submission(new: NewJob) -> dict[str, Any]:
    body: dict[str, Any] = {"model": new.model, "modality": new.modality, "params": dict(new.params),
                            "input_artifacts": list(new.input_artifacts), "deadline_seconds": new.deadline_s}  # fmt: skip
    if new.seed is not None:
        body["seed"] = new.seed
    if new.idempotency_key is not None:
        body["idempotency_key"] = new.idempotency_key
    return body


def _job_body(body: Any, asked: str | None = None, *, owner: str | None = None) -> dict[str, Any]:
    """A peer's answer about one job: a record of the job ``asked`` about, or of a job the
    peer ``owner`` made (a submission's). Any id was taken: a peer that alone offers a model
    answered a submission with another peer's job, whose audio the speech route then
    served as this client's, and whose job it cancelled when the client left (an audit,
    2026-12-07)."""
    if not isinstance(body, dict) or not isinstance(body.get("id"), str) or not isinstance(body.get("state"), str):
        raise PeerUnreachable("the owning peer answered something that is not a job")
    try:
        job_id = parse_id(body["id"])
    except MalformedId:
        raise PeerUnreachable("the owning peer answered a job without a valid id") from None
    if (asked is not None and job_id != asked) or (owner is not None and owner_candidates(job_id, [owner]) != [owner]):
        raise PeerUnreachable(f"the peer answered with job {job_id}, which is not the one asked for")
    return body


def _key_rank(peer_id: str, key: str) -> bytes:
    """A peer's rank for an idempotency key: rendezvous hashing, so every peer picks the same
    home for a key and a peer joining or leaving moves only the keys it wins or held."""
    return hashlib.sha256(f"{peer_id}\0{key}".encode()).digest()
