"""What a forward frame must satisfy before this peer spends any work on it.

:mod:`p2p.wire` has already typed every field (sizes, integers, strings). These checks need
context the decoder lacks: the registry (who holds which layers) and the engine's shape.
Every hop checks the *remaining* route again, because the hop before it may be the liar::

    contiguous      each hop starts where the previous one ends (so layers strictly increase)
    complete        the last hop ends at the model's last layer
    registered      every hop names a node the registry knows, with that peer and range
    no repeats      no node twice (a loop would make a peer compute a frame many times),
                    and a libp2p hop is its own node (node id == peer id)
    input           token ids on the first range (inside the vocabulary), finite hidden
                    states of the model's width after it, at most a context of positions
                    (checked before the hidden states are decoded)
    discard         a failover's rebuild frame may end before the last layer (its last hop
                    drops the output), and never samples
    replay          names boundaries of the route; the hop ending at ``at`` re-sends only
                    what it kept for the session, only once per adopt (the entry just moved
                    it), so a frame cannot make a stage send a session's states at will

A failure is a :class:`FrameRejected` with a fixed :class:`FrameReason`; the forward service
counts it and answers the entry peer with an ``error`` frame, never an exception that could
reach a nursery.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence

import numpy as np

from inclavate import tensors
from inclavate.types import NodeId
from node.engine import EngineInfo
from node.eval_capture import half_to_float32
from p2p.errors import P2PError
from p2p.records import NodeRecord
from p2p.routing import Hop

RecordOf = Callable[[NodeId], NodeRecord | None]
"""The registry's current record of a node, or None."""


class FrameReason(enum.Enum):
    ROUTE_GAP = "route_gap"
    ROUTE_INCOMPLETE = "route_incomplete"
    ROUTE_REPEATS = "route_repeats"
    ROUTE_UNREGISTERED = "route_unregistered"
    WRONG_INPUT = "wrong_input"
    NOT_FINITE = "not_finite"
    TOKEN_OUT_OF_RANGE = "token_out_of_range"
    SESSION_QUOTA = "session_quota"
    SESSION_NOT_YOURS = "session_not_yours"
    STRANGER_AT_RELAY = "stranger_at_relay"
    """A frame for a legacy node this peer relays from neither a registered entry (token ids)
    nor a live previous hop of its range (hidden states)."""
    CLOSE_OFF_ROUTE = "close_off_route"
    """A close to pass on that is not this stage's to pass: its first hop is not this node, or
    its onward hops are not where this stage sent the session (freed here at most)."""
    TOO_LARGE = "too_large"
    """More positions than the stage's context, or more bytes than the sender's budget."""
    QUEUE_FULL = "queue_full"
    """The work all peers queued here holds the stage's whole budget (``p2p.admission``)."""
    MALFORMED = "malformed"
    FOREIGN_REPLY = "foreign_reply"
    FOREIGN_ORIGIN = "foreign_origin"
    """An error naming another peer as its origin (counted, then attributed to its sender)."""
    FOREIGN_ADOPTED = "foreign_adopted"
    """An ``adopted`` from a peer other than the hop the entry asked (ignored by the entry)."""
    FOREIGN_REQUEST = "foreign_request"
    """An answer at the entry for a request its sender never received, or that only another
    hop gives (a token, ``closed``): :mod:`p2p.asked`."""
    REPLAY_REFUSED = "replay_refused"
    TOKENS_NOT_FROM_ENTRY = "tokens_not_from_entry"
    """Token ids whose ``reply_to`` is not their sender: dropped unanswered."""


class FrameRejected(P2PError):
    """A forward or close this peer refuses to act on; ``reason`` says which rule failed."""

    def __init__(self, reason: FrameReason, message: str) -> None:
        self.reason = reason
        super().__init__(message)


def check_route(route: Sequence[Hop], n_layers: int | None, record_of: RecordOf | None) -> None:
    """Raise :class:`FrameRejected` unless ``route`` is a registered chain to ``n_layers``
    (None: to anywhere, for a ``close`` the entry sends one hop at a time)."""
    seen: set[NodeId] = set()
    for index, hop in enumerate(route):
        if hop.node_id in seen or (not hop.forward_url and hop.node_id != hop.peer_id):
            raise FrameRejected(FrameReason.ROUTE_REPEATS, f"hop {index} repeats a node or names another peer's node")
        seen.add(hop.node_id)
        if index and route[index - 1].layers.end != hop.layers.start:
            raise FrameRejected(FrameReason.ROUTE_GAP, f"hop {index} does not start where hop {index - 1} ends")
        if record_of is not None and not _registered(hop, record_of(hop.node_id)):
            raise FrameRejected(FrameReason.ROUTE_UNREGISTERED, f"hop {index} is not what the registry says {hop.node_id} holds")
    if n_layers is not None and route[-1].layers.end != n_layers:
        raise FrameRejected(FrameReason.ROUTE_INCOMPLETE, f"the route ends at layer {route[-1].layers.end}, not {n_layers}")


