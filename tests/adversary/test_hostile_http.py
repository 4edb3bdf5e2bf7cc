"""Hostile HTTP clients, fake legacy nodes and a stranger's peer against a live 3-peer swarm.

Each test is one finding; each ends with every honest peer alive, the honest records
unchanged, and a chat through the chain answering with the whole model's text. The module
ends with a property-based fuzz of the REST API driven by the peer's own ``/openapi.json``.
One swarm serves the whole module (peer b requires a join token for legacy nodes); findings
at the chat edge alone run against the app over the real model in this process instead."""

from __future__ import annotations

import concurrent.futures
import contextlib
import http.server
import json
import os
import resource
import secrets
import socket
import sys
import threading
import time
import urllib.parse
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import trio
from body_flood import flood, rss_mb
from forward_frames import attack, forward, hop, peer_id
from hostile_peer import HostilePeer, hostile_peer, honest_record
from p2p_flood import open_quietly
from live_swarm import MAX_TOKENS, MODEL, QUESTION, assert_swarm_healthy, chat, honest_nodes, three_peers
from local_context import LocalContext, serve
from reference import whole_model_text
from swarm import PeerProcess, Swarm, request_json

from api.limits import RequestLimits
from inclavate.local_swarm import free_port
from inclavate.types import LayerRange, NodeId
from p2p import wire
from p2p.framing import FramedStream
from p2p.routing import Hop
from p2p.vocab import PROTOCOL as VOCAB_PROTOCOL

pytestmark = [pytest.mark.swarm, pytest.mark.slow]
JOIN_TOKEN = "join-" + secrets.token_hex(8)
TOKEN = "relay-" + secrets.token_hex(8)
RELAY = "X-Inclavate-Relay-Token"


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Swarm, list[PeerProcess]]]:
    # ``a`` tries the cheapest route for every new session (``--trial-share 1``): the tests of
    # a stranger's legacy node need chats routed through it, new to ``a`` (on probation).
    entry = ["--trial-share", "1"]
    with three_peers(tmp_path_factory.mktemp("hostile-http"), per_peer={0: entry, 1: ["--join-token", JOIN_TOKEN]}) as (s, peers):
        yield s, peers


@pytest.fixture(scope="module")
def expected(smollm2, slice_cache) -> str:
    return whole_model_text(smollm2, slice_cache, QUESTION, MAX_TOKENS)


@pytest.fixture(scope="module")
def baseline(live) -> list[tuple[str, int, int, str]]:
    return honest_nodes(live[1][0])


