"""Small chat templates that exercise each way a template can (not) control reasoning.

Shared with the end-to-end tests: ``TEST_TEMPLATES`` maps a name to a template file, and
:func:`smollm2_metadata` reads the real model's chat-template metadata.
Expected probe results are asserted in ``tests/test_reasoning.py``.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent

TEST_TEMPLATES: dict[str, str] = {path.stem: str(path) for path in sorted(_HERE.glob("*.jinja"))}
"""chatml, native_effort, native_strength, budget_r1, toggle_qwen3, toggle_default_off,
tools_llama3 -> absolute path of the ``.jinja`` file."""

_METADATA_KEYS = (
    "tokenizer.chat_template",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.tokens",
)


def load(name: str) -> str:
    """The template source for ``name``."""
    return Path(TEST_TEMPLATES[name]).read_text(encoding="utf-8")


@functools.cache
def smollm2_metadata(path: Path) -> dict[str, Any]:
    """The GGUF's chat-template metadata values.

    Cached: opening the GGUF takes a couple of seconds and several test modules want it.
    """
    from gguf import GGUFReader

    fields = GGUFReader(path).fields
    return {key: fields[key].contents() for key in _METADATA_KEYS if key in fields}
