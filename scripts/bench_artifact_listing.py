"""A swarm-wide artifact listing through the peer that holds none of the rows: two loopback
peers, ROWS ready rows inserted into A's index, B lists a page at the bottom of the window
and one at the top (best of 5 each). Run with ``taskset -c N`` and ``PYTHONSAFEPATH=1`` (so
``PYTHONPATH`` picks the tree): ``PYTHONPATH=TREE python scripts/bench_artifact_listing.py
[--rows 20000] [--emoji]``; ``--emoji`` names each row with 255 emoji (the longest filename
the upload routes keep)."""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import trio

from inclavate.artifact_swarm import SwarmArtifacts
from inclavate.artifact_types import MAX_FILENAME_CHARS, ArtifactMeta, ListQuery
from inclavate.artifacts import ArtifactStore
from inclavate.owner_ids import new_id
from p2p.artifacts import RemoteArtifacts, serve_artifacts
from p2p.host import open_host
from p2p.identity import Identity


def insert_rows(store: ArtifactStore, count: int, filename: str) -> None:
    rows = [ArtifactMeta(id=new_id(store.owner), media_type="text/plain", size_bytes=1, digest="0" * 64, state="ready",
                         kind="uploaded", created_at_ms=1_700_000_000_000 + i, filename=filename, purpose="user_data")
            for i in range(count)]  # fmt: skip
    with store.index._db.conn:
        store.index._db["artifacts"].insert_all([m.to_record() for m in rows])  # type: ignore[union-attr]


async def main(rows: int, filename: str) -> None:
    with tempfile.TemporaryDirectory() as d:
        async with open_host(Identity.generate(), listen_host="127.0.0.1") as a, \
                open_host(Identity.generate(), listen_host="127.0.0.1") as b:  # fmt: skip
            peers = [a.peer_id, b.peer_id]
            stores = [ArtifactStore(Path(d) / name, h.peer_id) for name, h in (("a", a), ("b", b))]
            for host, store in zip((a, b), stores):
                serve_artifacts(host, store)
            swarm = SwarmArtifacts(stores[1], RemoteArtifacts(b), lambda: peers, lambda: peers)
            await b.connect(a.multiaddrs()[0])
            insert_rows(stores[0], rows, filename)
            for query in (ListQuery(limit=1000, offset=rows - 1000), ListQuery(limit=100)):
                best, got = float("inf"), 0
                for _ in range(5):
                    start = time.perf_counter()
                    got = len((await swarm.list(query)).artifacts)
                    best = min(best, time.perf_counter() - start)
                print(f"rows={rows} offset={query.offset} limit={query.limit} listed={got} best={best * 1000:.0f} ms")
            for store in stores:
                store.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--emoji", action="store_true")
    args = parser.parse_args()
    trio.run(main, args.rows, "\U0001F600" * MAX_FILENAME_CHARS if args.emoji else "report.txt")
