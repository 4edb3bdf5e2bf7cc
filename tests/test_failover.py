"""Peers die mid-generation; the entry peer re-routes, replays and the client sees a stall.

Real SmolLM2 peers as processes on 127.0.0.1. Every streamed text is compared with the same
request run undisturbed; after every scenario no live peer holds a session. Two swarms, each
reused across its scenarios (they run in file order and each picks its victims from what is
left):

- f32, greedy, entry A holds layer 0: A 0-10, B/C 10-20, D/E 20-30 (the issue's swarm plus
  a second last stage). Middle hop killed under 8 streams mid-decode, last stage killed
  during a prefill, then the last holder of 10-20 killed: a 503 naming those layers, on SSE,
  /ws/chat and plain JSON.
- f16, seeded sampling, entry Z holds only the last layers: A/A2/A3 0-10, B 10-20, Z 20-30.
  The first stage killed under 3 streams, then the replacement killed too; an entry allowed no failover reports the failure.
- f32, greedy, three replicas of the middle span: 8 sessions on one of them fail over at
  once and spread over the two survivors.
- f32, greedy, two holders of the middle span: one drains (SIGTERM) and the other is then
  killed; the streams fail over onto the draining one.

(Five peers per swarm: with six, py-libp2p 0.8.1 here stops opening streams from the peer
everyone bootstrapped to, failover or not: a separate problem.)
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import trio
from swarm import PeerProcess, Swarm, request_json, stage_sessions

from inclavate.chat_stream import StreamedChat, stream_chat

pytestmark = [pytest.mark.swarm, pytest.mark.slow]
MODEL = "smollm2:135m"
# kill -9 is seen through the lost connection; a generous deadline keeps a loaded CI machine
# from failing over healthy-but-slow hops.
ADMIN_TOKEN = "failover-test"
SHARED = ["--max-sessions", "8", "--min-step-deadline", "30", "--admin-token", ADMIN_TOKEN]


def ask(question: str, max_tokens: int, **sampling: object) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "temperature": 0, **sampling}  # fmt: skip


def health(peer: PeerProcess) -> dict[str, int]:
    return peer.get("/health")["sessions"]


def wait_no_sessions(s: Swarm, peers: list[PeerProcess]) -> None:
    live = [p for p in peers if p.alive()]
    s.wait(lambda: all(health(p) == {"stage": 0, "entry": 0} for p in live), 15, "no session left on any live peer")


def kill(peer: PeerProcess) -> None:
    peer.process.send_signal(signal.SIGKILL)
    peer.process.wait(10)


def run_streams(entry: PeerProcess, bodies: list[dict], during: Callable[[list[StreamedChat]], None],
                entries: list[PeerProcess] | None = None) -> list[StreamedChat]:  # fmt: skip
    """Stream every body at once (the i-th through ``entries[i]`` when given); call ``during``
    (in this thread) once every stream has text."""
    started: list[StreamedChat] = []
    ready = threading.Event()

    def on_delta(chat: StreamedChat) -> None:
        if chat not in started:
            started.append(chat)
            if len(started) == len(bodies):
                ready.set()

    with ThreadPoolExecutor(len(bodies)) as pool:
        urls = [p.url for p in entries] if entries else [entry.url] * len(bodies)
        futures = [pool.submit(stream_chat, url, body, 300, on_delta) for url, body in zip(urls, bodies)]
        deadline = time.monotonic() + 240
        while not ready.wait(0.2):
            # A stream that ended before its first text (an error) would never set ``ready``.
            ended = [f.result() for f in futures if f.done()]
            assert not ended, f"a stream ended before every stream had text: {ended[0]}\n{entry.log_tail()}"
            assert time.monotonic() < deadline, f"the streams did not all start\n{entry.log_tail()}"
        during(started)
        return [f.result() for f in futures]


def warm_up(s: Swarm, entry: PeerProcess, n: int) -> None:
    """A few small requests, so that the peers have dialed each other (on a loaded machine a
    first dial can take seconds) before anything is measured or killed."""
    def answered() -> bool:
        return request_json("POST", entry.url + "/v1/chat/completions", ask("Hi", 2), timeout=120)[0] == 200

    for _ in range(n):
        s.wait(answered, 120, "a warm-up answer", entry)


def busiest(peers: list[PeerProcess]) -> PeerProcess:
    return max((p for p in peers if p.alive()), key=stage_sessions)


# ----------------------------------------------------------------- f32, greedy


@pytest.fixture(scope="module")
def greedy_swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Swarm, dict[str, PeerProcess]]]:
    with Swarm(tmp_path_factory.mktemp("failover-f32"), extra_args=["--wire-dtype", "f32", *SHARED]) as s:
        a = s.start("a", "--layers", "0-10")
        peers = {"a": a}
        for name, layers in [("b", "10-20"), ("c", "10-20"), ("d", "20-30"), ("e", "20-30")]:
            peers[name] = s.start(name, "--layers", layers, bootstrap=a)
        for peer in peers.values():
            s.wait_ready(peer, timeout=120)
        s.wait(lambda: a.get("/api/models")[0]["chain_complete"] and len(a.get("/nodes")) == 5, 30, "the whole swarm")
        warm_up(s, a, 4)
        yield s, peers


QUESTION = "Tell me a short story about a lighthouse keeper."
STREAM_TOKENS = 128
"""Tokens of a stream something happens to mid-decode. On a loaded machine the last of 8
streams started 2.7 s after the first (its prefill waited for the others' steps), and a
stream of 48 tokens that started first ended before it: the kill then landed on no
stream."""


@pytest.fixture(scope="module")
def greedy_text(greedy_swarm) -> str:
    s, peers = greedy_swarm
    status, body = request_json("POST", peers["a"].url + "/v1/chat/completions", ask(QUESTION, STREAM_TOKENS), timeout=120)
    assert status == 200, body
    return body["choices"][0]["message"]["content"]


def counters(peers: list[PeerProcess]) -> tuple[int, int]:
    """Sessions these peers' stages kept across failovers, and positions they recomputed."""
    totals = [p.get("/health")["failover"] for p in peers]
    return sum(t["adopted"] for t in totals), sum(t["recomputed"] for t in totals)


def test_eight_streams_survive_a_middle_hop_killed_mid_decode(greedy_swarm, greedy_text: str) -> None:
    """Span replay: the hops before and after the dead one keep their caches (they adopt the
    moved sessions); only the replacement computes the past positions again."""
    s, peers = greedy_swarm
    lasts = [peers["d"], peers["e"]]
    before = counters(lasts)
    moved: list[int] = []
    killed: list[str] = []

    def kill_a_middle_hop(chats: list[StreamedChat]) -> None:
        victim = busiest([peers["b"], peers["c"]])
        moved.append(stage_sessions(victim))
        killed.append(victim.get("/health")["peer_id"])
        kill(victim)

    chats = run_streams(peers["a"], [ask(QUESTION, STREAM_TOKENS)] * 8, kill_a_middle_hop)
    assert [c.error for c in chats] == [None] * 8
    assert [c.text for c in chats] == [greedy_text] * 8
    # The entry tells each session's route as it is now: none goes through the dead peer.
    routes = [peers["a"].get(f"/sessions/{c.session_id}")["route"] for c in chats]
    assert all(len(route) == 3 and killed[0] not in {hop["peer_id"] for hop in route} for route in routes), routes
    adopted, recomputed = (after - was for after, was in zip(counters(lasts), before))
    assert adopted >= moved[0] > 0, (adopted, moved)
    # Each moved session's last stage redid at most its last step or two, not its ~80 positions.
    assert recomputed <= 4 * adopted, recomputed
    wait_no_sessions(s, list(peers.values()))


def test_sessions_leave_a_hop_set_idle_at_the_next_step(greedy_swarm, greedy_text: str) -> None:
    """Not a failure: the hop keeps serving, and the entry moves its sessions to the other
    holder at a step boundary (what a draining, politely stopping peer gets too)."""
    s, peers = greedy_swarm

    def set_busiest_last_stage_idle(chats: list[StreamedChat]) -> None:
        leaving = busiest([peers["d"], peers["e"]])
        node = leaving.get("/health")["peer_id"]
        status, body = request_json("PATCH", f"{leaving.url}/admin/nodes/{node}/state", {"state": "idle"},
                                    headers={"X-Admin-Token": ADMIN_TOKEN})  # fmt: skip
        assert status == 200, body
        s.wait(lambda: stage_sessions(leaving) == 0, 60, "the sessions to leave the idle hop", leaving)
        assert all(c.finish_reason is None for c in chats), "the streams should still be running"

    try:
        chats = run_streams(peers["a"], [ask(QUESTION, STREAM_TOKENS)] * 2, set_busiest_last_stage_idle)
        assert [(c.error, c.text) for c in chats] == [(None, greedy_text)] * 2
    finally:  # the module's swarm serves the next tests: a failure here must not leave a hop idle
        for peer in (peers["d"], peers["e"]):
            node = peer.get("/health")["peer_id"]
            status, _ = request_json("PATCH", f"{peer.url}/admin/nodes/{node}/state", {"state": "ready"},
                                     headers={"X-Admin-Token": ADMIN_TOKEN})  # fmt: skip
            assert status == 200
        s.wait(lambda: not any(n["idle"] for n in peers["a"].get("/nodes")), 20, "the hop to be active again")
    wait_no_sessions(s, list(peers.values()))


LONG_QUESTION = "Summarise this: " + "the quick brown fox jumps over the lazy dog. " * 38


def test_the_last_stage_killed_during_prefill(greedy_swarm) -> None:
    """The kill lands while the prompt's chunks are still crossing the chain (the last stage
    has taken the first chunk, no token is out yet)."""
    s, peers = greedy_swarm
    body = ask(LONG_QUESTION, 8)
    status, reply = request_json("POST", peers["a"].url + "/v1/chat/completions", body, timeout=120)
    assert status == 200, reply
    expected = reply["choices"][0]["message"]["content"]
    started: list[StreamedChat] = []
    killed_before_first_token: list[bool] = []

    def kill_when_prefill_arrives() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            for peer in (peers["d"], peers["e"]):
                if stage_sessions(peer) > 0:
                    kill(peer)
                    killed_before_first_token.append(not started)
                    return
            time.sleep(0.01)

    with ThreadPoolExecutor(1) as pool:
        killer = pool.submit(kill_when_prefill_arrives)
        chat = stream_chat(peers["a"].url, body, 300, started.append)
        killer.result()
    assert killed_before_first_token == [True], "the kill should land during the prefill"
    assert (chat.error, chat.text) == (None, expected)
    wait_no_sessions(s, list(peers.values()))


def test_an_entry_that_did_not_run_for_8_s_blames_no_hop(greedy_swarm, greedy_text: str) -> None:
    """The entry stopped (SIGSTOP: swapped out, a laptop's lid) for longer than the step
    deadline and the registry's 6 s of silence: when it runs again, its hops' answers and
    heartbeats are in its sockets. Before, it had every hop Degraded and every deadline
    missed, and failed both streams over blaming healthy peers (an audit, 2026-12-08)."""
    s, peers = greedy_swarm
    entry = peers["a"]
    since = len(entry.log_path.read_text(errors="replace"))

    def pause_the_entry(_: list[StreamedChat]) -> None:
        entry.process.send_signal(signal.SIGSTOP)
        try:
            time.sleep(8)
        finally:
            entry.process.send_signal(signal.SIGCONT)

    chats = run_streams(entry, [ask(QUESTION, STREAM_TOKENS)] * 2, pause_the_entry)
    assert [(c.error, c.text) for c in chats] == [(None, greedy_text)] * 2
    failovers = [line for line in entry.log_path.read_text(errors="replace")[since:].splitlines() if "failover" in line]
    assert failovers == [], failovers
    wait_no_sessions(s, list(peers.values()))


def test_no_live_holder_left_is_a_503_naming_the_layers(greedy_swarm) -> None:
    s, peers = greedy_swarm
    entry = peers["a"]
    (middle,) = [p for p in (peers["b"], peers["c"]) if p.alive()]
    (chat,) = run_streams(entry, [ask(QUESTION, STREAM_TOKENS)], lambda _: kill(middle))
    assert chat.error is not None and chat.error["status"] == 503, chat.error
    assert "10-20" in chat.error["error"], chat.error

    status, body = request_json("POST", entry.url + "/v1/chat/completions", ask(QUESTION, 8), timeout=60)
    assert status == 503 and "10-20" in body["error"], body

    async def over_ws() -> dict:
        from trio_websocket import open_websocket_url

        async with open_websocket_url(f"ws://127.0.0.1:{entry.api_port}/ws/chat") as ws:
            await ws.send_message(json.dumps(ask(QUESTION, 8)))
            return json.loads(await ws.get_message())

    frame = trio.run(over_ws)
    assert frame["status"] == 503 and "10-20" in frame["error"], frame
    wait_no_sessions(s, list(peers.values()))


# ------------------------------------------------------------ f16, seeded sampling


@pytest.fixture(scope="module")
def seeded_swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Swarm, dict[str, PeerProcess]]]:
    with Swarm(tmp_path_factory.mktemp("failover-f16"), extra_args=["--wire-dtype", "f16", *SHARED]) as s:
        z = s.start("z", "--layers", "20-30")
        peers = {"z": z}
        for name, layers in [("a", "0-10"), ("a2", "0-10"), ("a3", "0-10"), ("b", "10-20")]:
            extra = ["--max-failovers", "0"] if name == "b" else []
            peers[name] = s.start(name, "--layers", layers, *extra, bootstrap=z)
        for peer in peers.values():
            s.wait_ready(peer, timeout=120)
        s.wait(lambda: z.get("/api/models")[0]["chain_complete"] and len(z.get("/nodes")) == 5, 30, "the whole swarm")
        warm_up(s, z, 4)
        yield s, peers


