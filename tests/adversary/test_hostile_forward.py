"""A stranger's libp2p peer attacks the forward protocol of a live 3-peer swarm.

Each test sends one kind of hostile frame straight to a stage, checks how it was refused,
and ends with every honest peer alive, the registry unchanged, and a chat through the chain
that still answers with the whole model's text. One swarm serves the whole module."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import trio
from forward_frames import attack, forward, hop, peer_id
from hostile_peer import HostilePeer, honest_record, hostile_peer
from live_swarm import MAX_TOKENS, MODEL, QUESTION, assert_swarm_healthy, chat, honest_nodes, three_peers
from reference import whole_model_text
from swarm import PeerProcess, Swarm, request_json, stage_sessions

from inclavate import tensors
from inclavate.types import LayerRange, NodeId, PeerId, SessionId
from node.sampling import SamplingParams
from p2p import wire
from p2p.errors import P2PError
from p2p.framing import FramedStream
from p2p.routing import Hop

pytestmark = [pytest.mark.swarm, pytest.mark.slow]
D_MODEL = 576
N_VOCAB = 49152
ADMIN_TOKEN = "adversary-admin-token"


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Swarm, list[PeerProcess]]]:
    with three_peers(tmp_path_factory.mktemp("hostile-forward"), "--admin-token", ADMIN_TOKEN) as (s, peers):
        yield s, peers


@pytest.fixture(scope="module")
def expected(smollm2, slice_cache) -> str:
    return whole_model_text(smollm2, slice_cache, QUESTION, MAX_TOKENS)


@pytest.fixture(scope="module")
def baseline(live) -> list[tuple[str, int, int, str]]:
    return honest_nodes(live[1][0])


def raw_frame(header: dict[str, Any] | str, body: bytes = b"") -> bytes:
    text = header if isinstance(header, str) else json.dumps(header)
    raw = text.encode()
    return struct.pack(">I", len(raw)) + raw + body


def errors(replies: list[wire.Message]) -> list[str]:
    return [r.code for r in replies if isinstance(r, wire.Error)]


def finite_hidden(rows: int = 1) -> np.ndarray:
    return np.random.default_rng(rows).normal(size=(rows, D_MODEL)).astype(np.float32)


def test_a_route_with_a_hop_after_the_last_range(live, expected, baseline) -> None:
    s, (a, b, c) = live
    evil_hop = Hop(NodeId("x"), PeerId("x"), LayerRange(30, 31))

    async def run(evil: HostilePeer, stream: FramedStream, _: list) -> None:
        await stream.send(forward(evil, (hop(c, "20-30"), evil_hop), hidden=finite_hidden(), sampling=SamplingParams(0, 1, 0)), timeout=10)

    assert errors(attack(c, s, run)) == ["wrong_route"]
    assert_swarm_healthy([a, b, c], expected, baseline)


def test_a_route_that_repeats_a_hop_is_refused_without_computing(live, expected, baseline) -> None:
    s, (a, b, c) = live
    before = c.get("/health")

    async def run(evil: HostilePeer, stream: FramedStream, _: list) -> None:
        await stream.send(forward(evil, (hop(c, "20-30"),) * 200, hidden=finite_hidden()), timeout=10)

    assert errors(attack(c, s, run)) == ["wrong_route"]
    assert c.get("/health")["sessions"] == before["sessions"]
    assert_swarm_healthy([a, b, c], expected, baseline)


def test_a_route_through_an_unregistered_peer_is_refused(live, expected, baseline) -> None:
    """Otherwise any stranger could make a stage send it the hidden states of a chain."""
    s, (a, b, c) = live

    async def run(evil: HostilePeer, stream: FramedStream, _: list) -> None:
        mine = Hop(NodeId(evil.peer_id), evil.peer_id, LayerRange(20, 30))
        await stream.send(forward(evil, (hop(b, "10-20"), mine), hidden=finite_hidden()), timeout=10)

    assert errors(attack(b, s, run)) == ["wrong_route"]
    assert_swarm_healthy([a, b, c], expected, baseline)


def forward_header(evil: HostilePeer, target: PeerProcess, layers: list[int], **fields: Any) -> dict[str, Any]:
    """A well-formed forward header (one hidden row), with ``fields`` replaced."""
    pid = peer_id(target)
    return {"type": "forward", "req": 1, "session": "m", "start_pos": 0, "route": [[pid, pid, *layers, ""]],
            "reply_to": evil.peer_id, "sampling": None,
            "input": {"kind": "hidden", "dtype": "f32", "shape": [1, D_MODEL]}, **fields}  # fmt: skip


def test_a_non_integer_seed_is_dropped_at_the_wire(live, expected, baseline) -> None:
    s, (a, b, c) = live

    async def run(evil: HostilePeer, stream: FramedStream, _: list) -> None:
        body = finite_hidden().tobytes()
        for sampling in ([0.5, 0.9, 1.5], [0.5, 0.9, "x"], [0.5, 0.9, None], [0.5, 0.9, [1]], [0.5, 0.9, True],
                         ["hot", 0.9, 1], [0.5, 7, 1], [0.5, 0.9], {"seed": 1}):  # fmt: skip
            await stream.send(raw_frame(forward_header(evil, c, [20, 30], sampling=sampling), body), timeout=10)
        nan = json.dumps(forward_header(evil, c, [20, 30], sampling=[0.5, 0.9, 1])).replace("[0.5, 0.9, 1]", "[NaN, 0.9, 1]")
        await stream.send(raw_frame(nan, body), timeout=10)

    assert errors(attack(c, s, run)) == []  # malformed: dropped, and counted, never computed
    assert_swarm_healthy([a, b, c], expected, baseline)


def test_nan_and_infinite_hidden_states_fail_their_frame_only(live, expected, baseline) -> None:
    s, (a, b, c) = live

    async def run(evil: HostilePeer, stream: FramedStream, _: list) -> None:
        for i, (bad, half) in enumerate((b, h) for h in (False, True) for b in (np.nan, np.inf, -np.inf)):
            hidden = finite_hidden(2)
            hidden[1, 7] = bad  # rng.choice used to raise on the NaN probabilities, in the stage worker
            await stream.send(forward(evil, (hop(c, "20-30"),), session=f"n{i}", hidden=hidden,
                                      sampling=SamplingParams(0.8, 0.95, 3), half=half), timeout=10)  # fmt: skip

    assert errors(attack(c, s, run)) == ["invalid_batch"] * 6  # float32 frames, then float16 ones (decoded in C)
    assert_swarm_healthy([a, b, c], expected, baseline)


def test_a_vanishing_temperature_draws_what_greedy_draws(live, expected, baseline) -> None:
    """Any positive temperature is valid on the wire; one too small for a float32 1/T once
    made the most likely token's weight NaN and left the sampler nothing to draw from."""
    s, (a, b, c) = live

    async def run(evil: HostilePeer, stream: FramedStream, _: list) -> None:
        for params in (SamplingParams(0, 1, 0), SamplingParams(5e-324, 0.95, 1), SamplingParams(1e-30, 1.0, 2)):
            await stream.send(forward(evil, (hop(c, "20-30"),), session="v", hidden=finite_hidden(), sampling=params),
                              timeout=10)  # fmt: skip

    replies = attack(c, s, run)
    tokens = [r.token for r in replies if isinstance(r, wire.Result)]
    assert errors(replies) == []
    assert len(tokens) == 3 and len(set(tokens)) == 1
    assert_swarm_healthy([a, b, c], expected, baseline)


