"""The stage worker on a real engine: batching, per-session order, waiting for a slot."""

from __future__ import annotations


import numpy as np
import pytest
import trio
import trio.testing
from conftest import smollm2_engine

from inclavate.types import SessionId
from node.engine import BatchItem
from node.errors import DecodeFailed, SessionEvicted, SessionLimitReached
from node.llamacpp_engine import LlamaCppEngine
from node.sampling import SamplingParams
from node.stage import Job, Stage, StageResult

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture
def engine(smollm2, slice_cache) -> LlamaCppEngine:
    with smollm2_engine(smollm2, slice_cache, context_length=128, max_sessions=2) as e:
        yield e


async def run_job(stage: Stage, session: str, start: int, tokens: list[int], sampling=GREEDY, source: str = "") -> StageResult:
    done: list[StageResult] = []
    event = trio.Event()

    async def deliver(result: StageResult) -> None:
        done.append(result)
        event.set()

    await stage.submit(Job(BatchItem(SessionId(session), start, tokens=np.array(tokens, np.int32)), SessionId(session), deliver,
                           sampling, source=source))  # fmt: skip
    await event.wait()
    return done[0]


async def test_chunks_of_a_session_run_in_order_and_match_one_prefill(engine) -> None:
    prompt = [1, 4093, 198, 19556, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]
    expected = int(np.argmax(engine.forward([BatchItem(SessionId("ref"), 0, tokens=np.array(prompt, np.int32))])[0].logits))
    engine.close_session(SessionId("ref"))
    stage = Stage(engine)
    async with trio.open_nursery() as nursery:
        await nursery.start(stage.run)
        results: list[StageResult] = []

        async def chunk(start: int, part: list[int], sampling) -> None:
            results.append(await run_job(stage, "s", start, part, sampling))

        # Submitted back to back: the second must wait for the first, in order.
        async with trio.open_nursery() as inner:
            inner.start_soon(chunk, 0, prompt[:8], None)
            await trio.sleep(0)
            inner.start_soon(chunk, 8, prompt[8:], GREEDY)
        assert [r.error for r in results] == [None, None]
        assert results[-1].token == expected
        nursery.cancel_scope.cancel()


async def test_a_new_session_waits_for_a_free_slot_then_runs(engine) -> None:
    stage = Stage(engine)
    async with trio.open_nursery() as nursery:
        await nursery.start(stage.run)
        for name in ("a", "b"):
            assert (await run_job(stage, name, 0, [1, 2, 3])).error is None
        waiting: list[StageResult] = []

        async def third() -> None:
            waiting.append(await run_job(stage, "c", 0, [1, 2, 3]))

        nursery.start_soon(third)
        await trio.sleep(0.3)
        assert waiting == [], "ran without a free slot"

        async def closed(_: StageResult) -> None:
            pass

        await stage.submit(Job(None, SessionId("a"), closed))
        with trio.fail_after(5):
            while not waiting:
                await trio.sleep(0.05)
        assert waiting[0].error is None and waiting[0].token is not None
        nursery.cancel_scope.cancel()


async def test_a_close_is_not_starved_by_another_session_s_queued_work(engine) -> None:
    """A peer with many long jobs queued (a stranger's flood: admission lets it keep 64) must
    not hold back another session's close for all of them: the close frees the slot a new
    session waits for. Closes used to run only when first in line, behind every such job."""
    stage = Stage(engine)
    finished: list[str] = []

    def record(name: str):
        async def deliver(result: StageResult) -> None:
            assert result.error is None, result.error
            finished.append(name)

        return deliver

    async with trio.open_nursery() as nursery:
        await nursery.start(stage.run)
        await run_job(stage, "a", 0, [1, 2, 3])
        flood = [1, 4093, 198, 19556, 314, 260, 3575, 282] * 6
        for i in range(8):  # each rewinds the session to 0: 48 positions of work every time
            await stage.submit(Job(BatchItem(SessionId("flood"), 0, tokens=np.array(flood, np.int32)),
                                   SessionId("flood"), record(f"flood{i}")))  # fmt: skip
        await stage.submit(Job(None, SessionId("a"), record("close a")))
        with trio.fail_after(60):
            result = await run_job(stage, "c", 0, [1, 2, 3])  # both slots are taken until a closes
            while len(finished) < 9:
                await trio.sleep(0.05)
        assert result.error is None
        assert finished.index("close a") < finished.index("flood3"), finished
        nursery.cancel_scope.cancel()


