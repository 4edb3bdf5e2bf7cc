"""Messages of the forward protocol (``/inclavate/forward/2``) and their byte layout.

Every message is one frame (``p2p.framing``: u32 length + payload). A payload takes one of
three forms, told apart by its first byte::

    JSON:   u32 big-endian header length (< 2**24, so the first byte is 0)
            | header: UTF-8 JSON with a "type" tag | body bytes
    step:   0xF1 | 0 | u16 context length | u64 req | u32 start_pos | u32 rows
            | context: UTF-8 JSON {session, route, reply_to, sampling, input[, lane]} | body bytes
    result: 0xF2 | 0 | u16 session length | u64 req | i32 token (-1: none) | session (UTF-8)

A decode step goes round the chain once per token, and its route, session, entry and
sampling never change within a leg: the *step* form carries them as a context that both
ends cache by its exact bytes, so a hop parses and checks them once per leg instead of once
per token (a JSON header cost ~40 us a frame to parse and check on a 2-core VM, ~100 us
right after an engine call had emptied the caches). Each cache is bounded; a stranger who
sends a new context every frame only makes us parse JSON, as every frame did before.
``result`` is the token going home. Every other message, and a ``forward`` carrying a
replay or ``discard``, uses the JSON form, which every receiver still accepts.

Only ``forward`` carries a body: int32 token ids for the first range, or hidden states in
the header's wire dtype (``inclavate.tensors``) after it. Messages are one-way: a stage
passes ``forward`` down the route; the last stage sends ``result`` (or any stage
``error``) straight to ``reply_to``, the entry peer. Hidden states never travel back.

Failover adds three things (``p2p.chain``): ``adopt`` asks one hop to keep a session's cache
under a new leg id (answered ``adopted`` with the positions it keeps); a ``forward`` may carry
``replay``, telling the hop whose range ends at ``at`` to send its kept outputs of ``frames``
into the hops up to boundary ``until`` first; and those frames carry ``discard``: the route
ends before the model does and its last hop only rebuilds its cache.

A ``forward`` may name a *lane* (0 when absent): the entry spreads its sessions over lanes,
and a stage of a chain runs the decode steps of one lane per engine call, so that the lanes
go round the chain out of phase and several stages compute at once (``node.stage``). A peer
that does not know lanes ignores the key and batches every lane together, as before.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import numpy as np

from inclavate import tensors
from inclavate.types import LayerRange, NodeId, PeerId, SessionId
from inclavate.untrusted import (
    Malformed, as_dict, as_int, as_list, as_str, parse_json, read_bool, read_dict, read_int, read_list, read_str,
)  # fmt: skip
from node.sampling import SamplingParams
from p2p.errors import ProtocolError
from p2p.routing import Hop

PROTOCOL = "/inclavate/forward/2"
"""Version 2 added the step and result forms; a peer that speaks only version 1 refuses the
stream, so a route through it fails fast as ``unreachable`` instead of on a garbled frame."""
_HEADER_LEN = struct.Struct(">I")
_STEP = struct.Struct(">BBHQII")
_RESULT = struct.Struct(">BBHQi")
STEP_TAG = 0xF1
RESULT_TAG = 0xF2
_REQ_LIMIT = 2**63
"""Request ids are below this in every form (JSON reads them as signed 64-bit)."""
CONTEXT_CACHE_ENTRIES = 512
"""Step contexts each end remembers (a context is one leg of one session)."""
MAX_CACHED_CONTEXT_BYTES = 4096
"""Longer contexts (routes of dozens of hops) are parsed every time, so the caches hold at
most ``CONTEXT_CACHE_ENTRIES`` x 4 KiB whatever a stranger sends."""
MAX_HEADER_BYTES = 64 * 1024
MAX_ROUTE_HOPS = 256
"""More hops than any model has layers worth splitting; a longer route is refused unread."""
MAX_ID_CHARS = 256
MAX_URL_CHARS = 2048
MAX_MESSAGE_CHARS = 4096
MAX_DIM = 1 << 24
MAX_REPLAY_FRAMES = 4096
"""Frames one replay may name (a 128k context in 32-position frames)."""
MAX_LANE = 15
"""Lanes are small numbers; a stage folds them onto the lanes it runs (``node.stage``)."""

def max_frame_bytes(context_length: int, d_model: int) -> int:
    """The largest forward frame a model can need: a whole context of float32 hidden states
    (the entry sends prefill in smaller chunks), plus the header. Inbound frames are capped
    at this instead of the framing layer's generic 256 MiB."""
    return _HEADER_LEN.size + MAX_HEADER_BYTES + context_length * d_model * 4