def check_replay(route: Sequence[Hop], at: int, until: int) -> bool:
    """Raise unless ``at`` and ``until`` are boundaries of ``route`` with a hop between them
    (``route[0]`` is the receiver); True when the receiver is the hop that re-sends."""
    ends = [hop.layers.end for hop in route]
    if at not in ends[:-1] or until not in ends or until <= at:
        raise FrameRejected(FrameReason.REPLAY_REFUSED, "a replay must name boundaries of its route")
    return ends[0] == at


def _registered(hop: Hop, record: NodeRecord | None) -> bool:
    if record is None or record.peer_id != hop.peer_id or record.layers != hop.layers:
        return False
    return (record.forward_url if record.relayed else "") == hop.forward_url


def check_positions(positions: int, context_length: int) -> None:
    """A frame carries at most one context of positions. The framing cap is one context of
    float32 hidden states, so a frame of token ids could carry ``d_model`` contexts (1.18M
    positions for SmolLM2 at 2048) and one of f16 states two: work the stage would decode
    and queue (a minute, waiting for a slot) only to fail it. Checked before decoding."""
    if positions > context_length:
        raise FrameRejected(FrameReason.TOO_LARGE, f"a frame of {positions} positions exceeds the context of {context_length}")


def check_tokens(tokens: np.ndarray | None, info: EngineInfo) -> None:
    """The first range takes token ids, each inside the vocabulary."""
    if not info.is_first or tokens is None:
        raise FrameRejected(FrameReason.WRONG_INPUT, f"layers {info.layers} take {'tokens' if info.is_first else 'hidden states'}")
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= info.n_vocab):
        raise FrameRejected(FrameReason.TOKEN_OUT_OF_RANGE, f"token ids must lie in [0, {info.n_vocab})")


def check_hidden(hidden: np.ndarray, info: EngineInfo) -> None:
    """Later ranges take finite hidden states of the model's width: one NaN would poison
    every later layer and make the last stage's sampler fail."""
    if info.is_first:
        raise FrameRejected(FrameReason.WRONG_INPUT, f"layers {info.layers} take tokens")
    check_states(hidden, info.d_model)


def decoded_hidden(t: tensors.EncodedTensor, info: EngineInfo) -> np.ndarray:
    """``t`` decoded, as :func:`check_hidden` accepts it (or :class:`FrameRejected`). A
    float16 frame of the model's width, every value finite, is decoded and checked in one
    native pass (``node.eval_capture.half_to_float32``): numpy's four calls for it cost
    ~0.05 ms more on the caches an engine call left cold, at every hop of every token."""
    if not info.is_first and t.dtype == "f16" and len(t.shape) == 2 and t.shape[1] == info.d_model:
        hidden = half_to_float32(t.data, t.shape)
        if hidden is not None:
            return hidden
    hidden = tensors.decode(t)
    check_hidden(hidden, info)
    return hidden


def check_states(hidden: np.ndarray, d_model: int, rows: int | None = None) -> None:
    """Hidden states of the model's width (``rows`` of them, when that is known), all finite."""
    if hidden.ndim != 2 or hidden.shape[1] != d_model or (rows is not None and hidden.shape[0] != rows):
        raise FrameRejected(FrameReason.WRONG_INPUT, f"hidden states must be ({rows if rows is not None else 'n'}, {d_model}), "
                            f"not {list(hidden.shape)}")  # fmt: skip
    if not np.isfinite(hidden).all():
        raise FrameRejected(FrameReason.NOT_FINITE, "hidden states must be finite")


def relay_answer_matches(sent: object, answer: object) -> bool:
    """Whether a legacy node's answer continues the frame it was sent, and nothing else:
    the relaying peer sends the answer on under its own identity, so a node must not be
    able to aim it at another route, session or peer."""
    from p2p import wire  # wire imports this module's neighbours; keep the cycle lazy

    if not isinstance(sent, (wire.Forward, wire.Close)) or not isinstance(answer, wire.Message.__args__):  # type: ignore[attr-defined]
        return False
    if answer.session_id != sent.session_id or answer.req_id != sent.req_id:
        return False
    if isinstance(answer, wire.Error):
        return True
    if isinstance(sent, wire.Forward):
        if isinstance(answer, wire.Forward):
            # ... nor make up a replay for the next hops (one is passed on or dropped at the end
            # of its span); its ``discard`` and ``lane`` are the frame's, set by the relay
            # (``p2p.legacy``: a flipped ``discard`` had the next hops answer nothing).
            return (answer.route == sent.route[1:] and answer.reply_to == sent.reply_to and answer.start_pos == sent.start_pos
                    and answer.sampling == sent.sampling and answer.hidden is not None
                    and answer.replay in (None, sent.replay))  # fmt: skip
        return isinstance(answer, wire.Result) and len(sent.route) == 1 and sent.sampling is not None
    if isinstance(answer, wire.Close):
        return answer.route == sent.route[1:] and answer.reply_to == sent.reply_to
    return isinstance(answer, wire.Closed) and len(sent.route) == 1
