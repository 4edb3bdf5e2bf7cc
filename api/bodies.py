"""Reading request bodies, with the spec's errors for what cannot be read."""

from __future__ import annotations

from typing import Any

from quart import request

from api.errors import BadRequest
from inclavate.untrusted import Malformed, parse_json

MAX_BODY_BYTES = 24 * 1024 * 1024
"""The spec's request body limit; the chat routes check theirs before reading."""


def decode_json(raw: bytes | str) -> object:
    """A request body as JSON, through the shared untrusted-input parser: nesting deeper
    than any request needs, NaN and overflowing numbers are a 400, never a 500."""
    try:
        return parse_json(raw, max_bytes=MAX_BODY_BYTES)
    except Malformed as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None


async def json_object() -> dict[str, Any]:
    """The request's body as a JSON object, or 400 (the content type is checked by
    :mod:`api.request_guard` before any handler runs)."""
    body = decode_json(await request.get_data(cache=False) or b"null")
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body
