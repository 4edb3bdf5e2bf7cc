"""The data-plane and HTTP edge rules as pure logic, fast: forward-route checks, admission
control, the legacy-node HTTP client, template limits, sampling and the Host policy."""

from __future__ import annotations

import dataclasses
import http.server
import json
import logging
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import numpy as np
import pytest
import trio
from conftest import smollm2_engine
from registry_helpers import MODEL, signed

from api.chat_template import ChatTemplate, TemplateError
from api.request_guard import HostPolicy
from inclavate import tensors
from inclavate.artifact_types import ArtifactUnavailable, BadArtifactRequest
from inclavate.errors import RelayedError
from inclavate.peer_http import _raise_for_error
from inclavate.types import LayerRange, ModelId, NodeId, PeerId, SessionId
from inclavate.untrusted import Malformed
from node.engine import BatchItem, EngineInfo
from node.errors import SessionLimitReached
from node.sampling import SamplingParams, UnusableLogits, sample
from node.stage import Job, Stage, StageResult
from p2p import forward_checks, wire
from p2p.admission import FRAME_OVERHEAD_BYTES, Admission, AdmissionLimits
from p2p.artifact_wire import decode_answer, decode_request
from p2p.chain import SwarmPipeline, _Session, _Span, new_request_id
from p2p.errors import ProtocolError
from p2p.failover import FailoverPolicy
from p2p.forward import ForwardService
from p2p.forward_checks import FrameReason, FrameRejected, check_hidden, check_route, check_tokens, relay_answer_matches
from p2p.legacy import LegacyNodes, _Node
from p2p.legacy_http import HttpLimits, LegacyHttp, NodeUnreachable, check_node_url
from p2p.identity import Identity
from p2p.legs import Leg, blame
from p2p.records import NodeRecord, legacy_node_id
from p2p.registry import Liveness, Table, Verdict, apply
from p2p.routing import Hop


def _hop(name: str, start: int, end: int, url: str = "") -> Hop:
    return Hop(NodeId(name), PeerId(name), LayerRange(start, end), url)


def _registry(*hops: Hop) -> dict[NodeId, NodeRecord]:
    return {h.node_id: NodeRecord(node_id=h.node_id, peer_id=h.peer_id, model_id=ModelId("m"), start_layer=h.layers.start,
                                  end_layer=h.layers.end, n_layers=30, d_model=8, state="Ready", seq=1, ts_ms=1)
            for h in hops}  # fmt: skip


def _reason(call) -> FrameReason:  # type: ignore[no-untyped-def]
    with pytest.raises(FrameRejected) as info:
        call()
    return info.value.reason


def test_routes_must_be_contiguous_complete_registered_and_loop_free() -> None:
    a, b, c = _hop("a", 0, 10), _hop("b", 10, 20), _hop("c", 20, 30)
    known = _registry(a, b, c)
    check_route((a, b, c), 30, known.get)
    check_route((b, c), 30, known.get)
    check_route((b,), None, known.get)  # a close may name one hop
    assert _reason(lambda: check_route((c, _hop("x", 30, 31)), 30, known.get)) is FrameReason.ROUTE_UNREGISTERED
    assert _reason(lambda: check_route((c, _hop("x", 30, 31)), 30, None)) is FrameReason.ROUTE_INCOMPLETE
    assert _reason(lambda: check_route((a, c), 30, known.get)) is FrameReason.ROUTE_GAP
    assert _reason(lambda: check_route((b,), 30, known.get)) is FrameReason.ROUTE_INCOMPLETE
    assert _reason(lambda: check_route((c,) * 200, 30, known.get)) is FrameReason.ROUTE_REPEATS
    assert _reason(lambda: check_route((Hop(NodeId("c"), PeerId("a"), LayerRange(20, 30)),), 30, known.get)) is FrameReason.ROUTE_REPEATS
    liar = _hop("b", 10, 25)  # b is registered for 10-20
    assert _reason(lambda: check_route((a, liar, _hop("d", 25, 30)), 30, known.get)) is FrameReason.ROUTE_UNREGISTERED


def test_inputs_must_fit_the_range() -> None:
    first = EngineInfo(ModelId("m"), LayerRange(0, 10), 30, 8, 100, "llama")
    later = EngineInfo(ModelId("m"), LayerRange(10, 20), 30, 8, 100, "llama")
    check_tokens(np.array([0, 99], np.int32), first)
    assert _reason(lambda: check_tokens(np.array([100], np.int32), first)) is FrameReason.TOKEN_OUT_OF_RANGE
    assert _reason(lambda: check_tokens(np.array([-1], np.int32), first)) is FrameReason.TOKEN_OUT_OF_RANGE
    assert _reason(lambda: check_tokens(np.array([1], np.int32), later)) is FrameReason.WRONG_INPUT
    check_hidden(np.zeros((2, 8), np.float32), later)
    assert _reason(lambda: check_hidden(np.zeros((2, 9), np.float32), later)) is FrameReason.WRONG_INPUT
    for bad in (np.nan, np.inf, -np.inf):
        x = np.zeros((2, 8), np.float32)
        x[1, 3] = bad
        assert _reason(lambda x=x: check_hidden(x, later)) is FrameReason.NOT_FINITE


def test_a_legacy_node_may_only_continue_the_frame_it_was_sent() -> None:
    b, c = _hop("b", 10, 20, "http://n"), _hop("c", 20, 30)
    sent = wire.Forward(1, SessionId("s"), 0, (b, c), PeerId("e"), None, hidden=None)
    h = tensors.encode(np.zeros((1, 8), np.float32))
    assert relay_answer_matches(sent, wire.Forward(1, SessionId("s"), 0, (c,), PeerId("e"), None, hidden=h))
    assert relay_answer_matches(sent, wire.Error(1, SessionId("s"), "engine_error", "x", PeerId("b")))
    assert not relay_answer_matches(sent, wire.Forward(1, SessionId("s"), 0, (_hop("evil", 20, 30),), PeerId("e"), None, hidden=h))
    assert not relay_answer_matches(sent, wire.Forward(1, SessionId("other"), 0, (c,), PeerId("e"), None, hidden=h))
    assert not relay_answer_matches(sent, wire.Result(1, SessionId("s"), 5))  # not the last hop
    assert not relay_answer_matches(sent, wire.Close(1, SessionId("s"), (c,), PeerId("e")))
    # nor make up a replay for the next hops (an audit, 2026-12-07); its discard and lane are
    # the frame's, set by the relay (test_legacy_rules.py -k keeps_the_frame)
    onward = wire.Forward(1, SessionId("s"), 0, (c,), PeerId("e"), None, hidden=h)
    assert not relay_answer_matches(sent, dataclasses.replace(onward, replay=wire.Replay(20, 25, ((0, 4),))))  # made up
    replaying = dataclasses.replace(sent, replay=wire.Replay(20, 25, ((0, 4),)))
    assert relay_answer_matches(replaying, dataclasses.replace(onward, replay=replaying.replay))  # passed on
    assert relay_answer_matches(replaying, onward)  # or dropped at the end of its span


def test_strangers_get_a_bounded_share_of_sessions_and_lose_idle_ones() -> None:
    now = [0.0]
    admission = Admission(AdmissionLimits(stranger_idle_s=30), is_known=lambda p: p == "friend", clock=lambda: now[0])
    evil, other = PeerId("evil"), PeerId("other")
    admission.admit(evil, SessionId("e1"), held=False, max_sessions=4)
    admission.admit(evil, SessionId("e1"), held=True, max_sessions=4)  # its own session again
    with pytest.raises(FrameRejected) as quota:
        admission.admit(evil, SessionId("e2"), held=False, max_sessions=4)
    assert quota.value.reason is FrameReason.SESSION_QUOTA
    admission.admit(other, SessionId("o1"), held=False, max_sessions=4)
    with pytest.raises(FrameRejected):  # strangers together hold half of the 4 slots at most
        admission.admit(PeerId("third"), SessionId("t1"), held=False, max_sessions=4)
    with pytest.raises(FrameRejected) as theft:
        admission.admit(other, SessionId("e1"), held=True, max_sessions=4)
    assert theft.value.reason is FrameReason.SESSION_NOT_YOURS
    with pytest.raises(FrameRejected):  # a session someone known opened
        admission.admit(evil, SessionId("honest"), held=True, max_sessions=4)
    for i in range(10):
        admission.admit(PeerId("friend"), SessionId(f"f{i}"), held=False, max_sessions=4)
    assert not admission.may_close(other, SessionId("e1")) and admission.may_close(evil, SessionId("e1"))
    now[0] = 20.0
    admission.admit(evil, SessionId("e1"), held=True, max_sessions=4)  # used: stays
    now[0] = 40.0
    assert admission.idle_stranger_sessions() == [SessionId("o1")]
    now[0] = 60.0
    assert admission.idle_stranger_sessions() == [SessionId("e1")]


async def test_work_in_flight_is_bounded_per_peer(autojump_clock: trio.abc.Clock) -> None:
    admission = Admission(AdmissionLimits(jobs_per_peer=2, bytes_per_peer=100), is_known=lambda p: True)
    flood, honest = PeerId("flood"), PeerId("honest")
    first = await admission.reserve(flood, 10)
    await admission.reserve(flood, 10)
    with trio.move_on_after(5) as blocked:
        await admission.reserve(flood, 10)
    assert blocked.cancelled_caught  # the flooder waits...
    await admission.reserve(honest, 90)  # ...everyone else does not
    with pytest.raises(FrameRejected):
        await admission.reserve(honest, 101)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(admission.reserve, flood, 10)
        await trio.sleep(1)
        first()
    assert admission.in_flight(flood) == (2, 20)
    admission.reset_in_flight()
    assert admission.in_flight(flood) == (0, 0)


