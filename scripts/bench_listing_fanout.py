"""What one swarm-wide listing costs the peer that serves it when the registry holds many
identities that each answer a full window of keys: PEERS in-process fake peers (no
network: each answers after RTT with its keys, JSON-encoded once, that the asker parses
and decodes as ``p2p.artifacts.RemoteArtifacts`` does, with
``p2p.artifacts.decode_key_answer``, in the fan-out's second phase where the tree has two
(``key_answer``, ``decode_keys``), else in the ask (``keys``); on a tree before
``decode_key_answer``, with ``decode_answer`` and ``decode_keys`` in one go), one
``limit=100`` page at ``offset = WINDOW - 100``. Prints the listing's wall
time and CPU (this is all event-loop time: nothing here runs in a thread), the longest
stall (``stall``: how late a task sleeping 1 ms at a time woke, at worst: the longest
stretch the event loop ran the listing without letting another task run, the wait a chat
stream on that peer would see), the most asks in flight at once, the peak of memory
allocated during the listing (tracemalloc, in a second run), and of the first run the keys
decoded and the peers left out unasked, by reason. With ``--at-once N``, N listings run at
once (the ``ListingGate`` allows 4): the figures are theirs together.

With ``--jobs``, the swarm-wide job listing instead (``GenerationService.list``): PEERS fake
peers each answer a full window (``WINDOW``, at most 1,000) of honest-looking job rows (a
completed speech job of the peer's own, ~500 bytes), JSON-encoded once, that the asker reads
as ``PeerHttp.read`` hands it (on a tree before it, parsed as ``PeerHttp.json`` does, then
decoded in the fan-out's ``take``); one ``limit=100`` page at ``offset = WINDOW - 100``.
``keys_decoded`` is then the rows answered (an answer cut off by the deadline while it
waited for the decode turn is not decoded), ``left_out`` the job fan-out's.

Run with ``taskset -c N`` and ``PYTHONSAFEPATH=1`` (so ``PYTHONPATH`` picks the tree):
``PYTHONPATH=TREE python scripts/bench_listing_fanout.py [--peers 200] [--window 5000] [--at-once 1] [--jobs]``."""

from __future__ import annotations

import argparse
import gc
import json
import math
import tempfile
import time
import tracemalloc
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

from inclavate.artifact_swarm import SwarmArtifacts
from inclavate.artifact_types import ArtifactMeta, ArtifactPage, KeyPage, ListQuery, Usage
from inclavate.artifacts import ArtifactStore
from inclavate.generations import GenerationService
from inclavate.job_runner import JobRunner
from inclavate.jobs import Job, JobStore
from inclavate.owner_ids import Owners, new_id
from inclavate.types import ModelId, NodeId, PeerId
from inclavate.untrusted import parse_json
import p2p.artifacts
from p2p.artifact_wire import decode_answer, decode_keys, encode
from p2p.identity import Identity
from p2p.records import NodeRecord
from p2p.registry import NodeView


decode_key_answer = getattr(p2p.artifacts, "decode_key_answer", None)
"""What ``RemoteArtifacts.keys`` does with an answer's frame, where the tree has it."""


class _Answering:
    """Fake peers that answer after ``rtt`` seconds, counting the asks in flight."""

    def __init__(self, peers: int, rtt: float) -> None:
        self.rtt, self.in_flight, self.most_in_flight = rtt, 0, 0
        self.names = [f"peer-{i:04}" for i in range(peers)]

    async def _wait(self) -> None:
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await trio.sleep(self.rtt)
        finally:
            self.in_flight -= 1


class FakePeers(_Answering):
    """Each peer lists ``window`` keys, newest first, answered after ``rtt`` seconds."""

    def __init__(self, peers: int, window: int, rtt: float) -> None:
        super().__init__(peers, rtt)
        self.keys_decoded = 0
        self.listed = {name: [(1_700_000_000_000 + window * i + j, new_id(name)) for j in range(window)][::-1]
                     for i, name in enumerate(self.names)}  # fmt: skip
        self.wire = {name: encode({"ok": True, "keys": [list(k) for k in keys], "truncated": True})
                     for name, keys in self.listed.items()}  # fmt: skip

    async def key_answer(self, peer: str, query: ListQuery) -> bytes:
        """The fan-out's first phase (``RemoteArtifacts.key_answer``): the frame."""
        await self._wait()
        return self.wire[peer]

    async def decode_keys(self, peer: str, raw: bytes, query: ListQuery, owners: Owners) -> KeyPage:
        """Its second, in the decode turn (``RemoteArtifacts.decode_keys``)."""
        assert decode_key_answer is not None
        page = await decode_key_answer(raw, peer, query, owners)
        self.keys_decoded += len(page.keys)
        return page

    async def keys(self, peer: str, query: ListQuery, owners: Owners) -> KeyPage:
        """Both in one ask, for a tree before the two phases."""
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


