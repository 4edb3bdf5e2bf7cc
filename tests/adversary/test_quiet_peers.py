"""A peer that holds layers and plays by the wire format, but misbehaves quietly: it takes
frames and drops them, delays them, or refuses them. It is the real peer with one method
replaced (``quiet_peer/sitecustomize.py``), so its record, pings and links are honest.

The swarm: ``a`` (the entry, 0-10), ``c`` (10-15), ``f`` (15-20) and ``b`` (20-30), honest;
the quiet peer joins holding a range that makes it the cheapest route from ``a`` (fewer
hops). Every test checks that the entry's users get their answer and that new requests go
round the quiet peer."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from live_swarm import MAX_TOKENS, QUESTION, chat
from reference import whole_model_text
from swarm import PeerProcess, Swarm

pytestmark = [pytest.mark.swarm, pytest.mark.slow]
QUIET_PEER = Path(__file__).parent / "quiet_peer"


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Swarm, PeerProcess]]:
    with Swarm(tmp_path_factory.mktemp("quiet-peers"), extra_args=["--wire-dtype", "f32"]) as s:
        # Every new session may try the cheapest route (``--trial-share 1``): these tests are
        # about a misbehaving peer that routing picks, and on probation (the default 1/8) a
        # quiet peer new to the entry would get only a share of its sessions.
        a = s.start("a", "--layers", "0-10", "--trial-share", "1")
        others = [s.start(name, "--layers", layers, bootstrap=a) for name, layers in (("c", "10-15"), ("f", "15-20"), ("b", "20-30"))]
        for peer in (a, *others):
            s.wait_ready(peer, timeout=120)
        s.wait(lambda: a.get("/api/models")[0]["chain_complete"], 30, "a complete chain", a)
        assert chat(a)[0] == 200  # the entry has measured its steps: deadlines are at their floor
        yield s, a


@pytest.fixture(scope="module")
def expected(smollm2, slice_cache) -> str:
    return whole_model_text(smollm2, slice_cache, QUESTION, MAX_TOKENS)


def timed_chat(entry: PeerProcess, expected: str) -> float:
    """One chat that must answer the whole model's text; the seconds it took."""
    began = time.monotonic()
    status, body = chat(entry)
    assert status == 200, body
    assert body["choices"][0]["message"]["content"] == expected, body
    return time.monotonic() - began


def quiet_peer(s: Swarm, entry: PeerProcess, name: str, mode: str, layers: str = "0-30") -> PeerProcess:
    path = os.pathsep.join(p for p in (str(QUIET_PEER), os.environ.get("PYTHONPATH", "")) if p)
    quiet = s.start(name, "--layers", layers, bootstrap=entry, env={"PYTHONPATH": path, "QUIET_PEER_MODE": mode})
    s.wait_ready(quiet, timeout=120)
    quiet_id = quiet.get("/health")["peer_id"]
    s.wait(lambda: any(n["node_id"] == quiet_id and n["state"] == "Ready" for n in entry.get("/nodes")), 30,
           "the quiet peer Ready at the entry", entry)  # fmt: skip
    time.sleep(2)  # its link latency measured: routing now prefers it
    return quiet


def test_a_peer_that_swallows_every_frame_is_routed_around(live: tuple[Swarm, PeerProcess], expected: str) -> None:
    """It takes every frame and never answers, but answers pings. The entry blamed nobody
    after a missed deadline (no hop missed a ping), so every failover and every new request
    chose the route through it again: each chat was a 503 after 4 deadlines (20 s)."""
    s, a = live
    quiet = quiet_peer(s, a, "swallower", "drop")
    try:
        assert timed_chat(a, expected) < 15, "more than one deadline"  # one deadline (5 s), then round it
        for _ in range(3):
            assert timed_chat(a, expected) < 4, "a new request went through the quiet peer again"
    finally:
        s.stop(quiet)


def test_a_peer_that_blames_the_hop_after_it_is_routed_around(live: tuple[Swarm, PeerProcess], expected: str) -> None:
    """It holds 10-20 (a route through it has one hop fewer) and answers every frame with
    "the next hop is unreachable", naming ``b``, the only holder of 20-30, alive and well.
    The entry took its word: ``b`` was left out of the failover's routes, and every chat
    was a 503 naming layers 20-30, while a route round the liar existed."""
    s, a = live
    liar = quiet_peer(s, a, "blamer", "blame_next", layers="10-20")
    try:
        for _ in range(4):
            assert timed_chat(a, expected) < 10
    finally:
        s.stop(liar)


