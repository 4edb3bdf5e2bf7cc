"""HTTP to legacy nodes, treated as the strangers they are.

A legacy node's URL comes from whoever called ``POST /nodes``, so everything about the
exchange is bounded here:

* **URL**: ``http`` or ``https`` with a host, no credentials, query or fragment
  (:func:`check_node_url`, at registration). ``foo`` or ``file:///etc/passwd`` never get
  as far as a request (an unknown scheme used to raise ``ValueError`` in the relay worker
  and take the whole peer down).
* **No redirects and no proxies from the environment**: a node answers from the URL it
  registered, or not at all.
* **Time**: one deadline for the whole exchange, checked between reads of one socket read
  each (``read1``), so a node that drips one byte per second cannot hold a thread for longer
  than the deadline plus one socket timeout.
* **Size**: at most ``max_response_bytes`` are read, and no more than the caller says the
  answer can hold (a relayed frame's: its positions' hidden states).
* **Threads**: blocking calls run on this module's own :class:`trio.CapacityLimiter`, never
  on trio's default one that the engine and the tokenizer share, so slow nodes cannot stall
  the peer's other work.

Every failure is one :class:`NodeUnreachable`.
"""

from __future__ import annotations

import functools
import http.client
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import trio

from inclavate.untrusted import Malformed, Reason

MAX_URL_CHARS = 2048
_READ_CHUNK = 256 * 1024
_SOCKET_TIMEOUT_S = 10.0


class NodeUnreachable(OSError):
    """The legacy node did not answer usably: refused, timed out, redirected, too large."""


def check_node_url(url: str) -> str:
    """The node's base URL, normalised (no trailing slash), or :class:`Malformed`."""
    if len(url) > MAX_URL_CHARS:
        raise Malformed(Reason.TOO_LONG, "http_url", f"longer than {MAX_URL_CHARS} characters")
    try:
        parts = urlsplit(url.strip())
        port = parts.port  # raises ValueError on a bad port
    except ValueError:
        raise Malformed(Reason.BAD_VALUE, "http_url", "is not a URL") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise Malformed(Reason.BAD_VALUE, "http_url", "must be an http:// or https:// URL with a host")
    if parts.username is not None or parts.query or parts.fragment:
        raise Malformed(Reason.BAD_VALUE, "http_url", "must not carry credentials, a query or a fragment")
    if port == 0:
        raise Malformed(Reason.BAD_VALUE, "http_url", "port 0 is not a port")
    return url.strip().rstrip("/")


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None  # urllib then raises HTTPError with the 3xx status


_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirects())


@dataclass(frozen=True)
class HttpLimits:
    timeout_s: float = 60.0
    """The whole exchange: connect, send, and read the answer."""
    max_response_bytes: int = 64 * 1024 * 1024
    threads: int = 8
    """Concurrent requests to legacy nodes (each blocks one worker thread)."""


class LegacyHttp:
    def __init__(self, limits: HttpLimits = HttpLimits()) -> None:
        self.limits = limits
        self._limiter = trio.CapacityLimiter(limits.threads)

    async def request(
        self, method: str, url: str, body: bytes | None = None, headers: dict[str, str] | None = None,
        *, timeout_s: float | None = None, max_bytes: int | None = None,
    ) -> tuple[int, bytes]:  # fmt: skip
        """(status, body) for any HTTP status; :class:`NodeUnreachable` for anything else,
        an answer longer than ``max_bytes`` (at most ``max_response_bytes``) included."""
        timeout = self.limits.timeout_s if timeout_s is None else timeout_s
        cap = self.limits.max_response_bytes if max_bytes is None else min(max_bytes, self.limits.max_response_bytes)
        call = functools.partial(_exchange, method, url, body, headers or {}, time.monotonic() + timeout, cap)
        with trio.move_on_after(timeout + 1.0):
            return await trio.to_thread.run_sync(call, limiter=self._limiter, abandon_on_cancel=True)
        raise NodeUnreachable(f"no answer from {url} within {timeout:g} s")


def _exchange(method: str, url: str, body: bytes | None, headers: dict[str, str], deadline: float,
              max_bytes: int) -> tuple[int, bytes]:  # fmt: skip
    """Runs in a worker thread."""
    socket_timeout = max(0.1, min(_SOCKET_TIMEOUT_S, deadline - time.monotonic()))
    try:
        request = urllib.request.Request(url, data=body, method=method, headers=headers)
        try:
            response = _OPENER.open(request, timeout=socket_timeout)
        except urllib.error.HTTPError as err:
            with err:
                return err.code, _read(err, deadline, max_bytes)
        with response:
            return response.status, _read(response, deadline, max_bytes)
    except NodeUnreachable:
        raise
    except (OSError, ValueError, http.client.HTTPException) as exc:
        raise NodeUnreachable(f"{type(exc).__name__}: {exc}") from None


def _read(response: Any, deadline: float, max_bytes: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        if time.monotonic() > deadline:
            raise NodeUnreachable("the answer took too long")
        # One socket read a call: ``read(n)`` waits for all n bytes, each within the socket's
        # timeout, so a node dripping a byte a second held the thread (and its place in the
        # limiter) for days, past every deadline (an audit, 2026-12-07).
        chunk = response.read1(_READ_CHUNK)
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > max_bytes:
            raise NodeUnreachable(f"the answer exceeds {max_bytes} bytes")
        chunks.append(chunk)
