"""Render a model's own chat template into the prompt string the entry peer tokenizes.

Models are trained on one exact byte layout of a conversation, and a stray newline or a
missing BOS shifts what they generate. The reference for "exact" is llama-cpp-python's
``Jinja2ChatFormatter`` (what every llama.cpp-based server in Python renders), which in
turn copies Hugging Face Transformers' chat-template environment. We rebuild that
environment here instead of importing the formatter: it is a private class that also builds
stop criteria and fixes ``add_generation_prompt`` at construction, and its internals move
between releases. ``tests/test_chat_template.py`` holds the two byte for byte together.

Every failure (a template that does not compile, a ``raise_exception`` call, a conversation
the template cannot handle) surfaces as :class:`TemplateError` carrying the template's own
message, so callers never see jinja2's exception tree.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping, Sequence
from datetime import datetime
from types import FrameType
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2 import meta
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from inclavate.errors import InclavateError

__all__ = ["ChatTemplate", "TemplateError"]

# The variables the reference formatter always passes; ``extra`` may not shadow them,
# because there (as keyword arguments) a duplicate is a TypeError, not an override.
_STANDARD_VARIABLES = frozenset(
    {
        "messages",
        "bos_token",
        "eos_token",
        "add_generation_prompt",
        "tools",
        "tool_choice",
        "functions",
        "function_call",
        "raise_exception",
        "strftime_now",
    }
)

# Exceptions a foreign template can provoke from inside the sandbox: jinja2's own
# (undefined names, sandbox violations) and plain Python ones from operations on the
# caller's data, e.g. ``'<|im_start|>' + message['content']`` when content is a list.
_RENDER_FAILURES = (
    jinja2.TemplateError,
    TypeError,
    ValueError,
    LookupError,
    AttributeError,
    ArithmeticError,
)


class TemplateError(InclavateError):
    """The chat template cannot render this conversation (or cannot be compiled at all).

    ``raised_by_template`` is true when the template itself refused via
    ``raise_exception(...)``; ``message`` is then exactly the template's text.
    """

    def __init__(self, message: str, *, raised_by_template: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.raised_by_template = raised_by_template


class _TemplateRaised(Exception):
    """``raise_exception`` inside a template; kept apart so its message is passed on verbatim."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class _GenerationTag(jinja2.ext.Extension):
    """Pass-through for Transformers' ``{% generation %}`` block (marks trainable tokens)."""

    tags = {"generation"}  # noqa: RUF012 (jinja2 declares it as a plain class attribute)

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        parser.stream.skip(1)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Replaces jinja2's HTML-safe ``tojson`` (which escapes <, >, & and ') because tool
    # schemas must reach the model as plain JSON, as Transformers renders them.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


RENDER_TIMEOUT_S = 5.0
"""A template is code from a model file: it gets this long to render one conversation."""
MAX_RENDERED_CHARS = 32 * 1024 * 1024
"""More than any context holds; a template that writes more is refused, not buffered."""
_TEMPLATE_FILENAME = "<template>"  # what jinja2 compiles templates from strings as


class _RenderTimeout(Exception):
    pass


