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

Budget. Every body reserves its bytes in the app's :class:`~api.body_budget.BodyBudget` as
they arrive, gives back what a streaming reader takes (unless it keeps them in memory:
``RequestChunks(kept=True)``), and the rest when its request ends
(:meth:`BackpressureConnection.__call__`): the bytes of all bodies a peer holds are bounded,
not only each body's.
"""

from __future__ import annotations

from typing import Any, ClassVar

import trio
from quart import request
from quart_trio import QuartTrio

from quart_trio.asgi import TrioASGIHTTPConnection
from quart_trio.wrappers.request import TrioBody, TrioRequest

from api.body_budget import BodyBudget, BodyBudgetFull
from api.errors import ApiError

HIGH_WATER_BYTES = 4 * 1024 * 1024
"""How far a streaming handler may fall behind the socket before the socket waits."""


class StreamedBody(TrioBody):
    """Quart's body buffer, plus a wait for a streaming reader to catch up, and its bytes
    reserved in the app's budget (none for a class without one, as in unit tests)."""

    budget: ClassVar[BodyBudget | None] = None

    def __init__(self, expected_content_length: int | None, max_content_length: int | None) -> None:
        super().__init__(expected_content_length, max_content_length)
        self.streaming = False
        self.keeps_what_it_takes = False
        """Set by a reader that keeps the chunks it takes in memory (a form read whole): its
        bytes stay reserved until the request ends, as a body read whole does."""
        self.held = 0
        self._taken = trio.Event()

    def append(self, data: bytes) -> None:
        if data and self._must_raise is None and self.budget is not None and not self.budget.reserve(self, len(data)):
            self.refuse(self.budget.full_error())
            return
        super().append(data)

    async def __anext__(self) -> bytes:
        self.streaming = True
        try:
            data = await super().__anext__()
        finally:
            self._taken.set()
        if self.budget is not None and not self.keeps_what_it_takes:
            self.budget.release(self, len(data))  # a streaming reader took them on
        return data

    def arriving(self) -> bool:
        """Whether the body is still coming in (only then can refusing it free anything)."""
        return not self._complete.is_set()

    def refuse(self, error: BodyBudgetFull) -> None:
        """Drop what is buffered; the handler's next read raises ``error``."""
        self._must_raise = error
        self._data.clear()
        self.set_complete()
        self._taken.set()

    def release_all(self) -> None:
        """Give the body's bytes back to the budget: its request has ended."""
        if self.budget is not None:
            self.budget.release(self)

    async def caught_up(self) -> None:
        """Return once a streaming reader holds at most HIGH_WATER_BYTES unread."""
        while self.streaming and len(self._data) > HIGH_WATER_BYTES and self._must_raise is None:
            self._taken = trio.Event()
            await self._taken.wait()


class BackpressureConnection(TrioASGIHTTPConnection):
    async def __call__(self, receive: Any, send: Any) -> None:
        # quart-trio's, plus giving the body's budget back however the request ends
        request = self._create_request_from_scope(send)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self.handle_messages, nursery, request, receive)
                nursery.start_soon(self.handle_request, nursery, request, send)
        finally:
            if isinstance(request.body, StreamedBody):
                request.body.release_all()

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


def install_request_class(app: QuartTrio, budget_bytes: int) -> BodyBudget:
    """Give ``app`` its own request class (with its own table of route ceilings and its own
    budget of ``budget_bytes`` buffered over all requests), and the connection class that
    applies backpressure to streamed bodies and gives budgets back. Returns the budget."""
    budget = BodyBudget(budget_bytes)
    body_class = type("InclavateBody", (StreamedBody,), {"budget": budget})
    app.request_class = type("InclavateRequest", (BodyLimitedRequest,), {"body_limits": {}, "body_class": body_class})
    app.asgi_http_class = BackpressureConnection
    return budget


