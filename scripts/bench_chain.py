"""Speed of a 3-peer loopback chain (separate processes, libp2p) against the whole model.

Both sides are measured through the same peer API and generation loop, in one run on the
same machine: a single peer holding all layers (one process) is the baseline, the chain is
three peers holding a third each. Decode rate is the streamed token rate after the first
token; prefill rate is prompt tokens over the time to the first token. Each peer runs its
engine on the same thread count, so the ratio isolates what the chain costs.

The script is a list of sections (``SECTIONS``), each starting its own peers and returning
its figures against their targets; ``--sections`` runs a subset.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inclavate.catalog import Catalog
from inclavate.config import inclavate_home
from inclavate.generate_cmd import split_evenly
from inclavate.local_swarm import LocalSwarm, PeerProcess
from inclavate.store import ModelStore

TARGET_DECODE, TARGET_PREFILL = 0.85, 0.90
TARGET_HOP_MS = 0.5


def stream(peer: PeerProcess, model: str, prompt: str, max_tokens: int) -> tuple[float, float, int, int]:
    """(seconds to first token, seconds for the rest, completion tokens, prompt tokens)."""
    body = {
        "model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
        "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
        # A stop that never occurs keeps SmolLM2 from ending early and skewing the count.
    }  # fmt: skip
    req = urllib.request.Request(peer.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})  # fmt: skip
    start = time.perf_counter()
    first = last = None
    usage = {}
    with urllib.request.urlopen(req, timeout=600) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                now = time.perf_counter()
                first = first or now
                last = now
    assert first is not None and last is not None, "no tokens streamed"
    return first - start, last - first, usage["completion_tokens"], usage["prompt_tokens"]


def measure(peer: PeerProcess, model: str, prompt: str, n: int, rounds: int) -> tuple[float, float]:
    """Best prefill and decode tokens/s over ``rounds``."""
    best_prefill = best_decode = 0.0
    for _ in range(rounds):
        ttft, rest, completion, prompt_tokens = stream(peer, model, prompt, n)
        best_prefill = max(best_prefill, prompt_tokens / ttft)
        best_decode = max(best_decode, (completion - 1) / rest)
    return best_prefill, best_decode


@dataclass(frozen=True)
class Verdict:
    """One figure against its target."""

    name: str
    value: float
    target: float
    higher_is_better: bool = True

    @property
    def met(self) -> bool:
        return self.value >= self.target if self.higher_is_better else self.value <= self.target

    def line(self) -> str:
        op = ">=" if self.higher_is_better else "<="
        return f"{self.name}: {self.value:.3f} (target {op} {self.target}): {'met' if self.met else 'NOT met'}"


@dataclass
class Bench:
    """What every section needs: arguments, the model, and a way to start peers."""

    args: argparse.Namespace
    home: Path
    spec: Any
    workdir: Path
    prompt: str
    short: str = "Write a long story about a dragon who learns to cook."

    def swarm(self) -> LocalSwarm:
        common = ["--p2p-host", "127.0.0.1", "--no-mdns", "--threads", str(self.args.threads),
                  "--wire-dtype", self.args.wire_dtype, "--context", "2048", "--max-sessions", "2"]  # fmt: skip
        return LocalSwarm(Path(tempfile.mkdtemp(dir=self.workdir)), common, {"INCLAVATE_HOME": str(self.home)})

    def start_whole(self, swarm: LocalSwarm) -> PeerProcess:
        whole = swarm.start("whole", self.spec.model_id, "--layers", f"0-{self.spec.n_layers}")
        swarm.wait_ready(whole)
        return whole

    def start_chain(self, swarm: LocalSwarm, *extra: str, prefix: str = "") -> PeerProcess:
        """Start a chain of ``--peers`` peers (``extra`` arguments each); returns its entry."""
        ranges = split_evenly(self.spec.n_layers, self.args.peers)
        chain = [swarm.start(f"{prefix}chain-1", self.spec.model_id, "--layers", str(ranges[0]), *extra)]
        chain += [swarm.start(f"{prefix}chain-{i + 1}", self.spec.model_id, "--layers", str(r), *extra, bootstrap=chain[0])
                  for i, r in enumerate(ranges[1:], start=1)]  # fmt: skip
        for peer in chain:
            swarm.wait_ready(peer)
        swarm.wait(lambda: chain[0].get("/api/models")[0]["chain_complete"], 30, "a complete chain")
        return chain[0]

    def decode_cpu_ms(self, entry: PeerProcess, swarm: LocalSwarm) -> dict[str, float]:
        """CPU milliseconds (user + system) each running peer spends per streamed token."""
        peers = [p for p in swarm.peers if p.alive()]
        before = {p.name: process_cpu_s(p.process.pid) for p in peers}
        completion = stream(entry, self.spec.model_id, self.short, self.args.decode_tokens)[2]
        return {p.name: (process_cpu_s(p.process.pid) - before[p.name]) * 1000 / completion for p in peers}

    def idle_cpu_ms_per_s(self, swarm: LocalSwarm, seconds: float = 3.0) -> dict[str, float]:
        """CPU milliseconds per second each running peer spends with no request (gossip,
        heartbeats, pings): part of what every extra process adds on a shared core."""
        peers = [p for p in swarm.peers if p.alive()]
        before = {p.name: process_cpu_s(p.process.pid) for p in peers}
        time.sleep(seconds)
        return {p.name: (process_cpu_s(p.process.pid) - before[p.name]) * 1000 / seconds for p in peers}

    def rates(self, peer: PeerProcess) -> tuple[float, float]:
        """(best prefill tok/s, best decode tok/s) of ``peer``."""
        return (measure(peer, self.spec.model_id, self.prompt, 2, self.args.rounds)[0],
                measure(peer, self.spec.model_id, self.short, self.args.decode_tokens, self.args.rounds)[1])  # fmt: skip


def whole_vs_chain(bench: Bench) -> list[Verdict]:
    """The chain against one peer holding the whole model, each on its own thread count."""
    with bench.swarm() as swarm:
        whole = bench.start_whole(swarm)
        wp, wd = bench.rates(whole)
        swarm.stop(whole)
        cp, cd = bench.rates(bench.start_chain(swarm, *(("--direct-port", "-1") if bench.args.libp2p_only else ())))
    hops = bench.args.peers  # entry -> stage 2 -> ... -> last, and the token back to the entry
    print(f"{'':8}{'prefill tok/s':>15}{'decode tok/s':>15}")
    print(f"{'whole':8}{wp:15.1f}{wd:15.1f}")
    print(f"{'chain':8}{cp:15.1f}{cd:15.1f}")
    print(f"decode step: whole {1000 / wd:.2f} ms, chain {1000 / cd:.2f} ms; "
          f"added latency {max(0.0, (1 / cd - 1 / wd) * 1000 / hops):.2f} ms per hop ({hops} messages per step)")
    return [Verdict("prefill chain/whole", cp / wp, TARGET_PREFILL), Verdict("decode chain/whole", cd / wd, TARGET_DECODE)]


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextmanager
def pinned_to_one_core() -> Iterator[int]:
    """This process and every peer it starts meanwhile (children inherit the mask) on one core."""
    before = os.sched_getaffinity(0)
    core = min(before)
    os.sched_setaffinity(0, {core})
    try:
        yield core
    finally:
        os.sched_setaffinity(0, before)


def pinned_hop_cost(bench: Bench) -> list[Verdict]:
    """Every process on one core: the CPU a hop costs, isolated from the cores it could borrow.

    Per-hop overhead = (chain decode step - whole-peer decode step) / hops: on one core the
    stages' compute adds up to the whole model's, so what is left is what the hops cost. The
    chain runs twice: over the direct data plane (the default) and over libp2p streams only
    (``--direct-port -1``, what every hop cost before)."""
    hops = bench.args.peers
    with pinned_to_one_core() as core, bench.swarm() as swarm:
        whole = bench.start_whole(swarm)
        wp, wd = bench.rates(whole)
        cpu = bench.decode_cpu_ms(whole, swarm)
        swarm.stop(whole)
        print(f"all processes on core {core}; whole: decode {wd:.1f} tok/s ({1000 / wd:.2f} ms/step), "
              f"prefill {wp:.1f} tok/s, CPU {cpu['whole']:.2f} ms/token")
        figures = {}
        for plane, extra in (("direct", ()), ("libp2p", ("--direct-port", "-1"))):
            entry = bench.start_chain(swarm, *extra, prefix=f"{plane}-")
            cp, cd = bench.rates(entry)
            chain_cpu = bench.decode_cpu_ms(entry, swarm)
            idle = bench.idle_cpu_ms_per_s(swarm)
            swarm.stop_all()
            per_hop = (1 / cd - 1 / wd) * 1000 / hops
            figures[plane] = (cp, cd, per_hop)
            print(f"chain over {plane}: decode {cd:.1f} tok/s ({1000 / cd:.2f} ms/step), prefill {cp:.1f} tok/s; "
                  f"per-hop overhead {per_hop:.2f} ms ({hops} messages per step)")
            print(f"  CPU ms/token " + ", ".join(f"{k} {v:.2f}" for k, v in chain_cpu.items())
                  + f": {(sum(chain_cpu.values()) - cpu['whole']) / hops:.2f} more than the whole peer per hop; "
                  f"idle background {', '.join(f'{v:.0f}' for v in idle.values())} ms CPU/s per peer")
    cp, cd, per_hop = figures["direct"]
    return [Verdict("pinned per-hop overhead ms", per_hop, TARGET_HOP_MS, higher_is_better=False),
            Verdict("pinned prefill chain/whole", cp / wp, TARGET_PREFILL),
            Verdict("pinned decode chain/whole", cd / wd, TARGET_DECODE),
            Verdict("pinned decode direct/libp2p (no target)", cd / figures["libp2p"][1], 1.0)]


SECTIONS: dict[str, Callable[[Bench], list[Verdict]]] = {
    "chain": whole_vs_chain,
    "pinned": pinned_hop_cost,
}
"""Each section starts its own peers and returns its figures; ``--sections`` picks some."""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2:135m")
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--prompt-words", type=int, default=300, help="length of the prefill prompt")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="engine threads per peer")
    parser.add_argument("--wire-dtype", default="f16", choices=("f16", "bf16", "f32"))
    parser.add_argument("--libp2p-only", action="store_true",
                        help="the chain section's peers forward over libp2p streams (no direct data plane)")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    args = parser.parse_args()
    chosen = [s for s in args.sections.split(",") if s]
    unknown = set(chosen) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections: {', '.join(sorted(unknown))}")

    home = inclavate_home()
    spec = Catalog.load(home).get(args.model)
    ModelStore(home).pull(spec)
    prompt = "Summarise this text: " + " ".join(["the quick brown fox jumps over the lazy dog"] * (args.prompt_words // 9))
    print(f"model {spec.model_id}: {args.peers}-peer chain vs one peer; {args.threads} engine thread(s) per peer, "
          f"wire {args.wire_dtype}, best of {args.rounds}; load average {os.getloadavg()[0]:.2f}")
    print("reproduce: scripts/bench_chain " + " ".join(sys.argv[1:]))
    verdicts: list[Verdict] = []
    with tempfile.TemporaryDirectory() as tmp:
        bench = Bench(args, home, spec, Path(tmp), prompt)
        for name in chosen:
            print(f"\n== {name}: {SECTIONS[name].__doc__.splitlines()[0]}")
            verdicts += SECTIONS[name](bench)
    print()
    for verdict in verdicts:
        print(verdict.line())
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
