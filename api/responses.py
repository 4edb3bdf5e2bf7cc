"""Responses without a body, built so they are safe under trio.

``quart.Response(status=204)`` gets an empty *sync* iterable as its body, and quart walks a
sync iterable through asyncio's executor: under trio that raised "no running event loop"
after the status line had gone out, so every such response logged "Error in ASGI Framework"
and cost its connection. An empty bytes body is sent as data, never iterated. (quart-trio's
own response class is no way out: its iterable body takes async generators, but iterates
other async iterators, like the artifact downloads' chunks, as sync ones.)
"""

from __future__ import annotations

from quart import Response


def no_content() -> Response:
    """``204 No Content``."""
    return Response(b"", status=204)