def test_a_peer_that_holds_every_step_just_under_the_deadline_is_left(live: tuple[Swarm, PeerProcess],
                                                                     expected: str) -> None:  # fmt: skip
    """It holds 10-20 (one hop fewer than ``c`` + ``f``, its replicas between them) and serves
    every frame 1.5 s late: far under any deadline, and it answers pings. Nothing blamed it:
    every step of the chat took 1.5 s (about 25 s for 16 tokens), its answers raised the
    entry's deadline, and the next chat went through it again. Now the chat moves round it
    after a few such steps, and the next one goes round it from the start."""
    s, a = live
    before = a.log_path.read_text(errors="replace").count("moving off slow peer")
    dawdler = quiet_peer(s, a, "dawdler", "delay:1.5", layers="10-20")
    try:
        for _ in range(4):  # routing prefers the dawdler once the entry's latency round (10 s) measured it
            took = timed_chat(a, expected)
            moves = a.log_path.read_text(errors="replace").count("moving off slow peer") - before
            if moves:
                break
            time.sleep(4)  # this chat went round it, never meeting it: the link was not measured yet
        assert moves == 1, f"{moves} moves off the slow route in {took:.1f} s: no chat met the dawdler\n{a.log_tail()}"
        assert took < 12, f"{took:.1f} s: the chat stayed on the slow peer"
        assert timed_chat(a, expected) < 5, "a new chat went through the slow peer again"
    finally:
        s.stop(dawdler)


def test_a_peer_that_holds_every_step_under_a_second_is_left(live: tuple[Swarm, PeerProcess], expected: str) -> None:
    """It holds the whole model (a route of one hop: the cheapest) and serves every frame 0.6
    s late: each step of a route whose records say ~25 ms a step (8x: 0.2 s) is 25x slower,
    and under the old 1 s floor of ``p2p.pace`` nothing judged it: every step of the chat
    came 0.6 s late and the next chat went through it again. Under the 0.25 s floor the
    session moves off it after its settling steps and three more, and the next chat goes
    round it from the start (no second move). Checked by the entry's log, not by time."""
    s, a = live
    before = a.log_path.read_text(errors="replace").count("moving off slow peer")
    dawdler = quiet_peer(s, a, "sub-second-dawdler", "delay:0.6")
    try:
        took = timed_chat(a, expected)
        moves = a.log_path.read_text(errors="replace").count("moving off slow peer") - before
        assert moves == 1, f"{moves} moves off the slow route in {took:.1f} s: it was not judged slow\n{a.log_tail()}"
        timed_chat(a, expected)
        assert a.log_path.read_text(errors="replace").count("moving off slow peer") - before == 1, \
            "a new chat went through the slow peer again"  # fmt: skip
    finally:
        s.stop(dawdler)


@pytest.mark.parametrize("code", ["session_evicted", "context_full", "invalid_batch"])
def test_a_peer_that_refuses_every_frame_blaming_nobody_is_routed_around(live: tuple[Swarm, PeerProcess], expected: str,
                                                                        code: str) -> None:  # fmt: skip
    """It answers every frame with an error that blames nobody: an eviction (a fair share)
    or the request's own fault. Believed every time, each chat was a 503 (the eviction
    replayed on the same route until the failovers were spent) or the client's error (400,
    503), and every new chat went through it again."""
    s, a = live
    quiet = quiet_peer(s, a, f"refuser-{code}", f"error:{code}")
    try:
        for _ in range(3):
            timed_chat(a, expected)
    finally:
        s.stop(quiet)


def _blamed_lines(entry: PeerProcess, since: int) -> list[str]:
    """The entry's failover lines after the first ``since`` characters of its log."""
    return [line for line in entry.log_path.read_text(errors="replace")[since:].splitlines() if "(blamed:" in line]


@pytest.mark.parametrize("mode", ["nan", "gap"])
def test_a_peer_that_frames_the_hop_after_it_is_blamed_and_routed_around(live: tuple[Swarm, PeerProcess], expected: str,
                                                                        mode: str) -> None:  # fmt: skip
    """It holds 10-20 (one hop fewer than ``c`` + ``f``) and serves every frame, but sends
    ``b`` (20-30, its only holder) input ``b`` must refuse: NaN hidden states, or a position
    past what the session holds there. ``b`` answers ``invalid_batch``, which the entry read
    as the request's fault: ``b`` was blamed, the framer kept in the failover's prefix, and
    every chat was a 503 naming ``b`` (an audit, 2026-12-07). Now the framer is a suspect
    with ``b`` and the only one a route can do without: each chat answers, and the framer
    is blamed."""
    s, a = live
    since = len(a.log_path.read_text(errors="replace"))
    framer = quiet_peer(s, a, f"framer-{mode}", f"frame:{mode}", layers="10-20")
    framer_id = framer.get("/health")["peer_id"]
    try:
        for _ in range(4):  # each chat is bounded (120 s at most, 15 s to pass), and so are the tries
            assert timed_chat(a, expected) < 15
            if _blamed_lines(a, since):
                break
            time.sleep(4)  # this chat went round it: the entry's latency round has not measured it yet
        blamed = _blamed_lines(a, since)
        assert blamed, f"no chat met the framer\n{a.log_tail()}"
        assert all(framer_id[-6:] in line.split("(blamed:")[1] for line in blamed), blamed
        assert not any("client" in line for line in blamed)
        assert timed_chat(a, expected) < 5, "a new chat went through the framer again"
    finally:
        s.stop(framer)
