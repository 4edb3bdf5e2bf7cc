"""Whether a piece of async code ended its task's turn: what the no-turn fast paths promise."""

from __future__ import annotations

import trio


async def gives_a_turn(action) -> bool:  # type: ignore[no-untyped-def]
    """Whether the task ended its turn (went back to the scheduler) while ``action`` ran."""
    me = trio.lowlevel.current_task()
    steps: list[object] = []

    class Steps(trio.abc.Instrument):
        def before_task_step(self, task: trio.lowlevel.Task) -> None:
            if task is me:
                steps.append(task)

    instrument = Steps()
    trio.lowlevel.add_instrument(instrument)
    try:
        await action()
    finally:
        trio.lowlevel.remove_instrument(instrument)
    return bool(steps)
