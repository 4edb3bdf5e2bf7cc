"""``inclavate chat``: a streaming chat in the terminal against any peer.

The conversation is kept for the session (each request carries the history, as the
OpenAI API expects). Ctrl-C during an answer stops that answer (the peer frees the session
when the connection closes); Ctrl-C or Ctrl-D at the prompt leaves.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from inclavate.errors import ConfigError, InclavateError
from inclavate.peer_api import DEFAULT_API, PeerApi, PeerRefused, malformed
from inclavate.swarm_view import DIM, RESET
from inclavate.terminal import printable

SESSION_HEADER = "x-dppan-session-id"
MAX_TEMPERATURE = 2.0
"""The API's range is [0, 2]: ``--temperature nan``, ``-1`` or ``5`` started a chat whose
every turn was a 400 (an audit from outside, 2026-12-08); refused at start now."""


def add_chat_command(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "chat",
        help="chat with a model the swarm serves, streaming in the terminal",
        description="A streaming chat against any peer's API. History is kept for the session; "
        "Ctrl-C stops an answer, Ctrl-C or Ctrl-D at the prompt leaves.",
    )
    parser.add_argument("--api", default=DEFAULT_API, help=f"any peer's API address (default {DEFAULT_API})")
    parser.add_argument("--model", help="model id (default: the first model the swarm serves)")
    parser.add_argument("--system", help="a system prompt")
    parser.add_argument("--max-tokens", type=int, default=512, help="longest answer in tokens (default 512)")
    parser.add_argument("--temperature", type=float, default=0.7,
                        help="sampling temperature, 0 to 2 (default 0.7; 0 is greedy)")  # fmt: skip
    parser.set_defaults(handler=_chat)


@dataclass
class Turn:
    """One streamed answer: turns SSE events into text to print, and remembers the answer.

    Events are a peer's word: ``choices`` that is no list, a choice or ``delta`` that is no
    object, text that is no string are skipped (each was a traceback that ended the chat and
    its history; an audit from outside, 2026-12-08)."""

    color: bool = False
    content: str = ""
    reasoning: str = ""
    finish_reason: str | None = None
    completion_tokens: int | None = None
    error: str | None = None
    chunks: int = 0
    cut_off: bool = False
    """The stream ended with neither ``[DONE]``, a finish reason nor an error: the answer is
    partial, and stays out of the history."""
    _in_reasoning: bool = field(default=False, repr=False)

    def feed(self, event: dict[str, Any]) -> str:
        """The text ``event`` adds to the screen (reasoning dimmed, apart from the answer)."""
        if "error" in event:
            err = event["error"]
            self.error = str(err.get("message") if isinstance(err, dict) else err)
            return self._close_reasoning()
        usage = event.get("usage")
        tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
        if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 0:
            self.completion_tokens = tokens
        out = ""
        choices = event.get("choices")
        for choice in choices if isinstance(choices, list) else ():
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta")
            delta = delta if isinstance(delta, dict) else {}
            thought, text = delta.get("reasoning_content"), delta.get("content")
            thought, text = (v if isinstance(v, str) else None for v in (thought, text))
            if thought:
                self.chunks += 1
                self.reasoning += thought
                if not self._in_reasoning:
                    self._in_reasoning = True
                    out += self._dim("(thinking) ")
                out += self._dim(printable(str(thought)))  # the chain's last stage chose it
            if text:
                self.chunks += 1
                out += self._close_reasoning()
                self.content += text
                out += printable(str(text))
            if choice.get("finish_reason"):
                self.finish_reason = str(choice["finish_reason"])
        return out

    @property
    def tokens(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else self.chunks

    def _close_reasoning(self) -> str:
        if not self._in_reasoning:
            return ""
        self._in_reasoning = False
        return "\n"

    def _dim(self, text: str) -> str:
        return f"{DIM}{text}{RESET}" if self.color else text


def stats_line(turn: Turn, seconds: float, route: Iterable[dict[str, Any]] | None) -> str:
    """``[12 tokens, 30.5 tok/s, finish stop, route …a1b2c3 0-10 → …d4e5f6 10-30]``."""
    parts = [f"{turn.tokens} tokens"]
    if turn.tokens and seconds > 0:
        parts.append(f"{turn.tokens / seconds:.1f} tok/s")
    if turn.finish_reason:
        parts.append(f"finish {turn.finish_reason}")
    hops = [f"…{str(h.get('peer_id', ''))[-6:]} {h.get('start_layer')}-{h.get('end_layer')}" for h in route or []]
    if hops:
        parts.append("route " + " → ".join(hops))
    return "[" + ", ".join(parts) + "]"


def pick_model(api: PeerApi, wanted: str | None) -> str:
    """``wanted``, or the first model the peer serves; an answer that is no OpenAI model list
    (a list, ``{"data": 5}``: a traceback before) is a :class:`PeerRefused`."""
    answer = api.get("/v1/models")
    if not isinstance(answer, dict) or not isinstance(answer.get("data"), list):
        raise malformed(f"{api.base}/v1/models", "a model list")
    served = [m["id"] for m in answer["data"] if isinstance(m, dict) and isinstance(m.get("id"), str)]
    if wanted:
        if wanted not in served:
            served_text = printable(", ".join(str(m) for m in served)) or "nothing"
            print(f"note: the swarm does not serve {printable(wanted)} right now (it serves: {served_text})", file=sys.stderr)
        return wanted
    if not served:
        raise InclavateError(f"the swarm at {api.base} serves no model right now; start peers, or pass --model")
    return str(served[0])


def _route(api: PeerApi, session_id: str | None) -> list[dict[str, Any]] | None:
    if not session_id:
        return None
    try:
        answer = api.get(f"/sessions/{session_id}")
    except InclavateError:
        return None  # an older peer without GET /sessions/:id: no route to show
    route = answer.get("route") if isinstance(answer, dict) else None
    return [hop for hop in route if isinstance(hop, dict)] if isinstance(route, list) else None


def _answer(api: PeerApi, body: dict[str, Any], color: bool) -> Turn:
    turn = Turn(color=color)
    started = time.monotonic()
    first: float | None = None
    session_id = None
    try:
        with api.stream("/v1/chat/completions", body) as (headers, events):
            session_id = headers.get(SESSION_HEADER)
            for event in events:
                text = turn.feed(event)
                if text:
                    first = first or time.monotonic()
                    print(text, end="", flush=True)  # made printable by ``Turn.feed``
            if not (events.done or turn.finish_reason or turn.error):
                turn.cut_off = True
                turn.error = f"the answer was cut off (the connection to {api.base} ended before the stream's end)"
    except KeyboardInterrupt:
        turn.finish_reason = "stopped"  # leaving the block closed the stream: the peer stops
    print()
    if turn.error:
        print(f"error: {printable(str(turn.error))}", file=sys.stderr)
    elapsed = time.monotonic() - (first or started)
    line = printable(stats_line(turn, elapsed, _route(api, session_id)))
    print(f"{DIM}{line}{RESET}" if color else line, file=sys.stderr)
    return turn


def _chat(args: argparse.Namespace) -> int:
    if args.max_tokens < 1:
        raise ConfigError("--max-tokens must be at least 1")
    if not (math.isfinite(args.temperature) and 0 <= args.temperature <= MAX_TEMPERATURE):
        raise ConfigError(f"--temperature must be a number from 0 to {MAX_TEMPERATURE:g}")
    api = PeerApi(args.api)
    model = pick_model(api, args.model)
    color = sys.stdout.isatty()
    history: list[dict[str, str]] = [{"role": "system", "content": args.system}] if args.system else []
    print(printable(f"chatting with {model} through {api.base} (Ctrl-C stops an answer, Ctrl-D leaves)"), file=sys.stderr)
    while True:
        try:
            prompt = input("you> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if not prompt.strip():
            continue
        history.append({"role": "user", "content": prompt})
        body = {"model": model, "messages": history, "stream": True, "stream_options": {"include_usage": True},
                "max_tokens": args.max_tokens, "temperature": args.temperature}  # fmt: skip
        try:
            turn = _answer(api, body, color)
        except PeerRefused as exc:
            history.pop()  # the peer refused the turn: it never happened
            print(f"error: {printable(str(exc))}", file=sys.stderr)
            continue
        if turn.content and not turn.cut_off:
            history.append({"role": "assistant", "content": turn.content})
        elif turn.error:
            history.pop()  # no answer, or a cut-off one: the turn did not happen