ErrorCode = Literal[
    "session_limit", "context_full", "invalid_batch", "engine_error", "wrong_route",
    "unreachable", "timeout", "shutting_down", "protocol", "session_evicted",
]  # fmt: skip


def _hop_json(hop: Hop) -> list[Any]:
    return [hop.peer_id, hop.node_id, hop.layers.start, hop.layers.end, hop.forward_url]


def _hop_from_json(item: Any) -> Hop:
    fields = as_list(item, "hop", max_len=5)
    if len(fields) != 5:
        raise ValueError("a hop has five fields")
    peer, node, start, end, url = fields
    layers = LayerRange(as_int(start, "hop start", lo=0, hi=MAX_DIM), as_int(end, "hop end", lo=1, hi=MAX_DIM))
    return Hop(NodeId(as_str(node, "hop node", max_len=MAX_ID_CHARS)), PeerId(as_str(peer, "hop peer", max_len=MAX_ID_CHARS)),
               layers, as_str(url, "hop url", max_len=MAX_URL_CHARS))  # fmt: skip


def _route(h: dict[str, Any]) -> tuple[Hop, ...]:
    route = tuple(_hop_from_json(x) for x in read_list(h, "route", max_len=MAX_ROUTE_HOPS))
    if not route:
        raise ValueError("a route needs at least one hop")
    return route


def _addressing(h: dict[str, Any]) -> tuple[tuple[Hop, ...], PeerId, SamplingParams | None]:
    """The fields of a ``forward`` that stay the same for a whole leg: route, entry, sampling."""
    return _route(h), PeerId(read_str(h, "reply_to", max_len=MAX_ID_CHARS)), _sampling(h.get("sampling"))


def _sampling_json(sampling: SamplingParams | None) -> list[Any] | None:
    return None if sampling is None else [sampling.temperature, sampling.top_p, sampling.seed]


def _sampling(raw: Any) -> SamplingParams | None:
    """Typed before use: a stranger's ``"seed": 1.5`` must not reach the sampler."""
    if raw is None:
        return None
    fields = as_list(raw, "sampling", max_len=3)
    if len(fields) != 3:
        raise ValueError("sampling has three fields")
    temperature, top_p, seed = fields
    return SamplingParams(temperature, top_p, seed)  # checks types and ranges itself


@dataclass(frozen=True)
class Replay:
    """Positions ``[0, k)`` rebuilt from the kept outputs of the hop whose range ends at
    ``at``, sent (in these frames, the shapes that built them) through the hops up to
    boundary ``until``, which discard their result: the hops after ``until`` still hold them."""

    at: int
    until: int
    frames: tuple[tuple[int, int], ...]

    @property
    def positions(self) -> int:
        start, n = self.frames[-1]
        return start + n


def _replay(raw: Any, start_pos: int) -> Replay | None:
    if raw is None:
        return None
    spec = as_dict(raw, "replay", max_len=3)
    at, until = read_int(spec, "at", lo=1, hi=MAX_DIM), read_int(spec, "until", lo=2, hi=MAX_DIM)
    if until <= at:
        raise ValueError("a replay ends after the hop that sends it")
    frames, pos = [], 0
    for item in read_list(spec, "frames", max_len=MAX_REPLAY_FRAMES):
        pair = as_list(item, "replay frame", max_len=2)
        if len(pair) != 2:
            raise ValueError("a replay frame is [start, length]")
        start, n = as_int(pair[0], "replay start", lo=0, hi=MAX_DIM), as_int(pair[1], "replay length", lo=1, hi=MAX_DIM)
        if start != pos:
            raise ValueError("replay frames are contiguous from position 0")
        frames.append((start, n))
        pos += n
    if not frames or pos != start_pos:
        raise ValueError("a replay rebuilds exactly the positions before its frame")
    return Replay(at, until, tuple(frames))


