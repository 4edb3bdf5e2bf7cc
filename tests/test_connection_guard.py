"""The bounds and eviction order of ``p2p.connection_guard`` (the floods themselves:
``tests/adversary/test_hostile_p2p_connections.py``)."""

from __future__ import annotations

import resource

import pytest

from inclavate.source_table import source_of
from inclavate.types import PeerId
from p2p import accept_rate
from p2p.accept_rate import AcceptRate
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


class _Clock:
    """A clock the test moves (the buckets read it; no sleeping)."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _rate(clock: _Clock, **kwargs: float) -> AcceptRate:
    return AcceptRate(**{"burst": 4, "per_s": 2.0, "total_burst": 100, "total_per_s": 100.0, "clock": clock, **kwargs})


def test_a_source_gets_its_burst_then_its_rate() -> None:
    clock = _Clock()
    rate = _rate(clock)
    assert [rate.take("10.0.0.1") for _ in range(6)] == [True] * 4 + [False] * 2
    clock.now += 0.5  # one token back at 2 a second
    assert [rate.take("10.0.0.1") for _ in range(2)] == [True, False]
    clock.now += 60  # never more than the burst, however long it rested
    assert sum(rate.take("10.0.0.1") for _ in range(10)) == 4
    assert rate.refused_by_source == 9 and rate.refused_in_all == 0


def test_a_flooded_source_leaves_another_its_own_burst() -> None:
    clock = _Clock()
    rate = _rate(clock)
    for _ in range(1000):
        rate.take("10.0.0.2")
    assert all(rate.take("10.0.0.1") for _ in range(4))
    assert all(rate.take("2001:db8:0:1::1") for _ in range(4))


def test_an_ipv6_64_is_one_source() -> None:
    """The guard keys buckets by ``source_of``: every address in a /64 draws on one bucket."""
    clock = _Clock()
    rate = _rate(clock)
    hosts = [f"2001:db8:0:1::{i:x}" for i in range(1, 9)]
    assert [rate.take(source_of(h)) for h in hosts] == [True] * 4 + [False] * 4


def test_many_sources_share_the_bucket_of_all() -> None:
    """Past the total burst every source is refused until it refills, and a refusal there
    takes no token from the source's own bucket (no reserve here: the next tests have it)."""
    clock = _Clock()
    rate = _rate(clock, total_burst=10, total_per_s=5.0, reserve=0)
    assert sum(rate.take(f"10.1.0.{i}") for i in range(40)) == 10
    assert rate.refused_in_all == 30 and rate.refused_by_source == 0
    clock.now += 1.0  # five back in all
    assert sum(rate.take("10.1.0.39") for _ in range(10)) == 4  # its own burst, untouched
    assert rate.take("10.1.0.38")
    assert not rate.take("10.1.0.37")


def test_the_table_of_buckets_is_bounded_oldest_first() -> None:
    clock = _Clock()
    rate = _rate(clock, max_sources=8, total_burst=10**6)
    for i in range(10_000):
        rate.take(f"10.2.{i // 256}.{i % 256}")
        assert len(rate) <= 8
    flooder = "10.9.9.9"
    while rate.take(flooder):
        pass
    for i in range(7):  # seven newer sources: the flooder is still held, still empty
        rate.take(f"10.3.0.{i}")
    assert not rate.take(flooder)
    assert rate.refused_in_all == 0
    for i in range(8):  # eight newer: it is the least recently used, forgotten (starts full)
        rate.take(f"10.4.0.{i}")
    assert rate.take(flooder)


def test_a_refilled_bucket_is_forgotten() -> None:
    """A full bucket says nothing a new one would not: the table holds only recent sources."""
    clock = _Clock()
    rate = _rate(clock)
    for i in range(100):
        rate.take(f"10.5.0.{i}")
    clock.now += 0.25  # each took one of four, half of it back: still held
    rate.take("10.6.0.1")
    assert len(rate) == 101
    clock.now += 2.0  # full again, but not its quiet tokens (one each 16 s): still held
    rate.take("10.6.0.2")
    assert len(rate) == 102
    clock.now += 16.0  # both full
    rate.take("10.6.0.3")
    assert len(rate) == 1


def _flood(rate: AcceptRate, clock: _Clock, sources: list[str], per_source_s: float, seconds: float,
           quiet: str, every_s: float) -> list[bool]:  # fmt: skip
    """``sources`` each opening ``per_source_s`` connections a second, in turn (staggered, as
    independent dialers are), and ``quiet`` one each ``every_s`` (after the flood's of the
    same instant: last in line), for ``seconds`` of the test's clock in steps of 10 ms;
    returns whether each of the quiet source's got in."""
    step, got, at, owed, turn = 0.01, [], 0.0, 0.0, 0
    for tick in range(int(seconds / step)):
        clock.now += step
        owed += len(sources) * per_source_s * step
        while owed >= 1.0:
            owed -= 1.0
            rate.take(sources[turn % len(sources)])
            turn += 1
        if tick * step >= at:
            got.append(rate.take(quiet))
            at += every_s
    return got


@pytest.mark.parametrize("per_source_s", [4.0, 50.0], ids=["paced_to_its_rate", "past_its_rate"])
def test_a_quiet_source_gets_in_while_many_sources_keep_the_bucket_of_all_dry(per_source_s: float) -> None:
    """40 addresses, each at 4 a second (its own bucket never short) or far past it, keep the
    bucket of all (64, 32 a second) dry for a minute; a source that dials once each 20 s (a
    neighbour reconnecting) gets in every time, from the reserve. Before: first come, first
    served, it found the bucket empty every time (the flood's tokens are taken as they come)."""
    clock = _Clock()
    rate = AcceptRate(clock=clock)
    flood = [f"10.7.0.{i}" for i in range(40)]
    got = _flood(rate, clock, flood, per_source_s, 60.0, "10.8.0.1", every_s=20.0)
    assert rate.refused_in_all > 1000  # the bucket of all was kept dry
    assert got == [True] * 3
    assert rate.let_in_quiet >= 3


def test_a_flood_gets_from_the_reserve_at_most_its_quiet_rate() -> None:
    """What the module docstring promises an attacker with N addresses: from the reserve, each
    address's first ``QUIET_BURST`` connections, then ``QUIET_PER_S`` a second each."""
    clock = _Clock()
    rate = AcceptRate(clock=clock)
    flood = [f"10.9.0.{i}" for i in range(40)]
    seconds = 60.0
    _flood(rate, clock, flood, 50.0, seconds, "10.8.0.1", every_s=1000.0)
    bound = len(flood) * (accept_rate.QUIET_BURST + accept_rate.QUIET_PER_S * seconds) + 1  # + the quiet one's
    assert 0 < rate.let_in_quiet <= bound
    assert rate.refused_in_all > 1000
