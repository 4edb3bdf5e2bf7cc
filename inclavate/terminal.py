"""Text from the network, made safe to print on a terminal.

What ``inclavate status`` and ``inclavate chat`` print comes from other machines: records any
peer may publish (a model id, a node id), a peer's API answers, and a model's text, which the
last stage of a chain chooses token by token. A terminal acts on the control characters in it:
an escape sequence can rewrite the screen, set the window title, or (OSC 52) write the user's
clipboard. Each such character is shown as U+FFFD instead; tabs and newlines stay."""

from __future__ import annotations

import re
from typing import Any

_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
"""C0 controls but tab and newline, DEL, C1 controls, and the bidirectional overrides (which
reorder what follows them on screen)."""


_UNSAFE_IN_A_LINE = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def printable(text: str, *, one_line: bool = False) -> str:
    """``text`` with every character a terminal would act on replaced by U+FFFD; with
    ``one_line``, tabs and line breaks too (a stranger's text inside a log line must not
    start a line of its own, one that would read as ours)."""
    return (_UNSAFE_IN_A_LINE if one_line else _UNSAFE).sub("\ufffd", text)


def printable_tree(value: Any) -> Any:
    """A JSON value with every string in it (keys too) :func:`printable`."""
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, dict):
        return {printable_tree(k): printable_tree(v) for k, v in value.items()}
    if isinstance(value, list):
        return [printable_tree(v) for v in value]
    return value
