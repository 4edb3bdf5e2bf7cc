"""The artifact and file routes served in-process on loopback over one real store."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import trio

from api.app import create_app, serve_api
from api.limits import RequestLimits
from inclavate.artifact_swarm import SwarmArtifacts
from inclavate.artifact_types import ArtifactConfig
from inclavate.artifacts import ArtifactStore
from inclavate.local_swarm import free_port

OWNER = "12D3KooWApiApiApiApiApiApiApiApiApiApiApiApiApiApiAp"


class ArtifactContext:
    """The slice of ``PeerContext`` the artifact routes use, plus what ``create_app`` reads."""

    version = "test"
    peer_id = OWNER
    admin_token: str | None = None

    def __init__(self, store: ArtifactStore, limits: RequestLimits | None = None) -> None:
        self.limits = limits or RequestLimits()
        self._artifacts = SwarmArtifacts(store)

    def artifacts(self) -> SwarmArtifacts:
        return self._artifacts


@asynccontextmanager
async def serve_store(
    data_dir: Path, config: ArtifactConfig | None = None, limits: RequestLimits | None = None
) -> AsyncIterator[tuple[str, ArtifactStore]]:
    store = ArtifactStore(data_dir, OWNER, config)
    app = create_app(ArtifactContext(store, limits))  # type: ignore[arg-type]  # a partial context
    port = free_port()
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_api, app, "127.0.0.1", port)
            yield f"http://127.0.0.1:{port}", store
            nursery.cancel_scope.cancel()
    finally:
        store.close()


def raw_http(base: str, request: bytes, *, read_timeout: float = 10.0) -> bytes:
    """Send raw bytes to the server and return everything it answers (for requests no
    well-behaved client would make: lying Content-Length, huge headers)."""
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=read_timeout) as sock:
        try:
            sock.sendall(request)
        except OSError:
            pass  # the server may answer and close before reading everything
        answer = b""
        try:
            while chunk := sock.recv(65536):
                answer += chunk
                if b"\r\n\r\n" in answer and _complete(answer):
                    break
        except (TimeoutError, ConnectionResetError):
            pass
        return answer


def _complete(answer: bytes) -> bool:
    head, _, body = answer.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return len(body) >= int(line.split(b":")[1])
    return False
