"""What one swarm-wide listing costs the peer that serves it when the registry holds many
identities that each answer a full window of keys: PEERS in-process fake peers (no
network: each answers after RTT with its keys, JSON-encoded once, that the asker parses
and decodes as ``p2p.artifacts.RemoteArtifacts.keys`` does, with
``p2p.artifacts.decode_key_answer``; on a tree before it, with ``decode_answer`` and
``decode_keys`` in one go), one ``limit=100`` page at ``offset = WINDOW - 100``. Prints the listing's wall
time and CPU (this is all event-loop time: nothing here runs in a thread), the longest
stall (``stall``: how late a task sleeping 1 ms at a time woke, at worst: the longest
stretch the event loop ran the listing without letting another task run, the wait a chat
stream on that peer would see), the most asks in flight at once, the peak of memory
allocated during the listing (tracemalloc, in a second run), and of the first run the keys
decoded and the peers left out unasked, by reason. With ``--at-once N``, N listings run at
once (the ``ListingGate`` allows 4): the figures are theirs together.

Run with ``taskset -c N`` and ``PYTHONSAFEPATH=1`` (so ``PYTHONPATH`` picks the tree):
``PYTHONPATH=TREE python scripts/bench_listing_fanout.py [--peers 200] [--window 5000] [--at-once 1]``."""

from __future__ import annotations

import argparse
import gc
import math
import tempfile
import time
import tracemalloc
from pathlib import Path

import trio

from inclavate.artifact_swarm import SwarmArtifacts
from inclavate.artifact_types import ArtifactMeta, ArtifactPage, KeyPage, ListQuery, Usage
from inclavate.artifacts import ArtifactStore
from inclavate.owner_ids import Owners, new_id
import p2p.artifacts
from p2p.artifact_wire import decode_answer, decode_keys, encode
from p2p.identity import Identity


decode_key_answer = getattr(p2p.artifacts, "decode_key_answer", None)
"""What ``RemoteArtifacts.keys`` does with an answer's frame, where the tree has it."""


class FakePeers:
    """Each peer lists ``window`` keys, newest first, answered after ``rtt`` seconds."""

    def __init__(self, peers: int, window: int, rtt: float) -> None:
        self.rtt, self.in_flight, self.most_in_flight, self.keys_decoded = rtt, 0, 0, 0
        self.names = [f"peer-{i:04}" for i in range(peers)]
        self.listed = {name: [(1_700_000_000_000 + window * i + j, new_id(name)) for j in range(window)][::-1]
                     for i, name in enumerate(self.names)}  # fmt: skip
        self.wire = {name: encode({"ok": True, "keys": [list(k) for k in keys], "truncated": True})
                     for name, keys in self.listed.items()}  # fmt: skip

    async def _wait(self) -> None:
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await trio.sleep(self.rtt)
        finally:
            self.in_flight -= 1

    async def keys(self, peer: str, query: ListQuery, owners: Owners) -> KeyPage:
        await self._wait()
        if decode_key_answer is None:  # a tree before it: parsed and decoded in one go
            page = decode_keys(decode_answer(self.wire[peer], peer), peer, query, owners)
        else:
            page = await decode_key_answer(self.wire[peer], peer, query, owners)
        self.keys_decoded += len(page.keys)
        return page

    async def list(self, peer: str, query: ListQuery, owners: Owners, row_bytes: int = 0) -> ArtifactPage:
        await self._wait()
        keys = [k for k in self.listed[peer] if query.after is None or k < query.after][: query.limit]
        return ArtifactPage([ArtifactMeta(id=i, media_type="text/plain", size_bytes=1, digest="0" * 64, state="ready",
                                          kind="uploaded", created_at_ms=ms, filename="x.txt", purpose="user_data")
                             for ms, i in keys], False)  # fmt: skip

    async def usage(self, peer: str) -> Usage:
        await self._wait()
        return Usage()


def left_out(swarm: SwarmArtifacts) -> str:
    """Peers left out without an answer, by reason (a tree without the counter: "-")."""
    counter = getattr(swarm.fan_out, "left_out", None)
    return "-" if counter is None else str(counter.snapshot())


TICK_S = 0.001


class Ticker:
    """A task that sleeps :data:`TICK_S` at a time and notes how late it woke, at worst: the
    longest the event loop went without running it (what a chat stream's next token waits)."""

    def __init__(self) -> None:
        self.worst = 0.0

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            began = time.perf_counter()
            await trio.sleep(TICK_S)
            self.worst = max(self.worst, time.perf_counter() - began - TICK_S)


async def listings(swarm: SwarmArtifacts, query: ListQuery, at_once: int) -> tuple[int, float, float, float]:
    """``at_once`` listings together: rows of the first, wall, CPU, and the longest stall."""
    ticker, listed = Ticker(), []

    async def one() -> None:
        listed.append(len((await swarm.list(query)).artifacts))

    wall, cpu = time.perf_counter(), time.process_time()
    async with trio.open_nursery() as outer:
        await outer.start(ticker.run)
        async with trio.open_nursery() as nursery:
            for _ in range(at_once):
                nursery.start_soon(one)
        outer.cancel_scope.cancel()
    return listed[0], time.perf_counter() - wall, time.process_time() - cpu, ticker.worst


async def main(peers: int, window: int, rtt: float, at_once: int) -> None:
    fakes = FakePeers(peers, window, rtt)
    gc.freeze()  # the fakes are no part of the peer: its collections need not walk them
    with tempfile.TemporaryDirectory() as d:
        store = ArtifactStore(Path(d), Identity.generate().peer_id)
        swarm = SwarmArtifacts(store, fakes, lambda: fakes.names, lambda: fakes.names)  # type: ignore[arg-type]
        query = ListQuery(limit=100, offset=window - 100)
        listed, wall, cpu, stall = await listings(swarm, query, at_once)
        decoded, dropped = fakes.keys_decoded, left_out(swarm)
        tracemalloc.start()
        await listings(swarm, query, at_once)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        store.close()
    print(f"peers={peers} window={window} rtt={rtt * 1000:.0f} ms at_once={at_once} listed={listed} "
          f"wall={wall * 1000:.0f} ms cpu={cpu * 1000:.0f} ms stall={math.ceil(stall * 1000)} ms "
          f"keys_decoded={decoded} left_out={dropped} most_in_flight={fakes.most_in_flight} "
          f"peak_alloc={peak / 2**20:.0f} MiB")  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--peers", type=int, default=200)
    parser.add_argument("--window", type=int, default=5000)
    parser.add_argument("--rtt", type=float, default=0.005, help="seconds each fake peer takes to answer")
    parser.add_argument("--at-once", type=int, default=1, help="listings run together (the gate allows 4)")
    args = parser.parse_args()
    trio.run(main, args.peers, args.window, args.rtt, args.at_once)
