"""The bound and the choice of ``p2p.outbound_guard`` (the flood itself:
``tests/adversary/test_hostile_outbound.py``)."""

from __future__ import annotations

import resource

from p2p.outbound_guard import Outbound, outbound_capacity, to_close


def _conn(key: int, idle_since: float, *, busy: bool = False, kept: bool = False) -> Outbound:
    return Outbound(key, busy, kept, idle_since)


def test_the_bound_follows_the_descriptor_limit(monkeypatch) -> None:
    for soft, bound in [(64, 16), (256, 32), (1024, 128), (65536, 1024)]:
        monkeypatch.setattr(resource, "getrlimit", lambda _which, soft=soft: (soft, soft))
        assert outbound_capacity() == bound


def test_within_the_bound_nothing_is_closed() -> None:
    assert to_close([_conn(1, 0.0), _conn(2, 0.0)], capacity=2, now=100.0) == []


def test_past_the_bound_the_longest_idle_go_first() -> None:
    conns = [_conn(1, 50.0), _conn(2, 10.0), _conn(3, 30.0), _conn(4, 90.0)]
    assert to_close(conns, capacity=2, now=100.0) == [2, 3]


def test_a_busy_or_kept_connection_is_never_closed_even_if_oldest() -> None:
    conns = [_conn(1, 0.0, busy=True), _conn(2, 1.0, kept=True), _conn(3, 50.0), _conn(4, 60.0)]
    assert to_close(conns, capacity=2, now=100.0) == [3, 4]


def test_a_connection_idle_less_than_min_idle_stays_so_fewer_may_close() -> None:
    """One just dialled for an ask has no stream yet: it is not closed under it."""
    conns = [_conn(1, 10.0), _conn(2, 99.5), _conn(3, 99.9)]
    assert to_close(conns, capacity=1, now=100.0, min_idle=1.0) == [1]


def test_when_all_are_busy_or_kept_none_is_closed() -> None:
    conns = [_conn(1, 0.0, busy=True), _conn(2, 0.0, kept=True), _conn(3, 0.0, busy=True)]
    assert to_close(conns, capacity=1, now=100.0) == []
