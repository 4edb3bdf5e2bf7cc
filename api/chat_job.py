"""From a decoded chat request to a generation ready to run, and its OpenAI-shaped output.

Shared by ``POST /v1/chat/completions`` (plain and SSE) and ``/ws/chat``, so all three
validate in the same order, before any work: request shape and limits, then the model (422),
its capabilities (400), a route through the swarm (503), the prompt's length on its face
(400: :meth:`ChatModel.refuse_if_it_cannot_fit`), the reasoning level and the template (400),
the rendered prompt's length on its face (400, the same check), and the prompt's length in
tokens (400).

The CPU-heavy steps (parsing a body of up to 24 MiB, decoding its media, rendering the
template, tokenizing) run in worker threads, at most :data:`PREPARE_THREADS` at a time: on
the event loop a few big requests would stall every stream, every forward frame and the
peer's heartbeats. A prompt too long for any tokenization to fit the context is refused
before tokenizing: on its user text before rendering, on the whole rendered text after (every
role, name, tool call and tool result it writes). Four clients sending 20 MB prompts held
both threads for ~7 s each, and every chat waited behind them.
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from api.bodies import decode_json
from api.chat_model import ChatModel, PreparedPrompt
from api.chat_request import ChatMessage, ChatRequest, Role, parse_chat_request
from api.content import TextPart
from api.context import PeerContext
from api.errors import BadRequest, UnknownModel
from api.generation import Generation, GenerationResult
from api.generation_tools import GenerationTool, offered_tools, start_generations
from api.media import require_modalities
from api.reasoning_split import Delta
from api.tool_calls import ParsedToolCall, extract_tool_calls
from inclavate.types import SessionId


@dataclass
class ChatJob:
    request: ChatRequest
    chat: ChatModel
    prompt: PreparedPrompt
    generation: Generation
    session_id: SessionId
    created: int = field(default_factory=lambda: int(time.time()))
    generation_tools: tuple[GenerationTool, ...] = ()
    """Generators offered as tools because the request set ``tool_choice``."""
    answer_id: str | None = None
    """The id the client was given for this turn, when the route answers in another shape
    than a chat completion (``resp_...``): what ``GET /sessions/:id`` says back."""

    @property
    def completion_id(self) -> str:
        return f"chatcmpl-{self.session_id}"

    @property
    def buffers_content(self) -> bool:
        """With tools offered, content is held to the end: it may turn out to be a call."""
        return bool(self.request.tools or self.generation_tools) and self.chat.supports_tools


def template_message(message: ChatMessage) -> dict[str, Any]:
    """A message as chat templates expect it (text parts joined; media was refused earlier)."""
    if isinstance(message.content, str):
        content = message.content
    else:
        content = "".join(p.text for p in message.content if isinstance(p, TextPart))
    out: dict[str, Any] = {"role": message.role, "content": content}
    if message.name:
        out["name"] = message.name
    if message.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in message.tool_calls
        ]
    if message.tool_call_id:
        out["tool_call_id"] = message.tool_call_id
    return out


PREPARE_THREADS = 2
_PREPARE = trio.CapacityLimiter(PREPARE_THREADS)


Translate = Callable[[object], object]
"""A decoded body of another OpenAI shape to the chat request body it means (raising
BadRequest for what it cannot mean): ``POST /v1/responses`` (:mod:`api.responses_request`)."""


def _parse(raw: bytes | str, ctx: PeerContext, translate: Translate | None) -> tuple[ChatRequest, int]:
    body = decode_json(raw)
    request = parse_chat_request(body if translate is None else translate(body), ctx.limits)
    return request, _user_text_chars(request)


def _user_text_chars(request: ChatRequest) -> int:
    """Characters of user text that any chat template renders: each user message's text,
    without the surrounding whitespace a template's ``trim`` removes. Other roles do not
    count here: a template may leave them out (one that knows only user and assistant turns
    drops system and tool messages) or shorten them (Qwen3's drops an earlier answer's
    reasoning). They count once rendered, before tokenizing (:meth:`ChatModel.prepare`)."""
    return sum(len(template_message(m)["content"].strip()) for m in request.messages if m.role is Role.USER)


def _require_tools_if_demanded(request: ChatRequest, chat: ChatModel) -> None:
    """A request that demands a tool call (``tool_choice`` ``required`` or a named function)
    from a model whose template cannot offer tools would get prose instead: refused. With
    ``auto`` the model may answer in prose anyway, so that passes."""
    choice = request.tool_choice
    if choice is not None and choice.mode in ("required", "function") and not chat.supports_tools:
        raise BadRequest(f"model {request.model!r} cannot call tools (supports_tools is false in /api/models): "
                         "tool_choice cannot be required or name a function")  # fmt: skip


async def prepare_chat(ctx: PeerContext, raw: bytes | str, translate: Translate | None = None) -> ChatJob:
    """``raw``: the request body, size-checked by the caller. ``translate``: applied to the
    decoded body in the same worker thread, so another route's bodies cost the event loop
    no more than a chat body, and go through the same validation after it."""
    request, user_chars = await trio.to_thread.run_sync(_parse, raw, ctx, translate, limiter=_PREPARE)
    if not ctx.knows_model(request.model):
        raise UnknownModel(f"model {request.model!r} is not in the registry")
    chat = await ctx.chat_model(request.model)
    require_modalities(request, chat.input_modalities)
    _require_tools_if_demanded(request, chat)
    generation_tools: tuple[GenerationTool, ...] = ()
    if ctx.generations is not None and request.tool_choice is not None and chat.supports_tools:
        generation_tools = offered_tools(ctx.generations.capabilities(), request)
    tools = [t.to_openai() for t in request.tools] + [t.to_openai() for t in generation_tools] or None
    tool_choice = None if request.tool_choice is None else request.tool_choice.mode
    pipeline = ctx.pipeline(request.model)
    prepare = functools.partial(
        chat.prepare,
        [template_message(m) for m in request.messages],
        thinking=request.thinking,
        reasoning_effort=request.reasoning_effort,
        tools=tools if tool_choice != "none" else None,
        tool_choice=tool_choice,
        context_length=pipeline.context_length,
    )
    chat.refuse_if_it_cannot_fit(user_chars, pipeline.context_length)
    prompt = await trio.to_thread.run_sync(prepare, limiter=_PREPARE)
    params = chat.generation_params(
        prompt,
        max_tokens=request.max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        seed=request.seed,
        stop=request.stop,
    )
    session_id = SessionId(uuid.uuid4().hex)
    generation = Generation(pipeline, chat.tokenizer, session_id, params, prompt.splitter)
    return ChatJob(request, chat, prompt, generation, session_id, generation_tools=generation_tools)


@dataclass
class Collected:
    """Everything a finished generation said, for a non-streaming answer."""

    reasoning: list[str] = field(default_factory=list)
    content: list[str] = field(default_factory=list)

    async def add(self, delta: Delta) -> None:
        (self.reasoning if delta.kind == "reasoning" else self.content).append(delta.text)


def finish_and_calls(job: ChatJob, result: GenerationResult, content: str) -> tuple[str, str, list[ParsedToolCall]]:
    """Final content, finish_reason and tool calls. ``length`` outranks ``tool_calls``: a
    reply cut at the cap may have been cut mid-call. With ``parallel_tool_calls`` false only
    the first call is handed back, as OpenAI's model makes at most one: a caller that said
    so may run only one, and would leave the others unanswered in its next request."""
    if not job.buffers_content:
        return content, result.finish_reason, []
    remaining, calls = extract_tool_calls(content)
    if not job.request.parallel_tool_calls:
        calls = calls[:1]
    if calls and result.finish_reason != "length":
        return remaining, "tool_calls", calls
    return content, result.finish_reason, []


@dataclass(frozen=True)
class Outcome:
    """How a finished reply is reported: content, finish_reason, the tool calls handed back
    and the generation jobs its generation-tool calls started."""

    content: str
    finish_reason: str
    calls: list[ParsedToolCall]
    generated: list[dict[str, Any]]


async def settle(ctx: PeerContext, job: ChatJob, result: GenerationResult, content: str) -> Outcome:
    """Start the generations the reply asked for (see :mod:`api.generation_tools`)."""
    content, finish, calls = finish_and_calls(job, result, content)
    generated: list[dict[str, Any]] = []
    if calls and job.generation_tools and ctx.generations is not None:
        calls, generated = await start_generations(ctx.generations, job.generation_tools, calls, job.request)
        if not calls:
            finish = "stop"  # every call became a job: nothing is left for the caller to run
    return Outcome(content, finish, calls, generated)


def usage(result: GenerationResult) -> dict[str, int]:
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "total_tokens": result.prompt_tokens + result.completion_tokens,
    }


def completion_body(job: ChatJob, result: GenerationResult, collected: Collected, outcome: Outcome) -> dict[str, Any]:
    content, calls = outcome.content, outcome.calls
    message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
    if collected.reasoning:
        message["reasoning_content"] = "".join(collected.reasoning)
    if calls:
        message["tool_calls"] = [c.to_openai() for c in calls]
    body = {
        **_envelope(job, "chat.completion"),
        "choices": [{"index": 0, "message": message, "finish_reason": outcome.finish_reason}],
        "usage": usage(result),
    }
    if outcome.generated:
        body["generated"] = outcome.generated
    return body


def _envelope(job: ChatJob, kind: str) -> dict[str, Any]:
    return {"id": job.completion_id, "object": kind, "created": job.created, "model": job.request.model}


def chunk(job: ChatJob, delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
    return {
        **_envelope(job, "chat.completion.chunk"),
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
    }


def delta_chunk(job: ChatJob, delta: Delta) -> dict[str, Any]:
    key = "reasoning_content" if delta.kind == "reasoning" else "content"
    return chunk(job, {key: delta.text})


def final_chunks(job: ChatJob, result: GenerationResult, outcome: Outcome) -> list[dict[str, Any]]:
    """The closing chunks: held-back content or tool calls, ``finish_reason`` (carrying the
    ``generated`` jobs, if any), usage."""
    out = []
    if outcome.calls:
        out.append(chunk(job, {"tool_calls": [c.to_openai(i) for i, c in enumerate(outcome.calls)]}))
    elif outcome.content:
        out.append(chunk(job, {"content": outcome.content}))
    closing = chunk(job, {}, outcome.finish_reason)
    if outcome.generated:
        closing["generated"] = outcome.generated
    out.append(closing)
    if job.request.include_usage:
        out.append({**chunk(job, {}), "choices": [], "usage": usage(result)})
    return out
