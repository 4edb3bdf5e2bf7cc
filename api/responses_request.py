"""``POST /v1/responses`` bodies (OpenAI's Responses API) turned into the chat request they mean.

Pure and synchronous: :func:`chat_body` runs on the decoded body in the chat route's worker
thread (:func:`api.chat_job.prepare_chat`), and what it returns is validated, limited and
run exactly as a ``POST /v1/chat/completions`` body. So this module checks only what it
must read to translate (the shape of ``input``, ``instructions``, ``text``) and what the
chat body spells differently (``max_output_tokens``); ``model``, ``temperature``, ``top_p``
and ``stream`` go through under the same names and are checked there. (Not to be confused
with :mod:`api.responses`, the HTTP helpers.)

The subset served: ``input`` as a string or a list of message items whose content is a
string or a list of text parts, ``instructions`` (a system message), ``max_output_tokens``,
``temperature``, ``top_p``, ``stream``; ``metadata``, ``user`` and ``store`` are accepted,
and nothing is stored whatever ``store`` says. Refused with a 400 naming the field, because
ignoring them would change the answer or pretend to a state this server does not keep:

* ``previous_response_id`` and ``conversation``: no response is stored to continue from;
  send the whole conversation as ``input``.
* ``reasoning`` (and the chat spelling ``reasoning_effort``): the spec says this route does
  not accept it yet. Mapping it onto the chat field is one line, but the spec is the
  contract, and OpenAI's ``reasoning`` object carries more than an effort (``summary``)
  that has no meaning here. A model that reasons by default still does, and its reasoning
  comes back as a ``reasoning`` output item (:mod:`api.responses_output`).
* tools (``tools``, a ``tool_choice`` that demands a call), images, files and audio in the
  input, function-call items, ``include``, ``top_logprobs``, a ``text.format`` other than
  text, a ``text.verbosity``, ``truncation: "auto"``, ``background``, a stored ``prompt``:
  nothing here does them. ``/v1/chat/completions`` serves tools and images.

Unknown fields are ignored, as on the chat route, for the clients that always send them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from api.chat_request import integer_field, optional_field
from api.errors import BadRequest

MAX_METADATA_KEYS = 16
"""OpenAI's bound on ``metadata``, which is echoed in every answer: kept so that a caller
cannot make each answer (and each streamed event that carries the response) arbitrarily big."""
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
MAX_USER_CHARS = 256
"""``user`` is echoed in every answer and in three events of a stream: a 20 MB one streamed
60 MB back (a review, 2026-12-07). OpenAI's own ids for it (``safety_identifier``) are 64."""

_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = ("input_text", "output_text")
"""Text parts: OpenAI's assistant turns carry ``output_text`` (an earlier answer sent back),
the others ``input_text``; either is taken in any turn, as text."""

# Fields refused unless absent, null or in their neutral form: (field, neutral values, why).
_REFUSED: tuple[tuple[str, tuple[Any, ...], str], ...] = (
    ("previous_response_id", (), "nothing is stored here, so there is no response to continue from: "
                                 "send the whole conversation as input"),
    ("conversation", (), "nothing is stored here, so there is no conversation to continue: "
                         "send the whole conversation as input"),
    ("reasoning", (), "POST /v1/responses does not accept reasoning settings yet: "
                      "use reasoning_effort on POST /v1/chat/completions"),
    ("reasoning_effort", (), "POST /v1/responses does not accept reasoning settings yet: "
                             "use it on POST /v1/chat/completions"),
    ("tools", ([],), "tools are not supported on POST /v1/responses: use POST /v1/chat/completions"),
    ("tool_choice", ("none", "auto"), "no tools can be called on POST /v1/responses: "
                                      "leave it out (or \"none\", \"auto\")"),
    ("include", ([],), "there is nothing extra to include: leave it out (or [])"),
    ("top_logprobs", (0,), "log probabilities are not supported: leave it out (or 0)"),
    ("truncation", ("disabled",), "the input is never truncated here: a prompt too long is refused; "
                                  "leave it out (or \"disabled\")"),
    ("background", (False,), "responses are not run in the background here: leave it out (or false)"),
    ("prompt", (), "no prompt templates are stored here: send the instructions and input themselves"),
)