SEEDED = {"temperature": 0.9, "seed": 7}


def test_the_first_stage_and_then_its_replacement_killed(seeded_swarm) -> None:
    """The entry holds only the last layers. The stage holding layer 0 for most sessions
    dies: its sessions move to the two other holders; then the busiest of those dies too.
    Every stream finishes with the sampled text of an undisturbed run (f16 on the wire)."""
    s, peers = seeded_swarm
    body = ask(QUESTION, 96, **SEEDED)
    status, reply = request_json("POST", peers["z"].url + "/v1/chat/completions", body, timeout=120)
    assert status == 200, reply
    expected = reply["choices"][0]["message"]["content"]
    firsts = [peers["a"], peers["a2"], peers["a3"]]
    spread: list[list[int]] = []

    def kill_twice(chats: list[StreamedChat]) -> None:
        kill(busiest(firsts))
        seen = [len(c.times) for c in chats]
        s.wait(lambda: all(len(c.times) > n + 2 for c, n in zip(chats, seen)), 120, "tokens after the first failover")
        spread.append(sorted(stage_sessions(p) for p in firsts if p.alive()))
        kill(busiest(firsts))

    chats = run_streams(peers["z"], [body] * 3, kill_twice)
    assert [(c.error, c.text) for c in chats] == [(None, expected)] * 3
    # How the moved sessions spread depends on measured link latencies (on a loaded machine a
    # replica whose ping timed out costs 1000 ms): tests/test_failover_policy.py asserts the
    # rule; here it is only reported.
    print(f"sessions on the two surviving first stages after the first failover: {spread}")
    assert sum(p.alive() for p in firsts) == 1
    wait_no_sessions(s, list(peers.values()))


