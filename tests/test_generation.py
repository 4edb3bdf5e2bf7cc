"""The text a generation hands the client when a character's bytes span several tokens.

SmolLM2's byte-level vocabulary spells 🌍 as three tokens (``f0 9f``, ``8c``, ``8d``), so a
cap can cut it. The loop runs with the real tokenizer over a pipeline that answers chosen
token ids; ``test_a_reply_cut_mid_character_ends_at_its_last_whole_one`` does the same
through the API with the real model."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import httpx
import pytest
from local_context import LocalContext, serve
from trio_websocket import WebSocketConnection, open_websocket_url

from api.generation import Generation, GenerationParams
from api.reasoning_split import Delta
from inclavate.types import SessionId
from node.sampling import SamplingParams
from node.tokenizer import Tokenizer

EARTH = [10813, 230, 231]  # 🌍: f0 9f | 8c | 8d
FIRE = [10813, 238, 115]  # 🔥: f0 9f | 94 | a5
LONE_CONTINUATION = 230  # 8c on its own: not UTF-8
A, B = 81, 82


class ScriptedPipeline:
    """Answers each sampling step with the next of ``tokens``."""

    context_length = 64

    def __init__(self, tokens: Sequence[int]) -> None:
        self._tokens = iter(tokens)

    async def step(self, session_id: SessionId, start_pos: int, tokens: Sequence[int], sampling: SamplingParams | None) -> int | None:
        return next(self._tokens) if sampling is not None else None

    async def close_session(self, session_id: SessionId) -> None:
        pass


@pytest.fixture(scope="module")
def tokenizer(smollm2) -> Iterator[Tokenizer]:
    t = Tokenizer(smollm2.path)
    yield t
    t.close()


async def reply(tokenizer: Tokenizer, answers: Sequence[int], max_tokens: int) -> tuple[str, str]:
    """Content and finish_reason of a generation whose model answers ``answers``."""
    params = GenerationParams(prompt=(A,), max_tokens=max_tokens, sampling=SamplingParams(temperature=0))
    deltas: list[Delta] = []

    async def emit(delta: Delta) -> None:
        deltas.append(delta)

    result = await Generation(ScriptedPipeline(answers), tokenizer, SessionId("s"), params).run(emit)
    return "".join(d.text for d in deltas), result.finish_reason


async def test_a_cap_inside_a_character_drops_its_first_bytes(tokenizer: Tokenizer) -> None:
    """The loop flushed its decoder with ``errors="replace"``: "🌍\\ufffd" at 5 tokens."""
    answers = EARTH + FIRE
    replies = [await reply(tokenizer, answers, n) for n in range(1, 7)]
    assert replies == [("", "length")] * 2 + [("🌍", "length")] * 3 + [("🌍🔥", "length")]


async def test_the_end_of_generation_inside_a_character_drops_its_first_bytes(tokenizer: Tokenizer) -> None:
    assert await reply(tokenizer, [*EARTH, *FIRE[:2], tokenizer.eos_id], 10) == ("🌍", "stop")


async def test_bytes_that_are_not_utf8_between_characters_are_still_replaced(tokenizer: Tokenizer) -> None:
    assert await reply(tokenizer, [A, LONE_CONTINUATION, B, *EARTH[:1], A], 5) == ("a\ufffdb\ufffda", "length")


@pytest.fixture
async def emoji_chat(smollm2, slice_cache) -> AsyncIterator[str]:
    ctx = LocalContext("smollm2:135m", smollm2.path, slice_cache, context_length=256)
    try:
        async with serve(ctx) as url:
            yield url
    finally:
        ctx.close()


@pytest.mark.slow
async def test_a_reply_cut_mid_character_ends_at_its_last_whole_one(emoji_chat: str) -> None:
    """With the real model: 🌍 at four tokens and nothing at two, plain, over SSE and over
    ``/ws/chat``, where the client used to read "🌍\\ufffd" and "\\ufffd" (the stream's last
    content delta was a lone U+FFFD)."""
    question = [{"role": "user", "content": "Reply only with emoji: 🌍🔥😀🎉"}]
    async with httpx.AsyncClient(timeout=120) as client:
        for max_tokens, expected in ((2, ""), (4, "🌍")):
            body = {"model": "smollm2:135m", "messages": question, "max_tokens": max_tokens, "temperature": 0}
            plain = (await client.post(emoji_chat + "/v1/chat/completions", json=body)).json()
            assert (plain["choices"][0]["message"]["content"], plain["choices"][0]["finish_reason"]) == (expected, "length")
            async with client.stream("POST", emoji_chat + "/v1/chat/completions", json={**body, "stream": True}) as streamed:
                events = [json.loads(line[6:]) async for line in streamed.aiter_lines() if line.startswith("data: {")]
            assert streamed_content(events) == expected, events
            async with open_websocket_url(emoji_chat.replace("http://", "ws://") + "/ws/chat") as ws:
                await ws.send_message(json.dumps(body))
                frames = [json.loads(m) async for m in frames_until_done(ws)]
            assert streamed_content(frames) == expected, frames


def streamed_content(chunks: list[dict[str, Any]]) -> str:
    """The text of a stream's content deltas, joined (the SSE and websocket chunks alike)."""
    return "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])


async def frames_until_done(ws: WebSocketConnection) -> AsyncIterator[str]:
    while (message := await ws.get_message()) != "[DONE]":
        yield message
