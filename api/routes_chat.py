"""``POST /v1/chat/completions`` (JSON and SSE), ``/ws/chat``, ``GET``/``DELETE /sessions/:id``.

A streamed generation runs as a task in the app's nursery and hands deltas to the response
over a channel (``api.relay``). If the client goes away, the response is cancelled and
cancels the task, whose own cleanup frees the session's KV cache on every stage (see
``api.generation``). :class:`ChatRunner` is that whole path (guards, preparation, tracking,
streaming) for ``POST /v1/responses`` too, which only translates (``api.routes_responses``).
"""

from __future__ import annotations

import functools

import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import trio
from quart import Response, jsonify, request, websocket
from quart_trio import QuartTrio

from api.chat_job import (
    ChatJob,
    Collected,
    Translate,
    chunk,
    completion_body,
    delta_chunk,
    final_chunks,
    prepare_chat,
    settle,
)
from api.context import PeerContext
from api.errors import Conflict, NotFound, error_response_parts
from api.generation import GenerationResult
from api.reasoning_split import Delta
from api.relay import Offer, relay
from api.responses import no_content
from api.session_routes import RouteBook
from api.sessions import ActiveSessions
from inclavate.types import SessionId

log = logging.getLogger(__name__)

SESSION_HEADER = "x-dppan-session-id"


class RequestInFlight(Conflict):
    """A ``/ws/chat`` request frame sent before the previous request's ``"[DONE]"`` (409)."""


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


@dataclass(frozen=True)
class _Tracking:
    """What this peer keeps about the generations it drives as entry peer."""

    ctx: PeerContext
    sessions: ActiveSessions
    """In flight, for ``DELETE /sessions/:id``."""
    routes: RouteBook
    """Recent routes, for ``GET /sessions/:id``."""


async def _run(job: ChatJob, tracking: _Tracking, emit: Any) -> GenerationResult:
    sid, model = job.session_id, job.request.model
    note = functools.partial(tracking.routes.note, sid, model, answer_id=job.answer_id)

    noted: list[object] = [None]

    async def noting_route(delta: Delta) -> None:
        # The route exists once the first step ran (and may move on failover): read it while
        # the session is open, since closing it forgets the route. Noted when it changes,
        # not at every token (comparing routes hop by hop is work on a token's path).
        route = tracking.ctx.session_route(sid)
        if route is not noted[0]:
            note(route)
            noted[0] = route
        await emit(delta)

    note(None)
    async with tracking.sessions.track(sid):
        try:
            return await job.generation.run(noting_route)
        finally:
            note(None, active=False)


def _events(app: QuartTrio, job: ChatJob, tracking: _Tracking) -> AsyncIterator[dict[str, Any]]:
    """Chunks of a streamed generation (errors as ``{"error": ...}``), produced by a task
    in the app's nursery so the response can be cancelled without losing the cleanup
    (``api.relay``)."""
    held: list[str] = []

    async def produce(offer: Offer[dict[str, Any]]) -> None:
        async def emit(delta: Delta) -> None:
            if delta.kind == "content" and job.buffers_content:
                held.append(delta.text)
            else:
                offer(delta_chunk(job, delta))

        offer(chunk(job, {"role": "assistant", "content": ""}))
        try:
            result = await _run(job, tracking, emit)
            outcome = await settle(tracking.ctx, job, result, "".join(held))
            for final in final_chunks(job, result, outcome):
                offer(final)
        except Exception as exc:  # noqa: BLE001 - reported to the client, never raised into the app
            status, body = error_response_parts(exc)
            log.info("streamed generation %s failed (%d): %s", job.session_id, status, exc)
            offer({**body, "status": status})

    return relay(app.nursery, produce)


@dataclass(frozen=True)
class ChatRunner:
    """A chat turn run exactly as ``POST /v1/chat/completions`` runs it: the same guards
    before any work (body size, the 429 when every place is taken), the same preparation,
    and the same tracking (``GET``/``DELETE /sessions/:id``, freeing the session when the
    client leaves). Kept in ``app.extensions[RUNNER]`` for routes that speak another OpenAI
    shape over it (``api.routes_responses``) and only translate."""

    app: QuartTrio
    tracking: _Tracking

    async def prepare(self, translate: Translate | None = None) -> ChatJob:
        """The current request's body, size-checked, admitted and prepared."""
        limits = self.tracking.ctx.limits
        length = request.content_length
        if length is not None:
            limits.check_body_size(length)
        raw = await request.get_data(cache=False)
        limits.check_body_size(len(raw))
        with self.tracking.sessions.admitting():  # after the body: a client that never sends it holds no place
            return await prepare_chat(self.tracking.ctx, raw, translate)

    async def complete(self, job: ChatJob) -> dict[str, Any]:
        """The whole turn, as a ``chat.completion`` body."""
        collected = Collected()
        result = await _run(job, self.tracking, collected.add)
        outcome = await settle(self.tracking.ctx, job, result, "".join(collected.content))
        return completion_body(job, result, collected, outcome)

    def chunks(self, job: ChatJob) -> AsyncIterator[dict[str, Any]]:
        """The turn as ``chat.completion.chunk`` objects (errors as ``{"error": ..., "status": ...}``)."""
        return _events(self.app, job, self.tracking)