def set_body_limit(app: QuartTrio, method: str, path: str, limit: int) -> None:
    """Let ``method path`` (an exact path, no variables) carry bodies up to ``limit`` bytes."""
    request_class = app.request_class
    if not issubclass(request_class, BodyLimitedRequest):
        raise TypeError("call install_request_class(app) first")
    request_class.body_limits[(method.upper(), path)] = limit


UPLOAD_IDLE_TIMEOUT_S = 60.0
"""A client that sends nothing for this long has its upload dropped (no slowloris holds a
handler, a temp file and a quota reservation forever)."""

MIN_UPLOAD_RATE = 32 * 1024
"""Bytes per second an upload must average, over the whole upload, once its
:data:`UPLOAD_GRACE_S` is spent (256 kbit/s: a poor mobile uplink still passes). The idle
timeout alone let one byte every 50 s keep an upload, its temp file and its quota
reservation for ever: one connection that sent nearly the quota then trickled had every
other upload, clip and generation output refused with 507 while usage read empty (an audit,
2026-12-07, F5). With the floor, a burst of B bytes buys at most B / rate seconds; holding
the quota costs a sustained upload at this rate, as re-uploading committed junk that
anyone may delete would. The average is over the whole upload, not a window, so an honest
client's stalls (a handover, a busy disk) spend the credit its earlier bytes earned."""

UPLOAD_GRACE_S = 60.0
"""Seconds every upload has before :data:`MIN_UPLOAD_RATE` applies: TCP's slow start, a
small clip over a slow link (1 MiB at 12 KiB/s passes)."""


def rate_deadline(started: float, received: int, grace_s: float, min_rate: float) -> float:
    """When an upload that began at ``started`` and has ``received`` bytes falls below
    ``min_rate`` bytes/s averaged since then, ``grace_s`` aside: its next bytes are due by
    this time. The same bound as a p2p read's (``p2p.artifacts.read_deadline``), taken as
    the bytes arrive, so a body of unknown length is bounded too."""
    return started + grace_s + received / min_rate


class UploadTimeout(ApiError):
    status = 408


class UploadTooSlow(UploadTimeout):
    """An upload fell below :data:`MIN_UPLOAD_RATE` on average after its grace: dropped
    with 408, its temp file removed and its quota reservation given back."""


class RequestChunks:
    """The request body as it arrives, never buffered whole (an async iterator; a class
    rather than a generator so that abandoning it half way leaves nothing to finalize).

    Each chunk must come within the idle timeout and before :func:`rate_deadline`. The
    limits are read when the reader is made (tests shorten them)."""

    def __init__(self, idle_timeout: float | None = None, *, kept: bool = False) -> None:
        """``kept``: the caller keeps what it reads in memory, so the bytes stay in the body
        budget until the request ends (a streaming reader passing them on to disk gives them
        back as it takes them)."""
        if kept and isinstance(request.body, StreamedBody):
            request.body.keeps_what_it_takes = True
        self._body = request.body.__aiter__()
        self._idle_timeout = UPLOAD_IDLE_TIMEOUT_S if idle_timeout is None else idle_timeout
        self._grace_s = UPLOAD_GRACE_S
        self._min_rate = MIN_UPLOAD_RATE
        self._started = trio.current_time()
        self._received = 0

    def __aiter__(self) -> RequestChunks:
        return self

    async def __anext__(self) -> bytes:
        too_slow_at = rate_deadline(self._started, self._received, self._grace_s, self._min_rate)
        idle_at = trio.current_time() + self._idle_timeout
        with trio.move_on_at(min(idle_at, too_slow_at)):
            chunk = await self._body.__anext__()
            self._received += len(chunk)
            return chunk
        if too_slow_at < idle_at:
            raise UploadTooSlow(
                f"the upload averaged under {self._min_rate} bytes/s ({self._received} bytes in "
                f"{trio.current_time() - self._started:.0f} s); upload abandoned"
            )
        raise UploadTimeout(f"no request body bytes for {self._idle_timeout:g} s; upload abandoned")
