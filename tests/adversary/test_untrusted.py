"""The shared validation boundary: every way a stranger's JSON can be wrong becomes one
typed ``Malformed`` with a fixed reason, and drop counters cannot be grown by a sender."""

from __future__ import annotations

import enum
import json
import math

import pytest

from inclavate.untrusted import (
    DropCounter,
    Malformed,
    Reason,
    as_float,
    as_int,
    check_depth,
    parse_json,
    read_bool,
    read_dict,
    read_float,
    read_int,
    read_list,
    read_str,
)


def reason_of(call) -> Reason:  # type: ignore[no-untyped-def]
    with pytest.raises(Malformed) as info:
        call()
    return info.value.reason


def test_parse_json_accepts_an_ordinary_document() -> None:
    assert parse_json(b'{"a": [1, 2.5, "x", null, true]}', max_bytes=100) == {"a": [1, 2.5, "x", None, True]}
    assert parse_json('{"a": 1}', max_bytes=100) == {"a": 1}


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"x" * 101, Reason.TOO_LARGE),
        (b"{", Reason.NOT_JSON),
        (b"\xff\xfe", Reason.NOT_UTF8),
        (b'{"a": NaN}', Reason.NOT_FINITE),
        (b'{"a": -Infinity}', Reason.NOT_FINITE),
        (b"[1e400]", Reason.NOT_FINITE),
    ],
)
def test_parse_json_refuses_with_a_fixed_reason(data: bytes, reason: Reason) -> None:
    assert reason_of(lambda: parse_json(data, max_bytes=100)) is reason


def test_nesting_past_the_recursion_limit_is_malformed_not_recursion_error() -> None:
    deep = b"[" * 100_000 + b"]" * 100_000
    assert reason_of(lambda: parse_json(deep, max_bytes=1 << 20)) is Reason.TOO_DEEP


def test_nesting_below_the_recursion_limit_but_past_ours_is_refused() -> None:
    # json.loads parses this fine; a later dataclasses.asdict / json.dumps would not.
    doc = '{"a":' * 500 + "1" + "}" * 500
    assert reason_of(lambda: parse_json(doc, max_bytes=1 << 20, max_depth=32)) is Reason.TOO_DEEP
    assert parse_json('{"a":' * 32 + "1" + "}" * 32, max_bytes=1 << 20, max_depth=32)


def test_brackets_inside_strings_do_not_count_as_depth() -> None:
    assert parse_json(json.dumps({"s": "[" * 1000}), max_bytes=1 << 20, max_depth=4) == {"s": "[" * 1000}


@pytest.mark.parametrize(
    "doc",
    [
        rb'{"content": "\ud800"}',  # a lone high surrogate (chat content: the tokenizer raised)
        rb'{"k": "ok \uDFFF"}',  # a lone low one, upper-case hex (SQLite refused an idempotency key)
        rb'{"\udabc": 1}',  # in a key
        rb'{"a": [{"b": ["x", "\ude00\ud83d"]}]}',  # nested, and a pair in the wrong order
    ],
)
def test_lone_surrogate_escapes_are_not_utf8(doc: bytes) -> None:
    """JSON allows an unpaired ``\\ud800``; json.loads makes it a str no UTF-8 encoder takes,
    so every later ``.encode()`` (SQLite, the tokenizer, a log) raised: a 500 on every route."""
    assert reason_of(lambda: parse_json(doc, max_bytes=1 << 20)) is Reason.NOT_UTF8
    assert reason_of(lambda: parse_json(doc.decode(), max_bytes=1 << 20)) is Reason.NOT_UTF8


def test_paired_surrogates_and_escaped_backslashes_are_text() -> None:
    assert parse_json(rb'{"e": "\ud83d\ude00", "\ud83d\ude00": "\\ud800"}', max_bytes=100) == {"e": "\U0001f600", "\U0001f600": "\\ud800"}
    assert reason_of(lambda: parse_json('{"raw": "\ud800"}', max_bytes=100)) is Reason.NOT_UTF8  # a raw one in a str


def test_check_depth_is_iterative() -> None:
    value: list = []
    for _ in range(50_000):
        value = [value]
    assert reason_of(lambda: check_depth(value, 10)) is Reason.TOO_DEEP