def test_an_entry_allowed_no_failover_reports_the_failure(seeded_swarm) -> None:
    s, peers = seeded_swarm
    entry = peers["b"]  # started with --max-failovers 0
    (last_first,) = [p for p in (peers["a"], peers["a2"], peers["a3"]) if p.alive()]
    # The entry must have seen the killed first stages fall silent: with no failover allowed,
    # a route through one of them would fail before the first token.
    s.wait(lambda: [n["peer_id"] for n in entry.get("/nodes") if n["start_layer"] == 0 and n["state"] == "Ready"]
           == [last_first.get("/health")["peer_id"]], 60, "the entry to see one live first stage", entry)  # fmt: skip
    (chat,) = run_streams(entry, [ask(QUESTION, 64)], lambda _: kill(last_first))
    assert chat.error is not None and chat.error["status"] == 503, chat.error
    assert "after 0 failover" in chat.error["error"], chat.error
    wait_no_sessions(s, list(peers.values()))


# ------------------------------------------------- spreading over the survivors


def set_state(peer: PeerProcess, state: str) -> None:
    node = peer.get("/health")["peer_id"]
    status, body = request_json("PATCH", f"{peer.url}/admin/nodes/{node}/state", {"state": state},
                                headers={"X-Admin-Token": ADMIN_TOKEN})  # fmt: skip
    assert status == 200, body


