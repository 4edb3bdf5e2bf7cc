"""Streamed chats read in the background, for tests that disturb a swarm mid-generation."""

from __future__ import annotations

import threading
import time
from typing import Any

from inclavate.chat_stream import StreamedChat, stream_chat
from inclavate.local_swarm import PeerProcess

MODEL = "smollm2:135m"


class BackgroundStream(threading.Thread):
    """One streamed greedy chat on a thread: the text so far and how it ended."""

    def __init__(self, peer: PeerProcess, messages: list[dict[str, str]], max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url = peer.url
        self.body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
        self.chunks = 0
        self.chat: StreamedChat | None = None
        self.failure: str | None = None

    def run(self) -> None:
        try:
            self.chat = stream_chat(self.url, self.body, timeout=120, on_delta=self._count)
        except (OSError, ValueError) as exc:  # an HTTP error status, a reset connection
            self.failure = repr(exc)

    def _count(self, _: StreamedChat) -> None:
        self.chunks += 1

    @property
    def text(self) -> str:
        return self.chat.text if self.chat else ""

    @property
    def error(self) -> Any:
        return self.failure or (self.chat.error if self.chat else None)

    @property
    def done(self) -> bool:
        """Finished normally (a finish reason, no error event)."""
        return self.chat is not None and self.chat.error is None and self.chat.finish_reason is not None

    def wait_chunks(self, n: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while self.chunks < n:
            if not self.is_alive() or time.monotonic() > deadline:
                raise AssertionError(f"the stream ended or stalled before {n} chunks: {self.error!r} {self.text!r}")
            time.sleep(0.02)
