"""Forwarding to the peer that owns a job (``inclavate.peer_http``) against a real HTTP
server on loopback: what a client watching jobs can and cannot take from other clients."""

from __future__ import annotations

import gzip
import http.server
import json
import threading
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from pathlib import Path
from typing import Any

import pytest
import trio
from quart import Response
from quart_trio import QuartTrio

from api.app import serve_api
from inclavate.local_swarm import free_port
from inclavate.errors import RelayedError
from inclavate.peer_http import (
    MAX_EVENT_STREAMS,
    MAX_EVENT_STREAMS_PER_OWNER,
    MAX_EVENT_STREAMS_PER_SOURCE,
    MAX_IN_FLIGHT_PER_OWNER,
    PeerBusy,
    PeerHttp,
    PeerUnreachable,
)


def _silent_owner() -> tuple[QuartTrio, list[int]]:
    """An owner whose ``/events`` send one event and then nothing, for ever; and how many
    of them are open."""
    owner = QuartTrio("owner")
    watching = [0]

    @owner.get("/events")
    async def events():  # type: ignore[no-untyped-def]
        async def body() -> AsyncIterator[bytes]:
            watching[0] += 1
            yield b"data: {}\n\n"
            await trio.sleep_forever()

        response = Response(body(), mimetype="text/event-stream")
        response.timeout = None
        return response

    return owner, watching


async def test_watchers_of_another_peers_job_leave_room_for_every_other_forwarded_request() -> None:
    """``GET /v1/generations/:id/events`` of a job on another peer holds an HTTP connection
    to that peer while the job runs, and the forwarded requests shared one pool of 100:
    110 watchers (one client) on a 3-peer swarm made every other forwarded request of the
    peer (a poll, a cancel, a submission, the listing's rows from the owner) wait 60 s for a
    connection and fail with 503 PoolTimeout, and watchers past 100 waited for ever. The
    relayed event streams now have connections of their own, at most MAX_EVENT_STREAMS, of
    which one owner's jobs hold at most MAX_EVENT_STREAMS_PER_OWNER (watchers of 64 silent
    jobs of one peer held them all: an audit, 2026-12-07); one more is refused at once."""
    owner, watching = _silent_owner()

    @owner.get("/job")
    async def job():  # type: ignore[no-untyped-def]
        return {"id": "the job", "state": "running"}

    owners = MAX_EVENT_STREAMS // MAX_EVENT_STREAMS_PER_OWNER
    urls = [f"http://127.0.0.1:{free_port()}" for _ in range(owners + 1)]
    http = PeerHttp()

    clients = iter(range(10**6))

    async def watch(url: str) -> None:  # each watch from a client of its own
        async with http.stream_lines(url, "/events", max_line_bytes=1024, source=f"client {next(clients)}") as lines:
            async for _ in lines:
                pass

    async def refused(url: str) -> None:
        with pytest.raises(PeerBusy):
            async with http.stream_lines(url, "/events", max_line_bytes=1024, source="a newcomer"):
                pass

    try:
        async with trio.open_nursery() as nursery:
            for url in urls:
                await nursery.start(serve_api, owner, "127.0.0.1", int(url.rsplit(":", 1)[1]))
            for _ in range(MAX_EVENT_STREAMS_PER_OWNER):
                nursery.start_soon(watch, urls[0])
            with trio.fail_after(30):
                while watching[0] < MAX_EVENT_STREAMS_PER_OWNER:
                    await trio.sleep(0.05)
                await refused(urls[0])  # that owner's share is taken, not every stream
            for url in urls[1:owners]:
                for _ in range(MAX_EVENT_STREAMS_PER_OWNER):
                    nursery.start_soon(watch, url)
            with trio.fail_after(30):
                while watching[0] < MAX_EVENT_STREAMS:
                    await trio.sleep(0.05)
            with trio.fail_after(5):
                assert await http.json(urls[0], "GET", "/job") == (200, {"id": "the job", "state": "running"})
                await refused(urls[owners])  # every stream is taken, and this owner holds none
            nursery.cancel_scope.cancel()
    finally:
        await http.aclose()


