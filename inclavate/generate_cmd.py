"""``inclavate generate``: answer one prompt through an in-process chain of layer ranges.

No network and no peers: the quickest way to see the layer-range engine work, and the
reference that swarm output is compared against.
"""

from __future__ import annotations

import argparse
import sys

import trio

from api.chat_model import ChatModel
from api.generation import Generation
from api.reasoning_split import Delta
from inclavate.catalog import Catalog
from inclavate.config import inclavate_home
from inclavate.errors import ConfigError
from inclavate.progress import Progress
from inclavate.store import ModelStore
from inclavate.types import LayerRange, ModelId, SessionId
from node.engine import EngineConfig
from node.engines import ENGINE_CHOICES, load_engine, resolve_engine
from node.local_pipeline import LocalPipeline

DEFAULT_MODEL = "smollm2:135m"


def add_generate_command(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="answer one prompt through an in-process chain of layer ranges",
        description="Pull the model if needed, cut it into --ranges equal layer ranges run in "
        "this process, and stream the answer to PROMPT.",
    )
    parser.add_argument("prompt", help="the user message")
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"model id (default {DEFAULT_MODEL})")
    parser.add_argument("--ranges", type=int, default=3, help="number of layer ranges (default 3)")
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens to generate at most (default 256)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--system", default=None, help="optional system message")
    parser.add_argument("--engine", choices=ENGINE_CHOICES, default="auto",
                        help="what runs the layers (default auto: mlx on macOS arm64, llamacpp elsewhere)")  # fmt: skip
    parser.set_defaults(handler=_generate)


def split_evenly(n_layers: int, parts: int) -> list[LayerRange]:
    if not 1 <= parts <= n_layers:
        raise ConfigError(f"--ranges must be between 1 and {n_layers}")
    bounds = [round(i * n_layers / parts) for i in range(parts + 1)]
    return [LayerRange(a, b) for a, b in zip(bounds, bounds[1:])]


def _generate(args: argparse.Namespace) -> int:
    home = inclavate_home()
    spec = Catalog.load(home).get(args.model)
    path = ModelStore(home).pull(spec, Progress(sys.stderr)).path
    model_id = ModelId(spec.model_id)
    config = EngineConfig(max_sessions=1)
    kind = resolve_engine(args.engine)
    engines = [
        load_engine(kind, model_id=model_id, model_path=path, model_sha256=spec.gguf_sha256,
                    layers=r, config=config, slice_cache=home / "slices")
        for r in split_evenly(spec.n_layers, args.ranges)
    ]  # fmt: skip
    chat = ChatModel.load(model_id, path)
    try:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.prompt}
        ]
        prompt = chat.prepare(messages)
        params = chat.generation_params(
            prompt, max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
        )
        print(f"[{model_id} on {kind}: layers {' | '.join(str(e.info.layers) for e in engines)}]", file=sys.stderr)
        generation = Generation(LocalPipeline(engines), chat.tokenizer, SessionId("cli"), params, prompt.splitter)

        async def show(delta: Delta) -> None:
            stream = sys.stderr if delta.kind == "reasoning" else sys.stdout
            print(delta.text, end="", file=stream, flush=True)

        result = trio.run(generation.run, show)
        print()
        print(
            f"[{result.finish_reason}: {result.prompt_tokens} prompt + "
            f"{result.completion_tokens} completion tokens]",
            file=sys.stderr,
        )
    finally:
        chat.close()
        for engine in engines:
            engine.close()
    return 0