def test_token_ids_outside_the_vocabulary_are_refused_at_the_first_stage(live, expected, baseline) -> None:
    s, (a, b, c) = live

    async def run(evil: HostilePeer, stream: FramedStream, _: list) -> None:
        route = (hop(a, "0-10"), hop(b, "10-20"), hop(c, "20-30"))
        for i, token in enumerate((N_VOCAB, -1, 2**31 - 1)):
            await stream.send(forward(evil, route, session=f"t{i}", tokens=[1, token]), timeout=10)

    assert errors(attack(a, s, run)) == ["invalid_batch"] * 3
    assert_swarm_healthy([a, b, c], expected, baseline)


def test_a_stranger_cannot_hold_every_kv_slot(live, expected, baseline) -> None:
    """Eight one-token frames used to hold all slots for the stage's 10-minute idle timeout."""
    s, (a, b, c) = live
    route = (hop(a, "0-10"), hop(b, "10-20"), hop(c, "20-30"))

    async def run(evil: HostilePeer, stream: FramedStream, _: list) -> None:
        for i in range(8):
            await stream.send(forward(evil, route, session=f"slot{i}", tokens=[1]), timeout=10)

    replies = attack(a, s, run, settle=2.0)
    assert errors(replies).count("session_limit") >= 7  # one session per stranger, at most
    assert a.get("/health")["sessions"]["stage"] <= 1
    assert_swarm_healthy([a, b, c], expected, baseline)
    for _ in range(3):  # and several chats at once still find slots
        status, body = chat(b)
        assert status == 200 and body["choices"][0]["message"]["content"] == expected


