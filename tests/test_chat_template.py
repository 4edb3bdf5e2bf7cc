"""ChatTemplate renders byte for byte what llama-cpp-python's Jinja2ChatFormatter renders."""

from __future__ import annotations

import datetime
from typing import Any

import pytest
from templates import TEST_TEMPLATES, load, smollm2_metadata

from api.chat_template import ChatTemplate, TemplateError

BOS, EOS = "<s>", "</s>"

SYSTEM = {"role": "system", "content": "You are terse."}
USER = {"role": "user", "content": "What is 2 + 2?"}
ASSISTANT = {"role": "assistant", "content": "<think>\nEasy.\n</think>\n\n4"}
FOLLOW_UP = {"role": "user", "content": "  Unicode: héllo 🌍 <b>&amp;</b>\n"}

CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "user": [USER],
    "system": [SYSTEM, USER],
    "multi_turn": [SYSTEM, USER, ASSISTANT, FOLLOW_UP],
    "no_system_multi_turn": [USER, ASSISTANT, FOLLOW_UP],
}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Finds <things> & stuff, café",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def smollm2_meta(smollm2) -> dict[str, Any]:
    return smollm2_metadata(smollm2.path)


def _templates(smollm2_meta: dict[str, Any]) -> dict[str, ChatTemplate]:
    templates = {name: ChatTemplate(load(name), BOS, EOS) for name in TEST_TEMPLATES}
    templates["smollm2"] = ChatTemplate.from_gguf_metadata(smollm2_meta)
    return templates


def _reference(template: ChatTemplate, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    """What llama-cpp-python renders, or the message of the error it raises."""
    chat_format = pytest.importorskip("llama_cpp.llama_chat_format")
    add_generation_prompt = kwargs.pop("add_generation_prompt", True)
    formatter = chat_format.Jinja2ChatFormatter(
        template=template.source,
        eos_token=template.eos_token,
        bos_token=template.bos_token,
        add_generation_prompt=add_generation_prompt,
    )
    return formatter(messages=messages, **kwargs).prompt


def _ours(template: ChatTemplate, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    add_generation_prompt = kwargs.pop("add_generation_prompt", True)
    tools = kwargs.pop("tools", None)
    tool_choice = kwargs.pop("tool_choice", None)
    return template.render(
        messages,
        add_generation_prompt=add_generation_prompt,
        tools=tools,
        tool_choice=tool_choice,
        extra=kwargs,
    )


def _assert_same(template: ChatTemplate, messages: list[dict[str, Any]], **kwargs: Any) -> None:
    try:
        expected = _reference(template, messages, **dict(kwargs))
    except ValueError as exc:  # raise_exception in the reference
        with pytest.raises(TemplateError) as caught:
            _ours(template, messages, **dict(kwargs))
        assert caught.value.raised_by_template
        assert caught.value.message == str(exc)
        return
    assert _ours(template, messages, **dict(kwargs)) == expected


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
def test_renders_like_llama_cpp_python(
    smollm2_meta: dict[str, Any], conversation: str, add_generation_prompt: bool
) -> None:
    for template in _templates(smollm2_meta).values():
        _assert_same(
            template, CONVERSATIONS[conversation], add_generation_prompt=add_generation_prompt
        )


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        ("tools_llama3", {"tools": TOOLS}),
        ("tools_llama3", {"tools": TOOLS, "tool_choice": "required"}),
        ("native_effort", {"reasoning_effort": "high"}),
        ("native_effort", {"reasoning_effort": "minimal"}),  # raises in both
        ("native_effort", {"enable_thinking": False, "reasoning_effort": "low"}),
        ("native_strength", {"reasoning_strength": "max"}),
        ("toggle_qwen3", {"enable_thinking": False}),
        ("toggle_default_off", {"thinking": True}),
    ],
)
def test_tools_and_extra_variables_render_like_llama_cpp_python(
    name: str, kwargs: dict[str, Any]
) -> None:
    template = ChatTemplate(load(name), BOS, EOS)
    for messages in CONVERSATIONS.values():
        _assert_same(template, messages, **kwargs)


