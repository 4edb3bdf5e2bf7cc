"""Speed of a 3-peer loopback chain (separate processes, libp2p) against the whole model.

Both sides are measured through the same peer API and generation loop, in one run on the
same machine: a single peer holding all layers (one process) is the baseline, the chain is
three peers holding a third each. Decode rate is the streamed token rate after the first
token; prefill rate is prompt tokens over the time to the first token. Each peer runs its
engine on the same thread count, so the ratio isolates what the chain costs.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from inclavate.catalog import Catalog
from inclavate.config import inclavate_home
from inclavate.generate_cmd import split_evenly
from inclavate.local_swarm import LocalSwarm, PeerProcess
from inclavate.store import ModelStore

TARGET_DECODE, TARGET_PREFILL = 0.85, 0.90


def stream(peer: PeerProcess, model: str, prompt: str, max_tokens: int) -> tuple[float, float, int, int]:
    """(seconds to first token, seconds for the rest, completion tokens, prompt tokens)."""
    body = {
        "model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
        "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
        # A stop that never occurs keeps SmolLM2 from ending early and skewing the count.
    }  # fmt: skip
    req = urllib.request.Request(peer.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})  # fmt: skip
    start = time.perf_counter()
    first = last = None
    usage = {}
    with urllib.request.urlopen(req, timeout=600) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                now = time.perf_counter()
                first = first or now
                last = now
    assert first is not None and last is not None, "no tokens streamed"
    return first - start, last - first, usage["completion_tokens"], usage["prompt_tokens"]


def measure(peer: PeerProcess, model: str, prompt: str, n: int, rounds: int) -> tuple[float, float]:
    """Best prefill and decode tokens/s over ``rounds``."""
    best_prefill = best_decode = 0.0
    for _ in range(rounds):
        ttft, rest, completion, prompt_tokens = stream(peer, model, prompt, n)
        best_prefill = max(best_prefill, prompt_tokens / ttft)
        best_decode = max(best_decode, (completion - 1) / rest)
    return best_prefill, best_decode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2:135m")
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--prompt-words", type=int, default=300, help="length of the prefill prompt")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="engine threads per peer")
    parser.add_argument("--wire-dtype", default="f16", choices=("f16", "bf16", "f32"))
    args = parser.parse_args()

    home = inclavate_home()
    spec = Catalog.load(home).get(args.model)
    ModelStore(home).pull(spec)
    common = ["--p2p-host", "127.0.0.1", "--no-mdns", "--threads", str(args.threads),
              "--wire-dtype", args.wire_dtype, "--context", "2048", "--max-sessions", "2"]  # fmt: skip
    prompt = "Summarise this text: " + " ".join(["the quick brown fox jumps over the lazy dog"] * (args.prompt_words // 9))
    short = "Write a long story about a dragon who learns to cook."
    with tempfile.TemporaryDirectory() as tmp, LocalSwarm(Path(tmp), common, {"INCLAVATE_HOME": str(home)}) as swarm:
        whole = swarm.start("whole", spec.model_id, "--layers", f"0-{spec.n_layers}")
        swarm.wait_ready(whole)
        results = {"whole": (measure(whole, spec.model_id, prompt, 2, args.rounds)[0],
                             measure(whole, spec.model_id, short, args.decode_tokens, args.rounds)[1])}  # fmt: skip
        swarm.stop(whole)
        ranges = split_evenly(spec.n_layers, args.peers)
        chain = [swarm.start("chain-1", spec.model_id, "--layers", str(ranges[0]))]
        chain += [swarm.start(f"chain-{i + 1}", spec.model_id, "--layers", str(r), bootstrap=chain[0])
                  for i, r in enumerate(ranges[1:], start=1)]  # fmt: skip
        for peer in chain:
            swarm.wait_ready(peer)
        swarm.wait(lambda: chain[0].get("/api/models")[0]["chain_complete"], 30, "a complete chain")
        entry = chain[0]
        results["chain"] = (measure(entry, spec.model_id, prompt, 2, args.rounds)[0],
                            measure(entry, spec.model_id, short, args.decode_tokens, args.rounds)[1])  # fmt: skip

    (wp, wd), (cp, cd) = results["whole"], results["chain"]
    hops = args.peers  # entry -> stage 2 -> ... -> last, and the token back to the entry
    per_hop_ms = max(0.0, (1 / cd - 1 / wd) * 1000 / hops)
    print(f"model {spec.model_id}: {args.peers}-peer chain {' '.join(map(str, ranges))} vs one peer; "
          f"{args.threads} engine thread(s) per peer, wire {args.wire_dtype}, best of {args.rounds}")  # fmt: skip
    print(f"{'':8}{'prefill tok/s':>15}{'decode tok/s':>15}")
    print(f"{'whole':8}{wp:15.1f}{wd:15.1f}")
    print(f"{'chain':8}{cp:15.1f}{cd:15.1f}")
    print(f"{'ratio':8}{cp / wp:15.3f}{cd / wd:15.3f}")
    print(f"decode step: whole {1000 / wd:.2f} ms, chain {1000 / cd:.2f} ms; "
          f"added latency {per_hop_ms:.2f} ms per hop ({hops} messages per step)")
    ok = cd / wd >= TARGET_DECODE and cp / wp >= TARGET_PREFILL
    print(f"target: decode >= {TARGET_DECODE}, prefill >= {TARGET_PREFILL}: {'met' if ok else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
