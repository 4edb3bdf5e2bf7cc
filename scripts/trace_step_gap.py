"""Where a whole peer's batched decode step spends the time outside ``llama_decode``.

8 sessions stream through one peer holding the whole model (default flags, as
``scripts/bench_peer`` section 2 runs it). The peer runs with a tracer injected at start-up
(``sitecustomize`` on its ``PYTHONPATH``; nothing in the product changes) that timestamps, on
every stage round: the stage's engine call (``Stage._compute``, on the engine thread) and the
``llama_decode`` inside it, the call's hand-over to the engine thread and back, each result's
delivery, and each session's next step arriving at the stage. Printed: the medians of each
piece of the gap between two batched engine calls, i.e. what runs in series with the engine.

Usage: ``python scripts/trace_step_gap.py [--rounds 3] [--tokens 96] [--tree PATH]``
(``--tree`` runs the peer from another checkout, to compare two trees in turns). Figures in
docs/ARCHITECTURE.md ("What a batched step waits for outside the engine").
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import textwrap
import time
from bisect import bisect_left, bisect_right
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_peer  # noqa: E402

from inclavate.catalog import Catalog  # noqa: E402
from inclavate.config import inclavate_home  # noqa: E402
from inclavate.local_swarm import LocalSwarm  # noqa: E402
from inclavate.store import ModelStore  # noqa: E402

TRACER = textwrap.dedent('''
    import os, threading, time
    import llama_cpp
    import node.engine_thread as engine_thread
    import node.llamacpp_engine as llamacpp_engine
    import node.stage as stage

    events = []
    note = events.append
    clock = time.perf_counter

    def wrap_sync(owner, name, tag):
        inner = getattr(owner, name)
        def traced(*args):
            start = clock()
            try:
                return inner(*args)
            finally:
                note((tag, start, clock(), len(args[1]) if tag == "compute" else 0))
        setattr(owner, name, traced)

    wrap_sync(stage.Stage, "_compute", "compute")
    decode = llama_cpp.llama_decode
    def traced_decode(ctx, batch):
        start = clock()
        try:
            return decode(ctx, batch)
        finally:
            note(("decode", start, clock(), 0))
    llamacpp_engine.llama_cpp.llama_decode = traced_decode

    submit = stage.Stage.submit
    async def traced_submit(self, job):
        note(("submit", clock(), 0, 0))
        return await submit(self, job)
    stage.Stage.submit = traced_submit

    deliver = stage._deliver
    async def traced_deliver(job, result):
        note(("deliver", clock(), 0, 0))
        await deliver(job, result)
    stage._deliver = traced_deliver

    run = engine_thread.EngineThread.run
    async def traced_run(self, fn, *args):
        note(("handed", clock(), 0, 0))
        try:
            return await run(self, fn, *args)
        finally:
            note(("resumed", clock(), 0, 0))
    engine_thread.EngineThread.run = traced_run

    def dump():
        while True:
            time.sleep(1)
            with open(os.environ["INCLAVATE_TRACE_OUT"] + ".tmp", "w") as out:
                for tag, a, b, n in list(events):
                    out.write(f"{tag} {a} {b} {n}\\n")
            os.replace(os.environ["INCLAVATE_TRACE_OUT"] + ".tmp", os.environ["INCLAVATE_TRACE_OUT"])
    threading.Thread(target=dump, daemon=True).start()
''')


def pieces(path: Path, sessions: int) -> dict[str, list[float]]:
    """Milliseconds of each piece of every gap between two full batched calls."""
    by_tag: dict[str, list[tuple[float, float, int]]] = {}
    for line in path.read_text().splitlines():
        tag, a, b, n = line.split()
        by_tag.setdefault(tag, []).append((float(a), float(b), int(n)))
    calls = by_tag.get("compute", [])
    times = {tag: sorted(a for a, _, _ in rows) for tag, rows in by_tag.items() if tag != "compute"}
    decodes = by_tag.get("decode", [])
    out: dict[str, list[float]] = {}

    def add(name: str, seconds: float) -> None:
        out.setdefault(name, []).append(seconds * 1000)

    for this, nxt in zip(calls, calls[1:]):
        if this[2] != sessions or nxt[2] != sessions:
            continue
        end, start = this[1], nxt[0]

        def within(tag: str) -> list[float]:
            ts = times.get(tag, [])
            return ts[bisect_left(ts, end) : bisect_right(ts, start)]

        delivered, submitted, resumed, handed = within("deliver"), within("submit"), within("resumed"), within("handed")
        inline = not resumed and not handed  # both calls made on the event loop's thread (node.stage)
        if len(delivered) < sessions or len(submitted) < sessions or not (inline or (resumed and handed)):
            continue
        if inline:
            add("call's end -> first result delivered (inline calls)", delivered[0] - end)
        else:
            add("engine thread -> stage worker resumed", resumed[0] - end)
        add(f"{sessions} results delivered", delivered[-1] - delivered[0])
        add("last delivery -> first next step queued", submitted[0] - delivered[-1])
        add(f"{sessions} next steps queued (first to last)", submitted[-1] - submitted[0])
        if inline:
            add("last step queued -> next call starts (inline calls)", start - submitted[-1])
        else:
            add("last step queued -> call handed to the engine thread", handed[-1] - submitted[-1])
            add("handed -> engine thread starts the call", start - handed[-1])
        add("gap between two calls (all of the above)", start - end)
        inside = [d for d in decodes if this[0] <= d[0] and d[1] <= this[1]]
        if len(inside) == 1:
            add("engine call: before llama_decode", inside[0][0] - this[0])
            add("engine call: llama_decode", inside[0][1] - inside[0][0])
            add("engine call: after llama_decode (logits, sampling)", this[1] - inside[0][1])
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2:135m")
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=96, help="tokens per session per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tree", type=Path, help="run the peer from this checkout")
    args = parser.parse_args()
    home = inclavate_home()
    spec = Catalog.load(home).get(args.model)
    model_path = ModelStore(home).pull(spec).path
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)  # `python -m` puts the working directory first on the peer's path: not a checkout
        inject = Path(tmp) / "inject"
        inject.mkdir()
        (inject / "sitecustomize.py").write_text(TRACER)
        trace = Path(tmp) / "trace.txt"
        path = os.pathsep.join(str(p) for p in (args.tree, inject) if p is not None)
        env = {"INCLAVATE_HOME": str(home), "PYTHONPATH": path, "INCLAVATE_TRACE_OUT": str(trace)}
        with LocalSwarm(Path(tmp) / "swarm", ["--p2p-host", "127.0.0.1", "--no-mdns"], env, colocated=False) as swarm:
            peer = swarm.start("whole", spec.model_id, *bench_peer.whole_layers(model_path))
            swarm.wait_ready(peer)
            bench_peer.stream(peer, spec.model_id, bench_peer.DECODE_PROMPT, 4)
            for _ in range(args.rounds):
                rate = bench_peer.concurrent_decode(peer, spec.model_id, args.sessions, args.tokens)
                print(f"{args.sessions} sessions: {rate:.1f} tok/s aggregate")
            time.sleep(2.5)  # the tracer writes its file every second
            swarm.stop(peer)
        measured = pieces(trace, args.sessions)
    if not measured:
        print("no full batched rounds were traced")
        return 1
    rounds = len(measured["gap between two calls (all of the above)"])
    print(f"\nms over {rounds} pairs of consecutive {args.sessions}-session engine calls "
          "(a mean far above the median: a few long waits, e.g. for the GIL)")  # fmt: skip
    print(f"  {'':<55} {'median':>7} {'mean':>7} {'p90':>7}")
    for name, values in measured.items():
        p90 = statistics.quantiles(values, n=10)[-1] if len(values) > 1 else values[0]
        print(f"  {name:<55} {statistics.median(values):7.3f} {statistics.fmean(values):7.3f} {p90:7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
