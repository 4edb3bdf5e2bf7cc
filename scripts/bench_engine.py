"""Speed of the layer-range technique: a 3-range in-process chain against the whole model.

Both run in this process, on the same machine, alternating, so background noise hits both;
the best of several rounds is reported. Hidden states cross each boundary through the wire
codec, as they would between processes.

``--sessions N`` (default 8; 0 skips it) then times the whole model's engine decoding N
sessions at once, one step of every session per call, against llama.cpp's own batched decode
of the same N sequences (``bench_llama_worker.batched``), in this process and in turns: what
the engine's code costs a batched step, apart from a peer's event loop, HTTP and clients (the
share of ``bench_peer``'s section 2 that is the engine's).

``--engine mlx`` instead compares the MLX engine with llama.cpp on this machine (the whole
model on each, tokens/s side by side), then measures how far a mixed chain (llama.cpp,
MLX, llama.cpp ranges) agrees with the whole llama.cpp model, greedy, on a few chat prompts.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

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


def batched_steps(engine: LayerEngine, prompt: list[int], sessions: int, steps: int) -> float:
    """Seconds per step of ``steps`` greedy decode steps, every session's in one call, after
    each session is prefilled with ``prompt`` (as ``bench_llama_worker.batched`` is asked to)."""
    sids = [SessionId(f"batched-{i}") for i in range(sessions)]
    try:
        last = []
        for sid in sids:
            (out,) = engine.forward([BatchItem(sid, 0, tokens=np.array(prompt, np.int32))])
            last.append(int(np.argmax(out.logits[-1])))
        started = time.perf_counter()
        for step in range(steps):
            outs = engine.forward([BatchItem(sid, len(prompt) + step, tokens=np.array([t], np.int32))
                                   for sid, t in zip(sids, last)])  # fmt: skip
            last = [int(np.argmax(out.logits[-1])) for out in outs]
        return (time.perf_counter() - started) / steps
    finally:
        for sid in sids:
            engine.close_session(sid)


def engine_vs_llama_batched(path: Any, make: Callable[[EngineConfig], LayerEngine], args: argparse.Namespace) -> None:
    """Both in this process, so under one thread-wait policy (this process imported ``node``:
    a lone peer's default), with the same prompt, sessions, threads and steps."""
    import llama_cpp
    from bench_llama_worker import batched  # beside this script

    threads = args.threads or EngineConfig().n_threads
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=512, n_threads=threads, n_threads_batch=threads, verbose=False)
    prompt = llm.tokenize(b"Once upon a time, in a land far away, there lived a dragon who loved to read.")
    config = EngineConfig(n_threads=threads, context_length=len(prompt) + args.batched_steps + 8, max_sessions=args.sessions)
    engine = make(config)
    ours, theirs = [], []
    try:
        batched_steps(engine, prompt, args.sessions, 4)  # warm up
        for _ in range(args.rounds):
            ours.append(batched_steps(engine, prompt, args.sessions, args.batched_steps))
            theirs.append(batched(llm, threads, [prompt] * args.sessions, args.batched_steps, None)["decode_s"] / args.batched_steps)
    finally:
        engine.close()
        llm.close()
    print(f"\n{args.sessions} sessions batched, {threads} threads, {args.batched_steps} steps, best of {args.rounds} in turns: "
          f"the engine {min(ours) * 1000:.2f} ms a step, llama.cpp {min(theirs) * 1000:.2f} ms a step")  # fmt: skip
    print(f"llama.cpp/engine {min(theirs) / min(ours):.3f} (no target of its own: the engine's part of bench_peer's section 2)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2:135m")
    parser.add_argument("--cuts", default="10,20", help="layer boundaries of the chain")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--wire-dtype", default="f16", choices=tensors.WIRE_DTYPES)
    parser.add_argument("--sessions", type=int, default=8, help="sessions of the batched comparison (0: skip it)")
    parser.add_argument("--batched-steps", type=int, default=48, help="decode steps of the batched comparison")
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

    def engine(r: LayerRange, config: EngineConfig = config) -> LayerEngine:
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
    if args.sessions > 0:
        engine_vs_llama_batched(path, lambda c: engine(LayerRange(0, spec.n_layers), c), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
