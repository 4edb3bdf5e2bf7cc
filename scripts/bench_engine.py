"""Speed of the layer-range technique: a 3-range in-process chain against the whole model.

Both run in this process, on the same machine, alternating, so background noise hits both;
the best of several rounds is reported. Hidden states cross each boundary through the wire
codec, as they would between processes.

``--engine mlx`` instead compares the MLX engine with llama.cpp on this machine (the whole
model on each, tokens/s side by side), then measures how far a mixed chain (llama.cpp,
MLX, llama.cpp ranges) agrees with the whole llama.cpp model, greedy, on a few chat prompts.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from inclavate import tensors
from inclavate.catalog import Catalog
from inclavate.config import inclavate_home
from inclavate.store import ModelStore
from inclavate.types import LayerRange, ModelId, SessionId
from node.engine import BatchItem, EngineConfig, LayerEngine
from node.llamacpp_engine import LlamaCppEngine

TARGET_DECODE, TARGET_PREFILL = 0.95, 0.95


def run(engines: list[LayerEngine], prompt: np.ndarray, n_decode: int, wire: str) -> tuple[float, float]:
    """Seconds for the prefill and for ``n_decode`` greedy steps."""
    sid = SessionId("bench")

    def step(tokens: np.ndarray, pos: int) -> int:
        items = [BatchItem(sid, pos, tokens=tokens)]
        for engine in engines:
            (out,) = engine.forward(items)
            if out.logits is not None:
                return int(np.argmax(out.logits))
            hidden = tensors.decode(tensors.encode(out.hidden, wire))
            items = [BatchItem(sid, pos, hidden=hidden)]
        raise AssertionError("no last range")

    try:
        t0 = time.perf_counter()
        token = step(prompt, 0)
        t1 = time.perf_counter()
        pos = len(prompt)
        for _ in range(n_decode):
            token = step(np.array([token], np.int32), pos)
            pos += 1
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1
    finally:
        for engine in engines:
            engine.close_session(sid)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2:135m")
    parser.add_argument("--cuts", default="10,20", help="layer boundaries of the chain")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--wire-dtype", default="f16", choices=tensors.WIRE_DTYPES)
    parser.add_argument("--engine", default="llamacpp", choices=("llamacpp", "mlx"),
                        help="mlx: MLX against llama.cpp, and a mixed chain's greedy agreement")  # fmt: skip
    args = parser.parse_args()
    if args.engine == "mlx":
        from bench_mlx import main_mlx

        return main_mlx(args)

    home = inclavate_home()
    spec = Catalog.load(home).get(args.model)
    path = ModelStore(home).pull(spec).path
    config = EngineConfig(context_length=args.prompt_tokens + args.decode_tokens + 8, max_sessions=1)
    if args.threads:
        config = EngineConfig(n_threads=args.threads, context_length=config.context_length, max_sessions=1)
    cuts = [int(c) for c in args.cuts.split(",")]
    bounds = [0, *cuts, spec.n_layers]

    def engine(r: LayerRange) -> LayerEngine:
        return LlamaCppEngine(
            model_id=ModelId(spec.model_id), model_path=path, model_sha256=spec.gguf_sha256,
            layers=r, config=config, slice_cache=home / "slices",
        )

    whole = [engine(LayerRange(0, spec.n_layers))]
    chain = [engine(LayerRange(a, b)) for a, b in zip(bounds, bounds[1:])]
    prompt = np.random.default_rng(0).integers(100, 40000, args.prompt_tokens).astype(np.int32)
    print(f"model {spec.model_id}, chain {' '.join(str(r.info.layers) for r in chain)}, "
          f"{config.n_threads} threads, prompt {args.prompt_tokens} tokens, "
          f"decode {args.decode_tokens} tokens, wire {args.wire_dtype}, best of {args.rounds}")
    best = {"whole": [float("inf")] * 2, "chain": [float("inf")] * 2}
    run(whole, prompt, 4, args.wire_dtype)  # warm caches and page in the weights
    run(chain, prompt, 4, args.wire_dtype)
    for _ in range(args.rounds):
        for name, engines in (("whole", whole), ("chain", chain)):
            times = run(engines, prompt, args.decode_tokens, args.wire_dtype)
            best[name] = [min(a, b) for a, b in zip(best[name], times)]
    rates = {
        name: (args.prompt_tokens / p, args.decode_tokens / d) for name, (p, d) in best.items()
    }
    prefill_ratio = rates["chain"][0] / rates["whole"][0]
    decode_ratio = rates["chain"][1] / rates["whole"][1]
    print(f"{'':8}{'prefill tok/s':>15}{'decode tok/s':>15}")
    for name, (p, d) in rates.items():
        print(f"{name:8}{p:15.1f}{d:15.1f}")
    print(f"{'ratio':8}{prefill_ratio:15.3f}{decode_ratio:15.3f}")
    ok = decode_ratio >= TARGET_DECODE and prefill_ratio >= TARGET_PREFILL
    print(f"target: decode >= {TARGET_DECODE}, prefill >= {TARGET_PREFILL}: {'met' if ok else 'NOT met'}")
    for e in whole + chain:
        e.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
