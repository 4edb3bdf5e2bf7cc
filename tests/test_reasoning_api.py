"""Reasoning controls end to end, on random-weight models whose chat templates use each
mechanism: native (the template reads reasoning_effort) and token budget (the template
opens <think> and offers no control)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import trio
from gguf_factory import write_random_gguf
from local_context import LocalContext, serve
from templates import load

pytestmark = pytest.mark.slow
QUESTION = [{"role": "user", "content": "What is 2 + 2?"}]


@asynccontextmanager
async def _served(model_id: str, template: str, seed: int, smollm2, tmp_path: Path) -> AsyncIterator[str]:
    """A random-weight model with ``template`` as its chat template, served in-process."""
    path = write_random_gguf(tmp_path / f"{seed}.gguf", "llama", tokenizer_from=smollm2.path, chat_template=load(template), seed=seed)
    ctx = LocalContext(model_id, path, tmp_path / "slices")
    try:
        async with serve(ctx) as url:
            yield url
    finally:
        ctx.close()


@pytest.fixture
async def native(smollm2, tmp_path: Path) -> AsyncIterator[str]:
    async with _served("reason:native", "native_effort", 3, smollm2, tmp_path) as url:
        yield url


@pytest.fixture
async def budget(smollm2, tmp_path: Path) -> AsyncIterator[str]:
    async with _served("reason:budget", "budget_r1", 4, smollm2, tmp_path) as url:
        yield url


async def post(url: str, path: str = "/v1/chat/completions", **body) -> httpx.Response:
    def call() -> httpx.Response:
        return httpx.post(url + path, json=body, timeout=120)

    return await trio.to_thread.run_sync(call)


async def get(url: str, path: str) -> httpx.Response:
    return await trio.to_thread.run_sync(lambda: httpx.get(url + path, timeout=60))


async def test_native_levels_are_listed_passed_to_the_template_and_checked(native: str) -> None:
    (model,) = (await get(native, "/api/models")).json()
    assert model["reasoning_effort_levels"] == ["low", "medium", "high"]
    prompts = {}
    for level in ("low", "high", "none"):
        reply = await post(native, model="reason:native", messages=QUESTION, reasoning_effort=level, max_tokens=4, temperature=0)
        assert reply.status_code == 200, reply.text
        prompts[level] = reply.json()["usage"]["prompt_tokens"]
    omitted = await post(native, model="reason:native", messages=QUESTION, max_tokens=4, temperature=0)
    # Each level renders its own instruction; "none" never reaches the template, so it
    # renders like an omitted field plus the thinking-off switch.
    assert prompts["low"] != prompts["high"] and prompts["none"] != prompts["low"]
    assert omitted.json()["usage"]["prompt_tokens"] < prompts["low"]
    refused = await post(native, model="reason:native", messages=QUESTION, reasoning_effort="max")
    assert refused.status_code == 400
    assert all(level in refused.json()["error"] for level in ("'none'", "'low'", "'medium'", "'high'"))


async def test_budget_levels_cap_reasoning_and_force_the_close_tag(budget: str) -> None:
    (model,) = (await get(budget, "/api/models")).json()
    assert model["reasoning_effort_levels"] == ["low", "medium", "high", "max"]

    # low = 512 reasoning tokens, then </think> is forced and the answer follows.
    reply = (await post(budget, model="reason:budget", messages=QUESTION, reasoning_effort="low", max_tokens=560, temperature=0)).json()
    message = reply["choices"][0]["message"]
    assert message["reasoning_content"] and "</think>" not in message["reasoning_content"]
    assert reply["usage"]["completion_tokens"] <= 560
    assert message["content"] or reply["choices"][0]["finish_reason"] == "stop"

    # A budget larger than max_tokens: the reasoning is cut, content empty, finish "length".
    cut = (await post(budget, model="reason:budget", messages=QUESTION, reasoning_effort="medium", max_tokens=40, temperature=0)).json()
    assert cut["choices"][0]["finish_reason"] == "length"
    assert cut["choices"][0]["message"]["content"] == "" and cut["choices"][0]["message"]["reasoning_content"]

    # Thinking off on a model with no switch: the span is closed at once.
    off = (await post(budget, model="reason:budget", messages=QUESTION, thinking=False, max_tokens=20, temperature=0)).json()
    assert "reasoning_content" not in off["choices"][0]["message"]
    assert off["choices"][0]["message"]["content"]


async def test_streamed_reasoning_arrives_as_reasoning_content_deltas(budget: str) -> None:
    def call() -> list[dict]:
        import json

        body = {"model": "reason:budget", "messages": QUESTION, "reasoning_effort": "low", "max_tokens": 530, "stream": True, "temperature": 0}
        with httpx.stream("POST", budget + "/v1/chat/completions", json=body, timeout=120) as r:
            return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]

    chunks = await trio.to_thread.run_sync(call)
    deltas = [c["choices"][0]["delta"] for c in chunks if c.get("choices")]
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    assert reasoning and "</think>" not in reasoning + content
    first_content = next((i for i, d in enumerate(deltas) if d.get("content")), len(deltas))
    assert all("reasoning_content" not in d for d in deltas[first_content:]), "reasoning after the answer began"


async def test_a_prompt_longer_than_the_context_is_a_400(native: str) -> None:
    reply = await post(native, model="reason:native", messages=[{"role": "user", "content": "word " * 3000}])
    assert reply.status_code == 400 and "context" in reply.json()["error"]
