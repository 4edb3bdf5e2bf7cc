"""What listings cost a peer whose registry holds many identities a stranger listens for:
the outbound libp2p connections (and descriptors) each listing leaves behind.

    INCLAVATE_HOME=~/.inclavate PYTHONPATH=. python scripts/probe_outbound_flood.py \\
        [--identities 96] [--listings 20] [--nofile 256]

One peer (``smollm2:135m``, one thread, 127.0.0.1, no mDNS) under a soft and hard
descriptor limit of ``--nofile``. In this process: ``--identities`` fresh identities, each a
libp2p host answering an empty artifact listing, made known to the peer by hostile
introducers (their addresses, on peer exchange) and records signed by each (gossip,
published again before each listing, as a live identity's heartbeat would).
Then ``--listings`` listings (``GET /v1/artifacts``) one after another, and a quiet
``--watch`` seconds. Every listing and every second after: the HTTP status, how many
identities have been asked, the peer's established TCP connections to their ports (from
``/proc``: the descriptors it holds for them) and all its descriptors.
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "adversary"))
from p2p_flood import FLOODED_PEER_ARGS, descriptors_of, listening_identities, sockets_to  # noqa: E402

from inclavate.local_swarm import LocalSwarm, PeerProcess, request_json  # noqa: E402

_MODEL = "smollm2:135m"


def _listing(a: PeerProcess) -> str:
    """One listing's HTTP status, or why none came."""
    try:
        return str(request_json("GET", a.url + "/v1/artifacts?limit=10", timeout=30)[0])
    except Exception as exc:  # noqa: BLE001 - a peer out of descriptors answers nothing
        return type(exc).__name__


async def _probe(swarm: LocalSwarm, a: PeerProcess, args: argparse.Namespace) -> None:
    pid = a.process.pid
    async with listening_identities(swarm.multiaddr(a), args.identities) as listeners:
        ids = {h.peer_id for h in listeners.hosts}
        ports = listeners.ports()

        def knows_all() -> bool:
            return ids <= {n["node_id"] for n in a.get("/nodes")}

        await trio.to_thread.run_sync(lambda: swarm.wait(knows_all, 120, "the peer to hold every record", a))
        print(f"records held; before listings: to identities {sockets_to(pid, ports)}, fds {descriptors_of(pid)}", flush=True)
        most = 0
        started = time.monotonic()
        for i in range(args.listings):
            await listeners.publish()  # records that stop beating age out of the listings
            t0 = time.monotonic()
            status = await trio.to_thread.run_sync(_listing, a)
            held = sockets_to(pid, ports)
            most = max(most, held)
            print(f"listing {i + 1:3d}: {status:>12} in {time.monotonic() - t0:4.2f} s, asked {len(listeners.asked):4d}, "
                  f"to identities {held:4d}, fds {descriptors_of(pid):4d}", flush=True)  # fmt: skip
        elapsed = time.monotonic() - started
        for second in range(int(args.watch)):
            await trio.sleep(1)
            held = sockets_to(pid, ports)
            print(f"t+{second + 1:3d}s: to identities {held:4d}, fds {descriptors_of(pid):4d}", flush=True)
        print(f"RESULT identities={args.identities} listings={args.listings} nofile={args.nofile}: asked "
              f"{len(listeners.asked)}, most connections to them {most} (after the listings), at rest {held}, "
              f"fds at rest {descriptors_of(pid)}, listings took {elapsed:.1f} s", flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--identities", type=int, default=96)
    parser.add_argument("--listings", type=int, default=20)
    parser.add_argument("--nofile", type=int, default=256)
    parser.add_argument("--watch", type=float, default=10.0, help="seconds to watch after the listings")
    parser.add_argument("--workdir", help="keep the peer's data and log here (default: a temporary directory)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, LocalSwarm(Path(args.workdir or tmp), FLOODED_PEER_ARGS) as swarm:
        a = swarm.start("a", _MODEL)
        swarm.wait_ready(a)
        resource.prlimit(a.process.pid, resource.RLIMIT_NOFILE, (args.nofile, args.nofile))
        trio.run(_probe, swarm, a, args)


if __name__ == "__main__":
    main()