def test_int_reader_refuses_bools_floats_strings_and_huge_values() -> None:
    assert read_int({"n": 5}, "n", lo=0, hi=10) == 5
    assert reason_of(lambda: read_int({"n": True}, "n")) is Reason.WRONG_TYPE
    assert reason_of(lambda: read_int({"n": 1.0}, "n")) is Reason.WRONG_TYPE
    assert reason_of(lambda: read_int({"n": "1"}, "n")) is Reason.WRONG_TYPE
    assert reason_of(lambda: read_int({"n": 2**70}, "n")) is Reason.OUT_OF_RANGE
    assert reason_of(lambda: read_int({"n": -1}, "n", lo=0)) is Reason.OUT_OF_RANGE
    assert reason_of(lambda: read_int({}, "n")) is Reason.MISSING
    assert read_int({}, "n", default=7) == 7


def test_float_reader_wants_finite_numbers_in_range() -> None:
    assert read_float({"x": 2}, "x") == 2.0
    assert reason_of(lambda: as_float(math.nan, "x")) is Reason.NOT_FINITE
    assert reason_of(lambda: as_float(math.inf, "x")) is Reason.NOT_FINITE
    assert reason_of(lambda: as_float(10**400, "x")) is Reason.OUT_OF_RANGE
    assert reason_of(lambda: as_float("1.5", "x")) is Reason.WRONG_TYPE
    assert reason_of(lambda: as_float(False, "x")) is Reason.WRONG_TYPE
    assert reason_of(lambda: read_float({"x": -0.5}, "x", lo=0.0)) is Reason.OUT_OF_RANGE


def test_string_list_dict_and_bool_readers() -> None:
    assert read_str({"s": "ab"}, "s", max_len=2) == "ab"
    assert reason_of(lambda: read_str({"s": "abc"}, "s", max_len=2)) is Reason.TOO_LONG
    assert reason_of(lambda: read_str({"s": 1}, "s", max_len=2)) is Reason.WRONG_TYPE
    assert reason_of(lambda: read_str({"s": "z"}, "s", max_len=2, choices=frozenset("ab"))) is Reason.BAD_VALUE
    assert read_list({"l": [1]}, "l", max_len=1) == [1]
    assert reason_of(lambda: read_list({"l": [1, 2]}, "l", max_len=1)) is Reason.TOO_LONG
    assert reason_of(lambda: read_list({"l": 1}, "l", max_len=1)) is Reason.WRONG_TYPE
    assert read_dict({"d": {}}, "d") == {}
    assert reason_of(lambda: read_dict({"d": []}, "d")) is Reason.WRONG_TYPE
    assert reason_of(lambda: read_dict({"d": {str(i): i for i in range(5)}}, "d", max_len=4)) is Reason.TOO_LONG
    assert read_bool({"b": False}, "b") is False
    assert reason_of(lambda: read_bool({"b": 0}, "b")) is Reason.WRONG_TYPE
    assert reason_of(lambda: read_int([1], "n")) is Reason.WRONG_TYPE  # type: ignore[arg-type]


def test_the_message_names_our_field_never_the_senders_text() -> None:
    with pytest.raises(Malformed) as info:
        as_int("<script>" * 100, "start_layer")
    assert "<script>" not in str(info.value)
    assert info.value.field == "start_layer"


def test_drop_counter_is_keyed_by_reason_codes_only() -> None:
    class Other(enum.Enum):
        REPLAY = "replay"

    drops = DropCounter()
    drops.count(Reason.TOO_DEEP)
    drops.count(Reason.TOO_DEEP)
    drops.count(Other.REPLAY)
    assert drops[Reason.TOO_DEEP] == 2
    assert drops.total() == 3
    assert drops.snapshot() == {"too_deep": 2, "replay": 1}
    with pytest.raises(TypeError):
        drops.count("attacker text")  # type: ignore[arg-type]


def test_int_reader_accepts_only_int_in_bounds_even_at_int64_edges() -> None:
    assert as_int(2**63 - 1, "n") == 2**63 - 1
    assert reason_of(lambda: as_int(2**63, "n")) is Reason.OUT_OF_RANGE
