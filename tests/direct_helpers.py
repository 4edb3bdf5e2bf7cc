"""Two connected hosts serving direct links, for the direct data plane's tests."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio

from inclavate.types import PeerId
from p2p.direct import DirectLimits, DirectLinks
from p2p.host import P2PHost, open_host
from p2p.identity import Identity
from p2p.sealed import SealedStream

ECHO = "/test/echo/1"


@asynccontextmanager
async def direct_pair(limits: DirectLimits = DirectLimits()) -> AsyncIterator[tuple[P2PHost, P2PHost, DirectLinks, DirectLinks]]:
    """Two connected hosts, each serving direct links; b echoes on ECHO with the dialer's id."""
    async with open_host(Identity.generate()) as a, open_host(Identity.generate()) as b, trio.open_nursery() as n:
        links_a, links_b = DirectLinks(a, limits=limits), DirectLinks(b, limits=limits)

        async def echo(stream: SealedStream, remote: PeerId) -> None:
            while True:
                payload = await stream.receive(timeout=30)
                await stream.send(remote.encode() + b":" + payload, timeout=5)

        links_b.set_handler(ECHO, echo)
        await n.start(links_a.run)
        await n.start(links_b.run)
        await a.connect(b.multiaddrs()[0])
        yield a, b, links_a, links_b
        n.cancel_scope.cancel()
