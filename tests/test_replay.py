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
from node.kept_outputs import KeptOutputs
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


def run(engines: list[LayerEngine], sid: SessionId, pos: int, tokens: list[int], wire: tensors.WireDType,
        kept: list[KeptOutputs] | None = None) -> list[np.ndarray]:  # fmt: skip
    """One pass; returns what crossed each boundary (as sent) and the last position's logits.
    With ``kept``, each boundary's sender keeps what it sent, as a stage does."""
    item = BatchItem(sid, pos, tokens=np.array(tokens, np.int32))
    seen = []
    for index, engine in enumerate(engines):
        (out,) = engine.forward([item])
        if engine.info.is_last:
            return [*seen, out.logits]
        sent = tensors.encode(out.hidden, wire)
        if kept is not None:
            kept[index].put(sid, pos, sent, lambda s: engine.session_length(s) > 0)
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
        history, shapes, out = build(chain, original, prompt, wire)

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


def build(chain: list[LayerEngine], sid: SessionId, prompt: list[int], wire: tensors.WireDType,
          kept: list[KeptOutputs] | None = None) -> tuple[list[int], list[int], list[np.ndarray]]:  # fmt: skip
    """A session as the generation loop builds it: prompt chunks, then one greedy token per
    step (and once a multi-token step, as when a reasoning close tag is forced). Returns the
    tokens, the step shapes and the last step's boundaries and logits."""
    history, shapes = list(prompt), []
    for pos in range(0, len(prompt), PREFILL_CHUNK):
        chunk = prompt[pos : pos + PREFILL_CHUNK]
        out = run(chain, sid, pos, chunk, wire, kept)
        shapes.append(len(chunk))
    for i in range(40):
        step = [int(np.argmax(out[-1]))] if i != 20 else [28, 29, 30]
        out = run(chain, sid, len(history), step, wire, kept)
        history += step
        shapes.append(len(step))
    return history, shapes, out


@pytest.mark.parametrize("wire", ["f32", "f16", "bf16"])
def test_a_span_rebuilt_from_kept_outputs_continues_with_identical_bits(chain, smollm2, slice_cache, wire: tensors.WireDType) -> None:
    """Span replay: the middle range dies. The first and last ranges keep their caches under
    the new leg's id; a fresh middle engine is rebuilt from what the first range kept of its
    own outputs, in the original step shapes, its output discarded; then the last steps run
    through the whole route. Every boundary and the logits equal the undisturbed run's."""
    with Tokenizer(smollm2.path) as tok:
        prompt = tok.tokenize(chatml("Summarise: " + "the quick brown fox jumps over the lazy dog. " * 30))
    original, moved = SessionId("kept"), SessionId("kept.1")
    kept = [KeptOutputs(max_sessions=CONFIG.max_sessions, context_length=CONFIG.context_length, d_model=e.info.d_model,
                        wire_dtype=wire) for e in chain[:-1]]  # fmt: skip
    replacement = _engine(smollm2, chain[1].info.layers, slice_cache)
    try:
        history, shapes, out = build(chain, original, prompt, wire, kept)
        # The failover: the kept hops confirm what they hold; the entry re-sends the last two
        # steps through the whole new route (the kept hops rewind).
        k = len(history) - shapes[-2] - shapes[-1]
        for engine, store in ((chain[0], kept[0]), (chain[2], None)):
            assert engine.rename_session(original, moved) == len(history)
            if store is not None:
                store.rename(original, moved)
        assert kept[0].take_replay(moved) and not kept[0].take_replay(moved)  # once per adopt
        for start, n in replay_plan(shapes[:-2]):
            rows = tensors.decode(kept[0].rows(moved, start, n))
            replacement.forward([BatchItem(moved, start, hidden=rows)])
        route = [chain[0], replacement, chain[2]]
        run(route, moved, k, history[k : k + shapes[-2]], wire)
        got = run(route, moved, len(history) - 1, history[-1:], wire)
        for boundary, (a, b) in enumerate(zip(out, got)):
            assert np.array_equal(a, b), f"boundary {boundary} differs after the span replay"
    finally:
        replacement.close()
        for engine in chain:
            engine.close_session(original)
            engine.close_session(moved)
