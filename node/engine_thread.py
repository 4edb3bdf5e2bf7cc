"""The one OS thread that calls into an engine.

llama.cpp built with OpenMP gives every OS thread that starts a parallel region its own team
of worker threads. Calls made from trio's worker-thread cache (and the event loop) land on
several OS threads over time, so a peer at 2 threads held several teams: libgomp then counts
more managed threads than cores and cuts every barrier's spin to 100 iterations, and each of
the few hundred barriers of a decode step became a futex sleep and wake-up. One peer ran at
0.69x llama.cpp's decode speed at 2 threads and its 8 batched sessions at 0.70x; with every
call on one thread, 1.03x and 0.90x (``scripts/bench_peer``, docs/ARCHITECTURE.md). The
engine is also never touched by two threads at once, whatever its caller does.

A call waits uncancellably for its result, like ``trio.to_thread.run_sync`` without
``abandon_on_cancel``: an engine call cannot be interrupted halfway, and a caller that was
cancelled meanwhile sees the cancellation at its next checkpoint.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import outcome
import trio

T = TypeVar("T")

_STOP = object()


class EngineThread:
    """A single worker thread; ``await run(fn, *args)`` runs ``fn`` there, in call order."""

    def __init__(self, name: str = "engine") -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._closed = False
        self._thread.start()

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        if self._closed:
            raise RuntimeError("the engine thread is closed")
        token = trio.lowlevel.current_trio_token()
        task = trio.lowlevel.current_task()

        def deliver(result: outcome.Outcome[T]) -> None:
            token.run_sync_soon(trio.lowlevel.reschedule, task, result)

        self._jobs.put((fn, args, deliver))
        return await trio.lowlevel.wait_task_rescheduled(lambda _: trio.lowlevel.Abort.FAILED)

    def close(self) -> None:
        """Stop after the calls already queued; does not wait (see :meth:`join`)."""
        if not self._closed:
            self._closed = True
            self._jobs.put(_STOP)

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            fn, args, deliver = job
            try:
                deliver(outcome.capture(fn, *args))
            except trio.RunFinishedError:
                pass  # the caller's trio run ended while this call ran: nobody to tell
