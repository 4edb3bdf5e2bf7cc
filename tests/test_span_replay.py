"""Span replay's pure pieces: what a stage keeps of its outputs, the new frame fields and
messages (hostile input: every one is checked at the wire), and the boundary rules."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from inclavate import tensors
from inclavate.types import LayerRange, NodeId, PeerId, SessionId
from node.kept_outputs import KeptOutputs
from node.sampling import SamplingParams
from p2p import wire
from p2p.errors import ProtocolError
from p2p.forward_checks import FrameRejected, check_replay
from p2p.routing import Hop

D = 8
S = SessionId("s")


def store(dtype: tensors.WireDType = "f16", sessions: int = 2, context: int = 64) -> KeptOutputs:
    return KeptOutputs(max_sessions=sessions, context_length=context, d_model=D, wire_dtype=dtype)


def rows(n: int, start: int = 0) -> np.ndarray:
    return (np.arange(start * D, (start + n) * D, dtype=np.float32).reshape(n, D) + 0.25) * 1.001


def held(_: SessionId) -> bool:
    return True


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_kept_rows_decode_to_what_the_next_hop_decoded(dtype: tensors.WireDType) -> None:
    kept = store(dtype)
    sent = [tensors.encode(rows(5), dtype), *(tensors.encode(rows(1, 5 + i), dtype) for i in range(4))]
    pos = 0
    for t in sent:
        kept.put(S, pos, t, held)
        pos += t.shape[0]
    original = np.concatenate([tensors.decode(t) for t in sent])
    for start, n in ((0, 5), (5, 4), (0, 9), (3, 4)):
        assert np.array_equal(tensors.decode(kept.rows(S, start, n)), original[start : start + n])
    with pytest.raises(IndexError):
        kept.rows(S, 5, 5)


def test_a_rewind_truncates_and_a_gap_forgets() -> None:
    kept = store()
    kept.put(S, 0, tensors.encode(rows(6), "f16"), held)
    kept.put(S, 4, tensors.encode(rows(1, 100), "f16"), held)  # a step re-sent at 4
    assert kept.length(S) == 5
    assert np.array_equal(tensors.decode(kept.rows(S, 4, 1)), tensors.decode(tensors.encode(rows(1, 100), "f16")))
    kept.put(S, 7, tensors.encode(rows(1), "f16"), held)  # a gap: nothing replayable
    assert kept.length(S) == 0


def test_an_f16_overflow_fallback_is_sent_again_exactly() -> None:
    kept = store("f16")
    big = rows(1) * 1e5  # does not fit float16: that frame went as f32
    kept.put(S, 0, tensors.encode(rows(2), "f16"), held)
    kept.put(S, 2, tensors.encode(big, "f16"), held)
    again = kept.rows(S, 0, 3)
    assert again.dtype == "f32"
    assert np.array_equal(tensors.decode(again)[2], big[0])


def test_bounded_by_sessions_and_context() -> None:
    kept = store(sessions=2, context=8)
    for i in range(3):
        kept.put(SessionId(f"s{i}"), 0, tensors.encode(rows(1), "f16"), held)
    assert len(kept) == 2
    kept.put(SessionId("s0"), 0, tensors.encode(rows(9), "f16"), held)  # past the context: dropped
    assert kept.length(SessionId("s0")) == 0
    kept.put(SessionId("s0"), 0, tensors.encode(rows(1), "f16"), held)
    kept.put(SessionId("s9"), 0, tensors.encode(rows(1), "f16"), lambda sid: sid != SessionId("s1"))
    assert kept.length(SessionId("s9")) == 1 and kept.length(SessionId("s1")) == 0  # only live sessions stay
    assert kept.reserved_bytes == 2 * 8 * D * 2


def test_a_replay_is_allowed_once_per_adopt() -> None:
    kept = store()
    kept.put(S, 0, tensors.encode(rows(2), "f16"), held)
    assert not kept.take_replay(S)
    kept.rename(S, SessionId("s.1"))
    assert kept.length(S) == 0 and kept.length(SessionId("s.1")) == 2
    assert kept.take_replay(SessionId("s.1")) and not kept.take_replay(SessionId("s.1"))


HOPS = tuple(Hop(NodeId(p), PeerId(p), LayerRange(a, b)) for p, a, b in (("a", 0, 10), ("b", 10, 20), ("d", 20, 30)))


def test_new_messages_round_trip() -> None:
    replay = wire.Replay(10, 20, ((0, 256), (256, 32), (288, 3)))
    fwd = wire.Forward(3, S, 291, HOPS, PeerId("e"), SamplingParams(0, 1, 0), tokens=np.array([5], np.int32), replay=replay)
    back = wire.decode(wire.encode(fwd))
    assert isinstance(back, wire.Forward) and back.replay == replay and not back.discard
    rebuild = wire.Forward(3, S, 0, HOPS[1:2], PeerId("e"), None, hidden=tensors.encode(rows(2), "f16"), discard=True)
    back = wire.decode(wire.encode(rebuild))
    assert isinstance(back, wire.Forward) and back.discard and back.replay is None
    for msg in (wire.Adopt(4, S, SessionId("s.1"), HOPS[:1], PeerId("e")), wire.Adopted(4, SessionId("s.1"), 291)):
        assert wire.decode(wire.encode(msg)) == msg


def frame(header: dict) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack(">I", len(raw)) + raw + struct.pack("<i", 5)


def forward_header(**fields: object) -> dict:
    return {"type": "forward", "req": 1, "session": "s", "start_pos": 8, "route": [["a", "a", 0, 10, ""]], "reply_to": "e",
            "sampling": None, "input": {"kind": "tokens", "shape": [1]}, **fields}  # fmt: skip


@pytest.mark.parametrize("fields", [
    {"replay": {"at": 10, "until": 20, "frames": [[0, 4], [5, 3]]}},  # not contiguous
    {"replay": {"at": 10, "until": 20, "frames": [[0, 4]]}},  # does not end at start_pos
    {"replay": {"at": 10, "until": 20, "frames": []}},
    {"replay": {"at": 20, "until": 10, "frames": [[0, 8]]}},
    {"replay": {"at": 10, "until": 20, "frames": [[0, 0], [0, 8]]}},
    {"replay": {"at": 10, "until": 20, "frames": [[0, 1]] * (wire.MAX_REPLAY_FRAMES + 1)}},
    {"replay": {"at": 10, "until": 20, "frames": [[0, 8]], "more": 1, "x": 2}},
    {"replay": [10, 20]},
    {"discard": 1},
    {"discard": True, "sampling": [0.5, 0.9, 1]},
    {"discard": True, "replay": {"at": 10, "until": 20, "frames": [[0, 8]]}},
])  # fmt: skip
def test_malformed_replays_are_protocol_errors(fields: dict) -> None:
    with pytest.raises(ProtocolError):
        wire.decode(frame(forward_header(**fields)))


@pytest.mark.parametrize("header", [
    {"type": "adopt", "req": 1, "session": "s", "new": "s", "route": [["a", "a", 0, 10, ""]], "reply_to": "e"},
    {"type": "adopt", "req": 1, "session": "s", "new": "s.1", "route": [["a", "a", 0, 10, ""]] * 2, "reply_to": "e"},
    {"type": "adopt", "req": 1, "session": "s", "new": "x" * 300, "route": [["a", "a", 0, 10, ""]], "reply_to": "e"},
    {"type": "adopted", "req": 1, "session": "s", "length": -1},
    {"type": "adopted", "req": 1, "session": "s", "length": "9"},
])  # fmt: skip
def test_malformed_adopts_are_protocol_errors(header: dict) -> None:
    with pytest.raises(ProtocolError):
        wire.decode(frame(header))


def test_a_replay_must_name_boundaries_of_its_route() -> None:
    assert check_replay(HOPS, 10, 20)  # the first hop re-sends
    assert not check_replay(HOPS, 20, 30)  # a hop before the sender passes it on
    for at, until in ((10, 15), (30, 30), (5, 20), (20, 10)):
        with pytest.raises(FrameRejected):
            check_replay(HOPS, at, until)
