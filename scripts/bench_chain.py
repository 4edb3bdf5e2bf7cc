"""Speed of a 3-peer loopback chain (separate processes, libp2p) against the whole model.

Both sides are measured through the same peer API and generation loop, in one run on the
same machine: a single peer holding all layers (one process) is the baseline, the chain is
three peers holding a third each. Decode rate is the streamed token rate after the first
token; prefill rate is prompt tokens over the time to the first token. Each peer runs its
engine on the same thread count, so the ratio isolates what the chain costs.

The script is a list of sections (``SECTIONS``), each starting its own peers and returning
its figures against their targets; ``--sections`` runs a subset:
- ``chain``: one stream, decode and prefill rates (targets: decode >= 0.85, prefill >= 0.9),
  and a step's time outside the engine calls, per hop (target <= 0.5 ms): each stage counts
  the seconds of its decode-step calls, so this figure does not move with the engines'
  speed, which on a shared VM moves 10-30% between minutes.
- ``pinned``: every process on one core; per-hop overhead, CPU, and time outside the
  engines (target <= 0.5 ms).
- ``chain`` and ``pinned`` also run the same engines in bare processes (``bench_bare``: a
  whole model and a chain passing raw hidden states over pipes, no peer code), in turns
  with the peers. The bare chain/whole ratio is the floor any chain of processes gets on
  the machine at that moment; the peers' chain against the bare chain is what our code
  costs on top (no targets: figures for reading the others).
- ``transport``: one message between two processes over libp2p, the direct link, plain TCP.
- ``concurrency``: 1, 4 and 8 sessions streaming at once, aggregate decode tok/s and how
  many sessions each stage's step calls batched (target at 8: chain >= 0.85x whole); also a
  chain whose peers run every session's steps in one call (``--decode-lanes 1``, what the
  default lanes are measured against).
- ``long-prefill``: a ~2,000-token prompt, prompt tok/s to the first token (target >= 0.9).
``--cores-apart`` pins each chain peer to a core of its own (round robin) and the whole peer
to ``--threads`` cores, so that the stages compute side by side as on separate machines
(with ``--peers`` up to the machine's cores; e.g. ``--peers 2 --sections concurrency`` on 2
cores).
Setups within a section are measured in turns (whole, chain, whole, ...), best of ``--rounds``
(default 5). The pinned hop's verdict is the median of ``--pairs`` (default 32) short
pairs of turns, a whole peer's and a chain's back to back (their order alternating), each
pair's chain against its own whole peer, with a 95% interval of that median (met reliably,
NOT met reliably, or undecided where it straddles the target); the pairs cross
``--hop-instances`` (default 2) whole peers with as many chains, so that one process's luck
(a few percent faster than its twin for its whole life) is not the verdict: on this VM a
whole peer's rate moves 10-50% between turns seconds apart, so a pair must be as short as
its figure allows and there must be many (five pairs of the rounds' long turns read -0.02
to 1.42 ms for one tree in one hour). The rounds' paired median is printed beside it. The
``chain`` section judges its decode ratio both ways: best of the rounds, and the median of
as many short pairs (one whole peer, one chain) with its interval.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench_bare import BareSetup
from bench_peer import FILLER, concurrent_decode, cpu_s, stream

from inclavate.catalog import Catalog
from inclavate.config import inclavate_home
from inclavate.generate_cmd import split_evenly
from inclavate.local_swarm import LocalSwarm, PeerProcess
from inclavate.store import ModelStore
from node.engine import EngineConfig

TARGET_DECODE, TARGET_PREFILL = 0.85, 0.90
TARGET_HOP_MS = 0.5
HOP_PAIR_TOKENS = 32
"""Tokens of each turn of the pinned hop's pairs: a turn of ~0.3 s, the first token (the
prompt's) not counted."""
CONTEXT = 2048
TARGET_CONCURRENT, TARGET_LONG_PREFILL = 0.85, 0.90