def test_smollm2_template_is_chatml(smollm2_meta: dict[str, Any]) -> None:
    template = ChatTemplate.from_gguf_metadata(smollm2_meta)
    assert (template.bos_token, template.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert template.render([SYSTEM, USER]) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_tojson_keeps_plain_json() -> None:
    # jinja2's own tojson would HTML-escape "<" and "&"; chat templates must not.
    template = ChatTemplate("{{ tools | tojson }}", BOS, EOS)
    rendered = template.render([USER], tools=TOOLS)
    assert "<things> & stuff, café" in rendered


def test_raise_exception_carries_the_templates_message() -> None:
    template = ChatTemplate(load("tools_llama3"), BOS, EOS)
    with pytest.raises(TemplateError) as caught:
        template.render([SYSTEM])
    assert caught.value.message == "Conversation must contain a user message"
    assert str(caught.value) == caught.value.message
    assert caught.value.raised_by_template


@pytest.mark.parametrize(
    ("source", "messages"),
    [
        ("{{ messages.append(1) }}", [USER]),  # the sandbox forbids mutation
        ("{{ undefined_thing.attribute }}", [USER]),
        ("{{ '<|im_start|>' + messages[0]['content'] }}", [{"role": "user", "content": None}]),
        ("{{ messages[5]['content'] | upper + 1 }}", [USER]),
    ],
)
def test_render_failures_are_template_errors(source: str, messages: list[dict[str, Any]]) -> None:
    with pytest.raises(TemplateError) as caught:
        ChatTemplate(source, BOS, EOS).render(messages)
    assert not caught.value.raised_by_template


def test_syntax_error_is_a_template_error() -> None:
    with pytest.raises(TemplateError, match="does not compile"):
        ChatTemplate("{% if messages %}unclosed", BOS, EOS)


def test_extra_may_not_shadow_standard_variables() -> None:
    with pytest.raises(ValueError, match="bos_token"):
        ChatTemplate("{{ bos_token }}", BOS, EOS).render([USER], extra={"bos_token": "x"})


def test_strftime_now_is_available() -> None:
    template = ChatTemplate("{{ strftime_now('%Y') }}", BOS, EOS)
    before = datetime.datetime.now().year
    rendered = template.render([USER])
    assert rendered in {str(before), str(datetime.datetime.now().year)}


def test_variables_lists_what_the_template_reads() -> None:
    template = ChatTemplate(load("native_effort"), BOS, EOS)
    assert {"reasoning_effort", "enable_thinking", "messages"} <= template.variables
    assert "reasoning_strength" not in template.variables


def test_from_gguf_metadata_token_sources() -> None:
    tokens = ["<unk>", "<bos>", "<eos>"]
    by_id = {
        "tokenizer.chat_template": "{{ bos_token }}|{{ eos_token }}",
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.tokens": tokens,
    }
    assert ChatTemplate.from_gguf_metadata(by_id).render([USER]) == "<bos>|<eos>"
    explicit = {**by_id, "bos_token": "B", "eos_token": "E"}
    assert ChatTemplate.from_gguf_metadata(explicit).render([USER]) == "B|E"
    # llama-cpp-python renders a token the model lacks (id -1) as "".
    missing = {**by_id, "tokenizer.ggml.bos_token_id": -1}
    del missing["tokenizer.ggml.eos_token_id"]
    assert ChatTemplate.from_gguf_metadata(missing).render([USER]) == "|"


@pytest.mark.parametrize(
    "metadata",
    [
        {},
        {"tokenizer.chat_template": "  "},
        {
            "tokenizer.chat_template": "x",
            "tokenizer.ggml.bos_token_id": 9,
            "tokenizer.ggml.tokens": [],
        },
    ],
)
def test_from_gguf_metadata_rejects_unusable_metadata(metadata: dict[str, Any]) -> None:
    with pytest.raises(TemplateError):
        ChatTemplate.from_gguf_metadata(metadata)
