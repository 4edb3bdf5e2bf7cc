"""Reading request bodies, with the spec's errors for what cannot be read."""

from __future__ import annotations

import json
from typing import Any

from quart import request

from api.errors import BadRequest


def decode_json(raw: bytes | str) -> object:
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc


async def json_object() -> dict[str, Any]:
    """The request's body as a JSON object (any Content-Type), or 400."""
    body = decode_json(await request.get_data(cache=False) or b"null")
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body
