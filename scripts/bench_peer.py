"""One peer against llama.cpp on the same machine: single-stream speed, batched throughput,
stream latency while another session prefills, and resident memory.

The baseline is llama-cpp-python alone (``scripts/bench_llama_worker.py``), same GGUF, same
thread count, in its own process with llama.cpp's default environment, given the token ids
the peer's chat template makes of each request (checked against the peer's reported
``prompt_tokens``): both sides decode the same sequences. The peer is
``inclavate peer`` holding the whole model at default flags (``--threads`` set only where a
thread count is being compared), measured over its REST API as a user sees it. Both stay up
for the whole run and are measured alternately (ABAB ...), so a busy machine slows both
alike; each figure is the best over ``--rounds``.

Sections:
1. decode and prefill, peer / llama.cpp, at 1 thread, 2 threads and all cores (default flags);
   target >= 0.95 each, and the default thread count never slower than a smaller one. Greedy,
   and at the default thread count also at the API's default sampling (a request that names
   no temperature or top_p) against llama.cpp's sampler chain drawing from the same
   distribution (target >= 0.95), and each side's sampled rate over its greedy one;
2. 8 concurrent sessions: the peer's aggregate decode rate while all 8 stream, against
   llama.cpp decoding the 8 sequences batched (one ``llama_decode`` per step); target >= 0.9.
   Also printed: each round's paired ratio, and a step's time split into the engine call,
   the time between calls, and the CPU of the peer's event loop (less the engine calls it runs
   inline); then the same at the API's default sampling (llama.cpp with a sampler chain per
   session);
3. the worst gap between two streamed tokens of a decoding session while another session
   prefills a ~2,000-token prompt (reported with the session's median gap; no target);
4. the peer's event-loop CPU per generated token and per request, streamed and not (the
   same 8 concurrent requests at 48 and 192 tokens; the difference per added token is a
   token's cost): what the event loop's share of a batched step is made of;
5. resident memory of a peer holding 10 layers against the size of its slice and KV cache.
"""

from __future__ import annotations

import os

# Measure the defaults: a thread-wait setting inherited from the shell would change both
# sides (the peer's own default is applied by the peer itself).
INHERITED_WAIT_ENV = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith(("OMP_", "GOMP_"))}

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import urllib.request  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

from bench_sse import stream_all  # noqa: E402

from api.chat_model import ChatModel  # noqa: E402
from api.chat_request import ChatRequest  # noqa: E402
from inclavate.catalog import Catalog  # noqa: E402
from inclavate.config import inclavate_home  # noqa: E402
from inclavate.gguf_meta import read_metadata  # noqa: E402
from inclavate.local_swarm import LocalSwarm, PeerProcess  # noqa: E402
from inclavate.store import ModelStore  # noqa: E402

TARGET_SINGLE, TARGET_BATCHED, TARGET_DEFAULT_THREADS = 0.95, 0.90, 0.95
API_SAMPLING = (ChatRequest.temperature, ChatRequest.top_p)
"""What a chat request that names no temperature or top_p is sampled at."""
DECODE_PROMPT = "Write a long story about a dragon who learns to cook."
LONG_DECODE_PROMPT = "Write the numbers from 1 to 3000 separated by commas."
"""Runs to 1,500 tokens on SmolLM2 at temperature 0 (~20 s alone): one request of session A
outlasts B's prefill. ("Count from 1 to 2000, one number per line" stopped after 121 tokens,
and a run could measure A's gaps over only the first moments of B's prefill.)"""
FILLER = "the quick brown fox jumps over the lazy dog "  # ~9 tokens


def chat_tokens(chat: ChatModel, content: str) -> list[int]:
    """The token ids the peer decodes for a one-message chat of ``content``: its chat template
    rendered and tokenized, which is what the llama.cpp baseline must decode too (the
    template's ~35 tokens make a step over the context measurably dearer)."""
    return list(chat.prepare([{"role": "user", "content": content}]).tokens)


