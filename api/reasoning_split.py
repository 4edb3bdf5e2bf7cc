"""Splitting generated text into the reasoning span and the answer, as it streams."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Literal, NamedTuple

from api.reasoning import ReasoningSupport

__all__ = ["Delta", "ReasoningSplitter", "collect"]


class Delta(NamedTuple):
    """A classified piece of generated text: one SSE delta, or a part of the final message."""

    kind: Literal["reasoning", "content"]
    text: str


class _Phase(enum.Enum):
    START = "start"  # nothing visible yet: the output may still open a reasoning span
    REASONING = "reasoning"
    CONTENT = "content"


class ReasoningSplitter:
    """Separates the reasoning span from the answer in generated text, piece by piece.

    Token boundaries ignore tags (``</think>`` may arrive as ``</`` + ``think>``), so a
    tail that could still become a tag is held back until the next piece decides it.
    Templates surround the tags with newlines; whitespace at both ends of the reasoning
    and at the start of the answer is dropped, held back the same way, so the streamed
    deltas concatenate to exactly the non-streaming split. Only a span at the very start
    of the output (or opened by the prompt) is reasoning; tags later on are answer text.
    """

    def __init__(
        self,
        open_tag: str | None = None,
        close_tag: str | None = None,
        *,
        in_reasoning: bool = False,
    ) -> None:
        if (open_tag is None) != (close_tag is None):
            raise ValueError("open_tag and close_tag come as a pair")
        if in_reasoning and close_tag is None:
            raise ValueError("in_reasoning needs the tags that close the span")
        self._open = open_tag
        self._close = close_tag
        if in_reasoning:
            self._phase = _Phase.REASONING
        else:
            self._phase = _Phase.START if open_tag is not None else _Phase.CONTENT
        self._trim = in_reasoning  # drop whitespace at the start of the current phase
        self._pending = ""  # held back: a possible partial tag, or whitespace at an edge
        self._finished = False

    @classmethod
    def for_prompt(cls, support: ReasoningSupport, prompt: str) -> ReasoningSplitter:
        """A splitter for the output that continues ``prompt``.

        Starts inside the span when the prompt's generation prefix left it open
        (DeepSeek-R1's ``<think>\\n``), outside when it opened and closed it (thinking off).
        """
        if support.open_tag is None or support.close_tag is None:
            return cls()
        opened = prompt.rfind(support.open_tag) > prompt.rfind(support.close_tag)
        return cls(support.open_tag, support.close_tag, in_reasoning=opened)

    @property
    def in_reasoning(self) -> bool:
        """True while generated tokens count against a reasoning budget."""
        return self._phase is _Phase.REASONING

    def feed(self, text: str) -> list[Delta]:
        """Classify the next generated piece; returns what can be emitted now."""
        if self._finished:
            raise RuntimeError("feed() after finish()")
        self._pending += text
        out: list[Delta] = []
        while self._advance(out):
            pass
        return _merged(out)

    def finish(self) -> list[Delta]:
        """Flush what was held back once generation has ended (a cut-off tag is text)."""
        if self._finished:
            return []
        self._finished = True
        rest, self._pending = self._pending, ""
        if self._phase is _Phase.REASONING:
            return _merged([Delta("reasoning", rest.rstrip())])
        if self._phase is _Phase.CONTENT and self._trim:
            return []  # only whitespace after the close tag
        return _merged([Delta("content", rest)])

    def _advance(self, out: list[Delta]) -> bool:
        """Move what ``_pending`` decides into ``out``; True when the phase changed."""
        if self._phase is _Phase.START:
            return self._advance_start()
        if self._trim:
            self._pending = self._pending.lstrip()
            if not self._pending:
                return False
            self._trim = False
        if self._phase is _Phase.CONTENT:
            out.append(Delta("content", self._pending))
            self._pending = ""
            return False
        return self._advance_reasoning(out)

    def _advance_start(self) -> bool:
        assert self._open is not None
        head = self._pending.lstrip()
        if head.startswith(self._open):
            self._pending = head[len(self._open) :]
            self._phase, self._trim = _Phase.REASONING, True
            return True
        if self._open.startswith(head):  # only whitespace or a partial tag so far
            return False
        self._phase = _Phase.CONTENT
        return True

    def _advance_reasoning(self, out: list[Delta]) -> bool:
        assert self._close is not None
        end = self._pending.find(self._close)
        if end >= 0:
            out.append(Delta("reasoning", self._pending[:end].rstrip()))
            self._pending = self._pending[end + len(self._close) :]
            self._phase, self._trim = _Phase.CONTENT, True
            return True
        undecided = len(self._pending) - _partial_tag_length(self._pending, self._close)
        emit = len(self._pending[:undecided].rstrip())
        out.append(Delta("reasoning", self._pending[:emit]))
        self._pending = self._pending[emit:]
        return False


def collect(deltas: Sequence[Delta]) -> tuple[str | None, str]:
    """Join deltas into ``(reasoning_content, content)``; reasoning is None if there was none."""
    reasoning = "".join(d.text for d in deltas if d.kind == "reasoning")
    content = "".join(d.text for d in deltas if d.kind == "content")
    return reasoning or None, content


def _partial_tag_length(text: str, tag: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``tag``."""
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


def _merged(deltas: list[Delta]) -> list[Delta]:
    merged: list[Delta] = []
    for delta in deltas:
        if not delta.text:
            continue
        if merged and merged[-1].kind == delta.kind:
            merged[-1] = Delta(delta.kind, merged[-1].text + delta.text)
        else:
            merged.append(delta)
    return merged
