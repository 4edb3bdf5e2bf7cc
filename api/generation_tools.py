"""Generation from a chat turn: the swarm's speech generators offered to the model as tools.

Opt-in, as the spec says: tools are offered only when the request sets ``tool_choice``
(``auto``, ``required`` or a named function); without it a chat turn is unchanged and a
probabilistic model gets no authority to start expensive work nobody asked for. The caller
steers with ``generation_model`` and ``generation_voice`` (naming one this swarm does not
have offers no tools rather than falling back) and ``generation_max_duration_seconds``
(a ceiling on the audio the whole reply produces, split evenly across the jobs it starts).

A reply's calls to these tools start jobs (at most :data:`MAX_PER_REPLY`) and come back in
the response's ``generated`` array; every other call, including generation calls past the
fourth or with arguments no job can take, is handed back as an ordinary tool call.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from api.chat_request import ChatRequest
from api.tool_calls import ParsedToolCall, read_json
from inclavate.errors import InclavateError
from inclavate.generations import GenerationService
from inclavate.jobs import NewJob

MAX_PER_REPLY = 4
TOOL_PREFIX = "generate_speech_"


@dataclass(frozen=True)
class GenerationTool:
    name: str
    model: str
    voices: tuple[str, ...]

    def to_openai(self) -> dict[str, Any]:
        properties: dict[str, Any] = {"text": {"type": "string", "description": "The exact words to speak."}}
        if self.voices:
            properties["voice"] = {"type": "string", "enum": list(self.voices)}
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": f"Speak text aloud as an audio clip (speech model {self.model}). "
                "Starts a generation job; the audio is delivered separately.",
                "parameters": {"type": "object", "properties": properties, "required": ["text"]},
            },
        }


def offered_tools(capabilities: Sequence[dict[str, Any]], request: ChatRequest) -> tuple[GenerationTool, ...]:
    """The generation tools this request opts into (none without ``tool_choice``)."""
    if request.tool_choice is None or request.tool_choice.mode == "none":
        return ()
    tools = []
    for entry in capabilities:
        if entry.get("modality") != "audio" or entry.get("kind") is not None:
            continue  # speech only: understanding needs input media a tool call cannot carry
        model = str(entry["model"])
        if request.generation_model is not None and model != request.generation_model:
            continue
        voices = tuple(entry.get("voices", [])) + tuple(entry.get("builtin_voices", []))
        if request.generation_voice is not None:
            if request.generation_voice not in voices:
                continue
            voices = (request.generation_voice,)
        tools.append(GenerationTool(TOOL_PREFIX + re.sub(r"[^A-Za-z0-9]+", "_", model).strip("_"), model, voices))
    return tuple(tools)


async def start_generations(
    service: GenerationService, tools: Sequence[GenerationTool], calls: Sequence[ParsedToolCall], request: ChatRequest
) -> tuple[list[ParsedToolCall], list[dict[str, Any]]]:
    """``(calls handed back, generated job references)``."""
    by_name = {tool.name: tool for tool in tools}
    wanted = min(MAX_PER_REPLY, sum(1 for call in calls if call.name in by_name))
    ceiling = request.generation_max_duration_seconds
    remaining: list[ParsedToolCall] = []
    generated: list[dict[str, Any]] = []
    for call in calls:
        tool = by_name.get(call.name)
        if tool is None or len(generated) >= MAX_PER_REPLY:
            remaining.append(call)
            continue
        params = _params(tool, call, request, ceiling / wanted if ceiling else None)
        if params is None:
            remaining.append(call)
            continue
        try:
            job = await service.submit(NewJob("audio", tool.model, params, deadline_s=service.settings.default_deadline_s),
                                       local_only=False, known_chat_model=False)  # fmt: skip
        except InclavateError:
            remaining.append(call)  # e.g. the queue is full: the caller can run the call itself
            continue
        generated.append({"id": job["id"], "object": "generation", "modality": "audio", "model": tool.model,
                          "state": job["state"], "tool_call_id": call.id})  # fmt: skip
    return remaining, generated


def _params(tool: GenerationTool, call: ParsedToolCall, request: ChatRequest, max_s: float | None) -> dict[str, Any] | None:
    try:
        args = read_json(call.arguments)
    except ValueError:
        return None
    text = args.get("text") if isinstance(args, dict) else None
    if not isinstance(text, str) or not text.strip():
        return None
    params: dict[str, Any] = {"text": text}
    voice = request.generation_voice or args.get("voice")
    if isinstance(voice, str) and voice in tool.voices:
        params["voice"] = voice
    if max_s is not None:
        params["max_duration_seconds"] = max_s
    return params