class _Deadline:
    """Aborts a render that runs past its time: a trace function, installed on the rendering
    thread only, that watches just the template's own compiled code (every loop iteration of
    a template is a line event there), so nested loops cannot spin forever."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._at = time.monotonic() + seconds

    def on_call(self, frame: FrameType, event: str, arg: Any) -> Any:
        if frame.f_code.co_filename == _TEMPLATE_FILENAME:
            return self.on_line
        return None

    def on_line(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line" and time.monotonic() > self._at:
            raise _RenderTimeout
        return self.on_line


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, plus a cap on what one ``*`` or ``**`` may build: the stock
    sandbox lets ``'a' * 10**10`` allocate until the machine runs out of memory."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "**" and isinstance(right, int) and abs(right) > 4096:
            raise SecurityError("exponent too large")
        if operator == "*":
            for seq, count in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(count, int) and len(seq) * count > MAX_RENDERED_CHARS:
                    raise SecurityError("repetition too large")
        return super().call_binop(context, operator, left, right)


def _make_environment() -> ImmutableSandboxedEnvironment:
    # Immutable sandbox: a template may not mutate the caller's messages or reach Python
    # internals. trim_blocks/lstrip_blocks decide the prompt's whitespace, so they must
    # match the reference exactly.
    env = _BoundedSandbox(
        loader=jinja2.BaseLoader(),
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    return env


_ENVIRONMENT = _make_environment()


class ChatTemplate:
    """One model's compiled chat template plus the special tokens it may print."""

    def __init__(self, source: str, bos_token: str, eos_token: str) -> None:
        try:
            ast = _ENVIRONMENT.parse(source)
            self._compiled = _ENVIRONMENT.from_string(ast)
        except jinja2.TemplateSyntaxError as exc:
            raise TemplateError(f"chat template does not compile: {exc}") from exc
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        # Names the template reads from its context: how reasoning.py tells whether a
        # template knows ``reasoning_effort`` or ``enable_thinking`` at all.
        self.variables: frozenset[str] = frozenset(meta.find_undeclared_variables(ast))

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> ChatTemplate:
        """Build from GGUF metadata values already read by the caller.

        Reads ``tokenizer.chat_template``; the special tokens come from ``bos_token`` /
        ``eos_token`` strings when given, else from ``tokenizer.ggml.{bos,eos}_token_id``
        looked up in ``tokenizer.ggml.tokens``. A token the model lacks renders as "",
        as llama-cpp-python does for id -1.
        """
        source = metadata.get("tokenizer.chat_template")
        if not isinstance(source, str) or not source.strip():
            raise TemplateError("the model has no chat template (tokenizer.chat_template)")
        return cls(
            source,
            bos_token=_special_token(metadata, "bos"),
            eos_token=_special_token(metadata, "eos"),
        )

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: Any = None,
        extra: Mapping[str, Any] | None = None,
        timeout_s: float = RENDER_TIMEOUT_S,
    ) -> str:
        """Render the conversation; ``extra`` adds template variables (``enable_thinking``...).

        Blocking and CPU-bound: call it from a worker thread. A template still running after
        ``timeout_s``, or writing more than :data:`MAX_RENDERED_CHARS`, is a TemplateError."""
        extra = dict(extra or {})
        shadowed = _STANDARD_VARIABLES & extra.keys()
        if shadowed:
            raise ValueError(f"extra template variables shadow standard ones: {sorted(shadowed)}")
        deadline = _Deadline(timeout_s)
        previous = sys.gettrace()
        sys.settrace(deadline.on_call)
        try:
            return _bounded_join(self._compiled.generate(
                messages=messages,
                eos_token=self.eos_token,
                bos_token=self.bos_token,
                raise_exception=_raise_exception,
                add_generation_prompt=add_generation_prompt,
                functions=None,
                function_call=None,
                tools=tools,
                tool_choice=tool_choice,
                strftime_now=_strftime_now,
                **extra,
            ))
        except _RenderTimeout:
            raise TemplateError(f"chat template did not finish rendering within {deadline.seconds:g} s") from None
        except MemoryError:
            raise TemplateError("chat template tried to build more text than memory holds") from None
        except _TemplateRaised as exc:
            raise TemplateError(exc.message, raised_by_template=True) from None
        except _RENDER_FAILURES as exc:
            raise TemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from exc
        finally:
            sys.settrace(previous)

    def __repr__(self) -> str:
        size = f"<{len(self.source)} chars>"
        return f"ChatTemplate({size}, bos={self.bos_token!r}, eos={self.eos_token!r})"


def _bounded_join(chunks: Any) -> str:
    out: list[str] = []
    size = 0
    for chunk in chunks:
        size += len(chunk)
        if size > MAX_RENDERED_CHARS:
            raise TemplateError(f"chat template wrote more than {MAX_RENDERED_CHARS} characters")
        out.append(chunk)
    return "".join(out)


def _special_token(metadata: Mapping[str, Any], kind: str) -> str:
    text = metadata.get(f"{kind}_token")
    if isinstance(text, str):
        return text
    token_id = metadata.get(f"tokenizer.ggml.{kind}_token_id")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if token_id is None or int(token_id) < 0:
        return ""
    if tokens is None or int(token_id) >= len(tokens):
        raise TemplateError(f"{kind} token id {token_id} is not in tokenizer.ggml.tokens")
    return str(tokens[int(token_id)])
