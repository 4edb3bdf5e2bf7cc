"""Reasoning control probed from templates, request validation, and the streaming splitter."""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections.abc import Sequence

import pytest
from templates import TEST_TEMPLATES, load, smollm2_metadata

from api.chat_template import ChatTemplate, TemplateError
from api.reasoning import (
    BUDGET_TOKENS,
    ConflictingReasoning,
    InvalidReasoningEffort,
    ReasoningRequestError,
    ReasoningSupport,
    probe_reasoning,
    resolve_reasoning,
)
from api.reasoning_split import Delta, ReasoningSplitter, collect

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2 + 2?"},
]
BUDGET_LEVELS = ("low", "medium", "high", "max")
THINK = {"open_tag": "<think>", "close_tag": "</think>"}

EXPECTED = {
    "chatml": ReasoningSupport("none"),
    "tools_llama3": ReasoningSupport("none"),
    "native_effort": ReasoningSupport(
        "native",
        ("low", "medium", "high"),
        "reasoning_effort",
        **THINK,
        toggle_variable="enable_thinking",
        default_thinking=True,
    ),
    "native_strength": ReasoningSupport(
        "native", ("low", "medium", "high", "max"), "reasoning_strength", default_thinking=True
    ),
    "budget_r1": ReasoningSupport("budget", BUDGET_LEVELS, **THINK, default_thinking=True),
    "toggle_qwen3": ReasoningSupport(
        "budget", BUDGET_LEVELS, **THINK, toggle_variable="enable_thinking", default_thinking=True
    ),
    "toggle_default_off": ReasoningSupport(
        "budget", BUDGET_LEVELS, **THINK, toggle_variable="thinking", default_thinking=False
    ),
}


def _template(name: str) -> ChatTemplate:
    return ChatTemplate(load(name), "<s>", "</s>")


def _support(name: str) -> ReasoningSupport:
    return probe_reasoning(_template(name))


# --- probe_reasoning ---------------------------------------------------------------------


def test_every_test_template_has_an_expectation() -> None:
    assert set(EXPECTED) == set(TEST_TEMPLATES)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_probe(name: str) -> None:
    support = _support(name)
    assert support == EXPECTED[name]
    assert support.thinking_toggle == (support.toggle_variable is not None)
    assert "none" not in support.levels


def test_probe_smollm2_has_no_reasoning(smollm2) -> None:
    metadata = smollm2_metadata(smollm2.path)
    assert probe_reasoning(ChatTemplate.from_gguf_metadata(metadata)) == ReasoningSupport("none")


def test_value_printed_verbatim_is_a_level_but_none_is_never_listed() -> None:
    # gpt-oss style: the default level renders the same as no variable, but is printed.
    source = (
        "{% set effort = reasoning_effort if reasoning_effort is defined else 'medium' %}"
        "Reasoning: {{ effort }}\n{% for m in messages %}{{ m.content }}\n{% endfor %}"
    )
    support = probe_reasoning(ChatTemplate(source, "", ""))
    assert support.mechanism == "native"
    assert support.levels == ("minimal", "low", "medium", "high", "xhigh", "max")


def test_read_but_ignored_variable_is_no_level() -> None:
    # "low" occurs inside "below" and "max" inside "maximum": whole words only.
    source = (
        "{% if reasoning_effort is defined %}{% endif %}Answer below, maximum care.\n"
        "{% for m in messages %}{{ m.content }}\n{% endfor %}"
    )
    assert probe_reasoning(ChatTemplate(source, "", "")) == ReasoningSupport("none")


def test_effort_variable_that_always_raises_falls_back_to_budget() -> None:
    source = (
        "{% if reasoning_effort is defined %}{{ raise_exception('no') }}{% endif %}"
        "{% for m in messages %}{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}<think>\n{% endif %}"
    )
    support = probe_reasoning(ChatTemplate(source, "", ""))
    assert (support.mechanism, support.levels) == ("budget", BUDGET_LEVELS)


def test_probe_falls_back_when_the_template_refuses_a_system_turn() -> None:
    source = (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
        "{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}"
        "{% if reasoning_effort is defined %}[{{ reasoning_effort }}]{% endif %}"
    )
    assert probe_reasoning(ChatTemplate(source, "", "")).mechanism == "native"


def test_probe_of_a_template_that_renders_nothing_raises() -> None:
    with pytest.raises(TemplateError, match="no probe conversation: always"):
        probe_reasoning(ChatTemplate("{{ raise_exception('always') }}", "", ""))