class _FakeNode(http.server.BaseHTTPRequestHandler):
    """A legacy node that answers its health check and then lies: garbage on /forward."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._answer(200, b'{"ok": true}')

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("content-length") or 0))
        self._answer(200, b"garbage, not a frame")

    def _answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def fake_node_url() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeNode)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def register(peer: PeerProcess, node_id: str, url: str, layers: tuple[int, int] = (10, 20), *, token: str | None = TOKEN,
             headers: dict[str, str] | None = None) -> tuple[int, Any]:  # fmt: skip
    body = {"node_id": node_id, "model_id": MODEL, "http_url": url, "start_layer": layers[0], "end_layer": layers[1]}
    if token is not None:
        body["relay_token"] = token
    return request_json("POST", peer.url + "/nodes", body, headers=headers)


def legacy_state(peer: PeerProcess, node_id: str) -> str | None:
    return next((n["state"] for n in peer.get("/nodes") if n["legacy"] and n["node_id"].endswith(":" + node_id)), None)


def test_a_legacy_node_with_a_bad_url_never_registers(live, expected, baseline) -> None:
    """``http_url: "foo"`` then a chat used to kill the entry peer (ValueError in the relay)."""
    s, (a, b, c) = live
    closed = f"http://127.0.0.1:{free_port()}"
    for url, status in (("foo", 400), ("file:///etc/passwd", 400), ("ftp://127.0.0.1/x", 400), ("http://", 400),
                        ("http://user:pw@127.0.0.1:1/", 400), (closed, 422)):  # fmt: skip
        got, body = register(a, "n1", url)
        assert got == status and isinstance(body["error"], str), (url, got, body)
    assert register(a, "n1", closed, token=None)[0] == 400  # no relay token: nobody could drive it
    assert request_json("POST", a.url + "/nodes/n1/health", {"ready": True})[0] == 404
    assert_swarm_healthy([a, b, c], expected, baseline)


def test_a_stranger_s_failing_legacy_node_costs_its_chats_a_failover_not_the_relaying_peer(
        live, expected, baseline, fake_node_url: str) -> None:  # fmt: skip
    """Anyone may register a node for a peer to relay. Its failure was blamed on the relaying
    peer, here the entry: its failover then left out the entry's own layers 0-10, the only
    holder, and every chat routed through the node failed with a 503 (an audit, 2026-12-07)."""
    s, (a, b, c) = live
    for attempt in range(3):  # which chats the node draws is the routes' cost and chance: a fresh node a round
        node = f"whole{attempt}"
        assert register(a, node, fake_node_url, (0, 30))[0] == 200
        assert request_json("POST", a.url + f"/nodes/{node}/health", {"ready": True}, headers={RELAY: TOKEN})[0] == 200
        s.wait(lambda: legacy_state(a, node) == "Ready", 10, "the fake node to be Ready")  # noqa: B023
        logged = a.log_path.stat().st_size
        with concurrent.futures.ThreadPoolExecutor(6) as pool:  # routed through the node until it is held out
            answers = list(pool.map(lambda _: chat(a), range(6)))
        assert request_json("DELETE", a.url + f"/nodes/{node}", headers={RELAY: TOKEN})[0] == 204
        assert [status for status, _ in answers] == [200] * 6, answers
        assert {body["choices"][0]["message"]["content"] for _, body in answers} == {expected}
        with a.log_path.open("rb") as log:
            log.seek(logged)
            if f":{node} sent a bad frame".encode() in log.read():
                break
    else:
        pytest.skip("no chat was routed through the fake node in three rounds: nothing was tested")
    assert_swarm_healthy([a, b, c], expected, baseline)


def test_a_legacy_node_that_fails_is_held_out_of_routing(live, expected, baseline, fake_node_url: str) -> None:
    s, (a, b, c) = live
    assert register(a, "liar", fake_node_url)[0] == 200
    assert request_json("POST", a.url + "/nodes/liar/health", {"ready": True}, headers={RELAY: TOKEN})[0] == 200
    s.wait(lambda: legacy_state(a, "liar") == "Ready", 10, "the fake node to be Ready")
    liar = next(n for n in a.get("/nodes") if n["legacy"])

    states: list[str | None] = []

    async def run(evil: HostilePeer, stream: FramedStream, _: list) -> None:
        route = (Hop(NodeId(liar["node_id"]), peer_id(a), LayerRange(10, 20), fake_node_url), hop(c, "20-30"))
        hidden = np.zeros((1, 576), np.float32)
        # A stranger's frame is refused before the node is asked: it may not open sessions there.
        await stream.send(forward(evil, route, session="stranger", hidden=hidden), timeout=10)
        await trio.sleep(1.0)
        states.append(await trio.to_thread.run_sync(legacy_state, a, "liar"))
        # As a previous hop of 10-20 (a record of its own ends there), its frame is relayed, as a
        # chain's would be: the node's garbage answer must neither crash the relaying peer nor
        # keep the node in routing.
        record = honest_record(evil.identity, model=MODEL, start=9, end=10, state="Joining")  # on no route
        await evil.publish_record(record)
        with trio.fail_after(15):
            while evil.peer_id not in {n["node_id"] for n in await trio.to_thread.run_sync(a.get, "/nodes")}:
                await trio.sleep(0.2)
        await stream.send(forward(evil, route, session="previous-hop", hidden=hidden), timeout=10)
        await trio.sleep(1.0)
        await evil.publish_record(record.replace(state="Dead", seq=record.seq + 1))  # leave the registry as it was

    replies = attack(a, s, run, settle=2.0, gossip=True)
    assert states == ["Ready"]
    assert [(r.code, r.origin) for r in replies if isinstance(r, wire.Error)] == [
        ("session_limit", peer_id(a)), ("engine_error", liar["node_id"])]  # the node's failure, in its name
    assert legacy_state(a, "liar") == "Joining"  # held out, although it still heartbeats ready
    assert request_json("POST", a.url + "/nodes/liar/health", {"ready": True}, headers={RELAY: TOKEN})[0] == 200
    assert legacy_state(a, "liar") == "Joining"
    assert_swarm_healthy([a, b, c], expected, baseline)
    assert request_json("DELETE", a.url + "/nodes/liar", headers={RELAY: TOKEN})[0] == 204


def test_heartbeat_leave_and_reregistration_are_bound_to_the_relay_token(live, expected, baseline, fake_node_url: str) -> None:
    s, (a, b, c) = live
    assert register(a, "mine", fake_node_url, (0, 10))[0] == 200
    health = a.url + "/nodes/mine/health"
    assert request_json("POST", health, {"ready": True})[0] == 403
    assert request_json("POST", health, {"ready": True}, headers={RELAY: "x" * 20})[0] == 403
    assert request_json("DELETE", a.url + "/nodes/mine")[0] == 403
    assert register(a, "mine", fake_node_url, (0, 10), token="someone-else-entirely")[0] == 409
    assert legacy_state(a, "mine") == "Joining"  # never made Ready by a stranger
    assert register(a, "mine", fake_node_url, (0, 10))[0] == 200  # the node itself, restarted
    assert request_json("POST", health, {"ready": "yes"}, headers={RELAY: TOKEN})[0] == 400
    assert request_json("DELETE", a.url + "/nodes/mine", headers={RELAY: TOKEN})[0] == 204
    assert_swarm_healthy([a, b, c], expected, baseline)


def test_registration_needs_the_join_token_when_the_peer_has_one(live, expected, baseline, fake_node_url: str) -> None:
    s, (a, b, c) = live
    assert register(b, "joiner", fake_node_url)[0] == 403
    assert register(b, "joiner", fake_node_url, headers={"X-Inclavate-Join-Token": "guess"})[0] == 403
    assert register(b, "joiner", fake_node_url, headers={"X-Inclavate-Join-Token": JOIN_TOKEN})[0] == 200
    assert request_json("DELETE", b.url + "/nodes/joiner", headers={RELAY: TOKEN})[0] == 204
    assert_swarm_healthy([a, b, c], expected, baseline)


def test_what_a_browser_on_another_origin_can_send_is_refused(live, expected, baseline) -> None:
    s, (a, b, c) = live
    node = json.dumps({"node_id": "csrf", "model_id": MODEL, "http_url": "http://127.0.0.1:1", "relay_token": TOKEN})
    chat = json.dumps({"model": MODEL, "messages": QUESTION, "max_tokens": 2})
    with httpx.Client(timeout=30) as client:
        for path, body in (("/nodes", node), ("/nodes/join", node), ("/v1/chat/completions", chat)):
            for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
                headers = {"content-type": ctype} if ctype else {}
                r = client.post(a.url + path, content=body, headers=headers)
                assert r.status_code == 415 and "error" in r.json(), (path, ctype, r.status_code)
            r = client.post(a.url + path, content=body, headers={"content-type": "application/json", "origin": "http://evil.example"})
            assert r.status_code == 403 and "error" in r.json()
        r = client.delete(a.url + "/sessions/x", headers={"origin": "http://evil.example"})
        assert r.status_code == 403
        r = client.delete(a.url + "/sessions/x", headers={"origin": a.url})  # same origin: allowed
        assert r.status_code == 404
    assert_swarm_healthy([a, b, c], expected, baseline)


def test_a_websocket_from_another_origin_is_refused(live, expected, baseline) -> None:
    """Browsers do not preflight websockets: ``/ws/chat`` checks ``Origin`` (and ``Host``)
    itself. A second request on the refused connection used to make hypercorn raise h11's
    LocalProtocolError out of the server nursery: two requests stopped the peer."""
    s, (a, b, c) = live
    upgrade = {"connection": "Upgrade", "upgrade": "websocket", "sec-websocket-version": "13",
               "sec-websocket-key": "dGhlIHNhbXBsZSBub25jZQ=="}  # fmt: skip
    with httpx.Client(timeout=10) as client:
        assert client.get(a.url + "/ws/chat", headers={**upgrade, "origin": "http://evil.example"}).status_code == 403
        try:
            client.get(a.url + "/ws/chat", headers={**upgrade, "host": "evil.example"})
        except httpx.HTTPError:
            pass  # this connection may be dropped; the peer must not be
    with httpx.Client(timeout=10) as client:
        assert client.get(a.url + "/ws/chat", headers={**upgrade, "host": "evil.example"}).status_code == 403
    assert_swarm_healthy([a, b, c], expected, baseline)


def test_dns_rebinding_hosts_are_refused(live) -> None:
    a = live[1][0]
    port = a.api_port
    with httpx.Client(timeout=10) as client:
        for host, status in ((f"evil.example:{port}", 403), ("evil.example", 403), (f"localhost:{port}", 200),
                             (f"127.0.0.1:{port}", 200), (f"[::1]:{port}", 200)):  # fmt: skip
            r = client.get(a.url + "/health", headers={"host": host})
            assert r.status_code == status, host


def test_deeply_nested_json_is_a_400_in_the_spec_shape(live, expected, baseline) -> None:
    s, (a, b, c) = live
    deep = '{"model": ' + "[" * 100_000 + "]" * 100_000 + "}"
    with httpx.Client(timeout=30) as client:
        for path in ("/v1/chat/completions", "/nodes", "/nodes/join", "/nodes/x/health"):
            r = client.post(a.url + path, content=deep, headers={"content-type": "application/json"})
            assert r.status_code == 400 and isinstance(r.json()["error"], str), (path, r.status_code, r.text[:200])
    assert_swarm_healthy([a, b, c], expected, baseline)


@pytest.fixture
async def local_chat(smollm2, slice_cache) -> AsyncIterator[tuple[str, LocalContext]]:
    """The REST app over the real model in this process: no swarm, for the chat edge."""
    ctx = LocalContext(MODEL, smollm2.path, slice_cache, context_length=256)
    try:
        async with serve(ctx) as url:
            yield url, ctx
    finally:
        ctx.close()


async def _chat_and_ws(url: str, body: bytes) -> tuple[httpx.Response, dict[str, Any]]:
    """The same request body through ``POST /v1/chat/completions`` and ``/ws/chat``."""
    from trio_websocket import open_websocket_url

    async with httpx.AsyncClient(timeout=60) as client:
        response = await client.post(url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    async with open_websocket_url(url.replace("http://", "ws://") + "/ws/chat") as ws:
        await ws.send_message(body)
        frame = json.loads(await ws.get_message())
    return response, frame


async def test_an_empty_websocket_frame_is_a_400_frame_not_an_idle_close(local_chat) -> None:
    """Quart hands an empty binary frame to the handler as ``None``, which ``/ws/chat`` took
    for its idle deadline: the connection was closed at once as "idle: no request for a
    while", with no error. It is now an empty body (400), and the connection serves on."""
    from trio_websocket import open_websocket_url

    url, _ = local_chat
    with trio.fail_after(60):
        async with open_websocket_url(url.replace("http://", "ws://") + "/ws/chat") as ws:
            for empty in (b"", ""):
                await ws.send_message(empty)
                frame = json.loads(await ws.get_message())
                assert frame["status"] == 400 and "JSON" in frame["error"], frame
            await ws.send_message(json.dumps({"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}))
            assert "choices" in json.loads(await ws.get_message())


async def test_a_websocket_request_as_large_as_a_post_body_gets_the_same_answer(local_chat) -> None:
    """hypercorn's 16 MiB websocket default closed the connection (1009) on a 17 MiB request
    frame, with no error frame, where the same body over HTTP got its JSON answer: both
    paths take a request up to the body limit, 24 MiB (2026-12-07, an audit from outside)."""
    url, _ = local_chat
    padding = "x" * (17 * 1024 * 1024)
    body = json.dumps({"model": "no-such-model", "messages": [{"role": "user", "content": padding}]}).encode()
    with trio.fail_after(60):
        response, frame = await _chat_and_ws(url, body)
    assert response.status_code == frame["status"] == 422 and "no-such-model" in frame["error"], (response.status_code, frame)


async def test_an_error_quotes_at_most_a_bounded_part_of_what_was_sent(local_chat) -> None:
    """Error messages quote the caller's input: an 8 MiB model id came back as an 8 MiB 422
    body, a 60,000-character id in a path as a 60 KB 404 (2026-12-07, an audit from outside)."""
    from api.errors import MAX_MESSAGE_CHARS

    url, _ = local_chat
    long_id = "m" * 60_000
    body = json.dumps({"model": "x" * (8 << 20), "messages": [{"role": "user", "content": "hi"}]})
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        answers = [await client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"}),
                   await client.get(f"/v1/models/{long_id}"), await client.get(f"/metrics/model/{long_id}")]  # fmt: skip
    for response, status in zip(answers, (422, 404, 404), strict=True):
        assert response.status_code == status and len(response.json()["error"]) < MAX_MESSAGE_CHARS + 100, (status, len(response.content))


async def test_a_content_part_type_that_is_not_a_string_is_a_media_400(local_chat) -> None:
    """``"type": ["x"]`` reached a dict lookup and raised ``TypeError: unhashable`` (500)."""
    url, _ = local_chat
    for kind in (["x"], {"image_url": 1}):
        body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": [{"type": kind}]}]}).encode()
        response, frame = await _chat_and_ws(url, body)
        for status, error in ((response.status_code, response.json()["error"]), (frame["status"], frame["error"])):
            assert status == 400 and error["param"] == "messages[0].content[0].type" and error["code"] == "invalid_media", (kind, status, error)


async def test_a_lone_surrogate_in_chat_content_is_a_400(local_chat) -> None:
    """``"\\ud800"`` is valid JSON that is not text: the tokenizer's UTF-8 encode raised (500)."""
    url, _ = local_chat
    for content in (rb'"hi \ud800"', rb'[{"type": "text", "text": "\udfff"}]'):
        body = b'{"model": "' + MODEL.encode() + b'", "max_tokens": 1, "messages": [{"role": "user", "content": ' + content + b"}]}"
        response, frame = await _chat_and_ws(url, body)
        assert response.status_code == 400 and "surrogate" in response.json()["error"], response.text
        assert frame["status"] == 400 and "surrogate" in frame["error"], frame


async def test_a_prompt_too_long_for_the_context_is_refused_before_any_tokenizing(local_chat, monkeypatch) -> None:
    """Four clients with 20 MB prompts held the two preparation threads ~7 s each (render,
    tokenize, then the 400), stalling every chat. The 400 now comes from the length alone;
    the bound is sound: a prompt near it that fits (66-byte tokens) is still served."""
    url, ctx = local_chat
    chat = ctx.chat
    calls: list[str] = []
    tokenize, render = chat.tokenizer.tokenize, chat.template.render
    monkeypatch.setattr(chat.tokenizer, "tokenize", lambda *a, **k: calls.append("tokenize") or tokenize(*a, **k))
    monkeypatch.setattr(chat.template, "render", lambda *a, **k: calls.append("render") or render(*a, **k))

    async def ask(content: str) -> httpx.Response:
        body = {"model": MODEL, "max_tokens": 1, "temperature": 0, "messages": [{"role": "user", "content": content}]}
        async with httpx.AsyncClient(timeout=120) as client:
            return await client.post(url + "/v1/chat/completions", json=body)

    huge = await ask("word " * 400_000)  # 2 MB; the context holds 256 tokens
    assert huge.status_code == 400 and "256" in huge.json()["error"], huge.text  # the same 400 as after tokenizing
    assert calls == []  # neither rendered nor tokenized
    assert "at least" in huge.json()["error"]
    fits = await ask((" " + "=" * 65) * 200)  # 200 tokens of 66 bytes: 13,200 characters
    assert fits.status_code == 200 and fits.json()["usage"]["prompt_tokens"] < 256, fits.text
    assert calls[:2] == ["render", "tokenize"]


async def test_a_prompt_too_long_in_any_role_is_refused_before_any_tokenizing(local_chat, monkeypatch) -> None:
    """The early refusal counted user text only: 21 MB in a system message held a preparation
    thread 7-14 s tokenizing before the same 400, and a one-word chat on the peer waited ~12 s.
    Every role the template writes (instructions, earlier answers, tool results) now counts
    once rendered, before tokenizing; a long system prompt that fits is still served."""
    url, ctx = local_chat
    calls: list[str] = []
    tokenize = ctx.chat.tokenizer.tokenize
    monkeypatch.setattr(ctx.chat.tokenizer, "tokenize", lambda *a, **k: calls.append("tokenize") or tokenize(*a, **k))

    async def ask(*messages: dict[str, Any]) -> httpx.Response:
        body = {"model": MODEL, "max_tokens": 1, "temperature": 0, "messages": [*messages, {"role": "user", "content": "hi"}]}
        async with httpx.AsyncClient(timeout=120) as client:
            return await client.post(url + "/v1/chat/completions", json=body)

    huge = "word " * 400_000  # 2 MB; the context holds 256 tokens
    call = {"id": "c1", "type": "function", "function": {"name": "look", "arguments": "{}"}}
    for messages in (
        [{"role": "system", "content": huge}],
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": huge}],
        [{"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "tool", "tool_call_id": "c1", "content": huge}],
    ):
        refused = await ask(*messages)
        assert refused.status_code == 400 and "at least" in refused.json()["error"], (messages[-1]["role"], refused.text)
        assert "256" in refused.json()["error"] and calls == [], messages[-1]["role"]
    fits = await ask({"role": "system", "content": (" " + "=" * 65) * 200})  # 200 tokens of 66 bytes
    assert fits.status_code == 200 and fits.json()["usage"]["prompt_tokens"] < 256, fits.text
    assert calls == ["tokenize"]


async def test_a_flood_of_chats_past_the_entrys_turns_is_a_429_before_any_work(smollm2, slice_cache) -> None:
    """100 concurrent streams from one client through one entry of a 3-peer swarm were all
    taken (200): the entry drove every one of them at once, they queued for the stages' 8
    session slots past its step deadline, it blamed healthy peers and failed over, and 43-57
    of them ended in an in-band 503 ("no Ready chain covers ...: layers 0-10 have no Ready
    node", the entry's own layers), with another client's 5-token chat waiting 37-186 s. An
    entry now drives at most ``max_generations`` at once, lets ``max_waiting_generations``
    wait their turn, and refuses the rest with a 429 before any work, on every chat path;
    a generation that ends, however it ends, gives its turn to the next."""
    ctx = LocalContext(MODEL, smollm2.path, slice_cache, context_length=1024)
    ctx.limits = RequestLimits(max_generations=1, max_waiting_generations=1)
    calls: list[str] = []
    tokenize = ctx.chat.tokenizer.tokenize
    ctx.chat.tokenizer.tokenize = lambda *a, **k: calls.append("tokenize") or tokenize(*a, **k)  # type: ignore[method-assign]
    essay = "Write a very long essay about the history of Rome."  # 900 tokens at temperature 0: it holds its turn
    body = {"model": MODEL, "temperature": 0, "messages": [{"role": "user", "content": essay}]}
    try:
        async with serve(ctx) as url, httpx.AsyncClient(timeout=60) as client:

            async def stream(max_tokens: int) -> httpx.Response:
                chat = client.build_request("POST", url + "/v1/chat/completions", json={**body, "max_tokens": max_tokens, "stream": True})
                return await client.send(chat, stream=True)

            running = await stream(900)
            tokens = running.aiter_lines()  # kept: an abandoned line iterator closes the connection
            while '"content":"' not in (line := await tokens.__anext__()) or '"content":""' in line:
                pass  # up to its first token: it holds the only turn
            waiting = await stream(3)
            queued = waiting.aiter_lines()
            assert waiting.status_code == 200 and '"role":"assistant"' in await queued.__anext__()  # it waits its turn
            prepared = len(calls)
            refused = await client.post(url + "/v1/chat/completions", json={**body, "max_tokens": 3})
            assert refused.status_code == 429 and isinstance(refused.json()["error"], str), refused.text
            assert 1 <= int(refused.headers["retry-after"]) <= 60  # the openai SDK's retry waits this long
            streamed = await stream(3)
            await streamed.aread()
            assert streamed.status_code == 429 and isinstance(streamed.json()["error"], str), streamed.text
            _, frame = await _chat_and_ws(url, json.dumps({**body, "max_tokens": 3}).encode())
            assert frame["status"] == 429 and isinstance(frame["error"], str), frame
            assert len(calls) == prepared  # refused before any work: nothing was tokenized
            await running.aclose()  # the first client leaves: the waiting one gets the turn and finishes
            with contextlib.suppress(httpx.StreamError, httpx.TransportError):  # run the iterator to its end
                async for _ in tokens:
                    pass
            rest = [line async for line in queued if line]
            await waiting.aclose()
            assert any('"finish_reason":"length"' in line for line in rest) and rest[-1] == "data: [DONE]", rest
            after = await client.post(url + "/v1/chat/completions", json={**body, "max_tokens": 3})
            assert after.status_code == 200, after.text  # every turn was given back
    finally:
        ctx.close()


async def _send_quietly(stream: trio.SocketStream, data: bytes) -> None:
    """Send what the peer takes: one that refused the body may close while it comes."""
    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
        await stream.send_all(data)


async def _answer(stream: trio.SocketStream) -> tuple[int | None, bytes]:
    """The status and body of one HTTP/1.1 answer on ``stream`` (None: closed without one)."""
    received = b""
    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        while b"\r\n\r\n" not in received and (chunk := await stream.receive_some()):
            received += chunk
        head, _, body = received.partition(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")), 0)
        while len(body) < length and (chunk := await stream.receive_some()):
            body += chunk
    if not received.startswith(b"HTTP/1.1 "):
        return None, received
    return int(received.split(b" ")[1]), received.partition(b"\r\n\r\n")[2]


async def test_request_bodies_a_peer_buffers_at_once_are_bounded_over_all_connections(smollm2, slice_cache) -> None:
    """Each body had its ceiling (24 MiB for JSON routes), but Quart buffers a body as it
    arrives and nothing bounded them together: 40 connections sending most of a 24 MiB body
    to ``POST /v1/chat/completions`` raised a peer's RSS by ~940 MB (to ``POST /nodes``
    ~1.2 GB), more connections more. Bodies now share one budget (``max_buffered_body_bytes``,
    ``api.body_budget``): past it a body is refused with a 503 in the spec's shape, a
    smaller one displacing the largest still arriving, so an honest chat gets in through
    the flood; every request gives its bytes back when it ends."""
    from api.app import create_app, serve_api

    mib = 1024 * 1024
    ctx = LocalContext(MODEL, smollm2.path, slice_cache, context_length=256)
    ctx.limits = RequestLimits(max_body_bytes=4 * mib, max_buffered_body_bytes=16 * mib, max_generations=4)  # its 4 slots
    chat = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    try:
        app = create_app(ctx)
        port = free_port()
        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                await nursery.start(serve_api, app, "127.0.0.1", port)
                flood = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(12)]
                for stream in flood:  # 12 x 3 MiB of 4 MiB bodies, held unfinished
                    head = ("POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                            f"Content-Type: application/json\r\nContent-Length: {4 * mib}\r\n\r\n")  # fmt: skip
                    await _send_quietly(stream, head.encode() + b" " * (3 * mib))
                async with httpx.AsyncClient(timeout=60) as client:
                    honest = await client.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=chat)
                    assert honest.status_code == 200, honest.text  # through the flood
                    for stream in flood:
                        await _send_quietly(stream, b" " * mib)  # the rest: whole bodies of spaces are 400s
                    answers = [await _answer(stream) for stream in flood]
                    for stream in flood:
                        await stream.aclose()
                    refused = [json.loads(body) for status, body in answers if status == 503]
                    assert refused and all("request bodies" in r["error"] for r in refused), answers
                    assert {status for status, _ in answers} <= {400, 503, None}, answers
                    budget = app.extensions["inclavate.body_budget"]
                    assert budget.peak <= 16 * mib and budget.refused >= len(refused)
                    chats = [None] * 16  # sixteen honest chats at once, after it

                    async def ask(i: int) -> None:
                        chats[i] = await client.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=chat)

                    async with trio.open_nursery() as asking:
                        for i in range(16):
                            asking.start_soon(ask, i)
                    assert all(r is not None and r.status_code == 200 for r in chats), chats
                assert budget.held == 0  # every request gave its bytes back
                nursery.cancel_scope.cancel()
    finally:
        ctx.close()


def test_memory_a_flood_of_bodies_left_goes_back_once_it_is_over(tmp_path) -> None:
    """The body budget bounds what a peer holds at once, not what glibc keeps after: it
    raises its mmap threshold to the largest block freed, so later bodies come from the heap
    and stay there. Two floods of 40 connections x 23 of 24 MiB left a real peer ~530 MB
    above its start, for good (``scripts/bench_body_flood.py``); the peer now trims its heap
    once a flood is over (``api.heap_trim``). Memory, not time: RSS is polled for up to 20 s
    and must come back within 150 MB of where it started."""
    with Swarm(tmp_path) as s:
        peer = s.start("a")
        s.wait_ready(peer)
        chat = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
        assert request_json("POST", peer.url + "/v1/chat/completions", chat, timeout=60)[0] == 200
        pid = peer.process.pid
        start = rss_mb(pid)
        peaks = [trio.run(lambda: flood(peer.api_port, connections=40, pid=pid)) for _ in range(2)]
        assert max(peaks) > start + 200, (start, peaks)  # the flood did raise it
        deadline = time.monotonic() + 20
        while (now := rss_mb(pid)) > start + 150 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert now <= start + 150, f"RSS {now:.0f} MB after the floods, {start:.0f} MB before (peaks {peaks})"
        assert request_json("POST", peer.url + "/v1/chat/completions", chat, timeout=60)[0] == 200


def _closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(1, socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, OSError):  # not yet connected, or connected and open
        return False


def _health_on(sock: socket.socket) -> bytes:
    """``GET /health`` on a keep-alive connection: the answer's status line."""
    sock.setblocking(True)
    sock.settimeout(10)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    answer = b""
    while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
        chunk = sock.recv(65536)
        assert chunk, f"closed after {answer!r}"
        answer += chunk
    return answer.split(b"\r\n")[0]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts the peer's descriptors in /proc")
def test_a_flood_of_idle_connections_leaves_the_peer_its_descriptors_and_its_clients(tmp_path) -> None:
    """Nothing counted HTTP connections: 1,100 connections that sent nothing took every
    descriptor of a peer limited to 1,024 for 30 s at a time (its keep-alive); the API
    answered nobody (``accept returned EMFILE`` ten times a second) and a peer bootstrapping
    through it found nobody answering its dial. Here 300 from 127.0.0.2 against a peer
    limited to 256 (the API's share 64): each newcomer ends the flood's oldest, so the peer
    never reaches its limit, a keep-alive client on 127.0.0.1 keeps its connection and a
    new one is answered (before: 256 descriptors held, ``EMFILE``, the new client unanswered)."""
    with Swarm(tmp_path) as s:
        peer = s.start("a")
        s.wait_ready(peer)
        resource.prlimit(peer.process.pid, resource.RLIMIT_NOFILE, (256, 256))
        honest = socket.create_connection(("127.0.0.1", peer.api_port), timeout=10)
        flood: list[socket.socket] = []
        try:
            assert _health_on(honest) == b"HTTP/1.1 200 "
            flood = open_quietly(peer.api_port, "127.0.0.2", 300)
            most = 0

            def flood_ended() -> bool:
                nonlocal most
                most = max(most, len(os.listdir(f"/proc/{peer.process.pid}/fd")))
                return sum(map(_closed_by_peer, flood)) >= 300 - 64

            s.wait(flood_ended, 60, "the peer to end the flood's surplus", peer)
            assert most < 256, f"the peer held {most} descriptors, its limit 256"
            assert _health_on(honest) == b"HTTP/1.1 200 "  # kept through the flood
            assert peer.get("/health")["ok"]  # and a newcomer is answered
            assert "EMFILE" not in peer.log_path.read_text(errors="replace")
        finally:
            honest.close()
            for sock in flood:
                sock.close()


async def test_an_idle_chat_websocket_is_closed(smollm2, slice_cache) -> None:
    """A ``/ws/chat`` connection that never sent a request stayed open for ever (checked to
    120 s): 2,000 of them held 2,000 descriptors and 64 MB of a peer, and nothing ever gave
    them back (HTTP connections are closed after 30 s idle, 60 s for a body that never
    comes). One that sends no request for ``websocket_idle_s`` is now closed; one that
    keeps asking is served as before."""
    ctx = LocalContext(MODEL, smollm2.path, slice_cache, context_length=256)
    ctx.limits = RequestLimits(websocket_idle_s=1.0)
    try:
        async with serve(ctx) as url:
            _, frame = await _chat_and_ws(url, json.dumps({"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}).encode())
            assert "choices" in frame, frame  # a request within the idle time is answered
            stream = await trio.open_tcp_stream("127.0.0.1", int(url.rsplit(":", 1)[1]))
            try:
                await stream.send_all(b"GET /ws/chat HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                                      b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")  # fmt: skip
                received = b""
                with trio.fail_after(5):  # then nothing is sent: the peer closes the connection
                    while chunk := await stream.receive_some():
                        received += chunk
            finally:
                await stream.aclose()
            head, _, frames = received.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 101") and frames[:1] == b"\x88", received  # a close frame, then EOF
    finally:
        ctx.close()


@contextlib.asynccontextmanager
async def _held_turn(smollm2, slice_cache) -> AsyncIterator[tuple[int, Any]]:
    """A peer whose only generation turn the test holds: a chat request waits for it, and
    the handler reads nothing while it waits (unless it watches the connection)."""
    from api.app import create_app, serve_api
    from inclavate.types import SessionId

    ctx = LocalContext(MODEL, smollm2.path, slice_cache, context_length=256)
    ctx.limits = RequestLimits(max_generations=1)
    try:
        app = create_app(ctx)
        port = free_port()
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_api, app, "127.0.0.1", port)
            sessions = app.extensions["inclavate.sessions"]
            async with sessions.track(SessionId("held-by-the-test")):
                yield port, sessions
            nursery.cancel_scope.cancel()
    finally:
        ctx.close()


async def test_frames_sent_while_a_chat_websocket_answers_are_refused_and_a_close_is_seen(smollm2, slice_cache) -> None:
    """``/ws/chat`` read the next frame only once the current request was answered. Frames a
    client sent meanwhile queued in the peer, ten in hypercorn and ten in quart-trio, up to
    16 MiB each (~330 MB a connection), and its close queued behind them: a client that left
    mid-answer after sending more left its generation running to ``max_tokens`` (or its
    wait for a turn to 120 s), then the frames it sent ran as requests, to nobody. Frames
    before ``"[DONE]"`` are now read and refused (409), and a close is seen at once."""
    from trio_websocket import open_websocket_url

    request = json.dumps({"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
    frame = b"x" * (4 * 1024 * 1024)
    with trio.fail_after(60):
        async with _held_turn(smollm2, slice_cache) as (port, sessions):
            async with open_websocket_url(f"ws://127.0.0.1:{port}/ws/chat", max_message_size=1 << 20) as ws:
                await ws.send_message(request)
                for _ in range(30):
                    await ws.send_message(frame)
                answers = [json.loads(await ws.get_message()) for _ in range(31)]
                refused = [a for a in answers if "error" in a]
                assert len(refused) == 30 and all(a["status"] == 409 and "[DONE]" in a["error"] for a in refused), refused[:2]
                assert len(sessions) == 2  # the test's turn and the request waiting for it
                stream = ws._stream  # noqa: SLF001 - leave without a close handshake, as a crash would
                await ws.send_message(frame)
                await stream.aclose()
            while len(sessions) > 1:  # the waiting request left with its client
                await trio.sleep(0.05)


@pytest.mark.parametrize("after, upgrade", [(b"G", b""), (b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", b""),
                                            (b"G" * 200_000, b""), (b"G" * 200_000, b"Upgrade: x\r\n")],
                         ids=["a byte", "a request", "past the bound", "past the bound, asking an upgrade"])  # fmt: skip
async def test_a_client_that_sent_a_byte_more_and_left_is_seen_to_go(smollm2, slice_cache, after: bytes,
                                                                      upgrade: bytes) -> None:  # fmt: skip
    """hypercorn's HTTP/1.1 protocol holds a read when bytes of a next request follow a
    whole one, and read nothing more until the response was done: a client that sent one
    byte more and left was never seen to go, so a non-streamed chat ran to ``max_tokens``
    (or its wait for a turn to 120 s), a speech job completed and stored its audio, for
    nobody (20 such requests kept a 3-peer chain busy 129 s: an audit, 2026-12-07). The
    connection is now read on, and its close seen at once."""
    body = json.dumps({"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}).encode()
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               b"%sContent-Length: %d\r\n\r\n" % (upgrade, len(body))) + body  # fmt: skip
    with trio.fail_after(30):
        async with _held_turn(smollm2, slice_cache) as (port, sessions):
            client = await trio.open_tcp_stream("127.0.0.1", port)
            all_sent = trio.Event()

            async def send() -> None:  # past the bound the peer closes on us: the rest may not go
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    await client.send_all(request + after)
                all_sent.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(send)
                while len(sessions) < 2 and not (len(after) > 64 * 1024 and all_sent.is_set()):
                    await trio.sleep(0.05)
            await client.aclose()
            with trio.fail_after(5):  # it waited 120 s for a turn before
                while len(sessions) > 1:
                    await trio.sleep(0.05)


async def test_pipelined_requests_are_still_answered_in_order() -> None:
    """Reading on while a request runs (above) must not break HTTP/1.1 pipelining."""
    from quart_trio import QuartTrio

    from api.app import serve_api

    app = QuartTrio("pipelining")
    arrived: list[int] = []

    @app.get("/slow/<int:n>")
    async def slow(n: int):  # type: ignore[no-untyped-def]
        arrived.append(n)
        await trio.sleep(0.1)
        return f"answer {n}"

    port = free_port()
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_api, app, "127.0.0.1", port)
            client = await trio.open_tcp_stream("127.0.0.1", port)
            await client.send_all(b"".join(b"GET /slow/%d HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" % n for n in range(3)))
            got = b""
            while not got.endswith(b"answer 2"):
                got += await client.receive_some(65536)
            assert got.count(b"HTTP/1.1 200") == 3 and got.index(b"answer 0") < got.index(b"answer 1") and arrived == [0, 1, 2]
            await client.aclose()
            nursery.cancel_scope.cancel()


async def test_a_keep_alive_clients_large_next_request_is_answered() -> None:
    """A next request sent as soon as the answer before it was read lands while the
    connection's protocol still reads both sides done: one of over 16 KiB was taken for junk
    pipelined behind a running request, and the connection closed unanswered (20 of 20 on a
    raw socket, 8 of 30 with httpx: a review, 2026-12-07)."""
    from quart import request
    from quart_trio import QuartTrio

    from api.app import serve_api

    app = QuartTrio("keep-alive")

    @app.post("/echo")
    async def echo():  # type: ignore[no-untyped-def]
        return str(len(await request.get_data()))

    def post(size: int) -> bytes:
        return b"POST /echo HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: %d\r\n\r\n" % size + b"x" * size

    async def answer(client: trio.SocketStream) -> bytes:
        got = b""
        while b"\r\n\r\n" not in got or len(got.split(b"\r\n\r\n", 1)[1]) < int(
                got.split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0]):  # fmt: skip
            data = await client.receive_some(65536)
            assert data, f"the connection closed after {got[:80]!r}"
            got += data
        return got.split(b"\r\n\r\n", 1)[1]

    port = free_port()
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_api, app, "127.0.0.1", port)
            client = await trio.open_tcp_stream("127.0.0.1", port)
            for _ in range(20):
                await client.send_all(post(10))
                assert await answer(client) == b"10"
                await client.send_all(post(20_000))  # at once, on the same connection
                assert await answer(client) == b"20000"
            await client.aclose()
            nursery.cancel_scope.cancel()


async def test_a_chat_websocket_serves_the_next_request_after_refusing_one(local_chat) -> None:
    """The refusal is for frames sent before ``"[DONE]"``; the next request is served."""
    from trio_websocket import open_websocket_url

    url, _ = local_chat
    request = json.dumps({"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]})
    with trio.fail_after(60):
        async with open_websocket_url(url.replace("http://", "ws://") + "/ws/chat") as ws:
            await ws.send_message(request)
            await ws.send_message(request)
            frames = []
            while (frames[-1] if frames else None) != "[DONE]":
                frames.append(await ws.get_message())
            # the second frame waited while the first was prepared, and was read once its answer began
            assert [json.loads(f)["status"] for f in frames if '"error"' in f] == [409], frames
            await ws.send_message(request)
            answer = [await ws.get_message()]
            while answer[-1] != "[DONE]":
                answer.append(await ws.get_message())
            assert all("error" not in f for f in answer), answer


def test_listing_models_never_downloads_a_strangers_vocabulary(live, expected, baseline) -> None:
    """``GET /api/models`` used to fetch the GGUF of any model in the registry, from whoever
    claimed to hold it, and compile its Jinja template."""
    s, (a, b, c) = live

    async def main() -> None:
        async with hostile_peer(s.multiaddr(a)) as evil:
            evil.serve(VOCAB_PROTOCOL, b"not a gguf")
            await evil.publish_record(honest_record(evil.identity, model="evil:model", start=0, end=4, n_layers=4))
            with trio.fail_after(20):
                while "evil:model" not in [m["id"] for m in await trio.to_thread.run_sync(a.get, "/api/models")]:
                    await trio.sleep(0.2)
            assert VOCAB_PROTOCOL not in evil.asked

    trio.run(main)
    assert_swarm_healthy([a, b, c], expected, baseline)


def test_the_rest_api_never_answers_500_to_a_fuzzer(live, expected, baseline) -> None:
    """Property-based: every operation in /openapi.json, bodies from its schemas and from
    arbitrary JSON, path parameters from arbitrary text. Bounded in examples and time."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from schema_strategies import ANY_JSON, from_schema

    s, (a, b, c) = live
    doc = a.get("/openapi.json")
    operations = [(path, method, op) for path, ops in doc["paths"].items() for method, op in ops.items()
                  if not op.get("x-websocket")]  # fmt: skip
    any_json = ANY_JSON

    def body_for(path: str, method: str, op: dict[str, Any]) -> st.SearchStrategy[Any]:
        schema = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
        if schema is None:
            return any_json if method in ("post", "put", "patch") else st.none()
        typed = from_schema(schema)
        if path == "/v1/chat/completions":  # often the real model, always short, so it runs a chain
            real = st.fixed_dictionaries({"model": st.just(MODEL), "max_tokens": st.integers(1, 3), "stream": st.booleans()})
            typed = st.tuples(typed, real).map(lambda pair: {**pair[0], **pair[1]}) | typed
        return typed | any_json

    operation = st.sampled_from(operations).flatmap(lambda o: st.tuples(
        st.just(o), body_for(*o), st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=12)))
    failures: list[str] = []
    deadline = time.monotonic() + 150

    @settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
    @given(operation)
    def probe(case: tuple[tuple[str, str, dict[str, Any]], Any, str]) -> None:
        (path, method, op), body, param = case
        if time.monotonic() > deadline:
            return
        url = a.url + path
        for p in op.get("parameters", []):
            url = url.replace("{" + p["name"] + "}", urllib.parse.quote(param, safe=""))
        content = None if body is None else json.dumps(body)
        headers = {"content-type": "application/json"} if content is not None else {}
        r = httpx.request(method.upper(), url, content=content, headers=headers, timeout=60)
        if r.status_code >= 500 and r.status_code not in (503, 504):
            failures.append(f"{method.upper()} {path} {content!r:.300} -> {r.status_code} {r.text[:300]}")

    probe()
    assert failures == []
    assert_swarm_healthy([a, b, c], expected, baseline)
