"""The one boundary every byte from the network crosses before anything uses it.

Peers, legacy nodes and HTTP clients are strangers (see "Threat model" in
docs/ARCHITECTURE.md). Whatever they send is parsed here with a size limit and a nesting
limit, then read field by field with typed readers that check type and range. Every failure
is one exception, :class:`Malformed`, carrying a :class:`Reason` from a fixed set, so
callers have one thing to catch and counters are keyed by our words, never the sender's::

    try:
        body = parse_json(data, max_bytes=64 * 1024)
        start = read_int(body, "start_layer", lo=0, hi=100_000)
    except Malformed as exc:
        drops.count(exc.reason)      # bounded: one slot per Reason member
        return

Why not just ``json.loads`` and ``try/except``: ``json.loads`` raises ``RecursionError``
(not ``ValueError``) on deep nesting, a value nested just below the recursion limit breaks
later code that recurses over it (``dataclasses.asdict``, ``json.dumps``), ``bool`` is an
``int`` in Python, ``float('nan')`` and ``1e400`` parse, and ``2**70`` is a valid JSON
integer that overflows every C integer it reaches. JSON also allows an unpaired UTF-16
surrogate escape (``"\\ud800"``), which ``json.loads`` turns into a ``str`` that is not
Unicode text: every later ``.encode("utf-8")`` raises (SQLite, the tokenizer, a log file).
"""

from __future__ import annotations

import enum
import json
import math
import re
from collections.abc import Mapping
from typing import Any, Final

DEFAULT_MAX_DEPTH: Final = 32
"""Deeper than any message we define (records nest 3 levels) and far below Python's
recursion limit, so nothing downstream can hit it."""

INT64_MAX: Final = 2**63 - 1


class Reason(enum.Enum):
    """Why an input was dropped: a fixed vocabulary, safe to use as a counter key or a log
    field (the sender's text never is)."""

    TOO_LARGE = "too_large"
    TOO_DEEP = "too_deep"
    NOT_JSON = "not_json"
    NOT_UTF8 = "not_utf8"
    WRONG_TYPE = "wrong_type"
    MISSING = "missing"
    OUT_OF_RANGE = "out_of_range"
    NOT_FINITE = "not_finite"
    TOO_LONG = "too_long"
    BAD_VALUE = "bad_value"
    """A well-typed value that is not one of the allowed ones (enum, format)."""
    HANDLER_FAILED = "handler_failed"
    """Not the input's fault as far as we know: a handler raised unexpectedly (a bug, logged
    with its traceback) and the input was dropped instead of the peer."""


class Malformed(ValueError):
    """An input from the network that is not what the protocol allows.

    ``reason`` is a :class:`Reason`; ``field`` is the name *we* gave the field (never the
    sender's key), so ``str(exc)`` is safe to log and to return to a client.
    A ``ValueError`` so that code which already confines ``ValueError`` stays correct."""

    def __init__(self, reason: Reason, field: str = "", detail: str = "") -> None:
        self.reason = reason
        self.field = field
        where = f"{field}: " if field else ""
        super().__init__(f"{where}{detail or reason.value}")


_MISSING: Any = object()


# ------------------------------------------------------------------ parsing


_SURROGATE_ESCAPE: Final = re.compile(r"\\u[dD][89a-fA-F]")
"""A ``\\uD800``-``\\uDFFF`` escape: where a lone surrogate can enter a parsed document
(paired ones decode to one code point; raw ones are refused with the text)."""


def parse_json(data: bytes | bytearray | str, *, max_bytes: int, max_depth: int = DEFAULT_MAX_DEPTH) -> Any:
    """Parse one JSON document from the network, or raise :class:`Malformed`.

    Size is checked before parsing, nesting depth and lone surrogates after, in one walk
    that runs only when a cheap scan of the text says it may find something (more brackets
    than ``max_depth``; a surrogate escape). Non-finite numbers (``NaN``, ``Infinity``, and
    literals like ``1e400`` that overflow to infinity) are refused here, so no reader ever
    sees them; nor does any reader see a string (value or key) that is not Unicode text."""
    if len(data) > max_bytes:
        raise Malformed(Reason.TOO_LARGE, detail=f"{len(data)} bytes exceeds the limit of {max_bytes}")
    if isinstance(data, (bytes, bytearray)):
        try:
            text = bytes(data).decode("utf-8")
        except UnicodeDecodeError:
            raise Malformed(Reason.NOT_UTF8) from None
    else:
        text = data
        if not text.isascii():
            _check_text(text)  # a raw surrogate in the str itself
    try:
        value = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except RecursionError:
        raise Malformed(Reason.TOO_DEEP) from None
    except Malformed:
        raise
    except ValueError as exc:  # JSONDecodeError, or a huge integer literal Python refuses
        raise Malformed(Reason.NOT_JSON, detail=f"not valid JSON ({type(exc).__name__})") from None
    deep = text.count("[") + text.count("{") > max_depth
    escapes = "\\u" in text and _SURROGATE_ESCAPE.search(text) is not None
    if deep or escapes:
        _walk(value, max_depth if deep else None, strings=escapes)
    return value


