"""Recognising a tool call in a model's reply.

Models write tool calls as text in their template's format; the two in wide use are the
Hermes/Qwen ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks and a bare
JSON object (or list) with ``name`` and ``arguments``/``parameters`` (Llama 3.1). A reply is
a tool call only when the request offered tools and the text parses as one of these; anything
else stays ordinary content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from inclavate.untrusted import parse_json

_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str
    """JSON text, as OpenAI's schema carries it."""
    id: str

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if index is not None:
            call["index"] = index
        return call


MAX_CALL_CHARS = 1 << 20
"""More than any context's worth of generated text."""


def read_json(text: str) -> Any:
    """JSON the model wrote, read as bytes from the network are (:func:`parse_json`): a
    stage can make the model write anything, and ``json.loads`` let 1,000 brackets raise
    ``RecursionError`` and a lone surrogate through to whatever encodes it next. Raises
    :class:`ValueError` (``Malformed``)."""
    return parse_json(text, max_bytes=MAX_CALL_CHARS)


def _call(obj: Any) -> ParsedToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            read_json(args)
        except ValueError:
            return None
        text = args
    elif isinstance(args, dict):
        text = json.dumps(args, ensure_ascii=False)
    else:
        return None
    return ParsedToolCall(obj["name"], text, f"call_{uuid.uuid4().hex[:24]}")


def extract_tool_calls(text: str) -> tuple[str, list[ParsedToolCall]]:
    """``(remaining content, calls)``; no calls means the reply is plain content."""
    blocks = _BLOCK.findall(text)
    if blocks:
        calls = []
        for block in blocks:
            try:
                call = _call(read_json(block))
            except ValueError:
                call = None
            if call is None:
                return text, []
            calls.append(call)
        return _BLOCK.sub("", text).strip(), calls
    stripped = text.strip()
    if stripped[:1] in "{[":
        try:
            obj = read_json(stripped)
        except ValueError:
            return text, []
        items = obj if isinstance(obj, list) else [obj]
        calls = [_call(item) for item in items]
        if calls and all(c is not None for c in calls):
            return "", [c for c in calls if c is not None]
    return text, []
