"""Chaos for failover: chats of every kind keep running while random peers die, hang and come back.

A loopback swarm of smollm2:135m (127.0.0.1 only, no mDNS): two entries, ``a`` 0-10 and
``c`` 20-30, replicas ``a2`` 0-10, ``b1``/``b2`` 10-20, ``c2`` 20-30, and a spare ``s``
choosing its own layers. ``--streams`` workers keep chats going in a loop, each drawing its
entry, prompt and kind (``--kinds``, default all) per chat: ``greedy`` (SSE, temperature 0),
``sampled`` (SSE, temperature 0.9, top_p 0.95 and a seed per prompt), ``ws`` (``/ws/chat``)
and ``plain`` (``"stream": false``), the last two greedy or seeded by turns. Meanwhile each round picks a
random non-entry peer and either kills it (SIGKILL), stops it politely (SIGTERM), stalls it
(SIGSTOP for 2-6 s, then SIGCONT), hangs it past the step deadline (SIGSTOP for 7-12 s), or
kills two replicas of different spans at once; a stopped or killed peer is restarted on its
data dir after a few seconds, and the next round waits until every peer is Ready again.

Every completed chat is checked against the same prompt's undisturbed text, greedy or seeded
(neither may depend on the route or on failovers: sampling is a pure function of ``(seed,
position)`` and a replay rebuilds the cache bit for bit; docs/ARCHITECTURE.md, "Failover"):
it must open with 200 (a ws chat: no error frame), end with a finish_reason and ``[DONE]``
(a plain chat: a JSON body with one), carry no error and give the same text. After the chaos,
no peer may hold a KV session (``/health`` ``sessions``) and every process must be gone. The
summary counts chats per kind, failovers (the entries' logs), mismatches, errors and leftover
sessions; the workdir keeps every peer's log.

Run (pinned to one core, as the tests are)::

    taskset -c 1 env PYTHONPATH=. INCLAVATE_HOME=... python scripts/chaos_failover.py --minutes 20 --seed 1
"""

from __future__ import annotations

import argparse
import json
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio
from trio_websocket import ConnectionClosed, HandshakeError, open_websocket_url

from inclavate.config import inclavate_home
from inclavate.local_swarm import LocalSwarm, PeerProcess, SwarmError

MODEL = "smollm2:135m"
ENTRIES = {"a": "0-10", "c": "20-30"}
REPLICAS = {"a2": "0-10", "b1": "10-20", "b2": "10-20", "c2": "20-30", "s": ""}
PROMPTS = [
    "Tell me a short story about a lighthouse keeper.",
    "Explain how a bicycle works to a child.",
    "Write a poem about the sea at night.",
    "What are three good reasons to learn to cook?",
    "Describe a walk through a forest in autumn.",
    "Why is the sky blue? Answer in a few sentences.",
]


KINDS = ("greedy", "sampled", "ws", "plain")
SAMPLING = {"temperature": 0.9, "top_p": 0.95}


@dataclass(frozen=True)
class Ask:
    """One chat to make: through which entry, which prompt, which kind, greedy or seeded."""

    entry: str
    prompt: int
    kind: str
    sampled: bool

    @property
    def key(self) -> tuple[int, bool]:
        """What its expected text depends on: the prompt and whether it is sampled."""
        return self.prompt, self.sampled


@dataclass
class Outcome:
    """One chat as the client saw it."""

    ask: Ask
    status: int = 0
    text: str = ""
    finish_reason: str | None = None
    done: bool = False
    error: str | None = None
    session_id: str = ""
    started: float = field(default_factory=time.time)
    ended: float = 0.0

    def problem(self, expected: str) -> str | None:
        """Why this chat broke the product's promise, or None."""
        if self.status != 200:
            return f"status {self.status}: {self.error}"
        if self.error is not None:
            return f"error event: {self.error}"
        if not self.done or self.finish_reason is None:
            return f"cut stream (done={self.done}, finish_reason={self.finish_reason})"
        if self.text != expected:
            return "mismatch"
        return None


def body(ask: Ask, max_tokens: int) -> dict[str, Any]:
    sampling = {**SAMPLING, "seed": 1000 + ask.prompt} if ask.sampled else {"temperature": 0}
    return {"model": MODEL, "messages": [{"role": "user", "content": PROMPTS[ask.prompt]}], "max_tokens": max_tokens,
            "stream": ask.kind != "plain", **sampling}  # fmt: skip


