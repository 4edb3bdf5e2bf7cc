"""The floor under a chain of peer processes: the same engines, nothing else.

Each stage runs in a bare process that blocks on a pipe, computes its range and writes the
hidden states to the next one (raw float32 bytes over a Unix socket); the first stage also
samples greedily from the last stage's token and starts the next step. No event loop, no
framing, no encryption, no checks. The whole model runs the same loop in one process.

What the bare chain loses against the bare whole is what any chain of processes pays on
this machine, whatever its code: the engine calls' caches left cold by the other
processes, and the kernel waking each process in turn. ``scripts/bench_chain`` measures it
beside the peers, in turns, so that a peer chain's ratio can be read against this floor
and the time it adds per hop above it is the peers' own cost.
"""

from __future__ import annotations

import multiprocessing
import pickle
import statistics
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np

from inclavate.types import LayerRange, ModelId, SessionId
from node.engine import BatchItem, EngineConfig, LayerEngine

_HIDDEN, _STATS = b"H", b"S"
_ANSWER_S = 300
"""Longest a run may take, model loading included."""
_PROMPT = np.arange(1, 6, dtype=np.int32)


@dataclass(frozen=True)
class BareRun:
    step_ms: float
    """Median decode step, the first stage's start to the sampled token back at it."""
    engine_ms: float
    """Median engine-call time per step, summed over the stages."""
    cpu_ms: float
    """CPU per step, every stage's process."""

    @property
    def decode(self) -> float:
        return 1000 / self.step_ms

    @property
    def outside_ms(self) -> float:
        return self.step_ms - self.engine_ms


@dataclass(frozen=True)
class _Spec:
    model_id: str
    model_path: Path
    layers: LayerRange
    config: EngineConfig


def _load(spec: _Spec) -> LayerEngine:
    from node.engines import load_engine  # in the child: the parent loads no model

    return load_engine("llamacpp", model_id=ModelId(spec.model_id), model_path=spec.model_path,
                       layers=spec.layers, config=spec.config)  # fmt: skip


def _stage(spec: _Spec, inbox: Connection, outbox: Connection, control: Connection | None) -> None:
    """One stage's process. With ``control`` it is the first: it runs the steps asked for
    there (the token comes back on ``inbox`` from the last stage) and answers with every
    stage's timings; the others serve ``inbox`` until it closes."""
    engine = _load(spec)
    session = SessionId("bare")
    calls: list[float] = []
    cpu = time.process_time()

    def run(item: BatchItem) -> bytes:
        started = time.perf_counter()
        out = engine.forward([item])[0]
        calls.append(time.perf_counter() - started)
        if out.logits is not None:
            return _HIDDEN + np.array([np.argmax(out.logits[-1])], np.int32).tobytes()
        assert out.hidden is not None
        return _HIDDEN + out.hidden.astype(np.float32).tobytes()

    def restart() -> None:
        nonlocal cpu
        engine.close_session(session)
        calls.clear()
        cpu = time.process_time()

    if control is None:
        pos = 0
        while True:
            try:
                frame = inbox.recv_bytes()
            except EOFError:
                return
            if frame[:1] == _STATS:  # the first stage collects every stage's timings
                stats = pickle.loads(frame[1:]) + [(calls[1:], time.process_time() - cpu)]
                outbox.send_bytes(_STATS + pickle.dumps(stats))
                continue
            hidden = np.frombuffer(frame, np.float32, offset=1).reshape(-1, engine.info.d_model)
            if hidden.shape[0] > 1:  # a prompt: a new run
                restart()
                pos = 0
            outbox.send_bytes(run(BatchItem(session, pos, hidden=hidden.copy())))
            pos += hidden.shape[0]
    while (request := control.recv()) is not None:
        restart()
        tokens, pos, times = _PROMPT, 0, []
        for _ in range(int(request) + 1):
            started = time.perf_counter()
            outbox.send_bytes(run(BatchItem(session, pos, tokens=tokens)))
            back = inbox.recv_bytes()
            times.append(time.perf_counter() - started)
            pos += len(tokens)
            tokens = np.frombuffer(back, np.int32, offset=1)[:1].copy()
        outbox.send_bytes(_STATS + pickle.dumps([(calls[1:], time.process_time() - cpu)]))
        control.send((times[1:], pickle.loads(inbox.recv_bytes()[1:])))


