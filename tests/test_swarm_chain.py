"""Three real peers: they place themselves, and their chain computes what the whole model does."""

from __future__ import annotations

from pathlib import Path

import pytest
from reference import whole_model_text
from swarm import Swarm, request_json

pytestmark = [pytest.mark.swarm, pytest.mark.slow]
QUESTION = "Explain in two sentences why the sky is blue."


def test_three_peers_without_layers_cover_the_model(tmp_path: Path) -> None:
    with Swarm(tmp_path) as swarm:
        first = swarm.start("a", "--max-layers", "12")
        # Started together: both late joiners see the first peer's range and collide on
        # the same gap; the tie-break must move one of them.
        others = [swarm.start(n, "--max-layers", "12", bootstrap=first) for n in ("b", "c")]
        for peer in [first, *others]:
            swarm.wait_ready(peer, timeout=90)
        model = swarm.wait(lambda: (m := first.get("/api/models")) and m[0]["chain_complete"] and m[0], 20, "a complete chain")
        assert model["gaps"] == [] and model["covered"] == [[0, 12], [12, 24], [24, 30]]


def test_a_three_peer_chain_equals_the_whole_model(tmp_path: Path, smollm2, slice_cache) -> None:
    with Swarm(tmp_path, extra_args=["--wire-dtype", "f32"]) as swarm:
        a = swarm.start("a", "--layers", "0-10")
        b = swarm.start("b", "--layers", "10-20", bootstrap=a)
        c = swarm.start("c", "--layers", "20-30", bootstrap=a)
        for peer in (a, b, c):
            swarm.wait_ready(peer, timeout=90)
        swarm.wait(lambda: a.get("/api/models")[0]["chain_complete"], 20, "a complete chain")
        status, body = request_json("POST", b.url + "/v1/chat/completions", {
            "model": "smollm2:135m", "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": 64, "temperature": 0,
        }, timeout=120)  # fmt: skip
        assert status == 200, body
        assert body["usage"]["completion_tokens"] == 64 or body["choices"][0]["finish_reason"] == "stop"

    expected = whole_model_text(smollm2, slice_cache, [{"role": "user", "content": QUESTION}], 64)
    assert body["choices"][0]["message"]["content"] == expected