async def test_waiting_too_long_for_a_slot_is_a_clear_error(engine) -> None:
    stage = Stage(engine, admission_timeout_s=0.2)
    async with trio.open_nursery() as nursery:
        await nursery.start(stage.run)
        for name in ("a", "b"):
            await run_job(stage, name, 0, [1, 2])
        with trio.fail_after(5):
            result = await run_job(stage, "c", 0, [1, 2])
        assert isinstance(result.error, SessionLimitReached) and "stayed busy" in str(result.error)
        nursery.cancel_scope.cancel()


async def test_a_source_holding_every_slot_gives_its_longest_idle_one_to_another_source(engine) -> None:
    """Any peer may open sessions at a first stage: one that took every slot (and kept them
    with a step now and then) used to make everyone else wait out the admission timeout."""
    stage = Stage(engine, admission_timeout_s=30)
    async with trio.open_nursery() as nursery:
        await nursery.start(stage.run)
        for name in ("h1", "h2"):
            assert (await run_job(stage, name, 0, [1, 2, 3], source="hoarder")).error is None
        assert (await run_job(stage, "h2", 3, [4], source="hoarder")).error is None  # h1 is now the longest idle
        with trio.fail_after(5):
            honest = await run_job(stage, "honest", 0, [1, 2, 3], source="entry")
        assert honest.error is None and honest.token is not None
        assert stage.stats.evicted == 1 and set(engine.sessions()) == {SessionId("h2"), SessionId("honest")}
        evicted = await run_job(stage, "h1", 3, [4], source="hoarder")
        assert isinstance(evicted.error, SessionEvicted), evicted.error
        # Now one each: a new session of either source waits for a slot, evicting nobody.
        with trio.move_on_after(0.5) as waited:
            await run_job(stage, "h3", 0, [1, 2, 3], source="hoarder")
        assert waited.cancelled_caught and stage.stats.evicted == 1
        nursery.cancel_scope.cancel()


PROMPT = [1, 4093, 198, 19556, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198] * 3


async def _stream_while_prefilling(stage: Stage, long_sampling) -> tuple[list[str], StageResult]:
    """Session a holds a stream; session b sends a long prompt; a's next step goes in behind it.
    Returns the order in which the jobs finished and b's result."""
    finished: list[str] = []
    long_result: list[StageResult] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(stage.run)
        await run_job(stage, "a", 0, [1, 2, 3])

        async def long() -> None:
            long_result.append(await run_job(stage, "b", 0, PROMPT, long_sampling))
            finished.append("b")

        async def step() -> None:
            await run_job(stage, "a", 3, [4])
            finished.append("a")

        async with trio.open_nursery() as inner:
            inner.start_soon(long)
            await trio.sleep(0)
            inner.start_soon(step)
        nursery.cancel_scope.cancel()
    return finished, long_result[0]


async def test_a_long_prefill_is_sliced_while_another_session_streams(engine) -> None:
    expected = int(np.argmax(engine.forward([BatchItem(SessionId("ref"), 0, tokens=np.array(PROMPT, np.int32))])[0].logits))
    engine.close_session(SessionId("ref"))
    stage = Stage(engine, prefill_slice_tokens=8)
    finished, result = await _stream_while_prefilling(stage, GREEDY)
    assert finished == ["a", "b"], "the decode step waited for the whole prompt"
    assert result.error is None and result.token == expected
    assert stage.stats.batches >= 1 + 1 + len(PROMPT) // 8, "the prompt ran in one piece"


async def test_a_sliced_prefill_passes_on_the_same_hidden_states(smollm2, slice_cache) -> None:
    with smollm2_engine(smollm2, slice_cache, (0, 10), context_length=128, max_sessions=2) as first:
        (alone,) = first.forward([BatchItem(SessionId("ref"), 0, tokens=np.array(PROMPT, np.int32))])
        first.close_session(SessionId("ref"))
        _, result = await _stream_while_prefilling(Stage(first, prefill_slice_tokens=8), None)
    assert result.error is None and result.output is not None
    assert np.array_equal(result.output.hidden, alone.hidden)


