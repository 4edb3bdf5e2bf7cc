"""A volunteer stops a peer (Ctrl-C / SIGTERM): it drains, then leaves; the drain is bounded;
a second signal leaves at once. Real peers on loopback, the middle hop stopped mid-stream."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator

import pytest
from reference import whole_model_text
from stream_helpers import BackgroundStream
from swarm import PeerProcess, Swarm, request_json

pytestmark = [pytest.mark.swarm, pytest.mark.slow]
STORY = [{"role": "user", "content": "Write a long story about a dragon who learns to cook."}]
TOKENS = 120
TOKEN = "stop-admin-token"


@pytest.fixture(scope="module")
def ends(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Swarm, PeerProcess, PeerProcess]]:
    """Peers holding 0-10 and 20-30; each test starts its own middle hop."""
    with Swarm(tmp_path_factory.mktemp("stop"), extra_args=["--wire-dtype", "f32"]) as s:
        a = s.start("a", "--layers", "0-10", "--admin-token", TOKEN)
        c = s.start("c", "--layers", "20-30", bootstrap=a)
        for peer in (a, c):
            s.wait_ready(peer, timeout=90)
        yield s, a, c


@pytest.fixture(scope="module")
def expected(smollm2, slice_cache) -> str:
    return whole_model_text(smollm2, slice_cache, STORY, TOKENS)


def _middle(s: Swarm, a: PeerProcess, name: str, *args: str) -> tuple[PeerProcess, str]:
    trust = ["--admin-peer", a.get("/health")["peer_id"]]  # a relays admin commands
    b = s.start(name, "--layers", "10-20", *trust, *args, bootstrap=a)
    node_id = s.wait_ready(b, timeout=90)["peer_id"]
    s.wait(lambda: a.get("/api/models")[0]["chain_complete"] and _node(a, node_id)["state"] == "Ready", 20,
           f"{name} in a's chain")  # fmt: skip
    return b, node_id


def _node(peer: PeerProcess, node_id: str) -> dict:
    return next(n for n in peer.get("/nodes") if n["node_id"] == node_id)


def _exit_code(b: PeerProcess, timeout: float) -> int:
    return b.process.wait(timeout)


def test_a_stopped_peer_drains_its_sessions_then_leaves(ends, expected: str) -> None:
    s, a, c = ends
    b, b_id = _middle(s, a, "b1")
    assert _node(a, b_id)["draining"] is False
    stream = BackgroundStream(a, STORY, TOKENS)
    stream.start()
    stream.wait_chunks(3)
    s.signal(b, signal.SIGTERM)
    stopped = time.monotonic()
    # The stop is visible to the whole swarm while b still serves the generation...
    s.wait(lambda: _node(c, b_id)["draining"] and _node(c, b_id)["state"] == "Ready", 5, "b draining at c")
    assert b.alive()
    # ... which runs to the end, exactly as undisturbed (nobody else holds 10-20).
    stream.join(120)
    assert stream.done and stream.error is None, stream.error
    assert stream.text == expected
    # Then b leaves on its own, announcing it.
    assert _exit_code(b, 15) == 0, b.log_tail()
    assert time.monotonic() - stopped < 30
    s.wait(lambda: _node(a, b_id)["state"] == "Dead", 5, "b Dead at a")


def test_the_drain_is_bounded(ends) -> None:
    s, a, c = ends
    b, _ = _middle(s, a, "b2", "--drain-timeout", "2")
    stream = BackgroundStream(a, STORY, 400)
    stream.start()
    stream.wait_chunks(3)
    s.signal(b, signal.SIGTERM)
    stopped = time.monotonic()
    assert _exit_code(b, 20) == 0, b.log_tail()
    took = time.monotonic() - stopped
    assert 1.5 <= took < 12, f"left {took:.1f} s after SIGTERM with a 2 s drain bound"
    stream.join(60)
    # Nobody else holds 10-20: the generation that outlived the bound fails with a clear error.
    assert not stream.done and stream.error is not None
    s.wait(lambda: a.get("/health")["sessions"] == {"stage": 0, "entry": 0}, 15, "a frees the session")


def test_a_second_signal_leaves_at_once(ends) -> None:
    s, a, c = ends
    b, b_id = _middle(s, a, "b3")
    stream = BackgroundStream(a, STORY, 400)
    stream.start()
    stream.wait_chunks(3)
    s.signal(b, signal.SIGINT)
    s.wait(lambda: _node(c, b_id)["draining"], 5, "b draining")
    assert b.alive(), "b left before its session ended"
    s.signal(b, signal.SIGINT)
    again = time.monotonic()
    assert _exit_code(b, 10) == 0, b.log_tail()
    assert time.monotonic() - again < 5
    s.wait(lambda: _node(a, b_id)["state"] == "Dead", 5, "b Dead at a (announced on the way out)")
    # Nobody else holds 10-20: the entry notices, ends the stream with an error, frees everything.
    stream.join(30)
    assert stream.error is not None and not stream.done
    s.wait(lambda: a.get("/health")["sessions"] == {"stage": 0, "entry": 0}, 15, "a frees the session")


def test_a_second_signal_leaves_at_once_an_entry_driving_a_stream(ends) -> None:
    """The peer a chat came in through, told twice: its generation's close waited for
    answers its own cancelled stage never sent (5 s, twice), and it took 11 s to exit (an
    audit from outside, 2026-12-08)."""
    s, a, c = ends
    b, _ = _middle(s, a, "b4", "--drain-timeout", "20")
    e = s.start("e", "--layers", "0-10", bootstrap=a)
    s.wait_ready(e, timeout=90)
    s.wait(lambda: e.get("/api/models")[0]["chain_complete"], 20, "a complete chain at e")
    stream = BackgroundStream(e, STORY, 400)
    stream.start()
    stream.wait_chunks(3)
    s.signal(e, signal.SIGINT)
    time.sleep(0.5)
    s.signal(e, signal.SIGINT)
    again = time.monotonic()
    assert _exit_code(e, 20) == 0, e.log_tail()
    assert time.monotonic() - again < 6, f"left {time.monotonic() - again:.1f} s after the second signal"  # 11 s before
    stream.join(30)
    # Its hops were told directly: they free the session, and b stops without waiting for it.
    s.wait(lambda: b.get("/health")["sessions"]["stage"] == 0 and c.get("/health")["sessions"]["stage"] == 0, 10,
           "the hops to free the session")  # fmt: skip
    s.stop(b, timeout=20)


def _streams(a: PeerProcess, n: int) -> list[BackgroundStream]:
    streams = [BackgroundStream(a, STORY, TOKENS) for _ in range(n)]
    for stream in streams:
        stream.start()
    for stream in streams:
        stream.wait_chunks(3)
    return streams


def _finish_undisturbed(streams: list[BackgroundStream], expected: str) -> None:
    for stream in streams:
        stream.join(120)
        assert stream.done and stream.error is None, stream.error
        assert stream.text == expected


def test_with_a_replica_no_request_fails_when_a_volunteer_stops_or_is_idled(ends, expected: str) -> None:
    s, a, c = ends
    r1, r1_id = _middle(s, a, "r1")
    r2, r2_id = _middle(s, a, "r2")
    # Three streams through 10-20 (spread over both replicas); r1 stops mid-generation.
    streams = _streams(a, 3)
    s.signal(r1, signal.SIGTERM)
    stopped = time.monotonic()
    # Its sessions move to r2, so it leaves long before its 30 s drain bound.
    assert _exit_code(r1, 25) == 0, r1.log_tail()
    assert time.monotonic() - stopped < 25
    _finish_undisturbed(streams, expected)

    # The same when an admin parks a peer: the busier replica's sessions move to the other.
    r3, r3_id = _middle(s, a, "r3")
    streams = _streams(a, 3)
    busy, busy_id = max(((r2, r2_id), (r3, r3_id)), key=lambda p: p[0].get("/health")["sessions"]["stage"])
    assert busy.get("/health")["sessions"]["stage"] >= 1
    status, _ = request_json("PATCH", f"{a.url}/admin/nodes/{busy_id}/state", {"state": "idle"},
                             headers={"X-Admin-Token": TOKEN})  # fmt: skip
    assert status == 200
    s.wait(lambda: busy.get("/health")["sessions"]["stage"] == 0, 20, "the idle peer's sessions to move away", busy)
    _finish_undisturbed(streams, expected)
    assert busy.get("/health")["sessions"]["stage"] == 0 and busy.alive()
