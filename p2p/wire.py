"""Messages of the forward protocol (``/inclavate/forward/1``) and their byte layout.

Every message is one frame (``p2p.framing``: u32 length + payload); a payload is::

    u32 big-endian header length | header: UTF-8 JSON with a "type" tag | body bytes

Only ``forward`` carries a body: int32 token ids for the first range, or hidden states in
the header's wire dtype (``inclavate.tensors``) after it. Messages are one-way: a stage
passes ``forward`` down the route; the last stage sends ``result`` (or any stage
``error``) straight to ``reply_to``, the entry peer. Hidden states never travel back.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np

from inclavate import tensors
from inclavate.types import LayerRange, NodeId, PeerId, SessionId
from node.sampling import SamplingParams
from p2p.errors import ProtocolError
from p2p.routing import Hop

PROTOCOL = "/inclavate/forward/1"
_HEADER_LEN = struct.Struct(">I")
MAX_HEADER_BYTES = 64 * 1024

ErrorCode = Literal[
    "session_limit", "context_full", "invalid_batch", "engine_error", "wrong_route",
    "unreachable", "timeout", "shutting_down", "protocol",
]  # fmt: skip


def _hop_json(hop: Hop) -> list[Any]:
    return [hop.peer_id, hop.node_id, hop.layers.start, hop.layers.end, hop.forward_url]


def _hop_from_json(item: Any) -> Hop:
    peer, node, start, end, url = item
    return Hop(NodeId(node), PeerId(peer), LayerRange(int(start), int(end)), str(url))


@dataclass(frozen=True, eq=False)
class Forward:
    """Run ``tokens`` or ``hidden`` at positions ``start_pos...`` through ``route[0]`` onward."""

    TYPE: ClassVar[str] = "forward"
    req_id: int
    session_id: SessionId
    start_pos: int
    route: tuple[Hop, ...]
    """Remaining hops, starting with the receiver."""
    reply_to: PeerId
    sampling: SamplingParams | None
    tokens: np.ndarray | None = None
    hidden: tensors.EncodedTensor | None = None

    @property
    def n_tokens(self) -> int:
        if self.tokens is not None:
            return int(self.tokens.shape[0])
        assert self.hidden is not None
        return int(self.hidden.shape[0])


@dataclass(frozen=True)
class Result:
    """The last stage's answer: the sampled token, or None for a prefill chunk."""

    TYPE: ClassVar[str] = "result"
    req_id: int
    session_id: SessionId
    token: int | None


@dataclass(frozen=True)
class Close:
    """Free the session on every hop of ``route``; the last one answers ``closed``."""

    TYPE: ClassVar[str] = "close"
    req_id: int
    session_id: SessionId
    route: tuple[Hop, ...]
    reply_to: PeerId


@dataclass(frozen=True)
class Closed:
    TYPE: ClassVar[str] = "closed"
    req_id: int
    session_id: SessionId


@dataclass(frozen=True)
class Error:
    TYPE: ClassVar[str] = "error"
    req_id: int
    session_id: SessionId
    code: ErrorCode
    message: str
    origin: PeerId
    failed_peer: PeerId | None = None
    """For ``unreachable``: the peer ``origin`` could not reach (absent from older peers)."""


Message = Forward | Result | Close | Closed | Error


def encode(msg: Message) -> bytes:
    header: dict[str, Any] = {"type": msg.TYPE, "req": msg.req_id, "session": msg.session_id}
    body = b""
    if isinstance(msg, Forward):
        header.update(
            start_pos=msg.start_pos,
            route=[_hop_json(h) for h in msg.route],
            reply_to=msg.reply_to,
            sampling=None if msg.sampling is None else [msg.sampling.temperature, msg.sampling.top_p, msg.sampling.seed],
        )
        if msg.tokens is not None:
            header["input"] = {"kind": "tokens", "shape": [int(msg.tokens.shape[0])]}
            body = np.ascontiguousarray(msg.tokens, dtype="<i4").tobytes()
        else:
            assert msg.hidden is not None
            header["input"] = {"kind": "hidden", "dtype": msg.hidden.dtype, "shape": list(msg.hidden.shape)}
            body = msg.hidden.data
    elif isinstance(msg, Result):
        header["token"] = msg.token
    elif isinstance(msg, Close):
        header.update(route=[_hop_json(h) for h in msg.route], reply_to=msg.reply_to)
    elif isinstance(msg, Error):
        header.update(code=msg.code, message=msg.message, origin=msg.origin)
        if msg.failed_peer is not None:
            header["failed"] = msg.failed_peer
    raw = json.dumps(header, separators=(",", ":")).encode()
    return _HEADER_LEN.pack(len(raw)) + raw + body


def decode(payload: bytes | memoryview) -> Message:
    view = memoryview(payload)
    if len(view) < _HEADER_LEN.size:
        raise ProtocolError("frame too short for a header")
    (size,) = _HEADER_LEN.unpack_from(view)
    if size > MAX_HEADER_BYTES or _HEADER_LEN.size + size > len(view):
        raise ProtocolError(f"bad header length {size}")
    try:
        h = json.loads(bytes(view[_HEADER_LEN.size : _HEADER_LEN.size + size]))
        body = view[_HEADER_LEN.size + size :]
        return _build(h, body)
    except (ValueError, KeyError, TypeError, tensors.TensorDecodeError) as exc:
        raise ProtocolError(f"malformed {type(exc).__name__}: {exc}") from exc


def _build(h: dict[str, Any], body: memoryview) -> Message:
    kind, req, session = h["type"], int(h["req"]), SessionId(str(h["session"]))
    if kind == Forward.TYPE:
        sampling = None if h["sampling"] is None else SamplingParams(*h["sampling"])
        spec = h["input"]
        tokens = hidden = None
        if spec["kind"] == "tokens":
            (n,) = spec["shape"]
            if len(body) != 4 * n:
                raise ValueError(f"{len(body)} bytes cannot hold {n} token ids")
            tokens = np.frombuffer(body, dtype="<i4").astype(np.int32)
        elif spec["kind"] == "hidden":
            hidden = tensors.EncodedTensor(spec["dtype"], tuple(int(d) for d in spec["shape"]), bytes(body))
            if spec["dtype"] not in tensors.WIRE_DTYPES or len(hidden.shape) != 2:
                raise ValueError(f"bad hidden-state tensor {spec}")
            tensors.validate(hidden)
        else:
            raise ValueError(f"unknown input kind {spec['kind']!r}")
        route = tuple(_hop_from_json(x) for x in h["route"])
        if not route:
            raise ValueError("a forward needs a route")
        return Forward(req, session, int(h["start_pos"]), route, PeerId(h["reply_to"]), sampling, tokens, hidden)
    if kind == Result.TYPE:
        token = h["token"]
        return Result(req, session, None if token is None else int(token))
    if kind == Close.TYPE:
        return Close(req, session, tuple(_hop_from_json(x) for x in h["route"]), PeerId(h["reply_to"]))
    if kind == Closed.TYPE:
        return Closed(req, session)
    if kind == Error.TYPE:
        failed = h.get("failed")
        return Error(req, session, h["code"], str(h["message"]), PeerId(h["origin"]),
                     PeerId(failed) if isinstance(failed, str) else None)  # fmt: skip
    raise ValueError(f"unknown message type {kind!r}")