@pytest.mark.slow
@pytest.mark.parametrize("inline_tokens", [0, 8])
async def test_decoding_sessions_out_of_step_come_to_share_one_call(engine, inline_tokens: int) -> None:
    """Two sessions whose steps arrive apart (as they do from a previous stage of a chain)
    end up in one engine call per step: the stage waits for the one it expects soon. A step
    that could skip the queue (``inline_tokens``) does not while another session decodes."""
    stage = Stage(engine, inline_tokens=inline_tokens)
    async with trio.open_nursery() as nursery:
        await nursery.start(stage.run)
        first = {name: (await run_job(stage, name, 0, [1, 2, 3])).token for name in ("a", "b")}

        async def decode(name: str, lag: float) -> None:
            await trio.sleep(lag)
            token, pos = first[name], 3
            for _ in range(6):
                result = await run_job(stage, name, pos, [token])
                assert result.error is None
                token, pos = result.token, pos + 1
                await trio.sleep(0.3)  # the rest of the round trip: the session's period

        async with trio.open_nursery() as sessions:
            sessions.start_soon(decode, "a", 0.0)
            sessions.start_soon(decode, "b", 0.1)
        nursery.cancel_scope.cancel()
    assert stage.stats.step_jobs == 12
    assert stage.stats.step_rounds <= 9, "the sessions' steps never shared a call"


async def test_a_round_with_every_decoding_session_queued_does_not_wait_for_a_busy_loop(engine) -> None:
    """The gather wait ends when every session decoding here has its step queued, not when
    the whole process is idle: a busy event loop (tokens being streamed out) must not hold
    the engine back. A task that never blocks stands in for it; the gather window is 60 s."""
    stage = Stage(engine, gather_s=60.0)
    async with trio.open_nursery() as nursery:
        await nursery.start(stage.run)
        tokens = {name: (await run_job(stage, name, 0, [1, 2, 3])).token for name in ("a", "b")}
        for name in ("a", "b"):  # one step each: both are now decoding here
            tokens[name] = (await run_job(stage, name, 3, [tokens[name]])).token

        async def busy() -> None:
            while True:
                await trio.sleep(0)

        nursery.start_soon(busy)
        with trio.fail_after(20):
            async with trio.open_nursery() as steps:
                for name in ("a", "b"):
                    steps.start_soon(run_job, stage, name, 4, [tokens[name]])
        nursery.cancel_scope.cancel()
    assert stage.stats.step_jobs == 4 and stage.stats.step_rounds == 3, "the last two steps shared one call"


async def test_submit_queues_without_a_scheduler_turn_and_waits_only_when_full(engine) -> None:
    """The forward service hands a frame to the stage and reads the next one at once; only
    a full queue holds it back (backpressure on the sending peer)."""
    stage = Stage(engine, queue_size=1)

    async def ignore(_: StageResult) -> None:
        return None

    def job(pos: int) -> Job:
        return Job(BatchItem(SessionId("s"), pos, tokens=np.array([1], np.int32)), SessionId("s"), ignore, GREEDY)

    with trio.testing.assert_no_checkpoints():
        await stage.submit(job(0))
    with trio.move_on_after(0.2) as waited:  # the stage is not running: its queue stays full
        await stage.submit(job(1))
    assert waited.cancelled_caught


async def test_a_lone_sessions_step_on_an_idle_stage_runs_in_its_submitters_task(engine) -> None:
    """One session decoding, nothing queued: the step is computed and delivered before
    ``submit`` returns (no hand-off to the worker), with the tokens the queue would give."""
    queued, inline = Stage(engine), Stage(engine, inline_tokens=8)
    async with trio.open_nursery() as nursery:
        for stage in (queued, inline):
            await nursery.start(stage.run)
        tokens = {}
        for name, stage in (("q", queued), ("i", inline)):
            tokens[name] = [(await run_job(stage, name, 0, [1, 4093, 198])).token]
            # The first step goes through the worker: it tells the stage how long a step takes.
            tokens[name].append((await run_job(stage, name, 3, [tokens[name][-1]])).token)
        for pos in range(4, 9):
            tokens["q"].append((await run_job(queued, "q", pos, [tokens["q"][-1]])).token)
            await trio.testing.wait_all_tasks_blocked()  # the worker waits for work
            delivered: list[StageResult] = []

            async def deliver(result: StageResult) -> None:
                delivered.append(result)

            item = BatchItem(SessionId("i"), pos, tokens=np.array([tokens["i"][-1]], np.int32))
            await inline.submit(Job(item, SessionId("i"), deliver, GREEDY))
            assert len(delivered) == 1 and delivered[0].error is None, "the step did not run in place"
            tokens["i"].append(delivered[0].token)
        nursery.cancel_scope.cancel()
    assert tokens["i"] == tokens["q"]
    assert inline.stats.step_jobs == 6 and inline.stats.tokens == 9 and inline.stats.inline_cpu_seconds > 0