@dataclass(frozen=True)
class Verdict:
    """One figure against its target."""

    name: str
    value: float
    target: float | None
    """None: a figure printed for reading the others (a floor, a comparison)."""
    higher_is_better: bool = True
    interval: tuple[float, float] | None = None
    """A 95% interval of ``value``, where the figure has one: then the line judges it."""

    @property
    def reliability(self) -> str:
        """What the interval says of the target: met or missed by the whole interval, or
        undecided (it straddles the target: the figure sits near its line, or the run was too
        noisy to tell; a rerun on a quiet machine says which)."""
        assert self.interval is not None
        low, high = self.interval
        worst, best = (low, high) if self.higher_is_better else (high, low)
        if self._meets(worst):
            return "met reliably"
        if not self._meets(best):
            return "NOT met, reliably"
        return "undecided: the interval straddles the target (a figure near its line, or a noisy run)"

    @property
    def met(self) -> bool:
        return self.target is None or self._meets(self.value)

    def _meets(self, value: float) -> bool:
        assert self.target is not None
        return value >= self.target if self.higher_is_better else value <= self.target

    def line(self) -> str:
        if self.target is None:
            return f"{self.name}: {self.value:.3f} (no target)"
        op = ">=" if self.higher_is_better else "<="
        if self.interval is not None:
            return f"{self.name}: {self.interval[0]:.3f} to {self.interval[1]:.3f} (target {op} {self.target}): {self.reliability}"
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
                  "--wire-dtype", self.args.wire_dtype, "--context", str(CONTEXT),
                  "--max-sessions", str(self.max_sessions), *self.args.peer_arg]  # fmt: skip
        return LocalSwarm(Path(tempfile.mkdtemp(dir=self.workdir)), common, {"INCLAVATE_HOME": str(self.home)})

    def start_whole(self, swarm: LocalSwarm, name: str = "whole") -> PeerProcess:
        whole = swarm.start(name, self.spec.model_id, "--layers", f"0-{self.spec.n_layers}")
        swarm.wait_ready(whole)
        if self.args.cores_apart:
            pin_threads(whole.process.pid, set(self.cores[: self.args.threads]))
        return whole

    def start_chain(self, swarm: LocalSwarm, *extra: str, prefix: str = "") -> list[PeerProcess]:
        """Start a chain of ``--peers`` peers (``extra`` arguments each); the entry first."""
        chain = swarm.start_chain(self.spec.model_id, split_evenly(self.spec.n_layers, self.args.peers), *extra, prefix=prefix)
        if self.args.cores_apart:
            for i, peer in enumerate(chain):
                pin_threads(peer.process.pid, {self.cores[i % len(self.cores)]})
        return chain

    @property
    def cores(self) -> list[int]:
        return sorted(os.sched_getaffinity(0))

    def interleaved(self, setups: dict[str, list[PeerProcess] | BareSetup]) -> dict[str, Rates]:
        """Each setup's best prefill and decode rate and least decode CPU over :meth:`in_turns`."""
        return best_of(self.in_turns(setups))

    def in_turns(self, setups: dict[str, list[PeerProcess] | BareSetup]) -> list[dict[str, Rates]]:
        """Every setup measured once per round, ``--rounds`` rounds, so a load that changes
        meanwhile touches them all alike; a round's figures can be compared with each other
        (paired). A setup is its peers, the entry first, or bare processes."""
        return [{name: self._bare_rates(setup) if isinstance(setup, BareSetup) else self._peer_rates(setup)
                 for name, setup in setups.items()} for _ in range(self.args.rounds)]  # fmt: skip

    def _peer_rates(self, peers: list[PeerProcess]) -> Rates:
        prefill = stream(peers[0], self.spec.model_id, self.prompt, 2)
        before = sum(process_cpu_s(p.process.pid) for p in peers)
        steps_before = step_batching(peers)
        decode = stream(peers[0], self.spec.model_id, self.short, self.args.decode_tokens)
        cpu_ms = (sum(process_cpu_s(p.process.pid) for p in peers) - before) * 1000 / decode.completion_tokens
        engines_ms = sum((b.seconds - a.seconds) * 1000 / max(1, b.jobs - a.jobs)
                         for a, b in zip(steps_before, step_batching(peers)))  # fmt: skip
        return Rates(prefill.prompt_tokens / prefill.ttft, decode.decode_rate, cpu_ms, 1000 / decode.decode_rate - engines_ms)

    def _bare_rates(self, setup: BareSetup) -> Rates:
        run = setup.run(self.args.decode_tokens)
        return Rates(math.nan, run.decode, run.cpu_ms, run.outside_ms)

    def bare(self, *, chain: bool) -> BareSetup:
        """The floor under the peers: the same engines in bare processes (``bench_bare``)."""
        ranges = split_evenly(self.spec.n_layers, self.args.peers if chain else 1)
        config = EngineConfig(n_threads=self.args.threads, context_length=CONTEXT, max_sessions=self.max_sessions)
        return BareSetup(self.spec.model_id, ModelStore(self.home).pull(self.spec).path, ranges, config)

    @property
    def max_sessions(self) -> int:
        return max(2, *self.args.sessions)

    def idle_cpu_ms_per_s(self, peers: list[PeerProcess], seconds: float = 3.0) -> list[float]:
        """CPU milliseconds per second each peer spends with no request (gossip, heartbeats,
        pings): part of what every extra process adds on a shared core."""
        before = [process_cpu_s(p.process.pid) for p in peers]
        time.sleep(seconds)
        return [(process_cpu_s(p.process.pid) - b) * 1000 / seconds for p, b in zip(peers, before)]


