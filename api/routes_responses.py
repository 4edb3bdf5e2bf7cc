"""``POST /v1/responses``: OpenAI's Responses API, as a translation of the chat route.

The body becomes the chat request it means (:mod:`api.responses_request`, in the chat
route's worker thread), which then goes through everything ``POST /v1/chat/completions``
does, through the same :class:`api.routes_chat.ChatRunner`: body size (413), the 429 when
every place is taken, validation, the model (422), routing (503), the prompt's length,
session tracking, and the session freed on every stage when a streaming client leaves.
Its output becomes a Response object or stream events (:mod:`api.responses_output`).

Errors before the stream starts are ordinary HTTP errors (:mod:`api.errors`); a failure
after it started is a ``response.failed`` event. Unlike the chat stream there is no
``data: [DONE]``: OpenAI's Responses stream ends with its final event.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from quart import jsonify
from quart_trio import QuartTrio

from api.context import PeerContext
from api.responses_output import EventStream, Shell, from_completion
from api.responses_request import chat_body, echoed
from api.routes_chat import RUNNER, ChatRunner, session_headers, sse_response


def _sse(event: dict[str, Any]) -> bytes:
    data = json.dumps(event, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


def install(app: QuartTrio, ctx: PeerContext) -> None:
    runner: ChatRunner = app.extensions[RUNNER]  # routes_chat installs first

    @app.post("/v1/responses")
    async def create_response():  # type: ignore[no-untyped-def]
        """OpenAI Responses API (text in, text out), plain JSON or SSE (``stream: true``)."""
        seen: list[dict[str, Any]] = []

        def translate(body: object) -> object:
            chat = chat_body(body)
            seen.append(echoed(body))  # type: ignore[arg-type]  # chat_body checked it is an object
            return chat

        job = await runner.prepare(translate)
        shell = Shell.of(job, seen[0])
        job.answer_id = shell.id
        if job.request.stream:

            async def body() -> AsyncIterator[bytes]:
                stream = EventStream(shell)
                for event in stream.start():
                    yield _sse(event)
                async for item in runner.chunks(job):
                    for event in stream.feed(item):
                        yield _sse(event)
                for event in stream.end():
                    yield _sse(event)

            return sse_response(body(), job)
        response = jsonify(from_completion(shell, await runner.complete(job)))
        response.headers.update(session_headers(job))
        return response