class FakeJobPeers(_Answering):
    """Each peer answers ``GET /v1/generations`` with ``window`` rows of its own jobs, newest
    first, and says it has more, after ``rtt`` seconds (``PeerHttp.read``'s bytes; ``json``
    parses them as ``PeerHttp.json`` does, for a tree before ``read``)."""

    def __init__(self, peers: int, window: int, rtt: float) -> None:
        super().__init__(peers, rtt)
        self.answered = 0
        self.wire = {name: json_bytes({"generations": [_job_row(name, 1_700_000_000_000 + window * i + j)
                                                        for j in reversed(range(window))], "truncated": True})
                     for i, name in enumerate(self.names)}  # fmt: skip

    def views(self) -> list[NodeView]:
        return [NodeView(NodeRecord(node_id=NodeId(name), peer_id=PeerId(name), model_id=ModelId("m:1"), start_layer=0,
                                    end_layer=30, n_layers=30, d_model=576, state="Ready", seq=1, ts_ms=0,
                                    api_url=f"http://{name}"), "Ready")  # type: ignore[arg-type]
                for name in self.names]  # fmt: skip

    async def read(self, base_url: str, method: str, path: str, *, params: Any = None, max_bytes: int = 0,
                   **_: Any) -> tuple[int, bytes]:  # fmt: skip
        await self._wait()
        self.answered += 1
        return 200, self.wire[base_url.removeprefix("http://")]

    async def json(self, base_url: str, method: str, path: str, *, max_bytes: int = 0, **kw: Any) -> tuple[int, Any]:
        status, raw = await self.read(base_url, method, path, max_bytes=max_bytes, **kw)
        return status, parse_json(raw, max_bytes=max_bytes)

    async def aclose(self) -> None:
        pass


def _job_row(peer: str, created_ms: int) -> dict[str, Any]:
    """A completed speech job of ``peer``'s, as its route lists it."""
    return Job(id=new_id(peer), state="completed", modality="audio", model="piper:en_US-lessac-medium",
               params={"text": "The quick brown fox jumps over the lazy dog, twice over.", "voice": "lessac",
                       "speed": 1.0, "format": "wav"}, seed=1234567, input_artifacts=(),
               output_artifacts=(new_id(peer),), progress_stage="done", progress_fraction=1.0, error_code=None,
               error_message=None, created_ms=created_ms, started_ms=created_ms + 40, completed_ms=created_ms + 900,
               expires_ms=created_ms + 86_400_000, idempotency_key=None, attempts=1, cancel_requested=False,
               version=3).to_json()  # fmt: skip


def json_bytes(body: Any) -> bytes:
    return json.dumps(body).encode()


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


async def listings(list_once: Callable[[], Awaitable[int]], at_once: int) -> tuple[int, float, float, float]:
    """``at_once`` listings together: rows of the first, wall, CPU, and the longest stall."""
    ticker, listed = Ticker(), []

    async def one() -> None:
        listed.append(await list_once())

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

        async def list_once() -> int:
            return len((await swarm.list(query)).artifacts)

        (listed, wall, cpu, stall), (decoded, dropped), peak = await measured(
            list_once, at_once, lambda: (fakes.keys_decoded, left_out(swarm)))
        store.close()
    report(peers, window, rtt, at_once, listed, wall, cpu, stall, decoded, dropped, fakes.most_in_flight, peak)


async def main_jobs(peers: int, window: int, rtt: float, at_once: int) -> None:
    fakes = FakeJobPeers(peers, window, rtt)
    gc.freeze()
    with tempfile.TemporaryDirectory() as d:
        me = Identity.generate().peer_id
        store = ArtifactStore(Path(d), me)
        runner = JobRunner(JobStore.in_dir(Path(d)), store, {}, me, read_input=None)  # type: ignore[arg-type]
        views = fakes.views()
        service = GenerationService(me, runner, SwarmArtifacts(store), lambda: views, fakes)  # type: ignore[arg-type]

        async def list_once() -> int:
            return len((await service.list(100, window - 100, local_only=False))[0])

        (listed, wall, cpu, stall), (answered, dropped), peak = await measured(
            list_once, at_once, lambda: (fakes.answered * window, str(service._fan_out.left_out.snapshot())))
        store.close()
    report(peers, window, rtt, at_once, listed, wall, cpu, stall, answered, dropped, fakes.most_in_flight, peak)


async def measured(list_once: Callable[[], Awaitable[int]], at_once: int,
                   counters: Callable[[], tuple[int, str]]) -> tuple[tuple[int, float, float, float], tuple[int, str], int]:  # fmt: skip
    """:func:`listings` once for time (then ``counters``: what that run decoded and left out),
    once more for the peak of memory allocated (tracemalloc slows it)."""
    timed = await listings(list_once, at_once)
    counted = counters()
    tracemalloc.start()
    await listings(list_once, at_once)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return timed, counted, peak


def report(peers: int, window: int, rtt: float, at_once: int, listed: int, wall: float, cpu: float, stall: float,
           decoded: int, dropped: str, in_flight: int, peak: int) -> None:  # fmt: skip
    print(f"peers={peers} window={window} rtt={rtt * 1000:.0f} ms at_once={at_once} listed={listed} "
          f"wall={wall * 1000:.0f} ms cpu={cpu * 1000:.0f} ms stall={math.ceil(stall * 1000)} ms "
          f"keys_decoded={decoded} left_out={dropped} most_in_flight={in_flight} "
          f"peak_alloc={peak / 2**20:.0f} MiB")  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--peers", type=int, default=200)
    parser.add_argument("--window", type=int, default=5000)
    parser.add_argument("--rtt", type=float, default=0.005, help="seconds each fake peer takes to answer")
    parser.add_argument("--at-once", type=int, default=1, help="listings run together (the gate allows 4)")
    parser.add_argument("--jobs", action="store_true", help="the job listing (window at most 1,000)")
    args = parser.parse_args()
    trio.run(main_jobs if args.jobs else main, args.peers, args.window, args.rtt, args.at_once)
