"""The bounds and eviction order of ``p2p.connection_guard`` (the floods themselves:
``tests/adversary/test_hostile_p2p_connections.py``)."""

from __future__ import annotations

import resource

from inclavate.types import PeerId
from p2p.connection_guard import ConnectionGuard, _Established, handshake_capacity, inbound_capacity


def test_the_bounds_follow_the_descriptor_limit(monkeypatch) -> None:
    for soft, inbound, handshakes in [(64, 16, 4), (256, 32, 8), (1024, 128, 32), (65536, 1024, 64)]:
        monkeypatch.setattr(resource, "getrlimit", lambda _which, soft=soft: (soft, soft))
        assert (inbound_capacity(), handshake_capacity()) == (inbound, handshakes)


def test_a_peer_whose_records_we_hold_goes_after_its_sources_strangers() -> None:
    """Past the bound the source holding the most loses a connection: a stranger's before a
    known peer's, even a newer stranger's."""
    guard = ConnectionGuard(inbound=lambda: 2)
    known = PeerId("known")
    guard.valued = lambda peer: peer == known
    old_known = _Established(known, lambda p: guard.valued(p))
    stranger = _Established(PeerId("stranger"), lambda p: guard.valued(p))
    guard.established.admit("10.0.0.1", old_known)
    guard.established.admit("10.0.0.1", stranger)
    newcomer = _Established(PeerId("other"), lambda p: guard.valued(p))
    guard.established.admit("10.0.0.2", newcomer)
    assert stranger.evicted.is_set() and not old_known.evicted.is_set() and not newcomer.evicted.is_set()