@dataclass(frozen=True)
class Rates:
    prefill: float
    """Prompt tokens per second to the first token."""
    decode: float
    """Streamed tokens per second after the first."""
    cpu_ms: float
    """CPU milliseconds (user + system, all the setup's processes) per streamed token."""
    outside_ms: float
    """A decode step's time outside the engine calls (each stage's own measure of its
    calls, summed): what the peers add around the engines, whatever the engines' speed on
    the machine at that moment (this VM's moves 10-30% between minutes)."""

    @property
    def prefill_text(self) -> str:
        return f"{self.prefill:.1f}" if self.prefill > 0 else "-"  # bare processes measure no prefill


def best_of(rounds: list[dict[str, Rates]]) -> dict[str, Rates]:
    """Each setup's best prefill and decode rate and least CPU and outside time over the rounds."""
    return {name: Rates(max(r[name].prefill for r in rounds), max(r[name].decode for r in rounds),
                        min(r[name].cpu_ms for r in rounds), min(r[name].outside_ms for r in rounds))
            for name in rounds[0]}  # fmt: skip


def whole_vs_chain(bench: Bench) -> list[Verdict]:
    """The chain against one peer holding the whole model, each on its own thread count."""
    with bench.swarm() as swarm, bench.bare(chain=False) as bare_whole, bench.bare(chain=True) as bare_chain:
        whole = [bench.start_whole(swarm)]
        chain = bench.start_chain(swarm, *(("--direct-port", "-1") if bench.args.libp2p_only else ()))
        rates = bench.interleaved({"whole": whole, "chain": chain, "bare-whole": bare_whole, "bare-chain": bare_chain})
        ratios = [chain_rate / whole_rate for whole_rate, chain_rate in paired_rates(bench, [whole], [chain])]
    whole, chain = rates["whole"], rates["chain"]
    hops = bench.args.peers  # entry -> stage 2 -> ... -> last, and the token back to the entry
    print(f"{'':11}{'prefill tok/s':>15}{'decode tok/s':>15}{'step ms':>10}{'outside engines ms':>20}")
    for name, r in rates.items():
        print(f"{name:11}{r.prefill_text:>15}{r.decode:15.1f}{1000 / r.decode:10.2f}{r.outside_ms:20.2f}")
    added = (chain.outside_ms - whole.outside_ms) / hops
    print(f"decode step: whole {1000 / whole.decode:.2f} ms, chain {1000 / chain.decode:.2f} ms; "
          f"added latency {max(0.0, (1 / chain.decode - 1 / whole.decode) * 1000 / hops):.2f} ms per hop ({hops} messages per step); "
          f"outside the engines {added:.2f} ms per hop, the rest is the engines' calls taking longer split across the chain")  # fmt: skip
    print_pairs("decode chain/whole", ratios, 1)
    return [Verdict("prefill chain/whole", chain.prefill / whole.prefill, TARGET_PREFILL),
            Verdict(f"decode chain/whole (best of {bench.args.rounds} rounds)", chain.decode / whole.decode, TARGET_DECODE),
            *interval_verdicts("decode chain/whole", ratios, TARGET_DECODE, higher_is_better=True),
            Verdict("chain per-hop time outside the engines ms", added, TARGET_HOP_MS, higher_is_better=False),
            *floor_verdicts(rates, "chain", hops, "")]  # fmt: skip