RUNNER = "inclavate.chat_runner"


def sse_response(body: AsyncIterator[bytes], job: ChatJob) -> Response:
    """A stream that lasts as long as its generation, with the session's header."""
    response = Response(body, mimetype="text/event-stream", headers=session_headers(job))
    response.headers["Cache-Control"] = "no-cache"
    response.timeout = None
    return response


ID_PREFIXES = ("chatcmpl-", "resp_")
"""What a session id is known by in the answers: a completion's id, a response's id."""


def session_of(answer_id: str) -> SessionId:
    """The session an answer's id (or the bare session id, as in the header) names."""
    for prefix in ID_PREFIXES:
        if answer_id.startswith(prefix):
            return SessionId(answer_id.removeprefix(prefix))
    return SessionId(answer_id)


def session_headers(job: ChatJob) -> dict[str, str]:
    return {SESSION_HEADER: job.session_id}


def install(app: QuartTrio, ctx: PeerContext) -> None:
    app.config["RESPONSE_TIMEOUT"] = None  # generations stream for as long as they take
    sessions: ActiveSessions = app.extensions["inclavate.sessions"]
    tracking = _Tracking(ctx, sessions, RouteBook())
    runner = app.extensions[RUNNER] = ChatRunner(app, tracking)

    @app.post("/v1/chat/completions")
    async def chat_completions():  # type: ignore[no-untyped-def]
        """OpenAI-compatible chat completion, plain JSON or SSE (``stream: true``)."""
        job = await runner.prepare()
        if job.request.stream:

            async def body() -> AsyncIterator[bytes]:
                async for item in runner.chunks(job):
                    yield _sse(item)
                yield b"data: [DONE]\n\n"

            return sse_response(body(), job)
        response = jsonify(await runner.complete(job))
        response.headers.update(session_headers(job))
        return response

    @app.websocket("/ws/chat")
    async def ws_chat() -> None:
        """Chat over a websocket: send a request frame (the POST body), receive the SSE
        chunks as JSON frames, then ``"[DONE]"``. Errors arrive as ``{"error": ...,
        "status": ...}`` frames; the connection stays open for the next request, and is
        closed after ``websocket_idle_s`` without one (an idle one held a descriptor for ever)."""
        while True:
            with trio.move_on_after(ctx.limits.websocket_idle_s) as idle:
                # Quart gives an empty binary frame as None: an empty body, not the deadline.
                raw = await websocket.receive() or b""
            if idle.cancelled_caught:
                await websocket.close(1000, "idle: no request for a while")
                return
            try:
                size = len(raw.encode() if isinstance(raw, str) else raw)
                ctx.limits.check_body_size(size)
                with sessions.admitting():
                    job = await prepare_chat(ctx, raw)
            except Exception as exc:  # noqa: BLE001 - every failure becomes an error frame
                status, body = error_response_parts(exc)
                await websocket.send(json.dumps({**body, "status": status}))
                continue
            await _answer_frames(_events(app, job, tracking))

    async def _answer_frames(items: AsyncIterator[dict[str, Any]]) -> None:
        """Send a request's chunks, then ``"[DONE]"``, reading the connection meanwhile: a
        frame that arrives before ``"[DONE]"`` is refused with a 409 frame. Unread, such frames
        stood in front of the client's close, so a client that left mid-answer (having sent
        more) left its generation running to ``max_tokens``, then the frames it had sent
        were answered as requests of their own, to nobody."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_refuse_frames_meanwhile)
            async for item in items:
                await websocket.send(json.dumps(item, separators=(",", ":")))
            await websocket.send("[DONE]")
            nursery.cancel_scope.cancel()

    async def _refuse_frames_meanwhile() -> None:
        while True:
            await websocket.receive()
            status, body = error_response_parts(RequestInFlight(
                "this connection is answering a request: send the next one after its \"[DONE]\""))  # fmt: skip
            await websocket.send(json.dumps({**body, "status": status}))  # the write is atomic (api.confined_server)

    @app.get("/sessions/<session_id>")
    async def session_route(session_id: str):  # type: ignore[no-untyped-def]
        """Which peers (and layers) a recent session of this peer went through; read-only."""
        found = tracking.routes.get(session_of(session_id))
        if found is None:
            raise NotFound(f"no recent generation session {session_id[:80]!r} on this peer")
        return jsonify(found.to_json())

    @app.delete("/sessions/<session_id>")
    async def close_session(session_id: str):  # type: ignore[no-untyped-def]
        """Stop a generation in flight and free its KV cache on every node of its chain."""
        sid = session_of(session_id)
        if not sessions.close(sid):
            raise NotFound(f"no generation session {session_id!r} is open on this peer")
        return no_content()
