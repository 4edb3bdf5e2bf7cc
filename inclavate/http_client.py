"""Small blocking HTTP calls (stdlib only).

Used where a handful of requests do not justify an HTTP client dependency: the local
swarm's readiness probes and the legacy-node bridge, which calls them from worker threads.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any


def request_bytes(
    method: str, url: str, data: bytes | None = None, timeout: float = 30.0, headers: dict[str, str] | None = None
) -> tuple[int, bytes]:
    """One request; returns (status, body) for any HTTP status, raises OSError otherwise."""
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def request_json(
    method: str, url: str, body: Any = None, timeout: float = 30.0, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    """A request with a JSON body; returns (status, decoded body or text) for any status."""
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    status, raw = request_bytes(method, url, data, timeout, {"content-type": "application/json", **(headers or {})})
    try:
        return status, json.loads(raw) if raw else None
    except ValueError:
        return status, raw.decode(errors="replace")