def check_same_prompt(peer_prompt_tokens: int, tokens: list[int]) -> None:
    """Refuse a comparison in which the peer decoded another prompt than the baseline."""
    if peer_prompt_tokens != len(tokens):
        raise RuntimeError(f"the peer decoded a prompt of {peer_prompt_tokens} tokens, the baseline one of "
                           f"{len(tokens)}: the two sides would not do the same work")  # fmt: skip


def story_content(i: int) -> str:
    return f"{DECODE_PROMPT} Story number {i}."


@dataclass
class Stream:
    """One streamed completion: when each content chunk arrived, and the usage it reported."""

    started: float
    token_times: list[float]
    prompt_tokens: int
    completion_tokens: int

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.started

    @property
    def decode_rate(self) -> float:
        if len(self.token_times) < 2:
            raise RuntimeError(f"{len(self.token_times)} tokens streamed; a decode rate needs at least 2")
        return (len(self.token_times) - 1) / (self.token_times[-1] - self.token_times[0])


def stream(peer: PeerProcess, model: str, prompt: str, max_tokens: int, stop: threading.Event | None = None,
           greedy: bool = True) -> Stream:  # fmt: skip
    """Greedy, or (``greedy=False``) at the API's default sampling with a fixed seed."""
    sampling = {"temperature": 0} if greedy else {"seed": 1}
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True}, **sampling}  # fmt: skip
    req = urllib.request.Request(peer.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})  # fmt: skip
    started = time.perf_counter()
    times: list[float] = []
    usage = {"prompt_tokens": 0, "completion_tokens": 0}
    with urllib.request.urlopen(req, timeout=900) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                times.append(time.perf_counter())
                if stop is not None and stop.is_set():
                    break  # closing the connection ends the generation
    if not times:
        raise RuntimeError(f"{peer.name} streamed no tokens")
    return Stream(started, times, usage["prompt_tokens"], usage["completion_tokens"])


class LlamaBaseline:
    """The llama-cpp-python worker process for one thread count."""

    def __init__(self, model_path: Path, threads: int) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
        worker = Path(__file__).with_name("bench_llama_worker.py")
        self.process = subprocess.Popen([sys.executable, str(worker), str(model_path), "--threads", str(threads)],
                                        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
        if not json.loads(self._read()).get("ready"):
            raise RuntimeError("llama.cpp worker did not start")

    def _read(self) -> str:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"llama.cpp worker exited ({self.process.wait()})")
        return line

    def ask(self, **cmd: object) -> dict[str, float]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(cmd) + "\n")
        self.process.stdin.flush()
        return json.loads(self._read())

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.wait(30)


def verdict(ratio: float, target: float) -> str:
    return f"{ratio:7.3f}  target >= {target}: {'met' if ratio >= target else 'NOT met'}"


def single_stream(swarm: LocalSwarm, chat: ChatModel, model_path: Path, threads: int | None, cores: int,
                  prompt: str, n: int, rounds: int) -> dict[str, float]:  # fmt: skip
    """Best decode/prefill rates of the peer and of llama.cpp at ``threads`` (None: default);
    at the default, also the decode rates at the API's default sampling."""
    count, model = threads or cores, chat.model_id
    decode_tokens, prefill_tokens = chat_tokens(chat, DECODE_PROMPT), chat_tokens(chat, prompt)
    peer = swarm.start(f"whole-{threads or 'default'}", model, *whole_layers(model_path),
                       *(["--threads", str(threads)] if threads else []))  # fmt: skip
    swarm.wait_ready(peer)
    base = LlamaBaseline(model_path, count)
    best = {"peer_decode": 0.0, "peer_prefill": 0.0, "llama_decode": 0.0, "llama_prefill": 0.0,
            "peer_sampled": 0.0, "llama_sampled": 0.0}  # fmt: skip
    try:
        check_same_prompt(stream(peer, model, DECODE_PROMPT, 4).prompt_tokens, decode_tokens)  # warm: weights, template
        check_same_prompt(stream(peer, model, prompt, 1).prompt_tokens, prefill_tokens)
        base.ask(op="single", tokens=decode_tokens, n=4)
        for _ in range(rounds):
            b = base.ask(op="single", tokens=decode_tokens, n=n)
            best["llama_decode"] = max(best["llama_decode"], (n - 1) / b["decode_s"])
            s = stream(peer, model, DECODE_PROMPT, n)
            best["peer_decode"] = max(best["peer_decode"], s.decode_rate)
            b = base.ask(op="single", tokens=prefill_tokens, n=1)
            best["llama_prefill"] = max(best["llama_prefill"], b["prompt_tokens"] / b["prefill_s"])
            s = stream(peer, model, prompt, 2)
            best["peer_prefill"] = max(best["peer_prefill"], s.prompt_tokens / s.ttft)
            if threads is None:
                b = base.ask(op="single", tokens=decode_tokens, n=n, sampling=list(API_SAMPLING))
                best["llama_sampled"] = max(best["llama_sampled"], (n - 1) / b["decode_s"])
                s = stream(peer, model, DECODE_PROMPT, n, greedy=False)
                best["peer_sampled"] = max(best["peer_sampled"], s.decode_rate)
    finally:
        base.close()
        swarm.stop(peer)
    return best


