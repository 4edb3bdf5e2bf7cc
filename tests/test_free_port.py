"""Ports a harness hands its child peers: never one the kernel may hand out for bind(0)."""

from __future__ import annotations

import socket

from inclavate import local_swarm


def test_ports_are_free_distinct_and_below_the_kernels_ephemeral_range() -> None:
    low, _ = local_swarm._ephemeral_range()
    ports = [local_swarm.free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(1024 <= p < low for p in ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))  # nobody listens there


def test_a_port_someone_listens_on_is_not_handed_out(monkeypatch) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        picks = iter([taken, taken + 1 if taken + 1 < 65536 else taken - 1])
        monkeypatch.setattr(local_swarm, "_ephemeral_range", lambda: (65536, 65536))
        monkeypatch.setattr(local_swarm.random, "randrange", lambda lo, hi: next(picks))
        assert local_swarm.free_port() != taken
