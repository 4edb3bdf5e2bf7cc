"""What a peer's death costs a client: the stall of a failover, on a real loopback swarm.

Peers A 0-10 (the entry), B and C 10-20 (replicas), D 20-30, as separate processes. Each
stream's prompt is long enough that the session holds ``--context-tokens`` positions when
the middle hop carrying it is killed with SIGKILL; the entry re-routes to the replica and
rebuilds the session there. Measured twice, in two fresh swarms one after the other: with
the default *span replay* (A and D keep their caches; A re-sends its kept outputs into C)
and with the entry forced to replay the whole route (``--failover-replay whole``).
Reported for each:

- **stall**: the longest gap between two tokens of a stream across the kill (target <= 2 s,
  for the default);
- **total**: the disturbed generation's time against the same request undisturbed;
- **identical**: whether the disturbed text equals the undisturbed one;

and once:

- **replay cost**, in-process: the context through the whole route against the 10-layer
  span alone, and what the kept outputs hold per session;

- **whole again**: seconds from ``kill -9`` of the only holder of a span to
  ``chain_complete`` again, healed by a spare replica moving there (target <= 30 s).
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from inclavate.catalog import Catalog
from inclavate.chat_stream import StreamedChat, stream_chat
from inclavate.config import inclavate_home
from inclavate.local_swarm import LocalSwarm, PeerProcess
from inclavate.store import ModelStore
from inclavate.types import LayerRange, ModelId, SessionId
from node.engine import BatchItem, EngineConfig
from node.llamacpp_engine import LlamaCppEngine
from node.tokenizer import Tokenizer
from p2p.failover import replay_plan

TARGET_STALL_S = 2.0
TARGET_HEALED_S = 30.0
PREFILL_CHUNK = 256


def prompt_of(tokenizer: Tokenizer, tokens: int) -> str:
    """A user message whose chat-templated prompt is about ``tokens`` long."""
    words = "the quick brown fox jumps over the lazy dog and"
    text = "Continue this story: "
    while len(tokenizer.tokenize(text)) < tokens - 30:
        text += words + " "
    return text


def body(model: str, prompt: str, max_tokens: int) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0}


def run_streams(entry: PeerProcess, bodies: list[dict], kill_after: int | None, victims: list[PeerProcess]) -> list[StreamedChat]:
    """Stream all at once; with ``kill_after``, SIGKILL the busiest victim once every stream
    has that many tokens."""
    progressed: set[int] = set()
    ready = threading.Event()

    def on_delta(chat: StreamedChat) -> None:
        if kill_after is not None and len(chat.times) >= kill_after:
            progressed.add(id(chat))
            if len(progressed) == len(bodies):
                ready.set()

    with ThreadPoolExecutor(len(bodies)) as pool:
        futures = [pool.submit(stream_chat, entry.url, b, 600, on_delta) for b in bodies]
        if kill_after is not None:
            if not ready.wait(600):
                raise RuntimeError("the streams did not reach the kill point")
            victim = max((v for v in victims if v.alive()), key=lambda v: v.get("/health")["sessions"]["stage"])
            victim.process.send_signal(signal.SIGKILL)
            victim.process.wait(10)
            print(f"killed {victim.name} (SIGKILL) with every stream {kill_after} tokens in")
        return [f.result() for f in futures]


def measure_heal(swarm: LocalSwarm, entry: PeerProcess, last: PeerProcess, model_id: str) -> float:
    """Seconds from ``kill -9`` of ``last``, the only holder of 20-30, to ``chain_complete``
    again: a new peer joins 10-20 beside the replica that survived, so one of the two is
    spare and moves to the gap (``scripts/bench_heal`` measures healing in more detail)."""
    spare = swarm.start("e", model_id, "--layers", "10-20", bootstrap=entry)
    swarm.wait_ready(spare)
    swarm.wait(lambda: sum((n["start_layer"], n["state"]) == (10, "Ready") for n in entry.get("/nodes")) == 2, 30,
               "two Ready holders of 10-20")  # fmt: skip
    last.process.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    swarm.wait(lambda: not entry.get("/api/models")[0]["chain_complete"], 30, "the gap to show")
    swarm.wait(lambda: entry.get("/api/models")[0]["chain_complete"], 120, "the swarm to heal the gap")
    return time.monotonic() - killed


def replay_costs(model_path: Path, model_id: str, context: int, slices: Path) -> tuple[float, float]:
    """Seconds to replay ``context`` positions (prompt chunks, then decode steps coalesced)
    through all 30 layers and through the 10-layer span alone, in this process."""
    prompt_len = context - 64
    shapes = [min(PREFILL_CHUNK, prompt_len - p) for p in range(0, prompt_len, PREFILL_CHUNK)] + [1] * 64
    frames = replay_plan(shapes)
    tokens = np.random.default_rng(0).integers(100, 40000, size=context).astype(np.int32)
    config = EngineConfig(n_threads=1, context_length=context + 8, max_sessions=1)
    ranges = [LayerRange(0, 10), LayerRange(10, 20), LayerRange(20, 30)]
    engines = [LlamaCppEngine(model_id=ModelId(model_id), model_path=model_path, layers=r, config=config, slice_cache=slices)
               for r in ranges]  # fmt: skip
    try:
        whole = span = float("inf")
        for _ in range(2):
            sid = SessionId("replay")
            started, span_s = time.perf_counter(), 0.0
            for start, n in frames:
                items = [BatchItem(sid, start, tokens=tokens[start : start + n])]
                for engine in engines:
                    t0 = time.perf_counter()
                    (out,) = engine.forward(items)
                    if engine.info.layers == ranges[1]:
                        span_s += time.perf_counter() - t0
                    if out.hidden is not None:
                        items = [BatchItem(sid, start, hidden=out.hidden)]
            whole, span = min(whole, time.perf_counter() - started), min(span, span_s)
            for engine in engines:
                engine.close_session(sid)
        return whole, span
    finally:
        for engine in engines:
            engine.close()


def measure_failover(args: argparse.Namespace, home: Path, model_id: str, bodies: list[dict], kill_after: int,
                     replay: str, heal: bool) -> tuple[list[StreamedChat], list[StreamedChat], float | None]:  # fmt: skip
    """Undisturbed and disturbed streams in a fresh swarm whose entry replays ``replay``;
    with ``heal``, then the time until the swarm is whole again."""
    common = ["--p2p-host", "127.0.0.1", "--no-mdns", "--threads", str(args.threads), "--wire-dtype", args.wire_dtype,
              "--context", "2048", "--max-sessions", str(max(2, args.streams))]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp, LocalSwarm(Path(tmp), common, {"INCLAVATE_HOME": str(home)}) as swarm:
        a = swarm.start("a", model_id, "--layers", "0-10", "--failover-replay", replay)
        b, c, d = (swarm.start(n, model_id, "--layers", r, bootstrap=a) for n, r in (("b", "10-20"), ("c", "10-20"), ("d", "20-30")))
        for peer in (a, b, c, d):
            swarm.wait_ready(peer)
        swarm.wait(lambda: a.get("/api/models")[0]["chain_complete"] and len(a.get("/nodes")) == 4, 30, "the swarm")
        run_streams(a, bodies, None, [])  # warm-up: connections, slices in the page cache
        calm = run_streams(a, bodies, None, [])
        disturbed = run_streams(a, bodies, kill_after, [b, c])
        kept = sum(p.get("/health")["failover"]["adopted"] for p in (a, d))
        print(f"[{replay} replay] sessions kept by the entry and the last stage across the failover: {kept}")
        for line in a.log_path.read_text(errors="replace").splitlines():
            if "failover" in line or "link to" in line:  # the entry's timeline of the failover
                print(f"[{replay} replay] entry log: {line}")
        healed = measure_heal(swarm, a, d, model_id) if heal else None
    return calm, disturbed, healed


def report(replay: str, calm: list[StreamedChat], disturbed: list[StreamedChat]) -> tuple[float, bool]:
    calm_total = max(ch.total for ch in calm)
    hurt_total = max(ch.total for ch in disturbed)
    stall = max(ch.longest_gap for ch in disturbed)
    normal_gap = max(ch.longest_gap for ch in calm)
    ttft = max(ch.times[0] - ch.started for ch in calm)
    same = [ch.text for ch in disturbed] == [ch.text for ch in calm] and all(ch.error is None for ch in disturbed)
    print(f"[{replay} replay] stall: longest gap {stall:.2f} s across the kill (undisturbed: longest gap "
          f"{normal_gap:.2f} s, first token after {ttft:.2f} s, which includes the prefill); "
          f"stall / first token {stall / ttft:.2f}; total disturbed/undisturbed {hurt_total:.2f}/{calm_total:.2f} s "
          f"= {hurt_total / calm_total:.2f}; identical text: {'yes' if same else 'NO'}")  # fmt: skip
    return stall, same


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2:135m")
    parser.add_argument("--context-tokens", type=int, default=512, help="positions a session holds when its hop dies")
    parser.add_argument("--decode-tokens", type=int, default=64, help="tokens generated per stream")
    parser.add_argument("--streams", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="engine threads per peer")
    parser.add_argument("--wire-dtype", default="f32", choices=("f16", "bf16", "f32"))
    args = parser.parse_args()

    home = inclavate_home()
    spec = Catalog.load(home).get(args.model)
    path = ModelStore(home).pull(spec).path
    kill_after = args.decode_tokens // 4
    with Tokenizer(path) as tok:
        prompt = prompt_of(tok, args.context_tokens - kill_after)
    bodies = [body(spec.model_id, prompt, args.decode_tokens)] * args.streams
    print(f"command: INCLAVATE_HOME={home} scripts/bench_failover " + " ".join(sys.argv[1:]))
    span = measure_failover(args, home, spec.model_id, bodies, kill_after, "span", heal=True)
    whole = measure_failover(args, home, spec.model_id, bodies, kill_after, "whole", heal=False)
    replay_whole, replay_span = replay_costs(path, spec.model_id, args.context_tokens, home / "slices")

    print(f"model {spec.model_id}: A 0-10 (entry), B/C 10-20, D 20-30; {args.streams} stream(s), "
          f"{args.context_tokens}-token context at the kill, wire {args.wire_dtype}, {args.threads} thread(s) per peer")  # fmt: skip
    stall, same = report("span", span[0], span[1])
    stall_whole, _ = report("whole", whole[0], whole[1])
    print(f"stall span / whole route: {stall / stall_whole:.2f} (in two swarms one after the other; a ratio "
          f"holds on a loaded machine, where seconds do not)")  # fmt: skip
    healed = span[2]
    assert healed is not None
    print(f"time until whole again: {healed:.1f} s from kill -9 of the only holder of 20-30 to chain_complete "
          f"(target <= {TARGET_HEALED_S:g} s: {'met' if healed <= TARGET_HEALED_S else 'NOT met'})")
    d_model, nbytes = spec.d_model, 2 if args.wire_dtype != "f32" else 4
    print(f"replay of {args.context_tokens} positions in-process: whole route {replay_whole:.2f} s, "
          f"the 10-layer span alone {replay_span:.2f} s (ratio {replay_span / replay_whole:.2f})")  # fmt: skip
    print(f"kept outputs: each stage before the last holds {args.context_tokens * d_model * nbytes / 1e6:.1f} MB "
          f"per session at this context, no extra bytes on the wire")  # fmt: skip
    met = stall <= TARGET_STALL_S and same
    print(f"target: stall <= {TARGET_STALL_S:g} s with identical text (span replay): {'met' if met else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
