"""One HTTP connection's failure ends that connection, never the peer.

hypercorn (0.17, trio worker) runs every connection as a task of its server nursery, so an
exception escaping one connection ends the server, and the peer with it. One was found by
the adversary suite: a websocket upgrade refused with a 403 (``api.request_guard``), then a
second request on the same connection, makes hypercorn's websocket stream answer 400 on an
h11 connection that is already DONE; h11's ``LocalProtocolError`` escapes, and any client
could stop any peer with two requests. :func:`install` swaps in a connection handler that
logs and drops such a failure (the connection is closed by hypercorn's own ``finally``), and
closes a connection its response ended even when the task that closes it is being cancelled.

The same handler writes a response's bytes in place when the kernel takes them at once.
hypercorn's own write takes a lock and then trio's ``send_all``, and each ends the task's
turn even when nothing waits: two scheduler turns for every SSE chunk. Writing in place cut
the event loop's CPU per batched step, 8 sessions streaming, by about an eighth
(docs/ARCHITECTURE.md, "What a batched step waits for outside the engine").

It also counts connections (:mod:`api.connection_table`): past the bound a connection of
the source holding the most is ended, and a connection that sends no whole request within
:data:`FIRST_REQUEST_S` is closed (hypercorn gave it its keep-alive, 30 s).

And it keeps reading a connection while a request runs (:meth:`ConfinedTCPServer._read_data`),
so that a client's close is seen whatever it sent before it.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from collections.abc import Callable

import h11
import hypercorn.trio.run as hypercorn_run
import trio
from hypercorn.events import Closed, Event, RawData, Updated
from hypercorn.trio.tcp_server import MAX_RECV, TCPServer

from api.connection_table import ConnectionTable, capacity, source_of

log = logging.getLogger(__name__)


class ConfinedTCPServer(TCPServer):
    idle = True
    """No request under way (read by :class:`ConnectionTable`)."""
    _requested = False
    _evicted = False
    _scope: trio.CancelScope | None = None

    async def run(self) -> None:
        table = CONNECTIONS  # released where admitted, whatever replaces the global meanwhile
        key = table.admit(self._source(), self)
        try:
            with trio.CancelScope() as self._scope:
                if self._evicted:  # its own source's surplus, taken and ended at once
                    self._scope.cancel()
                await super().run()
        except Exception:  # noqa: BLE001 - any failure of one connection stays with it
            log.warning("an HTTP connection failed and was closed", exc_info=True)
        finally:
            table.release(key)  # hypercorn's own ``finally`` closed the socket

    def evict(self) -> None:
        """End this connection to make room for a newcomer (``CONNECTIONS``): its task is
        cancelled, and hypercorn's ``finally`` closes the socket (shielded: :meth:`_close`)."""
        self._evicted = True
        if self._scope is not None:
            self._scope.cancel()

    def _source(self) -> str:
        sock = getattr(self.stream, "socket", None) or getattr(getattr(self.stream, "transport_stream", None), "socket", None)
        try:
            return source_of(sock.getpeername()[0])
        except (AttributeError, OSError, IndexError, TypeError):
            return "?"

    async def _read_data(self) -> None:
        """hypercorn's read loop, reading on while the protocol holds what it read.

        hypercorn hands each read to the HTTP/1.1 protocol in its read loop, and the protocol
        holds it (h11's ``PAUSED``) when bytes of a next request follow a whole one, until
        the response is done: nothing more was read, so a client that sent one byte more and
        left was never seen to go, and a non-streamed chat ran to ``max_tokens``, a speech
        job completed and stored its audio for nobody (20 such requests kept a 3-peer chain
        busy 129 s; an audit, 2026-12-07). Reads now go to the protocol through a task of
        their own. Past :data:`PIPELINED_BYTES` waiting for it, reading pauses while the
        request's own body is still being taken (the application's pace, as before), and the
        connection ends when the protocol holds a whole request (the bytes are a next one's).
        The end of the stream stops that task, then closes the protocol, as hypercorn does:
        whatever the client sent and the protocol has not taken goes unanswered, as the
        client has gone."""
        send, receive = trio.open_memory_channel[bytes](math.inf)  # bounded in bytes below
        waiting = 0
        taken = trio.Event()

        async def feed() -> None:
            nonlocal waiting, taken
            async for data in receive:
                waiting -= len(data)
                taken.set()
                taken = trio.Event()
                await self.protocol.handle(RawData(data))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(feed)
            while await self._room(lambda: waiting, lambda: taken):
                try:
                    with trio.fail_after(self.config.read_timeout or math.inf):
                        data = await self.stream.receive_some(MAX_RECV)
                except (trio.ClosedResourceError, trio.BrokenResourceError, trio.TooSlowError):
                    break
                if not data:
                    break
                waiting += len(data)
                send.send_nowait(bytes(data))
            nursery.cancel_scope.cancel()
        await self.protocol.handle(Closed())
        # The client has gone: nothing is idle to time out. A feed cut short inside the
        # protocol's ``Updated(idle=False)`` left the idle timer running, and the connection's
        # task and descriptor waited it out, 10-30 s (a review, 2026-12-07).
        await self.idle_task.stop()

    async def _room(self, waiting: Callable[[], int], taken: Callable[[], trio.Event]) -> bool:
        """Whether to read on: at once while under :data:`PIPELINED_BYTES` wait for the
        protocol; past it, once it took some (its request's body, at the application's
        pace), or False when it holds a whole request (what waits is a next request's)."""
        while waiting() > PIPELINED_BYTES:
            if self._holds_a_whole_request():
                log.info("an HTTP client sent %d bytes of next requests while one ran: its connection is closed",
                         waiting())  # fmt: skip
                return False
            with trio.move_on_after(0.5):  # and look again: the request may end meanwhile
                await taken().wait()
        return True

    def _holds_a_whole_request(self) -> bool:
        """The HTTP/1.1 protocol has read a whole request and holds what follows (h11's
        ``PAUSED``) while its answer is under way: true of an h11 connection whose client has
        sent a whole request, one asking for an upgrade (``MIGHT_SWITCH_PROTOCOL``) included
        (an ``Upgrade:`` header on a POST made its junk wait for ever: a review, 2026-12-07),
        and whose answer is not done. Between an answer's end and the next cycle (a few
        turns) both sides read DONE: a keep-alive client's next request of over 16 KiB, sent
        as soon as it read the answer, was taken for junk and its connection closed (a
        second review). Not of a websocket's (``SWITCHED_PROTOCOL``), whose frames go at the
        application's pace."""
        connection = getattr(getattr(self.protocol, "protocol", None), "connection", None)
        return (isinstance(connection, h11.Connection) and connection.their_state in _WHOLE_REQUEST
                and connection.our_state in (h11.SEND_RESPONSE, h11.SEND_BODY))  # fmt: skip

    async def _idle_timeout(self) -> None:
        """Before its first request a connection has :data:`FIRST_REQUEST_S` to send it
        whole (request line and headers); after, hypercorn's keep-alive."""
        if self._requested:
            await super()._idle_timeout()
            return
        with trio.move_on_after(FIRST_REQUEST_S):
            await self.context.terminated.wait()
        with trio.CancelScope(shield=True):
            await self._initiate_server_close()

    async def _close(self) -> None:
        """Close the connection, shielded. After a response that ends it (``Connection:
        close``, HTTP/1.0) hypercorn closes from the application's task, which is being
        cancelled just then: its first checkpoint raised ``Cancelled`` and the socket was
        never closed, so every client that waits for the server to close (or never closes)
        kept a descriptor and a task of the peer for ever."""
        with trio.CancelScope(shield=True):
            await super()._close()

    async def protocol_send(self, event: Event) -> None:
        if isinstance(event, Updated):
            self.idle = event.idle
            self._requested = self._requested or not event.idle
        if isinstance(event, RawData) and event.data:
            written = self._write_in_place(event.data)
            if written == len(event.data):
                return
            # the rest goes first: the write below takes the lock before any turn ends
            await self._send_or_close(event.data[written:])
            return
        await super().protocol_send(event)

    async def _send_or_close(self, data: bytes) -> None:
        """hypercorn's write (shielded: the application's cancel never cuts one half way),
        bounded: a client that stops reading a response held it, its task and whatever the
        response had open (a download's file, pinned on disk even once deleted) for ever.
        A write that does not complete within :data:`WRITE_STALL_S` ends the connection."""
        async with self.send_lock:
            try:
                with trio.CancelScope(shield=True), trio.move_on_after(WRITE_STALL_S) as stalled:
                    await self.stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                await self.protocol.handle(Closed())
                return
        if stalled.cancelled_caught:
            log.info("an HTTP client read nothing for %g s: its connection is closed", WRITE_STALL_S)
            await self._close()
            await self.protocol.handle(Closed())

    def _write_in_place(self, data: bytes) -> int:
        """Write what the kernel takes now, when no write of this connection is under way;
        how many bytes (0: none, or a failure hypercorn's own write then sees and handles)."""
        if IN_PLACE_UNSUPPORTED or self.send_lock.locked() or not isinstance(self.stream, trio.SocketStream):
            return 0
        fd = self.stream.socket.fileno()
        if fd < 0:
            return 0
        try:
            return os.write(fd, data)
        except OSError:  # BlockingIOError (the kernel's buffer is full), a closed peer
            return 0


