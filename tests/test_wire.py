"""The forward protocol's byte layout: decode steps and results in their compact forms, the
step context parsed once per leg, caches that a stranger cannot grow, and malformed compact
frames refused as protocol errors."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from inclavate import tensors
from inclavate.types import LayerRange, NodeId, PeerId, SessionId
from node.sampling import SamplingParams
from p2p import wire
from p2p.errors import ProtocolError
from p2p.routing import Hop

ROUTE = (Hop(NodeId("b"), PeerId("peer-b"), LayerRange(10, 20)), Hop(NodeId("c"), PeerId("peer-c"), LayerRange(20, 30)))


def _step(session: str = "s", *, req: int = 7, pos: int = 12, rows: int = 1, dtype: tensors.WireDType = "f16",
          sampling: SamplingParams | None = SamplingParams(0.5, 0.9, 3)) -> wire.Forward:  # fmt: skip
    hidden = np.random.default_rng(rows).normal(size=(rows, 64)).astype(np.float32)
    return wire.Forward(req, SessionId(session), pos, ROUTE, PeerId("entry"), sampling, hidden=tensors.encode(hidden, dtype))


def _context(**fields: object) -> bytes:
    base: dict[str, object] = {"session": "s", "route": [["peer-b", "b", 10, 20, ""]], "reply_to": "entry", "sampling": None,
                               "input": {"kind": "hidden", "dtype": "f32", "cols": 2}}  # fmt: skip
    return json.dumps({**base, **fields}).encode()


def _step_frame(context: bytes, body: bytes = bytes(8), *, rows: int = 1, pos: int = 0, reserved: int = 0) -> bytes:
    return struct.pack(">BBHQII", wire.STEP_TAG, reserved, len(context), 1, pos, rows) + context + body


@pytest.mark.parametrize("dtype", tensors.WIRE_DTYPES)
def test_a_decode_step_travels_in_the_step_form_and_comes_back_equal(dtype: tensors.WireDType) -> None:
    for msg in (_step(dtype=dtype), _step(rows=5, dtype=dtype, sampling=None)):
        frame = wire.encode(msg)
        assert frame[0] == wire.STEP_TAG
        back = wire.decode(frame)
        assert isinstance(back, wire.Forward)
        assert (back.req_id, back.session_id, back.start_pos, back.route, back.reply_to, back.sampling) == (
            msg.req_id, msg.session_id, msg.start_pos, msg.route, msg.reply_to, msg.sampling)  # fmt: skip
        assert back.hidden == msg.hidden and back.tokens is None and not back.discard and back.replay is None


def test_token_ids_and_results_use_the_compact_forms() -> None:
    first = wire.Forward(2**63 - 1, SessionId("s"), 0, ROUTE, PeerId("entry"), None, tokens=np.array([1, 49151], np.int32))
    back = wire.decode(wire.encode(first))
    assert isinstance(back, wire.Forward) and back.tokens is not None and back.tokens.tolist() == [1, 49151]
    assert back.req_id == 2**63 - 1
    for result in (wire.Result(3, SessionId("sessión-ü"), 49151), wire.Result(4, SessionId("s"), None), wire.Result(5, SessionId("s"), 0)):
        frame = wire.encode(result)
        assert frame[0] == wire.RESULT_TAG and len(frame) < 40
        assert wire.decode(frame) == result


def test_what_the_compact_forms_cannot_hold_goes_as_json() -> None:
    """A replay or a discarded frame: the JSON form, which every receiver reads."""
    replay = wire.Replay(10, 20, ((0, 12),))
    for msg in (wire.Forward(1, SessionId("s"), 12, ROUTE, PeerId("e"), None, hidden=_step().hidden, replay=replay),
                wire.Forward(1, SessionId("s"), 0, ROUTE[:1], PeerId("e"), None, hidden=_step().hidden, discard=True)):  # fmt: skip
        frame = wire.encode(msg)
        assert frame[0] == 0
        back = wire.decode(frame)
        assert isinstance(back, wire.Forward) and (back.req_id, back.replay, back.discard) == (msg.req_id, msg.replay, msg.discard)
    for too_big in (_step(req=2**63), wire.Result(2**63, SessionId("s"), 5)):  # refused in either form
        with pytest.raises(ProtocolError):
            wire.decode(wire.encode(too_big))


def test_a_step_s_lane_travels_in_either_form_and_lane_0_is_the_old_bytes() -> None:
    """The lane is part of a leg's context; lane 0 is written as before lanes existed, so a
    peer that does not know lanes reads it, and one that does reads its absence as 0."""
    lane_0 = _step("zero")
    frame = wire.encode(lane_0)
    size = struct.unpack_from(">BBHQII", frame)[2]
    header = struct.calcsize(">BBHQII")
    assert "lane" not in json.loads(frame[header : header + size])
    assert wire.decode(_step_frame(_context())).lane == 0  # type: ignore[union-attr]
    for lane in (1, wire.MAX_LANE):
        step = wire.Forward(1, SessionId("lanes"), 3, ROUTE, PeerId("e"), None, hidden=lane_0.hidden, lane=lane)
        as_json = wire.Forward(1, SessionId("lanes"), 3, ROUTE, PeerId("e"), None, hidden=lane_0.hidden,
                               replay=wire.Replay(10, 20, ((0, 3),)), lane=lane)  # fmt: skip
        for msg, tag in ((step, wire.STEP_TAG), (as_json, 0)):
            frame = wire.encode(msg)
            assert frame[0] == tag
            assert wire.decode(frame).lane == lane  # type: ignore[union-attr]


def test_a_leg_s_context_is_parsed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    parsed: list[bytes] = []
    real = wire._step_context
    monkeypatch.setattr(wire, "_step_context", lambda raw: parsed.append(raw) or real(raw))
    steps = [wire.decode(wire.encode(_step("once-per-leg", req=i, pos=i))) for i in range(20)]
    assert len(parsed) == 1
    assert all(isinstance(s, wire.Forward) and s.route is steps[0].route for s in steps)  # type: ignore[union-attr]
    assert [s.start_pos for s in steps] == list(range(20))  # type: ignore[union-attr]


def _onward_hidden(cols: int = 2) -> tensors.EncodedTensor:
    return tensors.encode(np.ones((1, cols), np.float32), "f16")


def test_a_frame_passed_on_is_the_bytes_it_would_be_built_afresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """``Forward.onward`` keys the sender's cache on the context its predecessor arrived
    with: the bytes sent are the same as those of the same frame built field by field (a
    peer of yesterday reads them), and no hop or sampling is hashed in Python to find them."""
    routes = [[["peer-b", "b", 10, 20, ""], ["peer-c", "c", 20, 30, ""], ["peer-d", "d", 30, 40, ""]],
              [["peer-b", "b", 10, 20, ""], ["peer-c", "c", 20, 30, ""]]]  # fmt: skip
    for i, route in enumerate(routes):
        received = wire.decode(_step_frame(_context(session=f"onward-{i}", route=route, sampling=[0.5, 0.9, 3], lane=2)))
        assert isinstance(received, wire.Forward) and received.context is not None
        hidden = _onward_hidden()
        nxt = received.onward(hidden, None)
        afresh = wire.Forward(received.req_id, received.session_id, received.start_pos, received.route[1:], received.reply_to,
                              received.sampling, hidden=hidden, lane=received.lane)  # fmt: skip
        assert wire.encode(nxt) == wire.encode(afresh)
        hashed: list[object] = []
        monkeypatch.setattr(Hop, "__hash__", lambda hop: hashed.append(hop) or 0)
        monkeypatch.setattr(SamplingParams, "__hash__", lambda sp: hashed.append(sp) or 0)
        again = wire.decode(_step_frame(_context(session=f"onward-{i}", route=route, sampling=[0.5, 0.9, 3], lane=2)))
        assert isinstance(again, wire.Forward)
        assert wire.encode(again.onward(hidden, None)) == wire.encode(nxt) and hashed == []
        monkeypatch.undo()


def test_a_leg_s_frames_carry_the_context_their_fields_encode_to(monkeypatch: pytest.MonkeyPatch) -> None:
    """A leg sets ``step_context`` on its frames: they go out as the same bytes as frames
    built field by field, a receiver decodes the same context from them, and the first
    stage passes them on with no hop or sampling hashed in Python. Frames that do not go in
    the step form (a rebuild, a replay), or whose context is too long to cache, get none."""
    route = tuple(Hop(NodeId(n), PeerId(f"peer-{n}"), LayerRange(a, b)) for n, a, b in (("a", 0, 10), ("b", 10, 20), ("c", 20, 30)))
    sampling = SamplingParams(0.7, 0.9, 3)
    tokens = np.array([5, 6, 7], np.int32)
    plain = wire.Forward(9, SessionId("leg"), 4, route, PeerId("entry"), sampling, tokens=tokens, lane=1)
    context = wire.step_context(plain)
    assert context is not None
    carried = wire.Forward(9, SessionId("leg"), 4, route, PeerId("entry"), sampling, tokens=tokens, lane=1, context=context)
    assert wire.encode(carried) == wire.encode(plain)
    received = wire.decode(wire.encode(carried))
    assert isinstance(received, wire.Forward) and received.context == context
    hidden = _onward_hidden()
    expected = wire.encode(wire.Forward(9, SessionId("leg"), 4, route[1:], PeerId("entry"), sampling, hidden=hidden, lane=1))
    hashed: list[object] = []
    monkeypatch.setattr(Hop, "__hash__", lambda hop: hashed.append(hop) or 0)
    monkeypatch.setattr(SamplingParams, "__hash__", lambda sp: hashed.append(sp) or 0)
    for _ in range(2):
        assert wire.encode(carried.onward(hidden, None)) == expected
    assert hashed == []
    monkeypatch.undo()
    assert wire.step_context(wire.Forward(1, SessionId("leg"), 0, route, PeerId("entry"), None, tokens=tokens, discard=True)) is None
    replay = wire.Replay(10, 20, ((0, 4),))
    assert wire.step_context(wire.Forward(1, SessionId("leg"), 4, route, PeerId("entry"), None, tokens=tokens, replay=replay)) is None
    long_route = tuple(Hop(NodeId("n" * 200 + str(i)), PeerId("p" * 200 + str(i)), LayerRange(i, i + 1)) for i in range(30))
    assert wire.step_context(wire.Forward(1, SessionId("leg"), 0, long_route, PeerId("entry"), None, tokens=tokens)) is None


def test_frames_passed_on_never_take_another_context_s_bytes() -> None:
    """Adversarial: contexts a stranger makes alike in all but one field (the route's next
    hop, the entry, the sampling, the lane, the session) each go on with their own fields,
    whatever was passed on before; a context too long to cache is passed on built afresh."""
    base = {"session": "alike", "route": [["peer-b", "b", 10, 20, ""], ["peer-c", "c", 20, 30, ""]], "reply_to": "entry",
            "sampling": [0.5, 0.9, 3], "lane": 1}  # fmt: skip
    variants = [base, {**base, "route": [["peer-b", "b", 10, 20, ""], ["peer-x", "x", 20, 30, ""]]},
                {**base, "reply_to": "other"}, {**base, "sampling": None}, {**base, "lane": 3}, {**base, "session": "alike2"},
                {**base, "route": [["peer-b", "b", 10, 20, ""], ["p" * 200, "n" * 200, 20, 21, ""]]
                 + [["p" * 200, "n" * 200, i, i + 1, ""] for i in range(21, 40)]}]  # fmt: skip
    for _ in range(2):  # the second time round, every onward context comes from the cache
        for fields in variants:
            received = wire.decode(_step_frame(_context(**fields)))
            assert isinstance(received, wire.Forward)
            for cols in (2, 3):
                back = wire.decode(wire.encode(received.onward(_onward_hidden(cols), None)))
                assert isinstance(back, wire.Forward) and back.hidden is not None and back.hidden.shape == (1, cols)
                assert (back.session_id, back.route, back.reply_to, back.sampling, back.lane) == (
                    received.session_id, received.route[1:], received.reply_to, received.sampling, received.lane)  # fmt: skip
    assert max(map(len, wire._sent_contexts.values())) <= wire.MAX_CACHED_CONTEXT_BYTES


def test_the_context_caches_stay_bounded_whatever_a_stranger_sends() -> None:
    for i in range(wire.CONTEXT_CACHE_ENTRIES + 300):
        wire.decode(wire.encode(_step(f"session-{i}")))
    assert len(wire._received_contexts) <= wire.CONTEXT_CACHE_ENTRIES
    assert len(wire._sent_contexts) <= wire.CONTEXT_CACHE_ENTRIES
    # A long context is parsed every time, never kept.
    route = [["p" * 200, "n" * 200, i, i + 1, ""] for i in range(20)]
    long = _context(route=route)
    assert len(long) > wire.MAX_CACHED_CONTEXT_BYTES
    msg = wire.decode(_step_frame(long))
    assert isinstance(msg, wire.Forward) and len(msg.route) == 20
    assert bytes(long) not in wire._received_contexts
    wire.decode(wire.encode(msg))  # forwarding it on: encoded, not kept either
    assert max(map(len, wire._sent_contexts.values())) <= wire.MAX_CACHED_CONTEXT_BYTES
    # The newest contexts are the ones kept: a leg in progress stays cached.
    wire.decode(wire.encode(_step("newest")))
    assert any(c.session_id == "newest" for c in wire._received_contexts.values())


@pytest.mark.parametrize(
    "frame",
    [
        bytes([wire.STEP_TAG]) + bytes(5),  # shorter than the step header
        _step_frame(_context(), reserved=1),
        struct.pack(">BBHQII", wire.STEP_TAG, 0, 5000, 1, 0, 1) + _context(),  # context past the end
        _step_frame(b"not json"),
        _step_frame(b"[" * 5000 + b"]" * 5000),
        _step_frame(_context(route=[])),
        _step_frame(_context(route=[[1, 2, "a", None, 5]])),
        _step_frame(_context(reply_to=None)),
        _step_frame(_context(sampling=[0.5, 0.9, 1.5])),
        _step_frame(_context(input={"kind": "hidden", "dtype": "f64", "cols": 2})),
        _step_frame(_context(input={"kind": "hidden", "dtype": "f32", "cols": 0})),
        _step_frame(_context(input={"kind": "pixels"})),
        _step_frame(_context(lane=wire.MAX_LANE + 1)),
        _step_frame(_context(lane=-1)),
        _step_frame(_context(lane="0")),
        _step_frame(_context(lane=True)),
        _step_frame(_context(), rows=0, body=b""),
        _step_frame(_context(), rows=2**24 + 1),
        _step_frame(_context(), pos=2**24 + 1),
        _step_frame(_context(), body=bytes(7)),  # one f32 row of 2 is 8 bytes
        _step_frame(_context(input={"kind": "tokens"}), body=bytes(5)),
        bytes([wire.RESULT_TAG]) + bytes(3),
        struct.pack(">BBHQi", wire.RESULT_TAG, 0, 1, 1, 5) + b"s" + b"trailing",
        struct.pack(">BBHQi", wire.RESULT_TAG, 0, 1, 1, -2) + b"s",
        struct.pack(">BBHQi", wire.RESULT_TAG, 0, 2, 1, 5) + b"\xff\xfe",  # not UTF-8
        struct.pack(">BBHQi", wire.RESULT_TAG, 0, 300, 1, 5) + b"s" * 300,  # a session id too long
        struct.pack(">BBHQi", wire.RESULT_TAG, 1, 1, 1, 5) + b"s",
        struct.pack(">BBHQi", wire.RESULT_TAG, 0, 1, 2**63, 5) + b"s",
        struct.pack(">BBHQII", wire.STEP_TAG, 0, len(_context()), 2**63, 0, 1) + _context() + bytes(8),
        bytes([0x05, 0, 0, 0]) + b"{}",  # neither form
    ],
)
def test_malformed_compact_frames_are_protocol_errors(frame: bytes) -> None:
    with pytest.raises(ProtocolError):
        wire.decode(frame)
