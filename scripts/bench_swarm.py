"""What ``./scripts/run`` gives on this machine: the local swarm exactly as ``inclavate swarm``
starts it (its defaults: a lone stream on every core, its decode steps on the cores the
other peers leave, several streams on the cores split evenly
between the peers, f32 on the wire), against llama.cpp alone holding the whole
model at all cores.

For each swarm size in ``--peers`` (default 1, 2, 3; ``./scripts/run`` starts 3): one
stream's decode rate after the first token and its prefill rate (prompt tokens over the time
to the first token), best of ``--rounds``, and the aggregate decode rate of ``--sessions``
streams at once, measured in turns with llama-cpp-python and with the swarm as the command
started it until 2026-12-05 (the cores split evenly for everything, and threads told to
sleep at once at a barrier), so the run shows what that default cost, and with the other
choice of a decode step's threads (``--step-threads``: every core where the default gives
the other peers' hand-offs their cores, one thread where it gives every core), in short
pairs of turns whose median ratio and 95% interval say which is faster, reliably or not:
a day's evidence for the default (docs/ARCHITECTURE.md, "A lone step's thread count").

No target of issue 10 names these figures: they are the default-flags view of the others.
llama.cpp's own RPC split of 3 ran at 0.34x of the whole model on loopback (issue 10's
measurement); ``scripts/bench_chain`` measures the hops at one thread per peer.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from bench_chain import median_interval
from bench_peer import DECODE_PROMPT, FILLER, LlamaBaseline, chat_tokens, concurrent_decode, stream

from api.chat_model import ChatModel
from inclavate.catalog import Catalog
from inclavate.config import inclavate_home
from inclavate.local_swarm import LocalSwarm, PeerProcess, split_cores
from inclavate.store import ModelStore
from inclavate.swarm_cmd import local_peer_args, open_swarm, start_peers


@dataclass
class Best:
    decode: float = 0.0
    prefill: float = 0.0
    sessions: float = 0.0

    def add(self, decode: float, prefill: float, sessions: float = 0.0) -> None:
        self.decode, self.prefill = max(self.decode, decode), max(self.prefill, prefill)
        self.sessions = max(self.sessions, sessions)


@dataclass
class Setup:
    label: str
    entry: PeerProcess
    best: Best = field(default_factory=Best)


def paired_ratios(a: Setup, b: Setup, model: str, pairs: int, tokens: int) -> list[float]:
    """``a``'s decode rate over ``b``'s in ``pairs`` short turns back to back, their order
    alternating: best-of-rounds moved 20% between identical setups on the 2-core VM
    (2026-12-07), and a pair's two turns are a second apart."""
    ratios = []
    for i in range(pairs):
        order = (a, b) if i % 2 == 0 else (b, a)
        rate = {setup.label: stream(setup.entry, model, DECODE_PROMPT, tokens).decode_rate for setup in order}
        ratios.append(rate[a.label] / rate[b.label])
    return ratios


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2:135m")
    parser.add_argument("--peers", default="1,2,3", help="swarm sizes, comma-separated")
    parser.add_argument("--rounds", type=int, default=3, help="rounds in turns per swarm size (best is kept)")
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--prompt-words", type=int, default=300, help="length of the prefill prompt")
    parser.add_argument("--sessions", type=int, default=8, help="streams at once for the aggregate rate")
    parser.add_argument("--session-tokens", type=int, default=48, help="tokens per stream in the aggregate")
    parser.add_argument("--pairs", type=int, default=24,
                        help="short pairs of turns, the swarm and its other --step-threads back to back, for the paired ratio")  # fmt: skip
    parser.add_argument("--pair-tokens", type=int, default=48, help="tokens per turn of a pair")
    args = parser.parse_args()

    home = inclavate_home()
    spec = Catalog.load(home).get(args.model)
    model_path = ModelStore(home).pull(spec).path
    cores = len(os.sched_getaffinity(0))
    prompt = "Summarise this text: " + FILLER * (args.prompt_words // 9)
    n = args.decode_tokens
    print(f"bench_swarm: {spec.model_id}, {cores} cores, load average {os.getloadavg()[0]:.1f} at the start; "
          f"best of {args.rounds} in turns; llama.cpp alone at {cores} threads")  # fmt: skip
    print("reproduce: scripts/bench_swarm")
    chat = ChatModel.load(spec.model_id, model_path)
    decode_tokens, prefill_tokens = chat_tokens(chat, DECODE_PROMPT), chat_tokens(chat, prompt)
    llama = LlamaBaseline(model_path, cores)
    llama_best = Best()
    rows: list[tuple[int, int, list[Setup], list[float]]] = []
    try:
        llama.ask(op="single", tokens=decode_tokens, n=4)
        for peers in (int(p) for p in args.peers.split(",")):
            split = split_cores(peers, cores)
            other_step = split.threads if split.step != split.threads else 1
            with tempfile.TemporaryDirectory() as tmp:
                env = {"INCLAVATE_HOME": str(home)}
                swarms = [open_swarm(Path(tmp) / "now", peers, "f32", env, cores),
                          open_swarm(Path(tmp) / "other", peers, "f32", env, cores, step_threads=other_step),
                          LocalSwarm(Path(tmp) / "before", local_peer_args(split.shared, "f32"), env, colocated=True)]
                labels = [f"now: {split.threads}, steps {split.step}, else {split.shared}",
                          f"--step-threads {other_step}: {split.threads}, else {split.shared}",
                          f"before: {split.shared}, sleeping"]  # fmt: skip
                try:
                    setups = [Setup(label, start_peers(swarm, spec.model_id, spec.n_layers, peers, None)[0])
                              for label, swarm in zip(labels, swarms)]  # fmt: skip
                    for setup in setups:
                        stream(setup.entry, spec.model_id, DECODE_PROMPT, 4)  # warm: weights paged in, template built
                    for _ in range(args.rounds):
                        b = llama.ask(op="single", tokens=decode_tokens, n=n)
                        p = llama.ask(op="single", tokens=prefill_tokens, n=1)
                        llama_best.add((n - 1) / b["decode_s"], p["prompt_tokens"] / p["prefill_s"])
                        for setup in setups:
                            d, s = stream(setup.entry, spec.model_id, DECODE_PROMPT, n), stream(setup.entry, spec.model_id, prompt, 2)
                            many = concurrent_decode(setup.entry, spec.model_id, args.sessions, args.session_tokens)
                            setup.best.add(d.decode_rate, s.prompt_tokens / s.ttft, many)
                    ratios = paired_ratios(setups[0], setups[1], spec.model_id, args.pairs, args.pair_tokens)
                finally:
                    for swarm in swarms:
                        swarm.stop_all()
            rows.append((peers, other_step, setups, ratios))
    finally:
        llama.close()
    print(f"{'peers':>5}  {'threads: 1 session, more':<30}{'decode tok/s':>13}{'prefill tok/s':>14}{'decode/llama':>13}"
          f"{'prefill/llama':>14}{f'{args.sessions} streams tok/s':>18}")  # fmt: skip
    for peers, other_step, setups, _ in rows:
        for setup in setups:
            r = setup.best
            print(f"{peers:>5}  {setup.label:<30}{r.decode:13.1f}{r.prefill:14.1f}{r.decode / llama_best.decode:13.3f}"
                  f"{r.prefill / llama_best.prefill:14.3f}{r.sessions:18.1f}")  # fmt: skip
        now = setups[0].best
        for label, other in ((f"--step-threads {other_step}", setups[1].best), ("before", setups[2].best)):
            print(f"{'':7}now / {label}: decode {now.decode / other.decode:.2f}x, prefill {now.prefill / other.prefill:.2f}x, "
                  f"{args.sessions} streams {now.sessions / other.sessions:.2f}x")  # fmt: skip
    for peers, other_step, _, ratios in rows:
        low, high = median_interval(ratios)
        faster = ("now, reliably" if low > 1 else f"--step-threads {other_step}, reliably" if high < 1
                  else "undecided (the interval straddles 1)")  # fmt: skip
        print(f"{peers:>5}  decode, now / --step-threads {other_step}, {len(ratios)} pairs of {args.pair_tokens}-token turns "
              f"back to back: median {statistics.median(ratios):.3f}, 95% interval {low:.3f} to {high:.3f}; faster: {faster}")  # fmt: skip
    print(f"llama.cpp alone at {cores} threads (best over the whole run): decode {llama_best.decode:.1f} tok/s, "
          f"prefill {llama_best.prefill:.1f} tok/s")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
