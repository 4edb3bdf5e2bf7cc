"""What the generation loop needs from whatever runs the layers: a pipeline.

The entry peer's generation loop (``api.generation``) drives a session through a pipeline
one step at a time and never learns whether the layers run in this process
(``node.local_pipeline``) or across the swarm (``p2p.chain``). Keeping this seam narrow is
what lets failover, batching and other engines attach without touching the loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from inclavate.types import SessionId
from node.sampling import SamplingParams


class Pipeline(Protocol):
    context_length: int
    """Most positions one session may hold on every stage."""

    async def step(
        self,
        session_id: SessionId,
        start_pos: int,
        tokens: Sequence[int],
        sampling: SamplingParams | None,
    ) -> int | None:
        """Run ``tokens`` at positions ``start_pos...`` through every layer.

        With ``sampling``, return the token drawn for position ``start_pos + len(tokens)``;
        without (a prefill chunk that is not the last), return None once every stage has
        taken the chunk. A ``start_pos`` below what a session holds rewinds it.
        """
        ...

    async def close_session(self, session_id: SessionId) -> None:
        """Free the session's KV cache on every stage; idempotent."""
        ...