def test_a_record_of_its_own_does_not_make_a_stranger_a_previous_hop(live, expected, baseline) -> None:
    """A record costs nothing to publish. Any identity that gossiped one about itself used
    to get a chain member's quota: every slot of every stage. Hidden states now get it only
    from a peer whose record ends where the stage starts (the previous hop of a route)."""
    s, (a, b, c) = live
    route = (hop(b, "10-20"), hop(c, "20-30"))
    before = stage_sessions(b)

    async def run(evil: HostilePeer, stream: FramedStream, _: list) -> None:
        record = honest_record(evil.identity, model=MODEL, start=0, end=1, state="Joining")  # no route uses it
        await evil.publish_record(record)
        with trio.fail_after(15):
            while evil.peer_id not in {n["node_id"] for n in await trio.to_thread.run_sync(b.get, "/nodes")}:
                await trio.sleep(0.2)
        for i in range(8):
            await stream.send(forward(evil, route, session=f"known{i}", hidden=finite_hidden()), timeout=10)
        await trio.sleep(1.0)
        await evil.publish_record(record.replace(state="Dead", seq=record.seq + 1))  # leave the registry as it was

    replies = attack(b, s, run, settle=2.0, gossip=True)
    assert errors(replies).count("session_limit") >= 7  # a stranger's one session, at most
    assert stage_sessions(b) <= before + 1
    assert_swarm_healthy([a, b, c], expected, baseline)


def test_a_record_holder_cannot_keep_every_slot_of_a_first_stage(tmp_path, expected) -> None:
    """Any peer may be an entry, so one with a record of its own may open sessions at a first
    stage. Holding every slot there (and, through the route, every slot after it) made every
    other chat wait out the stage's 60 s admission timeout and fail. A new session of another
    source now takes the longest-idle slot of the source holding the most, and the eviction
    closes that session on the hops after the stage too; the hoarder's next frame for it is
    answered ``session_evicted``. (A swarm of its own: the module's keeps other tests'
    strangers' sessions for a while, one slot each, which no fair share displaces.)"""
    with three_peers(tmp_path) as (s, (a, b, c)):
        _hoard_a_first_stage(s, a, b, c, expected, honest_nodes(a))


def _hoard_a_first_stage(s: Swarm, a: PeerProcess, b: PeerProcess, c: PeerProcess, expected: str,
                         baseline: list[tuple[str, int, int, str]]) -> None:  # fmt: skip
    route = (hop(a, "0-10"), hop(b, "10-20"), hop(c, "20-30"))
    slots = 4  # PEER_DEFAULTS' --max-sessions
    answers: list[tuple[int, Any]] = []

    async def run(evil: HostilePeer, stream: FramedStream, _: list) -> None:
        record = honest_record(evil.identity, model=MODEL, start=0, end=1, state="Joining")  # on no route
        await evil.publish_record(record)
        with trio.fail_after(15):
            while evil.peer_id not in {n["node_id"] for n in await trio.to_thread.run_sync(a.get, "/nodes")}:
                await trio.sleep(0.2)
        for i in range(slots):
            await stream.send(forward(evil, route, session=f"hoard{i}", tokens=[1, 2, 3]), timeout=10)
        with trio.fail_after(30):
            while [await trio.to_thread.run_sync(stage_sessions, p) for p in (a, b, c)] != [slots] * 3:
                await trio.sleep(0.2)
        answers.append(await trio.to_thread.run_sync(lambda: chat(b, timeout=45)))
        for i in range(slots):  # the hoarder steps on: the evicted one is told so
            await stream.send(forward(evil, route, session=f"hoard{i}", tokens=[4], start_pos=3), timeout=10)
        await trio.sleep(1.0)
        # Leave the swarm as it was: close what is left (on a stream of its own: the target may
        # have hung up on a peer that takes no connection back), retract the record.
        cleanup = await evil.open_stream(evil.target, wire.PROTOCOL)
        for i in range(slots):
            await cleanup.send(wire.encode(wire.Close(1, SessionId(f"hoard{i}"), route, evil.peer_id)), timeout=10)
        await trio.sleep(1.0)
        await evil.publish_record(record.replace(state="Dead", seq=record.seq + 1))

    replies = attack(a, s, run, settle=2.0, gossip=True)
    ((status, body),) = answers
    assert status == 200 and body["choices"][0]["message"]["content"] == expected, (status, body)
    assert errors(replies).count("session_evicted") == 1, errors(replies)
    s.wait(lambda: [stage_sessions(p) for p in (a, b, c)] == [0, 0, 0], 15, "the hoarder's sessions closed")
    assert_swarm_healthy([a, b, c], expected, baseline)


