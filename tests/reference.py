"""The reference every distributed answer is held to: the same chat template and greedy loop
on the whole model in one llama.cpp context, in this process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio

from api.chat_model import ChatModel
from api.generation import Generation
from api.reasoning_split import Delta
from inclavate.types import LayerRange, ModelId, SessionId
from node.engine import EngineConfig
from node.llamacpp_engine import LlamaCppEngine
from node.local_pipeline import LocalPipeline


def whole_model_text(model: Any, cache: Path, messages: list[dict[str, str]], max_tokens: int,
                     context_length: int = 512) -> str:  # fmt: skip
    engine = LlamaCppEngine(model_id=ModelId(model.spec.model_id), model_path=model.path, layers=LayerRange(0, model.spec.n_layers),
                            config=EngineConfig(n_threads=1, context_length=context_length, max_sessions=1), slice_cache=cache)  # fmt: skip
    chat = ChatModel.load(ModelId(model.spec.model_id), model.path)
    try:
        prompt = chat.prepare(messages)
        params = chat.generation_params(prompt, max_tokens=max_tokens, temperature=0.0, top_p=1.0, seed=0)
        parts: list[str] = []

        async def collect(delta: Delta) -> None:
            parts.append(delta.text)

        trio.run(Generation(LocalPipeline([engine]), chat.tokenizer, SessionId("ref"), params).run, collect)
        return "".join(parts)
    finally:
        chat.close()
        engine.close()