async def test_a_step_never_overtakes_its_sessions_queued_work(engine) -> None:
    """A prefill chunk handed to the waiting worker leaves the queue empty; the session's
    next step, sent right behind it, must still run after it (a gap would fail it)."""
    stage = Stage(engine, inline_tokens=8)
    async with trio.open_nursery() as nursery:
        await nursery.start(stage.run)
        await run_job(stage, "s", 0, [1, 4093, 198])
        await trio.testing.wait_all_tasks_blocked()
        order: list[tuple[str, StageResult]] = []
        done = trio.Event()

        def recorder(name: str):
            async def deliver(result: StageResult) -> None:
                order.append((name, result))
                if len(order) == 2:
                    done.set()
            return deliver

        chunk = BatchItem(SessionId("s"), 3, tokens=np.array([19556, 314], np.int32))
        step = BatchItem(SessionId("s"), 5, tokens=np.array([260], np.int32))
        with trio.testing.assert_no_checkpoints():
            await stage.submit(Job(chunk, SessionId("s"), recorder("chunk"), None))
            await stage.submit(Job(step, SessionId("s"), recorder("step"), GREEDY))
        with trio.fail_after(20):
            await done.wait()
        nursery.cancel_scope.cancel()
    assert [(name, r.error) for name, r in order] == [("chunk", None), ("step", None)]


async def test_a_step_stuck_delivering_in_place_holds_back_only_its_own_session(engine) -> None:
    """A step run in its submitter's task whose delivery never completes (a hostile or
    stalled next hop that stops reading) must not hold the stage: another session's work
    still runs through the worker."""
    stage = Stage(engine, inline_tokens=8)
    async with trio.open_nursery() as nursery:
        await nursery.start(stage.run)
        token = (await run_job(stage, "stuck", 0, [1, 4093, 198])).token
        after = (await run_job(stage, "stuck", 3, [token])).token  # a first step, through the worker
        await trio.testing.wait_all_tasks_blocked()
        never = trio.Event()
        computed = trio.Event()

        async def stalled(result: StageResult) -> None:
            computed.set()
            await never.wait()

        item = BatchItem(SessionId("stuck"), 4, tokens=np.array([after], np.int32))
        nursery.start_soon(stage.submit, Job(item, SessionId("stuck"), stalled, GREEDY))
        with trio.fail_after(20):
            await computed.wait()  # ran in place, now stuck in its delivery
            other = await run_job(stage, "other", 0, [1, 4093, 198])
        assert other.error is None and other.token == token
        nursery.cancel_scope.cancel()


@pytest.fixture
def first_range(smollm2, slice_cache) -> LlamaCppEngine:
    """A stage of a chain: the first third of the model (hidden states out)."""
    with smollm2_engine(smollm2, slice_cache, (0, 10), context_length=128, max_sessions=4) as e:
        yield e


async def _one_step_each(stage: Stage, lanes: dict[str, int], calls: list[int]) -> tuple[list[str], dict[str, np.ndarray]]:
    """Prefill every session, then queue one decode step of each at once (in ``lanes``'
    order). Returns the order the steps were delivered in and their outputs; ``calls`` (the
    stage's ``on_batch`` list) is left holding the tokens of each step call."""
    order: list[str] = []
    outputs: dict[str, np.ndarray] = {}
    async with trio.open_nursery() as nursery:
        await nursery.start(stage.run)
        for name in lanes:
            await run_job(stage, name, 0, [1, 4093, 198], None)
        calls.clear()
        done = trio.Event()

        def deliver_to(name: str):  # type: ignore[no-untyped-def]
            async def deliver(result: StageResult) -> None:
                assert result.error is None and result.output is not None
                order.append(name)
                outputs[name] = result.output.hidden
                if len(order) == len(lanes):
                    done.set()

            return deliver

        for name, lane in lanes.items():
            item = BatchItem(SessionId(name), 3, tokens=np.array([19556], np.int32))
            await stage.submit(Job(item, SessionId(name), deliver_to(name), lane=lane))
        with trio.fail_after(30):
            await done.wait()
        nursery.cancel_scope.cancel()
    return order, outputs


