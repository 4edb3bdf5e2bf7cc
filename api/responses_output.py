"""A chat turn's output in OpenAI's Responses shapes: the ``response`` object of
``POST /v1/responses`` and the events of its stream.

Pure translation of what the chat path produced (a ``chat.completion`` body, or the
``chat.completion.chunk`` objects of a stream, :class:`api.routes_chat.ChatRunner`), so the
answer is the chat answer to the letter. Ids come from the session id (``resp_``, ``msg_``,
``rs_`` before it): ``GET``/``DELETE /sessions/resp_...`` reach the generation.

A finish at the token cap (``max_output_tokens``, or the end of the model's context) is
status ``incomplete`` with reason ``max_output_tokens``. A model that reasons gives a
``reasoning`` item (its text as ``reasoning_text`` content, no summary) before the message.
``usage.output_tokens`` counts reasoning and answer together: the generation loop does not
count them apart, so ``reasoning_tokens`` is 0, as chat's usage does not split them either.
Cached tokens are 0: a session's KV cache is never reused across requests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from api.chat_job import ChatJob

Event = dict[str, Any]


@dataclass(frozen=True)
class Shell:
    """What every Response object of one request repeats."""

    session_id: str
    created_at: int
    model: str
    temperature: float
    top_p: float
    echoed: dict[str, Any]
    """From the request (:func:`api.responses_request.echoed`)."""

    @classmethod
    def of(cls, job: ChatJob, echoed: dict[str, Any]) -> Shell:
        r = job.request
        return cls(job.session_id, job.created, r.model, r.temperature, r.top_p, echoed)

    @property
    def id(self) -> str:
        return f"resp_{self.session_id}"

    @property
    def message_id(self) -> str:
        return f"msg_{self.session_id}"

    @property
    def reasoning_id(self) -> str:
        return f"rs_{self.session_id}"


def response_object(shell: Shell, status: str, output: list[dict[str, Any]], usage: dict[str, int] | None = None,
                    error: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    """A Response with every field the SDK's model requires, and the ones worth echoing."""
    return {
        "id": shell.id,
        "object": "response",
        "created_at": shell.created_at,
        "status": status,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "model": shell.model,
        "output": output,
        "temperature": shell.temperature,
        "top_p": shell.top_p,
        "tools": [],
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "background": False,
        "previous_response_id": None,
        "reasoning": None,
        **shell.echoed,
        "usage": None if usage is None else _usage(usage),
    }


def _usage(chat_usage: dict[str, int]) -> dict[str, Any]:
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat_usage["total_tokens"],
    }


def status_of(finish_reason: str) -> str:
    """``length`` (the token cap) is ``incomplete``; a finished answer is ``completed``."""
    return "incomplete" if finish_reason == "length" else "completed"


def reasoning_item(shell: Shell, text: str, status: str) -> dict[str, Any]:
    return {"id": shell.reasoning_id, "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if text else []}  # fmt: skip


def message_item(shell: Shell, text: str, status: str) -> dict[str, Any]:
    return {"id": shell.message_id, "type": "message", "role": "assistant", "status": status,
            "content": [_output_text(text)] if status != "in_progress" else []}  # fmt: skip


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}


def from_completion(shell: Shell, completion: dict[str, Any]) -> dict[str, Any]:
    """A ``chat.completion`` body as a Response."""
    choice = completion["choices"][0]
    status = status_of(choice["finish_reason"])
    message = choice["message"]
    output = []
    content = message.get("content") or ""
    if message.get("reasoning_content"):  # cut off at the cap while it reasoned: incomplete too
        output.append(reasoning_item(shell, message["reasoning_content"], "completed" if content else status))
    output.append(message_item(shell, content, status))
    return response_object(shell, status, output, completion["usage"])


def failure(status: int, error: Any) -> dict[str, Any]:
    """A chat error (``{"error": ...}``'s value, and its HTTP status) as a Response's ``error``."""
    message = error.get("message", str(error)) if isinstance(error, dict) else str(error)
    code = "rate_limit_exceeded" if status == 429 else "invalid_prompt" if status == 400 else "server_error"
    return {"code": code, "message": message}


