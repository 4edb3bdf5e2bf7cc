"""``/v1/generations``: capabilities, submit, list, read, watch (SSE), cancel, and the admin
erase. Thin: bodies are parsed by :mod:`api.generation_request`, everything else is
``PeerContext.generations`` (:class:`inclavate.generations.GenerationService`), which finds
the peer that owns or can run a job.
"""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator
from contextlib import aclosing

from quart import Response, jsonify, request
from quart_trio import QuartTrio

from api.auth import HEADER as ADMIN_HEADER
from api.bodies import json_object
from api.context import PeerContext
from api.errors import BadRequest, ServiceUnavailable, Unauthorized
from api.generation_request import parse_generation, parse_page
from inclavate.generations import GenerationService
from inclavate.peer_http import FORWARDED_HEADER
from inclavate.source_table import source_of


def forwarded() -> bool:
    """The request came from another peer on a client's behalf: answer from this peer only."""
    return request.headers.get(FORWARDED_HEADER) == "1"


def client_source() -> str:
    """Whom the request counts against: its connection's address as the server saw it (the
    ASGI scope's, never a header the client wrote), an IPv4 address or an IPv6 /64. A
    peer relaying for its clients is one source: ``inclavate.job_feeds.MAX_WATCHERS_PER_SOURCE``
    says why that fits."""
    client = request.scope.get("client")
    return source_of(client[0] if client else None)


def service(ctx: PeerContext) -> GenerationService:
    if ctx.generations is None:
        raise ServiceUnavailable("generation is not configured on this peer")
    return ctx.generations


def install(app: QuartTrio, ctx: PeerContext) -> None:
    @app.get("/v1/generations/capabilities")
    async def generation_capabilities():  # type: ignore[no-untyped-def]
        """What the swarm can generate, and what each generator honours."""
        generations = service(ctx)
        entries = generations.local_capabilities() if forwarded() else generations.capabilities()
        return jsonify(generators=entries)

    @app.post("/v1/generations")
    async def generation_submit():  # type: ignore[no-untyped-def]
        """Queue a generation job (202: durably queued, not finished)."""
        generations = service(ctx)
        new = parse_generation(await json_object(), generations.settings.default_deadline_s)
        job = await generations.submit(new, local_only=forwarded(), known_chat_model=ctx.knows_model(new.model))
        response = jsonify(job)
        response.status_code = 202
        return response

    @app.get("/v1/generations")
    async def generation_list():  # type: ignore[no-untyped-def]
        """The caller's jobs, newest first, with output artifacts resolved."""
        limit, offset = parse_page(request.args)
        rows, truncated = await service(ctx).list(limit, offset, local_only=forwarded())
        return jsonify(generations=rows, truncated=truncated)

    @app.get("/v1/generations/<job_id>")
    async def generation_get(job_id: str):  # type: ignore[no-untyped-def]
        """Poll one job."""
        return jsonify(await service(ctx).get(job_id, local_only=forwarded()))

    @app.get("/v1/generations/<job_id>/events")
    async def generation_events(job_id: str):  # type: ignore[no-untyped-def]
        """Live progress as Server-Sent Events; ends with ``data: [DONE]``."""
        payloads = await service(ctx).events(job_id, local_only=forwarded(), source=client_source())

        async def body() -> AsyncIterator[bytes]:
            # Closed when the client leaves (Quart closes body()): the stream's place (its
            # job's watcher, or a relayed stream) is given back then, not when collected.
            async with aclosing(payloads):
                async for payload in payloads:
                    yield b"data: " + payload.encode() + b"\n\n"

        response = Response(body(), mimetype="text/event-stream")
        response.headers["Cache-Control"] = "no-cache"
        response.timeout = None
        return response

    @app.delete("/v1/generations/<job_id>")
    async def generation_cancel(job_id: str):  # type: ignore[no-untyped-def]
        """Cancel a job; returns the job in the state it settled in."""
        return jsonify(await service(ctx).cancel(job_id, local_only=forwarded()))

    @app.delete("/admin/generations/<job_id>")
    async def admin_generation_erase(job_id: str):  # type: ignore[no-untyped-def]
        """Destroy a job record and, unless ``?artifacts=false``, the artifacts it produced."""
        if not ctx.admin_token:
            raise ServiceUnavailable("no admin token is configured on this peer (--admin-token)")
        offered = request.headers.get(ADMIN_HEADER, "")
        if not hmac.compare_digest(offered.encode(), ctx.admin_token.encode()):
            raise Unauthorized(f"missing or invalid {ADMIN_HEADER}")
        flag = request.args.get("artifacts", "true").lower()
        if flag not in ("true", "false", "1", "0"):
            raise BadRequest("artifacts must be true or false")
        return jsonify(await service(ctx).erase(job_id, artifacts=flag in ("true", "1")))
