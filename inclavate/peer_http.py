"""Forwarding a REST request to the peer that owns a job (HTTP to its advertised API URL).

A job lives on the peer that runs it; any other peer answers for it by forwarding the
client's request to the owner's API (``NodeRecord.api_url``) and relaying the answer. The
forwarded request carries :data:`FORWARDED_HEADER`, and a peer that receives it acts on its
own jobs only and never forwards again, so a request crosses at most one hop and two peers
can never bounce one between them. The header grants nothing: it only narrows what the
receiving peer does. Admin tokens are never forwarded (admin actions travel signed over
``/inclavate/admin/1``).

Errors: a peer that cannot be reached is :class:`PeerUnreachable` (503); an error the owner
answered is :class:`inclavate.errors.RelayedError`, relayed with its status and body.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from contextlib import aclosing, asynccontextmanager
from typing import Any

import httpx
import trio

from inclavate.errors import InclavateError, RelayedError
from inclavate.key_counts import KeyCounts
from inclavate.places import Place
from inclavate.untrusted import Malformed, parse_json

FORWARDED_HEADER = "x-inclavate-forwarded"

CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 60.0
MAX_RELAYED_ERROR_BYTES = 64 * 1024
MAX_ANSWER_BYTES = 32 * 1024 * 1024
"""A listing of 1000 jobs with large params fits; anything bigger is not a peer's answer."""
MAX_IN_FLIGHT_PER_OWNER = 8
"""Forwarded requests to one owner at once; one more is :class:`PeerUnreachable` at once.
The requests of every owner share one pool of connections: an owner dripping a byte a
minute into each answer held them all, and every other owner's relays failed (an audit,
2026-12-07)."""
_HEADERS = {FORWARDED_HEADER: "1", "Accept-Encoding": "identity"}
"""Answers are asked for, and read, uncompressed (:func:`_raw_body`): httpx inflates each
read whole before any bound on the answer is checked, so a gzip of a gzip (26 KB on the
wire) froze the event loop for half a minute and took gigabytes (an audit, 2026-12-07)."""
MAX_EVENT_STREAMS_PER_OWNER = 16
"""Of :data:`MAX_EVENT_STREAMS`, the most one owner's jobs may hold: watchers of 64 silent
jobs of one peer held them all (an audit, 2026-12-07)."""
MAX_EVENT_STREAMS_PER_SOURCE = 8
"""Of :data:`MAX_EVENT_STREAMS`, the most one client's source (``source_of`` its address: an
IPv4 address, an IPv6 /64) may hold, whatever owners its jobs are on: one client watching
four owners' jobs held all 64 (a review, 2026-12-07). Half an owner's share: at 16, one
address still took every stream of the one owner a small swarm has (the same review)."""
MAX_EVENT_STREAMS = 64
"""Owners' event streams relayed at once (``GET /v1/generations/:id/events`` of another
peer's job). Each holds a connection while its job runs, so they have connections of their
own: in the pool of the forwarded requests, 100 watchers left a poll, a cancel or a
submission waiting 60 s for a connection, then failing with 503."""


class PeerUnreachable(InclavateError):
    """The peer that owns a job did not answer (503)."""


class PeerBusy(InclavateError):
    """This peer already relays :data:`MAX_EVENT_STREAMS` event streams (429: retry, or poll)."""