class _HoldingStage:
    """A stage whose slots are all busy: it holds every job it is given (a real one keeps a
    new session's jobs for its 60 s admission wait, whatever its queue size)."""

    def __init__(self, layers: LayerRange, *, context_length: int, d_model: int) -> None:
        info = EngineInfo(MODEL, layers, 30, d_model, 100, "llama")
        config = SimpleNamespace(context_length=context_length, max_sessions=4)
        self.engine = SimpleNamespace(info=info, config=config, session_length=lambda _: 0)
        self.kept = None
        self.jobs: list = []

    async def submit(self, job, *, in_place: bool = True) -> None:  # type: ignore[no-untyped-def]
        self.jobs.append(job)

    async def step_now(self, *_: object) -> bool:
        return False  # nothing runs in place: every job waits for a slot

    def holds(self, session_id: SessionId) -> bool:
        return any(job.session_id == session_id for job in self.jobs)


def _serving(stage: _HoldingStage, limits: AdmissionLimits = AdmissionLimits()) -> tuple[ForwardService, list[str]]:
    """A forward service for ``stage`` whose answers are recorded (their error codes)."""
    service = ForwardService(SimpleNamespace(peer_id=PeerId("me")), node_id=NodeId("me"), stage=stage,  # type: ignore[arg-type]
                             admission=limits, direct_port=None)  # fmt: skip
    codes: list[str] = []

    async def send(peer: PeerId, msg: wire.Message, *, wait_for_room: bool = True) -> None:
        codes.append(msg.code if isinstance(msg, wire.Error) else msg.TYPE)

    service.send = send  # type: ignore[method-assign]
    return service, codes


def _frame(sender: PeerId, session: str, stage: _HoldingStage, rows: int) -> wire.Forward:
    info = stage.engine.info
    route = (Hop(NodeId("me"), PeerId("me"), info.layers),) + ((_hop("next", info.layers.end, 30),) if not info.is_last else ())
    if info.is_first:
        return wire.Forward(1, SessionId(session), 0, route, sender, None, tokens=np.ones(rows, np.int32))
    hidden = tensors.encode(np.ones((rows, info.d_model), np.float32), "f16")
    return wire.Forward(1, SessionId(session), 0, route, sender, None, hidden=hidden)