def serve_once_each(s: Swarm, entry: PeerProcess, holders: list[PeerProcess], prove: list[PeerProcess]) -> None:
    """Each of ``prove`` serves the entry a session, the other ``holders`` of its span idle
    meanwhile: proven to the entry, so a failover may spread over them (a failover goes
    through peers that served the entry first: docs/ARCHITECTURE.md, "Probation")."""
    for peer in prove:
        others = [p for p in holders if p is not peer]
        for other in others:
            set_state(other, "idle")
        s.wait(lambda: sum(n["idle"] for n in entry.get("/nodes")) == len(others), 20, "the other holders to be idle")
        warm_up(s, entry, 1)
        for other in others:
            set_state(other, "ready")
        s.wait(lambda: not any(n["idle"] for n in entry.get("/nodes")), 20, "the holders to be active")


def test_eight_sessions_failing_over_at_once_spread_over_the_survivors(tmp_path: Path) -> None:
    """A 0-10 (entry), B/C1/C2 10-20, D 20-30. C1 and C2 each serve the entry once (proven);
    they are idle while 8 greedy streams start, so all 8 go through B; they are active
    again, then B is killed: all 8 move at once, and both survivors take some of them.
    Every text is the undisturbed one."""
    with Swarm(tmp_path, extra_args=["--wire-dtype", "f32", *SHARED]) as s:
        a = s.start("a", "--layers", "0-10")
        b, c1, c2, d = (s.start(n, "--layers", r, bootstrap=a) for n, r in
                        (("b", "10-20"), ("c1", "10-20"), ("c2", "10-20"), ("d", "20-30")))  # fmt: skip
        peers = [a, b, c1, c2, d]
        for peer in peers:
            s.wait_ready(peer, timeout=120)
        s.wait(lambda: a.get("/api/models")[0]["chain_complete"] and len(a.get("/nodes")) == 5, 30, "the whole swarm")
        warm_up(s, a, 3)
        serve_once_each(s, a, [b, c1, c2], prove=[c1, c2])
        body = ask(QUESTION, STREAM_TOKENS)
        status, reply = request_json("POST", a.url + "/v1/chat/completions", body, timeout=120)
        assert status == 200, reply
        expected = reply["choices"][0]["message"]["content"]
        replicas = [c1, c2]
        for peer in replicas:
            set_state(peer, "idle")
        s.wait(lambda: sum(n["idle"] for n in a.get("/nodes")) == 2, 20, "the replicas to be idle")
        spread: list[int] = []

        def kill_b_when_replicas_are_back(chats: list[StreamedChat]) -> None:
            assert stage_sessions(b) == 8
            for peer in replicas:
                set_state(peer, "ready")
            s.wait(lambda: not any(n["idle"] for n in a.get("/nodes")), 20, "the replicas to be active")
            kill(b)
            s.wait(lambda: sum(stage_sessions(p) for p in replicas) == 8 or all(c.finish_reason for c in chats), 60,
                   "the sessions to move")  # fmt: skip
            spread.extend(stage_sessions(p) for p in replicas)

        chats = run_streams(a, [body] * 8, kill_b_when_replicas_are_back)
        assert [(c.error, c.text) for c in chats] == [(None, expected)] * 8
        assert sum(spread) == 8 and min(spread) > 0, spread
        wait_no_sessions(s, peers)


