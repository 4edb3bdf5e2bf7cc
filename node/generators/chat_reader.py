"""Understanding jobs addressed to a chat LLM of the swarm (``modality: "text"``).

The swarm's chat models read text only. A job that hands one media (audio, images, ...)
fails with the spec's ``unsupported_input``: refused inside the job, not as an HTTP status,
since the media type is only known once the artifact is read. ``text/*`` inputs are read:
they go to the model in the order given with the prompt last (the spec's order), as one
user turn, and the answer is the job's ``text/plain`` artifact.

The chat itself runs on the event loop (the swarm's pipeline is async): this generator,
called in a worker thread like every other, hands the turn to ``complete`` with
``trio.from_thread.run`` and blocks until it returns. ``complete`` checks the cancel flag
between tokens. It is not one of a peer's installed generators (its own ``capabilities`` is
empty): the generation service lists every chat model a text job may name, as an
understanding generator reading ``text`` and ``ready`` while a chain covers it
(``GenerationService.capabilities``); naming one for media gives the clear job error.

Text that cannot fit the model's context whatever it tokenizes to is refused
(``inference_failed``, as the chat path's own refusal of the prompt was) on its size in bytes, before it is decoded and joined: 16 copies of a
16 MiB upload were decoded, joined and JSON-encoded (+2.8 GB) before the chat path refused
them (an audit, 2026-12-07).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import trio

from inclavate.errors import InclavateError
from node.generators.base import (
    CancelCheck,
    GenerationCancelled,
    GenerationFailed,
    GenerationTask,
    GeneratorOutput,
    InvalidParams,
    Modality,
    ProgressReport,
)
from node.generators.params import optional_int

Complete = Callable[[str, str, Mapping[str, Any], CancelCheck], Awaitable[str]]
"""``(model, user message, params, cancelled) -> answer``: one chat turn on the swarm."""

PromptLimit = Callable[[str], Awaitable[int | None]]
"""``model -> bytes``: the most text a turn of ``model`` can hold (None: unknown)."""

SEPARATOR = "\n\n"

DEFAULT_MAX_TOKENS = 1024


class ChatModelReader:
    modality: Modality = "text"

    def __init__(self, model: str, complete: Complete | None = None, limit: PromptLimit | None = None) -> None:
        self.model = model
        self._complete = complete
        self._limit = limit

    def capabilities(self) -> dict[str, Any]:
        return {}

    def check(self, modality: str, params: Mapping[str, Any], n_inputs: int) -> None:
        if modality != "text":
            raise InvalidParams(f"{self.model} is a chat model; it generates no {modality}")
        optional_int(params, "max_tokens", 1, 32768)
        if params.get("thinking") is not None and not isinstance(params.get("thinking"), bool):
            raise InvalidParams("params.thinking must be true or false")

    def run(self, task: GenerationTask, cancelled: CancelCheck, progress: ProgressReport) -> GeneratorOutput:
        progress("reading_input", 0.0)
        media = sorted({m.media_type for m in task.inputs if not m.media_type.startswith("text/")})
        if media or self._complete is None:
            raise GenerationFailed("unsupported_input", f"{self.model} reads text only and cannot read {', '.join(media) or 'these inputs'}")
        prompt = str(task.params["prompt"])
        self._refuse_if_it_cannot_fit(task, prompt)
        try:
            texts = [m.data.decode("utf-8") for m in task.inputs]
        except UnicodeDecodeError as exc:
            raise GenerationFailed("input_unreadable", f"a text input is not UTF-8: {exc}") from exc
        message = SEPARATOR.join([*texts, prompt])
        progress("understanding", 0.0)
        try:
            answer = trio.from_thread.run(self._complete, self.model, message, task.params, cancelled)
        except (GenerationCancelled, GenerationFailed):
            raise
        except InclavateError as exc:  # no route, the chain failed, the prompt is too long, ...
            raise GenerationFailed("inference_failed", str(exc)) from exc
        progress("publishing", 1.0)
        return GeneratorOutput(answer.encode(), "text/plain; charset=utf-8")

    def _refuse_if_it_cannot_fit(self, task: GenerationTask, prompt: str) -> None:
        """``inference_failed`` for a message longer in bytes than the model's context can hold
        (the chat route's own bound), judged on the inputs' sizes before any is decoded."""
        limit = None if self._limit is None else trio.from_thread.run(self._limit, self.model)
        size = sum(len(m.data) for m in task.inputs) + len(SEPARATOR) * len(task.inputs) + len(prompt.encode())
        if limit is not None and size > limit:
            raise GenerationFailed("inference_failed", f"the inputs and prompt are {size} bytes; {self.model}'s context "
                                   f"cannot hold more than {limit} bytes of text, however it tokenizes")  # fmt: skip

    def close(self) -> None:
        pass