def story_requests(model: str, sessions: int, n: int, *, streamed: bool, greedy: bool = True) -> list[dict[str, object]]:
    """Chat bodies for ``sessions`` concurrent generations of ``n`` tokens each: greedy, or
    at the API's default sampling with a seed per session."""
    extra = {"stream": True, "stream_options": {"include_usage": True}} if streamed else {}
    return [{"model": model, "messages": [{"role": "user", "content": story_content(i)}],
             "max_tokens": n, **({"temperature": 0} if greedy else {"seed": i + 1}), **extra}
            for i in range(sessions)]  # fmt: skip


def concurrent_decode(peer: PeerProcess, model: str, sessions: int, n: int, greedy: bool = True,
                      prompts: list[list[int]] | None = None) -> float:  # fmt: skip
    """Aggregate tokens/s while every session streams: from the moment the last one got its
    first token until the first one finished, counting every session's tokens in between.
    The streams are read by this one thread (``bench_sse``), so the client takes as little
    of the machine's CPU from the peer as it can. ``prompts``: what a baseline decoded for
    each session, checked to be what the peer decoded."""
    results = stream_all(peer.url + "/v1/chat/completions", story_requests(model, sessions, n, streamed=True, greedy=greedy))
    if any(not s.token_times for s in results):
        raise RuntimeError(f"{peer.name}: a session streamed no tokens")
    for s, tokens in zip(results, prompts or []):
        check_same_prompt(s.usage["prompt_tokens"], tokens)
    lo = max(s.token_times[0] for s in results)
    hi = min(s.token_times[-1] for s in results)
    if hi <= lo:
        raise RuntimeError("the sessions never all streamed at once; raise --batched-tokens")
    tokens = sum(sum(1 for t in s.token_times if lo < t <= hi) for s in results)
    return tokens / (hi - lo)


@dataclass
class BatchedRound:
    """One ABAB round of section 2, with where the peer's time per batched step went."""

    llama_rate: float
    peer_rate: float
    llama_step_ms: float
    engine_ms: float
    """The peer's engine call per batched step (``/health`` ``batching.step_seconds``)."""
    loop_cpu_ms: float | None
    """CPU of the peer's event loop per step: its thread's, less the engine calls it runs
    inline (``node.stage``)."""
    sessions_per_call: float
    client_cpu_ms: float
    """CPU of this benchmark's own client per step: taken from the cores the peer uses."""


def cpu_s(stat: Path) -> float:
    """User + system CPU seconds from a ``/proc`` stat file (a process's, or one thread's)."""
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _thread_cpu_s(pid: int) -> float | None:
    """CPU seconds of the process's main thread (the peer's event loop); None without ``/proc``."""
    try:
        return cpu_s(Path(f"/proc/{pid}/task/{pid}/stat"))
    except OSError:
        return None


def loop_cpu_s(main_thread_s: float, before: dict[str, float], after: dict[str, float]) -> float:
    """The event loop's own CPU: its thread's, less the engine calls the stage ran on it
    (``inline_cpu_seconds`` in ``/health``'s ``batching``)."""
    return main_thread_s - (after.get("inline_cpu_seconds", 0.0) - before.get("inline_cpu_seconds", 0.0))


