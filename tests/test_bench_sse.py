"""The benchmarks' one-thread SSE reader (``scripts/bench_sse.py``) counts what a client sees."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("bench_sse", Path(__file__).parents[1] / "scripts" / "bench_sse.py")
assert _spec is not None and _spec.loader is not None
bench_sse = sys.modules["bench_sse"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up
_spec.loader.exec_module(bench_sse)

HEAD = b"HTTP/1.1 200 \r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def _chunk(obj: object) -> bytes:
    event = b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(event), event)


def _response(*events: object) -> bytes:
    return HEAD + b"".join(_chunk(e) for e in events) + b"0\r\n\r\n"


def _delta(text: str) -> dict[str, object]:
    return {"choices": [{"delta": {"content": text}}]}


STREAM = _response(
    {"choices": [{"delta": {"role": "assistant", "content": ""}}]},
    _delta("Once"),
    _delta(" upon"),
    _delta(" a time"),
    {"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 3}},
    b"[DONE]",
)


@pytest.mark.parametrize("piece", [1, 7, 64, len(STREAM)])
def test_every_content_chunk_is_timed_however_the_bytes_arrive(piece: int) -> None:
    reader = bench_sse.SseReader(started=0.0)
    for i, offset in enumerate(range(0, len(STREAM), piece)):
        reader.feed(STREAM[offset : offset + piece], now=float(i))
    assert reader.done
    assert len(reader.token_times) == 3  # the empty role chunk is not a token
    assert reader.token_times == sorted(reader.token_times)
    assert reader.usage == {"prompt_tokens": 12, "completion_tokens": 3}


def test_an_error_in_the_stream_fails_the_measurement() -> None:
    reader = bench_sse.SseReader(started=0.0)
    with pytest.raises(bench_sse.StreamFailed, match="error"):
        reader.feed(_response(_delta("a"), {"error": {"message": "chain broke"}, "status": 502}), now=1.0)


@pytest.mark.parametrize(
    "head",
    [b"HTTP/1.1 429 \r\ncontent-length: 2\r\n\r\n{}", b"HTTP/1.1 200 \r\ncontent-length: 2\r\n\r\n{}"],
)
def test_a_refusal_or_a_plain_answer_is_not_a_stream(head: bytes) -> None:
    with pytest.raises(bench_sse.StreamFailed):
        bench_sse.SseReader(started=0.0).feed(head, now=1.0)
