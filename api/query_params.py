"""Query parameters of the list routes (``limit``, ``offset``), read one way for all of them.

A number outside its documented bounds is a 400 naming them, never served as the nearest
bound: a client that pages with ``offset += limit`` after asking for 5000 rows and getting
1000 would skip the 4000 between, without a word. ``/v1/artifacts``, ``/v1/files`` and
``/v1/generations`` all read their numbers here, so one request gets one answer everywhere.
"""

from __future__ import annotations

from collections.abc import Mapping

from api.errors import BadRequest

MAX_OFFSET = 10**15
"""Past any table this serves, far inside SQLite's 64-bit integers, which a larger offset
overflowed (a 500)."""
_MAX_DIGITS = 19
"""Enough for any bound here; a longer string is refused before ``int`` reads it."""


def whole_number(name: str, raw: str | None, default: int, low: int, high: int) -> int:
    """``raw`` as a whole number in ``low..high`` (ASCII digits only: no sign, no spaces, no
    exponent), ``default`` when absent; a :class:`BadRequest` naming ``name`` otherwise."""
    if raw is None:
        return default
    if not raw.isascii() or not raw.isdigit() or len(raw) > _MAX_DIGITS or not low <= int(raw) <= high:
        raise BadRequest(f"{name} must be a whole number from {low} to {high}, not {raw[:40]!r}")
    return int(raw)


def list_page(args: Mapping[str, str], *, default_limit: int, max_limit: int) -> tuple[int, int]:
    """``(limit, offset)`` of a list request: ``limit`` 1..``max_limit``, ``offset``
    0..:data:`MAX_OFFSET` (default 0)."""
    limit = whole_number("limit", args.get("limit"), default_limit, 1, max_limit)
    offset = whole_number("offset", args.get("offset"), 0, 0, MAX_OFFSET)
    return limit, offset
