"""Legacy-node registration and relay as a hostile node or HTTP client would use them,
in process and fast: a real registry service (its host keeps what it publishes), a real
:class:`p2p.legacy.LegacyNodes`, and scripted HTTP nodes on loopback."""

from __future__ import annotations

import dataclasses
import http.server
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import trio

from inclavate import tensors
from inclavate.types import LayerRange, NodeId, PeerId, SessionId
from p2p import wire
from p2p.gossip import RegistryService
from p2p.identity import Identity
from p2p.legacy import MAX_LEGACY_NODES, BadRegistration, DuplicateNode, LegacyError, LegacyNodes, UnknownLegacyNode, UnreachableNode
from p2p.record_schema import MAX_COUNT
from p2p.records import InvalidRecord, SignedRecord
from p2p.registry import Liveness
from p2p.routing import Hop

MODEL = "smollm2:135m"
N_LAYERS, D_MODEL = 30, 576
TOKEN = "t" * 16


class _Host:
    """What the registry service needs of a libp2p host to publish."""

    def __init__(self) -> None:
        self.sent: list[Any] = []

    async def publish(self, topic: str, data: bytes) -> None:
        self.sent.append(SignedRecord.decode(data).record)


class _NotFound(http.server.BaseHTTPRequestHandler):
    """Any HTTP service that is not a node: 404 to everything."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self.send_response(404)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


class _Node(http.server.BaseHTTPRequestHandler):
    """A legacy node: ``/health`` answers (after ``server.health_delay_s``), ``/forward``
    answers what ``server.answer`` makes of the frame it was sent."""

    server: Any

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        time.sleep(self.server.health_delay_s)
        self._answer(200, b'{"ok": true}')

    def do_POST(self) -> None:  # noqa: N802
        msg = wire.decode(self.rfile.read(int(self.headers.get("content-length") or 0)))
        self._answer(200, self.server.answer(msg))

    def _answer(self, status: int, body: bytes) -> None:
        try:
            self.send_response(status)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except OSError:
            pass  # the peer gave up on us

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def node_server() -> Iterator[Any]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Node)
    server.daemon_threads = True
    server.health_delay_s = 0.0  # type: ignore[attr-defined]
    server.answer = lambda msg: b""  # type: ignore[attr-defined]
    server.url = f"http://127.0.0.1:{server.server_address[1]}"  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def _legacy(send: Any = None) -> tuple[RegistryService, LegacyNodes]:
    registry = RegistryService(_Host(), Identity.generate(), Liveness())  # type: ignore[arg-type]
    facts = {MODEL: (N_LAYERS, D_MODEL)}
    return registry, LegacyNodes(registry, facts.get, send=send)


def _relaying() -> tuple[RegistryService, LegacyNodes, list[tuple[PeerId, wire.Message]]]:
    """A legacy-node service whose relayed outputs are recorded (peer, message) in the list."""
    sent: list[tuple[PeerId, wire.Message]] = []

    async def send(peer: PeerId, msg: wire.Message) -> None:
        sent.append((peer, msg))

    registry, nodes = _legacy(send)
    return registry, nodes, sent


async def _ready(nodes: LegacyNodes, node_id: str, url: str) -> NodeId:
    """Register ``node_id`` at ``url`` and have it say it is ready; its registry id."""
    registry_id = NodeId((await nodes.register(_body(node_id, url), assign=False))["registry_id"])
    await nodes.heartbeat(node_id, {"ready": True}, TOKEN)
    return registry_id


def _route_through(registry: RegistryService, registry_id: NodeId, url: str) -> tuple[Hop, ...]:
    """The node (layers 0-10, relayed by the registry's peer), then a next hop for 10-30."""
    me = PeerId(registry.identity.peer_id)
    return (Hop(registry_id, me, LayerRange(0, 10), url + "/forward"),
            Hop(NodeId("next"), PeerId("next"), LayerRange(10, 30), ""))  # fmt: skip


def _body(node_id: str, url: str, token: str = TOKEN, **extra: Any) -> dict[str, Any]:
    return {"node_id": node_id, "model_id": MODEL, "http_url": url, "start_layer": 0, "end_layer": 10,
            "relay_token": token, **extra}  # fmt: skip


async def test_a_restart_refused_half_way_leaves_the_node_as_it_was(node_server: Any) -> None:
    """A node re-registering its live id (it holds the token) used to be dropped before its
    new registration was checked: one refused half-way (here its URL does not answer yet)
    left its old record vouched for, republished on every heartbeat, with nobody to
    heartbeat or leave it (404) and its id refused to the node itself (409)."""
    registry, nodes = _legacy()
    async with trio.open_nursery() as nursery:
        await nursery.start(nodes.run)
        first = await nodes.register(_body("n1", node_server.url), assign=False)
        registry_id = NodeId(first["registry_id"])
        for bad in (_body("n1", "http://127.0.0.1:1"), _body("n1", node_server.url, start_layer=5, end_layer=99)):
            with pytest.raises(Exception) as refused:
                await nodes.register(bad, assign=False)
            assert not isinstance(refused.value, DuplicateNode)
            # still the node's: it heartbeats, and the registry holds its one record
            await nodes.heartbeat("n1", {"ready": True}, TOKEN)
            assert nodes.serves(registry_id) and registry.own(registry_id) is not None
        assert (await nodes.register(_body("n1", node_server.url), assign=False))["registry_id"] == registry_id
        await nodes.leave("n1", TOKEN)
        assert not nodes.serves(registry_id) and registry.own(registry_id) is None
        with pytest.raises(UnknownLegacyNode):
            await nodes.heartbeat("n1", {}, TOKEN)
        nursery.cancel_scope.cancel()


async def test_a_heartbeat_no_record_can_carry_is_a_400_and_a_leave_always_ends_the_vouching(node_server: Any) -> None:
    """Heartbeat counters went to 2^53, records stop at 2^48: the node's record was refused at
    every registry heartbeat from then on (a traceback each), its ``leave`` answered 503 after
    dropping it from the legacy table, and the record stayed vouched for, refused for the
    life of the peer, its id taken (409) and unreachable (404). A stranger could pile up any
    number of them (an audit, 2026-12-07)."""
    registry, nodes = _legacy()
    async with trio.open_nursery() as nursery:
        await nursery.start(nodes.run)
        registry_id = await _ready(nodes, "n1", node_server.url)
        for key in ("tokens_generated", "requests_served", "errors"):
            for body in ({key: MAX_COUNT + 1}, {key: MAX_COUNT + 1, "ready": False}):  # counted, or published at once
                with pytest.raises(BadRegistration, match=key):
                    await nodes.heartbeat("n1", body, TOKEN)
        await nodes.heartbeat("n1", {"tokens_generated": MAX_COUNT}, TOKEN)
        record = registry.own(registry_id)
        assert record is not None and record.counters.tokens_total == MAX_COUNT
        await registry.publish(record)  # what the registry's next heartbeat does: receivers take it

        async def refused(record: Any) -> Any:
            raise InvalidRecord("receivers would refuse it")

        registry.publish = refused  # type: ignore[method-assign]
        await nodes.leave("n1", TOKEN)  # its departure cannot be announced: it ages out unvouched
        assert registry.own(registry_id) is None and not nodes.serves(registry_id)
        nursery.cancel_scope.cancel()


async def test_a_spec_heartbeat_makes_a_node_ready_and_its_errors_blame_it_alone(node_server: Any) -> None:
    """The spec's heartbeat has no ``ready``: defaulting to the node's state, a spec node stayed
    Joining for good, never routed. A node sends nothing on, so its ``unreachable`` naming the
    hop after it would have had that honest hop blamed: it is the node's own failure (an
    audit, 2026-12-07)."""
    registry, nodes, sent = _relaying()
    async with trio.open_nursery() as nursery:
        await nursery.start(nodes.run)
        registry_id = NodeId((await nodes.register(_body("n1", node_server.url), assign=False))["registry_id"])
        await nodes.heartbeat("n1", {"tokens_generated": 100, "requests_served": 5}, TOKEN)  # the spec's body
        assert registry.own(registry_id).state == "Ready"  # type: ignore[union-attr]
        route = _route_through(registry, registry_id, node_server.url)
        node_server.answer = lambda msg: wire.encode(wire.Error(msg.req_id, msg.session_id, "unreachable", "cannot reach",
                                                                PeerId("n1"), failed_peer=route[1].peer_id))  # fmt: skip
        await nodes.relay(wire.Forward(1, SessionId("s"), 0, route, PeerId("entry"), None, tokens=np.array([1], np.int32)))
        with trio.fail_after(10):
            while not sent:
                await trio.sleep(0.02)
        (peer, error), = sent
        assert peer == "entry" and isinstance(error, wire.Error)
        assert (error.code, error.origin, error.failed_peer) == ("engine_error", registry_id, None)
        nursery.cancel_scope.cancel()


async def test_a_node_back_from_silence_keeps_its_id_and_a_stranger_cannot_take_it(node_server: Any) -> None:
    """A node silent for a few seconds (SIGSTOP, a suspended laptop) was dropped: its
    heartbeats got 404 for good, its restart 409 while its record read Degraded, and once it
    read Dead anyone could register the id, under the same registry id (an audit,
    2026-12-07). Its id now stays its own while receivers may hold its record."""
    registry, nodes = _legacy()
    async with trio.open_nursery() as nursery:
        await nursery.start(nodes.run)
        registry_id = await _ready(nodes, "n1", node_server.url)
        nodes._nodes[registry_id].last_heartbeat -= 3600  # silent for an hour
        nodes._drop_silent()
        assert not nodes.serves(registry_id) and registry.own(registry_id) is None
        with pytest.raises(DuplicateNode):  # a stranger, with a token of its own
            await nodes.register(_body("n1", node_server.url, token="s" * 16), assign=False)
        await nodes.heartbeat("n1", {}, TOKEN)  # back: vouched for again
        assert nodes.serves(registry_id) and registry.own(registry_id) is not None
        nodes._nodes[registry_id].last_heartbeat -= 3600
        nodes._drop_silent()
        again = await nodes.register(_body("n1", node_server.url), assign=False)  # a restart, with its token
        assert again["registry_id"] == registry_id and nodes.serves(registry_id)
        nodes._nodes[registry_id].last_heartbeat -= 3600
        nodes._drop_silent()
        nodes._departed[registry_id].until = 0.0  # past the horizon: no revival, a registration
        with pytest.raises(UnknownLegacyNode):
            await nodes.heartbeat("n1", {}, TOKEN)
        nursery.cancel_scope.cancel()


async def test_a_legacy_node_the_peer_forgot_registers_again(autojump_clock: trio.abc.Clock) -> None:
    """Dropped by its peer (silent past the peer's memory of it, or the peer restarted), the
    node's heartbeats were answered 404 for good and it was never routed again."""
    from types import SimpleNamespace

    from inclavate.legacy_node import LegacyNode

    node = LegacyNode.__new__(LegacyNode)
    node.node_id, node.orchestrator = "n1", "http://peer"
    node._registration = {"node_id": "n1", "start_layer": 0, "end_layer": 10}
    stats = SimpleNamespace(tokens=0, errors=0, step_ms_per_layer=0.0)
    engine = SimpleNamespace(info=SimpleNamespace(layers=LayerRange(0, 10)), memory=lambda: SimpleNamespace(total_mb=1))
    node.stage, node.requests = SimpleNamespace(stats=stats, engine=engine), 0  # type: ignore[assignment]
    node.config = SimpleNamespace(liveness=SimpleNamespace(heartbeat_s=2.0))  # type: ignore[assignment]
    calls: list[tuple[str, str]] = []

    async def call(method: str, path: str, body: Any = None) -> tuple[int, Any]:
        calls.append((method, path))
        forgotten = len(calls) == 2
        return (404, {"error": "no legacy node"}) if forgotten else (200, {"ok": True})

    node._call = call  # type: ignore[method-assign]
    with trio.move_on_after(5):
        await node._heartbeat()
    assert calls[:4] == [("POST", "/nodes/n1/health"), ("POST", "/nodes/n1/health"), ("POST", "/nodes"),
                         ("POST", "/nodes/n1/health")]  # fmt: skip


async def test_nodes_that_left_count_until_the_swarm_forgets_them_and_a_refused_record_is_no_registration(
        node_server: Any) -> None:  # fmt: skip
    """Registering and leaving fresh ids (64 in a second) filled this peer's registry quota
    with Dead records: the swarm refused every record the peer signed for a quarter of an
    hour, and a registration then answered 200 for a node no peer listed (an audit,
    2026-12-07)."""
    registry, nodes = _legacy()
    async with trio.open_nursery() as nursery:
        await nursery.start(nodes.run)
        for i in range(MAX_LEGACY_NODES):
            await nodes.register(_body(f"churn{i}", node_server.url), assign=False)
            await nodes.leave(f"churn{i}", TOKEN)
        with pytest.raises(LegacyError, match=f"already vouches for {MAX_LEGACY_NODES}"):
            await nodes.register(_body("next", node_server.url), assign=False)
        for departed in nodes._departed.values():  # once receivers have dropped their records
            departed.until = 0.0
        await nodes.register(_body("next", node_server.url), assign=False)
        banned = registry.identity.peer_id + ":banned"
        registry.ban(banned, 600)  # what an admin's force-delete leaves
        with pytest.raises(LegacyError, match="refuses this peer's record"):
            await nodes.register(_body("banned", node_server.url), assign=False)
        assert not nodes.serves(NodeId(banned))
        nursery.cancel_scope.cancel()


async def test_a_live_id_is_refused_to_a_stranger_and_kept_through_a_bad_restart(node_server: Any) -> None:
    registry, nodes = _legacy()
    async with trio.open_nursery() as nursery:
        await nursery.start(nodes.run)
        await nodes.register(_body("n1", node_server.url), assign=False)
        with pytest.raises(DuplicateNode):
            await nodes.register(_body("n1", node_server.url, token="s" * 16), assign=False)
        with pytest.raises(UnreachableNode):  # the token holder, with a URL that does not answer
            await nodes.register(_body("n1", "http://127.0.0.1:1"), assign=False)
        await nodes.heartbeat("n1", {"ready": True}, TOKEN)
        nursery.cancel_scope.cancel()


async def test_registrations_waiting_for_their_probe_count_against_the_bound(node_server: Any) -> None:
    """The bound on legacy nodes was checked before each registration probed its URL: any
    number of concurrent registrations passed it while they waited (50 made 50 nodes)."""
    _, nodes = _legacy()
    node_server.health_delay_s = 0.2
    outcomes: list[str] = []

    async def register(i: int) -> None:
        try:
            await nodes.register(_body(f"n{i}", node_server.url, token=f"{i:016d}"), assign=False)
            outcomes.append("ok")
        except LegacyError as exc:
            outcomes.append(type(exc).__name__)

    async with trio.open_nursery() as nursery:
        await nursery.start(nodes.run)
        async with trio.open_nursery() as burst:
            for i in range(MAX_LEGACY_NODES + 8):
                burst.start_soon(register, i)
        assert outcomes.count("ok") == MAX_LEGACY_NODES == len(nodes._nodes)
        assert set(outcomes) == {"ok", "NoRangeAvailable"} and not nodes._registering
        nursery.cancel_scope.cancel()


async def test_registrations_probing_slow_urls_do_not_delay_the_relays(node_server: Any) -> None:
    """Probes and relays shared the same 8 threads: a burst of registrations naming a URL
    that answers slowly held them all, and every relay to a registered node waited ~5 s
    behind them. Probes have threads of their own."""
    registry, nodes, sent = _relaying()
    async with trio.open_nursery() as nursery:
        await nursery.start(nodes.run)
        registry_id = await _ready(nodes, "n0", node_server.url)
        node_server.health_delay_s = 3.0
        node_server.answer = _hidden_answer(1, D_MODEL)
        async with trio.open_nursery() as burst:
            for i in range(1, 13):
                burst.start_soon(_quietly, nodes.register(_body(f"n{i}", node_server.url, token=f"{i:016d}"), assign=False))
            await trio.sleep(0.5)  # every probe under way
            route = _route_through(registry, registry_id, node_server.url)
            await nodes.relay(wire.Forward(1, SessionId("s"), 0, route, PeerId("entry"), None, tokens=np.array([1], np.int32)))
            with trio.fail_after(1.5):  # ~3 s behind the probes before
                while not sent:
                    await trio.sleep(0.02)
            assert sent[0][0] == "next", sent
        nursery.cancel_scope.cancel()


async def _quietly(call: Any) -> None:
    try:
        await call
    except LegacyError:
        pass


def _hidden_answer(rows: int, cols: int, value: float = 0.0, dtype: str = "f32") -> Any:
    def answer(msg: wire.Forward) -> bytes:
        data = np.full((rows, cols), value, np.float32 if dtype == "f32" else np.float16).tobytes()
        hidden = tensors.EncodedTensor(dtype, (rows, cols), data)  # type: ignore[arg-type]
        return wire.encode(wire.Forward(msg.req_id, msg.session_id, msg.start_pos, msg.route[1:], msg.reply_to,
                                        msg.sampling, hidden=hidden))  # fmt: skip
    return answer


async def test_a_node_s_answer_keeps_the_frame_s_discard_and_lane(node_server: Any) -> None:
    """How the next hops treat a frame is the frame's: a node answering ``discard`` flipped had
    them compute and answer nothing (the entry waited out its deadline), and an honest node
    that does not echo the fields must still be relayed (a review, 2026-12-07)."""
    registry, nodes, sent = _relaying()
    async with trio.open_nursery() as nursery:
        await nursery.start(nodes.run)
        registry_id = await _ready(nodes, "n1", node_server.url)
        route = _route_through(registry, registry_id, node_server.url)
        answer = _hidden_answer(3, D_MODEL)
        node_server.answer = lambda msg: answer(dataclasses.replace(msg, discard=not msg.discard, lane=9))
        for discard in (False, True):
            sent.clear()
            frame = wire.Forward(1, SessionId("s"), 0, route, PeerId("entry"), None, tokens=np.array([1, 2, 3], np.int32),
                                 discard=discard, lane=2)  # fmt: skip
            await nodes.relay(frame)
            with trio.fail_after(10):
                while not sent:
                    await trio.sleep(0.02)
            (peer, out), = sent
            assert peer == "next" and isinstance(out, wire.Forward) and (out.discard, out.lane) == (discard, 2)
        nursery.cancel_scope.cancel()


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
async def test_hidden_states_a_node_answers_are_checked_before_they_are_sent_on(node_server: Any) -> None:
    """The relaying peer sent a node's hidden states on, under its own identity, whatever
    they held: the next hop refused NaN or a wrong shape in its own name (``invalid_batch``:
    the request failed and that honest hop was blamed), and the node stayed in routing."""
    registry, nodes, sent = _relaying()
    async with trio.open_nursery() as nursery:
        await nursery.start(nodes.run)
        registry_id = await _ready(nodes, "n1", node_server.url)
        route = _route_through(registry, registry_id, node_server.url)
        cases = [("honest", _hidden_answer(3, D_MODEL), "next"),
                 ("longer than 3 positions can be", lambda msg: b"x" * (4 << 20), "entry"),
                 ("nan", _hidden_answer(3, D_MODEL, float("nan")), "entry"),
                 ("f16 overflow", _hidden_answer(3, D_MODEL, 1e6, "f16"), "entry"),
                 ("narrow", _hidden_answer(3, 8), "entry"),
                 ("extra rows", _hidden_answer(40, D_MODEL), "entry")]  # fmt: skip
        for i, (case, answer, goes_to) in enumerate(cases):
            node_server.answer = answer
            node = nodes._nodes[registry_id]
            node.held_out_until, node.failures = 0.0, 0
            sent.clear()
            frame = wire.Forward(i, SessionId(f"s{i}"), 0, route, PeerId("entry"), None, tokens=np.array([1, 2, 3], np.int32))
            await nodes.relay(frame)
            with trio.fail_after(10):
                while not sent:
                    await trio.sleep(0.02)
            (peer, out), = sent
            assert peer == goes_to, case
            if goes_to == "entry":
                # in the node's name: the entry avoids it alone, not this peer (``blame``)
                assert isinstance(out, wire.Error) and out.origin == registry_id and node.held_out, (case, out)
                if case.startswith("longer"):  # not read past what the frame's answer can hold
                    assert f"exceeds {wire.max_frame_bytes(3, D_MODEL)} bytes" in out.message, out
            else:
                assert isinstance(out, wire.Forward) and not node.held_out
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("field, value", [("start_layer", 0.5), ("end_layer", True), ("start_layer", "0"), ("end_layer", 10.0),
                                          ("start_layer", [0]), ("start_layer", None),
                                          ("n_total_layers", "30"), ("d_model", "576"), ("n_total_layers", True),
                                          ("d_model", None), ("n_total_layers", [30])])  # fmt: skip
async def test_a_layer_range_and_the_model_shape_are_made_of_integers(node_server: Any, field: str, value: Any) -> None:
    """``int()`` took 0.5 as layer 0, ``true`` as layer 1 and ``"0"`` as layer 0 (200); and
    ``"n_total_layers": "30"`` was a 422 "n_total_layers 30 does not match smollm2:135m (30)":
    a wrong type is a malformed request (400, naming the field), not a model mismatch."""
    _, nodes = _legacy()
    async with trio.open_nursery() as nursery:
        await nursery.start(nodes.run)
        with pytest.raises(BadRegistration, match=field):
            await nodes.register(_body("n1", node_server.url, **{field: value}), assign=False)
        assert not nodes._nodes
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("field, value", [("http_url", "file:///etc/passwd"), ("vram_mb", -5), ("hardware", "x")])
async def test_a_malformed_join_is_a_400_even_when_no_range_is_free(node_server: Any, field: str, value: Any) -> None:
    """The range was assigned before the rest of the body was read: with every layer held,
    ``"http_url": "file:///etc/passwd"`` was a 503 "every layer ... is already covered"."""
    _, nodes = _legacy()
    async with trio.open_nursery() as nursery:
        await nursery.start(nodes.run)
        await nodes.register(_body("n1", node_server.url, start_layer=0, end_layer=N_LAYERS), assign=False)
        body = {k: v for k, v in _body("n2", node_server.url, token="u" * 16).items() if not k.endswith("_layer")}
        with pytest.raises(BadRegistration, match=field):
            await nodes.register({**body, field: value}, assign=True)
        nursery.cancel_scope.cancel()


async def test_a_refused_probe_says_nothing_of_what_answered() -> None:
    """A registration probes the URL it names: its refusal named what it found ("connection
    refused", "answered 404"), so any HTTP client could map the services on the peer's
    loopback and LAN through it. Whatever listens there, the refusal now reads the same."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _, nodes = _legacy()
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(nodes.run)
            answers = []
            for url in (f"http://127.0.0.1:{server.server_address[1]}", "http://127.0.0.1:1", "http://no-such-host.invalid"):
                with pytest.raises(UnreachableNode) as refused:
                    await nodes.register(_body("n1", url), assign=False)
                answers.append(str(refused.value))
            assert len(set(answers)) == 1, answers
            nursery.cancel_scope.cancel()
    finally:
        server.shutdown()
        server.server_close()


async def test_a_joining_node_that_could_hold_more_than_the_gap_gets_the_gap(node_server: Any) -> None:
    """``max_layers`` is what a joining node can hold at most: above the widest gap (here
    10 layers left of 30) it was refused with a 400; the gap is assigned."""
    _, nodes = _legacy()
    async with trio.open_nursery() as nursery:
        await nursery.start(nodes.run)
        await _ready(nodes, "n1", node_server.url)  # layers 0-10
        wide = await nodes.register(_body("n2", node_server.url, token="u" * 16, start_layer=10, end_layer=30), assign=False)
        assert (wide["start_layer"], wide["end_layer"]) == (10, 30)
        await nodes.leave("n2", "u" * 16)
        body = {k: v for k, v in _body("n3", node_server.url, token="v" * 16).items() if not k.endswith("_layer")}
        with pytest.raises(BadRegistration, match="max_layers"):
            await nodes.register({**body, "max_layers": 0}, assign=True)
        joined = await nodes.register({**body, "max_layers": 25}, assign=True)
        assert (joined["start_layer"], joined["end_layer"]) == (10, 30)
        nursery.cancel_scope.cancel()
