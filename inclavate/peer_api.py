"""A peer's REST API seen from the terminal, for ``inclavate status`` and ``inclavate chat``.

Standard library only (these commands must start fast and need nothing the peer does not).
Every failure becomes a :class:`PeerUnreachable` (nothing answered) or a :class:`PeerRefused`
(an HTTP error, with the peer's own message, or an answer of the wrong shape), each a whole
sentence, so the CLI prints one ``error: ...`` line and no traceback. A malformed ``--api``
is a :class:`~inclavate.errors.ConfigError` before anything is asked.
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from inclavate.errors import ConfigError, InclavateError

DEFAULT_API = "http://127.0.0.1:8001"
DONE = "[DONE]"


class PeerUnreachable(InclavateError):
    """Nothing answered at the API address (no peer there, wrong port, network down)."""


class PeerRefused(InclavateError):
    """The peer answered with an HTTP error."""

    def __init__(self, status: int, message: str) -> None:
        self.status = status
        super().__init__(message)


def api_base(url: str) -> str:
    """``localhost:8001``, ``http://host:8001/`` and ``http://host:8001/v1`` all mean the peer.

    Checked once here (scheme http or https, a host, a valid port): ``http://[::1`` raised
    urllib's ``ValueError`` outside every handler, a traceback (an audit from outside, 2026-12-08)."""
    base = url.strip().rstrip("/")
    if "://" not in base:
        base = "http://" + base
    base = base.removesuffix("/v1")
    try:
        parts = urllib.parse.urlsplit(base)
        parts.port  # noqa: B018 - raises ValueError for a port that is no number or out of range
    except ValueError:
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"--api {url!r} is not a URL like {DEFAULT_API}")
    return base


def malformed(url: str, what: str) -> PeerRefused:
    """A peer answered JSON of the wrong shape: one sentence, as an HTTP error would be."""
    return PeerRefused(200, f"{url} answered something that is not {what}: is this an Inclavate peer?")


def error_text(raw: bytes) -> str:
    """The message of either of the spec's error shapes, or the body itself."""
    try:
        body = json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace").strip()[:200] or "no message"
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        error = error.get("message")
    return str(error) if error else json.dumps(body)[:200]


class sse_events:  # noqa: N801 - used as the function it was
    """The JSON events of a ``text/event-stream`` body, until ``data: [DONE]``.

    ``done`` says whether ``[DONE]`` arrived: a body that simply ends (the connection closed
    mid-answer) is not a finished stream, and ``inclavate chat`` showed such a cut-off answer
    as a whole one (an audit from outside, 2026-12-08)."""

    def __init__(self, lines: Iterable[bytes]) -> None:
        self._lines = lines
        self.done = False

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for raw in self._lines:
            line = raw.decode("utf-8", errors="replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == DONE:
                self.done = True
                return
            try:
                event = json.loads(data)
            except ValueError:
                continue
            if isinstance(event, dict):
                yield event


class PeerApi:
    def __init__(self, url: str, timeout: float = 10.0, stream_timeout: float = 300.0) -> None:
        self.base = api_base(url)
        self.timeout = timeout
        self.stream_timeout = stream_timeout

    def get(self, path: str) -> Any:
        with self._open(urllib.request.Request(self.base + path), self.timeout) as response:
            raw = response.read()
        try:
            return json.loads(raw)
        except ValueError:
            raise PeerRefused(response.status, f"{self.base}{path} did not answer JSON: is this an Inclavate peer?") from None

    @contextmanager
    def stream(self, path: str, body: Any) -> Iterator[tuple[dict[str, str], sse_events]]:
        """POST ``body`` and yield the response headers and its server-sent events."""
        request = urllib.request.Request(
            self.base + path,
            data=json.dumps(body).encode(),
            method="POST",
            headers={"content-type": "application/json", "accept": "text/event-stream"},
        )
        with self._open(request, self.stream_timeout) as response:
            headers = {k.lower(): v for k, v in response.headers.items()}
            yield headers, sse_events(response)

    @contextmanager
    def _open(self, request: urllib.request.Request, timeout: float) -> Iterator[Any]:
        try:
            response = urllib.request.urlopen(request, timeout=timeout)
        except urllib.error.HTTPError as err:
            raise PeerRefused(err.code, f"{request.full_url} answered {err.code}: {error_text(err.read())}") from None
        except (OSError, http.client.HTTPException) as err:  # refused, reset, timeout, not HTTP at all
            reason = getattr(err, "reason", err)
            raise PeerUnreachable(
                f"cannot reach the API at {self.base} ({reason}); is a peer running there? (--api URL)"
            ) from None
        try:
            yield response
        except (ConnectionResetError, TimeoutError, http.client.HTTPException) as err:
            # Reading the body failed (the peer died or stalled); a broken pipe on *our*
            # stdout is not the peer's fault and goes up unchanged.
            raise PeerUnreachable(f"the connection to {self.base} broke ({err or type(err).__name__})") from None
        finally:
            response.close()
