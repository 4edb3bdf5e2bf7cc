"""The dashboard: ``GET /`` and ``GET /dashboard/<file>``, static files shipped in ``api/static``.

Plain HTML, CSS and JavaScript modules with no build step and nothing from a CDN, so the page
works on a machine with no internet. It reads the same JSON any client reads, from the peer
that served it (same-origin fetches only), so it needs no route of its own beyond the files.

The files are read once, when the app is built, into a fixed table: a request can only name a
file that was there, and nothing from the URL ever reaches the filesystem. Every response
carries a strict Content-Security-Policy (scripts, styles and connections from this origin
only, no inline script, no framing), ``nosniff`` and the right content type.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from quart import Response
from quart_trio import QuartTrio

from api.context import PeerContext
from api.errors import NotFound

STATIC_DIR = Path(__file__).parent / "static"
ASSET_PREFIX = "/dashboard/"

CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
}

CSP = "; ".join([
    "default-src 'none'",
    "script-src 'self'",
    "style-src 'self'",
    "img-src 'self' data:",
    "media-src 'self' blob:",  # generated audio plays from /v1/artifacts/:id
    "connect-src 'self'",  # fetch and EventSource to this peer only
    "base-uri 'none'",
    "form-action 'none'",
    "frame-ancestors 'none'",
])  # fmt: skip

SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    # A peer upgraded in place must not keep serving yesterday's scripts from a cache.
    "Cache-Control": "no-cache",
}


@dataclass(frozen=True)
class StaticFile:
    body: bytes
    content_type: str


def load_static(root: Path) -> dict[str, StaticFile]:
    """Every servable file under ``root`` by its relative POSIX path (``js/app.js``)."""
    files: dict[str, StaticFile] = {}
    for path in sorted(root.rglob("*")):
        content_type = CONTENT_TYPES.get(path.suffix)
        if path.is_file() and content_type is not None:
            files[path.relative_to(root).as_posix()] = StaticFile(path.read_bytes(), content_type)
    return files


def static_response(file: StaticFile) -> Response:
    response = Response(file.body, content_type=file.content_type)
    response.headers.update(SECURITY_HEADERS)
    return response


def install(app: QuartTrio, ctx: PeerContext) -> None:
    files = load_static(STATIC_DIR)

    @app.get("/")
    async def dashboard():  # type: ignore[no-untyped-def]
        """The dashboard (Swarm, Nodes, Metrics, Chat, Generate, Admin, Storage)."""
        return static_response(files["index.html"])

    @app.get(ASSET_PREFIX + "<path:name>")
    async def dashboard_file(name: str):  # type: ignore[no-untyped-def]
        """A script, stylesheet or image of the dashboard."""
        file = files.get(name)
        if file is None:
            raise NotFound(f"the dashboard has no file {name!r}")
        return static_response(file)