def chat(peer: PeerProcess, ask: Ask, max_tokens: int, timeout: float = 300.0) -> Outcome:
    """Make one chat of ``ask.kind`` to the end, noting everything a client could see go wrong
    (a client that waits ``timeout`` for it is hung)."""
    out = Outcome(ask)
    try:
        if ask.kind == "ws":
            trio.run(ws_chat, peer, out, body(ask, max_tokens), timeout)
        else:
            http_chat(peer, out, body(ask, max_tokens), timeout)
    except urllib.error.HTTPError as exc:
        out.status, out.error = exc.code, exc.read().decode(errors="replace")[:300]
    except (OSError, ValueError, trio.TooSlowError, HandshakeError, ConnectionClosed) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
        out.status = out.status or -1
    out.ended = time.time()
    return out


def http_chat(peer: PeerProcess, out: Outcome, payload: dict[str, Any], timeout: float) -> None:
    """``POST /v1/chat/completions``: SSE events to ``[DONE]``, or one JSON body."""
    req = urllib.request.Request(peer.url + "/v1/chat/completions", data=json.dumps(payload).encode(),
                                 headers={"content-type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        out.status = resp.status
        out.session_id = resp.headers.get("x-dppan-session-id", "")
        if not payload["stream"]:
            read_plain(out, json.loads(resp.read()))
            return
        for raw in resp:
            line = raw.decode().strip()
            if line == "data: [DONE]":
                out.done = True
            elif line.startswith("data: "):
                read_event(out, json.loads(line[6:]))


async def ws_chat(peer: PeerProcess, out: Outcome, payload: dict[str, Any], timeout: float) -> None:
    """``/ws/chat``: one request frame, then chunk frames to ``"[DONE]"``; an error frame
    carries its status."""
    with trio.fail_after(timeout):
        async with open_websocket_url(peer.url.replace("http://", "ws://") + "/ws/chat") as ws:
            await ws.send_message(json.dumps(payload))
            out.status = 200
            while not out.done:
                message = await ws.get_message()
                if message == "[DONE]":
                    out.done = True
                    continue
                event = json.loads(message)
                out.session_id = out.session_id or str(event.get("id", ""))
                if "error" in event:
                    out.status = int(event.get("status", -1))
                read_event(out, event)


def read_plain(out: Outcome, reply: dict[str, Any]) -> None:
    """A plain chat's body: complete by construction, so ``done`` once it parsed."""
    choice = reply["choices"][0]
    out.text, out.finish_reason, out.done = choice["message"].get("content") or "", choice.get("finish_reason"), True


def read_event(out: Outcome, event: dict[str, Any]) -> None:
    if "error" in event:
        out.error = json.dumps(event)[:300]
        return
    for choice in event.get("choices", []):
        out.finish_reason = choice.get("finish_reason") or out.finish_reason
        out.text += choice.get("delta", {}).get("content") or ""


class Chaos:
    """The swarm, the stream workers and the disturbances, with everything they saw."""

    def __init__(self, swarm: LocalSwarm, args: argparse.Namespace) -> None:
        self.swarm, self.args = swarm, args
        self.rng = random.Random(args.seed)
        self.peers: dict[str, PeerProcess] = {}
        self.expected: dict[tuple[int, bool], str] = {}
        self.outcomes: list[Outcome] = []
        self.events: list[str] = []
        self.actions: Counter[str] = Counter()
        self.rounds = 0
        self.stop = threading.Event()
        self.lock = threading.Lock()

    # ------------------------------------------------------------------ the swarm

    def start_peer(self, name: str) -> PeerProcess:
        layers = {**ENTRIES, **REPLICAS}[name]
        args = ("--layers", layers) if layers else ()
        boot = None if name == "a" else self.peers["a" if name in ("c", "a2", "b1") else "c"]
        peer = self.swarm.start(name, MODEL, *args, bootstrap=boot)
        self.peers[name] = peer
        return peer

    def start_swarm(self) -> None:
        for name in [*ENTRIES, *REPLICAS]:
            self.swarm.wait_ready(self.start_peer(name), timeout=180)
        self.wait_all_ready(60)

    def wait_all_ready(self, timeout: float) -> None:
        """Until both entries list every peer Ready (a restarted one under its old id)."""
        want = len(self.peers)

        def ready() -> bool:
            return all(sum(n["state"] == "Ready" for n in self.peers[e].get("/nodes")) == want for e in ENTRIES)

        self.swarm.wait(ready, timeout, f"{want} Ready peers on both entries")

    # ------------------------------------------------------------------ streams

    def reference(self) -> None:
        """Every prompt undisturbed, greedy and seeded, through each entry and over SSE, ws and
        plain JSON: neither text may depend on the route or on the kind of chat."""
        for prompt in range(len(PROMPTS)):
            for sampled in (False, True):
                asks = [Ask(e, prompt, kind, sampled) for e in ENTRIES for kind in ("sampled" if sampled else "greedy", "ws", "plain")]
                outs = [chat(self.peers[a.entry], a, self.args.max_tokens) for a in asks]
                for o in outs:
                    if o.problem(o.text) is not None:
                        raise SwarmError(f"reference run {o.ask} failed: {o}")
                if len({o.text for o in outs}) != 1:
                    raise SwarmError(f"undisturbed texts of prompt {prompt} (sampled: {sampled}) differ: {outs}")
                self.expected[(prompt, sampled)] = outs[0].text

    def draw(self, rng: random.Random, turn: int) -> Ask:
        """This worker's next chat: entry, prompt and kind drawn; ws and plain chats greedy
        and seeded by turns."""
        kind = rng.choice(self.args.kinds)
        sampled = kind == "sampled" or (kind in ("ws", "plain") and turn % 2 == 1)
        return Ask(rng.choice(list(ENTRIES)), rng.randrange(len(PROMPTS)), kind, sampled)

    def worker(self, n: int) -> None:
        rng = random.Random(self.args.seed * 1000 + n)
        turn = 0
        while not self.stop.is_set():
            ask = self.draw(rng, turn)
            out = chat(self.peers[ask.entry], ask, self.args.max_tokens)
            expected = self.expected[ask.key]
            problem = out.problem(expected)
            with self.lock:
                self.outcomes.append(out)
                if problem:
                    self.log(f"CHAT FAILED {ask} session {out.session_id}: {problem}"
                             + (f"\n  got:      {out.text!r}\n  expected: {expected!r}" if problem == "mismatch" else ""))  # fmt: skip
            turn += 1

    # ------------------------------------------------------------------ disturbances

    def log(self, line: str) -> None:
        stamp = time.strftime("%H:%M:%S")
        self.events.append(f"{stamp} {line}")
        print(f"{stamp} {line}", flush=True)

    def round(self, r: int) -> None:
        action = self.rng.choices(["kill", "term", "stop", "hang", "double"], weights=[5, 2, 2, 1, 1])[0]
        if action == "double":  # two replicas of different spans at once
            first = self.rng.choice(list(REPLICAS))
            names = [first, self.rng.choice([n for n in REPLICAS if n != first and (REPLICAS[n] != REPLICAS[first] or not REPLICAS[n])])]
        else:
            names = [self.rng.choice(list(REPLICAS))]
        pause = self.rng.uniform(7.0, 12.0) if action == "hang" else self.rng.uniform(2.0, 6.0)
        self.actions[action] += 1
        self.log(f"round {r}: {action} {' '.join(names)} (down {pause:.1f} s)")
        if action in ("stop", "hang"):  # hang: past the step deadline (5 s), so a failover
            self.peers[names[0]].process.send_signal(signal.SIGSTOP)
            time.sleep(pause)
            self.peers[names[0]].process.send_signal(signal.SIGCONT)
        else:
            for name in names:
                self.peers[name].process.send_signal(signal.SIGTERM if action == "term" else signal.SIGKILL)
            for name in names:
                self.reap(name, action)
            time.sleep(pause)
            for name in names:
                self.swarm.wait_ready(self.start_peer(name), timeout=180)
        self.wait_all_ready(90)
        time.sleep(self.rng.uniform(0.5, 3.0))

    def reap(self, name: str, action: str) -> None:
        """Wait for a signalled peer to exit (a polite stop drains first)."""
        peer = self.peers[name]
        try:
            code = peer.process.wait(60)
        except subprocess.TimeoutExpired:
            self.log(f"  {name} did not exit within 60 s of SIG{action.upper()}: killing it")
            peer.process.kill()
            code = peer.process.wait(10)
        if action == "term" and code != 0:
            self.log(f"  {name} exited {code} after SIGTERM")

    def run(self) -> None:
        workers = [threading.Thread(target=self.worker, args=(n,), daemon=True) for n in range(self.args.streams)]
        for w in workers:
            w.start()
        deadline = time.monotonic() + 60 * self.args.minutes
        r = 0
        try:
            while r < self.args.rounds and time.monotonic() < deadline:
                r += 1
                self.round(r)
        except SwarmError as exc:
            self.log(f"CHAOS STOPPED in round {r}: {exc}")
        finally:
            self.rounds = r
            self.stop.set()
            for w in workers:
                w.join(320)

    # ------------------------------------------------------------------ after

    def leftover_sessions(self, wait_s: float) -> dict[str, dict[str, int]]:
        """Sessions still held on each peer after ``wait_s`` of quiet (none is the promise)."""
        deadline = time.monotonic() + wait_s
        while True:
            held = {}
            for name, peer in self.peers.items():
                try:
                    sessions = peer.get("/health")["sessions"]
                except (OSError, SwarmError) as exc:
                    sessions = {"unanswered": 1, "why": str(exc)[:80]}  # type: ignore[dict-item]
                if any(v for v in sessions.values()):
                    held[name] = sessions
            if not held or time.monotonic() > deadline:
                return held
            time.sleep(1)

    def failovers(self) -> Counter[str]:
        """Failovers per session id, from every peer's log (``failover n/m`` lines)."""
        pattern = re.compile(r"session (\S+): .*failover \d+/\d+")
        found: Counter[str] = Counter()
        for p in self.peers.values():
            found.update(m.group(1) for m in pattern.finditer(p.log_path.read_text(errors="replace")))
        return found

    def summary(self, failovers: Counter[str]) -> tuple[int, list[str]]:
        """Print the counts per kind; return the mismatches and the other failures."""
        problems = [(o, o.problem(self.expected[o.ask.key])) for o in self.outcomes]
        mismatches = sum(p == "mismatch" for _, p in problems)
        errors = [f"{o.ask}: {p}" for o, p in problems if p and p != "mismatch"]
        print(f"rounds {self.rounds} ({', '.join(f'{n} {a}' for a, n in sorted(self.actions.items()))}); "
              f"chats completed {len(self.outcomes)}; failovers seen in logs {sum(failovers.values())}")  # fmt: skip
        for kind in self.args.kinds:
            mine = [(o, p) for o, p in problems if o.ask.kind == kind]
            moved = sum(failovers[o.session_id.removeprefix("chatcmpl-")] for o, _ in mine)
            print(f"  {kind:8} chats {len(mine):4} (seeded {sum(o.ask.sampled for o, _ in mine):4}), failovers {moved:3}, "
                  f"mismatches {sum(p == 'mismatch' for _, p in mine)}, errors {sum(bool(p) and p != 'mismatch' for _, p in mine)}")  # fmt: skip
        return mismatches, errors


def kinds(text: str) -> list[str]:
    chosen = [k.strip() for k in text.split(",") if k.strip()]
    if not chosen or set(chosen) - set(KINDS):
        raise argparse.ArgumentTypeError(f"kinds are among {', '.join(KINDS)}")
    return chosen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=20.0, help="how long to disturb the swarm")
    parser.add_argument("--rounds", type=int, default=10_000, help="at most this many disturbances")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--kinds", type=kinds, default=list(KINDS), help=f"chats to make, comma-separated (default {','.join(KINDS)})")
    parser.add_argument("--wire-dtype", default="f32", choices=("f16", "bf16", "f32"))
    parser.add_argument("--workdir", type=Path, help="keep the peers' data and logs here (default: a temp dir, kept)")
    args = parser.parse_args()

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="chaos-failover-"))
    common = ["--p2p-host", "127.0.0.1", "--no-mdns", "--threads", "1", "--context", "1024", "--max-sessions", "8",
              "--wire-dtype", args.wire_dtype, "--drain-timeout", "10"]  # fmt: skip
    print(f"command: {' '.join(sys.argv)}\nworkdir (peer logs): {workdir}", flush=True)
    with LocalSwarm(workdir, common, {"INCLAVATE_HOME": str(inclavate_home())}) as swarm:
        chaos = Chaos(swarm, args)
        chaos.start_swarm()
        chaos.reference()
        chaos.log("reference texts taken; chaos begins")
        chaos.run()
        leftovers = chaos.leftover_sessions(40)
        failovers = chaos.failovers()
    alive = [p.name for p in swarm.peers if p.alive()]
    print(f"\n===== summary (seed {args.seed}) =====")
    mismatches, errors = chaos.summary(failovers)
    print(f"mismatches {mismatches}; errors {len(errors)}")
    for e in errors:
        print(f"  {e}")
    print(f"leftover sessions: {leftovers or 'none'}; processes still alive: {alive or 'none'}")
    print(f"workdir: {workdir}")
    return 0 if not (mismatches or errors or leftovers or alive) else 1


if __name__ == "__main__":
    sys.exit(main())
