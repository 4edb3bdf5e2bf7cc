"""A loopback HTTP server that answers every GET with one fixed JSON body: another peer's
API, or a hostile one, as far as a test of what reads it needs."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def answering(body: Any) -> Iterator[str]:
    """Serve ``body`` (as JSON) to every GET for the duration of the block; yields the base URL."""
    encoded = json.dumps(body).encode()

    class Fixed(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(encoded)))
            self.end_headers()
            self.wfile.write(encoded)

        def log_message(self, *_args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Fixed)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
