"""What an artifact download relayed between peers costs, against one from its owner.

Two peers on 127.0.0.1 (``--max-layers 4`` of the model each: a peer needs a model to run).
A random object of ``--mib`` MiB is uploaded to peer A, then downloaded over HTTP, in turns,
``--rounds`` times each (the best is kept):

- **direct**: ``GET /v1/artifacts/<id>`` from A, which owns it (bytes from its disk);
- **relayed**: the same from B, which fetches it from A over ``/inclavate/artifacts/2`` in
  pieces of at most 1 MiB (``p2p/artifacts.py``).

Printed: MB/s of each (10^6 bytes per second, the whole body as the client read it), the
ratio relayed / direct, whether the bytes' sha256 matched the upload's, and the CPU seconds
per MiB each peer process spent during the download (``/proc/<pid>/stat`` utime + stime,
best round). The client reads in this process, so its CPU competes with the peers' on a
small machine; pin the whole run (``taskset -c 0``) to measure on one core.

``--compare TREE`` starts a second pair of peers from another checkout (``PYTHONPATH=TREE``
for its children: the tree before a change) and measures both pairs in the same rounds,
so the two are compared under the same load.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from inclavate.catalog import Catalog
from inclavate.config import inclavate_home
from inclavate.local_swarm import LocalSwarm, PeerProcess
from inclavate.store import ModelStore

CLK_TCK = os.sysconf("SC_CLK_TCK")
MIB = 1024 * 1024
CLIENT_CHUNK = 1 * MIB


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` (fields 14 and 15 of /proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


@dataclass
class Best:
    """The best round of one way to download."""

    mbps: float = 0.0
    cpu_per_mib: dict[str, float] = field(default_factory=dict)
    digests_ok: bool = True

    def add(self, mbps: float, cpu_per_mib: dict[str, float], digest_ok: bool) -> None:
        self.digests_ok &= digest_ok
        if mbps > self.mbps:
            self.mbps, self.cpu_per_mib = mbps, cpu_per_mib


@dataclass
class Pair:
    """Peer A (the owner) and peer B (the relay), from one source tree."""

    label: str
    a: PeerProcess
    b: PeerProcess
    artifact_id: str = ""
    direct: Best = field(default_factory=Best)
    relayed: Best = field(default_factory=Best)


def download(peer: PeerProcess, artifact_id: str, size: int, pair: Pair) -> tuple[float, str, dict[str, float]]:
    """(seconds, sha256 hex, CPU seconds per MiB of each peer of ``pair``) of one download."""
    pids = {"A": pair.a.process.pid, "B": pair.b.process.pid}
    before = {k: cpu_seconds(p) for k, p in pids.items()}
    digest, got = hashlib.sha256(), 0
    started = time.perf_counter()
    with httpx.stream("GET", f"{peer.url}/v1/artifacts/{artifact_id}", timeout=120) as response:
        if response.status_code != 200:
            raise SystemExit(f"GET from {peer.name}: {response.status_code} {response.read()[:200]!r}")
        for chunk in response.iter_raw(CLIENT_CHUNK):
            digest.update(chunk)
            got += len(chunk)
    elapsed = time.perf_counter() - started
    if got != size:
        raise SystemExit(f"GET from {peer.name}: {got} bytes of {size}")
    cpu = {k: (cpu_seconds(p) - before[k]) / (size / MIB) for k, p in pids.items()}
    return elapsed, digest.hexdigest(), cpu


THIS_TREE = Path(__file__).resolve().parent.parent


def start_pair(swarm: LocalSwarm, label: str, model: str, tree: Path | None) -> Pair:
    # PYTHONSAFEPATH: ``python -m inclavate`` puts the working directory ahead of PYTHONPATH,
    # so a --compare run from inside a tree ran that tree twice (until 2026-12-06).
    env = {"PYTHONPATH": str(tree or THIS_TREE), "PYTHONSAFEPATH": "1"}
    a = swarm.start(f"{label}-a", model, "--max-layers", "4", env=env)
    b = swarm.start(f"{label}-b", model, "--max-layers", "4", bootstrap=a, env=env)
    ids = set()
    for peer in (a, b):
        swarm.multiaddr(peer)
        ids.add(peer.get("/health")["peer_id"])
    for peer in (a, b):
        swarm.wait(lambda p=peer: {n["node_id"] for n in p.get("/nodes")} >= ids, 120, "both peers in the registry", peer)
    return Pair(label, a, b)


def upload(pair: Pair, data: bytes) -> str:
    created = httpx.post(f"{pair.a.url}/v1/artifacts", content=data, timeout=300,
                         headers={"Content-Type": "application/octet-stream"})  # fmt: skip
    if created.status_code != 201:
        raise SystemExit(f"upload to {pair.a.name}: {created.status_code} {created.text[:200]}")
    return str(created.json()["id"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2:135m")
    parser.add_argument("--mib", type=int, default=64, help="size of the artifact in MiB")
    parser.add_argument("--rounds", type=int, default=3, help="downloads of each kind, in turns (best kept)")
    parser.add_argument("--compare", type=Path, help="another source tree to measure in the same rounds (e.g. the tree before a change)")
    parser.add_argument("--workdir", type=Path, help="keep the peers' data and logs here (default: a temporary directory)")
    args = parser.parse_args()

    home = inclavate_home()
    spec = Catalog.load(home).get(args.model)
    ModelStore(home).pull(spec)
    size = args.mib * MIB
    data = os.urandom(size)
    want = hashlib.sha256(data).hexdigest()
    common = ["--p2p-host", "127.0.0.1", "--no-mdns", "--threads", "1", "--context", "512", "--max-sessions", "2"]
    affinity = sorted(os.sched_getaffinity(0))
    print(f"{args.mib} MiB, best of {args.rounds}, CPUs {affinity} of {os.cpu_count()}, "
          f"load {Path('/proc/loadavg').read_text().split()[0]}", flush=True)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp, LocalSwarm(args.workdir or Path(tmp), common, {"INCLAVATE_HOME": str(home)}) as swarm:
        pairs = [start_pair(swarm, "this", spec.model_id, None)]
        if args.compare:
            pairs.append(start_pair(swarm, "compare", spec.model_id, args.compare.resolve()))
        for pair in pairs:
            swarm.wait_ready(pair.a, 300)
            swarm.wait_ready(pair.b, 300)
            pair.artifact_id = upload(pair, data)
        for rnd in range(args.rounds):
            for pair in pairs:
                for kind, peer, best in (("direct", pair.a, pair.direct), ("relayed", pair.b, pair.relayed)):
                    elapsed, digest, cpu = download(peer, pair.artifact_id, size, pair)
                    mbps = size / elapsed / 1e6
                    best.add(mbps, cpu, digest == want)
                    print(f"round {rnd + 1} {pair.label:7s} {kind:7s} {mbps:7.1f} MB/s  CPU s/MiB "
                          f"A {cpu['A']:.4f} B {cpu['B']:.4f}  sha256 {'ok' if digest == want else 'MISMATCH'}", flush=True)  # fmt: skip
    print()
    for pair in pairs:
        for kind, best in (("direct", pair.direct), ("relayed", pair.relayed)):
            cpu = best.cpu_per_mib
            print(f"{pair.label:7s} {kind:7s} {best.mbps:7.1f} MB/s  CPU s/MiB A {cpu['A']:.4f} B {cpu['B']:.4f}  "
                  f"sha256 {'match' if best.digests_ok else 'MISMATCH'}")  # fmt: skip
        print(f"{pair.label:7s} relayed/direct {pair.relayed.mbps / pair.direct.mbps:.2f}x")
    if args.compare:
        print(f"relayed, this tree / compared tree: {pairs[0].relayed.mbps / pairs[1].relayed.mbps:.2f}x")
    print(f"reproduce: scripts/bench_artifacts --mib {args.mib} --rounds {args.rounds}"
          + (f" --compare {args.compare}" if args.compare else ""))  # fmt: skip
    return 0 if all(p.direct.digests_ok and p.relayed.digests_ok for p in pairs) else 1


if __name__ == "__main__":
    sys.exit(main())
