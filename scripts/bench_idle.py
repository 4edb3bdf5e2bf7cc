"""What an idle peer in a small swarm spends on background work, and on what.

A chain of ``--peers`` peers (explicit ``--layers``, the entry first, the others bootstrapped
to it: the chain ``bench_chain`` measures) is started on loopback; once every peer lists every
node Ready and ``--settle`` seconds passed, each peer's CPU (``/proc/<pid>/stat`` utime +
stime) is read over ``--window`` seconds: idle CPU ms per second, per peer. ``--lone`` adds a
lone whole peer measured in the same window (what a peer with no neighbour spends).

With ``--spy``, a second window records every peer with ``py-spy record -r 500 -f raw``
(``--nonblocking``: the peer is not stopped) and the samples are grouped by the trio task
they ran in (the first frame under trio's run loop that is not one of py-libp2p's task
wrappers) and by the layer they ended in, so the periodic work can be named and weighed.
py-spy leaves out the samples where the process sleeps in ``epoll_wait``; what is left is CPU.

Why this exists: on one core every chain peer's idle background runs inside the hops'
time (``bench_chain --sections pinned`` prints it as "idle background CPU per peer"); a lone
peer spent ~3 ms/s, a chain peer 7-10 (docs/ARCHITECTURE.md, "Open in issue 10").

Run it on a core of its own, serialized with other benchmarks::

    flock /tmp/s26-bench.lock taskset -c 0 env INCLAVATE_HOME=... .venv/bin/python scripts/bench_idle.py --lone
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from inclavate.catalog import Catalog
from inclavate.config import inclavate_home
from inclavate.generate_cmd import split_evenly
from inclavate.local_swarm import LocalSwarm, PeerProcess
from inclavate.store import ModelStore

CLK_TCK = os.sysconf("SC_CLK_TCK")
WRAPPERS = ("TrioManager._run_and_manage_task", "FunctionTask.run", "_run_handler", "run_and_deliver")
"""Frames that start a task on behalf of another function: the task is named by what they call."""
LAYERS = (("trio/_core/_run.py", "trio scheduler"), ("trio/_core/_io_epoll.py", "trio epoll"),
          ("libp2p/io/trio.py", "tcp"), ("trio/_highlevel_socket.py", "tcp"), ("trio/_socket.py", "tcp"),
          ("libp2p/security/noise", "noise"), ("libp2p/io/msgio.py", "noise"), ("nacl/", "crypto"),
          ("cryptography/", "crypto"), ("libp2p/stream_muxer/yamux", "yamux"),
          ("libp2p/network/", "net stream"), ("google/protobuf", "protobuf"), ("libp2p/pubsub", "pubsub"),
          ("p2p/", "inclavate p2p"), ("trio/", "trio other"))  # fmt: skip
"""Where a sample's innermost frame sits, by path fragment, first match wins."""


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime (fields 14, 15)


def idle_ms_per_s(pids: list[int], window_s: float) -> list[float]:
    """CPU milliseconds per second each process used over ``window_s``."""
    before = [cpu_seconds(pid) for pid in pids]
    started = time.monotonic()
    time.sleep(window_s)
    elapsed = time.monotonic() - started
    return [(cpu_seconds(pid) - b) * 1000 / elapsed for pid, b in zip(pids, before)]


def start_chain(swarm: LocalSwarm, model: str, n_layers: int, peers: int) -> list[PeerProcess]:
    chain = swarm.start_chain(model, split_evenly(n_layers, peers), ready_timeout=300)
    swarm.wait(lambda: all(sum(v["state"] == "Ready" for v in p.get("/nodes")) == peers for p in chain), 180,
               f"every peer to list {peers} Ready nodes")  # fmt: skip
    return chain


def task_of(frames: list[str]) -> str:
    """The trio task a sample ran in: the first frame under the run loop not a task wrapper."""
    names = [f.split(" (", 1)[0] for f in frames]
    for i, name in enumerate(names):
        if name == "unrolled_run":
            for inner in names[i + 1 :]:
                if inner not in WRAPPERS:
                    return inner
            return "trio run loop"
    return names[-1] if names else "?"


