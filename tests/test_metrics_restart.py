"""A real peer restarted on its data dir: ``metrics.db`` brings back the figures its stage
measured only for the model and layers they were measured on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from swarm import PeerProcess, Swarm, request_json

MODEL = "smollm2:135m"


def own_node(peer: PeerProcess, peer_id: str) -> dict[str, Any]:
    return next(n for n in peer.get("/nodes") if n["peer_id"] == peer_id)


@pytest.mark.swarm
@pytest.mark.slow
def test_a_peer_restarted_on_other_layers_publishes_none_of_the_old_figures(tmp_path: Path) -> None:
    """Before, a peer restarted with another range published the last run's step latency,
    throughput and tokens as its own (rankings, ``/metrics``, placement read them): here the
    30 layers' ~120 ms per step and 38 tokens, claimed for layers 10-30."""
    with Swarm(tmp_path) as swarm:
        a = swarm.start("a", "--layers", "0-30")
        a_id = swarm.wait_ready(a)["peer_id"]
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "temperature": 0}
        status, answer = request_json("POST", a.url + "/v1/chat/completions", body, timeout=60)
        assert status == 200, answer

        def measured() -> dict[str, Any] | None:
            node = own_node(a, a_id)
            return node if node["tokens_total"] and node["avg_latency_ms"] and node["throughput_tps"] else None

        swarm.wait(measured, 20, "a's record to carry what its stage measured", a)
        swarm.stop(a)

        a = swarm.start("a", "--layers", "0-30")  # the same slice: its figures come back
        swarm.wait_ready(a)
        kept = own_node(a, a_id)
        assert kept["tokens_total"] and kept["avg_latency_ms"] and kept["throughput_tps"], kept
        swarm.stop(a)

        a = swarm.start("a", "--layers", "10-30")  # another range: none of them
        swarm.wait_ready(a)
        fresh = own_node(a, a_id)
        assert (fresh["tokens_total"], fresh["avg_latency_ms"], fresh["throughput_tps"]) == (0, 0.0, 0.0), fresh
        assert fresh["requests_served"] == kept["requests_served"] == 1  # the entry's count is no slice's
        swarm.stop(a)
