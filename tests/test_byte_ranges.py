"""Range parsing: one satisfiable range or the spec's refusal (400 malformed, 416 others)."""

from __future__ import annotations

import pytest

from inclavate.byte_ranges import ByteRange, RangeMalformed, RangeNotSatisfiable, parse_range


def test_no_header_is_the_whole_object() -> None:
    assert parse_range(None, 10) is None
    assert parse_range("  ", 10) is None


@pytest.mark.parametrize(
    ("header", "start", "end"),
    [("bytes=0-9", 0, 9), ("bytes=3-3", 3, 3), ("bytes=5-", 5, 9), (" bytes=0-0 ", 0, 0), ("bytes=9-9", 9, 9)],
)
def test_single_ranges_are_served(header: str, start: int, end: int) -> None:
    r = parse_range(header, 10)
    assert r == ByteRange(start, end, 10)
    assert r.length == end - start + 1
    assert r.content_range() == f"bytes {start}-{end}/10"


@pytest.mark.parametrize(
    "header",
    ["bytes=0-9,20-29", "bytes=0-1, 3-4", "bytes=-5", "bytes=-0", "bytes=-500", "bytes=10-10", "bytes=10-", "bytes=10-999"],
)
def test_multi_suffix_and_starts_past_the_end_are_416(header: str) -> None:
    with pytest.raises(RangeNotSatisfiable) as info:
        parse_range(header, 10)
    assert info.value.size == 10


@pytest.mark.parametrize(("header", "start"), [("bytes=0-10", 0), ("bytes=5-999999", 5), ("bytes=9-10", 9)])
def test_an_end_past_the_object_is_clamped_to_its_last_byte(header: str, start: int) -> None:
    # RFC 9110 §14.1.2: a range whose first byte is inside the object is satisfiable
    r = parse_range(header, 10)
    assert r == ByteRange(start, 9, 10)
    assert r.content_range() == f"bytes {start}-9/10"


def test_any_range_of_an_empty_object_is_416() -> None:
    with pytest.raises(RangeNotSatisfiable):
        parse_range("bytes=0-", 0)


@pytest.mark.parametrize(
    "header",
    ["bytes", "bytes=", "bytes=a-b", "items=0-1", "bytes=5-3", "bytes=0x1-2", "bytes 0-1", "bytes=1-2-3",
     "bytes=+1-2", "bytes=" + "9" * 20 + "-", "bytes=0-1" + " " * 300, "bytes=٣-٤", "bytes=-"],
)  # fmt: skip
def test_malformed_ranges_are_400(header: str) -> None:
    with pytest.raises(RangeMalformed):
        parse_range(header, 10)