class PeerHttp:
    def __init__(self) -> None:
        self._client: httpx.AsyncClient | None = None
        self._stream_client: httpx.AsyncClient | None = None
        self._streams = 0
        self._in_flight = KeyCounts(MAX_IN_FLIGHT_PER_OWNER)
        """Forwarded requests under way, by owner URL."""
        self._streams_of = KeyCounts(MAX_EVENT_STREAMS_PER_OWNER)
        """Relayed event streams open, by owner URL."""
        self._streams_from = KeyCounts(MAX_EVENT_STREAMS_PER_SOURCE)
        """Relayed event streams open, by the source of the client they are relayed to."""

    def _http(self) -> httpx.AsyncClient:
        # Created on first use, inside the trio run (httpx picks trio through anyio).
        if self._client is None:
            timeout = httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
            self._client = httpx.AsyncClient(timeout=timeout, headers=_HEADERS)
        return self._client

    def _stream_http(self) -> httpx.AsyncClient:
        if self._stream_client is None:
            timeout = httpx.Timeout(None, connect=CONNECT_TIMEOUT_S, pool=CONNECT_TIMEOUT_S)
            limits = httpx.Limits(max_connections=MAX_EVENT_STREAMS, max_keepalive_connections=0)
            self._stream_client = httpx.AsyncClient(timeout=timeout, limits=limits, headers=_HEADERS)
        return self._stream_client

    def reserve_stream(self, owner: str, source: str = "?") -> Place:
        """A relayed event stream's place, taken now, in all, of ``owner`` (a PeerID: a URL
        any record may copy) and of the client's ``source``; PeerBusy when one is full.
        Taken at the check, before any wait: checked first and taken when the stream
        opened, a burst of watches passed the check together and each one past the bound
        became an uncounted poll of the owner (a review, 2026-12-07)."""
        if self._streams_from.full(source):
            raise PeerBusy(f"your address already watches {self._streams_from.limit} jobs of other peers through "
                           "this peer; close one, poll GET /v1/generations/:id, or watch on the peer that runs the job")  # fmt: skip
        if self._streams >= MAX_EVENT_STREAMS or self._streams_of.full(owner):
            raise PeerBusy("this peer already relays as many event streams from other peers as it may; "
                           "retry later, poll GET /v1/generations/:id, or watch on the peer that runs the job")  # fmt: skip
        place = Place(functools.partial(self._stream_ended, owner, source), f"a relayed stream from {owner}")
        self._streams += 1
        self._streams_of.take(owner)
        self._streams_from.take(source)
        return place

    def _stream_ended(self, owner: str, source: str) -> None:
        self._streams -= 1
        self._streams_of.give(owner)
        self._streams_from.give(source)

    async def aclose(self) -> None:
        for client in (self._client, self._stream_client):
            if client is not None:
                await client.aclose()

    async def json(self, base_url: str, method: str, path: str, *, body: Any = None,
                   params: Mapping[str, Any] | None = None, timeout: float | None = None,
                   max_bytes: int = MAX_ANSWER_BYTES, owner: str | None = None) -> tuple[int, Any]:  # fmt: skip
        """A forwarded JSON request; ``(status, decoded body)`` for 2xx, else raises. The
        answer is read up to ``max_bytes`` (a peer's answer is hostile input too; a caller that
        knows how large an honest answer can be passes that)."""
        status, raw = await self.read(base_url, method, path, body=body, params=params, timeout=timeout,
                                      max_bytes=max_bytes, owner=owner)  # fmt: skip
        return status, parse_answer(raw, base_url, max_bytes)

    async def read(self, base_url: str, method: str, path: str, *, body: Any = None,
                   params: Mapping[str, Any] | None = None, timeout: float | None = None,
                   max_bytes: int = MAX_ANSWER_BYTES, owner: str | None = None) -> tuple[int, bytes]:  # fmt: skip
        """:meth:`json`'s answer unparsed, for a caller that parses it when its turn comes
        (:func:`parse_answer`; a job listing's answers, in a fan-out's decode phase:
        :meth:`inclavate.fan_out.FanOut.ask`). ``owner``: the PeerID the request is for,
        whose share of requests it takes (by ``base_url`` when None: a URL any record may
        copy, and free identities copying an honest owner's took its share)."""
        deadline = timeout or READ_TIMEOUT_S
        key = owner or base_url
        if self._in_flight.full(key):
            raise PeerUnreachable(f"peer {key} has {MAX_IN_FLIGHT_PER_OWNER} requests of ours unanswered; retry later")
        with self._in_flight.held(key), trio.move_on_after(deadline) as late:
            try:
                async with self._http().stream(method, base_url + path, json=body, params=params) as response:
                    answer = await _read_body(response, base_url, max_bytes)
            except (httpx.HTTPError, httpx.InvalidURL) as exc:  # the URL is the peer's own claim
                raise PeerUnreachable(f"peer {base_url!r} did not answer: {type(exc).__name__}") from exc
        if late.cancelled_caught:  # a whole answer, not each read: a drip held a request for ever
            raise PeerUnreachable(f"peer {base_url} did not answer within {deadline:g} s")
        _raise_for_error(response.status_code, answer)
        return response.status_code, answer

    @asynccontextmanager
    async def stream_lines(self, base_url: str, path: str, *, max_line_bytes: int, owner: str | None = None,
                           source: str = "?", place: Place | None = None) -> AsyncIterator[AsyncIterator[str]]:  # fmt: skip
        """An SSE stream from ``owner`` (a PeerID; by ``base_url`` when None), line by line,
        for a client at ``source`` (errors before the stream opens raise; a line longer than
        ``max_line_bytes`` ends it as :class:`PeerUnreachable`). ``place``: the stream's,
        from :meth:`reserve_stream`, which the caller gives back; when None, one is taken
        here (PeerBusy when full) and given back when the stream ends, whichever way."""
        own = place is None
        place = place or self.reserve_stream(owner or base_url, source)
        try:
            async with self._stream_http().stream("GET", base_url + path) as response:
                if response.status_code >= 400:
                    raw = b""
                    with trio.move_on_after(READ_TIMEOUT_S):  # what error it is, if it says so in time
                        raw = await _read_body(response, base_url, MAX_RELAYED_ERROR_BYTES, cut=True)
                    _raise_for_error(response.status_code, raw)
                async with aclosing(_lines(_raw_body(response, base_url), max_line_bytes, base_url)) as lines:
                    yield lines
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            raise PeerUnreachable(f"peer {base_url} did not answer: {type(exc).__name__}") from exc
        finally:
            if own:
                place.release()


