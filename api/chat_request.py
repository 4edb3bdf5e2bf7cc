"""``POST /v1/chat/completions`` bodies: decoded JSON in, a frozen :class:`ChatRequest` out.

Pure and synchronous, so the HTTP (streaming or not) and /ws/chat paths share it and tests
need no server. The server checks the raw body size (``RequestLimits.check_body_size``)
and JSON syntax first; everything after that is here and in :mod:`api.media`.

Leniency, on purpose, because OpenAI SDKs and clients send it: unknown fields are ignored;
``null`` means "use the default" for every optional field; ``max_completion_tokens`` is
OpenAI's newer spelling of ``max_tokens``; roles ``tool`` and ``developer`` are accepted
beside the spec's three, and ``developer`` (OpenAI's new name for the system prompt, which
chat templates do not know) becomes ``system``. What is not accepted: ``n`` other than 1,
more than 4 stop sequences, a ``reasoning_effort`` that is not a string (its value is
checked later against the model's levels, which this module does not know), and OpenAI
fields that would change the reply but cannot be honoured here, in any but their neutral
form (``_refuse_what_cannot_be_honoured``): ``response_format``, ``logprobs``, penalties,
``logit_bias``, the deprecated ``functions``, audio output and web search.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, TypeVar

from api.content import ContentPart, Modality, TextPart
from api.errors import BadRequest
from api.limits import RequestLimits
from api.media import RawContent, parse_contents

__all__ = [
    "ChatMessage",
    "ChatRequest",
    "Role",
    "Tool",
    "ToolCall",
    "ToolChoice",
    "parse_chat_request",
]

MAX_STOP_SEQUENCES = 4  # OpenAI's limit, which clients already respect


class Role(StrEnum):
    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"
    TOOL = "tool"


_ROLE_ALIASES = {"developer": Role.SYSTEM}


def _role(raw: Any) -> Role | None:
    if not isinstance(raw, str):
        return None
    try:
        return _ROLE_ALIASES.get(raw) or Role(raw)
    except ValueError:
        return None


@dataclass(frozen=True)
class ToolCall:
    """A function call an assistant turn made; ``arguments`` is JSON text, as OpenAI sends."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class Tool:
    """A function the caller offers the model (OpenAI ``tools[].function``)."""

    name: str
    description: str | None = None
    parameters: Mapping[str, Any] | None = None  # a JSON Schema, passed to the chat template

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI shape, which is what chat templates expect in their ``tools``."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolChoice:
    """``none``, ``auto``, ``required``, or ``function`` with the one function to call."""

    mode: str
    function: str | None = None


@dataclass(frozen=True)
class ChatMessage:
    role: Role
    content: str | tuple[ContentPart, ...]
    name: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None

    @property
    def parts(self) -> tuple[ContentPart, ...]:
        """The content as parts, plain string content being one text part."""
        return (TextPart(self.content),) if isinstance(self.content, str) else self.content


@dataclass(frozen=True)
class ChatRequest:
    model: str
    messages: tuple[ChatMessage, ...]
    max_tokens: int = 512
    temperature: float = 0.8
    top_p: float = 0.95
    stream: bool = False
    include_usage: bool = False
    """``stream_options.include_usage``: send a usage frame before ``[DONE]``."""
    stop: tuple[str, ...] = ()
    thinking: bool | None = None
    reasoning_effort: str | None = None
    seed: int | None = None
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    """False: a reply hands back at most one tool call (its first)."""
    generation_model: str | None = None
    generation_voice: str | None = None
    generation_max_duration_seconds: float | None = None

    def modalities(self) -> frozenset[Modality]:
        """Every input kind the request uses (``text`` always), for capability checks."""
        return frozenset({Modality.TEXT, *(p.modality for m in self.messages for p in m.parts)})


