"""The HTTP connection handler's writes in place (``api.confined_server``): a streamed
response's bytes arrive whole and in order whether the kernel takes them at once, in part,
or not at all, and a write the kernel takes at once costs the task no scheduler turn."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio
from hypercorn.config import Config
from hypercorn.events import RawData
from hypercorn.trio import serve
from quart_trio import QuartTrio

from api import confined_server
from api.confined_server import ConfinedTCPServer
from tests.turn_helpers import gives_a_turn


@asynccontextmanager
async def _connection(sndbuf: int | None = None) -> AsyncIterator[tuple[ConfinedTCPServer, trio.SocketStream]]:
    """A handler over one end of a socket pair (the client holds the other end)."""
    ours, theirs = trio.socket.socketpair()
    if sndbuf is not None:
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
        theirs.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, sndbuf)
    stream, client = trio.SocketStream(ours), trio.SocketStream(theirs)
    try:
        yield ConfinedTCPServer(None, Config(), None, None, stream), client  # type: ignore[arg-type]
    finally:
        await trio.aclose_forcefully(stream)
        await trio.aclose_forcefully(client)


async def _read(client: trio.SocketStream, n: int) -> bytes:
    got = bytearray()
    while len(got) < n:
        chunk = await client.receive_some(65536)
        assert chunk, "the connection ended early"
        got += chunk
    return bytes(got)


async def test_a_chunk_the_kernel_takes_at_once_costs_no_turn() -> None:
    chunks = [b"data: {\"n\": %d}\n\n" % i for i in range(50)]
    async with _connection() as (server, client):

        async def send_all() -> None:
            for chunk in chunks:
                await server.protocol_send(RawData(chunk))

        assert not await gives_a_turn(send_all)
        assert await _read(client, sum(map(len, chunks))) == b"".join(chunks)


async def test_a_stream_larger_than_the_socket_buffer_arrives_whole_and_in_order() -> None:
    """The client stops reading: a big write goes in part in place, its rest through
    hypercorn's own write, which waits; chunks sent meanwhile queue behind it."""
    big = bytes(range(256)) * 2048  # 512 KiB: far more than the socket holds
    small = [b"data: %d\n\n" % i for i in range(20)]
    async with _connection(sndbuf=4096) as (server, client), trio.open_nursery() as nursery:

        async def send_small() -> None:
            await trio.testing.wait_all_tasks_blocked()  # the big write waits for room
            assert server.send_lock.locked()
            for chunk in small:
                await server.protocol_send(RawData(chunk))

        nursery.start_soon(server.protocol_send, RawData(big))
        nursery.start_soon(send_small)
        await trio.testing.wait_all_tasks_blocked()
        sent = big + b"".join(small)
        assert await _read(client, len(sent)) == sent


async def test_a_write_to_a_closed_client_is_handed_to_hypercorn_which_closes_the_connection() -> None:
    closed: list[object] = []

    class Protocol:
        async def handle(self, event: object) -> None:
            closed.append(event)

    async with _connection() as (server, client):
        server.protocol = Protocol()  # type: ignore[assignment]
        await client.aclose()
        await server.protocol_send(RawData(b"data: late\n\n"))
    assert closed, "hypercorn's own write saw the broken connection and reported it"


async def test_a_response_that_ends_its_connection_closes_it() -> None:
    """``Connection: close`` (or HTTP/1.0): hypercorn closed the socket from a task being
    cancelled, and it stayed open, a descriptor and a task of the peer for as long as the
    client kept it (a client that waits for the server's close waited for ever)."""
    confined_server.install()
    app = QuartTrio("close")

    @app.get("/")
    async def root() -> dict[str, bool]:
        return {"ok": True}

    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    config = Config()
    config.bind = [f"127.0.0.1:{port}"]
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve, app, config)
            for request in (b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", b"GET / HTTP/1.0\r\n\r\n"):
                while True:
                    try:
                        client = await trio.open_tcp_stream("127.0.0.1", port)
                        break
                    except OSError:
                        await trio.sleep(0.05)  # the server is starting
                async with client:
                    await client.send_all(request)
                    answer = b""
                    with trio.fail_after(5):  # before: no end, ever
                        while chunk := await client.receive_some(65536):
                            answer += chunk
                    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b'{"ok":true}\n')
            nursery.cancel_scope.cancel()