def test_a_stranger_s_lane_numbers_fold_onto_the_stage_s_lanes(live, expected, baseline) -> None:
    """Any lane 0-15 is served, and it makes at most ``--decode-lanes`` (4) groups at a
    stage: lanes 15 and 6 run as lanes 3 and 2, and the stage counts no fifth lane."""
    s, (a, b, c) = live
    before = c.get("/health")["batching"]["step_rounds_by_lane"]
    route = (hop(c, "20-30"),)

    async def run(evil: HostilePeer, stream: FramedStream, _: list) -> None:
        for pos, lane in enumerate((15, 6)):
            step = wire.Forward(1, SessionId("lanes"), pos, route, evil.peer_id, SamplingParams(0, 1, 0),
                                hidden=tensors.encode(finite_hidden(), "f32"), lane=lane)  # fmt: skip
            await stream.send(wire.encode(step), timeout=10)
        await stream.send(wire.encode(wire.Close(2, SessionId("lanes"), route, evil.peer_id)), timeout=10)

    replies = attack(c, s, run, settle=2.0)
    assert sorted(type(r).__name__ for r in replies) == ["Closed", "Result", "Result"], replies
    after = c.get("/health")["batching"]["step_rounds_by_lane"]
    assert len(after) == 4 and after[3] > before[3] and after[2] > before[2], (before, after)
    assert_swarm_healthy([a, b, c], expected, baseline)


def test_frames_larger_than_the_model_needs_are_refused_unread(live, expected, baseline) -> None:
    s, (a, b, c) = live

    async def run(evil: HostilePeer, stream: FramedStream, _: list) -> None:
        # A length prefix of 200 MiB (the old limit was 256 MiB): the stream is reset at once.
        raw = stream._raw  # the bytes under the framing: an honest FramedStream cannot lie about a length
        await raw.write(struct.pack(">I", 200 * 1024 * 1024) + b"\0" * 1024)

    attack(b, s, run)
    assert_swarm_healthy([a, b, c], expected, baseline)


def test_malformed_headers_are_dropped(live, expected, baseline) -> None:
    s, (a, b, c) = live

    async def run(evil: HostilePeer, stream: FramedStream, _: list) -> None:
        base = forward_header(evil, c, [20, 30])
        body = finite_hidden().tobytes()
        for header in (
            "[" * 20000 + "]" * 20000,
            {**base, "req": 2**70},
            {**base, "start_pos": -5},
            {**base, "route": [[1, 2, "a", None, 5]]},
            {**base, "route": [[peer_id(c), peer_id(c), 20, 30, ""]] * 300},
            {**base, "input": {"kind": "hidden", "dtype": "f32", "shape": [2**40, 2**40]}},
            {**base, "input": {"kind": "hidden", "dtype": "f64", "shape": [1, D_MODEL]}},
            {**base, "type": "result", "token": 10**30},
            "not json at all",
        ):
            await stream.send(raw_frame(header, body), timeout=10)
        await stream.send(raw_frame(json.dumps(base).replace('"req": 1,', '"req": Infinity,'), body), timeout=10)

    assert errors(attack(c, s, run)) == []
    assert_swarm_healthy([a, b, c], expected, baseline)