def floor_verdicts(rates: dict[str, Rates], chain_name: str, hops: int, prefix: str) -> list[Verdict]:
    """The bare processes' figures (``bench_bare``), and the peer chain's against them.

    The bare chain/whole ratio is what any chain of processes gets on this machine at that
    moment (cold caches after each hand-off, the kernel waking each process); the peers'
    chain against the bare chain is what the peers' own code costs on top."""
    bare_whole, bare_chain, chain = rates["bare-whole"], rates["bare-chain"], rates[chain_name]
    print(f"bare processes (bench_bare: the same engines, no peer code): chain/whole {bare_chain.decode / bare_whole.decode:.3f}, "
          f"{bare_chain.outside_ms / hops:.2f} ms per hop outside the engines; the peers' chain adds "
          f"{(1 / chain.decode - 1 / bare_chain.decode) * 1000 / hops:.2f} ms per hop to the bare chain's step")  # fmt: skip
    return [Verdict(f"{prefix}bare decode chain/whole (the floor on this machine)", bare_chain.decode / bare_whole.decode, None),
            Verdict(f"{prefix}decode chain/bare chain", chain.decode / bare_chain.decode, None)]


def pin_threads(pid: int, cores: set[int]) -> None:
    """Every thread of a running process on ``cores`` (a new thread inherits its creator's)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except OSError:  # the thread ended meanwhile
            pass


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads, from /proc."""
    return cpu_s(Path(f"/proc/{pid}/stat"))


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


def median_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float]:
    """A distribution-free interval holding the median of what ``values`` sample with at
    least ``confidence``: the k-th smallest and k-th largest value for the largest k that the
    binomial(n, 1/2) tails allow. The hop's figures are skewed by slow spells, so no normal
    approximation."""
    ordered, n = sorted(values), len(values)
    k, tail = 0, 0.0  # tail: P(fewer than k+1 of n below the median)
    while True:
        tail += math.comb(n, k) / 2**n
        if 2 * tail > 1 - confidence:
            break
        k += 1
    if k == 0:  # too few values for any interval
        return -math.inf, math.inf
    return ordered[k - 1], ordered[n - k]