# --- resolve_reasoning -------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_omitted_fields_render_exactly_as_without_them(name: str) -> None:
    template = _template(name)
    plan = resolve_reasoning(probe_reasoning(template), None, None)
    assert dict(plan.template_vars) == {}
    assert (plan.thinking, plan.effort, plan.budget_tokens, plan.close_tag) == (None,) * 4
    assert template.render(CONVERSATION, extra=plan.template_vars) == template.render(CONVERSATION)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_none_is_accepted_everywhere_and_never_reaches_the_template(name: str) -> None:
    support = _support(name)
    plan = resolve_reasoning(support, None, "none")
    assert plan.thinking is False and plan.effort is None
    assert support.variable not in plan.template_vars
    _template(name).render(CONVERSATION, extra=plan.template_vars)


@pytest.mark.parametrize(
    ("name", "effort", "accepted"),
    [
        ("native_effort", "max", "'none', 'low', 'medium', 'high'"),
        ("native_effort", "minimal", "'none', 'low', 'medium', 'high'"),
        ("budget_r1", "xhigh", "'none', 'low', 'medium', 'high', 'max'"),
        ("chatml", "low", "'none'"),
    ],
)
def test_unknown_levels_are_rejected_listing_what_the_model_accepts(
    name: str, effort: str, accepted: str
) -> None:
    support = _support(name)
    with pytest.raises(InvalidReasoningEffort) as caught:
        resolve_reasoning(support, None, effort)
    assert caught.value.effort == effort
    assert caught.value.levels == support.levels
    assert str(caught.value).endswith(f"it accepts {accepted}")


def test_thinking_true_with_effort_none_conflicts() -> None:
    with pytest.raises(ConflictingReasoning) as caught:
        resolve_reasoning(_support("toggle_qwen3"), True, "none")
    assert isinstance(caught.value, ReasoningRequestError)


def test_native_level_reaches_the_template() -> None:
    template = _template("native_effort")
    plan = resolve_reasoning(probe_reasoning(template), None, "high")
    assert dict(plan.template_vars) == {"reasoning_effort": "high"}
    assert plan.budget_tokens is None and plan.close_tag is None
    assert "Think very carefully" in template.render(CONVERSATION, extra=plan.template_vars)


@pytest.mark.parametrize("level", BUDGET_LEVELS)
def test_budget_level_becomes_a_token_cap(level: str) -> None:
    plan = resolve_reasoning(_support("budget_r1"), None, level)
    assert dict(plan.template_vars) == {}
    assert plan.budget_tokens == BUDGET_TOKENS[level]
    assert plan.close_tag == ("</think>" if BUDGET_TOKENS[level] is not None else None)
    assert (BUDGET_TOKENS["low"], BUDGET_TOKENS["medium"], BUDGET_TOKENS["high"]) == (
        512,
        2048,
        8192,
    )


def test_thinking_off_uses_the_templates_toggle() -> None:
    template = _template("toggle_qwen3")
    plan = resolve_reasoning(probe_reasoning(template), False, "high")
    assert dict(plan.template_vars) == {"enable_thinking": False}
    assert plan.budget_tokens is None
    assert template.render(CONVERSATION, extra=plan.template_vars).endswith(
        "<think>\n\n</think>\n\n"
    )


def test_thinking_off_without_a_toggle_closes_the_span_at_once() -> None:
    plan = resolve_reasoning(_support("budget_r1"), False, None)
    assert (dict(plan.template_vars), plan.budget_tokens, plan.close_tag) == ({}, 0, "</think>")


def test_thinking_on_flips_a_default_off_toggle() -> None:
    template = _template("toggle_default_off")
    plan = resolve_reasoning(probe_reasoning(template), True, "medium")
    assert dict(plan.template_vars) == {"thinking": True}
    assert plan.budget_tokens == 2048
    assert template.render(CONVERSATION, extra=plan.template_vars).endswith("<think>")


def test_thinking_and_native_level_are_independent() -> None:
    plan = resolve_reasoning(_support("native_effort"), False, "low")
    assert dict(plan.template_vars) == {"enable_thinking": False, "reasoning_effort": "low"}


def test_plan_is_immutable() -> None:
    plan = resolve_reasoning(_support("native_effort"), None, "low")
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.budget_tokens = 5  # type: ignore[misc]
    with pytest.raises(TypeError):
        plan.template_vars["x"] = 1  # type: ignore[index]


# --- ReasoningSplitter -------------------------------------------------------------------


def _run(pieces: Sequence[str], *, in_reasoning: bool = False, **tags: str) -> list[Delta]:
    splitter = ReasoningSplitter(**(tags or THINK), in_reasoning=in_reasoning)
    deltas = [delta for piece in pieces for delta in splitter.feed(piece)]
    return deltas + splitter.finish()