async def test_one_client_watching_jobs_on_several_owners_leaves_the_others_room() -> None:
    """Relayed event streams were bounded in all (64) and per owner (16), not per client: one
    client watching 16 jobs on each of four owners held every relayed stream of the peer,
    and every other client's watch was a 429 (a review, 2026-12-07). A client's source now
    holds at most MAX_EVENT_STREAMS_PER_SOURCE of them, whatever owners they are on."""
    owner, watching = _silent_owner()

    urls = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    http = PeerHttp()

    async def watch(url: str, source: str) -> None:
        async with http.stream_lines(url, "/events", max_line_bytes=1024, source=source) as lines:
            async for _ in lines:
                pass

    try:
        async with trio.open_nursery() as nursery:
            for url in urls:
                await nursery.start(serve_api, owner, "127.0.0.1", int(url.rsplit(":", 1)[1]))
            for i in range(MAX_EVENT_STREAMS_PER_SOURCE):  # spread over two owners: no owner's share is full
                nursery.start_soon(watch, urls[i % 2], "203.0.113.7")
            with trio.fail_after(30):
                while watching[0] < MAX_EVENT_STREAMS_PER_SOURCE:
                    await trio.sleep(0.05)
            with pytest.raises(PeerBusy, match="your address"):
                http.reserve_stream(urls[0], "203.0.113.7")
            with trio.fail_after(5), pytest.raises(PeerBusy):
                async with http.stream_lines(urls[1], "/events", max_line_bytes=1024, source="203.0.113.7"):
                    pass
            http.reserve_stream(urls[0], "198.51.100.1").release()  # another client: room
            nursery.start_soon(watch, urls[0], "198.51.100.1")
            with trio.fail_after(30):
                while watching[0] < MAX_EVENT_STREAMS_PER_SOURCE + 1:
                    await trio.sleep(0.05)
            nursery.cancel_scope.cancel()
    finally:
        await http.aclose()


# httpx's nested body generators are finalized by the collector when a read stops early
# (the response, and its connection, are closed by ``stream``'s context): a warning, not a leak.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.filterwarnings("ignore::ResourceWarning")
async def test_an_owner_s_event_line_is_bounded_whatever_it_streams() -> None:
    """httpx's ``aiter_lines`` held a line until its newline: an owner streaming one without
    end had the relaying peer buffer it until memory ran out (an audit, 2026-12-07)."""
    owner = QuartTrio("owner")

    @owner.get("/events")
    async def events():  # type: ignore[no-untyped-def]
        async def body() -> AsyncIterator[bytes]:
            yield b"data: one\r\ndata: two\n\ndata: "
            while True:  # then a line that never ends, in small pieces
                yield b"x" * 100
                await trio.sleep(0)

        response = Response(body(), mimetype="text/event-stream")
        response.timeout = None
        return response

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    http = PeerHttp()
    got: list[str] = []
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_api, owner, "127.0.0.1", port)
            with trio.fail_after(30), pytest.raises(PeerUnreachable, match="longer than 4096 bytes"):
                async with http.stream_lines(url, "/events", max_line_bytes=4096) as lines:
                    async for line in lines:
                        got.append(line)
            nursery.cancel_scope.cancel()
    finally:
        await http.aclose()
    assert got == ["data: one", "data: two", ""]


class _HostileOwner(http.server.BaseHTTPRequestHandler):
    """An owner's API that answers as no honest peer would."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        try:
            if self.path == "/bomb":  # 1 MiB of zeros, 1 KiB on the wire: a bomb's first layer
                body = gzip.compress(b"0" * (1 << 20))
                self._head(200, len(body), [("Content-Encoding", "gzip")])
                self.wfile.write(body)
            elif self.path == "/error-without-end":
                self._head(500, None, [("Transfer-Encoding", "chunked")])
                while True:
                    self.wfile.write(b"10000\r\n" + b"e" * 0x10000 + b"\r\n")
            elif self.path == "/drip":
                self._head(200, 64, [])
                for _ in range(64):
                    self.wfile.write(b" ")
                    self.wfile.flush()
                    time.sleep(0.5)
        except OSError:
            pass  # the peer gave up on us, as it should

    def _head(self, status: int, length: int | None, headers: list[tuple[str, str]]) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        if length is not None:
            self.send_header("Content-Length", str(length))
        for name, value in headers:
            self.send_header(name, value)
        self.end_headers()

    def log_message(self, *_args: Any) -> None:
        pass


# httpx's nested body generators are finalized by the collector when a read stops early.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.filterwarnings("ignore::ResourceWarning")
async def test_an_owner_s_answer_is_bounded_in_bytes_as_sent_and_in_time() -> None:
    """What a hostile owner made a relaying peer do (an audit, 2026-12-07): inflate a gzip of
    a gzip in one call (26 KB on the wire: the event loop frozen for half a minute,
    gigabytes), read an event stream's error body without end, and hold a request, and one
    of the connections every owner's requests share, for as long as it dripped bytes."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _HostileOwner)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    client = PeerHttp()
    try:
        with trio.fail_after(20):
            with pytest.raises(PeerUnreachable, match="must be uncompressed"):
                await client.json(url, "GET", "/bomb")
            with pytest.raises(RelayedError) as refused:
                async with client.stream_lines(url, "/error-without-end", max_line_bytes=1024):
                    pass
            assert refused.value.status == 500
            with pytest.raises(PeerUnreachable, match="within 1 s"):
                await client.json(url, "GET", "/drip", timeout=1.0)
            unanswered: list[str] = []

            async def drip() -> None:
                with pytest.raises(PeerUnreachable) as late:
                    await client.json(url, "GET", "/drip", timeout=3.0)
                unanswered.append(str(late.value))

            async with trio.open_nursery() as nursery:
                for _ in range(MAX_IN_FLIGHT_PER_OWNER + 1):
                    nursery.start_soon(drip)
            assert sum("unanswered" in e for e in unanswered) == 1  # the one past the owner's share, at once
            assert sum("within 3 s" in e for e in unanswered) == MAX_IN_FLIGHT_PER_OWNER
            # The share is the owner's (a PeerID), not its URL's, which any record may copy:
            # free identities copying an honest owner's URL took its share (a review, 2026-12-07).
            copied: list[str] = []

            async def copying(identity: str) -> None:
                with pytest.raises(PeerUnreachable) as late:
                    await client.json(url, "GET", "/drip", timeout=2.0, owner=identity)
                copied.append(str(late.value))

            async with trio.open_nursery() as nursery:
                for i in range(MAX_IN_FLIGHT_PER_OWNER):
                    nursery.start_soon(copying, f"copycat{i}")
                nursery.start_soon(copying, "honest")
            assert not any("unanswered" in e for e in copied)
    finally:
        await client.aclose()
        server.shutdown()
        server.server_close()


