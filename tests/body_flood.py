"""A flood of large request bodies at a real peer, and its resident memory (Linux ``/proc``).

Shared by ``tests/adversary/test_body_flood.py`` and ``scripts/bench_body_flood.py``:
``connections`` clients each announce a ``body_mib`` JSON body to ``/v1/chat/completions``,
send ``sent_mib`` of it (spaces) and hang up. The peer buffers what its body budget lets it
hold and refuses the rest; what matters afterwards is whether that memory goes back.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import trio

MIB = 1024 * 1024
_SPACES = memoryview(b" " * MIB)


def rss_mb(pid: int) -> float:
    """Resident memory of process ``pid`` in MB (VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


async def _one_body(port: int, body_mib: int, sent_mib: int) -> None:
    with contextlib.suppress(OSError, trio.BrokenResourceError, trio.ClosedResourceError):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            head = ("POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                    f"Content-Type: application/json\r\nContent-Length: {body_mib * MIB}\r\n\r\n")  # fmt: skip
            await stream.send_all(head.encode())
            for _ in range(sent_mib):
                await stream.send_all(_SPACES)


async def flood(port: int, *, connections: int = 40, body_mib: int = 24, sent_mib: int = 23,
                pid: int | None = None) -> float:  # fmt: skip
    """Send the flood, all connections at once; the peak RSS of ``pid`` seen meanwhile (MB,
    sampled every 20 ms; 0 without a pid)."""
    peak = 0.0
    async with trio.open_nursery() as nursery:

        async def sample() -> None:
            nonlocal peak
            while pid is not None:
                peak = max(peak, rss_mb(pid))
                await trio.sleep(0.02)

        nursery.start_soon(sample)
        async with trio.open_nursery() as senders:
            for _ in range(connections):
                senders.start_soon(_one_body, port, body_mib, sent_mib)
        nursery.cancel_scope.cancel()
    if pid is not None:
        peak = max(peak, rss_mb(pid))
    return peak
