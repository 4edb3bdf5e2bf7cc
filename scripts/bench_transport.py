"""What one message between two peers costs: a ping-pong of decode-sized frames (1.4 KiB,
SmolLM2's f16 hidden state plus header) between two processes pinned to one core, over a
py-libp2p stream (yamux + Noise), over the direct data plane (``p2p.direct``: TCP + sealed
frames), and over plain framed TCP (the floor). Rounds alternate the three, best of each."""

from __future__ import annotations

import multiprocessing as mp
import os
import resource
import time
from typing import Any

import trio

from p2p.direct import DirectLinks
from p2p.framing import FramedStream
from p2p.host import open_host
from p2p.identity import Identity

PROTOCOL = "/inclavate/bench-echo/1"
PAYLOAD = b"x" * 1400
KINDS = ("tcp", "direct", "libp2p")


async def _echo(stream: Any, _remote: object) -> None:
    while True:
        await stream.send(await stream.receive(timeout=60), timeout=10)


async def _serve_p2p(queue: Any) -> None:
    async with open_host(Identity.generate()) as host, trio.open_nursery() as nursery:
        links = DirectLinks(host)
        links.set_handler(PROTOCOL, _echo)
        await nursery.start(links.run)
        host.set_stream_handler(PROTOCOL, _echo)
        queue.put(host.multiaddrs()[0])
        await trio.sleep(600)


async def _serve_tcp(queue: Any) -> None:
    async def handler(tcp: trio.SocketStream) -> None:
        try:
            await _echo(FramedStream.over_trio(tcp), None)
        except Exception:  # noqa: BLE001 - the client hung up
            pass

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    queue.put(listeners[0].socket.getsockname()[1])
    await trio.serve_listeners(handler, listeners)


def _server(kind: str, core: int, queue: Any) -> None:
    os.sched_setaffinity(0, {core})
    trio.run(_serve_tcp if kind == "tcp" else _serve_p2p, queue)


async def _ping_pong(stream: Any, n: int) -> tuple[float, float]:
    """(ms per round trip, client CPU ms per round trip)."""
    for _ in range(100):
        await stream.send(PAYLOAD, 10)
        await stream.receive(10)
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for _ in range(n):
        await stream.send(PAYLOAD, 10)
        await stream.receive(10)
    elapsed, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    cpu = r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime
    return elapsed * 1000 / n, cpu * 1000 / n


async def _client(kind: str, address: Any, n: int) -> tuple[float, float]:
    if kind == "tcp":
        return await _ping_pong(FramedStream.over_trio(await trio.open_tcp_stream("127.0.0.1", address)), n)
    async with open_host(Identity.generate()) as host, trio.open_nursery() as nursery:
        peer = await host.connect(address)
        if kind == "libp2p":
            stream: Any = await host.new_stream(peer, PROTOCOL)
        else:
            links = DirectLinks(host)
            await nursery.start(links.run)
            stream = await links.open(peer, PROTOCOL, timeout=5)
        result = await _ping_pong(stream, n)
        nursery.cancel_scope.cancel()
        return result


def measure(rounds: int = 3, n: int = 600) -> dict[str, tuple[float, float]]:
    """Best (round trip ms, client CPU ms per round trip) of each kind, rounds alternating."""
    core = min(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})
    best: dict[str, tuple[float, float]] = {k: (float("inf"), float("inf")) for k in KINDS}
    try:
        for _ in range(rounds):
            for kind in KINDS:
                queue: Any = mp.get_context("spawn").Queue()
                server = mp.get_context("spawn").Process(target=_server, args=(kind, core, queue), daemon=True)
                server.start()
                try:
                    rtt, cpu = trio.run(_client, kind, queue.get(timeout=60), n)
                finally:
                    server.kill()
                    server.join(5)
                best[kind] = (min(best[kind][0], rtt), min(best[kind][1], cpu))
    finally:
        os.sched_setaffinity(0, before)
    return best


if __name__ == "__main__":
    for kind, (rtt, cpu) in measure().items():
        print(f"{kind:8} round trip {rtt:.3f} ms, client CPU {cpu:.3f} ms per round trip")
