"""One chat turn run to the end without HTTP: what an understanding job addressed to a chat
model uses (``node/generators/chat_reader.py``). Same preparation and validation as
``/v1/chat/completions`` (:func:`api.chat_job.prepare_chat`), so a job can do nothing a
chat request could not.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from api.chat_job import Collected, prepare_chat
from api.context import PeerContext
from api.reasoning_split import Delta
from inclavate.errors import InclavateError
from node.generators.base import CancelCheck, GenerationCancelled
from node.generators.chat_reader import DEFAULT_MAX_TOKENS


async def complete_turn(ctx: PeerContext, model: str, message: str, params: Mapping[str, Any], cancelled: CancelCheck) -> str:
    """The answer's content (reasoning dropped); raises GenerationCancelled between tokens."""
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": message}],
        "max_tokens": params.get("max_tokens", DEFAULT_MAX_TOKENS),
        "temperature": 0.0,
    }
    if params.get("thinking") is not None:
        body["thinking"] = params["thinking"]
    job = await prepare_chat(ctx, json.dumps(body))
    collected = Collected()

    async def emit(delta: Delta) -> None:
        if cancelled():
            raise GenerationCancelled()
        await collected.add(delta)

    await job.generation.run(emit)
    return "".join(collected.content)


async def prompt_byte_limit(ctx: PeerContext, model: str) -> int | None:
    """Bytes of text past which ``model``'s chain cannot hold a turn whatever it tokenizes to
    (the bound a chat request's prompt is refused on, :meth:`ChatModel.max_prompt_bytes`), so
    that a job refuses its inputs before decoding and joining them. None when unknown (no
    route yet, say): :func:`complete_turn` then says why."""
    try:
        chat = await ctx.chat_model(model)
        return chat.max_prompt_bytes(ctx.pipeline(model).context_length)
    except InclavateError:
        return None