def check_depth(value: Any, max_depth: int = DEFAULT_MAX_DEPTH) -> None:
    """Raise :class:`Malformed` if containers nest deeper than ``max_depth`` (iterative, so
    it cannot itself recurse too deep)."""
    _walk(value, max_depth, strings=False)


_CONTAINERS: Final = (dict, list)


def _walk(value: Any, max_depth: int | None, *, strings: bool) -> None:
    """One iterative pass over a parsed document, a level at a time: containers nested
    deeper than ``max_depth`` (``None``: not checked) and, with ``strings``, any string, key
    or value, that is not Unicode text. A level is gathered by one comprehension, of its
    containers alone unless strings are checked: a stack of ``(item, depth)`` pairs took
    ~1 us an item, 21 ms of event loop for a 20,000-key listing answer (its brackets always
    outnumber ``max_depth``), five times as long as parsing it (``scripts/bench_listing_fanout.py``)."""
    level: list[Any] = [value] if strings or isinstance(value, _CONTAINERS) else []
    depth = 1
    while level:
        if strings:
            _check_strings(level)
            level = [item for item in level if isinstance(item, _CONTAINERS)]
        if level and max_depth is not None and depth > max_depth:
            raise Malformed(Reason.TOO_DEEP, detail=f"nested deeper than {max_depth} levels")
        level = [child for item in level for child in (item.values() if isinstance(item, dict) else item)
                 if strings or isinstance(child, _CONTAINERS)]  # fmt: skip
        depth += 1


def _check_strings(level: list[Any]) -> None:
    """Refuse a string among ``level``, or a key of a dict among it, that is not Unicode text."""
    for item in level:
        if isinstance(item, str):
            if not item.isascii():
                _check_text(item)
        elif isinstance(item, dict):
            for key in item:
                if not key.isascii():
                    _check_text(key)


def _check_text(text: str) -> None:
    """Refuse a ``str`` holding a lone surrogate: it cannot be encoded as UTF-8 (encoding is
    a C loop that stops at the first one, faster than any search)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise Malformed(Reason.NOT_UTF8, detail="a string holds an unpaired UTF-16 surrogate (\\ud800-\\udfff)") from None


def _refuse_constant(name: str) -> Any:
    raise Malformed(Reason.NOT_FINITE, detail=f"{name} is not a number JSON allows")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise Malformed(Reason.NOT_FINITE, detail="number overflows a float")
    return value


# ------------------------------------------------------------------ value readers


def as_int(value: Any, field: str, *, lo: int = -INT64_MAX, hi: int = INT64_MAX) -> int:
    """An integer (never a ``bool``, never a float) within ``[lo, hi]``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise Malformed(Reason.WRONG_TYPE, field, "must be an integer")
    if not lo <= value <= hi:
        raise Malformed(Reason.OUT_OF_RANGE, field, f"must be between {lo} and {hi}")
    return value