def batched_round(peer: PeerProcess, model: str, prompts: list[list[int]], n: int, llama_decode_s: float,
                  greedy: bool = True) -> BatchedRound:  # fmt: skip
    """Section 2's peer half of a round, with the peer's own account of its steps."""
    before = peer.get("/health").get("batching") or {}
    cpu0, client0 = _thread_cpu_s(peer.process.pid), os.times()
    sessions = len(prompts)
    rate = concurrent_decode(peer, model, sessions, n, greedy, prompts)
    cpu1, client1 = _thread_cpu_s(peer.process.pid), os.times()
    after = peer.get("/health").get("batching") or {}
    steps = max(1, after.get("step_rounds", 0) - before.get("step_rounds", 0))
    return BatchedRound(
        llama_rate=sessions * n / llama_decode_s,
        peer_rate=rate,
        llama_step_ms=1000 * llama_decode_s / n,
        engine_ms=1000 * (after.get("step_seconds", 0.0) - before.get("step_seconds", 0.0)) / steps,
        loop_cpu_ms=None if cpu0 is None or cpu1 is None else 1000 * loop_cpu_s(cpu1 - cpu0, before, after) / steps,
        sessions_per_call=(after.get("step_jobs", 0) - before.get("step_jobs", 0)) / steps,
        client_cpu_ms=1000 * (client1.user + client1.system - client0.user - client0.system) / steps,
    )


def best_rates(rounds: list[BatchedRound]) -> tuple[float, float]:
    """The best llama.cpp and the best peer aggregate rate over the rounds."""
    return max(r.llama_rate for r in rounds), max(r.peer_rate for r in rounds)


def print_batched_breakdown(rounds: list[BatchedRound]) -> None:
    """Every round's paired ratio and where a step's time went: on a shared machine the
    pairs swing more than the target's margin, and the engine call's own time (which
    competes with the event loop for the cores) is the figure to watch, not only the ratio."""
    ratios = [r.peer_rate / r.llama_rate for r in rounds]
    print(f"   paired ratios (each round's peer / that round's llama.cpp): {' '.join(f'{x:.3f}' for x in ratios)}; "
          f"median {statistics.median(ratios):.3f}")  # fmt: skip
    peer_step = statistics.median(r.sessions_per_call * 1000 / r.peer_rate for r in rounds)
    engine = statistics.median(r.engine_ms for r in rounds)
    cpu = [r.loop_cpu_ms for r in rounds if r.loop_cpu_ms is not None]
    loop = f"{statistics.median(cpu):.2f} ms" if len(cpu) == len(rounds) else "n/a"
    print(f"   per batched step, median over rounds: llama.cpp {statistics.median(r.llama_step_ms for r in rounds):.1f} ms; "
          f"peer {peer_step:.1f} ms, of which the engine call {engine:.1f} ms; event-loop CPU {loop} (its own: "
          f"less the engine calls it runs inline); {statistics.median(r.sessions_per_call for r in rounds):.2f} "
          f"sessions per engine call; the benchmark's client {statistics.median(r.client_cpu_ms for r in rounds):.2f} ms CPU")  # fmt: skip


