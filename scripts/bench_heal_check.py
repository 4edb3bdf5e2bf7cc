"""What the healer's look costs the event loop, in-process, at 64 / 1,024 / 4,096 records.

Every peer's healer (:class:`inclavate.healer.Healer`) looks once a second, idle or not, on
the event loop that also runs decode steps. This fills a registry table (:func:`p2p.registry.apply`,
signed records, no network) the way a large swarm fills it: four models (24-40 layers),
many replicated ranges, ~5% departed (Dead), ~3% draining, ~2% idle, ~3% silent long
enough to be Degraded or Dead, every peer beating at the cadence's interval
(:class:`p2p.registry.Cadence`); the healer's model has a gap (its only holders are dead),
so a full look runs the whole election. Then, for ``--seconds`` simulated seconds, each
second two heartbeats arrive (what the cadence lets a swarm send, unchanged records but for
their counters) and the healer looks; the look alone is timed:

- ``full``: the look as it was before 2026-12-06's cache (list this model's views, who is
  waited on, plan the move), every second;
- ``healer``: :meth:`inclavate.healer.Healer.check` with the registry's heal key
  (:meth:`p2p.registry.Table.heal_key`): the answers are reused while the key stands;
- ``healer, a change each second``: the same, with a node of the healer's model turning
  draining and back each second (the worst case: a relevant change before every look).

Printed: ms per look (median and max over the seconds) for each. Run pinned
(``taskset -c 1``): ``PYTHONPATH=. python scripts/bench_heal_check.py``.
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import time
from collections.abc import Callable

from inclavate.healer import HealConfig, Healer
from inclavate.types import LayerRange, ModelId, NodeId
from p2p.healing import Settle, plan_heal, waited_on
from p2p.identity import Identity
from p2p.records import NodeRecord, SignedRecord
from p2p.registry import Cadence, Liveness, NodeView, Table, Verdict, apply

LIVE = Liveness()
MODELS = {ModelId("m:a"): (30, 10), ModelId("m:b"): (32, 8), ModelId("m:c"): (24, 6), ModelId("m:d"): (40, 10)}
"""Each model's layers and the width of its peers' spans."""
HEALER_MODEL = ModelId("m:a")
START_MS = 1_800_000_000_000


class Swarm:
    """A registry table filled with ``n`` signed records, and the clock it is read at."""

    def __init__(self, n: int, seed: int = 7) -> None:
        self.rng = random.Random(seed)
        self.beat_ms = int(Cadence().heartbeat_s(n, LIVE) * 1000)
        self.now = START_MS + 3 * 30 * self.beat_ms  # room for silent peers' old records
        self.table = Table()
        self.ids: list[Identity] = []
        self.records: dict[NodeId, NodeRecord] = {}
        self.listings = 0
        arrivals = []
        for i in range(n):
            identity = Identity.generate()
            record = self._record(identity, i)
            silent = self.rng.random() < 0.03  # Degraded (3 beats) or Dead (6) by silence
            ago = self.rng.uniform(3.5, 8) * self.beat_ms if silent else self.rng.uniform(0, self.beat_ms)
            arrivals.append((self.now - int(ago), identity, record))
        for at, identity, record in sorted(arrivals, key=lambda a: a[0]):
            self._apply(identity, record.replace(seq=at, ts_ms=at), at)
            self.ids.append(identity)

    def _record(self, identity: Identity, i: int) -> NodeRecord:
        model = list(MODELS)[i % len(MODELS)]
        n_layers, width = MODELS[model]
        spans = [(s, min(s + width, n_layers)) for s in range(0, n_layers, width)]
        start, end = spans[self.rng.randrange(len(spans))]
        state, draining, idle = "Ready", False, False
        roll = self.rng.random()
        if model == HEALER_MODEL and start == 20:
            state = "Dead"  # the healer's model lost every holder of 20-30: a gap
        elif roll < 0.05:
            state = "Dead"
        elif roll < 0.10:
            state = "Joining"
        elif roll < 0.13 and model != HEALER_MODEL:
            draining = True  # (in the healer's model a mover on its way stops the election)
        elif roll < 0.15:
            idle = True
        return NodeRecord(node_id=NodeId(identity.peer_id), peer_id=identity.peer_id, model_id=model,
                          start_layer=start, end_layer=end, n_layers=n_layers, d_model=576, state=state, draining=draining, idle=idle,  # type: ignore[arg-type]
                          seq=0, ts_ms=0, vram_mb=2048, slim=True, heartbeat_ms=self.beat_ms)  # fmt: skip

    def _apply(self, identity: Identity, record: NodeRecord, at: int) -> None:
        self.table, verdict = apply(self.table, SignedRecord.sign(record, identity), at, LIVE)
        assert verdict is Verdict.ACCEPTED, verdict
        self.records[record.node_id] = record

    def heartbeat(self, changes: dict[str, object] | None = None, node: int | None = None) -> None:
        """One live peer beats (its counters moved, or ``changes``)."""
        identity = self.ids[self.rng.randrange(len(self.ids)) if node is None else node]
        held = self.records[NodeId(identity.peer_id)]
        if held.state == "Dead":
            return
        self._apply(identity, held.replace(seq=max(held.seq + 1, self.now), ts_ms=self.now, uptime_s=held.uptime_s + 1, **(changes or {})), self.now)

    def views(self) -> list[NodeView]:
        """What the peer hands its healer: this model's views (``Peer._model_views``)."""
        self.listings += 1
        return [v for v in self.table.views(self.now, LIVE) if v.record.model_id == HEALER_MODEL]