async def test_a_chain_stage_runs_each_lane_s_steps_in_a_call_of_their_own(first_range) -> None:
    """Two lanes: the steps queued together run as one call per lane, the first queued
    step's lane first, and every step computes exactly what it computes in one shared call.
    A lane number past the stage's lanes folds onto them (3 is lane 1 of 2)."""
    lanes = {"a": 0, "b": 1, "c": 0, "d": 3}
    calls: list[int] = []
    stage = Stage(first_range, decode_lanes=2, on_batch=lambda n, ms: calls.append(n))
    order, laned = await _one_step_each(stage, lanes, calls)
    assert calls == [2, 2] and stage.stats.step_rounds_by_lane == [1, 1]
    assert order == ["a", "c", "b", "d"]
    for name in lanes:
        first_range.close_session(SessionId(name))
    one_call: list[int] = []
    _, shared = await _one_step_each(Stage(first_range, decode_lanes=1, on_batch=lambda n, ms: one_call.append(n)), lanes, one_call)
    assert one_call == [4]
    for name in lanes:
        assert np.array_equal(laned[name], shared[name])


async def test_a_stage_holding_the_whole_model_runs_every_lane_in_one_call(smollm2, slice_cache) -> None:
    """Nothing to overlap with: splitting its batch would only cost throughput."""
    with smollm2_engine(smollm2, slice_cache, context_length=128, max_sessions=4) as whole:
        calls: list[int] = []
        stage = Stage(whole, decode_lanes=2, on_batch=lambda n, ms: calls.append(n))
        assert stage.decode_lanes == 1
        await _one_step_each(stage, {"a": 0, "b": 1, "c": 0, "d": 1}, calls)
    assert calls == [4]


async def test_a_new_session_whose_first_job_fails_frees_no_slot_when_evicted(engine) -> None:
    """Sessions that never got a slot (their first job failed) are not evicted: only a
    session the engine holds frees one, or a newcomer would be let in past the slots."""
    stage = Stage(engine, admission_timeout_s=30)
    async with trio.open_nursery() as nursery:
        await nursery.start(stage.run)
        for i in range(6):  # a new session cannot start at position 5: each fails, none is held
            assert (await run_job(stage, f"bogus{i}", 5, [1], source="hoarder")).error is not None
        assert (await run_job(stage, "h1", 0, [1, 2, 3], source="hoarder")).error is None
        assert (await run_job(stage, "mine", 0, [1, 2, 3], source="entry")).error is None
        with trio.move_on_after(0.5) as waited:  # one each: nobody is evicted, the newcomer waits
            await run_job(stage, "later", 0, [1, 2, 3], source="other")
        assert waited.cancelled_caught and stage.stats.evicted == 0
        assert set(engine.sessions()) == {SessionId("h1"), SessionId("mine")}
        nursery.cancel_scope.cancel()


async def test_a_frame_that_cannot_open_a_session_evicts_nobody(engine) -> None:
    """A new session can only start at position 0. A frame for one that starts later (a stale
    frame of a closed session, or a peer's) fails whatever slot it is given: it took another
    source's session all the same, so a peer holding nothing evicted a lone busy entry's
    sessions with frames that cost it no compute and no slot, one per 10 s forever."""
    stage = Stage(engine, admission_timeout_s=30)
    async with trio.open_nursery() as nursery:
        await nursery.start(stage.run)
        for name in ("a1", "a2"):
            assert (await run_job(stage, name, 0, [1, 2, 3], source="busy")).error is None
        with trio.move_on_after(0.5):
            await run_job(stage, "bogus", 5, [1], source="other")
        with trio.move_on_after(0.5):  # more positions than a context holds
            await run_job(stage, "long", 0, [1] * (engine.config.context_length + 1), source="other")
        assert stage.stats.evicted == 0
        assert set(engine.sessions()) == {SessionId("a1"), SessionId("a2")}
        nursery.cancel_scope.cancel()


