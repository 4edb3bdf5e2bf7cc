"""The Python around one engine call: a lone decode step through ``LlamaCppEngine._step``
(the short path every token of a session decoding alone takes) and through the batch path,
in turns, for each range of a 3-range split, in one process.

Every hop of a chain pays this once a token, and right after the previous step's compute has
left the caches cold, where each line of Python costs several times what it costs warm. The
figure is a call's time less its ``llama_decode``; each step of the two paths feeds a session
of its own the same inputs, one after the other, so both run on the same caches::

    PYTHONSAFEPATH=1 PYTHONPATH=. python scripts/bench_engine_call.py [--steps 300]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np

import node.llamacpp_engine as llamacpp_engine
from inclavate.catalog import Catalog
from inclavate.config import inclavate_home
from inclavate.store import ModelStore
from inclavate.types import LayerRange, ModelId, SessionId
from node.engine import BatchItem, EngineConfig
from node.engines import load_engine


class DecodeTimer:
    """Stands in for ``llama_cpp.llama_decode`` in the engine's module, timing each call."""

    def __init__(self, decode: Any) -> None:
        self.decode = decode
        self.last_s = 0.0

    def __call__(self, ctx: Any, batch: Any) -> int:
        started = time.perf_counter()
        code = self.decode(ctx, batch)
        self.last_s = time.perf_counter() - started
        return code


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2:135m")
    parser.add_argument("--steps", type=int, default=300, help="decode steps (at most 500)")
    args = parser.parse_args()
    if not 20 < args.steps <= 500:
        parser.error("--steps must be from 21 to 500 (the engines' context is 512)")
    home = inclavate_home()
    spec = Catalog.load(home).get(args.model)
    path = ModelStore(home).pull(spec).path
    third = spec.n_layers // 3
    cuts = [(0, third), (third, 2 * third), (2 * third, spec.n_layers)]
    engines = [load_engine("llamacpp", model_id=ModelId(spec.model_id), model_path=path, layers=LayerRange(a, b),
                           config=EngineConfig(n_threads=1, context_length=512)) for a, b in cuts]  # fmt: skip
    timer = DecodeTimer(llamacpp_engine.llama_cpp.llama_decode)
    llamacpp_engine.llama_cpp.llama_decode = timer  # type: ignore[assignment]
    rng = np.random.default_rng(0)
    around: dict[tuple[int, str], list[float]] = {(i, p): [] for i in range(3) for p in ("short", "batch")}
    for pos in range(args.steps):
        hidden = rng.standard_normal((1, engines[1].info.d_model)).astype(np.float32)
        token = np.array([rng.integers(0, engines[0].info.n_vocab)], np.int32)
        for i, engine in enumerate(engines):
            for path_name in ("short", "batch"):
                if path_name == "batch":
                    engine._step = lambda _item: None  # type: ignore[method-assign]
                item = BatchItem(SessionId(path_name), pos, tokens=token) if i == 0 else \
                    BatchItem(SessionId(path_name), pos, hidden=hidden)  # fmt: skip
                started = time.perf_counter()
                engine.forward([item])
                took = time.perf_counter() - started
                if path_name == "batch":
                    del engine._step  # back to the class's
                if pos >= 20:  # past the first steps' allocations
                    around[(i, path_name)].append(took - timer.last_s)
    print(f"{spec.model_id}, ranges {cuts}, {args.steps} steps, 1 thread: Python around one call, median us")
    for i, (a, b) in enumerate(cuts):
        short, batch = (statistics.median(around[(i, p)]) * 1e6 for p in ("short", "batch"))
        print(f"  layers {a}-{b}: short path {short:6.1f}, batch path {batch:6.1f}, short/batch {short / batch:.2f}")
    for engine in engines:
        engine.close()


if __name__ == "__main__":
    main()
