"""``POST /v1/chat/completions`` (JSON and SSE), ``/ws/chat`` and ``DELETE /sessions/:id``.

A streamed generation runs as a task in the app's nursery and hands deltas to the response
over a channel. If the client goes away, the response is cancelled and cancels the task,
whose own cleanup frees the session's KV cache on every stage (see ``api.generation``).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import AsyncIterator
from typing import Any

import trio
from quart import Response, jsonify, request, websocket
from quart_trio import QuartTrio

from api.chat_job import ChatJob, Collected, chunk, completion_body, delta_chunk, final_chunks, prepare_chat
from api.context import PeerContext
from api.errors import NotFound, error_response_parts
from api.generation import GenerationResult
from api.reasoning_split import Delta
from api.sessions import ActiveSessions
from inclavate.types import SessionId

log = logging.getLogger(__name__)

SESSION_HEADER = "x-dppan-session-id"


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def _run(job: ChatJob, sessions: ActiveSessions, emit: Any) -> GenerationResult:
    with sessions.track(job.session_id):
        return await job.generation.run(emit)


def _events(app: QuartTrio, job: ChatJob, sessions: ActiveSessions) -> AsyncIterator[dict[str, Any]]:
    """Chunks of a streamed generation (errors as ``{"error": ...}``), produced by a task
    in the app's nursery so the response can be cancelled without losing the cleanup."""
    send, receive = trio.open_memory_channel[tuple[str, Any]](math.inf)
    scope = trio.CancelScope()
    held: list[str] = []

    async def emit(delta: Delta) -> None:
        if delta.kind == "content" and job.buffers_content:
            held.append(delta.text)
        else:
            send.send_nowait(("chunk", delta_chunk(job, delta)))

    async def produce() -> None:
        with scope:
            try:
                result = await _run(job, sessions, emit)
                for final in final_chunks(job, result, "".join(held)):
                    send.send_nowait(("chunk", final))
            except Exception as exc:  # noqa: BLE001 - reported to the client, never raised into the app
                status, body = error_response_parts(exc)
                log.info("streamed generation %s failed (%d): %s", job.session_id, status, exc)
                send.send_nowait(("chunk", {**body, "status": status}))
            finally:
                send.close()

    async def events() -> AsyncIterator[dict[str, Any]]:
        app.nursery.start_soon(produce)
        try:
            yield chunk(job, {"role": "assistant", "content": ""})
            async with receive:
                async for _kind, item in receive:
                    yield item
        finally:
            scope.cancel()

    return events()


def install(app: QuartTrio, ctx: PeerContext) -> None:
    app.config["RESPONSE_TIMEOUT"] = None  # generations stream for as long as they take
    sessions: ActiveSessions = app.extensions["inclavate.sessions"]

    @app.post("/v1/chat/completions")
    async def chat_completions():  # type: ignore[no-untyped-def]
        """OpenAI-compatible chat completion, plain JSON or SSE (``stream: true``)."""
        length = request.content_length
        if length is not None:
            ctx.limits.check_body_size(length)
        raw = await request.get_data(cache=False)
        ctx.limits.check_body_size(len(raw))
        job = await prepare_chat(ctx, raw)
        headers = {SESSION_HEADER: job.session_id}
        if job.request.stream:

            async def body() -> AsyncIterator[bytes]:
                async for item in _events(app, job, sessions):
                    yield _sse(item)
                yield b"data: [DONE]\n\n"

            response = Response(body(), mimetype="text/event-stream", headers=headers)
            response.headers["Cache-Control"] = "no-cache"
            response.timeout = None
            return response
        collected = Collected()
        result = await _run(job, sessions, collected.add)
        response = jsonify(completion_body(job, result, collected))
        response.headers.update(headers)
        return response

    @app.websocket("/ws/chat")
    async def ws_chat() -> None:
        """Chat over a websocket: send a request frame (the POST body), receive the SSE
        chunks as JSON frames, then ``"[DONE]"``. Errors arrive as ``{"error": ...,
        "status": ...}`` frames; the connection stays open for the next request."""
        while True:
            raw = await websocket.receive()
            try:
                size = len(raw.encode() if isinstance(raw, str) else raw)
                ctx.limits.check_body_size(size)
                job = await prepare_chat(ctx, raw)
            except Exception as exc:  # noqa: BLE001 - every failure becomes an error frame
                status, body = error_response_parts(exc)
                await websocket.send(json.dumps({**body, "status": status}))
                continue
            async for item in _events(app, job, sessions):
                await websocket.send(json.dumps(item, separators=(",", ":")))
            await websocket.send("[DONE]")

    @app.delete("/sessions/<session_id>")
    async def close_session(session_id: str):  # type: ignore[no-untyped-def]
        """Stop a generation in flight and free its KV cache on every node of its chain."""
        sid = SessionId(session_id.removeprefix("chatcmpl-"))
        if not sessions.close(sid):
            raise NotFound(f"no generation session {session_id!r} is open on this peer")
        return Response(status=204)
