"""Refusing what a web page on another origin can make a browser send to this peer.

The API has no user accounts: anyone who can reach it may use it, and by default it listens
on loopback, which every web page the operator visits can also reach through the browser.
Two attacks follow, and this module refuses both before any handler runs:

* **Cross-site requests (CSRF).** A page can POST to ``http://127.0.0.1:8001/nodes`` with a
  "simple" content type (``text/plain``, form encodings) and no preflight. So a request
  that changes state must say ``Content-Type: application/json`` (or carry no body, or be
  an upload route marked with :func:`takes_any_body`), else **415**; and if it carries an ``Origin`` that is not this API's own, **403**. Websockets
  (``/ws/chat``) get the same ``Origin`` check: browsers do not preflight them.
* **DNS rebinding.** A page on ``evil.example`` whose name then resolves to 127.0.0.1 is
  same-origin with itself, so the ``Origin`` check passes; its requests still name
  ``evil.example`` in ``Host``. When the API listens on loopback, ``Host`` must be
  ``127.0.0.1``, ``localhost`` or ``[::1]`` (with or without the port), or one of the names
  the operator added with ``--allow-host``; else **403**. An API bound to a public address
  was exposed on purpose and is reached by names we cannot know, so it skips this check.

Clients that are not browsers (the SDKs, curl with ``-H 'content-type: application/json'``)
send neither a foreign ``Origin`` nor a foreign ``Host`` and are unaffected.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import urlsplit

from quart import request, websocket
from quart_trio import QuartTrio

from api.errors import ApiError, Forbidden

_STATE_CHANGING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
_LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")


_ANY_BODY = "inclavate_takes_any_body"
View = TypeVar("View", bound=Callable[..., object])


class UnsupportedMediaType(ApiError):
    status = 415


def takes_any_body(view: View) -> View:
    """Let a write route take bodies other than JSON: the upload routes, which record the
    type they are given or parse multipart themselves (answering 400 for anything else).
    Apply it below ``@app.post``. Only the content-type rule is relaxed: a foreign ``Origin``
    or ``Host`` is still refused, and a browser always names the origin of a cross-site POST."""
    setattr(view, _ANY_BODY, True)
    return view


@dataclass(frozen=True)
class HostPolicy:
    """Which ``Host`` values the API answers; ``None`` hosts: any (a public bind)."""

    hosts: frozenset[str] | None

    @classmethod
    def for_bind(cls, api_host: str, api_port: int, extra: Iterable[str] = ()) -> HostPolicy:
        if not _is_loopback(api_host):
            return cls(None)
        names = [*_LOOPBACK_NAMES, *extra]
        allowed = {n.lower() for n in names} | {f"{n.lower()}:{api_port}" for n in names if not _has_port(n)}
        return cls(frozenset(allowed))

    def allows(self, host: str) -> bool:
        return self.hosts is None or host.lower() in self.hosts


def install(app: QuartTrio, hosts: HostPolicy = HostPolicy(None)) -> None:
    @app.before_request
    async def _guard_request() -> None:
        # A refusal never reads the body: the error handler answers a request that has one
        # with ``Connection: close`` (``api.app._closing_if_body_unread``), so nothing waits
        # behind it. Reading it first held the whole body in memory (up to an upload route's
        # 512 MiB) for a request that was refused from its headers.
        _check_host(hosts, request.host)
        if request.method not in _STATE_CHANGING:
            return
        _check_origin(request.headers.get("Origin"), request.host)
        # A path or method no route serves is answered by routing (404, 405): a 415 saying
        # that it "takes a JSON body" sent an SDK's multipart call to an absent route
        # (``/v1/audio/translations``) looking for a content-type mistake.
        if _has_body() and request.url_rule is not None and not _body_type_accepted(app):
            raise UnsupportedMediaType(
                f"{request.method} {request.path} takes a JSON body: send Content-Type: application/json"
            )

    @app.before_websocket
    async def _guard_websocket() -> None:
        _check_host(hosts, websocket.host)
        _check_origin(websocket.headers.get("Origin"), websocket.host)


def _body_type_accepted(app: QuartTrio) -> bool:
    mimetype = request.mimetype
    if mimetype == "application/json" or mimetype.endswith("+json"):
        return True
    view = app.view_functions.get(request.endpoint or "")
    return bool(getattr(view, _ANY_BODY, False))


def _has_body() -> bool:
    length = request.content_length
    return bool(length) or "chunked" in request.headers.get("Transfer-Encoding", "").lower()


def _check_host(hosts: HostPolicy, host: str) -> None:
    if not hosts.allows(host):
        raise Forbidden(f"Host {host[:100]!r} is not this peer's address (start the peer with --allow-host to add a name)")


def _check_origin(origin: str | None, host: str) -> None:
    """A browser names the page's origin; it must be this API's own address."""
    if origin is None:
        return
    parts = urlsplit(origin)
    if origin == "null" or parts.netloc.lower() != host.lower():
        raise Forbidden("cross-origin requests are refused: this API serves its own origin only")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _has_port(name: str) -> bool:
    return name.rsplit(":", 1)[-1].isdigit() and not name.endswith("]")
