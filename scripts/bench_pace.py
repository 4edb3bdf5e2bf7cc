"""How far an honest route's steps stray from what its records say they cost (``p2p.pace``).

The entry judges each decode step against ``expected``, what the route's records and links
say a step costs (``p2p.routing.route_step_ms``); a step over ``max(floor, factor x
expected)`` is slow, and 3 slow of a session's last 8 decode steps move it. This script
measures what honest routes do under load, to set those thresholds from data:

- a 3-peer loopback chain (separate processes, libp2p) of ``--model``, every process on the
  cores this script may use (``taskset -c 1`` puts the three peers and the client on one
  core: a worse case than peers on machines of their own);
- 1 streaming session, then ``--sessions`` (8) streaming at once while ``--prefills`` prompts
  of ~``--long-prompt-tokens`` (2,000) tokens are prefilled one after the other meanwhile;
- the entry logs every answered step with what its route's records predicted
  (``INCLAVATE_DEBUG=p2p.pace``, :func:`p2p.pace.trace`); this script reads the log.

It prints the distribution of step/expected over the decode steps (p50, p99, p99.9, max),
and for each candidate (floor, factor) how many steps it would call slow and how many
sessions it would have moved (``--slow-steps`` of ``--slow-window``; every step judged
alike, as if the leg had no settling steps), the least factor that moves none at each floor,
and the least floor that moves none at any factor. Prefill steps are printed per token
against the decode claim: seconds / (tokens x expected).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from bench_peer import FILLER, story_requests, stream
from bench_sse import stream_all

from inclavate.catalog import Catalog
from inclavate.cli import DEBUG_ENV
from inclavate.config import inclavate_home
from inclavate.generate_cmd import split_evenly
from inclavate.local_swarm import LocalSwarm, PeerProcess
from inclavate.store import ModelStore
from p2p.failover import DECODE_TOKENS

LINE = re.compile(r"pace session=(\S+) tokens=(\d+) seconds=([0-9.]+) expected=([0-9.]+|none)")


@dataclass(frozen=True)
class Step:
    session: str
    tokens: int
    seconds: float
    expected: float | None

    @property
    def ratio(self) -> float:
        assert self.expected
        return self.seconds / self.expected


def read_steps(log: Path, offset: int) -> tuple[list[Step], int]:
    """The steps the entry logged after byte ``offset`` of its log, and the log's end."""
    data = log.read_bytes()
    steps = []
    for m in LINE.finditer(data[offset:].decode(errors="replace")):
        expected = None if m[4] == "none" else float(m[4])
        steps.append(Step(m[1], int(m[2]), float(m[3]), expected))
    return steps, len(data)


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def worst_window(steps: list[Step], floor: float, factor: float, window: int) -> tuple[int, int]:
    """Slow decode steps under (floor, factor), and the most of them among ``window``
    consecutive decode steps (the session moves when that reaches ``slow_steps``)."""
    marks = [s.seconds > max(floor, factor * s.expected) for s in steps if s.expected]
    worst = max((sum(marks[i : i + window]) for i in range(max(1, len(marks) - window + 1))), default=0)
    return sum(marks), worst


def needed_factor(sessions: Iterable[list[Step]], floor: float, args: argparse.Namespace) -> float:
    """The least factor that, with ``floor``, moves no session: the highest ``slow_steps``-th
    largest ratio of a window's steps over the floor."""
    need = 0.0
    for steps in sessions:
        ratios = [s.ratio if s.seconds > floor else 0.0 for s in steps]
        for i in range(max(1, len(ratios) - args.slow_window + 1)):
            window = sorted(ratios[i : i + args.slow_window], reverse=True)
            if len(window) >= args.slow_steps:
                need = max(need, window[args.slow_steps - 1])
    return need


def needed_floor(sessions: Iterable[list[Step]], args: argparse.Namespace) -> float:
    """The least floor that moves no session whatever the factor."""
    need = 0.0
    for steps in sessions:
        for i in range(max(1, len(steps) - args.slow_window + 1)):
            window = sorted((s.seconds for s in steps[i : i + args.slow_window]), reverse=True)
            if len(window) >= args.slow_steps:
                need = max(need, window[args.slow_steps - 1])
    return need