def _raw_body(response: httpx.Response, base_url: str) -> AsyncGenerator[bytes, None]:
    """``response``'s body as sent, which must be uncompressed (:data:`_HEADERS`)."""
    encoding = response.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise PeerUnreachable(f"peer {base_url} answered in {encoding[:40]!r}; relayed answers must be uncompressed")
    return response.aiter_raw()


async def _read_body(response: httpx.Response, base_url: str, max_bytes: int, *, cut: bool = False) -> bytes:
    """At most ``max_bytes`` of the body: more is PeerUnreachable, or with ``cut`` left unread."""
    raw = bytearray()
    async with aclosing(_raw_body(response, base_url)) as chunks:  # closed at once on an early end
        async for chunk in chunks:
            raw += chunk
            if len(raw) > max_bytes:
                if cut:
                    return bytes(raw[:max_bytes])
                raise PeerUnreachable(f"peer {base_url} answered more than {max_bytes} bytes")
    return bytes(raw)


async def _lines(chunks: AsyncGenerator[bytes, None], max_line_bytes: int, base_url: str) -> AsyncIterator[str]:
    """``chunks`` split at newlines, no line held past ``max_line_bytes``. httpx's own
    ``aiter_lines`` holds a line until its newline comes: an owner that never sent one had
    the relaying peer buffer its stream until memory ran out (an audit, 2026-12-07). Each
    chunk is searched once, so a line dripped a byte at a time costs no more than its bytes."""
    pending = bytearray()
    async with aclosing(chunks):
        async for chunk in chunks:
            scan = len(pending)
            pending += chunk
            while (end := pending.find(b"\n", scan)) >= 0:
                if end > max_line_bytes:
                    break
                line = bytes(pending[:end]).removesuffix(b"\r")
                del pending[: end + 1]
                scan = 0
                yield line.decode("utf-8", errors="replace")
            if len(pending) > max_line_bytes:
                raise PeerUnreachable(f"peer {base_url} sent an event line longer than {max_line_bytes} bytes")
    if pending:
        yield bytes(pending).decode("utf-8", errors="replace")


def parse_answer(raw: bytes, base_url: str, max_bytes: int) -> Any:
    """A peer's 2xx answer (:meth:`PeerHttp.read`) as JSON (None when empty), or
    :class:`PeerUnreachable`: what is not JSON is no answer."""
    try:
        return parse_json(raw, max_bytes=max_bytes) if raw else None
    except Malformed as exc:
        raise PeerUnreachable(f"peer {base_url} answered something that is not JSON ({exc})") from exc


def _raise_for_error(status: int, raw: bytes) -> None:
    if status < 400:
        return
    try:
        body = parse_json(raw[:MAX_RELAYED_ERROR_BYTES], max_bytes=MAX_RELAYED_ERROR_BYTES) if raw else {}
    except Malformed:
        body = {}
    if not isinstance(body, dict) or "error" not in body:
        body = {"error": f"the owning peer answered {status}"}
    raise RelayedError(status, body)
