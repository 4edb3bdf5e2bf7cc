"""Resident memory of a real peer before, during and after floods of large request bodies.

40 connections each send 23 of 24 MiB of a chat body and hang up (the peer's body budget,
256 MiB, holds some and refuses the rest); printed, per flood, the peer's RSS before it, at
its peak and 2 s after the last connection closed. glibc kept the freed body memory
(``api/heap_trim.py`` gives it back)::

    PYTHONSAFEPATH=1 PYTHONPATH=. INCLAVATE_TEST_HOME=... python scripts/bench_body_flood.py [--floods 3]
        [--env MALLOC_MMAP_THRESHOLD_=131072]   # an environment variable for the peer
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from body_flood import flood, rss_mb  # noqa: E402
from swarm import Swarm, request_json  # noqa: E402  (the test suite's peers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--floods", type=int, default=3)
    parser.add_argument("--connections", type=int, default=40)
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE for the peer process")
    args = parser.parse_args()
    env = dict(item.split("=", 1) for item in args.env)
    with tempfile.TemporaryDirectory() as tmp, Swarm(Path(tmp)) as swarm:
        peer = swarm.start("a", env=env)
        swarm.wait_ready(peer)
        chat = {"model": "smollm2:135m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
        status, _ = request_json("POST", peer.url + "/v1/chat/completions", chat, timeout=60)
        assert status == 200, status
        time.sleep(1)
        pid = peer.process.pid
        start = rss_mb(pid)
        print(f"peer RSS at start (after one chat): {start:.0f} MB  env={env or 'none'}")
        for n in range(1, args.floods + 1):
            before = rss_mb(pid)
            began = time.monotonic()
            peak = trio.run(lambda: flood(peer.api_port, connections=args.connections, pid=pid))
            took = time.monotonic() - began
            time.sleep(2)
            after = rss_mb(pid)
            print(f"flood {n}: before {before:.0f} MB, peak {peak:.0f} MB, 2 s after {after:.0f} MB "
                  f"(+{after - start:.0f} MB over the start; flood took {took:.1f} s)")  # fmt: skip
        status, _ = request_json("POST", peer.url + "/v1/chat/completions", chat, timeout=60)
        print(f"a chat after the floods: {status}")


if __name__ == "__main__":
    main()
