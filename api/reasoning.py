"""How a model's reasoning is controlled, derived from its chat template alone.

The spec (``GET /api/models``, ``reasoning_effort``) names two mechanisms. *Native*: the
template reads an effort variable, so the level is handed to it and means what the model
was trained to make it mean. *Budget*: the model reasons between tags but its template
offers no control, so a level caps the reasoning span and the generation loop forces the
close tag. Support does not follow architecture, so we find out by rendering, once, when
the model loads (:func:`probe_reasoning`); each request is then checked and turned into
template variables and a token budget (:func:`resolve_reasoning`); generated text is
split into reasoning and answer as it streams (``api.reasoning_split``).

Exception tree::

    InclavateError
    └── ReasoningRequestError       thinking / reasoning_effort cannot be applied
        ├── InvalidReasoningEffort     the level is not one this model accepts
        └── ConflictingReasoning       thinking=true together with reasoning_effort="none"
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from api.chat_template import ChatTemplate, TemplateError
from inclavate.errors import InclavateError

__all__ = [
    "BUDGET_TOKENS",
    "REASONING_OFF",
    "ConflictingReasoning",
    "InvalidReasoningEffort",
    "ReasoningPlan",
    "ReasoningRequestError",
    "ReasoningSupport",
    "probe_reasoning",
    "resolve_reasoning",
]

Mechanism = Literal["native", "budget", "none"]

REASONING_OFF = "none"
"""Accepted on every model: reasoning off. Never probed, never passed to a template."""

EFFORT_VARIABLES = ("reasoning_effort", "reasoning_strength")
TOGGLE_VARIABLES = ("enable_thinking", "thinking")

# Candidate native levels, weakest first; the order is the order levels are listed in.
CANDIDATE_LEVELS = ("minimal", "low", "medium", "high", "xhigh", "max")

BUDGET_TOKENS: Mapping[str, int | None] = MappingProxyType(
    {"low": 512, "medium": 2048, "high": 8192, "max": None}
)
"""Budget mechanism: level -> reasoning tokens before the close tag is forced (None: no cap)."""

# Reasoning span delimiters seen in released templates. No pair is a substring of
# another, so the first match is unambiguous.
TAG_PAIRS = (
    ("<think>", "</think>"),
    ("<thinking>", "</thinking>"),
    ("<seed:think>", "</seed:think>"),
    ("<reasoning>", "</reasoning>"),
    ("[THINK]", "[/THINK]"),
    ("\u25c1think\u25b7", "\u25c1/think\u25b7"),
)

# Probe conversations, tried in order: some templates refuse a system turn.
_QUESTION = {"role": "user", "content": "What is 2 + 2?"}
_PROBES: tuple[tuple[dict[str, str], ...], ...] = (
    ({"role": "system", "content": "You are a careful assistant."}, _QUESTION),
    (_QUESTION,),
)


class ReasoningRequestError(InclavateError):
    """A request's ``thinking`` / ``reasoning_effort`` cannot be applied to this model."""


class InvalidReasoningEffort(ReasoningRequestError):
    """The level is neither "none" nor one of the model's levels (the spec's 400)."""

    def __init__(self, effort: str, levels: Sequence[str]) -> None:
        self.effort = effort
        self.levels = tuple(levels)
        accepted = ", ".join(repr(level) for level in (REASONING_OFF, *self.levels))
        super().__init__(
            f"reasoning_effort {effort!r} is not supported by this model; it accepts {accepted}"
        )


class ConflictingReasoning(ReasoningRequestError):
    """``thinking: true`` asks for reasoning that ``reasoning_effort: "none"`` turns off."""

    def __init__(self) -> None:
        super().__init__(
            'thinking=true contradicts reasoning_effort="none", which turns reasoning off'
        )


@dataclass(frozen=True)
class ReasoningSupport:
    """What one model's template lets a request control; computed once at load."""

    mechanism: Mechanism
    levels: tuple[str, ...] = ()
    variable: str | None = None
    open_tag: str | None = None
    close_tag: str | None = None
    toggle_variable: str | None = None
    default_thinking: bool = False

    @property
    def thinking_toggle(self) -> bool:
        """Whether the template reads ``enable_thinking`` / ``thinking``."""
        return self.toggle_variable is not None


@dataclass(frozen=True)
class ReasoningPlan:
    """How to apply one request: template variables plus what the generation loop enforces.

    ``budget_tokens`` is the number of reasoning tokens after which the loop must emit
    ``close_tag``; 0 means reasoning is off on a model whose template cannot say so, so
    the span is closed as soon as it is open. None: no cap.
    """

    template_vars: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    thinking: bool | None = None
    effort: str | None = None
    budget_tokens: int | None = None
    close_tag: str | None = None


def probe_reasoning(template: ChatTemplate) -> ReasoningSupport:
    """Find the model's reasoning controls by rendering a probe conversation.

    Raises :class:`TemplateError` when the template renders no probe conversation at all:
    such a model cannot serve a chat request either.
    """
    conversation = _probe_conversation(template)
    tags = _reasoning_tags(template, conversation)
    toggle = next((name for name in TOGGLE_VARIABLES if name in template.variables), None)
    variable, levels = _native_levels(template, conversation)
    if variable is not None:
        mechanism: Mechanism = "native"
    elif tags is not None:
        mechanism, levels = "budget", tuple(BUDGET_TOKENS)
    else:
        mechanism = "none"
    return ReasoningSupport(
        mechanism=mechanism,
        levels=levels,
        variable=variable,
        open_tag=tags[0] if tags else None,
        close_tag=tags[1] if tags else None,
        toggle_variable=toggle,
        default_thinking=_default_thinking(template, conversation, tags, toggle, variable),
    )


