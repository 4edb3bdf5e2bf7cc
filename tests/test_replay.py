"""Failover rebuilds a new route's KV cache by replaying a session's tokens in few frames,
where the original run built it from prefill chunks and then one token per step. On the real
SmolLM2 split in three ranges, the replayed cache must be the *same bits*: the next step's
hidden states at every boundary and its logits are identical, for every wire dtype.

Measured while writing this: one batch of 64 tokens or more does NOT reproduce single steps
(another CPU kernel path), fewer than 64 does; so the replay keeps prefill chunks in their
shapes and coalesces decode steps into small frames (``p2p.failover.replay_plan``). Kernels
change between llama.cpp releases: this test is what says the plan still holds."""

from __future__ import annotations

import numpy as np
import pytest
from test_engine import CONFIG, SPLIT, _engine, chatml

from inclavate import tensors
from inclavate.types import SessionId
from node.engine import BatchItem, LayerEngine
from node.tokenizer import Tokenizer
from p2p.failover import replay_plan

pytestmark = pytest.mark.slow
PREFILL_CHUNK = 256  # api.generation's default


@pytest.fixture(scope="module")
def chain(smollm2, slice_cache) -> list[LayerEngine]:
    engines = [_engine(smollm2, r, slice_cache) for r in SPLIT]
    yield engines
    for engine in engines:
        engine.close()


def run(engines: list[LayerEngine], sid: SessionId, pos: int, tokens: list[int], wire: tensors.WireDType) -> list[np.ndarray]:
    """One pass; returns what crossed each boundary (as sent) and the last position's logits."""
    item = BatchItem(sid, pos, tokens=np.array(tokens, np.int32))
    seen = []
    for engine in engines:
        (out,) = engine.forward([item])
        if engine.info.is_last:
            return [*seen, out.logits]
        sent = tensors.encode(out.hidden, wire)
        seen.append(np.frombuffer(sent.data, np.uint8).copy())
        item = BatchItem(sid, pos, hidden=tensors.decode(sent))
    raise AssertionError("no last range")


@pytest.mark.parametrize("wire", ["f32", "f16"])
def test_a_replayed_session_continues_with_identical_bits(chain, smollm2, wire: tensors.WireDType) -> None:
    with Tokenizer(smollm2.path) as tok:
        long_question = "Summarise: " + "the quick brown fox jumps over the lazy dog. " * 30
        prompt = tok.tokenize(chatml(long_question))
    assert PREFILL_CHUNK < len(prompt) < CONFIG.context_length - 64
    original, replayed = SessionId("original"), SessionId("replayed")
    try:
        # As the generation loop builds it: prompt chunks, then one greedy token per step
        # (and once a multi-token step, as when a reasoning close tag is forced).
        history, shapes = list(prompt), []
        for pos in range(0, len(prompt), PREFILL_CHUNK):
            chunk = prompt[pos : pos + PREFILL_CHUNK]
            out = run(chain, original, pos, chunk, wire)
            shapes.append(len(chunk))
        for i in range(40):
            step = [int(np.argmax(out[-1]))] if i != 20 else [28, 29, 30]
            out = run(chain, original, len(history), step, wire)
            history += step
            shapes.append(len(step))

        # As failover replays it on a fresh slot: all but the last step, then the last.
        frames = replay_plan(shapes[:-1])
        assert len(frames) < len(shapes) // 4  # small steps are coalesced
        for start, n in frames:
            run(chain, replayed, start, history[start : start + n], wire)
        got = run(chain, replayed, len(history) - 1, history[-1:], wire)
        for boundary, (a, b) in enumerate(zip(out, got)):
            assert np.array_equal(a, b), f"boundary {boundary} differs after the replay"
    finally:
        for engine in chain:
            engine.close_session(original)
            engine.close_session(replayed)
