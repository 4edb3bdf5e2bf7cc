"""A mixed chain: llama.cpp, MLX and llama.cpp peers hold one model's ranges and answer a chat.

The engines differ in arithmetic (llama.cpp quantizes activations for its quantized dot
products, MLX does not), so the mixed chain is near the whole llama.cpp model, not equal to
it: the test asserts the agreement measured with ``scripts/bench_engine --engine mlx``
(docs/ARCHITECTURE.md, "Cross-engine numerics"), not bit equality.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from reference import whole_model_text
from swarm import Swarm, request_json

pytestmark = [pytest.mark.swarm, pytest.mark.slow]
QUESTION = "Explain in two sentences why the sky is blue."
MAX_TOKENS = 20
"""Measured in process (bench_engine --engine mlx): the mixed chain's greedy answer to QUESTION
agrees with the whole llama.cpp model for 25 tokens, then parts at a near tie (0.5 logit)."""


def test_a_mixed_engine_chain_answers_a_chat(tmp_path: Path, smollm2, slice_cache) -> None:
    with Swarm(tmp_path, extra_args=["--wire-dtype", "f32"]) as swarm:
        a = swarm.start("a", "--layers", "0-10", "--engine", "llamacpp")
        b = swarm.start("b", "--layers", "10-20", "--engine", "mlx", bootstrap=a)
        c = swarm.start("c", "--layers", "20-30", "--engine", "llamacpp", bootstrap=a)
        for peer in (a, b, c):
            swarm.wait_ready(peer, timeout=120)
        swarm.wait(lambda: a.get("/api/models")[0]["chain_complete"], 30, "a complete chain")

        engines = {n["start_layer"]: n["engine"] for n in a.get("/nodes")}
        assert engines == {0: "llamacpp", 10: "mlx", 20: "llamacpp"}
        mlx_node = next(n for n in a.get("/nodes") if n["start_layer"] == 10)
        assert c.get(f"/nodes/{mlx_node['node_id']}/hardware")["engine"] == "mlx"

        status, body = request_json("POST", c.url + "/v1/chat/completions", {
            "model": "smollm2:135m", "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": MAX_TOKENS, "temperature": 0,
        }, timeout=180)  # fmt: skip
        assert status == 200, body
        text = body["choices"][0]["message"]["content"]

    expected = whole_model_text(smollm2, slice_cache, [{"role": "user", "content": QUESTION}], MAX_TOKENS)
    assert body["usage"]["completion_tokens"] == MAX_TOKENS
    assert text == expected