class EventStream:
    """``chat.completion.chunk`` objects in, Responses stream events out, in OpenAI's order:
    ``response.created``, ``response.in_progress``, then per item ``output_item.added``,
    ``content_part.added``, the deltas, ``*.done``, ``content_part.done``, ``output_item.done``,
    and last ``response.completed`` (or ``.incomplete``, or ``.failed``). Every event has the
    next ``sequence_number``."""

    def __init__(self, shell: Shell) -> None:
        self._shell = shell
        self._sequence = 0
        self._done: list[dict[str, Any]] = []  # closed items
        self._open: str | None = None  # "reasoning" or "message"
        self._texts: dict[str, list[str]] = {"reasoning": [], "message": []}
        self._finish: str | None = None
        self._usage: dict[str, int] | None = None
        self._ended = False

    def start(self) -> list[Event]:
        in_progress = response_object(self._shell, "in_progress", [])
        return [self._event("response.created", response=in_progress),
                self._event("response.in_progress", response=in_progress)]  # fmt: skip

    def feed(self, chunk: dict[str, Any]) -> list[Event]:
        """The events one chat chunk (or error object) makes."""
        if self._ended:
            return []
        if "error" in chunk:
            return self._fail(chunk.get("status", 500), chunk["error"])
        if chunk.get("usage"):
            self._usage = chunk["usage"]
        events: list[Event] = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                events += self._delta("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                events += self._delta("message", delta["content"])
            if choice.get("finish_reason"):
                self._finish = choice["finish_reason"]
        return events

    def end(self) -> list[Event]:
        """The closing events, once the chunks ran out."""
        if self._ended:
            return []
        if self._finish is None or self._usage is None:
            return self._fail(500, "the generation ended without finishing")
        status = status_of(self._finish)
        events = []
        if self._open == "reasoning" and status != "completed":  # cut off at the cap while it reasoned
            events += self._close(status)
        if self._open != "message":  # an empty answer is still a message
            events += self._delta("message", "")
        events += self._close(status)
        self._ended = True
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return [*events, self._event(kind, response=response_object(self._shell, status, self._done, self._usage))]

    def _delta(self, kind: str, text: str) -> list[Event]:
        events = []
        if self._open != kind:
            if self._open is not None:
                events += self._close("completed")
            events += self._open_item(kind)
        self._texts[kind].append(text)
        if text:
            name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
            extra = {"logprobs": []} if kind == "message" else {}
            events.append(self._event(name, **self._where(), delta=text, **extra))
        return events

    def _open_item(self, kind: str) -> list[Event]:
        self._open = kind
        item = self._item(kind, "in_progress", "")
        part = _output_text("") if kind == "message" else {"type": "reasoning_text", "text": ""}
        where = self._where()
        return [self._event("response.output_item.added", output_index=where["output_index"], item=item),
                self._event("response.content_part.added", **where, part=part)]  # fmt: skip

    def _close(self, status: str) -> list[Event]:
        kind, where = self._open, self._where()
        assert kind is not None
        text = "".join(self._texts[kind])
        if kind == "message":
            events = [self._event("response.output_text.done", **where, text=text, logprobs=[]),
                      self._event("response.content_part.done", **where, part=_output_text(text))]  # fmt: skip
        else:
            events = [self._event("response.reasoning_text.done", **where, text=text),
                      self._event("response.content_part.done", **where, part={"type": "reasoning_text", "text": text})]  # fmt: skip
        item = self._item(kind, status, text)
        events.append(self._event("response.output_item.done", output_index=where["output_index"], item=item))
        self._done.append(item)
        self._open = None
        return events

    def _fail(self, status: int, error: Any) -> list[Event]:
        """``response.failed``: what was said so far, as incomplete items, and why it stopped."""
        self._ended = True
        output = list(self._done)
        if self._open is not None:
            output.append(self._item(self._open, "incomplete", "".join(self._texts[self._open])))
        failed = response_object(self._shell, "failed", output, self._usage, failure(status, error))
        return [self._event("response.failed", response=failed)]

    def _item(self, kind: str, status: str, text: str) -> dict[str, Any]:
        if kind == "message":
            return message_item(self._shell, text, status)
        return reasoning_item(self._shell, text, status)

    def _where(self) -> dict[str, Any]:
        item_id = self._shell.message_id if self._open == "message" else self._shell.reasoning_id
        return {"item_id": item_id, "output_index": len(self._done), "content_index": 0}

    def _event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event
