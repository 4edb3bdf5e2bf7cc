"""Responses without a body, built so they are safe under trio.

``quart.Response(status=204)`` gets an empty *sync* iterable as its body, and quart walks a
sync iterable through asyncio's executor: under trio that raised "no running event loop"
after the status line had gone out, so every such response logged "Error in ASGI Framework"
and cost its connection. An empty bytes body is sent as data, never iterated. (quart-trio's
own response class is no way out: its iterable body takes async generators, but iterates
other async iterators, like the artifact downloads' chunks, as sync ones.)

A 204 has no body, so it has no type either; quart stamps its default
``text/html; charset=utf-8`` on every response, and :func:`install` takes it off every 204
the app sends, however a route built it.
"""

from __future__ import annotations

from quart import Response
from quart_trio import QuartTrio


def no_content() -> Response:
    """``204 No Content``."""
    return Response(b"", status=204)


def install(app: QuartTrio) -> None:
    """Every 204 leaves without ``Content-Type`` (RFC 9110 §15.3.5: there is no content to type)."""

    @app.after_request
    async def _no_type_without_content(response: Response) -> Response:
        if response.status_code == 204:
            response.headers.pop("Content-Type", None)
        return response
