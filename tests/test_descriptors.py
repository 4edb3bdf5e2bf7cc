"""The shares of the descriptor budget (``inclavate/descriptors.py``): every table a stranger
can fill follows the soft limit, and together they leave the peer half of it."""

from __future__ import annotations

import resource

import pytest
import trio
from direct_helpers import ECHO, direct_pair

from api.connection_table import capacity as http_connections
from inclavate.descriptors import share
from p2p.artifacts import DIRECT_PROTOCOL as ARTIFACT_LINKS
from p2p.artifacts import MAX_DIRECT_LINKS, MAX_READS_PER_PEER
from p2p.connection_guard import handshake_capacity, inbound_capacity
from p2p.direct import DirectLimits, LinkTable


@pytest.fixture
def soft_limit(monkeypatch):
    def set_to(soft: int) -> None:
        monkeypatch.setattr(resource, "getrlimit", lambda _which: (soft, soft))

    return set_to


def test_a_share_is_a_fraction_of_the_soft_limit_within_its_bounds(soft_limit) -> None:
    for soft, expected in [(64, 16), (1024, 32), (20_000, 512), (1 << 20, 512)]:
        soft_limit(soft)
        assert share(32, 16, 512) == expected


def test_strangers_tables_leave_the_peer_half_its_descriptors(soft_limit) -> None:
    for soft in (1024, 4096, 65536):
        soft_limit(soft)
        direct = 2 * share(32, 16, 512) + share(64, 4, 64)  # forward and artifact links, hellos
        strangers = http_connections() + inbound_capacity() + handshake_capacity() + direct
        assert strangers <= soft // 2, (soft, strangers)


async def test_direct_link_tables_follow_the_descriptor_limit(soft_limit) -> None:
    """At 1,024 descriptors, the fixed 512 forward links, 64 artifact links and 64 hellos
    (1,088) could take every descriptor; each protocol now holds at most a 32nd."""
    with trio.fail_after(30):
        async with direct_pair(DirectLimits()) as (_a, _b, _links_a, links_b):
            links_b.set_handler(ARTIFACT_LINKS, None, LinkTable(MAX_READS_PER_PEER, MAX_DIRECT_LINKS))  # type: ignore[arg-type]
            soft_limit(1024)
            assert links_b._table_of(ECHO)[1] == 32
            assert links_b._table_of(ARTIFACT_LINKS)[1] == 32
            soft_limit(20_000)
            assert links_b._table_of(ECHO)[1] == 512  # the fixed bounds stay the ceilings
            assert links_b._table_of(ARTIFACT_LINKS)[1] == MAX_DIRECT_LINKS
