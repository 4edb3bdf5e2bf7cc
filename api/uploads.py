"""Upload bodies: per-route ceilings above the app-wide ``MAX_CONTENT_LENGTH``, and the
body as a stream of chunks with an idle deadline.

Quart sizes a request's body limit when the request object is built, before routing, and
refuses a ``Content-Length`` over it outright. That app-wide limit is the chat limit
(24 MiB), right for JSON bodies that are read whole; the upload routes stream their bodies
to disk and have their own caps (512 MiB artifacts, 64 MiB files). So the app's request
class looks the route's ceiling up by method and exact path when it is built. The upload
handlers still check ``Content-Length`` first and count bytes as they arrive: this only
stops Quart from refusing them first, or from buffering past their cap.

Backpressure. Quart's ASGI loop moves every body message into the request's buffer as
fast as the client sends, whether or not the handler keeps up; a 300 MB upload raised a
peer's peak RSS by ~80 MB that way (and a slow disk would make it grow without bound).
The app's connection class here waits, after each message, while a handler that streams
the body (:class:`RequestChunks`) is more than :data:`HIGH_WATER_BYTES` behind, so the
socket (and the client) slow down instead. A handler that reads the body whole never
streams, so it is never waited for.
"""

from __future__ import annotations

from typing import Any, ClassVar

import trio
from quart import request
from quart_trio import QuartTrio

from quart_trio.asgi import TrioASGIHTTPConnection
from quart_trio.wrappers.request import TrioBody, TrioRequest

from api.errors import ApiError

HIGH_WATER_BYTES = 4 * 1024 * 1024
"""How far a streaming handler may fall behind the socket before the socket waits."""


class StreamedBody(TrioBody):
    """Quart's body buffer, plus a wait for a streaming reader to catch up."""

    def __init__(self, expected_content_length: int | None, max_content_length: int | None) -> None:
        super().__init__(expected_content_length, max_content_length)
        self.streaming = False
        self._taken = trio.Event()

    async def __anext__(self) -> bytes:
        self.streaming = True
        try:
            return await super().__anext__()
        finally:
            self._taken.set()

    async def caught_up(self) -> None:
        """Return once a streaming reader holds at most HIGH_WATER_BYTES unread."""
        while self.streaming and len(self._data) > HIGH_WATER_BYTES and self._must_raise is None:
            self._taken = trio.Event()
            await self._taken.wait()


class BackpressureConnection(TrioASGIHTTPConnection):
    async def handle_messages(  # type: ignore[override]
        self, nursery: trio.Nursery, request: TrioRequest, receive: Any
    ) -> None:
        # Quart's loop (quart.asgi.ASGIHTTPConnection.handle_messages), plus the wait.
        while True:
            message = await receive()
            if message["type"] == "http.request":
                request.body.append(message.get("body", b""))
                if not message.get("more_body", False):
                    request.body.set_complete()
                elif isinstance(request.body, StreamedBody):
                    await request.body.caught_up()
            elif message["type"] == "http.disconnect":
                break
        nursery.cancel_scope.cancel()


class BodyLimitedRequest(TrioRequest):
    body_class = StreamedBody
    body_limits: ClassVar[dict[tuple[str, str], int]] = {}

    def __init__(self, method: str, scheme: str, path: str, *args: Any, max_content_length: int | None = None, **kwargs: Any) -> None:
        limit = self.body_limits.get((method.upper(), path), max_content_length)
        super().__init__(method, scheme, path, *args, max_content_length=limit, **kwargs)


def install_request_class(app: QuartTrio) -> None:
    """Give ``app`` its own request class (with its own table of route ceilings), and the
    connection class that applies backpressure to streamed bodies."""
    app.request_class = type("InclavateRequest", (BodyLimitedRequest,), {"body_limits": {}})
    app.asgi_http_class = BackpressureConnection


def set_body_limit(app: QuartTrio, method: str, path: str, limit: int) -> None:
    """Let ``method path`` (an exact path, no variables) carry bodies up to ``limit`` bytes."""
    request_class = app.request_class
    if not issubclass(request_class, BodyLimitedRequest):
        raise TypeError("call install_request_class(app) first")
    request_class.body_limits[(method.upper(), path)] = limit


UPLOAD_IDLE_TIMEOUT_S = 60.0
"""A client that sends nothing for this long has its upload dropped (no slowloris holds a
handler, a temp file and a quota reservation forever)."""


class UploadTimeout(ApiError):
    status = 408


class RequestChunks:
    """The request body as it arrives, never buffered whole (an async iterator; a class
    rather than a generator so that abandoning it half way leaves nothing to finalize)."""

    def __init__(self, idle_timeout: float | None = None) -> None:
        self._body = request.body.__aiter__()
        self._idle_timeout = UPLOAD_IDLE_TIMEOUT_S if idle_timeout is None else idle_timeout

    def __aiter__(self) -> RequestChunks:
        return self

    async def __anext__(self) -> bytes:
        with trio.move_on_after(self._idle_timeout):
            return await self._body.__anext__()
        raise UploadTimeout(f"no request body bytes for {self._idle_timeout:g} s; upload abandoned")
