"""Speed of a 3-peer loopback chain (separate processes, libp2p) against the whole model.

Both sides are measured through the same peer API and generation loop, in one run on the
same machine: a single peer holding all layers (one process) is the baseline, the chain is
three peers holding a third each. Both stay up for the whole run and are measured
alternately (whole, chain, whole, ...), so a busy machine slows both alike; each figure is
the best over ``--rounds``. Each peer runs its engine on the same thread count, so the
ratio isolates what the chain costs.

Sections (``--only``/``--skip`` take their names):
- ``single``: one stream. Decode rate is the streamed token rate after the first token;
  prefill rate is prompt tokens over the time to the first token. Targets: decode >= 0.85,
  prefill >= 0.9.
- ``concurrency``: 1, 4 and 8 sessions streaming at once, aggregate decode tok/s while all
  of them stream. Target at 8: chain >= 0.85x the whole peer.
- ``long-prefill``: a ~2,000-token prompt, prompt tokens over the time to the first token.
  Target: chain >= 0.9x the whole peer.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench_peer import FILLER, concurrent_decode, stream

from inclavate.catalog import Catalog, ModelSpec
from inclavate.config import inclavate_home
from inclavate.generate_cmd import split_evenly
from inclavate.local_swarm import LocalSwarm, PeerProcess
from inclavate.store import ModelStore

TARGET_DECODE, TARGET_PREFILL = 0.85, 0.90
TARGET_CONCURRENT, TARGET_LONG_PREFILL = 0.85, 0.90
SHORT_PROMPT = "Write a long story about a dragon who learns to cook."


@dataclass
class Bench:
    """What every section gets: the two sides, up at once, and the run's arguments."""

    args: argparse.Namespace
    spec: ModelSpec
    whole: PeerProcess
    chain: list[PeerProcess]
    """The chain's peers in route order: requests to the first go through every stage."""

    @property
    def entry(self) -> PeerProcess:
        return self.chain[0]

    def sides(self) -> tuple[tuple[str, PeerProcess], ...]:
        return (("whole", self.whole), ("chain", self.entry))


def verdict(ratio: float, target: float) -> str:
    return f"ratio {ratio:.3f}, target >= {target}: {'met' if ratio >= target else 'NOT met'}"


def best_of(bench: Bench, measure: Callable[[PeerProcess], float]) -> dict[str, float]:
    """Best figure of each side over the rounds, the sides alternating."""
    best = {"whole": 0.0, "chain": 0.0}
    for _ in range(bench.args.rounds):
        for name, peer in bench.sides():
            best[name] = max(best[name], measure(peer))
    return best


def prefill_rate(bench: Bench, prompt: str) -> Callable[[PeerProcess], float]:
    def measure(peer: PeerProcess) -> float:
        s = stream(peer, bench.spec.model_id, prompt, 1)
        return s.prompt_tokens / s.ttft

    return measure