def pair_schedule(pairs: int, wholes: int, chains: int) -> list[tuple[int, int, bool]]:
    """``(whole, chain, whole first)`` for each pair: every whole peer against every chain in
    turn, and each combination run whole-first and chain-first alike (over every two cycles
    of the combinations), so neither an instance nor an order leans on the median."""
    combos = [(w, c) for w in range(wholes) for c in range(chains)]
    n = len(combos)
    # The order alternates; with an even count of combinations each would keep its order
    # from cycle to cycle, so the order also flips at every new cycle.
    return [(*combos[i % n], (i + (i // n if n % 2 == 0 else 0)) % 2 == 0) for i in range(pairs)]


def paired_rates(bench: Bench, wholes: list[list[PeerProcess]], chains: list[list[PeerProcess]]) -> list[tuple[float, float]]:
    """``(whole, chain)`` decode rates of ``--pairs`` short pairs of turns, a whole peer's
    and a chain's back to back in alternating order (whichever runs second follows the other's
    caches): each pair compares two turns a fraction of a second apart, where the rounds'
    long turns are seconds apart on a VM whose speed moves 10-50% between them.

    The pairs cycle through every whole peer against every chain given, each combination as
    often whole-first as chain-first: one process can run a few percent faster than its twin
    for as long as it lives (three whole peers of one run: 7.06, 7.19 and 7.30 ms a token),
    ~0.1 ms a hop, so one instance of each would make that luck part of the verdict."""
    pairs = []
    for w, c, whole_first in pair_schedule(bench.args.pairs, len(wholes), len(chains)):
        setups = [wholes[w], chains[c]] if whole_first else [chains[c], wholes[w]]
        rates = [stream(peers[0], bench.spec.model_id, bench.short, HOP_PAIR_TOKENS).decode_rate for peers in setups]
        pairs.append((rates[0], rates[1]) if whole_first else (rates[1], rates[0]))
    return pairs


def interval_verdicts(name: str, figures: list[float], target: float, *, higher_is_better: bool) -> list[Verdict]:
    """The median of the pairs' figures against the target, and its 95% interval judged."""
    median = statistics.median(figures)
    return [Verdict(f"{name} (median of {len(figures)} short pairs of turns)", median, target,
                    higher_is_better=higher_is_better),
            Verdict(f"{name}, the median's 95% interval", median, target, higher_is_better=higher_is_better,
                    interval=median_interval(figures))]  # fmt: skip


def print_pairs(what: str, figures: list[float], instances: int) -> None:
    low, high = median_interval(figures)
    print(f"{len(figures)} pairs of {HOP_PAIR_TOKENS}-token turns, a whole peer and a chain back to back"
          + (f" ({instances} of each, crossed)" if instances > 1 else "") + f": {what} "
          + ", ".join(f"{f:.2f}" for f in figures) + f"; the median's 95% interval {low:.3f} to {high:.3f}")


def pinned_hop_cost(bench: Bench) -> list[Verdict]:
    """Every process on one core: the CPU a hop costs, isolated from the cores it could borrow.

    Per-hop overhead = (chain decode step - whole-peer decode step) / hops: on one core the
    stages' compute adds up to the whole model's, so what is left is what the hops cost. The
    chain runs twice, in turns with the whole peer: over the direct data plane (the default)
    and over libp2p streams only (``--direct-port -1``, what every hop cost before)."""
    hops = bench.args.peers
    with pinned_to_one_core() as core, bench.swarm() as swarm, bench.bare(chain=False) as bare_whole, \
            bench.bare(chain=True) as bare_chain:  # fmt: skip
        peers = {"whole": [bench.start_whole(swarm)],
                 "direct": bench.start_chain(swarm, prefix="direct-"),
                 "libp2p": bench.start_chain(swarm, "--direct-port", "-1", prefix="libp2p-")}  # fmt: skip
        twins = range(2, bench.args.hop_instances + 1)  # for the pairs only: see paired_rates
        wholes = [peers["whole"], *([bench.start_whole(swarm, name=f"whole-{i}")] for i in twins)]
        chains = [peers["direct"], *(bench.start_chain(swarm, prefix=f"direct{i}-") for i in twins)]
        rounds = bench.in_turns({**peers, "bare-whole": bare_whole, "bare-chain": bare_chain})
        pairs = [(1 / chain - 1 / whole) * 1000 / hops for whole, chain in paired_rates(bench, wholes, chains)]
        idle = {name: bench.idle_cpu_ms_per_s(setup) for name, setup in peers.items()}
    rates = best_of(rounds)
    print(f"all processes on core {core}; best of {bench.args.rounds} in turns; idle background CPU per peer "
          + ", ".join(f"{name} {'/'.join(f'{v:.0f}' for v in values)}" for name, values in idle.items()) + " ms/s")
    print(f"{'':11}{'prefill tok/s':>15}{'decode tok/s':>15}{'ms/step':>10}{'CPU ms/token':>14}"
          f"{'hop ms':>8}{'hop CPU ms':>12}{'hop outside engines ms':>24}")
    for name, r in rates.items():
        whole = rates["bare-whole" if name.startswith("bare") else "whole"]  # each chain against its own whole
        hop = (1 / r.decode - 1 / whole.decode) * 1000 / hops
        hop_cpu = (r.cpu_ms - whole.cpu_ms) / hops
        outside = (r.outside_ms - whole.outside_ms) / hops
        extra = f"{hop:8.2f}{hop_cpu:12.2f}{outside:24.2f}" if not name.endswith("whole") else ""
        print(f"{name:11}{r.prefill_text:>15}{r.decode:15.1f}{1000 / r.decode:10.2f}{r.cpu_ms:14.2f}{extra}")
    paired_hop = [(1 / r["direct"].decode - 1 / r["whole"].decode) * 1000 / hops for r in rounds]
    paired_cpu = [(r["direct"].cpu_ms - r["whole"].cpu_ms) / hops for r in rounds]
    whole_rates = [r["whole"].decode for r in rounds]
    spread = max(whole_rates) / min(whole_rates) - 1
    print("each round, whole then direct chain: hop ms " + ", ".join(f"{h:.2f}" for h in paired_hop)
          + "; hop CPU ms " + ", ".join(f"{c:.2f}" for c in paired_cpu)
          + f"; the whole peer's decode {min(whole_rates):.1f}-{max(whole_rates):.1f} tok/s ({spread:.0%} apart"
          + (": above 15%, the machine was not quiet, rerun)" if spread > 0.15 else ")"))
    print_pairs("hop ms (direct chain)", pairs, len(wholes))
    whole, direct = rates["whole"], rates["direct"]
    return [*interval_verdicts("pinned per-hop overhead ms", pairs, TARGET_HOP_MS, higher_is_better=False),
            Verdict(f"pinned per-hop overhead ms (median of {len(rounds)} rounds, each against its own whole-peer turn)",
                    statistics.median(paired_hop), None),
            Verdict("pinned per-hop overhead ms (best chain turn against best whole turn)",
                    (1 / direct.decode - 1 / whole.decode) * 1000 / hops, None),
            Verdict("pinned per-hop time outside the engines ms", (direct.outside_ms - whole.outside_ms) / hops,
                    TARGET_HOP_MS, higher_is_better=False),
            Verdict(f"pinned per-hop CPU ms (median of {len(rounds)} rounds)", statistics.median(paired_cpu),
                    TARGET_HOP_MS, higher_is_better=False),
            Verdict("pinned prefill chain/whole", direct.prefill / whole.prefill, TARGET_PREFILL),
            Verdict("pinned decode chain/whole", direct.decode / whole.decode, TARGET_DECODE),
            Verdict("pinned decode direct/libp2p (must not be slower)", direct.decode / rates["libp2p"].decode, 1.0),
            *floor_verdicts(rates, "direct", hops, "pinned ")]  # fmt: skip


def transport_cost(bench: Bench) -> list[Verdict]:
    """One message between two processes on one core, no model: libp2p, direct, plain TCP."""
    import bench_transport  # beside this script

    best = bench_transport.measure()
    for kind, (rtt, cpu) in best.items():
        print(f"{kind:8} round trip {rtt:.3f} ms, client CPU {cpu:.3f} ms per round trip (a message each way)")
    return [Verdict("direct message ms (half a round trip)", best["direct"][0] / 2, TARGET_HOP_MS, higher_is_better=False),
            Verdict("libp2p/direct round trip", best["libp2p"][0] / best["direct"][0], None)]  # fmt: skip


def best_in_turns(bench: Bench, setups: dict[str, PeerProcess], measure: Callable[[PeerProcess], float]) -> dict[str, float]:
    """Each setup's best figure over ``--rounds``, the setups measured in turns."""
    best = dict.fromkeys(setups, 0.0)
    for _ in range(bench.args.rounds):
        for name, entry in setups.items():
            best[name] = max(best[name], measure(entry))
    return best


@dataclass(frozen=True)
class StepCounts:
    """A stage's decode-step engine calls so far: calls, the steps they ran, their seconds."""

    rounds: int
    jobs: int
    seconds: float


def step_batching(peers: list[PeerProcess]) -> list[StepCounts]:
    counts = [p.get("/health").get("batching") or {} for p in peers]
    return [StepCounts(c.get("step_rounds", 0), c.get("step_jobs", 0), c.get("step_seconds", 0.0)) for c in counts]


def concurrency(bench: Bench) -> list[Verdict]:
    """Aggregate decode rate with 1, 4, 8 sessions streaming at once, and how many sessions
    each stage's decode-step calls batched on average (all rounds of that level). The chain
    runs at default flags (two lanes of decode steps, ``node.stage``) and, in turns with it,
    with one lane (every session's step in one call per stage)."""
    args = bench.args
    with bench.swarm() as swarm:
        whole, chain = bench.start_whole(swarm), bench.start_chain(swarm)
        one_lane = bench.start_chain(swarm, "--decode-lanes", "1", prefix="one-lane-")
        peers = [whole, *chain, *one_lane]
        print(f"aggregate decode tok/s while every session streams ({args.concurrent_tokens} tokens each)")
        print(f"{'sessions':>8}{'whole':>10}{'chain':>10}{'1 lane':>10}{'ratio':>9}{'1 lane':>9}"
              "   mean sessions per step call: whole | chain stages | 1-lane chain stages")  # fmt: skip
        ratio = 0.0
        for sessions in args.sessions:
            before = step_batching(peers)
            best = best_in_turns(bench, {"whole": whole, "chain": chain[0], "one_lane": one_lane[0]},
                                 lambda p: concurrent_decode(p, bench.spec.model_id, sessions, args.concurrent_tokens))  # fmt: skip
            after = step_batching(peers)
            means = [f"{(b.jobs - a.jobs) / max(1, b.rounds - a.rounds):.2f}" for a, b in zip(before, after)]
            ratio = best["chain"] / best["whole"]
            stages = 1 + len(chain)
            print(f"{sessions:>8}{best['whole']:10.1f}{best['chain']:10.1f}{best['one_lane']:10.1f}{ratio:9.3f}"
                  f"{best['one_lane'] / best['whole']:9.3f}   {means[0]} | {' '.join(means[1:stages])} | {' '.join(means[stages:])}")  # fmt: skip
    return [Verdict(f"{args.sessions[-1]} sessions chain/whole", ratio, TARGET_CONCURRENT)]


def long_prefill(bench: Bench) -> list[Verdict]:
    """Prefill of a ~2,000-token prompt: the entry's chunks pipeline across the stages."""
    prompt = "Summarise: " + FILLER * (bench.args.long_prompt_tokens // 9)

    def rate(peer: PeerProcess) -> float:
        s = stream(peer, bench.spec.model_id, prompt, 1)
        return s.prompt_tokens / s.ttft

    with bench.swarm() as swarm:
        setups = {"whole": bench.start_whole(swarm), "chain": bench.start_chain(swarm)[0]}
        best = best_in_turns(bench, setups, rate)
    print(f"~{bench.args.long_prompt_tokens}-token prompt, prompt tok/s to the first token: "
          f"whole {best['whole']:.1f}, chain {best['chain']:.1f}")
    return [Verdict("long prefill chain/whole", best["chain"] / best["whole"], TARGET_LONG_PREFILL)]


SECTIONS: dict[str, Callable[[Bench], list[Verdict]]] = {
    "chain": whole_vs_chain,
    "pinned": pinned_hop_cost,
    "transport": transport_cost,
    "concurrency": concurrency,
    "long-prefill": long_prefill,
}
"""Each section starts its own peers and returns its figures; ``--sections`` picks some."""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2:135m")
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--prompt-words", type=int, default=300, help="length of the prefill prompt")
    parser.add_argument("--rounds", type=int, default=5,
                        help="rounds in turns; figures are the best of them (the pinned hop is judged by --pairs)")
    parser.add_argument("--pairs", "--hop-pairs", type=int, default=32,
                        help="short pairs of turns (whole peer, chain) whose median and its interval judge the pinned "
                        "hop and the chain's decode ratio")  # fmt: skip
    parser.add_argument("--hop-instances", type=int, default=2,
                        help="whole peers and direct chains started for the pairs, each crossed with each")
    parser.add_argument("--threads", type=int, default=1, help="engine threads per peer")
    parser.add_argument("--wire-dtype", default="f16", choices=("f16", "bf16", "f32"))
    parser.add_argument("--libp2p-only", action="store_true",
                        help="the chain section's peers forward over libp2p streams (no direct data plane)")
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 4, 8], help="concurrency levels")
    parser.add_argument("--concurrent-tokens", type=int, default=48, help="tokens per session, concurrency section")
    parser.add_argument("--long-prompt-tokens", type=int, default=2000)
    parser.add_argument("--cores-apart", action="store_true",
                        help="pin each peer of a chain to a core of its own (peer i on core i, round robin) and the whole "
                        "peer to --threads cores: the stages compute side by side, as on separate machines")  # fmt: skip
    parser.add_argument("--peer-arg", action="append", default=[], metavar="ARG",
                        help="one more argument for every peer, e.g. --peer-arg=--decode-lanes --peer-arg=1 "
                        "(to measure a flag against the defaults); repeatable")  # fmt: skip
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    args = parser.parse_args()
    chosen = [s for s in args.sections.split(",") if s]
    if args.pairs < 1:
        parser.error("--pairs must be at least 1 (30 for an interval of the median; 6 at the least)")
    if args.hop_instances < 1:
        parser.error("--hop-instances must be at least 1")
    unknown = set(chosen) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections: {', '.join(sorted(unknown))}")

    home = inclavate_home()
    spec = Catalog.load(home).get(args.model)
    ModelStore(home).pull(spec)
    prompt = "Summarise this text: " + FILLER * (args.prompt_words // 9)
    print(f"model {spec.model_id}: {args.peers}-peer chain vs one peer; {args.threads} engine thread(s) per peer, "
          f"wire {args.wire_dtype}, best of {args.rounds}; load average {os.getloadavg()[0]:.2f}")
    print("reproduce: scripts/bench_chain " + " ".join(sys.argv[1:]))
    if args.peer_arg:
        print("every peer also runs with " + " ".join(args.peer_arg))
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
