"""Chat request parsing (scalar fields, messages, tools) and the API's error mapping."""

from __future__ import annotations

from typing import Any

import pytest

from api.chat_request import (
    ChatMessage,
    ChatRequest,
    Role,
    Tool,
    ToolCall,
    ToolChoice,
    parse_chat_request,
)
from api.errors import (
    ApiError,
    BadRequest,
    Conflict,
    Forbidden,
    MediaCode,
    MediaError,
    NotFound,
    PayloadTooLarge,
    ServiceUnavailable,
    UnknownModel,
    error_response_parts,
    register,
)
from api.limits import MIB, RequestLimits
from inclavate.errors import ConfigError, InclavateError, ModelNotFound

LIMITS = RequestLimits()
USER = {"role": "user", "content": "What is 2 + 2?"}


def body(**fields: Any) -> dict[str, Any]:
    return {"model": "llama3.2:1b", "messages": [USER], **fields}


def parse(**fields: Any) -> ChatRequest:
    return parse_chat_request(body(**fields), LIMITS)


def bad(payload: Any) -> str:
    with pytest.raises(BadRequest) as info:
        parse_chat_request(payload, LIMITS)
    assert info.value.status == 400
    return info.value.message


# --- valid requests -------------------------------------------------------------------


def test_minimal_request_gets_the_spec_defaults() -> None:
    request = parse_chat_request({"model": "m", "messages": [USER]}, LIMITS)
    assert request == ChatRequest(model="m", messages=(ChatMessage(Role.USER, "What is 2 + 2?"),))
    assert (request.max_tokens, request.temperature, request.top_p) == (512, 0.8, 0.95)
    assert (request.stream, request.stop, request.thinking, request.reasoning_effort) == (
        False,
        (),
        None,
        None,
    )
    assert request.modalities() == {"text"}


def test_spec_example_with_every_scalar_field() -> None:
    request = parse(
        max_tokens=200,
        temperature=0,
        top_p=1,
        stream=True,
        stream_options={"include_usage": True},
        stop=["\n\n", "END"],
        thinking=False,
        reasoning_effort="high",
        seed=42,
        n=1,
        generation_model="qwen3-tts",
        generation_voice="alice",
        generation_max_duration_seconds=30,
    )
    assert (request.max_tokens, request.temperature, request.top_p) == (200, 0.0, 1.0)
    assert isinstance(request.temperature, float)
    assert (request.stream, request.include_usage, request.stop) == (True, True, ("\n\n", "END"))
    assert (request.thinking, request.reasoning_effort, request.seed) == (False, "high", 42)
    assert (request.generation_model, request.generation_voice) == ("qwen3-tts", "alice")
    assert request.generation_max_duration_seconds == 30.0


def test_openai_sdk_leniency() -> None:
    # Unknown fields, nulls for defaults, the newer max_tokens spelling, a single stop string.
    request = parse(
        max_tokens=None,
        max_completion_tokens=64,
        temperature=None,
        stop="###",
        logprobs=False,
        frequency_penalty=0,
        user="u-1",
        n=None,
        stream_options=None,
        response_format={"type": "text"},
        top_logprobs=None,
        presence_penalty=0.0,
        logit_bias={},
        functions=None,
        function_call="auto",
        modalities=["text"],
        audio=None,
        parallel_tool_calls=True,
        metadata={"k": "v"},
        store=False,
        service_tier="auto",
        prediction={"type": "content", "content": "4"},  # a latency hint: the reply is the same
    )
    assert (request.max_tokens, request.temperature, request.stop) == (64, 0.8, ("###",))
    assert parse(max_tokens=7, max_completion_tokens=7).max_tokens == 7
    assert parse(reasoning_effort="none").reasoning_effort == "none"  # value judged later


