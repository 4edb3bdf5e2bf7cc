"""Upload bodies: per-route ceilings above the app-wide ``MAX_CONTENT_LENGTH``, and the
body as a stream of chunks with an idle deadline.

Quart sizes a request's body limit when the request object is built, before routing, and
refuses a ``Content-Length`` over it outright. That app-wide limit is the chat limit
(24 MiB), right for JSON bodies that are read whole; the upload routes stream their bodies
to disk and have their own caps (512 MiB artifacts, 64 MiB files). So the app's request
class looks the route's ceiling up by method and exact path when it is built. The upload
handlers still check ``Content-Length`` first and count bytes as they arrive: this only
stops Quart from refusing them first, or from buffering past their cap.
"""

from __future__ import annotations

from typing import Any, ClassVar

import trio
from quart import request
from quart_trio import QuartTrio

from api.errors import ApiError
from quart_trio.wrappers.request import TrioRequest


class BodyLimitedRequest(TrioRequest):
    body_limits: ClassVar[dict[tuple[str, str], int]] = {}

    def __init__(self, method: str, scheme: str, path: str, *args: Any, max_content_length: int | None = None, **kwargs: Any) -> None:
        limit = self.body_limits.get((method.upper(), path), max_content_length)
        super().__init__(method, scheme, path, *args, max_content_length=limit, **kwargs)


def install_request_class(app: QuartTrio) -> None:
    """Give ``app`` its own request class (with its own table of route ceilings)."""
    app.request_class = type("InclavateRequest", (BodyLimitedRequest,), {"body_limits": {}})


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
