"""How soon a restarted sole holder serves again: two peers (layers 0-15, the entry; 15-30),
the second killed (SIGKILL) mid-stream and restarted on its data dir; printed, the seconds
from its /health naming its layers to the entry's first 200 (the entry kept a peer it saw
gone out of every route for 10 s, until a new record of it named another start)::

    PYTHONSAFEPATH=1 PYTHONPATH=. python scripts/bench_restart.py
"""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from swarm import PeerProcess, Swarm, request_json  # noqa: E402  (the test suite's peers)


def chat(peer: PeerProcess, max_tokens: int) -> tuple[int, Any]:
    body = {"model": "smollm2:135m", "messages": [{"role": "user", "content": "Count to a hundred."}],
            "max_tokens": max_tokens, "temperature": 0}  # fmt: skip
    return request_json("POST", peer.url + "/v1/chat/completions", body, timeout=60)


@contextlib.contextmanager
def streamed(peer: PeerProcess) -> Iterator[Iterator[bytes]]:
    """A long streamed chat through ``peer``: its SSE lines as they come."""
    body = {"model": "smollm2:135m", "messages": [{"role": "user", "content": "Write a very long story."}],
            "max_tokens": 1000, "temperature": 0, "stream": True}  # fmt: skip
    request = urllib.request.Request(peer.url + "/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=120) as response:
        yield (line for line in response if line.strip())


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp, Swarm(Path(tmp)) as swarm:
        entry = swarm.start("a", "--layers", "0-15")
        holder = swarm.start("b", "--layers", "15-30", bootstrap=entry)
        swarm.wait_ready(entry)
        swarm.wait_ready(holder)
        swarm.wait(lambda: chat(entry, 8)[0] == 200, 60, "a first chat")
        with streamed(entry) as events:
            for _ in range(5):  # the stream is under way through the holder
                next(events)
            swarm.signal(holder, signal.SIGKILL)
            killed = time.monotonic()
            holder.process.wait()
            tail = [line for line in events if b'"error"' in line]
        print(f"the stream through the killed holder ended with: {tail[-1].decode()[:120] if tail else 'no error'}")
        holder = swarm.start("b", "--layers", "15-30", bootstrap=entry)
        swarm.wait_ready(holder, 60)
        ready = time.monotonic()
        refused = 0
        while chat(entry, 2)[0] != 200:
            refused += 1
            time.sleep(0.2)
        served = time.monotonic()
        print(f"restarted holder ready {ready - killed:.1f} s after the kill; the entry's first 200 "
              f"{served - ready:.2f} s after that ({refused} refused in between)")  # fmt: skip


if __name__ == "__main__":
    main()