def _chunkings(text: str) -> list[list[str]]:
    """Whole, one piece per character, every split in two or three, and random splits."""
    cuts = range(1, len(text))
    splits = [[text], list(text)]
    for count in (1, 2):
        for points in itertools.combinations(cuts, count):
            bounds = (0, *points, len(text))
            splits.append([text[a:b] for a, b in itertools.pairwise(bounds)])
    rng = random.Random(1234)
    for _ in range(50):
        points = sorted(rng.sample(cuts, min(len(cuts), rng.randint(1, 8))))
        bounds = (0, *points, len(text))
        splits.append([text[a:b] for a, b in itertools.pairwise(bounds)])
    return splits


SPLIT_CASES = [
    # (text, starts inside the span, expected (reasoning_content, content))
    (
        "Let me think.\nOK.\n</think>\n\nThe answer is 4.",
        True,
        ("Let me think.\nOK.", "The answer is 4."),
    ),
    ("<think>\nhmm, 2+2\n</think>\n\n4", False, ("hmm, 2+2", "4")),
    ("\n\n<think>x</think>y", False, ("x", "y")),
    ("<think>\n\n</think>\n\nHi", False, (None, "Hi")),
    ("Hello <think> there</think>", False, (None, "Hello <think> there</think>")),
    ("<thin air", False, (None, "<thin air")),
    ("a</think>b</think>c", True, ("a", "b</think>c")),
    ("a < b and </thinking> is not it</think>ok", True, ("a < b and </thinking> is not it", "ok")),
    ("still thinking </thi", True, ("still thinking </thi", None)),
    ("<think>cut off mid-thought  \n", False, ("cut off mid-thought", None)),
    ("", True, (None, None)),
    ("  ", False, (None, "  ")),
]


@pytest.mark.parametrize(("text", "in_reasoning", "expected"), SPLIT_CASES)
def test_split_is_the_same_for_every_chunking(
    text: str, in_reasoning: bool, expected: tuple[str | None, str | None]
) -> None:
    reasoning, content = expected
    for pieces in _chunkings(text):
        deltas = _run(pieces, in_reasoning=in_reasoning)
        assert collect(deltas) == (reasoning, content or ""), pieces
        assert all(delta.text for delta in deltas)


def test_other_tag_pairs_split_across_pieces() -> None:
    tags = {"open_tag": "\u25c1think\u25b7", "close_tag": "\u25c1/think\u25b7"}
    text = "\u25c1think\u25b7pondering\u25c1/think\u25b7answer"
    for pieces in _chunkings(text):
        assert collect(_run(pieces, **tags)) == ("pondering", "answer")


def test_reasoning_streams_before_the_close_tag_arrives() -> None:
    splitter = ReasoningSplitter(**THINK, in_reasoning=True)
    assert splitter.in_reasoning
    assert splitter.feed("\nLet me ") == [Delta("reasoning", "Let me")]  # the space waits
    assert splitter.feed("see</") == [Delta("reasoning", " see")]  # "</" may be the tag
    assert splitter.feed("think>\n\nFour") == [Delta("content", "Four")]
    assert not splitter.in_reasoning
    assert splitter.feed(".") == [Delta("content", ".")]
    assert splitter.finish() == []
    with pytest.raises(RuntimeError):
        splitter.feed("more")


def test_splitter_without_tags_passes_everything_through() -> None:
    splitter = ReasoningSplitter()
    assert splitter.feed("  <think>x</think>") == [Delta("content", "  <think>x</think>")]
    assert not splitter.in_reasoning


@pytest.mark.parametrize(
    ("name", "thinking", "inside"),
    [
        ("budget_r1", None, True),  # the generation prompt opens <think>
        ("toggle_qwen3", False, False),  # ... or opens and closes it
        ("toggle_qwen3", None, False),  # the model may still open it itself
        ("toggle_default_off", True, True),
        ("toggle_default_off", None, False),
    ],
)
def test_for_prompt_knows_whether_the_prompt_opened_the_span(
    name: str, thinking: bool | None, inside: bool
) -> None:
    template = _template(name)
    support = probe_reasoning(template)
    plan = resolve_reasoning(support, thinking, None)
    prompt = template.render(CONVERSATION, extra=plan.template_vars)
    assert ReasoningSplitter.for_prompt(support, prompt).in_reasoning is inside


def test_for_prompt_on_a_model_without_tags_is_pass_through() -> None:
    splitter = ReasoningSplitter.for_prompt(ReasoningSupport("none"), "<think>")
    assert collect(splitter.feed("<think>a</think>b") + splitter.finish()) == (
        None,
        "<think>a</think>b",
    )


def test_splitter_rejects_half_a_tag_pair() -> None:
    with pytest.raises(ValueError):
        ReasoningSplitter("<think>", None)
    with pytest.raises(ValueError):
        ReasoningSplitter(in_reasoning=True)
