"""Reading generator parameters: ``params`` is generator-specific JSON from a stranger.

Each helper returns the typed value or raises :class:`InvalidParams` naming the field, so
every generator refuses bad input with the same kind of message.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from node.generators.base import InvalidParams


def optional_str(params: Mapping[str, Any], key: str, *, max_length: int = 256) -> str | None:
    value = params.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidParams(f"params.{key} must be a string")
    if len(value) > max_length:
        raise InvalidParams(f"params.{key} is longer than {max_length} characters")
    return value


def optional_number(params: Mapping[str, Any], key: str, low: float, high: float) -> float | None:
    """A finite number in ``(low, high]`` (``low`` excluded: durations and speeds are > 0)."""
    value = params.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidParams(f"params.{key} must be a number")
    if not low < value <= high:
        raise InvalidParams(f"params.{key} must be greater than {low:g} and at most {high:g}, got {value:g}")
    return float(value)


def optional_int(params: Mapping[str, Any], key: str, low: int, high: int) -> int | None:
    value = params.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidParams(f"params.{key} must be an integer from {low} to {high}")
    return value
