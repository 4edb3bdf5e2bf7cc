"""A pipeline of engines in this process: the reference the swarm is measured against,
and what ``inclavate generate`` runs without any network."""

from __future__ import annotations

from collections.abc import Sequence

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