def prefill_gap(peer: PeerProcess, model: str, prompt_words: int) -> dict[str, float]:
    """Session A streams (a new request whenever one ends); once it streams, session B sends
    a long prompt. A's worst gap between tokens of one request during B's prefill, against
    A's median gap before it."""
    stop = threading.Event()
    streams: list[Stream] = []

    def keep_streaming() -> None:
        while not stop.is_set():
            streams.append(stream(peer, model, LONG_DECODE_PROMPT, 1500, stop))

    a = threading.Thread(target=keep_streaming)
    a.start()
    time.sleep(4.0)  # A's prompt is short: by now it streams
    b = stream(peer, model, "Summarise: " + FILLER * (prompt_words // 9), 1)
    time.sleep(1.0)
    stop.set()
    a.join()
    gaps = [(t1, t2) for s in streams for t1, t2 in zip(s.token_times, s.token_times[1:])]
    before = [t2 - t1 for t1, t2 in gaps if t2 <= b.started]
    during = [(t2 - t1, t1) for t1, t2 in gaps if t2 > b.started and t1 < b.token_times[0]]
    if not during:
        raise RuntimeError("session A did not stream during B's prefill")
    worst, at = max(during)
    # A request of A that was streaming before B's request and still after B's first token
    # saw the whole prefill; otherwise A's gaps sample only part of it (A was between requests).
    spanned = any(s.token_times[0] < b.started and s.token_times[-1] > b.token_times[0] for s in streams)
    return {"median_ms": statistics.median(before) * 1000 if before else float("nan"), "worst_ms": worst * 1000,
            "median_during_ms": statistics.median(gap for gap, _ in during) * 1000, "spanned": spanned,
            "worst_at_s": at - b.started, "prefill_s": b.ttft, "prompt_tokens": b.prompt_tokens}  # fmt: skip


def loop_cost(peer: PeerProcess, model: str, sessions: int, lengths: tuple[int, int], rounds: int) -> dict[str, float] | None:
    """The peer's event-loop CPU per generated token and per request, streamed and not.

    The same ``sessions`` concurrent requests at two lengths: the CPU the longer ones add,
    over the tokens they add, is a token's cost (generation loop, routing, the stage, and for
    a stream its SSE chunk); what is left is a request's (HTTP, template, prefill hand-offs).
    None where ``/proc`` is missing."""
    url = peer.url + "/v1/chat/completions"

    errors: list[BaseException] = []

    def plain(body: dict[str, object]) -> None:
        req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=900) as resp:
                resp.read()
        except BaseException as exc:  # noqa: BLE001 - raised in the measuring thread below
            errors.append(exc)

    def measure(n: int, streamed: bool) -> tuple[float, int] | None:
        bodies = story_requests(model, sessions, n, streamed=streamed)
        before, cpu0 = peer.get("/health").get("batching") or {}, _thread_cpu_s(peer.process.pid)
        if streamed:
            stream_all(url, bodies)
        else:
            threads = [threading.Thread(target=plain, args=(body,)) for body in bodies]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if errors:
                raise errors[0]  # a failed request would skew a request's cost without a word
        after, cpu1 = peer.get("/health").get("batching") or {}, _thread_cpu_s(peer.process.pid)
        if cpu0 is None or cpu1 is None:
            return None
        return loop_cpu_s(cpu1 - cpu0, before, after), after.get("step_jobs", 0) - before.get("step_jobs", 0)

    out: dict[str, float] = {}
    for streamed, name in ((False, "plain"), (True, "stream")):
        per_token, per_request = [], []
        for _ in range(rounds):
            short, long = measure(lengths[0], streamed), measure(lengths[1], streamed)
            if short is None or long is None:
                return None
            token = (long[0] - short[0]) / max(1, long[1] - short[1])
            per_token.append(token)
            per_request.append((short[0] - token * short[1]) / sessions)
        out[f"{name}_token_us"] = statistics.median(per_token) * 1e6
        out[f"{name}_request_ms"] = statistics.median(per_request) * 1e3
    return out


def whole_layers(model_path: Path) -> list[str]:
    return ["--layers", f"0-{read_metadata(model_path).n_layers}"]


def rss(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            fields[key] = int(value.split()[0]) * 1024
    return fields


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2:135m")
    parser.add_argument("--rounds", type=int, default=3, help="ABAB rounds per figure (best is kept)")
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--prompt-words", type=int, default=300, help="length of the prefill prompt")
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--batched-tokens", type=int, default=48, help="tokens per session in the batched test")
    parser.add_argument("--gap-prompt-words", type=int, default=1980, help="~tokens of the long prompt in the gap test")
    parser.add_argument("--skip", action="append", default=[], choices=("single", "batched", "gap", "loop", "memory"))
    parser.add_argument("--peer-env", action="append", default=[], metavar="NAME=VALUE",
                        help="environment of the peers (e.g. GOMP_SPINCOUNT=30000 to try another thread wait)")
    args = parser.parse_args()

    home = inclavate_home()
    spec = Catalog.load(home).get(args.model)
    model_path = ModelStore(home).pull(spec).path
    cores = len(os.sched_getaffinity(0))
    load = os.getloadavg()[0]
    print(f"model {spec.model_id}, {cores} cores, load average {load:.1f} at start"
          f"{' (busy machine: ratios are noisy)' if load > cores * 0.5 else ''}; best of {args.rounds}, ABAB")  # fmt: skip
    if INHERITED_WAIT_ENV:
        print(f"ignoring inherited {' '.join(f'{k}={v}' for k, v in INHERITED_WAIT_ENV.items())}")
    peer_env = dict(item.split("=", 1) for item in args.peer_env)
    if peer_env:
        # This process imported node/, which chose a default wait policy and marked it as a
        # default; a child seeing that mark would choose again and drop the variable asked for.
        peer_env.setdefault("INCLAVATE_THREAD_WAIT_DEFAULTED", "")
        print(f"peers run with {' '.join(args.peer_env)}")
    prompt = "Summarise this text: " + FILLER * (args.prompt_words // 9)
    chat = ChatModel.load(spec.model_id, model_path)
    common = ["--p2p-host", "127.0.0.1", "--no-mdns"]
    with tempfile.TemporaryDirectory() as tmp, LocalSwarm(Path(tmp), common, {"INCLAVATE_HOME": str(home), **peer_env},
                                                          colocated=False) as swarm:
        if "single" not in args.skip:
            print("\n1. one stream, peer (whole model) / llama.cpp, same threads")
            print(f"{'threads':>12}{'llama dec':>11}{'peer dec':>10}{'llama pre':>11}{'peer pre':>10}   ratios")
            decode_by_threads: dict[int, float] = {}
            counts: list[int | None] = sorted({1, min(2, cores)}) + [None]
            if cores <= 2:
                counts = [1, None] if cores == 2 else [None]
            for threads in counts:
                r = single_stream(swarm, chat, model_path, threads, cores, prompt, args.decode_tokens, args.rounds)
                label = f"{threads}" if threads else f"{cores} (default)"
                decode_by_threads[threads or cores] = r["peer_decode"]
                print(f"{label:>12}{r['llama_decode']:11.1f}{r['peer_decode']:10.1f}{r['llama_prefill']:11.1f}"
                      f"{r['peer_prefill']:10.1f}")  # fmt: skip
                print(f"{'':12} decode  {verdict(r['peer_decode'] / r['llama_decode'], TARGET_SINGLE)}")
                print(f"{'':12} prefill {verdict(r['peer_prefill'] / r['llama_prefill'], TARGET_SINGLE)}")
                if threads is None:
                    print(f"{'':12} decode at the API's default sampling (temperature {API_SAMPLING[0]}, top_p "
                          f"{API_SAMPLING[1]}): llama.cpp {r['llama_sampled']:.1f}, peer {r['peer_sampled']:.1f}")  # fmt: skip
                    print(f"{'':12}   peer / llama.cpp sampling the same {verdict(r['peer_sampled'] / r['llama_sampled'], TARGET_SINGLE)}")
                    print(f"{'':12}   sampled / greedy, what sampling costs (the texts differ): peer "
                          f"{r['peer_sampled'] / r['peer_decode']:.3f}, llama.cpp {r['llama_sampled'] / r['llama_decode']:.3f}")  # fmt: skip
            smaller = [rate for count, rate in decode_by_threads.items() if count < cores]
            if smaller:
                print(f"default threads ({cores}) vs the best smaller count, peer decode: "
                      f"{verdict(decode_by_threads[cores] / max(smaller), TARGET_DEFAULT_THREADS)}")  # fmt: skip

        peer = swarm.start("whole", spec.model_id, *whole_layers(model_path))
        swarm.wait_ready(peer)
        if "batched" not in args.skip:
            base = LlamaBaseline(model_path, cores)
            prompts = [chat_tokens(chat, story_content(i)) for i in range(args.sessions)]
            rounds: list[BatchedRound] = []
            sampled: list[BatchedRound] = []
            try:
                stream(peer, spec.model_id, DECODE_PROMPT, 4)
                for _ in range(args.rounds):
                    b = base.ask(op="batched", prompts=prompts, n=args.batched_tokens)
                    rounds.append(batched_round(peer, spec.model_id, prompts, args.batched_tokens, b["decode_s"]))
                for _ in range(args.rounds):
                    b = base.ask(op="batched", prompts=prompts, n=args.batched_tokens, sampling=list(API_SAMPLING))
                    sampled.append(batched_round(peer, spec.model_id, prompts, args.batched_tokens, b["decode_s"],
                                                 greedy=False))  # fmt: skip
            finally:
                base.close()
            best_llama, best_peer = best_rates(rounds)
            print(f"\n2. {args.sessions} concurrent sessions, aggregate decode tok/s at {cores} threads: "
                  f"llama.cpp batched {best_llama:.1f}, peer {best_peer:.1f}")  # fmt: skip
            print(f"   ratio {verdict(best_peer / best_llama, TARGET_BATCHED)}")
            print_batched_breakdown(rounds)
            best_llama, best_peer = best_rates(sampled)
            print(f"   at the API's default sampling: llama.cpp batched, a sampler chain per session, {best_llama:.1f}; "
                  f"peer {best_peer:.1f}")  # fmt: skip
            print(f"   ratio {verdict(best_peer / best_llama, TARGET_BATCHED)}")
        if "gap" not in args.skip:
            g = prefill_gap(peer, spec.model_id, args.gap_prompt_words)
            print(f"\n3. a decoding session while another prefills {g['prompt_tokens']} tokens ({g['prefill_s']:.2f} s):"
                  f" worst inter-token gap {g['worst_ms']:.0f} ms, {g['worst_at_s']:.2f} s after B's request"
                  f" (median {g['median_during_ms']:.1f} ms during it, {g['median_ms']:.1f} ms before it)")  # fmt: skip
            if not g["spanned"]:
                print("   NOTE: no request of the decoding session lasted through the whole prefill: the gaps above "
                      "cover only part of it")  # fmt: skip
        if "loop" not in args.skip:
            cost = loop_cost(peer, spec.model_id, args.sessions, (48, 192), args.rounds)
            if cost is None:
                print("\n4. event-loop CPU per token: n/a (no /proc)")
            else:
                print(f"\n4. the peer's event-loop CPU, {args.sessions} concurrent requests of 48 and 192 tokens (median of "
                      f"{args.rounds}): per token {cost['stream_token_us']:.0f} us streamed, {cost['plain_token_us']:.0f} us "
                      f"not (the SSE chunk {cost['stream_token_us'] - cost['plain_token_us']:.0f} us); per request "
                      f"{cost['stream_request_ms']:.1f} ms streamed, {cost['plain_request_ms']:.1f} ms not")  # fmt: skip
        swarm.stop(peer)

        if "memory" not in args.skip:
            meta = read_metadata(model_path)
            layers = min(10, meta.n_layers)
            part = swarm.start("ten-layers", spec.model_id, "--layers", f"0-{layers}")
            swarm.wait_ready(part)
            mem = rss(part.process.pid)
            weights = sum(meta.layer_bytes(i) for i in range(layers)) + meta.tensor_bytes.get("token_embd.weight", 0)
            heads = int(meta.arch_value("attention.head_count", 1))
            kv_heads = int(meta.arch_value("attention.head_count_kv", heads))
            kv = 2048 * 8 * layers * 2 * kv_heads * (meta.d_model // heads) * 2  # default --context, --max-sessions
            mib = 1024 * 1024
            print(f"\n5. memory of a peer holding layers 0-{layers} (default flags, idle): RSS {mem['VmRSS'] / mib:.0f} MiB "
                  f"(anonymous {mem['RssAnon'] / mib:.0f}, file-backed {mem['RssFile'] / mib:.0f}); slice weights "
                  f"{weights / mib:.0f} MiB, KV cache reserved {kv / mib:.0f} MiB; overhead beyond both "
                  f"{(mem['VmRSS'] - weights - kv) / mib:.0f} MiB")  # fmt: skip
            swarm.stop(part)
    return 0


if __name__ == "__main__":
    sys.exit(main())