def report(name: str, steps: list[Step], args: argparse.Namespace) -> None:
    decode = [s for s in steps if s.tokens <= DECODE_TOKENS and s.expected]
    unjudged = sum(1 for s in steps if s.tokens <= DECODE_TOKENS and not s.expected)
    print(f"\n== {name}: {len(decode)} decode steps judged ({unjudged} with nothing to judge against), "
          f"{len({s.session for s in decode})} sessions")  # fmt: skip
    if not decode:
        return
    ratios = [s.ratio for s in decode]
    seconds = [s.seconds for s in decode]
    expected = sorted(s.expected for s in decode if s.expected)
    print(f"expected (records) {expected[0] * 1000:.1f}-{expected[-1] * 1000:.1f} ms; step time ms p50 "
          f"{quantile(seconds, 0.5) * 1000:.1f} p99 {quantile(seconds, 0.99) * 1000:.1f} "
          f"p99.9 {quantile(seconds, 0.999) * 1000:.1f} max {max(seconds) * 1000:.1f}")  # fmt: skip
    print(f"step/expected p50 {quantile(ratios, 0.5):.2f} p99 {quantile(ratios, 0.99):.2f} "
          f"p99.9 {quantile(ratios, 0.999):.2f} max {max(ratios):.2f}")  # fmt: skip
    by_session: dict[str, list[Step]] = defaultdict(list)
    for s in decode:
        by_session[s.session].append(s)
    print(f"{'floor s':>8}{'factor':>8}{'slow steps':>12}{'sessions moved':>16}{'most slow in a window':>23}")
    for floor in args.floors:
        for factor in args.factors:
            counts = [worst_window(v, floor, factor, args.slow_window) for v in by_session.values()]
            slow, moves = sum(c for c, _ in counts), sum(w >= args.slow_steps for _, w in counts)
            print(f"{floor:8.2f}{factor:8.1f}{slow:12d}{moves:16d}{max(w for _, w in counts):23d}")
    for floor in args.floors:
        need = needed_factor(by_session.values(), floor, args)
        print(f"floor {floor:.2f} s: a factor above {need:.1f} moves no session" if need else
              f"floor {floor:.2f} s: no {args.slow_window} steps hold {args.slow_steps} over it: no session moved at any factor")  # fmt: skip
    print(f"the highest {args.slow_steps}rd-largest step of {args.slow_window}: {needed_floor(by_session.values(), args) * 1000:.0f} ms "
          "(a floor above it moves no session at any factor)")  # fmt: skip
    prefill = [s for s in steps if s.tokens > DECODE_TOKENS and s.expected]
    if prefill:
        per_token = [s.seconds / (s.tokens * s.expected) for s in prefill]
        print(f"prefill steps: {len(prefill)}, tokens {min(s.tokens for s in prefill)}-{max(s.tokens for s in prefill)}, "
              f"seconds {min(s.seconds for s in prefill):.2f}-{max(s.seconds for s in prefill):.2f}; "
              f"seconds/(tokens x expected) max {max(per_token):.3f} median {quantile(per_token, 0.5):.3f}")  # fmt: skip


def dump(path: Path, phases: list[tuple[str, list[Step]]]) -> None:
    lines = ["phase,session,tokens,seconds,expected"]
    lines += [f"{name},{s.session},{s.tokens},{s.seconds:.6f},{s.expected or ''}" for name, steps in phases for s in steps]
    path.write_text("\n".join(lines) + "\n")


def busy(entry: PeerProcess, args: argparse.Namespace, sessions: int) -> None:
    """``sessions`` streaming at once; ``args.prefills`` long prompts prefilled meanwhile."""
    bodies = story_requests(args.model, sessions, args.tokens, streamed=True)
    done: list[object] = []
    runner = threading.Thread(target=lambda: done.append(stream_all(entry.url + "/v1/chat/completions", bodies)))
    runner.start()
    time.sleep(args.prefill_after_s)
    prompt = "Summarise: " + FILLER * (args.long_prompt_tokens // 9)
    for i in range(args.prefills):
        s = stream(entry, args.model, f"{i}. {prompt}", 4)
        print(f"long prompt {i + 1}: {s.prompt_tokens} tokens, first token after {s.ttft:.2f} s "
              f"({'while' if runner.is_alive() else 'AFTER'} the {sessions} sessions streamed)")  # fmt: skip
    runner.join()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2:135m")
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="engine threads per peer")
    parser.add_argument("--sessions", type=int, default=8, help="concurrent sessions of the busy phase")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per session")
    parser.add_argument("--long-prompt-tokens", type=int, default=2000)
    parser.add_argument("--prefills", type=int, default=3, help="long prompts prefilled during the busy phase")
    parser.add_argument("--prefill-after-s", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=1, help="busy phases")
    parser.add_argument("--floors", type=float, nargs="+", default=[1.0, 0.5, 0.25, 0.1])
    parser.add_argument("--factors", type=float, nargs="+", default=[8.0, 4.0, 3.0, 2.0])
    parser.add_argument("--slow-steps", type=int, default=3)
    parser.add_argument("--slow-window", type=int, default=8)
    parser.add_argument("--dump", type=Path, help="write every logged step here (CSV: phase, session, tokens, "
                        "seconds, expected), e.g. for tests/data/pace_honest_steps.csv")  # fmt: skip
    args = parser.parse_args()

    home = inclavate_home()
    spec = Catalog.load(home).get(args.model)
    ModelStore(home).pull(spec)
    print(f"model {spec.model_id}: {args.peers}-peer loopback chain, {args.threads} engine thread(s) per peer, "
          f"cores {sorted(os.sched_getaffinity(0))}; load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    print("reproduce: scripts/bench_pace " + " ".join(sys.argv[1:]))
    common = ["--p2p-host", "127.0.0.1", "--no-mdns", "--threads", str(args.threads), "--context", "4096",
              "--max-sessions", str(args.sessions + 4)]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp, \
            LocalSwarm(Path(tmp), common, {"INCLAVATE_HOME": str(home), DEBUG_ENV: "p2p.pace"}) as swarm:  # fmt: skip
        entry = swarm.start_chain(spec.model_id, split_evenly(spec.n_layers, args.peers))[0]
        stream(entry, spec.model_id, "Hello", 4)  # warm up: records measured, links known
        _, offset = read_steps(entry.log_path, 0)
        stream(entry, spec.model_id, "Write a long story about a dragon who learns to cook.", args.tokens)
        steps, offset = read_steps(entry.log_path, offset)
        report("1 session", steps, args)
        phases = [("1 session", steps)]
        every: list[Step] = []
        for r in range(args.rounds):
            busy(entry, args, args.sessions)
            steps, offset = read_steps(entry.log_path, offset)
            every += steps
        report(f"{args.sessions} sessions + {args.prefills} long prefills, {args.rounds} round(s)", every, args)
        phases.append((f"{args.sessions} sessions + {args.prefills} long prefills", every))
    if args.dump:
        dump(args.dump, phases)
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
