"""The llama.cpp side of ``scripts/bench_peer``: llama-cpp-python alone, in its own process.

It imports nothing of Inclavate, so llama.cpp runs with its own defaults (no thread-wait
policy of ours; ``bench_peer`` starts it with every ``OMP_*``/``GOMP_*`` variable removed).
It stays alive for the whole benchmark and answers one JSON command per stdin line, so the
benchmark can alternate it with the peer (ABAB) and the two share whatever the machine does.

Commands:
  {"op": "single", "tokens": [int, ...], "n": int, "sampling": [temperature, top_p] (optional)}:
      reset, evaluate the prompt's token ids (prefill), then generate n tokens, greedy or sampled with
      llama.cpp's own sampler chain; answers prompt tokens, prefill seconds and decode seconds
      for the n-1 tokens after the first (what a stream shows after its first token).
  {"op": "batched", "prompts": [[int, ...], ...], "n": int, "sampling": [...] (optional)}:
      llama.cpp batched decoding in this process: one session per prompt, each prefilled
      with its token ids, then n steps in which one ``llama_decode`` carries one token of
      every session, each token picked greedily or by the session's own sampler chain;
      answers the steps' seconds.

A prompt is token ids, not text, so that the baseline decodes exactly the sequence the peer
does: the peer's chat template turns a 12-token request into ~47 tokens, and a step over the
longer context cost llama.cpp itself ~6% more in a throwaway timing loop (8 sessions
batched, SmolLM2-135M, 2026-12-05).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import llama_cpp
import numpy as np


def sampler_chain(sampling: list[float] | None) -> llama_cpp.llama_sampler_p:
    """llama.cpp's sampler chain, built once per generation as its own tools do.

    ``Llama.sample`` builds a new chain on every call: ~0.2 ms a token even for greedy,
    which a baseline must not pay. Sampled: temperature, then top_p, then the draw (the
    peer's order)."""
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    if sampling is None:
        llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_greedy())
    else:
        temperature, top_p = sampling
        llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_temp(temperature))
        llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_top_p(top_p, 1))
        llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_dist(1))
    return chain


def single(llm: llama_cpp.Llama, tokens: list[int], n: int, sampling: list[float] | None) -> dict[str, float]:
    chain = sampler_chain(sampling)
    try:
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(tokens)
        token = llama_cpp.llama_sampler_sample(chain, llm.ctx, -1)
        t1 = time.perf_counter()
        for _ in range(n - 1):
            llm.eval([token])
            token = llama_cpp.llama_sampler_sample(chain, llm.ctx, -1)
        t2 = time.perf_counter()
    finally:
        llama_cpp.llama_sampler_free(chain)
    return {"prompt_tokens": len(tokens), "prefill_s": t1 - t0, "decode_s": t2 - t1}


def batched(llm: llama_cpp.Llama, threads: int, prompts: list[list[int]], n: int,
            sampling: list[float] | None) -> dict[str, float]:  # fmt: skip
    sessions = len(prompts)
    n_ctx = -(-(max(len(tokens) for tokens in prompts) + n + 8) // 256) * 256  # llama.cpp's padding, so no warning
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = n_ctx * sessions
    params.n_seq_max = sessions
    params.n_threads = params.n_threads_batch = threads
    params.no_perf = True
    ctx = llama_cpp.llama_init_from_model(llm.model, params)
    batch = llama_cpp.llama_batch_init(max(n_ctx, sessions), 0, 1)
    n_vocab = llm.n_vocab()

    def decode(rows: list[tuple[int, int, int]]) -> None:
        """rows: (token, position, sequence); logits for every row."""
        for i, (token, pos, seq) in enumerate(rows):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, 1
        batch.n_tokens = len(rows)
        if llama_cpp.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    # Greedy: argmax over the logits in place. Sampled: a chain per sequence, each its own draw.
    chains = [sampler_chain(sampling) for _ in range(sessions)] if sampling is not None else []

    def pick(seq: int, row: int) -> int:
        if chains:
            return llama_cpp.llama_sampler_sample(chains[seq], ctx, row)
        return int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, row), shape=(n_vocab,))))

    try:
        last = []
        for seq, tokens in enumerate(prompts):
            decode([(t, p, seq) for p, t in enumerate(tokens)])
            last.append(pick(seq, len(tokens) - 1))
        t0 = time.perf_counter()
        for step in range(n):
            decode([(last[seq], len(prompts[seq]) + step, seq) for seq in range(sessions)])
            last = [pick(seq, seq) for seq in range(sessions)]
        return {"decode_s": time.perf_counter() - t0}
    finally:
        for chain in chains:
            llama_cpp.llama_sampler_free(chain)
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model_path")
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--context", type=int, default=2048)
    args = parser.parse_args()
    llm = llama_cpp.Llama(model_path=args.model_path, n_ctx=args.context, n_threads=args.threads,
                          n_threads_batch=args.threads, verbose=False)  # fmt: skip
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "single":
            answer = single(llm, cmd["tokens"], cmd["n"], cmd.get("sampling"))
        else:
            answer = batched(llm, args.threads, cmd["prompts"], cmd["n"], cmd.get("sampling"))
        print(json.dumps(answer), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
