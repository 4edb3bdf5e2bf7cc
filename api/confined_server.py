"""One HTTP connection's failure ends that connection, never the peer.

hypercorn (0.17, trio worker) runs every connection as a task of its server nursery, so an
exception escaping one connection ends the server, and the peer with it. One was found by
the adversary suite: a websocket upgrade refused with a 403 (``api.request_guard``), then a
second request on the same connection, makes hypercorn's websocket stream answer 400 on an
h11 connection that is already DONE; h11's ``LocalProtocolError`` escapes, and any client
could stop any peer with two requests. :func:`install` swaps in a connection handler that
logs and drops such a failure (the connection is closed by hypercorn's own ``finally``).
"""

from __future__ import annotations

import logging

import hypercorn.trio.run as hypercorn_run
from hypercorn.trio.tcp_server import TCPServer

log = logging.getLogger(__name__)


class ConfinedTCPServer(TCPServer):
    async def run(self) -> None:
        try:
            await super().run()
        except Exception:  # noqa: BLE001 - any failure of one connection stays with it
            log.warning("an HTTP connection failed and was closed", exc_info=True)


def install() -> None:
    """Make hypercorn's trio worker use :class:`ConfinedTCPServer` (idempotent)."""
    hypercorn_run.TCPServer = ConfinedTCPServer  # type: ignore[misc]