def test_roles_and_message_fields() -> None:
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Weather?", "name": "ann"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"c":"Oslo"}'},
                },
                {"id": "c2", "function": {"name": "time", "arguments": {"tz": "CET"}}},
            ],
        },
        {"role": "tool", "content": "rain", "tool_call_id": "c1"},
        {"role": "system", "content": [{"type": "text", "text": "again"}]},
    ]
    request = parse_chat_request({"model": "m", "messages": messages}, LIMITS)
    dev, user, assistant, tool, system = request.messages
    assert dev.role is Role.SYSTEM  # developer is OpenAI's newer name for system
    assert user.name == "ann"
    assert assistant.content == ""
    assert assistant.tool_calls == (
        ToolCall("c1", "weather", '{"c":"Oslo"}'),
        ToolCall("c2", "time", '{"tz":"CET"}'),
    )
    assert (tool.role, tool.tool_call_id) == (Role.TOOL, "c1")
    assert system.content[0].text == "again"  # type: ignore[union-attr]


def test_tools_and_tool_choice() -> None:
    weather = {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "Forecast",
            "parameters": {"type": "object"},
        },
    }
    request = parse(
        tools=[weather, {"type": "function", "function": {"name": "now"}}], tool_choice="auto"
    )
    assert request.tools == (Tool("weather", "Forecast", {"type": "object"}), Tool("now"))
    assert request.tools[0].to_openai() == weather
    assert request.tool_choice == ToolChoice("auto")
    named = parse(tool_choice={"type": "function", "function": {"name": "speak"}})
    assert named.tool_choice == ToolChoice("function", "speak")