async def test_a_newcomer_that_evicted_gets_the_slot_it_freed(engine) -> None:
    """A newcomer evicted a session, then waited a round for room in the batch (a full one:
    16 slots prefilling fill the default 1024 tokens): the hoarder's own new session, queued
    ahead of it, took the freed slot the next round, and the hoarder, spared for 10 s after
    its loss, gave up no other. A hoarder keeping every slot busy so kept them all."""
    stage = Stage(engine, admission_timeout_s=30, max_batch_tokens=3)
    results: dict[str, StageResult] = {}

    def job(session: str, start: int, tokens: list[int], source: str) -> Job:
        async def deliver(result: StageResult) -> None:
            results[session] = result

        return Job(BatchItem(SessionId(session), start, tokens=np.array(tokens, np.int32)), SessionId(session), deliver,
                   GREEDY, source=source)  # fmt: skip

    async with trio.open_nursery() as nursery:
        await nursery.start(stage.run)
        for name in ("a1", "a2"):
            assert (await run_job(stage, name, 0, [1, 2, 3], source="hoarder")).error is None
        # One round: the hoarder's next session (waits: its own source), a step of a1 (in the
        # batch), a newcomer of another source (evicts a2, no room left in this batch).
        for queued in (job("a3", 0, [1, 2, 3], "hoarder"), job("a1", 3, [4], "hoarder"), job("new", 0, [1, 2, 3], "entry")):
            await stage.submit(queued)
        with trio.move_on_after(3):
            while "new" not in results:
                await trio.sleep(0.05)
        assert "new" in results and results["new"].error is None, (results, engine.sessions())
        assert SessionId("new") in engine.sessions()
        nursery.cancel_scope.cancel()


@pytest.fixture
def four_slots(smollm2, slice_cache) -> LlamaCppEngine:
    with smollm2_engine(smollm2, slice_cache, context_length=64, max_sessions=4) as e:
        yield e


async def test_a_previous_hop_loses_at_most_one_session_per_interval_to_another_hop(four_slots) -> None:
    """Previous hops share a stage by their totals (``node.slot_share``), each entry behind
    one a source of its own. A peer feeding the stage directly, opening and closing a session
    over and over, took a session from another entry behind an honest previous hop each time
    (each spared alone): every honest entry replayed in turn, not one per 10 s."""
    stage = Stage(four_slots, admission_timeout_s=30, evict_interval_s=3600)  # the whole test in one interval
    async with trio.open_nursery() as nursery:
        await nursery.start(stage.run)
        source_of = {f"e{i}": f"A>E{i}" for i in range(4)}  # an honest first stage's four entries
        for sid, source in source_of.items():
            assert (await run_job(stage, sid, 0, [1, 2, 3], source=source)).error is None
        for i in range(3):
            with trio.move_on_after(0.5):
                await run_job(stage, f"h{i}", 0, [1, 2, 3], source=f"H>r{i}")
            done = trio.Event()

            async def closed(_: StageResult, done: trio.Event = done) -> None:
                done.set()

            await stage.submit(Job(None, SessionId(f"h{i}"), closed))
            with trio.move_on_after(0.5):  # behind its session's job, if that still waits for a slot
                await done.wait()
            for sid in [sid for sid in source_of if SessionId(sid) not in four_slots.sessions()]:  # its replay
                source_of[f"{sid}.1"] = source_of.pop(sid)
                assert (await run_job(stage, f"{sid}.1", 0, [1, 2, 3], source=source_of[f"{sid}.1"])).error is None
        assert stage.stats.evicted == 1, stage.stats.evicted
        nursery.cancel_scope.cancel()


async def test_a_step_in_place_whose_bookkeeping_fails_answers_an_error_and_the_stage_goes_on(first_range) -> None:
    """A bug after the engine call (keeping the output for failover) fails that step with an
    error the entry sees at once, as the worker's path does, instead of escaping into the
    frame's reader and leaving the entry to wait out its deadline."""
    stage = Stage(first_range, inline_tokens=8, keep_outputs="f16")
    async with trio.open_nursery() as nursery:
        await nursery.start(stage.run)
        token = 1
        for pos in range(2):  # the first goes through the worker: then steps may run in place
            assert (await run_job(stage, "s", pos, [token])).error is None
        await trio.testing.wait_all_tasks_blocked()
        assert stage.kept is not None
        put, stage.kept.put = stage.kept.put, None  # type: ignore[assignment,method-assign]
        delivered: list[StageResult] = []

        async def deliver(result: StageResult) -> None:
            delivered.append(result)

        item = BatchItem(SessionId("s"), 2, tokens=np.array([token], np.int32))
        assert await stage.step_now(item, None, 0, deliver)
        assert len(delivered) == 1 and isinstance(delivered[0].error, DecodeFailed)
        stage.kept.put = put  # type: ignore[method-assign]
        await trio.testing.wait_all_tasks_blocked()
        assert (await run_job(stage, "s", 2, [token])).error is None
        nursery.cancel_scope.cancel()
