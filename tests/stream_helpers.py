"""Streamed chats read in the background, for tests that disturb a swarm mid-generation."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx

from inclavate.local_swarm import PeerProcess

MODEL = "smollm2:135m"


class BackgroundStream(threading.Thread):
    """One streamed greedy chat: the text so far, how many chunks arrived, how it ended."""

    def __init__(self, peer: PeerProcess, messages: list[dict[str, str]], max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
        self.url = peer.url + "/v1/chat/completions"
        self.text = ""
        self.chunks = 0
        self.done = False
        self.error: Any = None
        self.ended_at: float | None = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url, json=self.body, timeout=120) as response:
                if response.status_code != 200:
                    self.error = (response.status_code, response.read().decode(errors="replace"))
                    return
                for line in response.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        self.done = True
                        return
                    event = json.loads(line[6:])
                    if "error" in event:
                        self.error = event
                        return
                    self.text += event["choices"][0]["delta"].get("content") or ""
                    self.chunks += 1
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            self.error = repr(exc)
        finally:
            self.ended_at = time.monotonic()

    def wait_chunks(self, n: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while self.chunks < n:
            if not self.is_alive() or time.monotonic() > deadline:
                raise AssertionError(f"the stream ended or stalled before {n} chunks: {self.error!r} {self.text!r}")
            time.sleep(0.02)