def resolve_reasoning(
    support: ReasoningSupport, thinking: bool | None, reasoning_effort: str | None
) -> ReasoningPlan:
    """Validate a request's fields and turn them into a :class:`ReasoningPlan`.

    Both omitted gives an empty plan, so the prompt renders exactly as it did before the
    fields existed. ``thinking`` decides whether, the level how hard; "none" sets the first.
    Thinking off goes through the template's toggle when it has one, else through a
    zero budget on its close tag; a model with neither (gpt-oss) cannot be stopped from
    reasoning, and the plan's ``thinking`` only records what was asked.
    """
    if reasoning_effort == REASONING_OFF:
        if thinking is True:
            raise ConflictingReasoning()
        thinking, level = False, None
    elif reasoning_effort is not None and reasoning_effort not in support.levels:
        raise InvalidReasoningEffort(reasoning_effort, support.levels)
    else:
        level = reasoning_effort

    variables: dict[str, Any] = {}
    if thinking is not None and support.toggle_variable is not None:
        variables[support.toggle_variable] = thinking
    if level is not None and support.mechanism == "native" and support.variable is not None:
        variables[support.variable] = level

    budget: int | None = None
    if thinking is False:
        # Off, and the template has no switch: close the span before it says anything.
        if support.toggle_variable is None and support.close_tag is not None:
            budget = 0
    elif level is not None and support.mechanism == "budget":
        budget = BUDGET_TOKENS[level]
    return ReasoningPlan(
        template_vars=MappingProxyType(variables),
        thinking=thinking,
        effort=level,
        budget_tokens=budget,
        close_tag=support.close_tag if budget is not None else None,
    )


def _probe_conversation(template: ChatTemplate) -> tuple[dict[str, str], ...]:
    failure: TemplateError | None = None
    for conversation in _PROBES:
        try:
            template.render(list(conversation))
        except TemplateError as exc:
            failure = exc
        else:
            return conversation
    assert failure is not None
    raise TemplateError(f"chat template renders no probe conversation: {failure.message}")


def _render(template: ChatTemplate, conversation: Sequence[dict[str, str]], **extra: Any) -> str:
    return template.render(list(conversation), extra=extra)


def _generation_suffix(template: ChatTemplate, conversation: Sequence[dict[str, str]]) -> str:
    """What ``add_generation_prompt`` appends: where templates pre-open (or close) the span."""
    with_prompt = template.render(list(conversation), add_generation_prompt=True)
    without = template.render(list(conversation), add_generation_prompt=False)
    if with_prompt.startswith(without):
        return with_prompt[len(without) :]
    return with_prompt  # the flag also changed earlier text: search all of it


def _reasoning_tags(
    template: ChatTemplate, conversation: Sequence[dict[str, str]]
) -> tuple[str, str] | None:
    suffix = _generation_suffix(template, conversation)
    for open_tag, close_tag in TAG_PAIRS:
        declared = open_tag in template.source and close_tag in template.source
        if declared or open_tag in suffix:
            return open_tag, close_tag
    return None


def _native_levels(
    template: ChatTemplate, conversation: Sequence[dict[str, str]]
) -> tuple[str | None, tuple[str, ...]]:
    baseline = _render(template, conversation)
    for variable in EFFORT_VARIABLES:
        if variable not in template.variables:
            continue
        levels = tuple(
            value
            for value in CANDIDATE_LEVELS
            if _is_level(template, conversation, variable, value, baseline)
        )
        if levels:
            return variable, levels
    return None, ()


def _is_level(
    template: ChatTemplate,
    conversation: Sequence[dict[str, str]],
    variable: str,
    value: str,
    baseline: str,
) -> bool:
    # A template that raises on a value rejects it. One that accepts it shows so either by
    # rendering differently or by printing it (gpt-oss-style "Reasoning: medium", where the
    # default level renders the same as no variable at all). Whole words only: "low" must
    # not be found in "below".
    try:
        rendered = _render(template, conversation, **{variable: value})
    except TemplateError:
        return False
    return rendered != baseline or re.search(rf"\b{re.escape(value)}\b", rendered) is not None


def _default_thinking(
    template: ChatTemplate,
    conversation: Sequence[dict[str, str]],
    tags: tuple[str, str] | None,
    toggle: str | None,
    variable: str | None,
) -> bool:
    """Whether the model reasons when a request says nothing."""
    if toggle is not None:
        baseline = _render(template, conversation)
        try:
            on = _render(template, conversation, **{toggle: True})
            off = _render(template, conversation, **{toggle: False})
        except TemplateError:
            on = off = baseline
        if on != off and baseline in (on, off):
            return baseline == on
    if tags is not None:
        # A generation prompt that already closes the span (Qwen3's empty
        # "<think>\n\n</think>") means reasoning is off by default.
        return tags[1] not in _generation_suffix(template, conversation)
    return variable is not None
