"""Calls into an engine run on one OS thread: llama.cpp's OpenMP keeps a team of threads
per calling thread, and several teams throttle every barrier (node.engine_thread), unless
the thread-wait policy makes a second team cost nothing (node.teams_spin_alike)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import trio
import trio.testing

from inclavate.types import LayerRange, ModelId, SessionId
from node.engine import BatchItem, EngineConfig
from node.engine_thread import EngineThread
from node.llamacpp_engine import LlamaCppEngine
from node.stage import Job, Stage, StageResult


async def test_calls_run_in_order_on_one_thread_and_errors_come_back() -> None:
    thread = EngineThread("test")
    try:
        idents = [await thread.run(threading.get_ident) for _ in range(5)]
        assert len(set(idents)) == 1 and idents[0] != threading.get_ident()
        order: list[int] = []
        async with trio.open_nursery() as nursery:
            for i in range(20):
                nursery.start_soon(thread.run, order.append, i)
                await trio.sleep(0)
        assert order == list(range(20))
        with pytest.raises(ZeroDivisionError):
            await thread.run(lambda: 1 / 0)
        assert await thread.run(sum, [1, 2]) == 3  # the thread survives a failed call
    finally:
        thread.close()
        thread.join(5)
    assert not thread._thread.is_alive()
    with pytest.raises(RuntimeError):
        await thread.run(int)


async def test_a_cancelled_caller_waits_for_its_call_to_finish() -> None:
    thread = EngineThread("test")
    finished = threading.Event()

    def slow() -> None:
        threading.Event().wait(0.3)
        finished.set()

    try:
        with trio.move_on_after(0.05) as scope:
            await thread.run(slow)
            assert finished.is_set()  # not abandoned halfway: the engine is in a known state
            await trio.lowlevel.checkpoint()  # where the cancellation lands
        assert scope.cancelled_caught
    finally:
        thread.close()
        thread.join(5)


class _ThreadRecordingEngine(LlamaCppEngine):
    """The real engine, noting which OS thread each call came from; ``any_thread`` stands
    for what the process's thread-wait policy allows (``node.teams_spin_alike``)."""

    calls: list[tuple[str, int]]
    any_thread: bool

    @property
    def callable_from_any_thread(self) -> bool:
        return self.any_thread

    def forward(self, items):
        kind = "step" if all(item.n_tokens == 1 for item in items) else "prefill"
        self.calls.append((kind, threading.get_ident()))
        return super().forward(items)

    def close_session(self, session_id):
        self.calls.append(("close", threading.get_ident()))
        return super().close_session(session_id)


@pytest.mark.parametrize(("any_thread", "inline_max_s", "steps_on"), [
    (False, 0.1, ["engine", "engine", "engine"]),  # a policy under which a second OpenMP team costs
    (True, 0.1, ["engine", "loop", "loop"]),  # the first step tells the stage how long one takes
    (True, 0.0, ["engine", "engine", "engine"]),  # steps slower than inline_max_s
])  # fmt: skip
async def test_a_stage_at_two_threads_runs_steps_on_the_event_loop_only_where_that_costs_nothing(
        smollm2, slice_cache, any_thread: bool, inline_max_s: float, steps_on: list[str]) -> None:  # fmt: skip
    """Under a wait policy where a second OpenMP team costs nothing, a decode step runs on the
    event loop's thread (two hand-offs fewer), as long as steps are quick (an inline call
    blocks the event loop); otherwise everything runs on the engine thread. Prefill and close
    always go to the engine thread: the event loop must not stop for them."""
    with _ThreadRecordingEngine(model_id=ModelId("smollm2:135m"), model_path=smollm2.path, layers=LayerRange(0, 30),
                                config=EngineConfig(n_threads=2, context_length=256, max_sessions=2),
                                slice_cache=slice_cache) as engine:  # fmt: skip
        engine.calls, engine.any_thread = [], any_thread
        stage = Stage(engine, inline_tokens=8, inline_max_s=inline_max_s)
        async with trio.open_nursery() as nursery:
            await nursery.start(stage.run)
            results: list[StageResult] = []

            async def deliver(result: StageResult) -> None:
                results.append(result)

            sid = SessionId("s")
            for start, tokens in ((0, list(range(1, 120))), (119, [5]), (120, [6]), (121, [7])):
                await stage.submit(Job(BatchItem(sid, start, tokens=np.array(tokens, np.int32)), sid, deliver))
                await trio.testing.wait_all_tasks_blocked()  # one at a time: each step alone
            await stage.submit(Job(None, sid, deliver))
            while len(results) < 5:
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
        await stage.close_engine()
        assert all(r.error is None for r in results)
        names = {stage.engine_thread._thread.ident: "engine", threading.get_ident(): "loop"}
        assert [(kind, names[ident]) for kind, ident in engine.calls] == [
            ("prefill", "engine"), *(("step", where) for where in steps_on), ("close", "engine")]