def full_look(swarm: Swarm) -> None:
    """The look as the healer made it before the cache: list, who is waited on, plan."""
    views = swarm.views()
    waited_on(views, MODELS[HEALER_MODEL][0])
    plan_heal(views, MODELS[HEALER_MODEL][0])


def timed(swarm: Swarm, look: Callable[[], object], seconds: int, each_second: Callable[[int], None]) -> list[float]:
    """ms per look over ``seconds`` simulated seconds, ``each_second`` run (untimed) before each."""
    swarm.listings, spent = 0, []
    for second in range(seconds):
        swarm.now += 1000
        each_second(second)
        t0 = time.perf_counter_ns()
        look()
        spent.append((time.perf_counter_ns() - t0) / 1e6)
    return spent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="64,1024,4096")
    parser.add_argument("--seconds", type=int, default=60)
    args = parser.parse_args()
    logging.getLogger("inclavate.healer").setLevel(logging.ERROR)  # the elected mover never moves here: passed over
    for n in (int(s) for s in args.sizes.split(",")):
        swarm = Swarm(n)
        beats = lambda _: [swarm.heartbeat() for _ in range(2)]  # noqa: E731
        rows = [("full (before)", timed(swarm, lambda: full_look(swarm), args.seconds, beats), swarm.listings)]
        rows += healer_rows(swarm, args.seconds, beats)
        for name, spent, listed in rows:
            print(f"{n:5d} records  {name:30s} {statistics.median(spent):7.3f} ms/look median  {max(spent):7.3f} max"
                  f"  (listed the registry {listed} times in {len(spent)} looks)")
    return 0


def healer_rows(swarm: Swarm, seconds: int, beats: Callable[[int], None]) -> list[tuple[str, list[float], int]]:
    """The healer's own look (:meth:`Healer.check`, keyed by the registry's heal key)."""
    healer, settle = healer_of(swarm), Settle(HealConfig().settle_s)
    look = lambda: healer.check(settle, swarm.now / 1000)  # noqa: E731
    look()  # the first look lists the registry, as every look did before
    rows = [("healer (heartbeats only)", timed(swarm, look, seconds, beats), swarm.listings)]
    ready = [i for i, identity in enumerate(swarm.ids)
             if swarm.records[NodeId(identity.peer_id)].model_id == HEALER_MODEL
             and swarm.records[NodeId(identity.peer_id)].state == "Ready"]  # fmt: skip

    def toggle(second: int) -> None:  # a relevant change before every look: one node drains, then stops
        beats(second)
        node = ready[second // 2 % len(ready)]
        swarm.heartbeat({"draining": second % 2 == 0}, node)

    rows.append(("healer, a change each second", timed(swarm, look, seconds, toggle), swarm.listings))
    return rows


def healer_of(swarm: Swarm) -> Healer:
    async def never(target: LayerRange, still: Callable[[], bool]) -> bool:
        raise AssertionError("the bench only looks")

    return Healer(me=NodeId("bench"), n_layers=MODELS[HEALER_MODEL][0], capacity=10, views=swarm.views,
                  can_move=lambda: True, move=never,
                  version=lambda: swarm.table.heal_key(HEALER_MODEL, swarm.now, LIVE))  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
