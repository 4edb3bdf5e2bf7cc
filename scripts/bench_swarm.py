"""What ``./scripts/run`` gives on this machine: the local swarm exactly as ``inclavate swarm``
starts it (its defaults: the cores split evenly between the peers, f32 on the wire), against
llama.cpp alone holding the whole model at all cores.

For each swarm size in ``--peers`` (default 1, 2, 3; ``./scripts/run`` starts 3): one
stream's decode rate after the first token and its prefill rate (prompt tokens over the time
to the first token), best of ``--rounds``, measured in turns with llama-cpp-python. Where the
split gives a peer two threads or more, the same swarm with every peer sleeping at once at a
barrier (``INCLAVATE_COLOCATED=1``, the swarm's default until 2026-12-05) runs in turns too,
so the run shows what that default cost.

No target of issue 10 names these figures: they are the default-flags view of the others. One
stream through a chain computes at one stage at a time, so a swarm of N peers gets about the
speed of llama.cpp at cores/N threads, less the hops (``scripts/bench_chain``); llama.cpp's
own RPC split of 3 ran at 0.34x of the whole model on loopback (issue 10's measurement).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from bench_peer import DECODE_PROMPT, FILLER, LlamaBaseline, stream

from inclavate.catalog import Catalog
from inclavate.config import inclavate_home
from inclavate.local_swarm import LocalSwarm, PeerProcess, split_cores
from inclavate.store import ModelStore
from inclavate.swarm_cmd import open_swarm, start_peers
from node import COLOCATED_ENV


@dataclass
class Best:
    decode: float = 0.0
    prefill: float = 0.0

    def add(self, decode: float, prefill: float) -> None:
        self.decode, self.prefill = max(self.decode, decode), max(self.prefill, prefill)


@dataclass
class Setup:
    label: str
    entry: PeerProcess
    best: Best = field(default_factory=Best)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2:135m")
    parser.add_argument("--peers", default="1,2,3", help="swarm sizes, comma-separated")
    parser.add_argument("--rounds", type=int, default=3, help="rounds in turns per swarm size (best is kept)")
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--prompt-words", type=int, default=300, help="length of the prefill prompt")
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
    llama = LlamaBaseline(model_path, cores)
    llama_best = Best()
    rows: list[tuple[int, int, list[Setup]]] = []
    try:
        llama.ask(op="single", prompt=DECODE_PROMPT, n=4)
        for peers in (int(p) for p in args.peers.split(",")):
            split = split_cores(peers, cores)
            with tempfile.TemporaryDirectory() as tmp:
                swarms: list[LocalSwarm] = []
                try:
                    setups = []
                    now = open_swarm(Path(tmp) / "now", peers, "f32", {"INCLAVATE_HOME": str(home)}, cores)
                    swarms.append(now)
                    wait = "sleep at once" if split.oversubscribed else "spin a while (now)"
                    setups.append(Setup(wait if split.threads > 1 else "no barriers (1 thread)",
                                        start_peers(now, spec.model_id, spec.n_layers, peers, None)[0]))  # fmt: skip
                    if split.threads > 1 and not split.oversubscribed:
                        before = open_swarm(Path(tmp) / "before", peers, "f32",
                                            {"INCLAVATE_HOME": str(home), COLOCATED_ENV: "1"}, cores)  # fmt: skip
                        swarms.append(before)
                        setups.append(Setup("sleep at once (before)", start_peers(before, spec.model_id, spec.n_layers, peers, None)[0]))
                    for setup in setups:
                        stream(setup.entry, spec.model_id, DECODE_PROMPT, 4)  # warm: weights paged in, template built
                    for _ in range(args.rounds):
                        b = llama.ask(op="single", prompt=DECODE_PROMPT, n=n)
                        p = llama.ask(op="single", prompt=prompt, n=1)
                        llama_best.add((n - 1) / b["decode_s"], p["prompt_tokens"] / p["prefill_s"])
                        for setup in setups:
                            d, s = stream(setup.entry, spec.model_id, DECODE_PROMPT, n), stream(setup.entry, spec.model_id, prompt, 2)
                            setup.best.add(d.decode_rate, s.prompt_tokens / s.ttft)
                finally:
                    for swarm in swarms:
                        swarm.stop_all()
            rows.append((peers, split.threads, setups))
    finally:
        llama.close()
    print(f"{'peers':>5}{'threads':>8}  {'threads wait':<22}{'decode tok/s':>13}{'prefill tok/s':>14}{'decode/llama':>13}"
          f"{'prefill/llama':>14}")  # fmt: skip
    for peers, threads, setups in rows:
        for setup in setups:
            r = setup.best
            print(f"{peers:>5}{threads:>8}  {setup.label:<22}{r.decode:13.1f}{r.prefill:14.1f}"
                  f"{r.decode / llama_best.decode:13.3f}{r.prefill / llama_best.prefill:14.3f}")  # fmt: skip
        if len(setups) == 2:
            print(f"{'':15}spinning a while / sleeping at once: decode {setups[0].best.decode / setups[1].best.decode:.2f}x, "
                  f"prefill {setups[0].best.prefill / setups[1].best.prefill:.2f}x")  # fmt: skip
    print(f"llama.cpp alone at {cores} threads (best over the whole run): decode {llama_best.decode:.1f} tok/s, "
          f"prefill {llama_best.prefill:.1f} tok/s")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