def as_float(value: Any, field: str, *, lo: float = -math.inf, hi: float = math.inf) -> float:
    """A finite number (an integer is accepted and converted) within ``[lo, hi]``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise Malformed(Reason.WRONG_TYPE, field, "must be a number")
    try:
        number = float(value)
    except OverflowError:  # an integer beyond float range
        raise Malformed(Reason.OUT_OF_RANGE, field, "number too large") from None
    if not math.isfinite(number):
        raise Malformed(Reason.NOT_FINITE, field, "must be finite")
    if not lo <= number <= hi:
        raise Malformed(Reason.OUT_OF_RANGE, field, f"must be between {lo} and {hi}")
    return number


def as_bool(value: Any, field: str) -> bool:
    if not isinstance(value, bool):
        raise Malformed(Reason.WRONG_TYPE, field, "must be true or false")
    return value


def as_str(value: Any, field: str, *, max_len: int, choices: frozenset[str] | None = None) -> str:
    """A string of at most ``max_len`` characters, optionally one of ``choices``."""
    if not isinstance(value, str):
        raise Malformed(Reason.WRONG_TYPE, field, "must be a string")
    if len(value) > max_len:
        raise Malformed(Reason.TOO_LONG, field, f"longer than {max_len} characters")
    if choices is not None and value not in choices:
        raise Malformed(Reason.BAD_VALUE, field, f"must be one of {', '.join(sorted(choices))}")
    return value


def as_list(value: Any, field: str, *, max_len: int) -> list[Any]:
    if not isinstance(value, list):
        raise Malformed(Reason.WRONG_TYPE, field, "must be a list")
    if len(value) > max_len:
        raise Malformed(Reason.TOO_LONG, field, f"more than {max_len} items")
    return value


def as_dict(value: Any, field: str, *, max_len: int = 1024) -> dict[str, Any]:
    """A JSON object of at most ``max_len`` keys (JSON keys are always strings)."""
    if not isinstance(value, dict):
        raise Malformed(Reason.WRONG_TYPE, field, "must be an object")
    if len(value) > max_len:
        raise Malformed(Reason.TOO_LONG, field, f"more than {max_len} keys")
    return value


# ------------------------------------------------------------------ field readers


def _present(obj: Mapping[str, Any], key: str, default: Any) -> bool:
    """Whether ``key`` is in ``obj``; raises if it is absent and has no default."""
    if not isinstance(obj, Mapping):
        raise Malformed(Reason.WRONG_TYPE, detail="must be an object")
    if key in obj:
        return True
    if default is _MISSING:
        raise Malformed(Reason.MISSING, key, "is required")
    return False


def read_int(obj: Mapping[str, Any], key: str, *, lo: int = -INT64_MAX, hi: int = INT64_MAX, default: Any = _MISSING) -> int:
    """``obj[key]`` as :func:`as_int`; ``default`` (returned as is) when absent, else required."""
    return as_int(obj[key], key, lo=lo, hi=hi) if _present(obj, key, default) else default


def read_float(obj: Mapping[str, Any], key: str, *, lo: float = -math.inf, hi: float = math.inf, default: Any = _MISSING) -> float:
    return as_float(obj[key], key, lo=lo, hi=hi) if _present(obj, key, default) else default


def read_bool(obj: Mapping[str, Any], key: str, *, default: Any = _MISSING) -> bool:
    return as_bool(obj[key], key) if _present(obj, key, default) else default


def read_str(obj: Mapping[str, Any], key: str, *, max_len: int, choices: frozenset[str] | None = None, default: Any = _MISSING) -> str:
    return as_str(obj[key], key, max_len=max_len, choices=choices) if _present(obj, key, default) else default


def read_list(obj: Mapping[str, Any], key: str, *, max_len: int, default: Any = _MISSING) -> list[Any]:
    return as_list(obj[key], key, max_len=max_len) if _present(obj, key, default) else default


def read_dict(obj: Mapping[str, Any], key: str, *, max_len: int = 1024, default: Any = _MISSING) -> dict[str, Any]:
    return as_dict(obj[key], key, max_len=max_len) if _present(obj, key, default) else default


# ------------------------------------------------------------------ counting drops


class DropCounter:
    """How many inputs were dropped, per reason.

    Keys are enum members (:class:`Reason`, or any other fixed enum a protocol defines, such
    as the registry's verdicts), so the table can never hold more entries than the program
    has reason codes, whatever a sender does."""

    def __init__(self) -> None:
        self._counts: dict[enum.Enum, int] = {}

    def count(self, reason: enum.Enum) -> None:
        if not isinstance(reason, enum.Enum):
            raise TypeError("drop reasons are enum members, never free text")
        self._counts[reason] = self._counts.get(reason, 0) + 1

    def __getitem__(self, reason: enum.Enum) -> int:
        return self._counts.get(reason, 0)

    def total(self) -> int:
        return sum(self._counts.values())

    def snapshot(self) -> dict[str, int]:
        """``{reason code: count}``, for diagnostics and tests."""
        return {str(reason.value): n for reason, n in self._counts.items()}
