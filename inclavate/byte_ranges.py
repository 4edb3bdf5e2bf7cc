"""The ``Range`` header of an artifact read: one ``bytes=<start>-<end>`` range, or a refusal.

The spec serves single ranges only and never "partially honours" a request, so this is
stricter than RFC 9110 in what it refuses (several ranges, a suffix, anything it cannot
parse) but, like RFC 9110 §14.1.2, clamps an end past the object to its last byte: a
client that asks for ``bytes=990-2000`` of a 1000-byte object wants "from 990 on", and the
``Content-Range`` it gets back says exactly what it got. The rules, in order:

* no header (or an empty one): the whole object, 200;
* not ``bytes=`` followed by digits, one hyphen, digits (or an open end), or a start after
  its end, or a number of more than 19 digits: :class:`RangeMalformed` (400);
* a comma (multi-range) or a missing start (suffix ``bytes=-500``): :class:`RangeNotSatisfiable`
  (416), as the spec says, rather than serving part of what was asked;
* a start at or past the object's size (so any range of an empty object):
  :class:`RangeNotSatisfiable` (416, ``Content-Range: bytes */<size>``);
* otherwise the inclusive range ``start..min(end, size - 1)`` (``bytes=100-`` and
  ``bytes=100-99999`` both run to the last byte): 206.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from inclavate.errors import InclavateError

__all__ = ["ByteRange", "RangeMalformed", "RangeNotSatisfiable", "parse_range"]

MAX_HEADER_CHARS = 200
_SINGLE = re.compile(r"bytes=([0-9]{1,19})-([0-9]{1,19})?")
_SUFFIX = re.compile(r"bytes=-[0-9]{1,19}")


class RangeMalformed(InclavateError):
    """A Range header that cannot be read as a byte range (400)."""


class RangeNotSatisfiable(InclavateError):
    """A readable Range this server will not serve: several ranges, a suffix, or a start
    at or past the object's end (416). ``size`` goes into ``Content-Range: bytes */<size>``."""

    def __init__(self, message: str, size: int) -> None:
        super().__init__(message)
        self.size = size


@dataclass(frozen=True)
class ByteRange:
    """Bytes ``start..end`` of an object, both inclusive (as in ``Content-Range``)."""

    start: int
    end: int
    size: int
    """The whole object's size."""

    @property
    def length(self) -> int:
        return self.end - self.start + 1

    def content_range(self) -> str:
        return f"bytes {self.start}-{self.end}/{self.size}"


def parse_range(header: str | None, size: int) -> ByteRange | None:
    """The range to serve of an object of ``size`` bytes; None means the whole object."""
    if header is None or not header.strip():
        return None
    if len(header) > MAX_HEADER_CHARS:
        raise RangeMalformed(f"Range header longer than {MAX_HEADER_CHARS} characters")
    text = header.strip()
    if text.lower().startswith("bytes=") and "," in text:
        raise RangeNotSatisfiable("multiple ranges are not served; ask for one range at a time", size)
    if _SUFFIX.fullmatch(text):
        raise RangeNotSatisfiable("suffix ranges (bytes=-N) are not served; give the start byte", size)
    match = _SINGLE.fullmatch(text)
    if match is None:
        raise RangeMalformed(f"malformed Range {text[:60]!r}: expected bytes=<start>-<end>")
    start = int(match.group(1))
    end = int(match.group(2)) if match.group(2) is not None else None
    if end is not None and end < start:
        raise RangeMalformed(f"malformed Range {text!r}: the end comes before the start")
    if start >= size:
        raise RangeNotSatisfiable(f"range {text!r} starts past the object's end ({size} bytes)", size)
    return ByteRange(start, size - 1 if end is None else min(end, size - 1), size)
