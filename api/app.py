"""The REST app every peer serves (quart-trio on hypercorn, in the peer's trio nursery).

Routes live in ``api/routes_*.py``; each module exposes ``install(app, ctx)``. Errors never
build their own bodies: anything a handler raises reaches :func:`_on_error`, which asks
``api.errors.error_response_parts`` for the status and the spec's JSON shape.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from hypercorn.config import Config
from hypercorn.trio import serve as hypercorn_serve
from quart import Response, has_request_context, jsonify, request
from quart_trio import QuartTrio
from quart_trio.asgi import TrioASGIWebsocketConnection
from werkzeug.exceptions import HTTPException

from api import (
    confined_server,
    request_guard,
    responses,
    routes_admin,
    routes_artifacts,
    routes_audio,
    routes_chat,
    routes_dashboard,
    routes_files,
    routes_generations,
    routes_metrics,
    routes_models,
    routes_nodes,
    routes_responses,
    routes_system,
)
from api.context import PeerContext
from api.downloads import is_cut_short
from api.errors import error_headers, error_response_parts
from api.request_guard import HostPolicy
from api.sessions import ActiveSessions
from api.heap_trim import trim_after_floods
from api.uploads import install_request_class

log = logging.getLogger(__name__)

Installer = Callable[[QuartTrio, PeerContext], None]
INSTALLERS: list[Installer] = [
    routes_system.install,
    routes_models.install,
    routes_metrics.install,  # before routes_nodes: /nodes/rankings is not a node id
    routes_nodes.install,
    routes_chat.install,
    routes_responses.install,  # after routes_chat: it runs its turns through the chat runner
    routes_admin.install,
    routes_artifacts.install,
    routes_files.install,
    routes_dashboard.install,
    routes_generations.install,
    routes_audio.install,
]


def create_app(ctx: PeerContext, *, sessions: ActiveSessions | None = None,
               hosts: HostPolicy = HostPolicy(None)) -> QuartTrio:  # fmt: skip
    """``hosts``: the ``Host`` values to answer (see :mod:`api.request_guard`)."""
    app = QuartTrio("inclavate")
    app.config["MAX_CONTENT_LENGTH"] = ctx.limits.max_body_bytes
    app.config["JSON_SORT_KEYS"] = False
    app.extensions["inclavate.sessions"] = sessions or ActiveSessions.for_limits(ctx.limits)
    # upload routes raise their own body ceilings; all bodies share one budget
    app.extensions["inclavate.body_budget"] = install_request_class(app, ctx.limits.max_buffered_body_bytes)
    app.asgi_websocket_class = HandOverWebsocket
    request_guard.install(app, hosts)
    responses.install(app)  # a 204 carries no Content-Type
    for install in INSTALLERS:
        install(app, ctx)

    @app.errorhandler(HTTPException)
    async def _on_http_error(exc: HTTPException) -> Response:
        # Routing and protocol errors (404, 405, 413 from MAX_CONTENT_LENGTH) in our shape,
        # with the headers they carry besides their HTML body's type (a 405's ``Allow``,
        # which HTTP requires: it went missing here, an audit, 2026-12-07).
        response = jsonify({"error": exc.description or exc.name})
        response.status_code = exc.code or 500
        for name, value in exc.get_headers():
            if name.lower() != "content-type":
                response.headers[name] = value
        return _closing_if_body_unread(response)

    @app.errorhandler(Exception)
    async def _on_error(exc: Exception) -> Response:
        status, body = error_response_parts(exc)
        if status >= 500:
            log.error("request failed: %s", exc, exc_info=status == 500)
        response = jsonify(body)
        response.status_code = status
        response.headers.update(error_headers(exc))
        return _closing_if_body_unread(response)

    return app


class HandOverWebsocket(TrioASGIWebsocketConnection):
    """A websocket whose frames are handed to the handler, not queued for it.

    ``/ws/chat`` reads its next request once the current one is answered. quart-trio queued
    ten frames meanwhile (and hypercorn ten more, see :func:`serve_api`), each up to 16 MiB
    then (a body's limit, 24 MiB, now): one client held ~330 MB of a peer per connection.
    Unbuffered, the frames the handler has not asked for wait in the client's socket."""

    def __init__(self, app: QuartTrio, scope: Any) -> None:
        super().__init__(app, scope)
        self.send_channel, self.receive_channel = trio.open_memory_channel[bytes | str](0)


def _closing_if_body_unread(response: Response) -> Response:
    """A refused request may leave part of its body unread (a multipart upload refused on its
    first field, a body over the limit); the next request on that connection would then wait
    behind it. Closing the connection after the answer costs the client one reconnect."""
    if has_request_context() and (request.content_length or "chunked" in request.headers.get("Transfer-Encoding", "").lower()):
        response.headers["Connection"] = "close"
    return response


def _quiet_about_cut_downloads(logger: logging.Logger) -> logging.Logger:
    """``logger`` without hypercorn's "Error in ASGI Framework" for a download cut short
    (:class:`api.downloads.DownloadCutShort`: already logged, at info, and the client's to
    cause), so that the error log keeps meaning a fault of ours."""
    if not any(isinstance(f, _CutDownloads) for f in logger.filters):
        logger.addFilter(_CutDownloads())
    return logger


class _CutDownloads(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and is_cut_short(record.exc_info[1]))


async def serve_api(
    app: QuartTrio,
    host: str,
    port: int,
    *,
    shutdown: Callable[[], Awaitable[None]] | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` until cancelled (or ``shutdown`` returns); reports the bound URLs."""
    confined_server.install()
    config = Config()
    config.bind = [f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = _quiet_about_cut_downloads(logging.getLogger("hypercorn.error"))
    config.graceful_timeout = 2.0
    config.keep_alive_timeout = 30.0
    # One ASGI message queued per connection: a websocket message is up to a body's limit
    # (see HandOverWebsocket); an HTTP body's messages are socket reads, and streamed bodies have
    # their own backpressure (api.uploads).
    config.max_app_queue_size = 1
    # A ``/ws/chat`` request frame may be as large as a POST body, and is validated the same
    # way: at hypercorn's 16 MiB default, a 17 MiB request the spec allows closed the
    # connection (1009) with no error frame (2026-12-07, an audit from outside).
    config.websocket_max_message_size = app.config.get("MAX_CONTENT_LENGTH") or config.websocket_max_message_size
    async with trio.open_nursery() as nursery:
        budget = app.extensions.get("inclavate.body_budget")
        if budget is not None:
            nursery.start_soon(trim_after_floods, budget)  # the heap a flood of bodies left
        await hypercorn_serve(app, config, shutdown_trigger=shutdown, task_status=task_status)
        nursery.cancel_scope.cancel()
