"""Peer-exchange answers are typed and bounded: garbage is one ProtocolError (never a
RecursionError reaching the discovery nursery), and strangers cannot grow the peer book."""

from __future__ import annotations

import json

import pytest

from p2p.discovery import PeerAddrs, decode_peers, encode_peers
from p2p.errors import ProtocolError


def test_an_honest_answer_round_trips() -> None:
    peers = [PeerAddrs("12D3KooWA", ("/ip4/127.0.0.1/tcp/1/p2p/12D3KooWA",))]  # type: ignore[arg-type]
    assert decode_peers(encode_peers(peers)) == peers


@pytest.mark.parametrize(
    "frame",
    [
        b"[" * 100_000 + b"]" * 100_000,
        b'{"peers": 1}',
        b'{"peers": [{"id": 1, "addrs": []}]}',
        b'{"peers": [{"id": "x", "addrs": "not a list"}]}',
        json.dumps({"peers": [{"id": "x", "addrs": ["a"] * 100}]}).encode(),
        json.dumps({"peers": [{"id": "x" * 1000, "addrs": []}]}).encode(),
        b"\xff",
    ],
)
def test_garbage_is_a_protocol_error(frame: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_peers(frame)


def test_an_answer_longer_than_asked_for_is_refused() -> None:
    many = [PeerAddrs(f"p{i}", ()) for i in range(40)]  # type: ignore[arg-type]
    with pytest.raises(ProtocolError):
        decode_peers(encode_peers(many), max_peers=32)
