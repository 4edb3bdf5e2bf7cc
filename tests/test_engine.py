"""The llama.cpp layer-range engine on the real SmolLM2 model: a 3-range chain must compute
what the whole model computes in one context."""

from __future__ import annotations

import dataclasses

import resource
from pathlib import Path

import numpy as np
import pytest

from inclavate import tensors
from inclavate.types import LayerRange, ModelId, SessionId
from node.engine import BatchItem, EngineConfig, LayerEngine
from node.errors import ContextFull, InvalidBatch, SessionLimitReached
from node.llamacpp_engine import LlamaCppEngine
from node.tokenizer import Tokenizer
from conftest import smollm2_engine

MODEL = ModelId("smollm2:135m")
SPLIT = [LayerRange(0, 10), LayerRange(10, 20), LayerRange(20, 30)]
CONFIG = EngineConfig(n_threads=1, context_length=512, max_sessions=4)
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain gravity to a child.",
    "List three prime numbers.",
]


def chatml(question: str) -> str:
    return (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        f"<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.fixture(scope="module")
def tokenizer(smollm2) -> Tokenizer:
    with Tokenizer(smollm2.path) as tok:
        yield tok


@pytest.fixture(scope="module")
def prompts(tokenizer: Tokenizer) -> list[list[int]]:
    return [tokenizer.tokenize(chatml(q)) for q in QUESTIONS]


def _engine(model, layers: LayerRange, cache: Path, config: EngineConfig = CONFIG) -> LlamaCppEngine:
    return LlamaCppEngine(
        model_id=MODEL,
        model_path=model.path,
        model_sha256=model.spec.gguf_sha256,
        layers=layers,
        config=config,
        slice_cache=cache,
    )


@pytest.fixture(scope="module")
def whole(smollm2, slice_cache) -> LayerEngine:
    with _engine(smollm2, LayerRange(0, 30), slice_cache) as engine:
        yield engine


@pytest.fixture(scope="module")
def chain(smollm2, slice_cache) -> list[LayerEngine]:
    engines = [_engine(smollm2, r, slice_cache) for r in SPLIT]
    yield engines
    for engine in engines:
        engine.close()


def step(engines: list[LayerEngine], items: list[BatchItem], wire: tensors.WireDType) -> list[np.ndarray]:
    """One pass through the chain; hidden states cross each boundary through the wire codec."""
    for engine in engines:
        outputs = engine.forward(items)
        if engine.info.is_last:
            return [o.logits for o in outputs]
        items = [
            BatchItem(i.session_id, i.start_pos, hidden=tensors.decode(tensors.encode(o.hidden, wire)))
            for i, o in zip(items, outputs)
        ]
    raise AssertionError("the chain has no last range")


def generate(
    engines: list[LayerEngine],
    prompt: list[int],
    n: int,
    *,
    wire: tensors.WireDType = "f32",
    session: str = "s",
    forced: list[int] | None = None,
) -> tuple[list[int], list[np.ndarray]]:
    """Greedy tokens and per-step logits. With ``forced``, feed those tokens instead (teacher
    forcing), so two runs are compared step by step on the same inputs."""
    sid = SessionId(session)
    tokens, all_logits, pos = np.array(prompt, np.int32), [], 0
    try:
        for i in range(n):
            (logits,) = step(engines, [BatchItem(sid, pos, tokens=tokens)], wire)
            pos += len(tokens)
            all_logits.append(logits)
            nxt = int(np.argmax(logits)) if forced is None else forced[i]
            tokens = np.array([nxt], np.int32)
        return [int(np.argmax(lg)) for lg in all_logits], all_logits
    finally:
        for engine in engines:
            engine.close_session(sid)


@pytest.mark.slow
def test_split_with_float32_wire_is_bit_exact(whole, chain, prompts) -> None:
    for prompt in prompts[:3]:
        expected, expected_logits = generate([whole], prompt, 64)
        got, got_logits = generate(chain, prompt, 64, wire="f32")
        assert got == expected
        assert all(np.array_equal(a, b) for a, b in zip(expected_logits, got_logits))


@pytest.mark.slow
def test_split_with_float16_wire_agrees_except_at_near_ties(whole, chain, prompts) -> None:
    """Any perturbation of the residual stream, even 1e-6 relative, moves SmolLM2's logits by
    up to ~1: llama.cpp re-quantizes activations to 8 bits per block for Q4_1 matmuls and a
    nudged value can round to the other step. float16 (~5e-4 relative) sits at that noise
    floor, so a greedy pick can flip where the whole model's top two logits are close.
    Teacher forcing compares every step on identical inputs: any disagreement must be such
    a near tie, never a real difference. (Exactness is the float32 test above.)"""
    agreeing = 0
    for prompt in prompts:
        expected, expected_logits = generate([whole], prompt, 64)
        got, got_logits = generate(chain, prompt, 64, wire="f16", forced=expected)
        for i, (a, b) in enumerate(zip(expected_logits, got_logits)):
            assert np.max(np.abs(a - b)) < 2.0, f"step {i}: logits moved beyond the noise floor"
            if expected[i] != got[i]:
                top2 = np.sort(a)[-2:]
                assert top2[1] - top2[0] < 1.0, f"step {i}: a clear choice flipped"
        agreeing += sum(x == y for x, y in zip(expected, got))
    assert agreeing / (64 * len(prompts)) > 0.9


@pytest.mark.slow
def test_interleaved_sessions_in_one_batch_match_running_alone(chain, prompts) -> None:
    a_prompt, b_prompt = prompts[0], prompts[1]
    alone_a, _ = generate(chain, a_prompt, 24, session="a")
    alone_b, _ = generate(chain, b_prompt, 24, session="b")

    ids = [SessionId("a"), SessionId("b")]
    tokens = [np.array(a_prompt, np.int32), np.array(b_prompt, np.int32)]
    pos = [0, 0]
    got: list[list[int]] = [[], []]
    # A third conversation sits in the shared cache throughout: others' state must not
    # change a session's numbers.
    bystander = SessionId("c")
    step(chain, [BatchItem(bystander, 0, tokens=np.array(prompts[2] * 4, np.int32))], "f32")
    try:
        for _ in range(24):
            items = [BatchItem(ids[k], pos[k], tokens=tokens[k]) for k in range(2)]
            logits = step(chain, items, "f32")
            for k in range(2):
                pos[k] += len(tokens[k])
                got[k].append(int(np.argmax(logits[k])))
                tokens[k] = np.array([got[k][-1]], np.int32)
    finally:
        for engine in chain:
            for sid in [*ids, bystander]:
                engine.close_session(sid)
    assert got == [alone_a, alone_b]


@pytest.mark.slow
def test_closing_sessions_frees_kv_cache(chain, prompts) -> None:
    first, last = chain[0], chain[-1]
    sid = SessionId("reuse")
    baseline, _ = generate(chain, prompts[0], 4, session="reuse")
    # After close the slot is empty: a new session starting at position 0 is accepted and
    # computes exactly what a fresh one does.
    assert first.session_length(sid) == 0 and first.cached_positions(sid) == 0
    again, _ = generate(chain, prompts[0], 4, session="reuse")
    assert again == baseline

    def rss_kb() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    prompt = np.array(prompts[2], np.int32)
    for i in range(20):  # warm up allocator pools before measuring
        _one_session(chain, f"warm{i}", prompt)
    before = rss_kb()
    for i in range(200):
        _one_session(chain, f"s{i}", prompt)
        assert last.memory().sessions == 0
    assert rss_kb() - before < 32 * 1024, "memory grew while sessions were opened and closed"


def _one_session(chain: list[LayerEngine], name: str, prompt: np.ndarray) -> None:
    sid = SessionId(name)
    step(chain, [BatchItem(sid, 0, tokens=prompt)], "f16")
    for engine in chain:
        assert engine.close_session(sid)
        assert engine.session_length(sid) == 0


def test_rewinding_a_session_recomputes_from_that_position(chain, prompts) -> None:
    sid = SessionId("rewind")
    prompt = np.array(prompts[0], np.int32)
    try:
        (first,) = step(chain, [BatchItem(sid, 0, tokens=prompt)], "f32")
        step(chain, [BatchItem(sid, len(prompt), tokens=np.array([5, 6, 7], np.int32))], "f32")
        # Going back to the last prompt position replays it: same logits as the first time.
        (again,) = step(chain, [BatchItem(sid, len(prompt) - 1, tokens=prompt[-1:])], "f32")
        assert np.array_equal(first, again)
    finally:
        for engine in chain:
            engine.close_session(sid)


def test_bad_batches_are_refused_before_any_work(chain, smollm2, slice_cache) -> None:
    first, middle = chain[0], chain[1]
    with pytest.raises(InvalidBatch, match="token ids"):
        first.forward([BatchItem(SessionId("x"), 0, hidden=np.zeros((1, 576), np.float32))])
    with pytest.raises(InvalidBatch, match="hidden states"):
        middle.forward([BatchItem(SessionId("x"), 0, hidden=np.zeros((1, 100), np.float32))])
    with pytest.raises(InvalidBatch, match="cannot continue"):
        first.forward([BatchItem(SessionId("x"), 5, tokens=np.array([1], np.int32))])
    with pytest.raises(InvalidBatch, match="twice"):
        item = BatchItem(SessionId("x"), 0, tokens=np.array([1], np.int32))
        first.forward([item, item])
    with pytest.raises(ContextFull):
        first.forward([BatchItem(SessionId("x"), 0, tokens=np.ones(CONFIG.context_length + 1, np.int32))])
    assert first.memory().sessions == 0

    small = _engine(smollm2, LayerRange(0, 10), slice_cache, EngineConfig(n_threads=1, context_length=64, max_sessions=1))
    with small:
        small.forward([BatchItem(SessionId("a"), 0, tokens=np.array([1], np.int32))])
        with pytest.raises(SessionLimitReached):
            small.forward([BatchItem(SessionId("b"), 0, tokens=np.array([1], np.int32))])


def test_long_prefill_is_split_across_decode_calls(smollm2, slice_cache, prompts) -> None:
    """A batch longer than n_batch runs as several llama.cpp calls with identical results."""
    config = EngineConfig(n_threads=1, context_length=512, max_sessions=2, n_batch=16)
    engines = [_engine(smollm2, r, slice_cache, config) for r in SPLIT]
    try:
        small_batches, _ = generate(engines, prompts[0], 4)
    finally:
        for engine in engines:
            engine.close()
    engines = [_engine(smollm2, r, slice_cache) for r in SPLIT]
    try:
        one_batch, _ = generate(engines, prompts[0], 4)
    finally:
        for engine in engines:
            engine.close()
    assert small_batches == one_batch


def test_decode_steps_of_many_sessions_batch_exactly_whatever_their_slots(chain, prompts) -> None:
    """Sessions come and go, so the ones decoding together hold scattered sequence slots;
    every one must still get exactly its solo result, on every range."""
    ids = [SessionId(f"m{i}") for i in range(4)]
    prompt = [np.array(p, np.int32) for p in prompts]

    def run(batch_ids: list[SessionId]) -> list[np.ndarray]:
        items = [BatchItem(sid, len(prompt[ids.index(sid)]), tokens=np.array([60], np.int32)) for sid in batch_ids]
        return step(chain, items, "f32")

    try:
        for sid, p in zip(ids, prompt):
            step(chain, [BatchItem(sid, 0, tokens=p)], "f32")
        for engine in chain:  # free slot 1: the survivors hold slots 0, 2, 3
            engine.close_session(ids[1])
        survivors = [ids[3], ids[0], ids[2]]  # and arrive out of slot order
        together = run(survivors)
        for sid, logits in zip(survivors, together):
            assert all(e.session_length(sid) == len(prompt[ids.index(sid)]) + 1 for e in chain)
            (alone,) = run([sid])  # rewinds the step and runs it alone
            assert np.array_equal(alone, logits)
    finally:
        for engine in chain:
            for sid in ids:
                engine.close_session(sid)


def test_an_engine_holding_one_session_takes_every_thread_and_the_shared_count_with_more(
        whole, smollm2, slice_cache, prompts) -> None:  # fmt: skip
    """``inclavate swarm``'s peers share the cores but a lone stream computes at one stage at
    a time: it may use them all. What a call computes does not depend on it."""
    import llama_cpp

    config = EngineConfig(n_threads=2, n_threads_shared=1, context_length=512, max_sessions=4)
    a, b = SessionId("lone"), SessionId("other")
    prompt = np.array(prompts[0], np.int32)
    step = [BatchItem(a, len(prompt), tokens=np.array([60], np.int32))]
    with _engine(smollm2, LayerRange(0, 30), slice_cache, config) as engine:
        threads = lambda: llama_cpp.llama_n_threads(engine._ctx)  # noqa: E731 - what llama.cpp will use
        (lone_prefill,) = engine.forward([BatchItem(a, 0, tokens=prompt)])
        assert threads() == 2
        (lone,) = engine.forward(step)
        assert threads() == 2
        engine.forward([BatchItem(b, 0, tokens=prompt)])
        assert threads() == 1  # a second session: steps of both may come at every stage at once
        (shared, _) = engine.forward([*step, BatchItem(b, len(prompt), tokens=np.array([60], np.int32))])
        assert threads() == 1
        engine.forward(step)
        assert threads() == 1  # the other session is still held here
        engine.close_session(b)
        engine.forward(step)
        assert threads() == 2
    try:
        (reference_prefill,) = whole.forward([BatchItem(a, 0, tokens=prompt)])
        (reference,) = whole.forward(step)
    finally:
        whole.close_session(a)
    assert np.array_equal(lone_prefill.logits, reference_prefill.logits)
    assert np.array_equal(lone.logits, reference.logits) and np.array_equal(shared.logits, reference.logits)


def test_steps_past_the_split_kv_threshold_compute_alike_at_any_thread_count_batched_or_replayed(
        whole, smollm2, slice_cache, prompts) -> None:  # fmt: skip
    """From position 256 a one-token step takes flash attention's split-KV path, one chunk of
    keys per thread: at 2 threads it differed from the same step at 1 thread, from the step
    batched with another session's, and from a failover's replay in 32-token frames (an
    outside audit: a 3-peer ``inclavate swarm`` changed greedy text with concurrency). With
    ``exact_steps`` such steps run on one thread (``LlamaCppEngine._set_threads``); the rest
    keep theirs, and without it they keep every thread (the default: speed)."""
    import llama_cpp

    config = EngineConfig(n_threads=2, n_threads_shared=1, context_length=512, max_sessions=4, exact_steps=True)
    prompt = np.array(prompts[0], np.int32)
    rest = np.random.default_rng(0).integers(100, 20000, 320).astype(np.int32)
    tokens = np.concatenate([prompt, rest])
    n = 256 + 40  # llama.cpp pads a stream's KV cells to 256: 512 keys from position 256
    a, b = SessionId("a"), SessionId("b")

    def build(engine: LayerEngine, sid: SessionId, frame: int) -> None:
        """Positions [0, n): the prompt, then frames of ``frame`` tokens."""
        engine.forward([BatchItem(sid, 0, tokens=prompt)])
        for p in range(len(prompt), n, frame):
            engine.forward([BatchItem(sid, p, tokens=tokens[p:min(p + frame, n)])])

    step = lambda sid: BatchItem(sid, n, tokens=tokens[n:n + 1])  # noqa: E731
    with _engine(smollm2, LayerRange(0, 30), slice_cache, config) as engine:
        threads = lambda: llama_cpp.llama_n_threads(engine._ctx)  # noqa: E731 - for one-token ubatches
        engine.forward([BatchItem(a, 0, tokens=prompt)])
        engine.forward([BatchItem(a, len(prompt), tokens=tokens[len(prompt):len(prompt) + 1])])
        assert threads() == 2  # a lone session's short steps keep every thread
        engine.close_session(a)
        build(engine, a, 1)
        (lone,) = engine.forward([step(a)])  # alone: every thread, before
        engine.close_session(a)
        build(engine, a, 32)  # what a failover's replay sends
        (replayed,) = engine.forward([step(a)])
        engine.forward([BatchItem(b, 0, tokens=prompt)])
        together, _ = engine.forward([step(a), BatchItem(b, len(prompt), tokens=tokens[len(prompt):len(prompt) + 1])])
    try:
        build(whole, a, 1)  # one thread
        (reference,) = whole.forward([step(a)])
    finally:
        whole.close_session(a)
    assert np.array_equal(lone.logits, reference.logits)
    assert np.array_equal(replayed.logits, reference.logits)
    assert np.array_equal(together.logits, reference.logits)
    fast = dataclasses.replace(config, exact_steps=False)
    with _engine(smollm2, LayerRange(0, 30), slice_cache, fast) as engine:
        build(engine, a, 32)
        engine.forward([step(a)])
        assert llama_cpp.llama_n_threads(engine._ctx) == 2  # by default a lone step keeps every thread


@pytest.mark.parametrize("shared", [0, 3])
def test_the_shared_thread_count_is_between_one_and_all(shared: int) -> None:
    with pytest.raises(ValueError, match="n_threads_shared"):
        EngineConfig(n_threads=2, n_threads_shared=shared)
    with pytest.raises(ValueError, match="step_threads"):
        EngineConfig(n_threads=2, step_threads=shared)


def test_one_token_steps_take_the_step_thread_count_and_prompts_every_thread(whole, smollm2, slice_cache, prompts) -> None:
    """``step_threads`` (``--step-threads``) is llama.cpp's ``-t`` beside ``-tb``: a decode
    step at its count, a prompt at ``n_threads``. At one thread a step is also exact past
    position 256, where two threads' split-KV attention would sum it in another order."""
    import llama_cpp

    config = EngineConfig(n_threads=2, n_threads_shared=2, context_length=512, max_sessions=4, step_threads=1)
    prompt = np.array(prompts[0], np.int32)
    tokens = np.concatenate([prompt, np.random.default_rng(1).integers(100, 20000, 320).astype(np.int32)])
    a, b = SessionId("a"), SessionId("b")

    def run(engine: LayerEngine) -> list[np.ndarray]:
        out = [engine.forward([BatchItem(a, 0, tokens=prompt)])[0].logits]
        return out + [engine.forward([BatchItem(a, p, tokens=tokens[p:p + 1])])[0].logits for p in range(len(prompt), 256 + 8)]

    with _engine(smollm2, LayerRange(0, 30), slice_cache, config) as engine:
        stepped = run(engine)
        assert (llama_cpp.llama_n_threads(engine._ctx), llama_cpp.llama_n_threads_batch(engine._ctx)) == (1, 2)
        engine.forward([BatchItem(b, 0, tokens=prompt)])
        assert (llama_cpp.llama_n_threads(engine._ctx), llama_cpp.llama_n_threads_batch(engine._ctx)) == (1, 2)
    try:
        reference = run(whole)  # one thread throughout
    finally:
        whole.close_session(a)
    assert all(np.array_equal(s, r) for s, r in zip(stepped, reference, strict=True))


@pytest.mark.parametrize("layers", [(0, 10), (10, 20), (20, 30)])
def test_a_lone_step_computes_what_the_batch_path_computes(smollm2, slice_cache, layers: tuple[int, int]) -> None:
    """A session decoding alone takes a short path through the engine at every token
    (``LlamaCppEngine._step``); it must leave the same KV and give the same bits as the
    batch path, which a failover's replay and a batch with other sessions go through."""
    rng = np.random.default_rng(7)
    first = layers[0] == 0
    inputs = [rng.integers(0, 49152, size=1, dtype=np.int32) if first else rng.standard_normal((1, 576)).astype(np.float32)
              for _ in range(12)]  # fmt: skip

    def item(sid: str, pos: int) -> BatchItem:
        x = inputs[pos]
        return BatchItem(SessionId(sid), pos, tokens=x) if first else BatchItem(SessionId(sid), pos, hidden=x)

    with smollm2_engine(smollm2, slice_cache, layers) as engine:
        step, taken = engine._step, []
        engine._step = lambda it: taken.append(step(it)) or taken[-1]  # type: ignore[method-assign]
        short = [engine.forward([item("short", pos)])[0] for pos in range(12)]
        assert sum(out is not None for out in taken) == 11  # all but the first, which opens the session
        engine._step = lambda _item: None  # type: ignore[method-assign]  # the batch path only
        batch = [engine.forward([item("batch", pos)])[0] for pos in range(12)]
    for a, b in zip(short, batch):
        got, want = (a.hidden, b.hidden) if a.hidden is not None else (a.logits, b.logits)
        assert got is not None and want is not None and got.tobytes() == want.tobytes()


def test_a_lone_step_that_fails_after_the_capture_leaves_nothing_for_the_next(smollm2, slice_cache, monkeypatch) -> None:
    """A lone step reads the capture without resetting it first (``EvalCapture.take`` and
    ``_restore`` leave it empty): a call that fails after the callback copied its row must not
    leave that row to the next step, which must compute what a step that never failed does."""
    import llama_cpp

    from node.errors import DecodeFailed

    rng = np.random.default_rng(3)
    inputs = [rng.standard_normal((1, 576)).astype(np.float32) for _ in range(4)]
    decode, failures = llama_cpp.llama_decode, []

    def failing_once(ctx, batch):  # computes (the callback copies its row), then reports a failure
        code = decode(ctx, batch)
        return 2 if failures and failures.pop() else code

    with smollm2_engine(smollm2, slice_cache, (10, 20)) as engine:
        monkeypatch.setattr(llama_cpp, "llama_decode", failing_once)
        outs = {}
        for sid in ("failed", "clean"):
            s = SessionId(sid)
            outs[sid] = [engine.forward([BatchItem(s, pos, hidden=inputs[pos])])[0].hidden for pos in range(2)]
            if sid == "failed":
                failures.append(True)
                with pytest.raises(DecodeFailed, match="returned 2"):
                    engine.forward([BatchItem(s, 2, hidden=inputs[2])])
                assert engine.session_length(s) == 2
            outs[sid] += [engine.forward([BatchItem(s, pos, hidden=inputs[pos])])[0].hidden for pos in (2, 3)]
    for got, want in zip(outs["failed"], outs["clean"], strict=True):
        assert got is not None and want is not None and got.tobytes() == want.tobytes()