# ------------------------------------------------- a draining holder as the last resort


def _middle_held_twice(s: Swarm) -> tuple[PeerProcess, PeerProcess, PeerProcess, PeerProcess]:
    """A 0-10, B and C 10-20, D 20-30, all Ready, the entry A warmed up."""
    a = s.start("a", "--layers", "0-10")
    b, c, d = (s.start(n, "--layers", r, bootstrap=a) for n, r in (("b", "10-20"), ("c", "10-20"), ("d", "20-30")))
    for peer in (a, b, c, d):
        s.wait_ready(peer, timeout=120)
    s.wait(lambda: a.get("/api/models")[0]["chain_complete"] and len(a.get("/nodes")) == 4, 30, "the whole swarm")
    warm_up(s, a, 3)
    return a, b, c, d


def test_a_draining_holder_takes_the_streams_when_the_other_holder_dies(tmp_path: Path) -> None:
    """A 0-10, B/C 10-20, D 20-30. C is stopped politely (SIGTERM: draining) while two streams
    run, one entered at A and one at C itself (which keeps C's drain waiting); the streams
    move off C onto B; then B is killed. C, still serving until its drain ends, is the only
    way through 10-20: both streams fail over onto it and finish with the undisturbed text
    (before, a 503 "layers 10-20 have no Ready node"), and C leaves once they are done."""
    with Swarm(tmp_path, extra_args=["--wire-dtype", "f32", *SHARED, "--drain-timeout", "120"]) as s:
        a, b, c, d = _middle_held_twice(s)
        body = ask("Write the numbers from 1 to 3000 separated by commas.", 300)  # no early end of stream
        status, reply = request_json("POST", a.url + "/v1/chat/completions", body, timeout=120)
        assert status == 200, reply
        expected = reply["choices"][0]["message"]["content"]
        c_id = c.get("/health")["peer_id"]

        def drain_c_then_kill_b(chats: list[StreamedChat]) -> None:
            s.signal(c, signal.SIGTERM)
            s.wait(lambda: any(n["draining"] for n in a.get("/nodes") if n["peer_id"] == c_id), 20,
                   "the entry to see C draining", a)  # fmt: skip
            s.wait(lambda: stage_sessions(c) == 0 and stage_sessions(b) == 2, 60, "the streams to move off C", c)
            assert not any(chat.finish_reason for chat in chats), "the streams should still be running"
            kill(b)

        chats = run_streams(a, [body, body], drain_c_then_kill_b, entries=[a, c])
        assert [(chat.error, chat.text) for chat in chats] == [(None, expected)] * 2
        assert c.process.wait(30) == 0, "C should leave on its own once its streams are done"
        wait_no_sessions(s, [a, d])


