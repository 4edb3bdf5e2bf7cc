"""A live 3-peer swarm for adversarial tests, and the one check every attack ends with:
every honest peer is alive, its registry shows the honest records unchanged, and a chat
through the chain answers with the whole model's text."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from swarm import PeerProcess, Swarm, request_json

MODEL = "smollm2:135m"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 16
RANGES = ("0-10", "10-20", "20-30")


@contextmanager
def three_peers(workdir: Path, *extra: str, per_peer: dict[int, list[str]] | None = None) -> Iterator[tuple[Swarm, list[PeerProcess]]]:
    with Swarm(workdir, extra_args=["--wire-dtype", "f32", *extra]) as s:
        args = per_peer or {}
        a = s.start("a", "--layers", RANGES[0], *args.get(0, []))
        peers = [a] + [s.start(name, "--layers", RANGES[i], *args.get(i, []), bootstrap=a) for i, name in ((1, "b"), (2, "c"))]
        for peer in peers:
            s.wait_ready(peer, timeout=120)
        for peer in peers:
            s.wait(lambda p=peer: p.get("/api/models")[0]["chain_complete"], 30, "a complete chain", peer)
        yield s, peers


def honest_nodes(peer: PeerProcess) -> list[tuple[str, int, int, str]]:
    return sorted((n["node_id"], n["start_layer"], n["end_layer"], n["state"]) for n in peer.get("/nodes") if not n["legacy"])


def chat(peer: PeerProcess, timeout: float = 120.0) -> tuple[int, Any]:
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": MAX_TOKENS, "temperature": 0}
    return request_json("POST", peer.url + "/v1/chat/completions", body, timeout=timeout)


def assert_swarm_healthy(peers: list[PeerProcess], expected: str, baseline: list[tuple[str, int, int, str]]) -> None:
    """Alive, the honest records as before, and a chat through the chain still exact."""
    for peer in peers:
        assert peer.alive(), f"{peer.name} died:\n{peer.log_tail()}"
    for peer in peers:  # a stranger may add its own node, never change or hide ours
        assert set(baseline) <= set(honest_nodes(peer)), f"{peer.name}'s registry changed"
    status, body = chat(peers[0])
    assert status == 200, (status, body)
    assert body["choices"][0]["message"]["content"] == expected
