"""What a stranger's connections to a peer's libp2p port cost it: descriptors, memory,
whether its API still answers, whether an honest peer can still join through it, and how
long the peer keeps each connection.

    INCLAVATE_HOME=~/.inclavate PYTHONPATH=. python scripts/probe_p2p_flood.py \
        --kind silent|stalled|identities [--connections 400] [--nofile 256]
    ... --kind paced --sources 39 --per-s 600

One peer (``smollm2:135m``, one thread, 127.0.0.1, no mDNS) under a soft and hard
descriptor limit of ``--nofile``; the flood comes from 127.0.0.2 (``--kind paced``: from
``--sources`` addresses, 127.0.0.2 on, in turn, ``--per-s`` connections a second in all,
each closed at once, for the whole watch: it spends the peer's accept rate; the honest peer
dials from 127.0.0.1). Every second: the peer's
descriptors (``/proc/PID/fd``), RSS, the CPU seconds it used per second (``/proc/PID/stat``,
user + system: what the flood costs it), whether ``/health`` answered within 5 s, and how
many of the flood's connections the peer has closed (``--connections 0``: no flood). Once the flood is open a second peer
bootstraps through the first; "joined" is when each lists the other in ``/nodes``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import sys
import tempfile
import threading
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "adversary"))
from p2p_flood import FLOODED_PEER_ARGS, descriptors_of, STALLED_HELLO, closed_by_peer, fresh_identity_flood, open_quietly, paced_flood  # noqa: E402

from inclavate.local_swarm import LocalSwarm, PeerProcess  # noqa: E402

_MODEL = "smollm2:135m"


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return -1.0


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds ``pid`` has used (fields 14 and 15 of ``/proc/PID/stat``)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return -1.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _health(peer: PeerProcess) -> bool:
    try:
        return bool(peer.get("/health", timeout=5)["ok"])
    except Exception:  # noqa: BLE001 - any failure is "did not answer"
        return False


def _lists(peer: PeerProcess, other: str) -> bool:
    try:
        return other in {n["node_id"] for n in peer.get("/nodes", timeout=5)}
    except Exception:  # noqa: BLE001
        return False


def _flood(kind: str, port: int, target: str, n: int) -> tuple[list, list]:
    """Open the flood; returns what must stay referenced and the sockets to watch."""
    if kind == "silent":
        socks = open_quietly(port, "127.0.0.2", n)
        return socks, socks
    if kind == "stalled":
        socks = open_quietly(port, "127.0.0.2", n, STALLED_HELLO)
        return socks, socks
    held: list = []
    ready = threading.Event()
    release = threading.Event()

    async def hold() -> None:
        done, failed = await fresh_identity_flood(port, target, "127.0.0.2", n)
        print(f"identities: {len(done)} through Noise+yamux, {failed} failed", flush=True)
        held.extend(done)
        ready.set()
        await trio.to_thread.run_sync(release.wait)

    threading.Thread(target=trio.run, args=(hold,), daemon=True).start()
    ready.wait(300)
    return [release], [sock for _, sock in held]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kind", choices=["silent", "stalled", "identities", "paced"], required=True)
    parser.add_argument("--sources", type=int, default=39, help="--kind paced: flood addresses, 127.0.0.2 on")
    parser.add_argument("--per-s", type=float, default=600.0, help="--kind paced: new connections a second, in all")
    parser.add_argument("--connections", type=int, default=400)
    parser.add_argument("--nofile", type=int, default=256)
    parser.add_argument("--sustain", action="store_true", help="reopen every flood connection the peer closes")
    parser.add_argument("--workdir", help="keep the peers' data and logs here (default: a temporary directory)")
    parser.add_argument("--watch", type=float, default=40.0, help="seconds to watch after the flood is open")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, LocalSwarm(Path(args.workdir or tmp), FLOODED_PEER_ARGS) as swarm:
        a = swarm.start("a", _MODEL)
        health = swarm.wait_ready(a)
        port = int(health["multiaddrs"][0].split("/tcp/")[1].split("/")[0])
        resource.prlimit(a.process.pid, resource.RLIMIT_NOFILE, (args.nofile, args.nofile))
        pid = a.process.pid
        maddr = swarm.multiaddr(a)
        print(f"before: fds {descriptors_of(pid)}, RSS {_rss_mb(pid):.0f} MB", flush=True)
        samples: list[tuple[int, float]] = []
        stop = threading.Event()

        def sample() -> None:  # descriptors and RSS every 0.2 s, the flood's opening included
            while not stop.is_set():
                samples.append((descriptors_of(pid), _rss_mb(pid)))
                time.sleep(0.2)

        threading.Thread(target=sample, daemon=True).start()
        started = time.monotonic()
        paced = contextlib.ExitStack()
        if args.kind == "paced":
            sources = [f"127.0.0.{2 + i}" for i in range(args.sources)]
            flood = paced.enter_context(paced_flood(port, sources, args.per_s, STALLED_HELLO))
            time.sleep(5)  # the bucket of all drained, the flood's quiet tokens spent
            keep, watched = [], []
        else:
            keep, watched = _flood(args.kind, port, health["peer_id"], args.connections)
        print(f"flood open in {time.monotonic() - started:.1f} s: {len(watched)} connections", flush=True)
        b = swarm.start("b", _MODEL, "--bootstrap", maddr)
        b_id, joined_at = "", None
        unanswered, first_closed, reopened = 0, None, 0
        t0 = time.monotonic()
        cpu0 = cpu_last = _cpu_s(pid)
        tick_last = t0
        cpu_rates: list[float] = []
        while time.monotonic() - t0 < args.watch:
            ok = _health(a)
            unanswered += not ok
            gone = [sock for sock in watched if closed_by_peer(sock)]
            if gone and first_closed is None:
                first_closed = time.monotonic() - t0
            if args.sustain and gone and args.kind != "identities":
                for sock in gone:
                    sock.close()
                    watched.remove(sock)
                fresh = open_quietly(port, "127.0.0.2", len(gone), STALLED_HELLO if args.kind == "stalled" else b"")
                watched += fresh
                reopened += len(fresh)
            if not b_id:
                try:
                    b_id = b.get("/health", timeout=5)["peer_id"]
                except Exception:  # noqa: BLE001
                    pass
            if b_id and joined_at is None and _lists(a, b_id) and _lists(b, health["peer_id"]):
                joined_at = time.monotonic() - t0
            fds, rss = samples[-1]
            cpu_now, tick_now = _cpu_s(pid), time.monotonic()
            cpu_rates.append((cpu_now - cpu_last) / max(1e-3, tick_now - tick_last))
            cpu_last, tick_last = cpu_now, tick_now
            print(f"t={time.monotonic() - t0:5.1f}s fds {fds:4d} RSS {rss:5.0f} MB CPU {cpu_rates[-1]:4.2f} s/s "
                  f"health {'ok' if ok else 'NO'} "
                  f"closed {len(gone)}/{len(watched)} reopened {reopened} joined {joined_at is not None}", flush=True)  # fmt: skip
            time.sleep(1)
        watched_s = max(1e-3, time.monotonic() - t0)
        cpu_mean = (_cpu_s(pid) - cpu0) / watched_s
        if args.kind == "paced":
            paced.close()
            counters = a.get("/health", timeout=5)["connections"]
            print(f"paced flood: {flood.opened} opened ({flood.opened / (time.monotonic() - started):.0f}/s), "
                  f"{flood.failed} failed; peer's counters {counters}", flush=True)
        per_conn = f", {cpu_mean / (reopened / watched_s) * 1000:.1f} ms each" if reopened else ""
        stop.set()
        most_fds, most_rss = max(f for f, _ in samples), max(r for _, r in samples)
        at_limit = sum(f >= args.nofile - 2 for f, _ in samples) * 0.2
        log = a.log_path.read_text(errors="replace")
        print(f"RESULT kind={args.kind} n={args.connections} nofile={args.nofile}: most fds {most_fds}, most RSS "
              f"{most_rss:.0f} MB, CPU {cpu_mean:.2f} s/s (most {max(cpu_rates, default=0):.2f}) under {reopened / watched_s:.0f} new flood "
              f"connections/s{per_conn}, {at_limit:.1f} s at the limit, /health unanswered {unanswered}x, honest peer joined "
              f"{'after %.1f s' % joined_at if joined_at is not None else 'NEVER'}, first flood connection closed "
              f"{'after %.1f s' % first_closed if first_closed is not None else 'never'}, closed at end "
              f"{sum(map(closed_by_peer, watched))}/{len(watched)}, EMFILE in log {log.count('EMFILE')}x", flush=True)  # fmt: skip
        for item in keep:
            if isinstance(item, threading.Event):
                item.set()
            else:
                item.close()


if __name__ == "__main__":
    main()
