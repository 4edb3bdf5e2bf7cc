"""The swarm heals a gap by itself: four real peers on loopback, the only holder of 20-30 is
killed with SIGKILL, one of the two holders of 10-20 moves there, the chain answers again."""

from __future__ import annotations

import signal
import time

import pytest
from reference import whole_model_text
from stream_helpers import BackgroundStream
from swarm import PeerProcess, Swarm, request_json

pytestmark = [pytest.mark.swarm, pytest.mark.slow]
MODEL = "smollm2:135m"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
STORY = [{"role": "user", "content": "Write a long story about a dragon who learns to cook."}]
STORY_TOKENS = 200


def _ranges(peer: PeerProcess) -> dict[str, tuple[int, int, str]]:
    return {n["node_id"]: (n["start_layer"], n["end_layer"], n["state"]) for n in peer.get("/nodes")}


def _chat(peer: PeerProcess) -> str:
    status, body = request_json("POST", peer.url + "/v1/chat/completions",
                                {"model": MODEL, "messages": QUESTION, "max_tokens": 16, "temperature": 0}, timeout=120)  # fmt: skip
    assert status == 200, body
    return str(body["choices"][0]["message"]["content"])


def test_a_replica_moves_into_the_gap_a_killed_peer_left(tmp_path, smollm2, slice_cache) -> None:
    expected = whole_model_text(smollm2, slice_cache, QUESTION, 16)
    with Swarm(tmp_path, extra_args=["--wire-dtype", "f32"]) as s:
        a = s.start("a", "--layers", "0-10")
        b = s.start("b", "--layers", "10-20", bootstrap=a)
        c = s.start("c", "--layers", "10-20", bootstrap=a)
        d = s.start("d", "--layers", "20-30", bootstrap=a)
        ids = {p.name: s.wait_ready(p, timeout=120)["peer_id"] for p in (a, b, c, d)}
        s.wait(lambda: all(st == "Ready" for *_, st in _ranges(a).values()) and len(_ranges(a)) == 4, 20, "four Ready")

        s.signal(d, signal.SIGKILL)
        killed = time.monotonic()
        s.wait(lambda: not a.get("/api/models")[0]["chain_complete"], 20, "the gap to show")
        s.wait(lambda: a.get("/api/models")[0]["chain_complete"], 45, "the swarm to heal the gap")
        healed_s = time.monotonic() - killed
        table = _ranges(a)
        moved = [name for name in ("b", "c") if table[ids[name]][:2] == (20, 30)]
        assert len(moved) == 1, f"exactly one of b, c must move: {table}"
        stayed = "c" if moved == ["b"] else "b"
        assert table[ids[stayed]] == (10, 20, "Ready")
        print(f"kill -9 to chain_complete again: {healed_s:.1f} s")

        assert _chat(a) == expected
        # Settled: nobody moves again (the gap is gone, and healing never rebalances).
        time.sleep(6)
        assert {k: v for k, v in _ranges(a).items() if k != ids["d"]} == {k: v for k, v in table.items() if k != ids["d"]}

        # A volunteer stops the only holder of 20-30 while generations run through it: its
        # draining opens the gap at once, a replica of 10-20 moves there (its own sessions
        # moving to the other replica first), the stopping peer's sessions move to the mover,
        # and it leaves. Nobody's generation fails.
        holder = {"b": b, "c": c}[moved[0]]
        e = s.start("e", "--layers", "10-20", bootstrap=a)
        ids["e"] = s.wait_ready(e, timeout=120)["peer_id"]
        s.wait(lambda: sorted(r[:2] for r in _ranges(a).values() if r[2] == "Ready").count((10, 20)) == 2, 20, "e Ready")
        story = whole_model_text(smollm2, slice_cache, STORY, STORY_TOKENS)
        streams = [BackgroundStream(a, STORY, STORY_TOKENS) for _ in range(2)]
        for stream in streams:
            stream.start()
        for stream in streams:
            stream.wait_chunks(3)
        s.signal(holder, signal.SIGTERM)
        assert holder.process.wait(40) == 0, holder.log_tail()
        for stream in streams:
            stream.join(120)
            assert stream.done and stream.error is None, stream.error
            assert stream.text == story
        s.wait(lambda: a.get("/api/models")[0]["chain_complete"], 20, "the chain complete after the polite stop")
        table = _ranges(a)
        assert [n for n in ("c", "e", "b") if n in ids and table[ids[n]] == (20, 30, "Ready")], table
