"""The entry peer's generation loop: prompt tokens in, classified text deltas out.

It owns everything about a generation that is not layer arithmetic: prefill chunking,
incremental UTF-8 decoding, stop strings, end-of-generation tokens, ``max_tokens`` and the
context limit, the reasoning budget (forcing the close tag), usage counts, and freeing the
session on every stage however the loop ends (finished, failed, or cancelled because the
client went away). The pipeline behind it may be local or the whole swarm.
"""

from __future__ import annotations

import codecs
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import trio

from api.reasoning_split import Delta, ReasoningSplitter
from inclavate.errors import InclavateError
from inclavate.pipeline import Pipeline
from inclavate.types import SessionId
from node.sampling import SamplingParams
from node.tokenizer import Tokenizer

FinishReason = Literal["stop", "length"]
Emit = Callable[[Delta], Awaitable[None]]

CLOSE_TIMEOUT = 10.0
"""Seconds allowed to free a session on every stage after the generation ended."""


class PromptTooLong(InclavateError):
    """The prompt leaves no room in the context for even one generated token.

    ``at_least``: ``prompt_tokens`` is a lower bound, known from the prompt's length before
    it was tokenized (:meth:`api.chat_model.ChatModel.refuse_if_it_cannot_fit`)."""

    def __init__(self, prompt_tokens: int, context_length: int, *, at_least: bool = False) -> None:
        self.prompt_tokens = prompt_tokens
        self.context_length = context_length
        super().__init__(
            f"the prompt has {'at least ' if at_least else ''}{prompt_tokens} tokens; this model's "
            f"context holds {context_length}, so shorten the conversation"
        )


@dataclass(frozen=True)
class GenerationParams:
    prompt: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...] = ()
    reasoning_budget: int | None = None
    """Reasoning tokens allowed before ``close_tag_tokens`` are forced (None: no cap)."""
    close_tag_tokens: tuple[int, ...] = ()
    close_tag: str = ""
    prefill_chunk: int = 256
    """Prompt tokens per pipeline step: later stages start on a chunk while the next one
    is still crossing the wire."""


@dataclass(frozen=True)
class GenerationResult:
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int


class _StopFilter:
    """Holds back text that may be the start of a stop string; finds complete ones."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = [s for s in stops if s]
        self._pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Text safe to emit now, and whether a stop string ended the output."""
        self._pending += text
        for stop in self._stops:
            index = self._pending.find(stop)
            if index >= 0:
                out, self._pending = self._pending[:index], ""
                return out, True
        hold = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(self._pending)), hold, -1):
                if self._pending.endswith(stop[:k]):
                    hold = k
                    break
        cut = len(self._pending) - hold
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return out


class Generation:
    def __init__(
        self,
        pipeline: Pipeline,
        tokenizer: Tokenizer,
        session_id: SessionId,
        params: GenerationParams,
        splitter: ReasoningSplitter | None = None,
    ) -> None:
        if len(params.prompt) >= pipeline.context_length:
            raise PromptTooLong(len(params.prompt), pipeline.context_length)
        if not params.prompt:
            raise ValueError("a generation needs at least one prompt token")
        self._pipeline = pipeline
        self._tokenizer = tokenizer
        self.session_id = session_id
        self._params = params
        self._splitter = splitter
        self._stops = _StopFilter(params.stop)
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stopped = False

    async def run(self, emit: Emit) -> GenerationResult:
        """Generate until done, passing every delta to ``emit`` as soon as it is known."""
        try:
            return await self._run(emit)
        finally:
            # Shielded: a cancelled request (client gone) must still free its KV cache.
            with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_TIMEOUT):
                await self._pipeline.close_session(self.session_id)

    async def _run(self, emit: Emit) -> GenerationResult:
        p = self._params
        prompt, pos = list(p.prompt), 0
        while len(prompt) - pos > p.prefill_chunk:
            chunk = prompt[pos : pos + p.prefill_chunk]
            await self._pipeline.step(self.session_id, pos, chunk, None)
            pos += len(chunk)
        pending, completion, reasoning = prompt[pos:], 0, 0
        while True:
            if self._budget_spent(reasoning):
                pending = pending + list(p.close_tag_tokens)
                completion += len(p.close_tag_tokens)
                if await self._emit_text(emit, p.close_tag):
                    return await self._finish(emit, "stop", completion)
            token = await self._pipeline.step(self.session_id, pos, pending, p.sampling)
            assert token is not None
            pos += len(pending)
            if self._tokenizer.is_eog(token):
                return await self._finish(emit, "stop", completion)
            completion += 1
            if await self._emit_text(emit, self._utf8.decode(self._tokenizer.token_bytes(token))):
                return await self._finish(emit, "stop", completion)
            if completion >= p.max_tokens or pos >= self._pipeline.context_length:
                return await self._finish(emit, "length", completion)
            if self._splitter is not None and self._splitter.in_reasoning:
                reasoning += 1
            pending = [token]

    def _budget_spent(self, reasoning_tokens: int) -> bool:
        """Whether to force the reasoning close tag now (budget-mechanism models only)."""
        p = self._params
        return (
            p.reasoning_budget is not None
            and bool(p.close_tag_tokens)
            and self._splitter is not None
            and self._splitter.in_reasoning
            and reasoning_tokens >= p.reasoning_budget
        )

    async def _emit_text(self, emit: Emit, text: str) -> bool:
        """Emit what is safe of ``text``; True when a stop string ended the output."""
        safe, stopped = self._stops.feed(text)
        self._stopped = stopped
        await self._emit_classified(emit, safe)
        return stopped

    async def _emit_classified(self, emit: Emit, text: str, final: bool = False) -> None:
        if self._splitter is None:
            deltas = [Delta("content", text)] if text else []
        else:
            deltas = self._splitter.feed(text) if text else []
            if final:
                deltas += self._splitter.finish()
        for delta in deltas:
            if delta.text:
                await emit(delta)

    async def _finish(self, emit: Emit, reason: FinishReason, completion: int) -> GenerationResult:
        # Text held back as a possible stop-string prefix is released unless a stop string
        # already cut the output there. Bytes the decoder still holds are the start of a
        # character that was never finished (``max_tokens`` cut 🌍 after two of its four
        # bytes): they are dropped, so the reply ends at its last whole character rather
        # than in U+FFFD. Invalid bytes before that were already replaced as they came.
        self._utf8.reset()
        rest = "" if self._stopped else self._stops.flush()
        await self._emit_classified(emit, rest, final=True)
        return GenerationResult(reason, len(self._params.prompt), completion)
