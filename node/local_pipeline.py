"""A pipeline of engines in this process: the reference the swarm is measured against,
and what ``inclavate generate`` runs without any network."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import trio

from inclavate import tensors
from inclavate.types import SessionId
from node.engine import BatchItem, LayerEngine
from node.sampling import SamplingParams, sample


class LocalPipeline:
    def __init__(self, engines: Sequence[LayerEngine], wire_dtype: tensors.WireDType = "f32") -> None:
        if not engines or not engines[0].info.is_first or not engines[-1].info.is_last:
            raise ValueError("a pipeline needs engines covering the first through the last layer")
        for a, b in zip(engines, engines[1:]):
            if a.info.layers.end != b.info.layers.start:
                raise ValueError(f"engines {a.info.layers} and {b.info.layers} do not meet")
        self.engines = list(engines)
        self.wire_dtype = wire_dtype
        self.context_length = min(e.context_length for e in self.engines)
        self._lock = trio.Lock()  # engines are not thread-safe; one step at a time

    async def step(
        self,
        session_id: SessionId,
        start_pos: int,
        tokens: Sequence[int],
        sampling: SamplingParams | None,
    ) -> int | None:
        async with self._lock:
            return await trio.to_thread.run_sync(self._step, session_id, start_pos, list(tokens), sampling)

    def _step(
        self, session_id: SessionId, start_pos: int, tokens: list[int], sampling: SamplingParams | None
    ) -> int | None:
        item = BatchItem(session_id, start_pos, tokens=np.array(tokens, np.int32))
        for engine in self.engines:
            (out,) = engine.forward([item])
            if out.logits is not None:
                if sampling is None:
                    return None
                return sample(out.logits, sampling, start_pos + len(tokens))
            # Same precision loss as a real hop, so local and swarm runs compare fairly.
            hidden = tensors.decode(tensors.encode(out.hidden, self.wire_dtype))
            item = BatchItem(session_id, start_pos, hidden=hidden)
        raise AssertionError("the last engine produced no logits")

    async def close_session(self, session_id: SessionId) -> None:
        async with self._lock:
            for engine in self.engines:
                engine.close_session(session_id)


def greedy_run(
    engines: Sequence[LayerEngine], prompt: Sequence[int], n: int, stop: Callable[[int], bool] = lambda _: False
) -> tuple[list[int], list[np.ndarray]]:
    """Greedy tokens and each step's logits through ``engines`` in order, hidden states passed
    at full precision, ending after ``n`` tokens or the first ``stop`` token.

    The plain reference that split-equals-whole checks and engine comparisons share: no wire
    rounding, no sampling, the session freed however it ends."""
    sid, tokens, pos = SessionId("greedy-run"), np.array(prompt, np.int32), 0
    out: list[int] = []
    logits: list[np.ndarray] = []
    try:
        for _ in range(n):
            item = BatchItem(sid, pos, tokens=tokens)
            for engine in engines:
                (result,) = engine.forward([item])
                if result.logits is not None:
                    break
                item = BatchItem(sid, pos, hidden=result.hidden)
            else:
                raise ValueError("the last engine produced no logits")
            pos += len(tokens)
            logits.append(result.logits)
            out.append(int(np.argmax(result.logits)))
            if stop(out[-1]):
                break
            tokens = np.array([out[-1]], np.int32)
    finally:
        for engine in engines:
            engine.close_session(sid)
    return out, logits