def chat_body(body: object) -> dict[str, Any]:
    """The ``/v1/chat/completions`` body a Responses body means; raises BadRequest."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    for key, neutral, why in _REFUSED:
        value = body.get(key)
        if value is not None and not any(value == n and type(value) is type(n) for n in neutral):
            raise BadRequest(f"{key} is not supported: {why}")
    _text_config(body.get("text"))
    _echoed(body)
    messages = _instructions(body.get("instructions")) + _input(body.get("input"))
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    max_tokens = optional_field(body, "max_output_tokens", integer_field(1), None)
    if max_tokens is not None:
        chat["max_tokens"] = max_tokens
    for key in ("temperature", "top_p", "stream"):
        if body.get(key) is not None:
            chat[key] = body[key]
    if chat.get("stream") is True:
        chat["stream_options"] = {"include_usage": True}  # the final event carries the usage
    return chat


def _text_config(value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, dict):
        raise BadRequest("text must be an object")
    fmt = value.get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise BadRequest("text.format must be an object, such as {\"type\": \"text\"}")
    if fmt is not None and fmt.get("type") != "text":
        raise BadRequest(f"text.format {fmt.get('type')!r} is not supported: output cannot be constrained to JSON here; "
                         "leave it out (or {\"type\": \"text\"}), ask for JSON in the input and parse the reply")  # fmt: skip
    if value.get("verbosity") not in (None, "medium"):  # OpenAI's default, which SDKs may always send
        raise BadRequest("text.verbosity is not supported but as \"medium\": say how long an answer you want "
                         "in the instructions")  # fmt: skip


def _echoed(body: Mapping[str, Any]) -> None:
    """The fields accepted only to be echoed (``metadata``, ``user``) or to change nothing
    (``store``): their types, and ``metadata``'s bounds."""
    metadata = body.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA_KEYS:
            raise BadRequest(f"metadata must be an object of at most {MAX_METADATA_KEYS} string values")
        for key, value in metadata.items():
            if len(key) > MAX_METADATA_KEY_CHARS or not isinstance(value, str) or len(value) > MAX_METADATA_VALUE_CHARS:
                raise BadRequest(f"metadata keys must be at most {MAX_METADATA_KEY_CHARS} characters and its "
                                 f"values strings of at most {MAX_METADATA_VALUE_CHARS}")  # fmt: skip
    user = body.get("user")
    if user is not None and (not isinstance(user, str) or len(user) > MAX_USER_CHARS):
        raise BadRequest(f"user must be a string of at most {MAX_USER_CHARS} characters")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise BadRequest("parallel_tool_calls must be true or false")
    if body.get("store") is not None and not isinstance(body["store"], bool):
        raise BadRequest("store must be true or false")


def echoed(body: Mapping[str, Any]) -> dict[str, Any]:
    """What a Response object repeats of its request (checked by :func:`chat_body`)."""
    return {
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": body.get("metadata") or {},
        "user": body.get("user"),
        "tool_choice": body.get("tool_choice") or "auto",
        "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
    }


def _instructions(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, str):
        raise BadRequest("instructions must be a string")
    return [{"role": "system", "content": value}]


def _input(value: Any) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise BadRequest("input must be a string or a non-empty list of message items")
    # A reasoning item is an earlier answer's reasoning, sent back by the SDK's usual
    # conversation loop (``input += response.output``): dropped, as chat templates drop
    # earlier turns' reasoning (it was refused as needing tools: a review, 2026-12-07).
    messages = [_message(item, f"input[{i}]") for i, item in enumerate(value) if not _is_reasoning(item)]
    if not messages:
        raise BadRequest("input must hold at least one message item")
    return messages


def _is_reasoning(item: Any) -> bool:
    return isinstance(item, dict) and item.get("type") == "reasoning"


def _message(item: Any, name: str) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise BadRequest(f"{name} must be an object")
    kind = item.get("type", "message")
    if kind != "message":
        raise BadRequest(f"{name}.type {kind!r} is not supported: only message items are "
                         "(tool calls and their outputs need tools, which are not supported here)")  # fmt: skip
    role = item.get("role")
    if role not in _ROLES:
        raise BadRequest(f"{name}.role must be one of {', '.join(_ROLES)}, got {role!r}")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise BadRequest(f"{name}.content must be a string or a list of content parts")
    # One string, as the chat template would join the parts anyway: as parts, each counted
    # against the chat route's budget of 64 media parts a request, and the SDK's usual loop
    # (``input += response.output``) was refused at its 33rd turn (an audit, 2026-12-08).
    return {"role": role, "content": "".join(_text_part(p, f"{name}.content[{j}]") for j, p in enumerate(content))}


def _text_part(part: Any, name: str) -> str:
    if not isinstance(part, dict):
        raise BadRequest(f"{name} must be an object")
    if part.get("type") not in _TEXT_PARTS:
        raise BadRequest(f"{name}.type {part.get('type')!r} is not supported: only {' and '.join(_TEXT_PARTS)} parts are "
                         "(images, files and audio are not supported on POST /v1/responses; "
                         "POST /v1/chat/completions takes images)")  # fmt: skip
    text = part.get("text")
    if not isinstance(text, str):
        raise BadRequest(f"{name}.text must be a string")
    return text