# ------------------------------------------------- both holders of a span killed at once


def test_both_holders_of_a_span_killed_at_once_is_a_503_naming_the_layers(tmp_path: Path) -> None:
    """A 0-10, B/C 10-20, D 20-30; B and C killed within a millisecond while a stream runs
    through one of them. Each is tried once at most: the stream ends, after the wait for a
    route, with the 503 naming 10-20, and so does a new request at once (both are still Ready
    in the registry for seconds). It used to bounce between the two dead peers and end 0.2 s
    after the kill with "failed again after 3 failover(s): ... negative cache"."""
    with Swarm(tmp_path, extra_args=["--wire-dtype", "f32", *SHARED]) as s:
        a, b, c, d = _middle_held_twice(s)
        killed_at: list[float] = []

        def kill_both_middle_holders(chats: list[StreamedChat]) -> None:
            s.wait(lambda: len(chats[0].times) >= 10 or chats[0].finish_reason is not None, 60, "ten tokens")
            for peer in (b, c):
                peer.process.send_signal(signal.SIGKILL)
            killed_at.append(time.monotonic())
            for peer in (b, c):
                peer.process.wait(10)

        body = ask("Write the numbers from 1 to 3000 separated by commas.", 300)  # no early end of stream
        (chat,) = run_streams(a, [body], kill_both_middle_holders)
        ended = time.monotonic() - killed_at[0]
        assert chat.error is not None and chat.error["status"] == 503, chat.error
        assert "layers 10-20 have no Ready node" in chat.error["error"], (chat.error, a.log_tail())
        assert ended < 60, ended
        began = time.monotonic()
        status, reply = request_json("POST", a.url + "/v1/chat/completions", ask(QUESTION, 8), timeout=60)
        assert status == 503 and "layers 10-20 have no Ready node" in reply["error"], reply
        print(f"the stream's 503 came {ended:.2f} s after the kill; a new request's {time.monotonic() - began:.2f} s")
        wait_no_sessions(s, [a, d])
