"""A model as the entry peer sees it: vocabulary, chat template and reasoning controls.

Everything here comes from the GGUF's metadata (a vocab-only load), so any peer can prepare
a prompt for any model, whether or not it holds any of the model's layers. Built once per
model and shared by every request.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from api.chat_template import ChatTemplate, TemplateError
from api.generation import GenerationParams, PromptTooLong
from api.reasoning import ReasoningPlan, ReasoningSupport, probe_reasoning, resolve_reasoning
from api.reasoning_split import ReasoningSplitter
from inclavate.types import ModelId
from node.sampling import SamplingParams
from node.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# What llama.cpp falls back to for a model without a template.
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class PreparedPrompt:
    text: str
    tokens: tuple[int, ...]
    plan: ReasoningPlan
    splitter: ReasoningSplitter | None


class ChatModel:
    def __init__(self, model_id: ModelId, tokenizer: Tokenizer, template: ChatTemplate) -> None:
        self.model_id = model_id
        self.tokenizer = tokenizer
        self.template = template
        self.reasoning: ReasoningSupport = probe_reasoning(template)
        self.max_bytes_per_token = tokenizer.max_bytes_per_token()

    @classmethod
    def load(cls, model_id: ModelId, gguf_path: Path) -> ChatModel:
        tokenizer = Tokenizer(gguf_path)
        metadata = {
            "tokenizer.chat_template": tokenizer.metadata("tokenizer.chat_template"),
            "bos_token": tokenizer.token_text(tokenizer.bos_id) if tokenizer.bos_id >= 0 else "",
            "eos_token": tokenizer.token_text(tokenizer.eos_id) if tokenizer.eos_id >= 0 else "",
        }
        try:
            template = ChatTemplate.from_gguf_metadata(metadata)
        except TemplateError:
            log.warning("%s has no chat template; using ChatML as llama.cpp does", model_id)
            template = ChatTemplate(CHATML, metadata["bos_token"], metadata["eos_token"])
        return cls(model_id, tokenizer, template)

    @property
    def reasoning_levels(self) -> list[str]:
        return list(self.reasoning.levels)

    @property
    def supports_tools(self) -> bool:
        """Whether the template renders a ``tools`` list (otherwise tools would be ignored)."""
        return "tools" in self.template.variables

    @property
    def input_modalities(self) -> frozenset[str]:
        return frozenset({"text"})

    def refuse_if_it_cannot_fit(self, chars: int, context_length: int) -> None:
        """Raise :class:`PromptTooLong` for a conversation too long for the context whatever
        it tokenizes to, judged on length alone, before that work (seconds for megabytes of
        text, which any client may send).

        ``chars``: characters the rendered prompt holds at least: its user text before
        rendering (see ``api.chat_job``), the rendered text itself before tokenizing (see
        :meth:`prepare`). Characters are at most bytes and a token stands for at most
        :attr:`max_bytes_per_token` of them, so the prompt has at least ``chars /
        max_bytes_per_token`` tokens; past ``context_length - 1`` tokens it is refused
        anyway (:class:`api.generation.Generation`). Never refuses a prompt that fits."""
        limit = self.max_prompt_bytes(context_length)
        if limit is not None and chars > limit:
            raise PromptTooLong(-(-chars // self.max_bytes_per_token), context_length, at_least=True)  # type: ignore[operator]

    def max_prompt_bytes(self, context_length: int) -> int | None:
        """Bytes (or characters, fewer) of prompt past which no tokenization fits
        ``context_length - 1`` tokens: a token stands for at most :attr:`max_bytes_per_token`
        bytes. None when the vocabulary does not say."""
        per_token = self.max_bytes_per_token
        return per_token * (context_length - 1) if per_token else None

    def prepare(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        thinking: bool | None = None,
        reasoning_effort: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: Any = None,
        context_length: int | None = None,
    ) -> PreparedPrompt:
        """Render and tokenize a conversation; raises the reasoning errors for bad levels.

        With ``context_length``, a rendered prompt too long for it on its length alone is
        refused before it is tokenized: the check before rendering sees only user text, and
        a 20 MB system message, an earlier answer or a tool result held a preparation
        thread ~7 s in the tokenizer (rendering it takes ~0.06 s)."""
        plan = resolve_reasoning(self.reasoning, thinking, reasoning_effort)
        text = self.template.render(messages, tools=tools, tool_choice=tool_choice, extra=plan.template_vars)
        if context_length is not None:
            self.refuse_if_it_cannot_fit(len(text), context_length)
        tokens = self.tokenizer.tokenize(text, add_special=True, parse_special=True)
        # The template may already spell BOS; a second one from the tokenizer changes the
        # model's input (llama.cpp's server drops it the same way).
        bos = self.tokenizer.bos_id
        if len(tokens) > 1 and tokens[0] == bos and tokens[1] == bos:
            tokens = tokens[1:]
        splitter = (
            ReasoningSplitter.for_prompt(self.reasoning, text)
            if self.reasoning.open_tag
            else None
        )
        return PreparedPrompt(text, tuple(tokens), plan, splitter)

    def generation_params(
        self,
        prompt: PreparedPrompt,
        *,
        max_tokens: int,
        temperature: float,
        top_p: float,
        seed: int | None,
        stop: Sequence[str] = (),
    ) -> GenerationParams:
        plan = prompt.plan
        close_text = plan.close_tag or ""
        close_tokens = tuple(self.tokenizer.tokenize(close_text)) if close_text else ()
        return GenerationParams(
            prompt=prompt.tokens,
            max_tokens=max_tokens,
            sampling=SamplingParams(
                temperature=temperature,
                top_p=top_p,
                seed=seed if seed is not None else secrets.randbits(63),
            ),
            stop=tuple(stop),
            reasoning_budget=plan.budget_tokens,
            close_tag_tokens=close_tokens,
            close_tag=close_text,
        )

    def close(self) -> None:
        self.tokenizer.close()
