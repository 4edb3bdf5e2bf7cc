"""The dashboard's files: served from the package with the right types and a strict CSP,
nothing else reachable through its URL; and the route book behind ``GET /sessions/:id``."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from api.app import create_app
from api.limits import RequestLimits
from api.routes_dashboard import CSP, STATIC_DIR, load_static
from api.session_routes import RouteBook
from inclavate.types import LayerRange, NodeId, PeerId, SessionId
from p2p.routing import Hop


class _BareContext:
    """Enough of a PeerContext to build the app; the dashboard routes read no peer state."""

    version = "test"
    peer_id = "local"
    admin_token = None
    limits = RequestLimits()


@pytest.fixture
def client():  # type: ignore[no-untyped-def]
    return create_app(_BareContext()).test_client()  # type: ignore[arg-type]


async def test_the_dashboard_is_served_at_root_with_a_strict_csp(client) -> None:
    response = await client.get("/")
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/html; charset=utf-8"
    csp = response.headers["content-security-policy"]
    assert csp == CSP
    assert "script-src 'self'" in csp and "'unsafe-inline'" not in csp and "connect-src 'self'" in csp
    assert "frame-ancestors 'none'" in csp
    assert response.headers["x-content-type-options"] == "nosniff"
    html = (await response.get_data()).decode()
    assert '<script type="module" src="/dashboard/js/app.js">' in html
    assert "http://" not in html and "https://" not in html  # nothing from a CDN


async def test_every_asset_is_served_with_its_content_type(client) -> None:
    files = load_static(STATIC_DIR)
    assert {"index.html", "style.css", "favicon.svg", "js/app.js", "js/pages/swarm.js"} <= files.keys()
    expected = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
    for name in files:
        suffix = Path(name).suffix
        if suffix == ".html":
            continue
        response = await client.get("/dashboard/" + name)
        assert response.status_code == 200, name
        assert response.headers["content-type"] == expected[suffix], name
        assert response.headers["content-security-policy"] == CSP


@pytest.mark.parametrize("path", [
    "/dashboard/nope.js", "/dashboard/../app.py", "/dashboard/%2e%2e/app.py", "/dashboard/..%2fapp.py",
    "/dashboard/js/../../routes_dashboard.py", "/dashboard/", "/dashboard//etc/passwd",
])  # fmt: skip
async def test_only_shipped_files_are_reachable(client, path: str) -> None:
    response = await client.get(path)
    if response.status_code == 308:  # werkzeug merges "//" by redirecting within this origin
        target = urlsplit(response.headers["location"])
        assert target.path.startswith("/dashboard/") and target.netloc in ("", "localhost")
        response = await client.get(target.path)
    assert response.status_code == 404
    assert "error" in await response.get_json()


def test_every_script_import_resolves_to_a_shipped_file() -> None:
    """A typo in an import would blank the page in a browser; catch it without one."""
    files = load_static(STATIC_DIR)
    for name, file in files.items():
        if not name.endswith(".js"):
            continue
        for target in re.findall(r'^import .* from "(\.{1,2}/[^"]+)";$', file.body.decode(), re.M):
            resolved = (Path(name).parent / target).as_posix()
            parts: list[str] = []
            for part in resolved.split("/"):
                if part == "..":
                    parts.pop()
                elif part != ".":
                    parts.append(part)
            assert "/".join(parts) in files, f"{name} imports {target}"


def test_no_script_builds_markup_from_strings() -> None:
    """Ids, model names and errors come from strangers: text nodes only, never innerHTML."""
    for name, file in load_static(STATIC_DIR).items():
        if name.endswith(".js"):
            text = file.body.decode()
            assert "innerHTML" not in text and "insertAdjacentHTML" not in text and "eval(" not in text, name


def _hop(i: int) -> Hop:
    return Hop(NodeId(f"n{i}"), PeerId(f"p{i}"), LayerRange(i * 10, i * 10 + 10))


def test_route_book_keeps_the_latest_route_and_forgets_the_oldest_sessions() -> None:
    book = RouteBook(capacity=3)
    book.note(SessionId("s1"), "m", None)
    assert book.get(SessionId("s1")).hops == ()  # type: ignore[union-attr]
    book.note(SessionId("s1"), "m", [_hop(0), _hop(1)])
    book.note(SessionId("s1"), "m", None, active=False)  # the pipeline forgot it: keep what was known
    entry = book.get(SessionId("s1"))
    assert entry is not None and not entry.active and [h.node_id for h in entry.hops] == ["n0", "n1"]
    assert entry.to_json() == {
        "id": "chatcmpl-s1", "session_id": "s1", "model": "m", "active": False,
        "route": [{"node_id": "n0", "peer_id": "p0", "start_layer": 0, "end_layer": 10},
                  {"node_id": "n1", "peer_id": "p1", "start_layer": 10, "end_layer": 20}],
    }  # fmt: skip
    for i in range(2, 6):
        book.note(SessionId(f"s{i}"), "m", [_hop(0)])
    assert len(book) == 3 and book.get(SessionId("s1")) is None and book.get(SessionId("s5")) is not None