FIRST_REQUEST_S = 10.0
"""Seconds a new connection has to send its first request's line and headers."""

CONNECTIONS = ConnectionTable(capacity)
"""Every HTTP connection of the process: descriptors are the process's, whatever the server."""

PIPELINED_BYTES = 16 * 1024
"""Bytes of a connection read and not yet taken by the HTTP protocol (a next request sent
before the current one is answered, which HTTP/1.1 allows) past which the connection ends,
and the request it sent them behind with it (checked before each read, so up to one read
more waits).
Honest pipelined requests are a few hundred bytes; each running request may hold this (and
one read, 64 KiB) beside h11's own buffer, and one client may run thousands."""

_WHOLE_REQUEST = (h11.DONE, h11.MUST_CLOSE, h11.CLOSED, h11.MIGHT_SWITCH_PROTOCOL)

WRITE_STALL_S = 60.0
"""Seconds one write of a response (at most a download's read chunk) may wait for its client."""

IN_PLACE_UNSUPPORTED = sys.platform == "win32"
"""``os.write`` on a socket needs POSIX."""


def install() -> None:
    """Make hypercorn's trio worker use :class:`ConfinedTCPServer` (idempotent)."""
    hypercorn_run.TCPServer = ConfinedTCPServer  # type: ignore[misc]