def _whole(spec: _Spec, control: Connection) -> None:
    """The whole model in one process, the same loop with no hand-off."""
    engine = _load(spec)
    session = SessionId("bare")
    while (request := control.recv()) is not None:
        engine.close_session(session)
        tokens, pos, times = _PROMPT, 0, []
        cpu = time.process_time()
        for _ in range(int(request) + 1):
            started = time.perf_counter()
            out = engine.forward([BatchItem(session, pos, tokens=tokens)])[0]
            assert out.logits is not None
            pos += len(tokens)
            tokens = np.array([np.argmax(out.logits[-1])], np.int32)
            times.append(time.perf_counter() - started)
        control.send((times[1:], [(times[1:], time.process_time() - cpu)]))


class BareSetup:
    """A bare chain (one range per process) or, with one range, the bare whole model."""

    def __init__(self, model_id: str, model_path: Path, ranges: list[LayerRange], config: EngineConfig) -> None:
        ctx = multiprocessing.get_context("spawn")  # no fork of a parent that has threads
        self._control, child_control = ctx.Pipe()
        self._processes: list[multiprocessing.process.BaseProcess] = []
        specs = [_Spec(model_id, model_path, layers, config) for layers in ranges]
        links = []
        if len(specs) == 1:
            self._processes.append(ctx.Process(target=_whole, args=(specs[0], child_control), daemon=True))
        else:
            links = [ctx.Pipe() for _ in specs]  # links[i]: stage i -> stage i + 1 (the last: -> the first)
            for i, spec in enumerate(specs):
                inbox = links[i - 1][1]
                self._processes.append(ctx.Process(target=_stage, args=(spec, inbox, links[i][0], child_control if i == 0 else None),
                                                   daemon=True))  # fmt: skip
        for process in self._processes:
            process.start()
        child_control.close()  # the children hold their ends: a stage's exit ends the next one's inbox
        for a, b in links if len(specs) > 1 else ():
            a.close()
            b.close()

    def run(self, steps: int) -> BareRun:
        """``steps`` decode steps after a 5-token prompt (prompt included in the CPU)."""
        self._control.send(steps)
        if not self._control.poll(_ANSWER_S):  # a stage died (its log is above): fail, never hang
            raise RuntimeError(f"the bare processes did not answer within {_ANSWER_S} s")
        times, stages = self._control.recv()
        engine = np.sum([calls for calls, _ in stages], axis=0)  # per step, summed over the stages
        cpu = sum(seconds for _, seconds in stages)
        return BareRun(statistics.median(times) * 1000, float(np.median(engine)) * 1000, cpu * 1000 / steps)

    def __enter__(self) -> BareSetup:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        self._control.send(None)
        for process in self._processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()


def main() -> None:
    import argparse

    from inclavate.catalog import Catalog
    from inclavate.config import inclavate_home
    from inclavate.generate_cmd import split_evenly
    from inclavate.store import ModelStore

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2:135m")
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    home = inclavate_home()
    spec = Catalog.load(home).get(args.model)
    path = ModelStore(home).pull(spec).path
    config = EngineConfig(n_threads=args.threads)
    if args.steps + len(_PROMPT) > config.context_length:
        parser.error(f"--steps must leave room for the {len(_PROMPT)}-token prompt in {config.context_length} positions")
    setups = {"whole": BareSetup(spec.model_id, path, [LayerRange(0, spec.n_layers)], config),
              "chain": BareSetup(spec.model_id, path, split_evenly(spec.n_layers, args.peers), config)}  # fmt: skip
    best: dict[str, BareRun] = {}
    with setups["whole"], setups["chain"]:
        for _ in range(args.rounds):
            for name, setup in setups.items():
                run = setup.run(args.steps)
                if name not in best or run.step_ms < best[name].step_ms:
                    best[name] = run
    for name, run in best.items():
        print(f"{name:6} step {run.step_ms:6.2f} ms  engines {run.engine_ms:6.2f} ms  outside {run.outside_ms:5.2f} ms  "
              f"CPU {run.cpu_ms:6.2f} ms per step")
    print(f"bare chain/whole decode: {best['chain'].decode / best['whole'].decode:.3f}")


if __name__ == "__main__":
    main()
