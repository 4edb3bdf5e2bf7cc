"""Many streamed chat completions read by one thread, for the throughput benchmarks.

The benchmarks run the client on the machine they measure. Eight ``urllib`` threads, one per
session, cost ~0.8 ms of CPU per batched step (http.client reads a chunked body a line at a
time in Python, and every chunk wakes a thread that then waits for the GIL): CPU the peer's
engine threads lose to the measurement, and that the llama.cpp baseline, which streams
nothing, never pays. Here one thread waits on every socket at once (``selectors``), reads
whatever has arrived, and de-chunks and splits the SSE events itself. Each content chunk is
timestamped when its bytes are read; every event is still parsed as JSON and checked.
"""

from __future__ import annotations

import json
import selectors
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit


class StreamFailed(RuntimeError):
    """A streamed completion answered an error, broke off, or did not finish in time."""


@dataclass
class SseReader:
    """The state of one response being read: its HTTP head, then its chunked SSE body."""

    started: float
    token_times: list[float] = field(default_factory=list)
    usage: dict[str, int] = field(default_factory=lambda: {"prompt_tokens": 0, "completion_tokens": 0})
    done: bool = False
    _raw: bytes = b""
    _body: bytes = b""
    _head_read: bool = False

    def feed(self, data: bytes, now: float) -> None:
        """Take bytes off the socket; ``now`` is when they were read."""
        self._raw += data
        if not self._head_read and not self._read_head():
            return
        self._dechunk()
        while (end := self._body.find(b"\n\n")) >= 0:
            event, self._body = self._body[:end], self._body[end + 2 :]
            self._event(event, now)

    def _read_head(self) -> bool:
        end = self._raw.find(b"\r\n\r\n")
        if end < 0:
            return False
        head, self._raw = self._raw[:end].decode("latin-1"), self._raw[end + 4 :]
        status = head.split(" ", 2)[1]
        if status != "200":
            raise StreamFailed(f"HTTP {status}: {head.splitlines()[0]}")
        if "transfer-encoding: chunked" not in head.lower():
            raise StreamFailed("the response is not chunked: not a stream")
        self._head_read = True
        return True

    def _dechunk(self) -> None:
        while (line_end := self._raw.find(b"\r\n")) >= 0:
            size = int(self._raw[:line_end].split(b";")[0], 16)
            start = line_end + 2
            if len(self._raw) < start + size + 2:
                return
            if size == 0:
                self.done, self._raw = True, b""
                return
            self._body += self._raw[start : start + size]
            self._raw = self._raw[start + size + 2 :]

    def _event(self, event: bytes, now: float) -> None:
        if not event.startswith(b"data: ") or event == b"data: [DONE]":
            return
        chunk: dict[str, Any] = json.loads(event[6:])
        if "error" in chunk:
            raise StreamFailed(f"the stream answered an error: {chunk['error']}")
        self.usage = chunk.get("usage") or self.usage
        if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
            self.token_times.append(now)


def stream_all(url: str, bodies: Sequence[dict[str, Any]], timeout: float = 900.0) -> list[SseReader]:
    """POST every body to ``url`` (a peer's ``/v1/chat/completions``) at once and read all the
    streams to their end in this thread; one reader per body, in order."""
    parts = urlsplit(url)
    selector = selectors.DefaultSelector()
    readers: list[SseReader] = []
    try:
        for body in bodies:
            payload = json.dumps(body).encode()
            sock = socket.create_connection((parts.hostname, parts.port or 80), timeout=30)
            sock.sendall(
                f"POST {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode() + payload
            )
            sock.setblocking(False)
            reader = SseReader(time.perf_counter())
            readers.append(reader)
            selector.register(sock, selectors.EVENT_READ, reader)
        deadline = time.monotonic() + timeout
        while selector.get_map():
            ready = selector.select(timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise StreamFailed(f"the streams did not finish within {timeout:g} s")
            for key, _ in ready:
                sock, reader = key.fileobj, key.data
                assert isinstance(sock, socket.socket) and isinstance(reader, SseReader)
                data = sock.recv(1 << 16)
                if data:
                    reader.feed(data, time.perf_counter())
                if not data or reader.done:
                    selector.unregister(sock)
                    sock.close()
                    if not reader.done:
                        raise StreamFailed("the connection closed before the stream ended")
    finally:
        for key in list(selector.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        selector.close()
    return readers