@dataclass(eq=False, slots=True)
class Forward:
    """Run ``tokens`` or ``hidden`` at positions ``start_pos...`` through ``route[0]`` onward.

    Immutable by convention, not frozen: a frozen dataclass's ``__init__`` sets each of its
    fields through ``object.__setattr__``, and every hop makes two of these a token on the
    caches its engine call left cold (:class:`~inclavate.tensors.EncodedTensor` and
    :class:`Result` likewise). Nothing hashes one (``eq=False``: identity)."""

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
    discard: bool = False
    """Rebuild the cache only: the route may end before the model's last layer, and its
    last hop drops its output (a failover replay into a replaced span)."""
    replay: Replay | None = None
    lane: int = 0
    """Which group of the entry's sessions this step travels with (see the module's notes)."""
    context: bytes | None = None
    """The bytes of this frame's step context, when they are short enough to cache: those it
    arrived with (set by :func:`decode`), or :func:`step_context`'s for a frame a leg sends.
    :func:`encode` sends them as they are, and :meth:`onward` keys the next context on them.
    Never set otherwise: a frame built with other fields must leave it None."""
    via: bytes | None = None
    """Set by :meth:`onward` only: the ``context`` of the frame this one continues. This
    frame's own context is then a function of those bytes and its input's shape, so
    :func:`encode` finds it by them (CPython keeps a bytes object's hash) instead of hashing
    the route's hops and the sampling in Python at every hop of every token. Never sent."""

    def onward(self, hidden: tensors.EncodedTensor, replay: Replay | None) -> Forward:
        """This frame passed to the next hop: ``route[1:]``, carrying this hop's output."""
        return Forward(self.req_id, self.session_id, self.start_pos, self.route[1:], self.reply_to, self.sampling,
                       hidden=hidden, discard=self.discard, replay=replay, lane=self.lane, via=self.context)  # fmt: skip

    @property
    def n_tokens(self) -> int:
        if self.tokens is not None:
            return int(self.tokens.shape[0])
        assert self.hidden is not None
        return int(self.hidden.shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes of the body as received (a stage also holds the float32 decode of hidden
        states: ``p2p.admission.held_bytes``)."""
        return int(self.tokens.nbytes) if self.tokens is not None else self.hidden.nbytes if self.hidden else 0


@dataclass(slots=True)
class Result:
    """The last stage's answer: the sampled token, or None for a prefill chunk. Immutable by
    convention (see :class:`Forward`); compared, never hashed."""

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


@dataclass(frozen=True)
class Adopt:
    """Keep ``session_id``'s cache (and kept outputs) as ``new_id``: a failover's new leg goes
    on through this hop. ``route`` is the one receiving hop. Answered with ``adopted``."""

    TYPE: ClassVar[str] = "adopt"
    req_id: int
    session_id: SessionId
    new_id: SessionId
    route: tuple[Hop, ...]
    reply_to: PeerId


@dataclass(frozen=True)
class Adopted:
    """``session_id`` (the new id) holds ``length`` positions here (0: nothing was kept)."""

    TYPE: ClassVar[str] = "adopted"
    req_id: int
    session_id: SessionId
    length: int
    sender: PeerId | None = field(default=None, compare=False)
    """The peer it came from: never on the wire, set by the receiving forward service from the
    authenticated connection (the entry takes an answer only from the hop it asked)."""


Message = Forward | Result | Close | Closed | Error | Adopt | Adopted


@dataclass(frozen=True)
class _StepContext:
    """What a step frame's context names, checked."""

    session_id: SessionId
    route: tuple[Hop, ...]
    reply_to: PeerId
    sampling: SamplingParams | None
    kind: Literal["tokens", "hidden"]
    dtype: tensors.WireDType | None
    cols: int
    lane: int


_sent_contexts: dict[tuple[Any, ...], bytes] = {}
_received_contexts: dict[bytes, _StepContext] = {}


def _remember(cache: dict[Any, Any], key: Any, value: Any) -> None:
    if len(cache) >= CONTEXT_CACHE_ENTRIES:
        del cache[next(iter(cache))]  # the oldest: a leg that is still going is soon re-added
    cache[key] = value


def encode(msg: Message) -> bytes:
    if isinstance(msg, Forward) and not msg.discard and msg.replay is None:
        step = _encode_step(msg)
        if step is not None:
            return step
    elif isinstance(msg, Result):
        session = msg.session_id.encode()
        token = -1 if msg.token is None else msg.token
        if 0 <= msg.req_id < _REQ_LIMIT and len(session) <= 0xFFFF and -1 <= token < 2**31:
            return _RESULT.pack(RESULT_TAG, 0, len(session), msg.req_id, token) + session
    return _encode_json(msg)


def _encode_step(msg: Forward) -> bytes | None:
    """The step form of ``msg``, or None where a field does not fit it (then JSON)."""
    if msg.tokens is not None:
        kind, dtype, cols, rows = "tokens", None, 0, int(msg.tokens.shape[0])
        body = np.ascontiguousarray(msg.tokens, dtype="<i4").tobytes()
    else:
        assert msg.hidden is not None
        kind, dtype, (rows, cols), body = "hidden", msg.hidden.dtype, msg.hidden.shape, msg.hidden.data
    if not (0 <= msg.req_id < _REQ_LIMIT and 0 <= msg.start_pos < 2**32 and 0 <= rows < 2**32):
        return None
    context = msg.context if msg.context is not None else _context(msg, kind, dtype, cols)
    if context is None:
        return None
    return _STEP.pack(STEP_TAG, 0, len(context), msg.req_id, msg.start_pos, rows) + context + body


def step_context(msg: Forward) -> bytes | None:
    """The context bytes ``msg``'s step form carries: what a receiver finds in its
    ``Forward.context``. None where ``msg`` goes as JSON, or its context is longer than a
    cache keeps. A leg sets it on the frames it sends (``p2p.chain``), so that its own
    first stage checks the context once (``ForwardService._passed``) and passes it on by
    those bytes, as for a frame that arrived."""
    if msg.discard or msg.replay is not None or not 0 <= msg.req_id < _REQ_LIMIT:
        return None
    if msg.tokens is not None:
        context = _context(msg, "tokens", None, 0)
    else:
        assert msg.hidden is not None
        context = _context(msg, "hidden", msg.hidden.dtype, msg.hidden.shape[1])
    return context if context is not None and len(context) <= MAX_CACHED_CONTEXT_BYTES else None


def _context(msg: Forward, kind: str, dtype: str | None, cols: int) -> bytes | None:
    """``msg``'s step context for an input of ``kind``; None above the step form's 64 KiB."""
    # Either key names the context's bytes: a continued frame's by the bytes its predecessor
    # arrived with (see ``Forward.via``), anything else by the fields themselves. Tuples of
    # different lengths never compare equal, so the two kinds share one bounded cache.
    key: tuple[Any, ...] = (msg.via, kind, dtype, cols) if msg.via is not None else \
        (msg.session_id, msg.route, msg.reply_to, msg.sampling, kind, dtype, cols, msg.lane)  # fmt: skip
    context = _sent_contexts.get(key)
    if context is None:
        spec: dict[str, Any] = {"kind": kind} if dtype is None else {"kind": kind, "dtype": dtype, "cols": cols}
        fields = {"session": msg.session_id, "route": [_hop_json(h) for h in msg.route], "reply_to": msg.reply_to,
                  "sampling": _sampling_json(msg.sampling), "input": spec}  # fmt: skip
        if msg.lane:
            fields["lane"] = msg.lane
        context = json.dumps(fields, separators=(",", ":")).encode()
        if len(context) > 0xFFFF:
            return None
        if len(context) <= MAX_CACHED_CONTEXT_BYTES:  # routes come off the network: same bound as received ones
            _remember(_sent_contexts, key, context)
    return context


def _encode_json(msg: Message) -> bytes:
    header: dict[str, Any] = {"type": msg.TYPE, "req": msg.req_id, "session": msg.session_id}
    body = b""
    if isinstance(msg, Forward):
        header.update(
            start_pos=msg.start_pos,
            route=[_hop_json(h) for h in msg.route],
            reply_to=msg.reply_to,
            sampling=_sampling_json(msg.sampling),
        )
        if msg.discard:
            header["discard"] = True
        if msg.replay is not None:
            header["replay"] = {"at": msg.replay.at, "until": msg.replay.until, "frames": [list(f) for f in msg.replay.frames]}
        if msg.lane:
            header["lane"] = msg.lane
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
    elif isinstance(msg, Adopt):
        header.update(new=msg.new_id, route=[_hop_json(h) for h in msg.route], reply_to=msg.reply_to)
    elif isinstance(msg, Adopted):
        header["length"] = msg.length
    elif isinstance(msg, Error):
        header.update(code=msg.code, message=msg.message[:MAX_MESSAGE_CHARS], origin=msg.origin)
        if msg.failed_peer is not None:
            header["failed"] = msg.failed_peer
    raw = json.dumps(header, separators=(",", ":")).encode()
    return _HEADER_LEN.pack(len(raw)) + raw + body


def decode(payload: bytes | memoryview) -> Message:
    view = memoryview(payload)
    if len(view) < _HEADER_LEN.size:
        raise ProtocolError("frame too short for a header")
    try:
        if view[0] == STEP_TAG:
            return _decode_step(view)
        if view[0] == RESULT_TAG:
            return _decode_result(view)
        (size,) = _HEADER_LEN.unpack_from(view)
        if size > MAX_HEADER_BYTES or _HEADER_LEN.size + size > len(view):
            raise ProtocolError(f"bad header length {size}")
        h = parse_json(bytes(view[_HEADER_LEN.size : _HEADER_LEN.size + size]), max_bytes=MAX_HEADER_BYTES)
        body = view[_HEADER_LEN.size + size :]
        return _build(as_dict(h, "header", max_len=16), body)
    except (ValueError, KeyError, TypeError, struct.error, tensors.TensorDecodeError) as exc:
        # Malformed is a ValueError: the reason, not the sender's text, names the failure.
        detail = str(exc) if isinstance(exc, Malformed) else f"{type(exc).__name__}: {exc}"
        raise ProtocolError(f"malformed frame: {detail[:200]}") from exc


_ERROR_CODES = frozenset(ErrorCode.__args__)  # type: ignore[attr-defined]
_INPUT_KINDS = frozenset(("tokens", "hidden"))
_WIRE_DTYPES = frozenset(tensors.WIRE_DTYPES)


def _decode_step(view: memoryview) -> Forward:
    _, reserved, size, req, start_pos, rows = _STEP.unpack_from(view)
    end = _STEP.size + size
    if reserved or end > len(view) or req >= _REQ_LIMIT:
        raise ValueError(f"bad step header (context length {size})")
    raw = bytes(view[_STEP.size : end])
    context = _received_contexts.get(raw)
    cacheable = len(raw) <= MAX_CACHED_CONTEXT_BYTES
    if context is None:
        context = _step_context(raw)
        if cacheable:
            _remember(_received_contexts, raw, context)
    if not 0 < rows <= MAX_DIM or start_pos > MAX_DIM:
        raise ValueError(f"a step of {rows} positions at {start_pos}")
    body = view[end:]
    tokens = hidden = None
    if context.kind == "tokens":
        tokens = _tokens(body, rows)
    else:
        assert context.dtype is not None
        hidden = tensors.EncodedTensor(context.dtype, (rows, context.cols), bytes(body))
        tensors.validate(hidden)
    return Forward(req, context.session_id, start_pos, context.route, context.reply_to, context.sampling, tokens, hidden,
                   lane=context.lane, context=raw if cacheable else None)  # fmt: skip


def _step_context(raw: bytes) -> _StepContext:
    h = as_dict(parse_json(raw, max_bytes=MAX_HEADER_BYTES), "context", max_len=8)
    session = SessionId(read_str(h, "session", max_len=MAX_ID_CHARS))
    route, reply_to, sampling = _addressing(h)
    lane = _lane(h)
    spec = read_dict(h, "input", max_len=4)
    kind = read_str(spec, "kind", max_len=16, choices=_INPUT_KINDS)
    if kind == "tokens":
        return _StepContext(session, route, reply_to, sampling, "tokens", None, 0, lane)
    dtype = read_str(spec, "dtype", max_len=8, choices=_WIRE_DTYPES)
    cols = read_int(spec, "cols", lo=1, hi=MAX_DIM)
    return _StepContext(session, route, reply_to, sampling, "hidden", dtype, cols, lane)  # type: ignore[arg-type]


def _lane(h: dict[str, Any]) -> int:
    return read_int(h, "lane", lo=0, hi=MAX_LANE, default=0)


def _decode_result(view: memoryview) -> Result:
    _, reserved, size, req, token = _RESULT.unpack_from(view)
    if reserved or _RESULT.size + size != len(view) or token < -1 or req >= _REQ_LIMIT:
        raise ValueError("malformed result")
    session = as_str(str(view[_RESULT.size :], "utf-8"), "session", max_len=MAX_ID_CHARS)
    return Result(req, SessionId(session), None if token == -1 else token)


def _tokens(body: memoryview, n: int) -> np.ndarray:
    if len(body) != 4 * n:
        raise ValueError(f"{len(body)} bytes cannot hold {n} token ids")
    return np.frombuffer(body, dtype="<i4").astype(np.int32)


def _build(h: dict[str, Any], body: memoryview) -> Message:
    kind = read_str(h, "type", max_len=16)
    req = read_int(h, "req", lo=0)
    session = SessionId(read_str(h, "session", max_len=MAX_ID_CHARS))
    if kind == Forward.TYPE:
        route, reply_to, sampling = _addressing(h)
        spec = read_dict(h, "input", max_len=8)
        input_kind = read_str(spec, "kind", max_len=16)
        shape = [as_int(d, "shape", lo=0, hi=MAX_DIM) for d in read_list(spec, "shape", max_len=2)]
        tokens = hidden = None
        if input_kind == "tokens":
            if len(shape) != 1:
                raise ValueError("token ids are one-dimensional")
            tokens = _tokens(body, shape[0])
        elif input_kind == "hidden":
            dtype = read_str(spec, "dtype", max_len=8, choices=_WIRE_DTYPES)
            if len(shape) != 2:
                raise ValueError("hidden states are two-dimensional")
            hidden = tensors.EncodedTensor(dtype, (shape[0], shape[1]), bytes(body))  # type: ignore[arg-type]
            tensors.validate(hidden)
        else:
            raise ValueError("unknown input kind")
        if math.prod(shape) == 0:
            raise ValueError("a forward carries at least one position")
        start_pos = read_int(h, "start_pos", lo=0, hi=MAX_DIM)
        discard = read_bool(h, "discard", default=False)
        replay = _replay(h.get("replay"), start_pos)
        if discard and (sampling is not None or replay is not None):
            raise ValueError("a discarded frame neither samples nor replays")
        return Forward(req, session, start_pos, route, reply_to, sampling, tokens, hidden, discard, replay, _lane(h))
    if kind == Result.TYPE:
        token = h.get("token")
        return Result(req, session, None if token is None else as_int(token, "token", lo=0, hi=2**31 - 1))
    if kind == Close.TYPE:
        return Close(req, session, _route(h), PeerId(read_str(h, "reply_to", max_len=MAX_ID_CHARS)))
    if kind == Closed.TYPE:
        return Closed(req, session)
    if kind == Adopt.TYPE:
        new = SessionId(read_str(h, "new", max_len=MAX_ID_CHARS))
        route = _route(h)
        if new == session or len(route) != 1:
            raise ValueError("an adopt names one hop and a new session id")
        return Adopt(req, session, new, route, PeerId(read_str(h, "reply_to", max_len=MAX_ID_CHARS)))
    if kind == Adopted.TYPE:
        return Adopted(req, session, read_int(h, "length", lo=0, hi=MAX_DIM))
    if kind == Error.TYPE:
        code = read_str(h, "code", max_len=32, choices=_ERROR_CODES)
        message = read_str(h, "message", max_len=MAX_MESSAGE_CHARS)
        origin = PeerId(read_str(h, "origin", max_len=MAX_ID_CHARS))
        failed = read_str(h, "failed", max_len=MAX_ID_CHARS, default="")
        return Error(req, session, code, message, origin, PeerId(failed) if failed else None)  # type: ignore[arg-type]
    raise ValueError("unknown message type")