# --- malformed requests ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"model": ""}, "model"),
        ({"model": 3}, "model"),
        ({"model": None}, "model"),
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": ["hi"]}, "messages[0]"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "function", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": "x", "name": 1}]}, "messages[0].name"),
        (
            {"messages": [{"role": "tool", "content": "x", "tool_call_id": 1}]},
            "messages[0].tool_call_id",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
            "messages[0].content[0].text",
        ),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": "100"}, "max_tokens"),
        ({"max_completion_tokens": -3}, "max_completion_tokens"),
        ({"max_tokens": 5, "max_completion_tokens": 6}, "disagree"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": 2.01}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": False}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.0001}, "top_p"),
        ({"stream": "yes"}, "stream"),
        ({"stream": 1}, "stream"),
        ({"stream_options": "on"}, "stream_options"),
        ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": 5}, "stop"),
        ({"stop": ["ok", 5]}, "stop[1]"),
        ({"stop": [""]}, "stop[0]"),
        ({"reasoning_effort": 3}, "reasoning_effort"),
        ({"thinking": "on"}, "thinking"),
        ({"seed": 1.5}, "seed"),
        ({"n": 2}, "n must be 1"),
        ({"n": True}, "n must be 1"),
        ({"tools": {}}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name"),
        (
            {"tools": [{"function": {"name": "f", "parameters": []}}]},
            "tools[0].function.parameters",
        ),
        ({"tool_choice": "always"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {}}}, "tool_choice.function.name"),
        ({"generation_max_duration_seconds": 0}, "generation_max_duration_seconds"),
        ({"generation_voice": 2}, "generation_voice"),
        # Asked for, these would be silently ignored: the reply would not be what was asked.
        ({"response_format": {"type": "json_object"}}, "response_format 'json_object' is not supported"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}, "'json_schema'"),
        ({"response_format": "json"}, "response_format must be an object"),
        ({"logprobs": True}, "logprobs are not supported"),
        ({"top_logprobs": 3}, "logprobs are not supported"),
        # Sampling has temperature, top_p and seed only: these would change the reply.
        ({"presence_penalty": 1.5}, "presence_penalty is not supported"),
        ({"frequency_penalty": -0.5}, "frequency_penalty is not supported"),
        ({"frequency_penalty": "high"}, "frequency_penalty is not supported"),
        ({"logit_bias": {"42": -100}}, "logit_bias is not supported"),
        ({"functions": [{"name": "f", "parameters": {"type": "object"}}]}, "send tools and tool_choice"),
        ({"function_call": {"name": "f"}}, "send tools and tool_choice"),
        ({"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}}, "only text output"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "only text output"),
        ({"web_search_options": {}}, "web_search_options is not supported"),
        ({"parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ],
)
def test_malformed_field_names_the_field(fields: dict[str, Any], fragment: str) -> None:
    assert fragment in bad(body(**fields))


def test_assistant_tool_calls_are_checked() -> None:
    def with_calls(calls: Any) -> dict[str, Any]:
        return body(messages=[USER, {"role": "assistant", "content": None, "tool_calls": calls}])

    assert "messages[1].tool_calls" in bad(with_calls({}))
    assert "messages[1].tool_calls[0].function" in bad(with_calls([{"id": "x"}]))
    message = bad(with_calls([{"id": "x", "function": {"name": "f", "arguments": 3}}]))
    assert "messages[1].tool_calls[0].function.arguments" in message


@pytest.mark.parametrize("payload", [None, [], "text", 3, [{"model": "m"}]])
def test_body_must_be_an_object(payload: Any) -> None:
    assert bad(payload) == "request body must be a JSON object"


def test_null_content_only_for_assistant() -> None:
    assert "messages[0].content" in bad(body(messages=[{"role": "user", "content": None}]))


# --- limits and error mapping ---------------------------------------------------------


def test_body_size_check() -> None:
    LIMITS.check_body_size(24 * MIB)
    with pytest.raises(PayloadTooLarge) as info:
        LIMITS.check_body_size(24 * MIB + 1)
    assert error_response_parts(info.value)[0] == 413


def test_limits_must_be_positive() -> None:
    with pytest.raises(ConfigError):
        RequestLimits(max_media_items=0)
    with pytest.raises(ConfigError):
        RequestLimits(max_audio_seconds=-1.0)


@pytest.mark.parametrize(
    ("exc", "status"),
    [
        (BadRequest("b"), 400),
        (Forbidden("f"), 403),
        (NotFound("n"), 404),
        (Conflict("c"), 409),
        (UnknownModel("u"), 422),
        (PayloadTooLarge("p"), 413),
        (ServiceUnavailable("s"), 503),
    ],
)
def test_general_errors_render_the_spec_shape(exc: ApiError, status: int) -> None:
    assert error_response_parts(exc) == (status, {"error": exc.message})
    assert isinstance(exc, InclavateError)


def test_media_errors_render_the_envelope() -> None:
    err = MediaError(MediaCode.INVALID_MEDIA, "bad image", "messages[0].content[2].image_url.url")
    assert error_response_parts(err) == (
        400,
        {
            "error": {
                "message": "bad image",
                "type": "invalid_media",
                "param": "messages[0].content[2].image_url.url",
                "code": "invalid_media",
            }
        },
    )
    status, payload = error_response_parts(MediaError(MediaCode.MEDIA_TOO_LARGE, "big"))
    assert (status, payload["error"]["param"], payload["error"]["code"]) == (
        413,
        None,
        "media_too_large",
    )
    assert {code.status for code in MediaCode if code is not MediaCode.MEDIA_TOO_LARGE} == {400}


def test_foreign_errors_map_through_the_table() -> None:
    status, payload = error_response_parts(ModelNotFound("ghost:1b", ["smollm2:135m"]))
    assert status == 422 and "ghost:1b" in payload["error"]
    assert error_response_parts(ConfigError("bad --port")) == (400, {"error": "bad --port"})


def test_unmapped_errors_never_leak_details() -> None:
    class EngineCrash(InclavateError):
        pass

    assert error_response_parts(EngineCrash("/secret/path")) == (
        500,
        {"error": "internal error (EngineCrash)"},
    )
    assert error_response_parts(RuntimeError("traceback!")) == (500, {"error": "internal error"})


def test_register_maps_new_types_most_specific_first() -> None:
    class PeerError(InclavateError):
        pass

    class PeerGone(PeerError):
        pass

    register(PeerError, 502, message=lambda exc: "peer failed")
    register(PeerGone, 503)
    assert error_response_parts(PeerError("10.0.0.1 refused")) == (502, {"error": "peer failed"})
    assert error_response_parts(PeerGone("chain gap at 8")) == (503, {"error": "chain gap at 8"})
    with pytest.raises(TypeError):
        register(BadRequest, 418)


def test_scalar_fields_are_checked_before_media_is_decoded() -> None:
    broken = {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@@"}}
    payload = body(messages=[{"role": "user", "content": [broken]}], top_p=5)
    assert "top_p" in bad(payload)
