"""The MLX layer-range engine (mlx's CPU build on Linux) on the real SmolLM2 GGUF.

It must compute what a float64 NumPy pass over the same file computes, give the same greedy
tokens whether the model runs as one range or three, batch sessions without changing their
numbers, rewind, and hold in memory about its own range only.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from numpy_reference import NumpyModel, cosine
from test_engine import QUESTIONS, generate, step

from inclavate.types import LayerRange, ModelId, SessionId
from node.engine import BatchItem, EngineConfig, LayerEngine
from node.errors import ContextFull, InvalidBatch, SessionLimitReached
from node.mlx_engine import MlxEngine
from node.tokenizer import Tokenizer

pytestmark = pytest.mark.slow
MODEL = ModelId("smollm2:135m")
CONFIG = EngineConfig(context_length=256, max_sessions=3)
SPLIT = [LayerRange(0, 10), LayerRange(10, 20), LayerRange(20, 30)]


def _engine(model, layers: LayerRange, config: EngineConfig = CONFIG) -> MlxEngine:
    return MlxEngine(model_id=MODEL, model_path=model.path, layers=layers, config=config)


@pytest.fixture(scope="module")
def prompts(smollm2) -> list[list[int]]:
    """Chat turns without the default system prompt: ~15 tokens each, because mlx's CPU
    build runs a prefill at roughly 0.1 s a token on a 2-core VM."""
    with Tokenizer(smollm2.path) as tok:
        return [tok.tokenize(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n") for q in QUESTIONS]


@pytest.fixture(scope="module")
def whole(smollm2) -> LayerEngine:
    with _engine(smollm2, LayerRange(0, 30)) as engine:
        yield engine


@pytest.fixture(scope="module")
def chain(smollm2) -> list[LayerEngine]:
    engines = [_engine(smollm2, r) for r in SPLIT]
    yield engines
    for engine in engines:
        engine.close()


def test_logits_match_a_float64_numpy_reference(whole, smollm2, prompts) -> None:
    prompt = prompts[0]
    (out,) = whole.forward([BatchItem(SessionId("ref"), 0, tokens=np.array(prompt, np.int32))])
    whole.close_session(SessionId("ref"))
    expected = NumpyModel(smollm2.path).logits(prompt)
    # Measured: cosine 1 - 1e-12, max |d| 7e-5 (float32 against float64).
    assert cosine(out.logits, expected) > 0.999999
    assert np.max(np.abs(out.logits - expected)) < 1e-2
    assert int(np.argmax(out.logits)) == int(np.argmax(expected))


def test_a_three_range_chain_equals_one_range(whole, chain, prompts) -> None:
    expected, expected_logits = generate([whole], prompts[0], 32)
    got, got_logits = generate(chain, prompts[0], 32, wire="f32")
    assert got == expected
    assert len(set(expected)) > 3
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(expected_logits, got_logits)) < 1e-3


def test_batched_decode_equals_running_alone(chain, prompts) -> None:
    n = 8
    alone = [generate(chain, prompts[k], n, session=f"alone{k}")[0] for k in range(2)]
    ids = [SessionId("a"), SessionId("b")]
    tokens = [np.array(prompts[k], np.int32) for k in range(2)]
    pos, got = [0, 0], [[], []]
    try:
        for _ in range(n):
            logits = step(chain, [BatchItem(ids[k], pos[k], tokens=tokens[k]) for k in range(2)], "f32")
            for k in range(2):
                pos[k] += len(tokens[k])
                got[k].append(int(np.argmax(logits[k])))
                tokens[k] = np.array([got[k][-1]], np.int32)
    finally:
        for engine in chain:
            for sid in ids:
                engine.close_session(sid)
    assert got == alone


def test_rewind_recomputes_from_the_given_position(whole, prompts) -> None:
    sid = SessionId("rewind")
    prompt = np.array(prompts[1], np.int32)
    try:
        (first,) = whole.forward([BatchItem(sid, 0, tokens=prompt)])
        continuation = np.array([int(np.argmax(first.logits)), 42, 43, 44], np.int32)
        whole.forward([BatchItem(sid, len(prompt), tokens=continuation)])
        assert whole.session_length(sid) == len(prompt) + 4
        # Back to the end of the prompt: the same next token, the same logits.
        (again,) = whole.forward([BatchItem(sid, len(prompt) - 1, tokens=prompt[-1:])])
        assert whole.session_length(sid) == len(prompt)
        assert np.max(np.abs(again.logits - first.logits)) < 1e-4
        # A failover's adopt: the cache continues under a new id, never onto a held one.
        moved = SessionId("rewind.1")
        assert whole.rename_session(sid, moved) == len(prompt)
        assert whole.session_length(sid) == 0 and whole.rename_session(sid, moved) == 0
        (after,) = whole.forward([BatchItem(moved, len(prompt) - 1, tokens=prompt[-1:])])
        assert np.array_equal(after.logits, again.logits)
        whole.close_session(moved)
    finally:
        whole.close_session(sid)


def test_bad_batches_are_refused_without_leaving_state(smollm2, prompts) -> None:
    config = EngineConfig(context_length=64, max_sessions=1)
    with _engine(smollm2, LayerRange(0, 10), config) as first, _engine(smollm2, LayerRange(10, 20), config) as middle:
        with pytest.raises(InvalidBatch, match="hidden states"):
            middle.forward([BatchItem(SessionId("x"), 0, tokens=np.array([1], np.int32))])
        with pytest.raises(InvalidBatch, match="token ids must lie"):
            first.forward([BatchItem(SessionId("x"), 0, tokens=np.array([10**6], np.int32))])
        with pytest.raises(ContextFull):
            first.forward([BatchItem(SessionId("x"), 0, tokens=np.ones(65, np.int32))])
        first.forward([BatchItem(SessionId("a"), 0, tokens=np.array(prompts[0][:8], np.int32))])
        with pytest.raises(SessionLimitReached):
            first.forward([BatchItem(SessionId("b"), 0, tokens=np.array([1], np.int32))])
        with pytest.raises(InvalidBatch, match="cannot continue at 9"):
            first.forward([BatchItem(SessionId("a"), 9, tokens=np.array([1], np.int32))])
        assert first.memory().sessions == 1 and first.session_length(SessionId("a")) == 8
        assert first.close_session(SessionId("a")) and not first.close_session(SessionId("a"))
        assert first.memory().sessions == 0 and first.kv_positions_held() == 0


_RSS_PROBE = """
import json, sys
from pathlib import Path
def rss():
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096
import mlx.core, numpy, gguf
from inclavate.types import LayerRange, ModelId
from node.engine import EngineConfig
from node.mlx_engine import MlxEngine
before = rss()
engine = MlxEngine(model_id=ModelId("m"), model_path=Path(sys.argv[1]), layers=LayerRange(int(sys.argv[2]), int(sys.argv[3])),
                   config=EngineConfig(context_length=64, max_sessions=1))
print(json.dumps({"delta": rss() - before, "weights": engine.memory().weights_bytes}))
"""


def _rss_delta(model, layers: LayerRange) -> dict[str, int]:
    out = subprocess.run(
        [sys.executable, "-c", _RSS_PROBE, str(model.path), str(layers.start), str(layers.end)],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_range_holds_about_its_own_weights_in_memory(smollm2) -> None:
    """Resident memory after loading, in a fresh process each: a middle range reads its 10
    blocks only (no embedding, no head), so it costs a fraction of the whole model."""
    middle = _rss_delta(smollm2, LayerRange(10, 20))
    whole = _rss_delta(smollm2, LayerRange(0, 30))
    file_size = smollm2.path.stat().st_size
    assert middle["weights"] < whole["weights"] / 3
    # Measured: middle ~31 MB, whole ~121 MB (file 99 MB). Loose bounds: allocator noise.
    assert middle["delta"] < whole["delta"] / 2
    assert middle["delta"] < middle["weights"] + 24 * 2**20
    assert whole["delta"] < 2 * file_size
