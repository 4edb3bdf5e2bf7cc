"""Errors raised by the peer-to-peer layer.

libp2p's own exceptions (``SwarmException``, ``StreamReset``, ``MuxedStreamError``, ...)
never leave ``p2p/``: the host and the stream adapters translate them into this tree,
so callers handle one vocabulary whatever the transport did underneath::

    InclavateError
    └── P2PError                      anything transport, wire, registry or routing
        ├── IdentityError             the key file exists but cannot be used
        ├── ListenError               could not bind the listen address
        ├── DialError                 could not connect to a peer or address
        ├── PublishRejected           our own topic validator refused our message
        └── StreamError               a framed stream failed (and was reset)
            ├── StreamTimeout         a read or write missed its deadline
            ├── StreamClosed          the peer closed or reset the stream
            └── ProtocolError         a malformed frame (e.g. EOF mid-frame)
                └── FrameTooLarge     a frame longer than the agreed maximum

The registry and routing code hang their own subclasses of :class:`P2PError` here
(or in their modules) as they are written: the tree is meant to grow.
"""

from __future__ import annotations

from inclavate.errors import InclavateError


class P2PError(InclavateError):
    """Base class of every error raised by ``p2p/``."""


class IdentityError(P2PError):
    """The persisted key exists but is unreadable or not an Ed25519 libp2p key.

    Raised instead of silently generating a new key, which would change the PeerID
    that the rest of the swarm knows this peer by.
    """


class ListenError(P2PError):
    """The host could not listen on the requested address (port in use, bad host)."""


class DialError(P2PError):
    """Could not connect to a peer: bad multiaddr, refused, unreachable, handshake failed."""


class LinkLimitReached(DialError):
    """A direct link was refused because the acceptor holds as many of this peer's links of
    that protocol as it allows, none of them idle: older links of ours it has not yet seen
    end. Unlike a missing handler this passes in moments, so it is remembered briefly."""


class PublishRejected(P2PError):
    """Our own validator rejected a message we tried to publish.

    libp2p drops such a message silently; we refuse it loudly so that the bug that
    produced an invalid record is seen at its source rather than as missing gossip.
    """


class StreamError(P2PError):
    """A framed stream can no longer be used; it has been reset so the peer knows too.

    Two exceptions, both harmless to the stream: :class:`FrameTooLarge` raised by ``send``
    before writing anything, and :class:`StreamClosed` for the peer's clean close (we may
    still send).
    """


class LinkFull(P2PError):
    """A link to a peer already holds as many unwritten messages as it may: the peer is not
    reading what it is sent (or not fast enough), and a stage does not wait for it."""


class StreamTimeout(StreamError):
    """A send or receive missed its deadline; the stream was reset so the peer knows."""


class StreamClosed(StreamError):
    """The peer closed or reset the stream, or the connection under it went away."""


class ProtocolError(StreamError):
    """The bytes on the stream do not form valid frames (truncated, or oversized)."""


class FrameTooLarge(ProtocolError):
    """A frame announces (or a caller offers) more bytes than the stream's maximum."""

    def __init__(self, size: int, limit: int) -> None:
        self.size = size
        self.limit = limit
        super().__init__(f"frame of {size} bytes exceeds the limit of {limit} bytes")