def section_single(bench: Bench) -> None:
    """One stream: decode and prefill rates, and the latency each hop adds to a step."""
    args = bench.args
    prompt = "Summarise this text: " + FILLER * (args.prompt_words // 9)
    prefill = best_of(bench, prefill_rate(bench, prompt))
    decode = best_of(bench, lambda p: stream(p, bench.spec.model_id, SHORT_PROMPT, args.decode_tokens).decode_rate)
    (wp, cp), (wd, cd) = (prefill["whole"], prefill["chain"]), (decode["whole"], decode["chain"])
    hops = args.peers  # entry -> stage 2 -> ... -> last, and the token back to the entry
    per_hop_ms = max(0.0, (1 / cd - 1 / wd) * 1000 / hops)
    print(f"\n[single] one stream, {args.prompt_words}-word prefill prompt, {args.decode_tokens} decoded tokens")
    print(f"{'':8}{'prefill tok/s':>15}{'decode tok/s':>15}")
    print(f"{'whole':8}{wp:15.1f}{wd:15.1f}")
    print(f"{'chain':8}{cp:15.1f}{cd:15.1f}")
    print(f"{'ratio':8}{cp / wp:15.3f}{cd / wd:15.3f}")
    print(f"decode step: whole {1000 / wd:.2f} ms, chain {1000 / cd:.2f} ms; "
          f"added latency {per_hop_ms:.2f} ms per hop ({hops} messages per step)")  # fmt: skip
    print(f"decode  {verdict(cd / wd, TARGET_DECODE)}")
    print(f"prefill {verdict(cp / wp, TARGET_PREFILL)}")


def step_batching(peers: list[PeerProcess]) -> list[tuple[int, int]]:
    """(decode-step engine calls, steps they ran) of each peer's stage so far."""
    counts = [p.get("/health").get("batching") or {} for p in peers]
    return [(c.get("step_rounds", 0), c.get("step_jobs", 0)) for c in counts]


def section_concurrency(bench: Bench) -> None:
    """Aggregate decode rate with 1, 4, 8 sessions streaming at once, and how many sessions
    each stage's decode-step calls batched on average (all rounds of that level)."""
    args = bench.args
    peers = [bench.whole, *bench.chain]
    print(f"\n[concurrency] aggregate decode tok/s while every session streams ({args.concurrent_tokens} tokens each)")
    print(f"{'sessions':>8}{'whole':>10}{'chain':>10}{'ratio':>9}   mean sessions per step call: whole | chain stages")
    ratio = 0.0
    for sessions in args.sessions:
        before = step_batching(peers)
        best = best_of(bench, lambda p: concurrent_decode(p, bench.spec.model_id, sessions, args.concurrent_tokens))
        after = step_batching(peers)
        means = [(j1 - j0) / max(1, r1 - r0) for (r0, j0), (r1, j1) in zip(before, after)]
        ratio = best["chain"] / best["whole"]
        print(f"{sessions:>8}{best['whole']:10.1f}{best['chain']:10.1f}{ratio:9.3f}   "
              f"{means[0]:.2f} | {' '.join(f'{m:.2f}' for m in means[1:])}")  # fmt: skip
    print(f"{args.sessions[-1]} sessions: {verdict(ratio, TARGET_CONCURRENT)}")


def section_long_prefill(bench: Bench) -> None:
    """Prefill of a ~2,000-token prompt: the entry's chunks pipeline across the stages."""
    prompt = "Summarise: " + FILLER * (bench.args.long_prompt_tokens // 9)
    best = best_of(bench, prefill_rate(bench, prompt))
    ratio = best["chain"] / best["whole"]
    print(f"\n[long-prefill] ~{bench.args.long_prompt_tokens}-token prompt, prompt tok/s to the first token")
    print(f"whole {best['whole']:.1f}, chain {best['chain']:.1f}: {verdict(ratio, TARGET_LONG_PREFILL)}")


SECTIONS: dict[str, Callable[[Bench], None]] = {
    "single": section_single,
    "concurrency": section_concurrency,
    "long-prefill": section_long_prefill,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2:135m")
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--prompt-words", type=int, default=300, help="length of the prefill prompt")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="engine threads per peer")
    parser.add_argument("--wire-dtype", default="f16", choices=("f16", "bf16", "f32"))
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 4, 8], help="concurrency levels")
    parser.add_argument("--concurrent-tokens", type=int, default=48, help="tokens per session, concurrency")
    parser.add_argument("--long-prompt-tokens", type=int, default=2000)
    parser.add_argument("--only", action="append", choices=tuple(SECTIONS), help="run only these sections")
    parser.add_argument("--skip", action="append", default=[], choices=tuple(SECTIONS))
    parser.add_argument("--peer-arg", action="append", default=[], help="extra argument for every peer")
    args = parser.parse_args()
    sections = [name for name in (args.only or SECTIONS) if name not in args.skip]

    home = inclavate_home()
    spec = Catalog.load(home).get(args.model)
    ModelStore(home).pull(spec)
    common = ["--p2p-host", "127.0.0.1", "--no-mdns", "--threads", str(args.threads), "--wire-dtype", args.wire_dtype,
              "--context", "2048", "--max-sessions", str(max(args.sessions)), *args.peer_arg]  # fmt: skip
    ranges = split_evenly(spec.n_layers, args.peers)
    print(f"model {spec.model_id}: {args.peers}-peer chain {' '.join(map(str, ranges))} vs one peer; "
          f"{args.threads} engine thread(s) per peer, wire {args.wire_dtype}, best of {args.rounds}, alternating; "
          f"{len(os.sched_getaffinity(0))} cores, load average {os.getloadavg()[0]:.1f} at start")  # fmt: skip
    print("reproduce: scripts/bench_chain " + shlex.join(sys.argv[1:]))
    with tempfile.TemporaryDirectory() as tmp, LocalSwarm(Path(tmp), common, {"INCLAVATE_HOME": str(home)}) as swarm:
        # Two separate swarms: the whole peer has no bootstrap, so the chain never routes through it.
        whole = swarm.start("whole", spec.model_id, "--layers", f"0-{spec.n_layers}")
        chain = [swarm.start("chain-1", spec.model_id, "--layers", str(ranges[0]))]
        chain += [swarm.start(f"chain-{i + 1}", spec.model_id, "--layers", str(r), bootstrap=chain[0])
                  for i, r in enumerate(ranges[1:], start=1)]  # fmt: skip
        for peer in (whole, *chain):
            swarm.wait_ready(peer)
        swarm.wait(lambda: chain[0].get("/api/models")[0]["chain_complete"], 30, "a complete chain")
        bench = Bench(args, spec, whole, chain)
        for peer in (whole, chain[0]):
            stream(peer, spec.model_id, SHORT_PROMPT, 4)  # warm up
        for name in sections:
            SECTIONS[name](bench)
    print(f"\nload average {os.getloadavg()[0]:.1f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
