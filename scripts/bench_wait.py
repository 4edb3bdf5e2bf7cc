"""What trio's wait costs a hop between two processes on one core, against a blocking read.

Two processes pinned to one core pass a decode-sized frame (1.4 KiB) back and forth over a
socket pair; on every frame each side first does a few milliseconds of memory-bound work
(summing 24 MB, as an engine call leaves the caches cold), then writes. The receiver waits
for the frame in one of two forms, measured in turns, round by round:

- ``blocking``: ``os.read`` on a blocking socket (the kernel wakes the reader in the read);
- ``trio``: ``trio.lowlevel.wait_readable``, then ``os.read`` (what every peer's direct link
  does: the event loop's ``epoll_wait``, its scheduler turn, then the read).

The difference between the two round trips, halved, is what trio's wait adds to each hop
between processes: the part of ``scripts/bench_hop_floor.py``'s raw floor that a data plane
off the event loop (a native path, or a blocking read on a thread of its own) would not pay.
Nothing of Inclavate runs here::

    .venv/bin/python scripts/bench_wait.py
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import numpy as np
import trio

FORMS = ("blocking", "trio")
FRAME = b"x" * 1400
_MEMORY = np.ones(6 << 20, np.float32)  # 24 MB: more than this VM's L2, most of its L3


def _work() -> float:
    return float(_MEMORY.sum())


async def _trio_read(sock: socket.socket) -> bytes:
    await trio.lowlevel.wait_readable(sock)
    return os.read(sock.fileno(), 1 << 16)


def _echo(sock: socket.socket, form: str) -> None:
    """The far side: read a frame, work, send it back, until the socket closes."""
    sock.setblocking(form == "blocking")
    fd = sock.fileno()

    async def serve() -> None:
        while data := await _trio_read(sock):
            _work()
            os.write(fd, data)

    if form == "trio":
        trio.run(serve)
        return
    while data := os.read(fd, 1 << 16):
        _work()
        os.write(fd, data)


def _round_trips(sock: socket.socket, form: str, n: int) -> list[float]:
    """This side: send, wait for the echo (timed), then work as the far side did."""
    sock.setblocking(form == "blocking")
    fd, times = sock.fileno(), []

    async def ping() -> None:
        for _ in range(n):
            started = time.perf_counter()
            os.write(fd, FRAME)
            await _trio_read(sock)
            times.append(time.perf_counter() - started)
            _work()

    if form == "trio":
        trio.run(ping)
        return times
    for _ in range(n):
        started = time.perf_counter()
        os.write(fd, FRAME)
        os.read(fd, 1 << 16)
        times.append(time.perf_counter() - started)
        _work()
    return times


def measure(form: str, n: int) -> float:
    """Median round trip (the far side's work included) of ``n`` frames, after 20 to warm up."""
    mine, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # the far side
        mine.close()
        try:
            _echo(theirs, form)
        finally:
            os._exit(0)
    theirs.close()
    try:
        return statistics.median(_round_trips(mine, form, n + 20)[20:])
    finally:
        mine.close()
        os.waitpid(pid, 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds of both forms, in turns")
    parser.add_argument("--frames", type=int, default=300, help="round trips per form and round")
    args = parser.parse_args()
    core = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {core})  # the far side inherits it
    best = dict.fromkeys(FORMS, float("inf"))
    for _ in range(args.rounds):
        for form in FORMS:
            best[form] = min(best[form], measure(form, args.frames))
    print(f"bench_wait: two processes on core {core}, a 1.4 KiB frame each way, 24 MB of work on each side "
          f"before each write; median round trip, best of {args.rounds} in turns")  # fmt: skip
    for form in FORMS:
        print(f"  {form:9} {best[form] * 1e3:.3f} ms")
    print(f"trio's wait adds {(best['trio'] - best['blocking']) * 1e3 / 2:.3f} ms a hop (half the difference)")


if __name__ == "__main__":
    main()
