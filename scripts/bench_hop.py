"""What a hop costs in Python, without the noise of other processes: three stages, three
libp2p hosts and their direct links in **one** process, one session decoding through them.

Each round times one chain step (entry -> stage 1 -> 2 -> 3 -> token home, every frame
encoded, sealed, written to a loopback socket, read, checked and queued as between peers),
then the same three engine calls made directly on a second session. The difference is what
the chain adds: framing, sealing, codec, checks, queues, scheduler turns, and the cold
caches each engine call leaves behind. There are no cross-process wake-ups and no other
processes to share the core with, so this figure moves far less between runs than
``scripts/bench_chain --sections pinned`` (which includes both) and suits A/B comparisons
of two trees:

    PYTHONSAFEPATH=1 PYTHONPATH=<tree> python scripts/bench_hop.py [--stripped]

``--stripped`` also times, in turns with the peer's hop, a yardstick hop with nothing
between the engine call and the link (no checks, admission, stage, kept outputs or
counters): the difference is what the peer's own layers cost, with the machine's drift
cancelled (the peer's turns then keep no outputs, since every other position is missing;
keeping them was measured not to move the figure).

A trio instrument splits the chain's time by task (the receiving handler, the stage worker,
the link writer) and counts their steps per token (scheduler turns). "Per hop" divides by
the three frames of a step that cross a link (stage 1 -> 2, 2 -> 3, 3 -> entry); the
entry's own frame to stage 1 stays in its process. A throwaway harness, not a peer: no
registry, no HTTP, no generation loop.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import time
from typing import Any

import numpy as np
import trio

from inclavate import tensors
from inclavate.catalog import Catalog
from inclavate.config import inclavate_home
from inclavate.gguf_info import read_gguf_info
from inclavate.store import ModelStore
from inclavate.types import LayerRange, ModelId, NodeId, SessionId
from node.engine import BatchItem, EngineConfig
from node.engine_thread import EngineThread
from node.engines import load_engine
from node.sampling import SamplingParams
from node.stage import Stage
from p2p import wire
from p2p.forward import ForwardService
from p2p.host import open_host
from p2p.identity import Identity
from p2p.records import NodeRecord, SignedRecord, now_ms
from p2p.registry import Liveness, Table, apply
from p2p.routing import Hop

LINK_FRAMES = 3


class TaskTime(trio.abc.Instrument):
    """Time and steps per task (by its function's name) while ``on``."""

    def __init__(self) -> None:
        self.on = False
        self.seconds: collections.Counter[str] = collections.Counter()
        self.steps: collections.Counter[str] = collections.Counter()
        self._started = 0.0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self._started = time.perf_counter()

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        if self.on:
            name = ".".join(task.name.split(".")[-2:])
            self.seconds[name] += time.perf_counter() - self._started
            self.steps[name] += 1


async def measure(model_path: Any, model_id: str, n_layers: int, rounds: int, instrument: TaskTime,
                  with_stripped: bool = False) -> dict[str, float]:  # fmt: skip
    third = n_layers // 3
    ranges = [LayerRange(0, third), LayerRange(third, 2 * third), LayerRange(2 * third, n_layers)]
    async with open_host(Identity.generate()) as a, open_host(Identity.generate()) as b, \
            open_host(Identity.generate()) as c, trio.open_nursery() as nursery:  # fmt: skip
        hosts = [a, b, c]
        services, engines = [], []
        for host, layers in zip(hosts, ranges):
            thread = EngineThread(f"engine {layers}")
            engine = await thread.run(lambda layers=layers: load_engine(
                "llamacpp", model_id=ModelId(model_id), model_path=model_path, layers=layers, config=EngineConfig(n_threads=1)))  # fmt: skip
            stage = Stage(engine, engine_thread=thread, inline_tokens=8, keep_outputs="f16")  # a peer's defaults at 1 thread
            await nursery.start(stage.run)
            service = ForwardService(host, node_id=NodeId(host.peer_id), stage=stage)
            await nursery.start(service.run)
            services.append(service)
            engines.append(engine)
        for x, y in ((a, b), (b, c), (c, a)):
            await x.connect(y.multiaddrs()[0])
        table = _registry([(host, layers) for host, layers in zip(hosts, ranges)], ModelId(model_id), n_layers,
                          engines[0].info.d_model)  # fmt: skip
        for service in services:  # wired as a peer wires them: every frame checked against the registry
            service.record_of = lambda node_id: entry.record if (entry := table.get(node_id)) else None
            service.records_signed_by = table.records_signed_by
            service.registry_table = lambda: table
        route = tuple(Hop(NodeId(h.peer_id), h.peer_id, layers) for h, layers in zip(hosts, ranges))
        entry, session = services[0], SessionId("chain")
        inbox = entry.open_inbox(session)
        greedy = SamplingParams(0.0, 1.0, 0)

        # As a leg sends them (p2p/chain.py): carrying the step context of their fields (a
        # tree before 2026-12-07 03:00 has no step_context: kept runnable for A/B runs).
        step_context = getattr(wire, "step_context", lambda _: None)
        context = step_context(wire.Forward(0, session, 0, route, a.peer_id, greedy, tokens=np.zeros(0, np.int32)))

        async def step(req: int, pos: int, tokens: list[int]) -> int:
            await entry.send(a.peer_id, wire.Forward(req, session, pos, route, a.peer_id, greedy, tokens=np.array(tokens, np.int32),
                                                     context=context))  # fmt: skip
            while True:
                msg = await inbox.receive()
                if isinstance(msg, wire.Result) and msg.req_id == req and msg.token is not None:
                    return msg.token
                if isinstance(msg, wire.Error):
                    raise RuntimeError(f"the chain failed: {msg.message}")

        def engines_alone(pos: int, token: int) -> int:
            out = engines[0].forward([BatchItem(SessionId("alone"), pos, tokens=np.array([token], np.int32))])[0]
            out = engines[1].forward([BatchItem(SessionId("alone"), pos, hidden=out.hidden)])[0]
            out = engines[2].forward([BatchItem(SessionId("alone"), pos, hidden=out.hidden)])[0]
            assert out.logits is not None
            return int(np.argmax(out.logits[-1]))

        token, pos = await step(1, 0, [1, 2, 3, 4, 5]), 5
        for i in range(30):  # warm up: links open, caches filled
            token, pos = await step(2 + i, pos, [token]), pos + 1
        alone_token, alone_pos = token, 0
        chain_s, alone_s, stripped_added_s = [], [], []
        for i in range(rounds):
            for stripped in (False, True) if with_stripped else (False,):
                ForwardService._on_forward = _stripped_on_forward if stripped else _PEER_ON_FORWARD  # type: ignore[method-assign]
                instrument.on = not stripped
                started = time.perf_counter()
                token, pos = await step(100 + 2 * i + stripped, pos, [token]), pos + 1
                between = time.perf_counter()
                alone_token, alone_pos = engines_alone(alone_pos, alone_token), alone_pos + 1
                if stripped:
                    stripped_added_s.append((between - started) - (time.perf_counter() - between))
                else:
                    chain_s.append(between - started)
                    alone_s.append(time.perf_counter() - between)
        ForwardService._on_forward = _PEER_ON_FORWARD  # type: ignore[method-assign]
        instrument.on = False
        nursery.cancel_scope.cancel()
    added = statistics.median(c - e for c, e in zip(chain_s, alone_s))
    figures = {"chain_ms": statistics.median(chain_s) * 1e3, "alone_ms": statistics.median(alone_s) * 1e3,
               "added_ms": added * 1e3, "hop_ms": added * 1e3 / LINK_FRAMES}  # fmt: skip
    if stripped_added_s:
        figures["stripped_hop_ms"] = statistics.median(stripped_added_s) * 1e3 / LINK_FRAMES
    return figures


_PEER_ON_FORWARD = ForwardService._on_forward


def _registry(holders: list[tuple[Any, LayerRange]], model_id: ModelId, n_layers: int, d_model: int) -> Table:
    """The registry every peer keeps, holding each host's signed record of its range (it holds
    still here: in a swarm each heartbeat replaces it, a few times a second)."""
    table, now = Table(), now_ms()
    for host, layers in holders:
        record = NodeRecord(node_id=NodeId(host.peer_id), peer_id=host.peer_id, model_id=model_id, start_layer=layers.start,
                            end_layer=layers.end, n_layers=n_layers, d_model=d_model, state="Ready", seq=now, ts_ms=now)  # fmt: skip
        table, _ = apply(table, SignedRecord.sign(record, host.identity), now, Liveness())
    return table


async def _stripped_on_forward(self: ForwardService, msg: wire.Forward, remote: Any) -> None:
    """A yardstick, not a peer: a step frame's engine call with nothing around it (no route
    or input checks, no admission, no stage, no kept outputs, no counters), its output sent
    on through the same codec and links. What a peer's hop costs above this is what its
    own layers cost; measured in the same process, in turns with the peer's hop, so that the
    machine's drift from minute to minute cancels out of the difference."""
    stage = self.stage
    if stage is None or msg.n_tokens != 1:
        await _PEER_ON_FORWARD(self, msg, remote)
        return
    hidden = tensors.decode(msg.hidden) if msg.hidden is not None else None
    out = stage.engine.forward([BatchItem(msg.session_id, msg.start_pos, tokens=msg.tokens, hidden=hidden)])[0]
    if out.hidden is not None:
        nxt = wire.Forward(msg.req_id, msg.session_id, msg.start_pos, msg.route[1:], msg.reply_to, msg.sampling,
                           hidden=tensors.encode(out.hidden, self.wire_dtype), lane=msg.lane)  # fmt: skip
        await self.send(nxt.route[0].peer_id, nxt)
    else:
        assert out.logits is not None
        await self.send(msg.reply_to, wire.Result(msg.req_id, msg.session_id, int(np.argmax(out.logits[-1]))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2:135m")
    parser.add_argument("--rounds", type=int, default=300, help="decode steps measured (each also run on the engines alone)")
    parser.add_argument("--stripped", action="store_true",
                        help="also time, in turns with the peer's hop, a stripped hop (the engine call and the links, "
                             "nothing between them): the difference is what the peer's own layers cost")  # fmt: skip
    args = parser.parse_args()
    home = inclavate_home()
    spec = Catalog.load(home).get(args.model)
    pulled = ModelStore(home).pull(spec)
    n_layers = read_gguf_info(pulled.path).n_layers
    instrument = TaskTime()
    figures = trio.run(measure, pulled.path, spec.model_id, n_layers, args.rounds, instrument, args.stripped,
                       instruments=[instrument])  # fmt: skip
    print(f"bench_hop: {args.model}, 3 stages of {n_layers // 3} layers in one process, 1 engine thread, "
          f"{args.rounds} decode steps (pid {os.getpid()})")  # fmt: skip
    print(f"step through the chain {figures['chain_ms']:.2f} ms, the three engines alone {figures['alone_ms']:.2f} ms (median)")
    print(f"added per step {figures['added_ms']:.3f} ms; per hop {figures['hop_ms']:.3f} ms (median difference / {LINK_FRAMES} links)")
    if "stripped_hop_ms" in figures:
        print(f"a stripped hop, in turns: {figures['stripped_hop_ms']:.3f} ms; the peer's layers add "
              f"{figures['hop_ms'] - figures['stripped_hop_ms']:.3f} ms a hop")  # fmt: skip
    print("time per token by task (engine calls run inside the stage worker's steps):")
    for name, seconds in instrument.seconds.most_common(6):
        print(f"  {name:44s} {seconds / args.rounds * 1e6:8.0f} us  {instrument.steps[name] / args.rounds:4.1f} steps")


if __name__ == "__main__":
    main()
