"""Yamux receive credit returned in halves of the window, as go-yamux does.

py-libp2p 0.8.1's ``YamuxStream`` sends a WINDOW_UPDATE after nearly every read: whatever
hysteresis it applies, a branch for "slack below the threshold" credits the bytes just
read. Pubsub reads each message's varint length one byte at a time, so every gossip
message cost its receiver ~3 extra frames (yamux header, Noise record, a ``send()``, a trio
wake-up on both sides): strace of an idle peer in a 3-peer swarm shows a 30-byte write per
read. go-yamux (``sendWindowUpdate``) returns credit only once the unreturned part reaches
half the window, and so does this: one update per 128 KiB consumed instead of one per read.
A sender that ignores the window (py-libp2p buffers its excess and clamps the window at 0)
is owed nothing until the reader has drained the excess; then credit resumes.

Safe because the sender always keeps credit while the reader reads: what the reader has
consumed and not yet credited stays below half the window, so the sender's credit (window
minus buffered minus uncredited) is at least half the window whenever the buffer is empty;
a blocked sender means the reader has data it has not read. The window's auto-tuning is
kept (it runs when an update is sent, as in the library's full-update branch).
"""

from __future__ import annotations

from libp2p.stream_muxer.yamux.yamux import YamuxStream

_INSTALLED = "_inclavate_credit_in_halves"


async def _credit_in_halves(self: YamuxStream, *, bytes_read: int = 0) -> None:
    """Replaces ``YamuxStream._auto_tune_and_send_window_update`` (same signature)."""
    del bytes_read  # the owed credit is computed from the window, not counted per read
    async with self.window_lock:
        buffered = len(self.conn.stream_buffers.get(self.stream_id, b""))
        owed = self.target_recv_window - (self.recv_window + buffered)
        if owed <= 0 or owed < self._grow_threshold():  # the library's half (PY_YAMUX_* tunable)
            return
        increment = self._grow_to_delta(buffered) + self._apply_autotune_epoch(buffered)
    if increment > 0:
        await self.send_window_update(increment, skip_lock=True)


def install() -> None:
    """Patch the class once per process (every host built here uses it)."""
    if not getattr(YamuxStream, _INSTALLED, False):
        YamuxStream._auto_tune_and_send_window_update = _credit_in_halves  # type: ignore[method-assign]
        setattr(YamuxStream, _INSTALLED, True)