def layer_of(frames: list[str]) -> str:
    leaf = frames[-1] if frames else ""
    return next((name for fragment, name in LAYERS if fragment in leaf), leaf.split(" (", 1)[0])


def spy(pids: list[int], names: list[str], window_s: float, out: Path, rate: int) -> None:
    """py-spy every process at once for ``window_s``; print each one's samples by task and by layer."""
    spies = [subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "-p", str(pid), "-r", str(rate),
                               "-d", str(int(window_s)), "-f", "raw", "--nonblocking", "-o", str(out / f"{name}.spy")],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for pid, name in zip(pids, names)]  # fmt: skip
    for process in spies:
        process.wait()
    for name in names:
        by_task: collections.Counter[str] = collections.Counter()
        by_layer: collections.Counter[str] = collections.Counter()
        path = out / f"{name}.spy"
        for line in path.read_text().splitlines() if path.exists() else []:
            stack, _, count = line.rpartition(" ")
            frames = stack.split(";")
            if "EpollIOManager.get_events" in frames[-1]:
                continue  # asleep in epoll_wait: not CPU
            by_task[task_of(frames)] += int(count)
            by_layer[layer_of(frames)] += int(count)
        total = sum(by_task.values()) or 1
        print(f"\n{name}: {total} samples on CPU at {rate} Hz over {window_s:g} s (~{total * 1000 / rate / window_s:.1f} ms/s)")
        print("  by task:  " + "; ".join(f"{t} {c / total:.0%}" for t, c in by_task.most_common(12)))
        print("  by layer: " + "; ".join(f"{t} {c / total:.0%}" for t, c in by_layer.most_common(10)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2:135m")
    parser.add_argument("--peers", type=int, default=3, help="peers in the chain")
    parser.add_argument("--lone", action="store_true", help="also a lone whole peer, measured in the same window")
    parser.add_argument("--settle", type=float, default=20.0, help="seconds of quiet after the swarm formed")
    parser.add_argument("--window", type=float, default=20.0, help="seconds of CPU sampling")
    parser.add_argument("--spy", action="store_true", help="then py-spy every peer over another window")
    parser.add_argument("--spy-rate", type=int, default=500)
    parser.add_argument("--hold", type=float, default=0.0, help="keep the swarm idle this long at the end (to probe it)")
    parser.add_argument("--peer-arg", action="append", default=[], help="an extra argument for every peer")
    args = parser.parse_args()

    home = inclavate_home()
    spec = Catalog.load(home).get(args.model)
    ModelStore(home).pull(spec)
    common = ["--p2p-host", "127.0.0.1", "--no-mdns", "--threads", "1", "--context", "512", "--max-sessions", "2",
              *args.peer_arg]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp, LocalSwarm(Path(tmp), common, {"INCLAVATE_HOME": str(home)}) as swarm:
        peers = start_chain(swarm, spec.model_id, spec.n_layers, args.peers)
        if args.lone:
            peers.append(swarm.start("lone", spec.model_id, "--layers", f"0-{spec.n_layers}"))
            swarm.wait_ready(peers[-1], timeout=300)
        time.sleep(args.settle)
        load = Path("/proc/loadavg").read_text().split()[0]
        cpu = idle_ms_per_s([p.process.pid for p in peers], args.window)
        chain_cpu = cpu[: args.peers]
        print(f"idle CPU ms/s over {args.window:g} s after {args.settle:g} s settled (load {load}): "
              + ", ".join(f"{p.name} {c:.1f}" for p, c in zip(peers, cpu))
              + f"; chain mean {statistics.fmean(chain_cpu):.1f}", flush=True)  # fmt: skip
        if args.spy:
            spy([p.process.pid for p in peers], [p.name for p in peers], args.window, Path(tmp), args.spy_rate)
        if args.hold:
            print(f"holding for {args.hold:g} s: pids {[p.process.pid for p in peers]}", flush=True)
            time.sleep(args.hold)
    print(f"reproduce: scripts/bench_idle.py --peers {args.peers}{' --lone' if args.lone else ''} "
          f"--settle {args.settle:g} --window {args.window:g}{' --spy' if args.spy else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
