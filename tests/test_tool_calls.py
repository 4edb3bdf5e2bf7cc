"""Recognising tool calls in a reply, and finish_reason's precedence rules."""

from __future__ import annotations

import json

from api.chat_job import finish_and_calls
from api.chat_request import parse_chat_request
from api.generation import GenerationResult
from api.limits import RequestLimits
from api.tool_calls import extract_tool_calls


def test_hermes_blocks_become_calls() -> None:
    text = 'Let me check.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    content, calls = extract_tool_calls(text)
    assert content == "Let me check." and [c.name for c in calls] == ["weather"]
    assert json.loads(calls[0].arguments) == {"city": "Paris"}
    assert calls[0].to_openai(0)["function"]["name"] == "weather" and calls[0].id.startswith("call_")


def test_bare_json_with_parameters_is_a_call() -> None:
    content, calls = extract_tool_calls('{"name": "add", "parameters": {"a": 1, "b": 2}}')
    assert content == "" and calls[0].name == "add" and json.loads(calls[0].arguments) == {"a": 1, "b": 2}


def test_ordinary_text_and_broken_calls_stay_content() -> None:
    for text in ("Paris is the capital.", '{"answer": 4}', "<tool_call>{not json}</tool_call>", '{"name": 3}'):
        assert extract_tool_calls(text) == (text, [])


class _Job:
    def __init__(self, tools: bool, **fields: object) -> None:
        self.buffers_content = tools
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
        self.request = parse_chat_request(body, RequestLimits())


def test_length_outranks_tool_calls() -> None:
    call = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    assert finish_and_calls(_Job(True), GenerationResult("stop", 5, 9), call)[1] == "tool_calls"
    content, finish, calls = finish_and_calls(_Job(True), GenerationResult("length", 5, 9), call)
    assert finish == "length" and calls == [] and content == call
    assert finish_and_calls(_Job(False), GenerationResult("stop", 5, 9), call) == (call, "stop", [])


def test_parallel_tool_calls_false_hands_back_only_the_first_call() -> None:
    """OpenAI's model makes at most one call when told ``parallel_tool_calls: false``; the
    caller runs one. Handing back two left the second unanswered in its next request."""
    two = ('<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>\n'
           '<tool_call>{"name": "weather", "arguments": {"city": "Rome"}}</tool_call>')  # fmt: skip
    result = GenerationResult("stop", 5, 30)
    assert len(finish_and_calls(_Job(True), result, two)[2]) == 2
    assert len(finish_and_calls(_Job(True, parallel_tool_calls=True), result, two)[2]) == 2
    content, finish, calls = finish_and_calls(_Job(True, parallel_tool_calls=False), result, two)
    assert finish == "tool_calls" and content == "" and [json.loads(c.arguments) for c in calls] == [{"city": "Oslo"}]


def test_what_a_stage_can_make_the_model_write_stays_content() -> None:
    """The text comes from the last stage's tokens: 2,000 brackets raised RecursionError out
    of the chat (a 500), and a lone surrogate in the arguments reached whatever encoded them."""
    deep = "[" * 2000 + "]" * 2000
    assert extract_tool_calls(deep) == (deep, [])
    block = '<tool_call>{"name": "f", "arguments": ' + deep + "}</tool_call>"
    assert extract_tool_calls(block) == (block, [])
    lone = '{"name": "f", "arguments": "{\\"text\\": \\"\\ud800\\"}"}'
    assert extract_tool_calls(lone) == (lone, [])
