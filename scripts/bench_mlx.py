"""``bench_engine --engine mlx``: MLX against llama.cpp on this machine, and how near a mixed
chain (llama.cpp, MLX, llama.cpp ranges) stays to the whole llama.cpp model.

Speed: the whole model on each engine, alternating rounds, best of ``--rounds``. On Linux
mlx's CPU build is far slower than llama.cpp (reference BLAS, no SIMD kernels for quantized
matmuls); the figure that matters comes from a Mac, where MLX computes on the GPU.

Agreement: greedy decoding of each chat prompt, hidden states on float32 wires, compared
token by token with the whole llama.cpp model up to its end-of-turn or ``--decode-tokens``.
llama.cpp quantizes activations for its quantized matmuls and MLX does not, so the chain
is near, not equal: a near tie between the top two tokens can flip, after which the texts
part.
"""

from __future__ import annotations

import argparse

import numpy as np
from bench_engine import run

from api.chat_model import ChatModel
from inclavate.catalog import Catalog
from inclavate.config import inclavate_home
from inclavate.store import ModelStore
from inclavate.types import LayerRange, ModelId
from node.engine import EngineConfig, LayerEngine
from node.engines import EngineKind, load_engine
from node.local_pipeline import greedy_run

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain gravity to a child.",
    "List three prime numbers.",
    "Explain in two sentences why the sky is blue.",
]


def main_mlx(args: argparse.Namespace) -> int:
    home = inclavate_home()
    spec = Catalog.load(home).get(args.model)
    path = ModelStore(home).pull(spec).path
    context = max(512, args.prompt_tokens + args.decode_tokens + 8)
    config = EngineConfig(context_length=context, max_sessions=1)
    if args.threads:
        config = EngineConfig(n_threads=args.threads, context_length=context, max_sessions=1)

    def engine(kind: EngineKind, r: LayerRange) -> LayerEngine:
        return load_engine(kind, model_id=ModelId(spec.model_id), model_path=path, model_sha256=spec.gguf_sha256,
                           layers=r, config=config, slice_cache=home / "slices")  # fmt: skip

    whole = LayerRange(0, spec.n_layers)
    engines = {"llamacpp": [engine("llamacpp", whole)], "mlx": [engine("mlx", whole)]}
    prompt = np.random.default_rng(0).integers(100, 40000, args.prompt_tokens).astype(np.int32)
    print(f"model {spec.model_id}, whole model on each engine, {config.n_threads} llama.cpp threads, "
          f"prompt {args.prompt_tokens} tokens, decode {args.decode_tokens} tokens, best of {args.rounds}")  # fmt: skip
    best = {name: [float("inf")] * 2 for name in engines}
    for name, chain in engines.items():
        run(chain, prompt, 4, "f32")  # warm up
    for _ in range(args.rounds):
        for name, chain in engines.items():
            times = run(chain, prompt, args.decode_tokens, "f32")
            best[name] = [min(a, b) for a, b in zip(best[name], times)]
    rates = {name: (args.prompt_tokens / p, args.decode_tokens / d) for name, (p, d) in best.items()}
    print(f"{'':10}{'prefill tok/s':>15}{'decode tok/s':>15}")
    for name, (p, d) in rates.items():
        print(f"{name:10}{p:15.1f}{d:15.1f}")
    print(f"{'mlx/llama':10}{rates['mlx'][0] / rates['llamacpp'][0]:15.3f}{rates['mlx'][1] / rates['llamacpp'][1]:15.3f}")

    cuts = [int(c) for c in args.cuts.split(",")]
    bounds = [0, *cuts, spec.n_layers]
    kinds: list[EngineKind] = ["llamacpp" if i % 2 == 0 else "mlx" for i in range(len(bounds) - 1)]
    mixed = [engine(k, LayerRange(a, b)) for k, a, b in zip(kinds, bounds, bounds[1:])]
    chat = ChatModel.load(ModelId(spec.model_id), path)
    print(f"\nmixed chain {' '.join(f'{k}:{e.info.layers}' for k, e in zip(kinds, mixed))} against "
          f"the whole llama.cpp model, greedy, f32 wire, up to {args.decode_tokens} tokens")  # fmt: skip
    print("  (at the first disagreement, 'gap' is how far the whole model's own logit for the "
          "chain's token was below its pick: a small gap is a near tie)")  # fmt: skip
    for question in PROMPTS:
        tokens = list(chat.prepare([{"role": "user", "content": question}]).tokens)
        expected, logits = greedy_run(engines["llamacpp"], tokens, args.decode_tokens, chat.tokenizer.is_eog)
        got, _ = greedy_run(mixed, tokens, len(expected), chat.tokenizer.is_eog)
        same = next((i for i, (x, y) in enumerate(zip(expected, got)) if x != y), len(expected))
        gap = f"gap {logits[same][expected[same]] - logits[same][got[same]]:.3f}" if same < len(expected) else ""
        print(f"  {same:3d}/{len(expected):3d} tokens agree {gap:>10}  {question!r}")
    chat.close()
    for e in [*engines["llamacpp"], *engines["mlx"], *mixed]:
        e.close()
    return 0