def parse_chat_request(body: object, limits: RequestLimits) -> ChatRequest:
    """Validate a decoded request body; raises BadRequest, or MediaError for content parts."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    n = body.get("n")
    if n is not None and (_is_bool(n) or n != 1):
        raise BadRequest("n must be 1: one choice per request")
    _refuse_what_cannot_be_honoured(body)
    stream_options = optional_field(body, "stream_options", _object, {})
    return ChatRequest(
        model=_string(body.get("model"), "model", nonempty=True),
        max_tokens=_max_tokens(body),
        temperature=optional_field(body, "temperature", _number(0.0, 2.0), ChatRequest.temperature),
        top_p=optional_field(body, "top_p", _number(0.0, 1.0, low_open=True), ChatRequest.top_p),
        stream=optional_field(body, "stream", _boolean, False),
        include_usage=optional_field(stream_options, "include_usage", _boolean, False, "stream_options."),
        stop=optional_field(body, "stop", _stop, ()),
        thinking=optional_field(body, "thinking", _boolean, None),
        reasoning_effort=optional_field(body, "reasoning_effort", _string, None),
        seed=optional_field(body, "seed", integer_field(None), None),
        tools=optional_field(body, "tools", _tools, ()),
        tool_choice=optional_field(body, "tool_choice", _tool_choice, None),
        parallel_tool_calls=optional_field(body, "parallel_tool_calls", _boolean, True),
        generation_model=optional_field(body, "generation_model", _string, None),
        generation_voice=optional_field(body, "generation_voice", _string, None),
        generation_max_duration_seconds=optional_field(
            body, "generation_max_duration_seconds", _number(0.0, math.inf, low_open=True), None
        ),
        # Last, as arguments are evaluated in order: a request with a bad scalar field is
        # refused before any of its media is decoded.
        messages=_messages(body.get("messages"), limits),
    )


def _refuse_what_cannot_be_honoured(body: Mapping[str, Any]) -> None:
    """OpenAI fields this server accepts only in their default form. Ignored, a request for
    JSON output or for log probabilities got prose without them and no sign of why; their
    defaults (``{"type": "text"}``, ``false``), which some clients always send, pass."""
    response_format = optional_field(body, "response_format", _object, {"type": "text"})
    kind = response_format.get("type")
    if kind != "text":
        raise BadRequest(f"response_format {kind!r} is not supported: output cannot be constrained to JSON "
                         "here; ask for JSON in the messages and parse the reply")  # fmt: skip
    if optional_field(body, "logprobs", _boolean, False) or body.get("top_logprobs") is not None:
        raise BadRequest("logprobs are not supported: leave logprobs and top_logprobs out (or false)")
    # Sampling here is temperature, top_p and seed (node/sampling.py, on the last stage):
    # penalties and biases would change which tokens are drawn, so a reply without them is
    # not the reply asked for. Their neutral values (0, {}) change nothing and pass.
    for key in ("presence_penalty", "frequency_penalty"):
        value = body.get(key)
        if value is not None and (_is_bool(value) or value != 0):
            raise BadRequest(f"{key} is not supported: sampling here has no repetition penalties; leave it out (or 0)")
    if body.get("logit_bias") not in (None, {}):
        raise BadRequest("logit_bias is not supported: sampling here cannot bias tokens; leave it out (or {})")
    if body.get("functions") not in (None, []) or body.get("function_call") not in (None, "none", "auto"):
        raise BadRequest("functions and function_call (OpenAI's deprecated form) are not supported: "
                         "send tools and tool_choice instead")  # fmt: skip
    modalities = body.get("modalities")
    if modalities not in (None, ["text"]) or body.get("audio") is not None:
        raise BadRequest("only text output is supported: leave modalities out (or [\"text\"]) and audio out; "
                         "POST /v1/audio/speech speaks text")  # fmt: skip
    if body.get("web_search_options") is not None:
        raise BadRequest("web_search_options is not supported: nothing here searches the web")


# --- scalar fields --------------------------------------------------------------------

_V = TypeVar("_V")
_D = TypeVar("_D")


def optional_field(
    obj: Mapping[str, Any], key: str, parse: Callable[[Any, str], _V], default: _D, prefix: str = ""
) -> _V | _D:
    """An optional field: absent or null gives the default, anything else must parse."""
    value = obj.get(key)
    return default if value is None else parse(value, prefix + key)


def _is_bool(value: Any) -> bool:
    return isinstance(value, bool)  # JSON true/false arrive as bool, a subclass of int


def _string(value: Any, name: str, *, nonempty: bool = False) -> str:
    if not isinstance(value, str) or (nonempty and not value):
        raise BadRequest(f"{name} must be a {'non-empty ' if nonempty else ''}string")
    return value


def _boolean(value: Any, name: str) -> bool:
    if not _is_bool(value):
        raise BadRequest(f"{name} must be true or false")
    return bool(value)


def _object(value: Any, name: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise BadRequest(f"{name} must be an object")
    return value


def integer_field(minimum: int | None) -> Callable[[Any, str], int]:
    def parse(value: Any, name: str) -> int:
        if (
            _is_bool(value)
            or not isinstance(value, int)
            or (minimum is not None and value < minimum)
        ):
            raise BadRequest(
                f"{name} must be an integer" + (f" >= {minimum}" if minimum is not None else "")
            )
        return value

    return parse


def _number(low: float, high: float, *, low_open: bool = False) -> Callable[[Any, str], float]:
    def parse(value: Any, name: str) -> float:
        ok = not _is_bool(value) and isinstance(value, int | float) and math.isfinite(value)
        if not ok or value > high or value < low or (low_open and value == low):
            bounds = f"{'(' if low_open else '['}{low:g}, {high:g}]"
            raise BadRequest(f"{name} must be a number in {bounds}, got {value!r}")
        return float(value)

    return parse


def _max_tokens(body: Mapping[str, Any]) -> int:
    parse = integer_field(1)
    legacy = optional_field(body, "max_tokens", parse, None)
    newer = optional_field(body, "max_completion_tokens", parse, None)
    if legacy is not None and newer is not None and legacy != newer:
        raise BadRequest("max_tokens and max_completion_tokens disagree; send one of them")
    return newer or legacy or ChatRequest.max_tokens


def _stop(value: Any, name: str) -> tuple[str, ...]:
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or len(stops) > MAX_STOP_SEQUENCES:
        raise BadRequest(
            f"{name} must be a string or a list of at most {MAX_STOP_SEQUENCES} strings"
        )
    return tuple(_string(s, f"{name}[{i}]", nonempty=True) for i, s in enumerate(stops))


# --- tools ----------------------------------------------------------------------------


def _tools(value: Any, name: str) -> tuple[Tool, ...]:
    if not isinstance(value, list):
        raise BadRequest(f"{name} must be a list")
    return tuple(_tool(t, f"{name}[{i}]") for i, t in enumerate(value))


def _tool(value: Any, name: str) -> Tool:
    function = _function_of(value, name)
    return Tool(
        name=_string(function.get("name"), f"{name}.function.name", nonempty=True),
        description=optional_field(function, "description", _string, None, f"{name}.function."),
        parameters=optional_field(function, "parameters", _object, None, f"{name}.function."),
    )


def _function_of(value: Any, name: str) -> dict[str, Any]:
    """The ``function`` member of an OpenAI ``{"type": "function", "function": {...}}``."""
    _object(value, name)
    if value.get("type", "function") != "function":
        raise BadRequest(f"{name}.type must be 'function'")
    return _object(value.get("function"), f"{name}.function")


_TOOL_CHOICE_MODES = ("none", "auto", "required")


def _tool_choice(value: Any, name: str) -> ToolChoice:
    if isinstance(value, str):
        if value not in _TOOL_CHOICE_MODES:
            raise BadRequest(
                f"{name} must be one of {', '.join(_TOOL_CHOICE_MODES)} or a named function"
            )
        return ToolChoice(value)
    function = _function_of(value, name)
    return ToolChoice(
        "function", _string(function.get("name"), f"{name}.function.name", nonempty=True)
    )


def _tool_calls(value: Any, name: str) -> tuple[ToolCall, ...]:
    if not isinstance(value, list):
        raise BadRequest(f"{name} must be a list")
    calls = []
    for i, call in enumerate(value):
        function = _function_of(call, f"{name}[{i}]")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, dict):  # some clients send the object instead of its text
            arguments = json.dumps(arguments, separators=(",", ":"))
        calls.append(
            ToolCall(
                id=_string(call.get("id", ""), f"{name}[{i}].id"),
                name=_string(function.get("name"), f"{name}[{i}].function.name", nonempty=True),
                arguments=_string(arguments, f"{name}[{i}].function.arguments"),
            )
        )
    return tuple(calls)


# --- messages -------------------------------------------------------------------------


def _messages(value: Any, limits: RequestLimits) -> tuple[ChatMessage, ...]:
    if not isinstance(value, list) or not value:
        raise BadRequest("messages must be a non-empty list")
    shells = [_message_shell(m, f"messages[{i}]") for i, m in enumerate(value)]
    # Every content array goes to media validation in one call: the limits are per request.
    arrays = [
        RawContent(f"messages[{i}].content", shell["content"], shell["role"] is Role.USER)
        for i, shell in enumerate(shells)
        if isinstance(shell["content"], list)
    ]
    parsed = iter(parse_contents(arrays, limits))
    for shell in shells:
        if isinstance(shell["content"], list):
            shell["content"] = next(parsed)
    return tuple(ChatMessage(**shell) for shell in shells)


def _message_shell(value: Any, name: str) -> dict[str, Any]:
    """A message's fields, content arrays still raw; keys are ChatMessage's."""
    _object(value, name)
    raw_role = value.get("role")
    role = _role(raw_role)
    if role is None:
        roles = ", ".join([*Role, *_ROLE_ALIASES])
        raise BadRequest(f"{name}.role must be one of {roles}, got {raw_role!r}")
    tool_calls = optional_field(value, "tool_calls", _tool_calls, (), f"{name}.")
    content = value.get("content")
    if content is None and role is Role.ASSISTANT:
        content = ""  # an assistant turn that only called tools has null content
    if not isinstance(content, str | list):
        raise BadRequest(f"{name}.content must be a string or a list of content parts")
    return {
        "role": role,
        "content": content,
        "name": optional_field(value, "name", _string, None, f"{name}."),
        "tool_calls": tool_calls,
        "tool_call_id": optional_field(value, "tool_call_id", _string, None, f"{name}."),
    }
