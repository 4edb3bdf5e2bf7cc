"""Generation from a chat turn (api/generation_tools.py): which generators are offered as
tools, and how a reply's calls become jobs, against a real job runner and Piper."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trio
from generation_harness import serve_generations

from api.chat_job import settle
from api.chat_request import parse_chat_request
from api.generation import GenerationResult
from api.generation_tools import MAX_PER_REPLY, offered_tools, start_generations
from api.limits import RequestLimits
from api.tool_calls import ParsedToolCall

CAPS = [
    {"modality": "audio", "model": "piper:joe", "builtin_voices": ["joe"], "requires_speaker": False},
    {"modality": "audio", "model": "other:tts", "voices": ["warm"], "requires_speaker": True},
    {"modality": "text", "kind": "understand", "model": "whisper:tiny.en", "ready": True, "input_modalities": ["audio"]},
]
TOOL = "generate_speech_piper_joe"


def request(**fields: object):  # type: ignore[no-untyped-def]
    body = {"model": "smollm2:135m", "messages": [{"role": "user", "content": "say hi"}], **fields}
    return parse_chat_request(body, RequestLimits())


def test_tools_are_opt_in_with_tool_choice() -> None:
    assert offered_tools(CAPS, request()) == ()
    assert offered_tools(CAPS, request(tool_choice="none")) == ()
    for choice in ("auto", "required", {"type": "function", "function": {"name": TOOL}}):
        names = [t.name for t in offered_tools(CAPS, request(tool_choice=choice))]
        assert names == [TOOL, "generate_speech_other_tts"]  # speech only, not understanding


def test_generation_model_and_voice_restrict_and_never_fall_back() -> None:
    only = offered_tools(CAPS, request(tool_choice="auto", generation_model="piper:joe"))
    assert [t.model for t in only] == ["piper:joe"]
    assert offered_tools(CAPS, request(tool_choice="auto", generation_model="missing:tts")) == ()
    warm = offered_tools(CAPS, request(tool_choice="auto", generation_voice="warm"))
    assert [(t.model, t.voices) for t in warm] == [("other:tts", ("warm",))]
    assert offered_tools(CAPS, request(tool_choice="auto", generation_voice="nobody")) == ()
    schema = only[0].to_openai()["function"]["parameters"]
    assert schema["required"] == ["text"] and schema["properties"]["voice"]["enum"] == ["joe"]


def call(name: str, args: object) -> ParsedToolCall:
    return ParsedToolCall(name, json.dumps(args), f"call_{name}_{json.dumps(args)[:8]}")


@pytest.mark.slow
async def test_a_reply_starts_at_most_four_jobs_and_hands_the_rest_back(tmp_path: Path, speech_generators: dict) -> None:
    req = request(tool_choice="auto", generation_max_duration_seconds=2.0)
    tools = offered_tools(CAPS[:1], req)
    calls = [call(TOOL, {"text": f"Clip {n}."}) for n in range(MAX_PER_REPLY + 1)]
    calls += [call(TOOL, {"nope": 1}), call("weather", {"city": "Paris"})]
    async with serve_generations(tmp_path, speech_generators) as served:
        remaining, generated = await start_generations(served.service, tools, calls, req)
        assert len(generated) == MAX_PER_REPLY
        assert [g["tool_call_id"] for g in generated] == [c.id for c in calls[:MAX_PER_REPLY]]
        assert [c.name for c in remaining] == [TOOL, TOOL, "weather"]  # the fifth, the bad one, the user's own
        for ref in generated:
            job = served.jobs.get(ref["id"])
            assert job is not None and job.model == "piper:joe" and ref["state"] == "queued"
            assert job.params["max_duration_seconds"] == pytest.approx(2.0 / MAX_PER_REPLY)  # the reply's ceiling, split
        with trio.fail_after(120):
            while any(not served.jobs.get(g["id"]).finished for g in generated):
                await trio.sleep(0.1)
        assert all(served.jobs.get(g["id"]).state == "completed" for g in generated)


class _Ctx:
    def __init__(self, service: object) -> None:
        self.generations = service


class _Job:
    buffers_content = True

    def __init__(self, tools: tuple) -> None:
        self.generation_tools = tools
        self.request = request(tool_choice="auto")


@pytest.mark.slow
async def test_settle_reports_generated_jobs_and_finishes_with_stop(tmp_path: Path, speech_generators: dict) -> None:
    reply = f'<tool_call>{{"name": "{TOOL}", "arguments": {{"text": "Hi there."}}}}</tool_call>'
    async with serve_generations(tmp_path, speech_generators) as served:
        job = _Job(offered_tools(CAPS[:1], request(tool_choice="auto")))
        outcome = await settle(_Ctx(served.service), job, GenerationResult("stop", 5, 9), reply)  # type: ignore[arg-type]
        assert outcome.calls == [] and outcome.finish_reason == "stop" and len(outcome.generated) == 1
        mixed = reply + '<tool_call>{"name": "weather", "arguments": {}}</tool_call>'
        outcome = await settle(_Ctx(served.service), job, GenerationResult("stop", 5, 9), mixed)  # type: ignore[arg-type]
        assert [c.name for c in outcome.calls] == ["weather"] and outcome.finish_reason == "tool_calls"
        assert len(outcome.generated) == 1