async def test_work_in_flight_is_bounded_for_all_peers_together() -> None:
    """Identities cost nothing: 64 frames of ~4.7 MB each (256 MiB) from every one of them,
    held by a stage whose slots were busy, grew a peer's memory ~240 MB per identity until
    it died (2026-12, from an audit). Every peer here stays within its own budget; the
    newcomer that would take the total past ``bytes_total`` is refused, as a frame over its
    sender's budget is, and what the frames held is counted (an f16 frame: its bytes and
    their float32 decode) and given back when their jobs end, however they end."""
    ctx, d_model = 64, 16
    stage = _HoldingStage(LayerRange(10, 20), context_length=ctx, d_model=d_model)
    held = ctx * d_model * (2 + 4) + FRAME_OVERHEAD_BYTES  # what one full f16 frame holds here
    limits = AdmissionLimits(jobs_per_peer=64, bytes_per_peer=4 * held, bytes_total=12 * held, small_frame_bytes=held // 2)
    service, codes = _serving(stage, limits)
    senders = [PeerId(f"free-identity-{i}") for i in range(4)]
    with trio.fail_after(5):  # nobody waits: each is within its own budget
        for i, sender in enumerate(senders[:3]):
            for k in range(4):
                await service._on_forward(_frame(sender, f"s{i}-{k}", stage, ctx), sender)
        assert codes == [] and len(stage.jobs) == 12
        await service._on_forward(_frame(senders[3], "newcomer", stage, ctx), senders[3])
    assert codes == ["protocol"] and service.drops[FrameReason.QUEUE_FULL] == 1
    assert len(stage.jobs) == 12
    assert service.admission.in_flight(senders[0]) == (4, 4 * held)
    assert service.admission.in_flight_total() == (12, 12 * held)

    for job in stage.jobs:  # their sessions never got a slot (the stage's 60 s wait)
        await job.deliver(StageResult(error=SessionLimitReached("all slots stayed busy")))
    assert codes[1:] == ["session_limit"] * 12
    assert service.admission.in_flight_total() == (0, 0)
    assert all(service.admission.in_flight(sender) == (0, 0) for sender in senders)
    await stage.jobs[0].deliver(StageResult(error=SessionLimitReached("again")))  # gives back nothing twice
    assert service.admission.in_flight_total() == (0, 0)
    await service._on_forward(_frame(senders[3], "newcomer", stage, ctx), senders[3])
    assert len(stage.jobs) == 13 and service.admission.in_flight_total() == (1, held)

    async def closed(_job: object, **_: object) -> None:  # the stage went away under the frame
        raise trio.ClosedResourceError

    stage.submit = closed  # type: ignore[method-assign]
    with pytest.raises(trio.ClosedResourceError):
        await service._on_forward(_frame(senders[2], "late", stage, ctx), senders[2])
    assert service.admission.in_flight_total() == (1, held)
    service.stage = stage  # type: ignore[assignment]  # replaced: nothing of the old one is delivered
    assert service.admission.in_flight_total() == (0, 0)
    await stage.jobs[-1].deliver(StageResult(error=SessionLimitReached("late")))  # counted before the reset
    assert service.admission.in_flight_total() == (0, 0)


def test_the_entry_request_ids_cannot_be_guessed_from_those_a_hop_sees() -> None:
    """Request ids counted from 1: a hop that saw one knew the next, and a peer feeding that
    hop's range could aim a refusal through it at the entry for a request it never saw."""
    ids = [new_request_id() for _ in range(1000)]
    assert all(0 < i < 2**53 for i in ids) and len(set(ids)) == len(ids)
    assert sum(1 for a, b in zip(ids, ids[1:]) if b - a == 1) == 0


async def test_a_flood_of_large_frames_does_not_stop_the_decode_steps() -> None:
    """Four free identities' large frames fill what all peers may queue (``bytes_total``):
    every frame after them was refused, so the sessions decoding here failed for as long as
    the flood lasted. Small frames (decode steps) count against a total of their own, which
    is refused in its turn only when small frames fill it."""
    ctx, d_model = 64, 16
    stage = _HoldingStage(LayerRange(10, 20), context_length=ctx, d_model=d_model)
    large = ctx * d_model * (2 + 4) + FRAME_OVERHEAD_BYTES
    small = d_model * (2 + 4) + FRAME_OVERHEAD_BYTES  # one position
    limits = AdmissionLimits(jobs_per_peer=64, bytes_per_peer=4 * large, bytes_total=12 * large,
                             small_frame_bytes=large // 2, small_bytes_total=3 * small)  # fmt: skip
    service, codes = _serving(stage, limits)
    flood = [PeerId(f"free-identity-{i}") for i in range(3)]
    with trio.fail_after(5):
        for i, sender in enumerate(flood):
            for k in range(4):
                await service._on_forward(_frame(sender, f"s{i}-{k}", stage, ctx), sender)
        assert codes == [] and service.admission.in_flight_total() == (12, 12 * large)
        feeder = PeerId("previous-hop")
        for k in range(3):  # three sessions' decode steps
            await service._on_forward(_frame(feeder, f"decoding-{k}", stage, 1), feeder)
        assert codes == [] and len(stage.jobs) == 15
        await service._on_forward(_frame(feeder, "decoding-3", stage, 1), feeder)  # small frames' own total
    assert codes == ["protocol"] and service.drops[FrameReason.QUEUE_FULL] == 1
    assert service.admission.in_flight_total() == (15, 12 * large + 3 * small)
    await stage.jobs[-1].deliver(StageResult(error=SessionLimitReached("done")))  # a small one given back to its own total
    await service._on_forward(_frame(feeder, "decoding-4", stage, 1), feeder)
    assert codes[1:] == ["session_limit"] and len(stage.jobs) == 16


async def test_small_frames_of_the_largest_size_do_not_fill_their_total_from_a_few_identities(
        autojump_clock: trio.abc.Clock) -> None:  # fmt: skip
    """The flooder picks its frames' size: frames just under ``small_frame_bytes`` (42
    positions of f16 states at ``d_model`` 2048) filled the small frames' 64 MiB with 129
    frames from three identities, and every decode step after them was refused (2026-12-06,
    a review). Each peer's small frames now hold at most ``small_bytes_per_peer`` (more wait,
    as over its own budget), so fifteen identities leave room for the sessions decoding."""
    ctx, d_model = 4096, 2048
    stage = _HoldingStage(LayerRange(10, 20), context_length=ctx, d_model=d_model)
    limits = AdmissionLimits()
    rows = (limits.small_frame_bytes - FRAME_OVERHEAD_BYTES) // (d_model * (2 + 4))
    service, codes = _serving(stage, limits)
    for i in range(15):
        sender = PeerId(f"free-identity-{i}")
        with trio.move_on_after(10):  # as many as it may queue; the next one waits
            for k in range(limits.jobs_per_peer):
                await service._on_forward(_frame(sender, f"s{i}-{k}", stage, rows), sender)
    assert codes == []
    feeder = PeerId("previous-hop")
    with trio.fail_after(1):
        await service._on_forward(_frame(feeder, "decoding", stage, 1), feeder)
    assert codes == [] and service.drops[FrameReason.QUEUE_FULL] == 0


async def test_a_frame_longer_than_the_context_is_refused_before_it_is_decoded(monkeypatch: pytest.MonkeyPatch) -> None:
    """The framing cap is one context of float32 states, so one frame of token ids carried
    1.18M positions at SmolLM2's 2048 (4.7 MB), and one of f16 states two contexts: work no
    stage can run, decoded and queued for a minute before it failed."""
    ctx = 64
    decoded: list[object] = []
    real_decode, real_half = tensors.decode, forward_checks.half_to_float32

    def decode(t: tensors.EncodedTensor) -> np.ndarray:
        decoded.append(t)
        return real_decode(t)

    def half_to_float32(data: bytes, shape: tuple[int, ...]) -> np.ndarray | None:  # float16 states' native decode
        decoded.append(data)
        return real_half(data, shape)

    monkeypatch.setattr(tensors, "decode", decode)
    monkeypatch.setattr(forward_checks, "half_to_float32", half_to_float32)
    for layers in (LayerRange(0, 10), LayerRange(10, 20)):  # token ids, then hidden states
        stage = _HoldingStage(layers, context_length=ctx, d_model=16)
        service, codes = _serving(stage)
        entry = PeerId("entry")
        await service._on_forward(_frame(entry, "long", stage, ctx + 1), entry)
        assert codes == ["protocol"] and service.drops[FrameReason.TOO_LARGE] == 1, layers
        assert stage.jobs == [] and decoded == [] and service.admission.in_flight_total() == (0, 0)
        await service._on_forward(_frame(entry, "whole", stage, ctx), entry)  # one whole context is fine
        assert codes == ["protocol"] and len(stage.jobs) == 1
        assert len(decoded) == (0 if layers.start == 0 else 1)
        decoded.clear()


def test_node_urls_are_http_with_a_host() -> None:
    assert check_node_url("http://10.0.0.2:5001/") == "http://10.0.0.2:5001"
    assert check_node_url("https://node.example") == "https://node.example"
    for bad in ("foo", "file:///etc/passwd", "ftp://h/x", "http://", "http://u:p@h/", "http://h/?q=1", "http://h:99999",
                "gopher://h", "http://h:0", "x" * 3000):  # fmt: skip
        with pytest.raises(Malformed):
            check_node_url(bad)


class _Scripted(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802
        if self.path == "/redirect":
            self.send_response(302)
            self.send_header("location", "/big")
            self.send_header("content-length", "0")
            self.end_headers()
        elif self.path == "/big":
            body = b"x" * 5000
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        else:  # /drip: one byte every 0.3 s, for ever
            self.send_response(200)
            self.send_header("content-length", "1000")
            self.end_headers()
            try:
                for _ in range(1000):
                    self.wfile.write(b"x")
                    self.wfile.flush()
                    time.sleep(0.3)
            except OSError:
                pass

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def scripted_url() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Scripted)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


async def test_legacy_http_follows_no_redirect_and_bounds_size_and_time(scripted_url: str) -> None:
    client = LegacyHttp(HttpLimits(timeout_s=1.5, max_response_bytes=1000, threads=2))
    status, _ = await client.request("GET", scripted_url + "/redirect")
    assert status == 302  # reported, not followed
    with pytest.raises(NodeUnreachable, match="exceeds"):
        await client.request("GET", scripted_url + "/big")
    started = time.monotonic()
    with pytest.raises(NodeUnreachable):
        await client.request("GET", scripted_url + "/drip")
    assert time.monotonic() - started < 10  # the deadline, not the 300 s the node would take
    # ... and the thread ends too, within one socket timeout of it: it went on reading the
    # drip, its place in the limiter taken, for as long as the node kept it up (two such
    # nodes took every place here; four, every probe's: an audit, 2026-12-07).
    with trio.fail_after(5):
        while client._limiter.borrowed_tokens:
            await trio.sleep(0.05)
    with pytest.raises(NodeUnreachable):
        await client.request("GET", "foo/forward")  # the old crash: ValueError from urllib


def test_templates_are_bounded_in_time_and_size() -> None:
    spin = ChatTemplate("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x", "", "")
    started = time.monotonic()
    with pytest.raises(TemplateError, match="within"):
        spin.render([], timeout_s=0.5)
    assert time.monotonic() - started < 5
    with pytest.raises(TemplateError):
        ChatTemplate("{{ 'a' * 10000000000 }}", "", "").render([])
    with pytest.raises(TemplateError):
        ChatTemplate("{{ 7 ** 100000000 }}", "", "").render([])
    assert ChatTemplate("{{ messages[0]['content'] * 2 }}", "", "").render([{"role": "user", "content": "ab"}]) == "abab"


def test_sampling_refuses_what_the_wire_could_carry() -> None:
    for bad in ((0.5, 0.9, 1.5), (0.5, 0.9, "x"), (0.5, 0.9, True), ("hot", 0.9, 1), (float("nan"), 0.9, 1), (0.5, 2.0, 1)):
        with pytest.raises(ValueError):
            SamplingParams(*bad)  # type: ignore[arg-type]
    assert SamplingParams(0.5, 0.9, -1).seed == 2**64 - 1  # any integer maps onto the generator's 64 bits
    logits = np.zeros(10, np.float32)
    logits[3] = np.nan
    with pytest.raises(UnusableLogits):
        sample(logits, SamplingParams(0.8, 0.95, 1), 0)
    with pytest.raises(UnusableLogits):
        sample(logits, SamplingParams(0.0, 1.0, 1), 0)


def test_wire_frames_with_bad_fields_are_protocol_errors() -> None:
    base = {"type": "forward", "req": 1, "session": "s", "start_pos": 0, "route": [["p", "p", 0, 1, ""]], "reply_to": "e",
            "sampling": None, "input": {"kind": "tokens", "shape": [1]}}  # fmt: skip
    body = np.array([1], "<i4").tobytes()

    def frame(header: dict | str, payload: bytes = body) -> bytes:
        raw = (header if isinstance(header, str) else json.dumps(header)).encode()
        return len(raw).to_bytes(4, "big") + raw + payload

    assert isinstance(wire.decode(frame(base)), wire.Forward)
    for bad in ({**base, "sampling": [0.5, 0.9, 1.5]}, {**base, "req": 2**70}, {**base, "start_pos": -1},
                {**base, "route": []}, {**base, "route": [["p", "p", 0, 1, ""]] * 300}, {**base, "route": [[1, 2, 3]]},
                {**base, "input": {"kind": "hidden", "dtype": "f32", "shape": [2**40, 2**40]}},
                {**base, "input": {"kind": "tokens", "shape": [0]}}, {**base, "type": "result", "token": -1},
                {**base, "type": "error", "code": "made_up", "message": "", "origin": "p"},
                "[" * 10000 + "]" * 10000, json.dumps(base).replace('"req": 1,', '"req": Infinity,')):  # fmt: skip
        with pytest.raises(ProtocolError):
            wire.decode(frame(bad))
    with pytest.raises(ProtocolError):
        wire.decode(frame({**base, "input": {"kind": "hidden", "dtype": "f32", "shape": [2**40, 2**40]}}, b""))


def test_the_entry_refuses_token_ids_outside_the_vocabulary(smollm2) -> None:
    """llama.cpp aborts the process on such an id (std::terminate); the tokenizer raises."""
    from node.errors import UnknownToken
    from node.tokenizer import Tokenizer

    with Tokenizer(smollm2.path) as tokenizer:
        assert tokenizer.token_bytes(300)
        for bad in (tokenizer.n_vocab, 10**6, -1):
            with pytest.raises(UnknownToken):
                tokenizer.token_bytes(bad)


def test_the_host_check_applies_to_loopback_binds_only() -> None:
    local = HostPolicy.for_bind("127.0.0.1", 8001, ["my.box", "other:9000"])
    for ok in ("127.0.0.1:8001", "localhost:8001", "[::1]:8001", "127.0.0.1", "LOCALHOST:8001", "my.box:8001", "other:9000"):
        assert local.allows(ok), ok
    for bad in ("evil.example:8001", "evil.example", "127.0.0.1:8002", "other:8001", ""):
        assert not local.allows(bad), bad
    assert HostPolicy.for_bind("0.0.0.0", 8001).allows("anything.example")


async def test_a_hop_cannot_make_the_entry_blame_another_hop() -> None:
    """A hop on a session's route may report its own failure or its successor's, never name
    another hop (which the entry would then avoid for up to five minutes)."""

    class Entry:
        peer_id = PeerId("entry")

    liar, honest, last = PeerId("liar"), PeerId("honest"), PeerId("last")
    route = tuple(Hop(NodeId(p), p, LayerRange(i * 10, i * 10 + 10)) for i, p in enumerate((honest, liar, last)))
    service = _Wired(_hop(Entry.peer_id, 0, 10), None, *route)
    session = SessionId("s")
    leg = Leg(session, route, service.open_inbox(session, (h.peer_id for h in route)))

    async def blamed(error: wire.Error, sender: PeerId) -> set[PeerId]:
        # Each error answers a frame the entry sent along the route.
        await service.ask(honest, wire.Forward(error.req_id, session, 0, route, Entry.peer_id, None, tokens=np.ones(1, np.int32)))
        await service._dispatch(error, sender)
        return set(blame(leg, leg.inbox.receive_nowait(), Entry.peer_id))

    assert await blamed(wire.Error(1, session, "engine_error", "boom", origin=honest), liar) == {liar}
    assert await blamed(wire.Error(2, session, "unreachable", "gone", liar, failed_peer=honest), liar) == {liar}
    assert service.drops[FrameReason.FOREIGN_ORIGIN] == 1
    # What honest hops report still points where it did.
    assert await blamed(wire.Error(3, session, "unreachable", "gone", liar, failed_peer=last), liar) == {last}
    assert await blamed(wire.Error(4, session, "unreachable", "gone", honest), honest) == {liar}
    assert await blamed(wire.Error(5, session, "context_full", "full", last), last) == {last}
    for i, lost in enumerate((honest, liar, last)):  # our own link to any hop that ended
        entry_lost = wire.Error(6 + i, session, "unreachable", "link lost", Entry.peer_id, failed_peer=lost)
        assert await blamed(entry_lost, Entry.peer_id) == {lost}


async def test_a_full_legacy_relay_queue_is_an_error_to_the_entry_not_a_wait() -> None:
    """The relay runs in the reader of the sender's inbound stream: waiting for room stalled
    every other session that sender drives through this peer."""
    sent: list[tuple[PeerId, wire.Message]] = []

    async def send(peer: PeerId, msg: wire.Message) -> None:
        sent.append((peer, msg))

    registry = SimpleNamespace(identity=SimpleNamespace(peer_id=PeerId("host")))
    nodes = LegacyNodes(registry, None, send=send)  # type: ignore[arg-type]
    node_id = NodeId("host:n1")
    queue, _unread = trio.open_memory_channel[wire.Message](1)
    nodes._nodes[node_id] = _Node(NodeRecord.__new__(NodeRecord), "http://127.0.0.1:1/forward", "t", queue=queue)
    hop = Hop(node_id, PeerId("host"), LayerRange(0, 10), "http://127.0.0.1:1/forward")
    frame = wire.Forward(1, SessionId("s"), 0, (hop,), PeerId("entry"), None, tokens=np.array([1], np.int32))
    with trio.fail_after(5):
        await nodes.relay(frame)  # takes the queue's one place
        await nodes.relay(frame)
    assert len(sent) == 1
    peer, error = sent[0]
    assert peer == "entry" and isinstance(error, wire.Error) and "busy" in error.message


def test_hidden_states_get_a_chain_members_quota_only_from_a_previous_hop() -> None:
    """A record costs nothing to publish: "known" for a frame of hidden states means a live
    record of this model ending where the stage starts, the previous hop of some route."""
    prev, elsewhere, other_model, departed, relay, entry = (Identity.generate() for _ in range(6))
    records = [
        signed(prev, 0, 10), signed(elsewhere, 20, 30), signed(other_model, 0, 10, model_id=ModelId("other:1m")),
        signed(departed, 0, 10, state="Dead"), signed(entry, 0, 30, model_id=ModelId("other:1m")),
        signed(relay, 0, 10, node_id=legacy_node_id(relay.peer_id, "n1"), relayed=True, forward_url="http://10.0.0.1:9/forward"),
    ]  # fmt: skip
    table = Table()
    for record in records:
        table, verdict = apply(table, record, 1_000_000, Liveness())
        assert verdict is Verdict.ACCEPTED
    service = ForwardService(SimpleNamespace(peer_id=PeerId("me")), node_id=NodeId("me"), stage=None, direct_port=None)  # type: ignore[arg-type]
    service.record_of = lambda node_id: entry.record if (entry := table.get(node_id)) else None
    service.records_signed_by = table.records_signed_by
    stage = SimpleNamespace(engine=SimpleNamespace(info=SimpleNamespace(model_id=MODEL, layers=LayerRange(10, 20))))
    hop = Hop(NodeId("me"), PeerId("me"), LayerRange(10, 20))
    hidden = wire.Forward(1, SessionId("s"), 0, (hop,), PeerId("e"), None, hidden=tensors.encode(np.zeros((1, 4), np.float32)))
    tokens = wire.Forward(1, SessionId("s"), 0, (hop,), PeerId("e"), None, tokens=np.array([1], np.int32))

    def feeds(peer: Identity, msg: wire.Forward) -> bool:
        return service._may_feed(peer.peer_id, msg, stage)  # type: ignore[arg-type]

    assert [feeds(p, hidden) for p in (prev, relay)] == [True, True]
    assert [feeds(p, hidden) for p in (elsewhere, other_model, departed, entry)] == [False] * 4
    assert [feeds(p, tokens) for p in (prev, elsewhere, other_model, entry)] == [True] * 4  # any entry
    assert not feeds(departed, tokens) and not feeds(Identity.generate(), tokens)


def test_nesting_from_another_peer_is_a_refusal_not_a_recursion_error() -> None:
    """Artifact requests and answers, and peers' HTTP answers, came through ``json.loads``:
    2,000 brackets (4 KiB, within a request's size) raised ``RecursionError`` past every
    handler that expects ``ValueError``, a traceback logged per request (and a 500 for the
    asker's client)."""
    deep = b"[" * 2000 + b"]" * 2000
    with pytest.raises(BadArtifactRequest):
        decode_request(deep)
    with pytest.raises(ArtifactUnavailable, match="malformed answer"):
        decode_answer(b'{"ok": true, "x": ' + deep + b"}", "p")
    with pytest.raises(RelayedError) as refused:
        _raise_for_error(500, deep)
    assert refused.value.body == {"error": "the owning peer answered 500"}


def _recording_service(me: PeerId, table: Table) -> tuple[ForwardService, list[tuple[PeerId, wire.Message]]]:
    """A forward service checking frames against ``table``; what it sends, recorded (peer,
    message), not sent."""
    service = ForwardService(SimpleNamespace(peer_id=me), node_id=NodeId(me), stage=None, direct_port=None)  # type: ignore[arg-type]
    service.record_of = lambda node_id: held.record if (held := table.get(node_id)) else None
    service.records_signed_by = table.records_signed_by
    sent: list[tuple[PeerId, wire.Message]] = []

    async def send(peer: PeerId, msg: wire.Message, *, wait_for_room: bool = True) -> None:
        sent.append((peer, msg))

    service.send = send  # type: ignore[method-assign]
    return service, sent


async def test_a_stranger_cannot_have_an_honest_hop_refuse_a_frame_to_an_entry_it_names() -> None:
    """A refusal goes to the frame's ``reply_to`` in this peer's name: the entry fails the
    request (``invalid_batch``) or avoids this peer (``wrong_route``). Any stranger who
    learnt a session id could end it, or steer its traffic, through honest hops. Now only
    the entry itself or a live previous hop has a refusal sent to the entry; anyone else
    gets it back."""
    prev, stranger, entry = (Identity.generate() for _ in range(3))
    table = Table()
    for record in (signed(prev, 0, 10), signed(entry, 20, 30)):
        table, _ = apply(table, record, 1_000_000, Liveness())
    service, sent = _recording_service(PeerId("me"), table)
    hidden = tensors.encode(np.zeros((1, 4), np.float32))
    not_mine = (Hop(NodeId("gone"), PeerId("me"), LayerRange(10, 20)), Hop(NodeId("w"), PeerId("w"), LayerRange(20, 30)))
    gap = (Hop(NodeId("me"), PeerId("me"), LayerRange(10, 20)), Hop(NodeId("w"), PeerId("w"), LayerRange(25, 30)))
    stage = SimpleNamespace(engine=SimpleNamespace(info=SimpleNamespace(model_id=MODEL, layers=LayerRange(10, 20), n_layers=30)))

    async def refused_to(route: tuple[Hop, ...], sender: Identity) -> PeerId:
        sent.clear()
        frame = wire.Forward(7, SessionId("victim"), 0, route, entry.peer_id, None, hidden=hidden)
        await service._on_forward(frame, sender.peer_id)
        [(peer, error)] = sent
        assert isinstance(error, wire.Error) and error.origin == "me"
        return peer

    for route in (not_mine, gap):  # wrong_route before the stage, and a refusal by the route checks
        service.stage = stage if route is gap else None  # type: ignore[assignment]
        assert await refused_to(route, stranger) == stranger.peer_id
        assert await refused_to(route, prev) == entry.peer_id  # a previous hop acts for the entry
        assert await refused_to(route, entry) == entry.peer_id


async def test_a_peer_relays_only_its_own_legacy_nodes_and_only_for_their_sessions_peers() -> None:
    """A record naming a ``forward_url`` is free to publish, and every such hop was relayed:
    a stranger's own "legacy node" first on a route had this peer refuse the frame to the
    entry the stranger named, in this peer's name (blamed, avoided), and frames for a node
    this peer does relay were queued from anyone, past every stage rule (an audit,
    2026-12-07). Now a hop is relayed only by the peer vouching for it, and only for a
    registered entry or a live previous hop of its range."""
    me, prev, stranger, nobody, entry = (Identity.generate() for _ in range(5))
    url = "http://10.0.0.1:9/forward"
    mine, theirs = legacy_node_id(me.peer_id, "n1"), legacy_node_id(stranger.peer_id, "x")
    table = Table()
    for record in (signed(prev, 0, 10), signed(me, 10, 20, node_id=mine, relayed=True, forward_url=url),
                   signed(stranger, 10, 20, node_id=theirs, relayed=True, forward_url=url), signed(entry, 20, 30)):  # fmt: skip
        table, verdict = apply(table, record, 1_000_000, Liveness())
        assert verdict is Verdict.ACCEPTED
    service, sent = _recording_service(PeerId(me.peer_id), table)
    nodes = LegacyNodes(SimpleNamespace(identity=me), None, send=service.send)  # type: ignore[arg-type]
    queue, relayed = trio.open_memory_channel[wire.Message](8)
    nodes._nodes[mine] = _Node(NodeRecord.__new__(NodeRecord), url, "t", queue=queue)
    service.relayed = nodes
    last = Hop(NodeId(entry.peer_id), entry.peer_id, LayerRange(20, 30))

    def frame(first: NodeId, owner: Identity) -> wire.Forward:
        route = (Hop(first, owner.peer_id, LayerRange(10, 20), url), last)
        return wire.Forward(7, SessionId("victim"), 0, route, entry.peer_id, None, hidden=tensors.encode(np.zeros((1, 4), np.float32)))

    async def answers(msg: wire.Message, sender: Identity) -> list[tuple[PeerId, str]]:
        sent.clear()
        await service._dispatch(msg, sender.peer_id)
        return [(peer, getattr(answer, "code", answer.TYPE)) for peer, answer in sent]

    # The stranger's own node is nobody's to relay here: refused back to the stranger.
    assert await answers(frame(theirs, stranger), stranger) == [(stranger.peer_id, "wrong_route")]
    # Nobody's previous hop gets no session at a node this peer relays.
    assert await answers(frame(mine, me), nobody) == [(nobody.peer_id, "session_limit")]
    assert await answers(frame(mine, me), stranger) == [(stranger.peer_id, "session_limit")]
    assert service.drops[FrameReason.STRANGER_AT_RELAY] == 2
    with pytest.raises(trio.WouldBlock):
        relayed.receive_nowait()
    # Its live previous hop's frame is queued for the node, unanswered here.
    assert await answers(frame(mine, me), prev) == []
    assert relayed.receive_nowait().session_id == "victim"
    # A close goes on to the node only if this peer relays it.
    for first, owner in ((theirs, stranger), (mine, me)):
        await answers(wire.Close(8, SessionId("victim"), (Hop(first, owner.peer_id, LayerRange(10, 20), url),), entry.peer_id), prev)
    assert service.drops[FrameReason.CLOSE_OFF_ROUTE] == 1
    assert relayed.receive_nowait().TYPE == "close"
    # "Nothing kept" from a hop without the session goes to whoever asked, not to the entry named.
    adopt = wire.Adopt(9, SessionId("victim"), SessionId("victim.1"), (last,), entry.peer_id)
    assert await answers(adopt, prev) == [(prev.peer_id, "adopted")]


# ------------------------------------------------ who may claim, close and adopt a session


class _Wired(ForwardService):
    """A forward service driven frame by frame (``_dispatch`` with the sender's PeerID, as
    the stream reader passes it): what it sends to other peers is recorded, not sent."""

    def __init__(self, me: Hop, stage: Stage | None, *registered: Hop) -> None:
        super().__init__(SimpleNamespace(peer_id=me.peer_id), node_id=me.node_id, stage=stage, direct_port=None)  # type: ignore[arg-type]
        self.record_of = _registry(me, *registered).get
        self.sent: list[tuple[PeerId, wire.Message]] = []
        self.peers: dict[PeerId, ForwardService] = {}
        """Services wired to this one: what is sent to them is also delivered."""

    async def send(self, peer: PeerId, msg: wire.Message, *, wait_for_room: bool = True) -> None:
        if peer == self.me:
            await self._dispatch(msg, self.me)
            return
        self.sent.append((peer, msg))
        if peer in self.peers:
            await self.peers[peer]._dispatch(msg, self.me)


async def _until(condition, what: str, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    with trio.fail_after(timeout):
        while not condition():
            await trio.sleep(0.01)


def _tokens(session: str, route: tuple[Hop, ...], entry: PeerId, tokens: tuple[int, ...] = (1, 2, 3)) -> wire.Forward:
    return wire.Forward(1, SessionId(session), 0, route, entry, None, tokens=np.array(tokens, np.int32))


async def test_a_stranger_cannot_claim_a_session_whose_first_job_waits_at_the_stage(smollm2, slice_cache) -> None:
    """Admission took the sender of a frame for a session the engine did not hold as its
    owner: a stranger who knew the id of an honest session whose first job was still queued
    (here: waiting for a slot) became its owner, so it could feed it, close it or adopt it,
    and the idle sweep freed it 30 s on. Also for the new id of an adopt still queued."""
    me, y, z, k = _hop("me", 0, 10), _hop("y", 10, 20), _hop("z", 20, 30), _hop("k", 0, 30)
    route, known, evil, evil2 = (me, y, z), k.peer_id, PeerId("evil"), PeerId("evil2")
    s, moved = SessionId("s"), SessionId("s.1")
    with smollm2_engine(smollm2, slice_cache, (0, 10), max_sessions=4) as engine:
        stage = Stage(engine)
        service = _Wired(me, stage, y, z, k)
        async with trio.open_nursery() as nursery:
            await nursery.start(stage.run)
            for i in range(4):  # every slot taken by the known entry's sessions
                await service._dispatch(_tokens(f"busy{i}", route, known), known)
            await _until(lambda: engine.memory().sessions == 4, "the busy sessions to open")
            await service._dispatch(_tokens("s", route, known), known)  # waits for a slot
            await service._dispatch(wire.Adopt(2, s, moved, (me,), known), known)  # queued behind it
            await trio.sleep(0.1)
            assert engine.session_length(s) == 0
            await service._dispatch(_tokens("s", route, evil, (7,)), evil)
            await service._dispatch(wire.Close(3, s, route, evil), evil)
            await service._dispatch(_tokens("s.1", route, evil2, (7,)), evil2)
            assert service.drops[FrameReason.SESSION_NOT_YOURS] == 3
            assert not service.admission.may_close(evil, s) and not service.admission.may_close(evil2, moved)
            await service._dispatch(wire.Close(4, SessionId("busy0"), route, known), known)  # a slot frees
            await _until(lambda: engine.session_length(moved) == 3, "the honest session to open and move")
            await trio.sleep(0.3)  # what the strangers sent would have run by now
            assert engine.session_length(moved) == 3
            fed = [(m.session_id, m.reply_to) for _, m in service.sent if isinstance(m, wire.Forward) and m.session_id in (s, moved)]
            assert fed == [(s, known)]
            nursery.cancel_scope.cancel()


async def test_a_close_goes_on_only_along_the_route_the_stage_sent_the_session(smollm2, slice_cache) -> None:
    """A close was passed on under this peer's identity, checked only by who may close the
    session here: a stranger that owned id S here (its own session) had an honest peer send
    ``close S`` to any registered peer it named, which honours a known peer's close and
    freed someone else's S there. A close goes on only from this node's own hop, to the hops
    the session's frames went to from here."""
    me, y, other, z, k = _hop("me", 0, 10), _hop("y", 10, 20), _hop("y2", 10, 20), _hop("z", 20, 30), _hop("k", 0, 30)
    route, known, evil = (me, y, z), k.peer_id, PeerId("evil")
    mine, honest = SessionId("mine"), SessionId("honest")
    with smollm2_engine(smollm2, slice_cache, (0, 10), max_sessions=2) as engine:
        stage = Stage(engine)
        service = _Wired(me, stage, y, other, z, k)
        async with trio.open_nursery() as nursery:
            await nursery.start(stage.run)
            await service._dispatch(_tokens("mine", route, evil), evil)  # its own session, on to y
            await service._dispatch(_tokens("honest", route, known), known)
            await _until(lambda: engine.memory().sessions == 2, "both sessions to open")
            await service._dispatch(wire.Close(5, mine, (other, z), evil), evil)  # a first hop not ours
            await service._dispatch(wire.Close(6, mine, (me, other, z), evil), evil)  # ours, then elsewhere
            await _until(lambda: engine.session_length(mine) == 0, "the stranger's own session to close here")
            await service._dispatch(wire.Close(7, honest, route, known), known)  # the route it took
            await _until(lambda: engine.session_length(honest) == 0, "the honest session to close")
            await trio.sleep(0.1)
            closes = [(peer, m.session_id, m.route) for peer, m in service.sent if isinstance(m, wire.Close)]
            # The stranger's session freed here goes on closed where this stage sent it, in its name.
            assert closes == [(y.peer_id, mine, (y, z)), (y.peer_id, honest, (y, z))]
            assert service.drops[FrameReason.CLOSE_OFF_ROUTE] == 2
            nursery.cancel_scope.cancel()


async def test_the_peers_that_fed_a_session_may_close_it_once_the_registry_lets_them_lapse(smollm2, slice_cache) -> None:
    """A hop stopped for over a minute (SIGSTOP) wakes with every other record dropped from its
    registry and reads the closes queued meanwhile before any heartbeat: a close was honoured
    only from a registered peer (or a stranger's own session), so its entry's and its previous
    hop's closes were refused and the dead session kept its slot for the ten-minute idle
    timeout (2026-12, a chaos audit). The peers that fed the session here (the sender of its
    frames, and the entry they named) may close it whatever the registry says now; a stranger,
    or a peer that fed another session, still may not."""
    me, prev, entry = _hop("me", 20, 30), _hop("prev", 10, 20), _hop("entry", 0, 10)
    other_prev, other_entry, evil = _hop("prev2", 10, 20), _hop("entry2", 0, 10), PeerId("evil")
    first, second, theirs = SessionId("first"), SessionId("second"), SessionId("theirs")
    with smollm2_engine(smollm2, slice_cache, (20, 30), max_sessions=4) as engine:
        stage = Stage(engine)
        service = _Wired(me, stage, prev, entry, other_prev, other_entry)
        hidden = tensors.encode(np.ones((3, engine.info.d_model), np.float32), "f32")
        async with trio.open_nursery() as nursery:
            await nursery.start(stage.run)
            for session, sender, named in ((first, prev, entry), (second, prev, entry), (theirs, other_prev, other_entry)):
                frame = wire.Forward(1, session, 0, (me,), named.peer_id, None, hidden=hidden)
                await service._dispatch(frame, sender.peer_id)
            await _until(lambda: all(engine.session_length(s) == 3 for s in (first, second, theirs)), "the sessions to open")
            service.record_of = _registry(me).get  # everyone else lapsed while this peer was stopped
            await service._dispatch(wire.Close(2, first, (me,), evil), evil)
            await service._dispatch(wire.Close(3, first, (me,), other_entry.peer_id), other_entry.peer_id)
            await service._dispatch(wire.Close(4, theirs, (me,), entry.peer_id), prev.peer_id)
            assert service.drops[FrameReason.SESSION_NOT_YOURS] == 3
            await service._dispatch(wire.Close(5, first, (me,), entry.peer_id), entry.peer_id)  # the entry's own
            await service._dispatch(wire.Close(6, second, (me,), entry.peer_id), prev.peer_id)  # along the route
            await _until(lambda: engine.memory().sessions == 1, "the fed sessions to close")
            assert engine.session_length(theirs) == 3
            closed = [(peer, m.session_id) for peer, m in service.sent if isinstance(m, wire.Closed)]
            assert sorted(closed) == [(entry.peer_id, first), (entry.peer_id, second)]
            assert service.drops[FrameReason.SESSION_NOT_YOURS] == 3
            nursery.cancel_scope.cancel()


async def test_a_step_context_that_passed_its_checks_is_checked_again_for_another_sender_or_registry(smollm2, slice_cache) -> None:
    """A stage runs the checks a step context decides (route, sender) once per registry table
    and sender, not at every frame. What passed for the previous hop must not pass for a
    stranger replaying its context's bytes, nor once the registry no longer says what the
    check relied on: the sender lapsed, or a later hop moved its layers."""
    me, prev, z, evil = _hop("me", 10, 20), _hop("prev", 0, 10), _hop("z", 20, 30), PeerId("evil")
    session = SessionId("s")
    with smollm2_engine(smollm2, slice_cache, (10, 20), max_sessions=4) as engine:
        stage = Stage(engine)
        service = _Wired(me, stage, prev, z)
        registry = {"table": _registry(me, prev, z)}
        service.registry_table = lambda: registry["table"]

        def registered(*hops: Hop) -> None:
            registry["table"] = table = _registry(*hops)
            service.record_of = table.get

        registered(me, prev, z)
        hidden = tensors.encode(np.ones((1, engine.info.d_model), np.float32), "f16")

        async def step(at: int, sender: PeerId) -> None:
            frame = wire.decode(wire.encode(wire.Forward(at + 1, session, at, (me, z), prev.peer_id, None, hidden=hidden)))
            assert isinstance(frame, wire.Forward) and frame.context is not None  # a step frame, context cached
            await service._dispatch(frame, sender)

        onward = lambda: sum(1 for peer, m in service.sent if peer == z.peer_id and isinstance(m, wire.Forward))  # noqa: E731
        async with trio.open_nursery() as nursery:
            await nursery.start(stage.run)
            await step(0, prev.peer_id)
            await step(1, prev.peer_id)
            await _until(lambda: onward() == 2, "the previous hop's steps to go on")
            await step(2, evil)  # the same context's bytes from a stranger
            assert service.drops[FrameReason.SESSION_NOT_YOURS] == 1
            registered(me, z)  # the previous hop lapsed
            await step(2, prev.peer_id)
            assert service.drops[FrameReason.SESSION_NOT_YOURS] == 2
            registered(me, prev, _hop("z", 25, 30))  # the next hop now holds other layers
            await step(2, prev.peer_id)
            assert service.drops[FrameReason.ROUTE_UNREGISTERED] == 1
            registered(me, prev, z)  # as at first: the step goes on
            await step(2, prev.peer_id)
            await _until(lambda: onward() == 3, "the step to go on once the registry says so again")
            assert engine.session_length(session) == 3
            nursery.cancel_scope.cancel()


async def test_only_the_hop_asked_to_adopt_may_answer_for_it() -> None:
    """The entry matched ``adopted`` answers by request id only (a process-wide counter):
    another hop of the new route (one placed in the replacement span) answering first for a
    kept hop with a false length made the entry ask that hop to replay what it does not
    keep; it refused in its own name, was blamed, and the session failed over again."""
    entry, kept, middle, last = _hop("entry", 0, 10), _hop("kept", 0, 10), _hop("middle", 10, 20), _hop("last", 20, 30)
    service = _Wired(entry, None, kept, middle, last)
    pipeline = SwarmPipeline(service, MODEL, list, 128, lambda _: None)
    old = Leg(SessionId("s"), (kept, _hop("dead", 10, 20), last), trio.open_memory_channel[wire.Message](1)[1])
    new_route = (kept, middle, last)
    new = Leg(SessionId("s.1"), new_route, service.open_inbox(SessionId("s.1"), (h.peer_id for h in new_route)))
    held: dict[PeerId, int] = {}

    async def adopt() -> None:
        held.update(await pipeline._adopt(old, new, (kept, last)))

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(adopt)
            await _until(lambda: len(service.sent) == 2, "both adopts sent")
            asked = {peer: msg.req_id for peer, msg in service.sent if isinstance(msg, wire.Adopt)}
            for req in asked.values():  # the middle hop answers first, for both kept hops
                await service._dispatch(wire.Adopted(req, SessionId("s.1"), 4000), middle.peer_id)
            await service._dispatch(wire.Adopted(asked[last.peer_id], SessionId("s.1"), 12), kept.peer_id)  # the wrong hop
            for hop in (kept, last):
                await service._dispatch(wire.Adopted(asked[hop.peer_id], SessionId("s.1"), 12), hop.peer_id)
    assert held == {kept.peer_id: 12, last.peer_id: 12}
    assert service.drops[FrameReason.FOREIGN_ADOPTED] == 3


async def test_the_entry_takes_an_answer_only_from_the_hops_its_request_reached() -> None:
    """The entry took a session's answers from any hop of its route whatever request they
    named (request ids are a process-wide counter, so a hop sees other requests' ids): a
    middle hop could hand it the step's token ahead of the last stage, end a prefill with an
    error for a request it never received, or acknowledge a close that had not reached the
    last hop. Now an error comes only from a hop its request's frame reaches, a token only
    from the last hop of a frame that samples, ``closed`` only from a close's last hop; the
    rest is counted (``FOREIGN_REQUEST``) and dropped before the session sees it."""
    entry, first, middle, last = _hop("entry", 0, 10), _hop("first", 0, 10), _hop("middle", 10, 20), _hop("last", 20, 30)
    route, s = (first, middle, last), SessionId("s")
    service = _Wired(entry, None, first, middle, last)
    pipeline = SwarmPipeline(service, MODEL, list, 128, lambda _: None, policy=FailoverPolicy(poll_s=60.0))
    session = _Session(s)
    pipeline._sessions[s] = session
    pipeline._open_leg(session, list(route))
    assert session.leg is not None
    inbox = session.leg.inbox
    tokens: list[int | None] = []

    async def step() -> None:
        tokens.append(await pipeline.step(s, 0, [1, 2, 3], SamplingParams(seed=1)))

    def asked(kind: type) -> int:
        return [m for _, m in service.sent if isinstance(m, kind)][-1].req_id

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(step)
            await _until(lambda: service.sent, "the step to go out")
            req = asked(wire.Forward)
            await service._dispatch(wire.Result(req, s, 666), middle.peer_id)  # a middle hop's token
            await service._dispatch(wire.Error(req + 10_000, s, "engine_error", "boom", middle.peer_id), middle.peer_id)
            await service._dispatch(wire.Result(req, s, 7), last.peer_id)
    assert tokens == [7]
    assert service.drops[FrameReason.FOREIGN_REQUEST] == 2

    # A rebuild frame into the middle hop only, and a close along the route.
    await service.ask(middle.peer_id, wire.Forward(new_request_id(), s, 0, (middle,), entry.peer_id, None,
                                                   tokens=np.array([1], np.int32), discard=True))  # fmt: skip
    rebuild = asked(wire.Forward)
    await service.ask(first.peer_id, wire.Close(new_request_id(), s, route, entry.peer_id))
    close = asked(wire.Close)
    refused = (
        (wire.Error(rebuild, s, "engine_error", "boom", first.peer_id), first),  # the frame never reached it
        (wire.Result(rebuild, s, 3), middle),  # a rebuild frame never samples
        (wire.Closed(close, s), first),  # only the close's last hop acknowledges it
        (wire.Error(req, s, "engine_error", "late", middle.peer_id), middle),  # answered: done
    )
    for msg, sender in refused:
        await service._dispatch(msg, sender.peer_id)
    assert service.drops[FrameReason.FOREIGN_REQUEST] == 2 + len(refused)
    with pytest.raises(trio.WouldBlock):
        inbox.receive_nowait()
    taken = (
        (wire.Error(rebuild, s, "engine_error", "boom", middle.peer_id), middle),
        (wire.Error(close, s, "unreachable", "gone", first.peer_id, middle.peer_id), first),
        (wire.Closed(close, s), last),
        (wire.Error(rebuild, s, "unreachable", "link lost", entry.peer_id, middle.peer_id), entry),  # our own word
    )
    for msg, sender in taken:
        await service._dispatch(msg, sender.peer_id)
        assert inbox.receive_nowait() == msg


async def test_a_peer_that_learnt_a_session_id_cannot_claim_its_next_leg_first(smollm2, slice_cache) -> None:
    """Failover's new leg ids were ``<id>.1``, ``<id>.2``, ...: a peer that learnt a session's
    id (any hop of its route, the one about to be failed over too) could open the next leg's
    id first at a hop the failover keeps. The adopt, never onto an id already held, then kept
    nothing there (the span replay fell back to the whole route) and the new leg went on
    under an id the claimer held, which as a registered peer it could feed. A new leg's id
    now has a random part: the claim lands on an id nobody uses, and the adopt keeps the cache."""
    me, y, z = _hop("me", 0, 10), _hop("y", 10, 20), _hop("z", 20, 30)
    entry, claimer = _hop("entry", 0, 30), _hop("claimer", 0, 30)
    route, s = (me, y, z), SessionId("s")
    with smollm2_engine(smollm2, slice_cache, (0, 10), max_sessions=4) as engine:
        stage = Stage(engine, keep_outputs="f32")  # a stage before the last keeps what it sent on
        hop = _Wired(me, stage, y, z, entry, claimer)
        entry_side = _Wired(entry, None, me, y, z)
        entry_side.peers, hop.peers = {me.peer_id: hop}, {entry.peer_id: entry_side}
        pipeline = SwarmPipeline(entry_side, MODEL, list, 128, lambda _: None)
        session = _Session(s)
        pipeline._open_leg(session, list(route))
        old = session.leg
        assert old is not None and old.wire_id == s
        async with trio.open_nursery() as nursery:
            await nursery.start(stage.run)
            await entry_side.ask(me.peer_id, _tokens("s", route, entry.peer_id))
            for guess in ("s.1", "s.2"):  # the claimer opens the ids it expects the next legs to take
                await hop._dispatch(_tokens(guess, route, claimer.peer_id, (7,)), claimer.peer_id)
            await _until(lambda: engine.memory().sessions == 3, "the session and the claims to open")
            with trio.fail_after(10):
                pipeline._open_leg(session, list(route))  # a failover keeping this hop
                assert session.leg is not None
                held = await pipeline._adopt(old, session.leg, (me,))
            assert held == {me.peer_id: 3}
            assert engine.session_length(session.leg.wire_id) == 3 and engine.session_length(s) == 0
            assert [engine.session_length(SessionId(guess)) for guess in ("s.1", "s.2")] == [1, 1]
            nursery.cancel_scope.cancel()


async def test_closes_and_adopts_of_sessions_the_stage_does_not_hold_take_no_job(smollm2, slice_cache) -> None:
    """A stage runs a close or adopt ahead of every step, and queued one for any id a
    registered peer named: that peer's adopts of made-up ids, ~2,000 a second, kept every
    session waiting for three failovers and a 503 (2026-12-07, an audit). A session the stage
    holds nothing of is answered at once (adopt: nothing kept, to whoever asked), and its close
    goes on only where this stage sent the session. Here the stage's worker never runs: a
    job queued for them would never be answered."""
    me, y, z, k = _hop("me", 0, 10), _hop("y", 10, 20), _hop("z", 20, 30), _hop("k", 0, 30)
    with smollm2_engine(smollm2, slice_cache, (0, 10), max_sessions=4) as engine, trio.fail_after(20):
        service = _Wired(me, Stage(engine), y, z, k)
        for i in range(100):
            await service._dispatch(wire.Adopt(i, SessionId(f"nobody{i}"), SessionId(f"nobody{i}.1"), (me,), z.peer_id), k.peer_id)
            await service._dispatch(wire.Close(i, SessionId(f"nobody{i}"), (me, y, z), k.peer_id), k.peer_id)
        answers = [(peer, m.TYPE, m.length if m.TYPE == "adopted" else getattr(m, "code", None)) for peer, m in service.sent]
        # No close passed on in this peer's name; the asker, which named itself the entry, is
        # told at once (an entry then closes each hop itself, without waiting out its timeout).
        assert answers == [(k.peer_id, "adopted", 0), (k.peer_id, "error", "wrong_route")] * 100
        assert service.drops[FrameReason.CLOSE_OFF_ROUTE] == 100
        service.sent.clear()
        await service._dispatch(wire.Close(7, SessionId("nobody"), (me, y, z), z.peer_id), k.peer_id)  # naming another entry
        assert service.sent == []


async def test_a_close_or_adopt_goes_first_but_not_twice_in_a_row_past_a_held_sessions_step(smollm2, slice_cache) -> None:
    """A close or adopt runs ahead of the steps queued before it (it may free the slot a new
    session waits for), and each registered peer may close or adopt any session: one after
    another, they kept a held session's step waiting for as long as they came (2026-12-07, an
    audit). A step of a held session now runs between two of them."""
    ran: list[str] = []

    def noting(what: str):  # type: ignore[no-untyped-def]
        async def deliver(_: StageResult) -> None:
            ran.append(what)

        return deliver

    with smollm2_engine(smollm2, slice_cache, (0, 10), max_sessions=8) as engine, trio.fail_after(30):
        stage = Stage(engine)
        async with trio.open_nursery() as nursery:
            await nursery.start(stage.run)
            for name in ("s", "h1", "h2", "h3"):
                await stage.submit(Job(BatchItem(SessionId(name), 0, tokens=np.array([1, 2, 3], np.int32)), SessionId(name),
                                       noting(f"open {name}"), None), in_place=False)  # fmt: skip
            await _until(lambda: len(ran) == 4, "the sessions to open")
            nursery.cancel_scope.cancel()
        ran.clear()
        stage._control_ran = False  # a fresh worker: nothing ran before these
        for job in (Job(None, SessionId("h1"), noting("close h1")), Job(None, SessionId("h2"), noting("close h2")),
                    Job(BatchItem(SessionId("s"), 3, tokens=np.array([4], np.int32)), SessionId("s"), noting("step s"), None),
                    Job(None, SessionId("h3"), noting("close h3"))):  # fmt: skip
            await stage.submit(job, in_place=False)
        async with trio.open_nursery() as nursery:
            await nursery.start(stage.run)
            await _until(lambda: len(ran) == 4, "the queued jobs to run")
            nursery.cancel_scope.cancel()
        assert ran == ["close h1", "step s", "close h2", "close h3"]
        # A step behind a close of its own session cannot run before it: it does not hold the
        # close back (the round would run nothing, and wait; a review, the same day).
        step = Job(BatchItem(SessionId("s"), 4, tokens=np.array([4], np.int32)), SessionId("s"), noting("step s"), None)
        assert stage._steps_of_held_sessions([step])
        assert not stage._steps_of_held_sessions([Job(None, SessionId("s"), noting("close s")), step])


async def test_a_replay_is_sent_in_the_stages_own_frames_and_only_so_often_a_session(smollm2, slice_cache) -> None:
    """A replay's frames were the request's: a stranger that adopted its own session (as its
    opener may) had the stage re-send every kept row as a frame of its own, and again after
    each adopt, filling the link to the next hop in this peer's name until every honest step
    on it was refused (2026-12-07, an audit). The stage now plans the frames from the frames it
    sent (small steps in frames of up to 32), and a session a stranger opened gets at most
    ``STRANGER_REPLAYS`` (each recomputes everything kept at the next stage: with 16, an
    honest chat through it took 28 s against 6; a registered entry's: ``-k sixteen``)."""
    from node.kept_outputs import STRANGER_REPLAYS
    from p2p.failover import EXACT_BATCH

    me, y, z = _hop("me", 0, 10), _hop("y", 10, 20), _hop("z", 20, 30)
    evil, route = PeerId("evil"), (me, y, z)
    with smollm2_engine(smollm2, slice_cache, (0, 10), max_sessions=4) as engine, trio.fail_after(120):
        service = _Wired(me, Stage(engine, keep_outputs="f32"), y, z)
        async with trio.open_nursery() as nursery:
            await nursery.start(service.stage.run)
            await service._dispatch(_tokens("x0", route, evil), evil)
            for pos in range(3, 43):  # 40 one-token steps
                await service._dispatch(wire.Forward(1, SessionId("x0"), pos, route, evil, None, tokens=np.array([5], np.int32)), evil)
                await _until(lambda: engine.session_length(SessionId("x0")) == pos + 1, "the step")
            one_row_frames = ((0, 3), *((pos, 1) for pos in range(3, 43)))
            for i in range(STRANGER_REPLAYS + 1):
                old, new = SessionId(f"x{i}"), SessionId(f"x{i + 1}")
                service.sent.clear()
                await service._dispatch(wire.Adopt(1, old, new, (me,), evil), evil)
                await _until(lambda: service.sent, "the adopt's answer")
                assert [(m.TYPE, m.length) for _, m in service.sent] == [("adopted", 43 + i)]
                service.sent.clear()
                step = wire.Forward(1, new, 43 + i, route, evil, None, tokens=np.array([5], np.int32),
                                    replay=wire.Replay(10, 20, one_row_frames + tuple((43 + j, 1) for j in range(i))))  # fmt: skip
                await service._dispatch(step, evil)
                await _until(lambda: service.sent, "the replay or its refusal")
                sent = [m for _, m in service.sent if not isinstance(m, wire.Close)]  # the old id, at the next hop
                if i < STRANGER_REPLAYS:
                    assert [(m.start_pos, m.n_tokens, m.discard) for m in sent[:-1]] == [(0, EXACT_BATCH, True), (EXACT_BATCH, 11 + i, True)]
                    assert sent[-1].start_pos == 43 + i and not sent[-1].discard
            assert [m.code for m in sent] == ["protocol"] and service.drops[FrameReason.REPLAY_REFUSED] == 1
            nursery.cancel_scope.cancel()


async def test_a_strangers_sessions_are_not_left_at_the_next_hop(smollm2, slice_cache) -> None:
    """A stranger's one session at a stage, adopted by its opener again and again (a replay
    after an adopt, or a rewind to 0), went on to the next hop under each new id beside the
    last; closed at this stage alone, it stayed there too, and its opener could open another.
    Each took a slot at the next stage, fed by a registered hop, until every slot there was
    the stranger's (2026-12-07, an audit: ``stage: 4``). The stage that fed the next hops
    closes there what it no longer sends on: the old id ahead of the new id's frames, the
    id on a route it leaves for another, a session freed here that the close does not follow."""
    b, c, c2 = _hop("b", 10, 20), _hop("c", 20, 30), _hop("c2", 20, 30)
    evil = PeerId("evil")
    with (smollm2_engine(smollm2, slice_cache, (10, 20), max_sessions=4) as first,
          smollm2_engine(smollm2, slice_cache, (20, 30), max_sessions=4) as last,
          smollm2_engine(smollm2, slice_cache, (20, 30), max_sessions=4) as other, trio.fail_after(120)):  # fmt: skip
        hop = _Wired(b, Stage(first, keep_outputs="f32"), c, c2)
        hop.peers = {c.peer_id: _Wired(c, Stage(last), b), c2.peer_id: _Wired(c2, Stage(other), b)}
        rows = tensors.encode(np.random.default_rng(0).normal(size=(3, first.info.d_model)).astype(np.float32), "f32")
        step = tensors.encode(np.ones((1, first.info.d_model), np.float32), "f32")

        def prompt(session: str, to: Hop) -> wire.Forward:
            return wire.Forward(1, SessionId(session), 0, (b, to), evil, None, hidden=rows)

        async def then(held: list[int], why: str) -> None:
            await _until(lambda: [e.memory().sessions for e in (first, last, other)] == held, why, 5)

        async def adopt(old: str, new: str) -> None:
            await hop._dispatch(wire.Adopt(1, SessionId(old), SessionId(new), (b,), evil), evil)
            await _until(lambda: any(isinstance(m, wire.Adopted) and m.session_id == new for _, m in hop.sent), "the adopt")

        async with trio.open_nursery() as nursery:
            await nursery.start(hop.stage.run)
            for peer in hop.peers.values():
                await nursery.start(peer.stage.run)
            await hop._dispatch(prompt("x0", c), evil)
            await then([1, 1, 0], "the stranger's session at the next hop")
            await adopt("x0", "x1")
            await hop._dispatch(wire.Forward(1, SessionId("x1"), 3, (b, c), evil, None, hidden=step,
                                             replay=wire.Replay(20, 30, ((0, 3),))), evil)  # fmt: skip
            await _until(lambda: last.session_length(SessionId("x1")) == 4, "the replay")
            await then([1, 1, 0], "the old id closed at the next hop")
            await hop._dispatch(prompt("x1", c2), evil)  # on along another route
            await then([1, 0, 1], "the id closed on the route it left")
            await adopt("x1", "x2")
            await hop._dispatch(prompt("x2", c), evil)
            await then([1, 1, 0], "the old id closed on its route")
            await hop._dispatch(wire.Close(2, SessionId("x2"), (b,), evil), evil)  # here alone
            await then([0, 0, 0], "the session closed at the next hop too")
            await hop._dispatch(prompt("y", c2), evil)  # another, its quota here free again
            await then([1, 0, 1], "the next session")
            closes = [(peer, m.session_id) for peer, m in hop.sent if isinstance(m, wire.Close)]
            assert closes == [(c.peer_id, "x0"), (c.peer_id, "x1"), (c2.peer_id, "x1"), (c.peer_id, "x2")]
            nursery.cancel_scope.cancel()


async def test_an_honest_span_move_leaves_the_session_only_under_its_new_leg(smollm2, slice_cache) -> None:
    """After a span move every live hop holds the session once, under the new leg's id: the
    kept hops adopted it, the new span was rebuilt from the kept outputs, the old leg was
    closed; and the session's close frees it everywhere but on the dead hop."""
    entry, a, dead, m, c = _hop("entry", 0, 30), _hop("a", 0, 10), _hop("dead", 10, 20), _hop("m", 10, 20), _hop("c", 20, 30)
    s, hops = SessionId("s"), (entry, a, dead, m, c)
    with (smollm2_engine(smollm2, slice_cache, (0, 10), max_sessions=2) as e_a,
          smollm2_engine(smollm2, slice_cache, (10, 20), max_sessions=2) as e_dead,
          smollm2_engine(smollm2, slice_cache, (10, 20), max_sessions=2) as e_m,
          smollm2_engine(smollm2, slice_cache, (20, 30), max_sessions=2) as e_c, trio.fail_after(120)):  # fmt: skip
        side = _Wired(entry, None, *hops)
        ha, hd = _Wired(a, Stage(e_a, keep_outputs="f32"), *hops), _Wired(dead, Stage(e_dead, keep_outputs="f32"), *hops)
        hm, hc = _Wired(m, Stage(e_m, keep_outputs="f32"), *hops), _Wired(c, Stage(e_c), *hops)
        side.peers = {a.peer_id: ha, m.peer_id: hm, c.peer_id: hc}
        ha.peers = {dead.peer_id: hd, m.peer_id: hm, entry.peer_id: side}
        hd.peers = hm.peers = {c.peer_id: hc, entry.peer_id: side}
        hc.peers = {entry.peer_id: side}
        pipeline = SwarmPipeline(side, MODEL, list, 128, lambda _: None, policy=FailoverPolicy(poll_s=60.0),
                                 is_connected=lambda peer: peer != dead.peer_id)  # fmt: skip

        def held() -> list[int]:
            return [e.memory().sessions for e in (e_a, e_dead, e_m, e_c)]

        async with trio.open_nursery() as nursery:
            for stage in (ha.stage, hd.stage, hm.stage, hc.stage):
                await nursery.start(stage.run)
            session = _Session(s)
            pipeline._sessions[s] = session
            pipeline._open_leg(session, [a, dead, c])
            await pipeline.step(s, 0, [1, 2, 3, 4], None)
            for pos in (4, 5):
                await pipeline.step(s, pos, [5], SamplingParams(seed=1))
            assert held() == [1, 1, 0, 1]
            del ha.peers[dead.peer_id]  # the middle hop dies
            req = await pipeline._move_span(session, _Span([a, m, c], 1, 2), frozenset({dead.peer_id}), SamplingParams(seed=1))
            assert isinstance(await pipeline._await_token(session, req), int)
            assert session.leg is not None and session.leg.wire_id != s
            assert held() == [1, 1, 1, 1]
            assert all(e.session_length(session.leg.wire_id) == 6 for e in (e_a, e_m, e_c))
            await pipeline.close_session(s)
            await _until(lambda: held() == [0, 1, 0, 0], "the session closed on every live hop")
            nursery.cancel_scope.cancel()


async def test_a_strangers_refused_frames_are_counted_and_answered_not_logged(caplog: pytest.LogCaptureFixture) -> None:
    """Each refused close, adopt or forward frame wrote a line at info: a stranger with no
    record wrote 17,711 lines into a peer's log at ~2,700 a second (2026-12-07, an audit)."""
    me, y, z = _hop("me", 0, 10), _hop("y", 10, 20), _hop("z", 20, 30)
    evil = PeerId("evil")
    service = _Wired(me, None, y, z)
    with caplog.at_level(logging.INFO, logger="p2p.forward"):
        for i in range(50):
            await service._dispatch(wire.Adopt(i, SessionId(f"s{i}"), SessionId(f"s{i}.1"), (me,), evil), evil)
            await service._dispatch(wire.Close(i, SessionId(f"s{i}"), (me, y, z), evil), evil)
            await service._dispatch(_tokens(f"s{i}", (y, z), evil), evil)  # a hop this peer does not serve
    assert service.drops[FrameReason.SESSION_NOT_YOURS] == 100
    assert [m.code for _, m in service.sent] == ["wrong_route"] * 50
    assert not [r for r in caplog.records if r.levelno >= logging.INFO]


def test_a_session_may_be_adopted_any_number_of_times_and_replayed_sixteen() -> None:
    """The replay cap counted adopts: a hop after the replaced span is adopted at every move
    and sends no replay, so a long-lived session moved often had its next replay refused,
    and the honest hop that refused it blamed (a review, 2026-12-07)."""
    from node.kept_outputs import MAX_REPLAYS, KeptOutputs

    kept = KeptOutputs(max_sessions=2, context_length=64, d_model=4, wire_dtype="f32")
    kept.put(SessionId("s0"), 0, tensors.encode(np.ones((3, 4), np.float32), "f32"), lambda _: True)
    for i in range(3 * MAX_REPLAYS):  # moves that replay nothing from here
        kept.rename(SessionId(f"s{i}"), SessionId(f"s{i + 1}"))
    replayed = []
    for i in range(3 * MAX_REPLAYS, 4 * MAX_REPLAYS + 1):
        kept.rename(SessionId(f"s{i}"), SessionId(f"s{i + 1}"))
        replayed.append(kept.take_replay(SessionId(f"s{i + 1}")))
    assert replayed == [True] * MAX_REPLAYS + [False]
