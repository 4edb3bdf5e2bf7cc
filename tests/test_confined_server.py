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
from api.connection_table import ConnectionTable, source_of
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
    with trio.fail_after(20):
        async with _server() as port:
            for request in (b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", b"GET / HTTP/1.0\r\n\r\n"):
                async with await trio.open_tcp_stream("127.0.0.1", port) as client:
                    await client.send_all(request)
                    answer = b""
                    with trio.fail_after(5):  # before: no end, ever
                        while chunk := await client.receive_some(65536):
                            answer += chunk
                    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b'{"ok":true}\n')


class _Held:
    def __init__(self, idle: bool = True) -> None:
        self.idle = idle
        self.evicted = False

    def evict(self) -> None:
        self.evicted = True


def test_a_full_table_ends_the_oldest_idle_connection_of_the_source_holding_the_most() -> None:
    table = ConnectionTable(lambda: 4)
    honest = [_Held(), _Held(idle=False)]
    flood = [_Held(idle=False), _Held(), _Held()]
    for held in honest:
        table.admit("10.0.0.1", held)
    for held in flood:
        table.admit("10.0.0.2", held)  # the fifth: 10.0.0.2 holds the most
    assert len(table) == 4 and [h.evicted for h in flood] == [False, True, False]
    newcomer = _Held()
    table.admit("10.0.0.1", newcomer)  # a tie (2, 2): the newcomer's own source gives way
    assert honest[0].evicted and not newcomer.evicted and len(table) == 4


def test_a_source_holding_the_most_with_nothing_idle_loses_its_newcomer_elsewhere_its_oldest() -> None:
    table = ConnectionTable(lambda: 3)
    busy = [_Held(idle=False) for _ in range(3)]
    for held in busy:
        table.admit("10.0.0.2", held)
    own = _Held()
    table.admit("10.0.0.2", own)
    assert own.evicted and not any(h.evicted for h in busy)
    other = _Held()
    table.admit("10.0.0.1", other)
    assert busy[0].evicted and not other.evicted and table.evicted == 2


def test_released_connections_leave_no_row_and_ipv6_counts_by_its_64() -> None:
    table = ConnectionTable(lambda: 8)
    keys = [table.admit(source_of(f"2001:db8::{i}"), _Held()) for i in range(1, 4)]
    assert source_of("2001:db8::1") == source_of("2001:db8::ffff") == "2001:db8::/64"
    assert source_of("::ffff:10.0.0.1") == "10.0.0.1" and source_of("127.0.0.1") == "127.0.0.1"
    for key in keys:
        table.release(key)
        table.release(key)
    assert len(table) == 0 and not table._by_source


@asynccontextmanager
async def _server(**settings: object) -> AsyncIterator[int]:
    """The handler under hypercorn over a one-route app; yields its port."""
    confined_server.install()
    app = QuartTrio("conns")

    @app.get("/")
    async def root() -> dict[str, bool]:
        return {"ok": True}

    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    config = Config()
    config.bind = [f"127.0.0.1:{port}"]
    for name, value in settings.items():
        setattr(config, name, value)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve, app, config)
        while True:
            try:
                (await trio.open_tcp_stream("127.0.0.1", port)).socket.close()
                break
            except OSError:
                await trio.sleep(0.05)  # the server is starting
        yield port
        nursery.cancel_scope.cancel()


async def _connect(port: int, source: str) -> trio.SocketStream:
    sock = trio.socket.socket()
    await sock.bind((source, 0))
    await sock.connect(("127.0.0.1", port))
    return trio.SocketStream(sock)


async def _get(client: trio.SocketStream) -> bytes:
    await client.send_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    answer = b""
    while not answer.endswith(b'{"ok":true}\n'):
        chunk = await client.receive_some(65536)
        assert chunk, f"closed after {answer!r}"
        answer += chunk
    return answer


def _silent(port: int, source: str) -> socket.socket:
    """A connection that sends nothing (the kernel completes it before the server accepts)."""
    sock = socket.socket()
    sock.bind((source, 0))
    sock.connect(("127.0.0.1", port))
    return sock


def _closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(1, socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False


async def test_a_flood_of_idle_connections_is_bounded_and_another_sources_client_is_kept(monkeypatch) -> None:
    """40 idle connections from 127.0.0.2 against a bound of 8: each newcomer ends the
    flood's oldest, and a keep-alive client on 127.0.0.1 keeps its connection and is
    answered. Before, every connection was held until its keep-alive ran out (30 s at a
    peer), however many: a peer's descriptors went to whoever opened the most."""
    monkeypatch.setattr(confined_server, "CONNECTIONS", ConnectionTable(lambda: 8))
    with trio.fail_after(30):
        async with _server(keep_alive_timeout=600) as port:
            honest = await _connect(port, "127.0.0.1")
            assert (await _get(honest)).startswith(b"HTTP/1.1 200")
            flood = [_silent(port, "127.0.0.2") for _ in range(40)]
            try:
                while sum(map(_closed_by_server, flood)) < 40 - 7:
                    await trio.sleep(0.05)  # the server accepts the flood at its own pace
                assert len(confined_server.CONNECTIONS) <= 8
                assert (await _get(honest)).startswith(b"HTTP/1.1 200")
            finally:
                await honest.aclose()
                for sock in flood:
                    sock.close()


async def test_a_connection_that_sends_no_whole_request_is_closed_before_its_keep_alive(monkeypatch) -> None:
    monkeypatch.setattr(confined_server, "FIRST_REQUEST_S", 0.2)
    with trio.fail_after(30):  # before: held for the keep-alive, 600 s
        async with _server(keep_alive_timeout=600) as port:
            silent, partial = await _connect(port, "127.0.0.1"), await _connect(port, "127.0.0.1")
            await partial.send_all(b"GET / HT")
            for client in (silent, partial):
                assert await client.receive_some(65536) == b""
                await client.aclose()
            kept = await _connect(port, "127.0.0.1")
            await _get(kept)
            await trio.sleep(0.5)  # past FIRST_REQUEST_S: a connection that asked keeps its keep-alive
            assert (await _get(kept)).startswith(b"HTTP/1.1 200")
            await kept.aclose()