def test_malformed_step_and_result_frames_are_dropped(live, expected, baseline) -> None:
    """The compact forms (p2p/wire.py): garbled headers, contexts and bodies, and a flood of
    distinct contexts past what the context cache holds."""
    s, (a, b, c) = live

    async def run(evil: HostilePeer, stream: FramedStream, _: list) -> None:
        pid = peer_id(c)

        def context(**fields: Any) -> bytes:
            base = {"session": "m", "route": [[pid, pid, 20, 30, ""]], "reply_to": evil.peer_id, "sampling": None,
                    "input": {"kind": "hidden", "dtype": "f32", "cols": D_MODEL}}  # fmt: skip
            return json.dumps({**base, **fields}).encode()

        def step(ctx: bytes, body: bytes, *, rows: int = 1, reserved: int = 0) -> bytes:
            return struct.pack(">BBHQII", wire.STEP_TAG, reserved, len(ctx), 1, 0, rows) + ctx + body

        row = finite_hidden().tobytes()
        for frame in (
            bytes([wire.STEP_TAG]) + b"\xff" * 30,
            step(context(), row, reserved=7),
            struct.pack(">BBHQII", wire.STEP_TAG, 0, 60000, 1, 0, 1) + context(),
            step(b"[" * 30000 + b"]" * 30000, row),
            step(context(input={"kind": "hidden", "dtype": "f32", "cols": 2**30}), row),
            step(context(route=[[pid, pid, 20, 30, ""]] * 300), row),
            step(context(), row, rows=2**31),
            step(context(), row[:-1]),
            step(context(lane=wire.MAX_LANE + 1), row),  # lanes: an integer 0-15, nothing else
            step(context(lane=-1), row),
            step(context(lane="1"), row),
            step(context(lane=1.0), row),
            struct.pack(">BBHQi", wire.RESULT_TAG, 0, 2, 1, 5) + b"\xff\xfe",
            struct.pack(">BBHQi", wire.RESULT_TAG, 0, 1, 1, -9) + b"m",
        ):
            await stream.send(frame, timeout=10)
        for i in range(wire.CONTEXT_CACHE_ENTRIES + 100):  # parseable, but a token id to a hidden-state stage
            await stream.send(step(context(session=f"flood-{i}", input={"kind": "tokens"}), bytes(4)), timeout=10)

    replies = attack(c, s, run, settle=3.0)
    assert {m.code for m in replies if isinstance(m, wire.Error)} <= {"invalid_batch"}  # the flood, refused frame by frame
    assert not [m for m in replies if isinstance(m, wire.Result)]
    assert_swarm_healthy([a, b, c], expected, baseline)


def test_a_flood_from_one_peer_does_not_starve_a_chat(live, expected, baseline) -> None:
    """Chats one after another while a stranger keeps its 64 jobs queued at the last stage:
    more chats than that stage has slots (4, one of them the flood's), so each needs the one
    before it to be closed there. A close used to wait behind every flood job queued before
    it (10-20 s here): the slots stayed taken, a new chat waited for one, and on a busy
    machine its entry gave up on the chain."""
    s, (a, b, c) = live
    results: list[Any] = []
    held_before = stage_sessions(c)  # earlier tests' strangers may still hold some

    async def run(evil: HostilePeer, stream: FramedStream, replies: list) -> None:
        frame = forward(evil, (hop(c, "20-30"),), session="flood", hidden=finite_hidden(128))

        async def flood() -> None:
            try:
                while True:  # until the chats are done
                    await stream.send(frame, timeout=30)  # rewinds to 0 each time: 128 rows of work
            except P2PError:
                pass  # over its budget, the flooder is no longer read: being throttled is the point

        async with trio.open_nursery() as nursery:
            nursery.start_soon(flood)
            for _ in range(4):
                results.append(await trio.to_thread.run_sync(chat, a))
            await trio.to_thread.run_sync(s.wait, lambda: 0 <= stage_sessions(c) <= held_before + 1, 10,
                                          "the chats' sessions to be closed at the flooded stage", c)  # fmt: skip
            nursery.cancel_scope.cancel()

    attack(c, s, run, settle=0.1)
    for status, body in results:
        assert status == 200, (status, body)
        assert body["choices"][0]["message"]["content"] == expected
    assert_swarm_healthy([a, b, c], expected, baseline)


def _set_state(target: PeerProcess, state: str) -> None:
    status, body = request_json("PATCH", target.url + f"/admin/nodes/{peer_id(target)}/state", {"state": state},
                                headers={"X-Admin-Token": ADMIN_TOKEN})  # fmt: skip
    assert status == 200, body