async def test_a_burst_of_watches_from_one_address_is_refused_past_its_share_not_polled(tmp_path: Path) -> None:
    """A relayed watch's place was checked, then taken when its stream opened, an owner's
    round trip later: watches sent together all passed the check, and each one past the
    bound was refused only after its 200 began, which the fallback for an owner's 429 turned
    into an uncounted poll of the owner every second (one address: 16 streams and 7 pollers,
    a review, 2026-12-07). The place is now taken at the check: past the address's share, a
    429 before any response, and the owner is never polled."""
    from quart_trio import QuartTrio as Owner
    from registry_helpers import view

    from inclavate.artifact_swarm import SwarmArtifacts
    from inclavate.artifacts import ArtifactStore
    from inclavate.generations import GenerationService
    from inclavate.job_runner import JobRunner
    from inclavate.jobs import JobStore
    from inclavate.owner_ids import new_id

    me, other = "12D3KooWme", "12D3KooWother"
    owner = Owner("owner")
    polls = [0]

    @owner.get("/v1/generations/<job_id>/events")
    async def events(job_id: str):  # type: ignore[no-untyped-def]
        async def body() -> AsyncIterator[bytes]:
            yield f"data: {json.dumps({'id': job_id, 'state': 'running'})}\n\n".encode()
            await trio.sleep_forever()

        response = Response(body(), mimetype="text/event-stream")
        response.timeout = None
        return response

    @owner.get("/v1/generations/<job_id>")
    async def job(job_id: str):  # type: ignore[no-untyped-def]
        polls[0] += 1
        await trio.sleep(0.05)  # the round trip the burst's checks all passed within
        return {"id": job_id, "state": "running"}

    port = free_port()
    store = ArtifactStore(tmp_path, me)
    runner = JobRunner(JobStore.in_dir(tmp_path), store, {}, me, read_input=None)  # type: ignore[arg-type]
    http = PeerHttp()
    views = [view(other, 0, 30, api_url=f"http://127.0.0.1:{port}")]
    service = GenerationService(me, runner, SwarmArtifacts(store), lambda: views, http)  # type: ignore[arg-type]
    accepted, refused, streaming = [0], [0], [0]

    async def watch() -> None:
        try:
            payloads = await service.events(new_id(other), local_only=False, source="203.0.113.7")
        except PeerBusy:
            refused[0] += 1
            return
        accepted[0] += 1
        async with aclosing(payloads) as relayed:
            async for _ in relayed:
                streaming[0] += 1

    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_api, owner, "127.0.0.1", port)
            with trio.fail_after(30):
                for _ in range(MAX_EVENT_STREAMS_PER_SOURCE + 4):  # all at once
                    nursery.start_soon(watch)
                while accepted[0] + refused[0] < MAX_EVENT_STREAMS_PER_SOURCE + 4 or streaming[0] < accepted[0]:
                    await trio.sleep(0.05)
            existence_checks = polls[0]
            await trio.sleep(2.5)  # a poller would ask every second
            assert (accepted[0], refused[0]) == (MAX_EVENT_STREAMS_PER_SOURCE, 4)
            assert polls[0] == existence_checks == MAX_EVENT_STREAMS_PER_SOURCE
            nursery.cancel_scope.cancel()
    finally:
        await http.aclose()
