"""A streamed chat completion read as a client sees it, with the time of every token.

Blocking and stdlib-only, for tests and benchmarks that drive local swarms from threads:
what text arrived, when each piece arrived (the stall of a failover is the longest gap),
and the error event if the stream ended with one.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StreamedChat:
    started: float
    text: str = ""
    times: list[float] = field(default_factory=list)
    """``time.perf_counter()`` of every content delta."""
    finish_reason: str | None = None
    error: dict[str, Any] | None = None
    """The streamed error event (``{"error": ..., "status": ...}``), if the stream ended with one."""
    session_id: str = ""

    @property
    def longest_gap(self) -> float:
        """Seconds of the longest wait between two content deltas (0 with fewer than two)."""
        return max((b - a for a, b in zip(self.times, self.times[1:])), default=0.0)

    @property
    def total(self) -> float:
        return (self.times[-1] - self.started) if self.times else 0.0


def stream_chat(url: str, body: dict[str, Any], timeout: float = 600.0,
                on_delta: Callable[[StreamedChat], None] | None = None) -> StreamedChat:  # fmt: skip
    """POST ``body`` (with ``stream: true``) to ``url``/v1/chat/completions and read it to the end."""
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"content-type": "application/json"})  # fmt: skip
    chat = StreamedChat(time.perf_counter())
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        chat.session_id = resp.headers.get("x-dppan-session-id", "")
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                chat.error = event
                continue
            for choice in event.get("choices", []):
                if choice.get("finish_reason"):
                    chat.finish_reason = choice["finish_reason"]
                content = choice.get("delta", {}).get("content")
                if content:
                    chat.text += content
                    chat.times.append(time.perf_counter())
                    if on_delta is not None:
                        on_delta(chat)
    return chat