def test_a_last_stage_that_answers_a_token_outside_the_vocabulary(live, expected, baseline) -> None:
    """llama.cpp aborts the whole entry process (std::terminate) on such a token id. Here a
    stranger registers as the only Ready holder of layers 10-30 and answers every step with
    token 1,000,000: the chat fails cleanly and the entry lives."""
    s, (a, b, c) = live
    outcome: list[tuple[int, object]] = []

    async def main() -> None:
        async with hostile_peer(s.multiaddr(a)) as evil:
            async def lie(stream: FramedStream, remote: PeerId) -> None:
                while True:
                    msg = wire.decode(await stream.receive(timeout=60))
                    answer: wire.Message | None = None
                    if isinstance(msg, wire.Forward) and msg.sampling is not None:
                        answer = wire.Result(msg.req_id, msg.session_id, 1_000_000)
                    elif isinstance(msg, wire.Close):
                        answer = wire.Closed(msg.req_id, msg.session_id)
                    if answer is not None:
                        out = await evil.host.new_stream(msg.reply_to, wire.PROTOCOL)
                        await out.send(wire.encode(answer), timeout=10)
                        await out.close()

            evil.host.set_stream_handler(wire.PROTOCOL, lie)
            await evil.publish_record(honest_record(evil.identity, model=MODEL, start=10, end=30, n_layers=30, d_model=D_MODEL,
                                                    multiaddrs=tuple(evil.host.multiaddrs())))  # fmt: skip
            for honest in (b, c):
                await trio.to_thread.run_sync(_set_state, honest, "idle")
            try:
                with trio.fail_after(20):
                    while not (await trio.to_thread.run_sync(a.get, "/api/models"))[0]["chain_complete"]:
                        await trio.sleep(0.2)
                outcome.append(await trio.to_thread.run_sync(chat, a))
            finally:
                for honest in (b, c):
                    await trio.to_thread.run_sync(_set_state, honest, "ready")

    trio.run(main)
    status, body = outcome[0]
    assert status == 503 and "vocabulary" in str(body), (status, body)
    assert a.alive()
    evil_gone = lambda: all(n["state"] != "Ready" for n in a.get("/nodes") if n["node_id"] not in {x[0] for x in baseline})  # noqa: E731
    s.wait(evil_gone, 20, "the stranger's record to age out", a)
    assert_swarm_healthy([a, b, c], expected, baseline)


# ------------------------------------------------------- failover's span replay


def test_a_stranger_cannot_make_a_stage_resend_or_move_what_it_keeps(live, expected, baseline) -> None:
    """A stage re-sends a session's kept outputs only right after an adopt, once, and only
    the session's opener (or a registered peer) may adopt it: a stranger who learnt a session
    id can neither pull its hidden states out again nor move it."""
    s, (a, b, c) = live
    route = (hop(b, "10-20"), hop(c, "20-30"))
    replay = wire.Replay(20, 30, ((0, 2),))

    def again(evil: HostilePeer, session: str) -> bytes:
        return wire.encode(wire.Forward(2, SessionId(session), 2, route, evil.peer_id, None,
                                        hidden=tensors.encode(finite_hidden(), "f32"), replay=replay))  # fmt: skip

    async def run(evil: HostilePeer, stream: FramedStream, replies: list) -> None:
        await stream.send(forward(evil, route, session="mine", hidden=finite_hidden(2)), timeout=10)
        await stream.send(again(evil, "mine"), timeout=10)  # no adopt before it: refused
        adopt = wire.Adopt(3, SessionId("mine"), SessionId("mine.1"), route[:1], evil.peer_id)
        await stream.send(wire.encode(adopt), timeout=10)  # its own session: allowed
        await trio.sleep(0.5)
        await stream.send(again(evil, "mine.1"), timeout=10)  # once...
        await stream.send(again(evil, "mine.1"), timeout=10)  # ...and no more
        theirs = wire.Adopt(4, SessionId("someone-elses"), SessionId("stolen"), route[:1], evil.peer_id)
        await stream.send(wire.encode(theirs), timeout=10)  # a session it did not open: no answer
        for session in ("mine", "mine.1"):  # its own sessions: it may free them along the route
            await stream.send(wire.encode(wire.Close(5, SessionId(session), route, evil.peer_id)), timeout=10)

    replies = attack(b, s, run, settle=2.0)
    assert errors(replies) == ["protocol", "protocol"], replies
    assert [(r.session_id, r.length) for r in replies if isinstance(r, wire.Adopted)] == [("mine.1", 2)]
    assert_swarm_healthy([a, b, c], expected, baseline)
