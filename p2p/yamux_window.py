"""Yamux receive windows enforced: a sender past its window loses the stream's data.

py-libp2p 0.8.1 notices a DATA frame beyond the stream's receive window, logs a warning,
clamps the window at 0 and buffers the bytes anyway, so the receive buffer of a stream
whose handler is not reading at that moment (it is sending an answer, or computing) grew
without bound: measured, one stream of a stranger's that ignores the window held 125 MiB
after 2,000 frames of 64 KiB, and nothing stopped it there. go-yamux closes the
connection ("recvWindowExceeded").

:func:`install` keeps the library's muxer (py-libp2p builds ``Yamux`` by name, whatever
muxer class a host is given) and swaps each connection's per-stream buffers for ones that
refuse bytes past the stream's remaining window (:class:`WindowExceeded`). The
library's reader catches that on a data frame: the stream is marked ended for reading (its
handler sees the end) and the bytes are dropped; on a stream-opening frame it closes the
connection. An honest sender never exceeds the window it was granted, so nothing honest is
refused; a stream's buffer is bounded by its window (256 KiB, growing up to 16 MiB only
while its reader keeps up).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from libp2p.stream_muxer.yamux.yamux import Yamux

logger = logging.getLogger(__name__)

_REFUSED_MARK = "bytes past a window of"
"""In the message of every :class:`WindowExceeded` (the library logs it; see install)."""


class WindowExceeded(ConnectionError):
    """A peer sent more bytes on a stream than its receive window allowed."""


class _WindowedBuffer(bytearray):
    def __init__(self, conn: Yamux, stream_id: int, initial: Iterable[int] = b"") -> None:
        super().__init__(initial)
        self._conn = conn
        self._stream_id = stream_id

    def extend(self, data: Iterable[int]) -> None:
        stream = self._conn.streams.get(self._stream_id)
        size = len(data) if isinstance(data, (bytes, bytearray, memoryview)) else None
        if stream is not None and size is not None and size > stream.recv_window:
            raise WindowExceeded(f"stream {self._stream_id}: {size} {_REFUSED_MARK} {stream.recv_window}")
        super().extend(data)


class _WindowedBuffers(dict[int, bytearray]):
    def __init__(self, conn: Yamux) -> None:
        super().__init__()
        self._conn = conn

    def __setitem__(self, stream_id: int, buffer: bytearray) -> None:
        super().__setitem__(stream_id, _WindowedBuffer(self._conn, stream_id, buffer))


_INSTALLED = "_inclavate_windowed_buffers"


def _not_a_refusal(record: logging.LogRecord) -> bool:
    """The library logs every refused frame at error level, so a sender past its window
    would fill the log as fast as it sends: those records are dropped (debug-level here)."""
    if _REFUSED_MARK not in record.getMessage():
        return True
    logger.debug("dropped bytes past a yamux window")
    return False


def install() -> None:
    """Patch ``Yamux.__init__`` once per process (every connection of every host here)."""
    if getattr(Yamux, _INSTALLED, False):
        return
    logging.getLogger(Yamux.__module__).addFilter(_not_a_refusal)
    library_init = Yamux.__init__

    def windowed_init(self: Yamux, *args: Any, **kwargs: Any) -> None:
        library_init(self, *args, **kwargs)
        self.stream_buffers = _WindowedBuffers(self)

    Yamux.__init__ = windowed_init  # type: ignore[method-assign]
    setattr(Yamux, _INSTALLED, True)
