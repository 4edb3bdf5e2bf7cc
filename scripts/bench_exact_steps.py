"""What ``--exact-steps`` costs: a lone session's one-token steps on an engine holding the
whole model, at the peer's default thread count (all cores), with and without it, in turns.

Past position 256 llama.cpp's split-KV flash attention sums a one-token step in an order that
depends on the thread count; ``--exact-steps`` runs those steps on one thread so that text
does not change with concurrency or after a failover (``node/llamacpp_engine.py``,
``LlamaCppEngine._set_threads``). Below 256 both run the same way, so the first window is the
yardstick for the machine's noise::

    PYTHONSAFEPATH=1 PYTHONPATH=. python scripts/bench_exact_steps.py [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from inclavate.catalog import Catalog
from inclavate.config import inclavate_home
from inclavate.store import ModelStore
from inclavate.types import LayerRange, ModelId, SessionId
from node.engine import BatchItem, EngineConfig, LayerEngine, default_threads
from node.engines import load_engine

WINDOWS = (100, 400, 1200)
"""Where each measured run of steps starts (positions)."""


def median_step_ms(engine: LayerEngine, start: int, steps: int, rng: np.random.Generator) -> float:
    """A session prefilled to ``start``, then ``steps`` one-token steps: their median time."""
    session = SessionId(f"bench-{start}")
    engine.forward([BatchItem(session, 0, tokens=rng.integers(100, 20000, start).astype(np.int32))])
    times = []
    for pos in range(start, start + steps):
        began = time.perf_counter()
        engine.forward([BatchItem(session, pos, tokens=np.array([5], np.int32))])
        times.append(time.perf_counter() - began)
    engine.close_session(session)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2:135m")
    parser.add_argument("--threads", type=int, default=default_threads(), help="engine threads (default: all cores)")
    parser.add_argument("--steps", type=int, default=150, help="steps per window")
    parser.add_argument("--rounds", type=int, default=2, help="rounds, each window taken in turns")
    args = parser.parse_args()
    home = inclavate_home()
    spec = Catalog.load(home).get(args.model)
    path = ModelStore(home).pull(spec).path
    rng = np.random.default_rng(0)
    engines = {exact: load_engine("llamacpp", model_id=ModelId(spec.model_id), model_path=path, layers=LayerRange(0, spec.n_layers),
                                  config=EngineConfig(n_threads=args.threads, context_length=2048, max_sessions=1, exact_steps=exact))
               for exact in (False, True)}  # fmt: skip
    print(f"bench_exact_steps: {args.model} whole, {args.threads} threads, a lone session, median of {args.steps} steps")
    ratios: dict[int, list[float]] = {start: [] for start in WINDOWS}
    for round_ in range(args.rounds):
        for start in WINDOWS:
            fast = median_step_ms(engines[False], start, args.steps, rng)
            exact = median_step_ms(engines[True], start, args.steps, rng)
            ratios[start].append(exact / fast)
            print(f"round {round_ + 1}, positions {start}-{start + args.steps}: default {fast:.2f} ms a step, "
                  f"--exact-steps {exact:.2f} ms ({exact / fast:.2f}x)")  # fmt: skip
    for start in WINDOWS:
        print(f"positions from {start}: --exact-steps costs {statistics.median(ratios[start]):.2f}x a step (median of rounds)")


if __name__ == "__main__":
    main()
