"""The REST API of a real 3-peer swarm, driven with the official ``openai`` SDK.

Every peer answers, every answer equals the whole model run in one context with the same
template, and every bad request gets the documented status and body. At the end no peer
holds a session.
"""

from __future__ import annotations

import base64
import json
import struct
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from reference import whole_model_text
from swarm import PeerProcess, Swarm, request_json

pytestmark = [pytest.mark.swarm, pytest.mark.slow]
MODEL = "smollm2:135m"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Swarm, list[PeerProcess]]]:
    with Swarm(tmp_path_factory.mktemp("api"), extra_args=["--wire-dtype", "f32"]) as s:
        a = s.start("a", "--layers", "0-10")
        peers = [a, s.start("b", "--layers", "10-20", bootstrap=a), s.start("c", "--layers", "20-30", bootstrap=a)]
        for peer in peers:
            s.wait_ready(peer, timeout=90)
        for peer in peers:
            s.wait(lambda p=peer: p.get("/api/models")[0]["chain_complete"], 20, "a complete chain", peer)
        yield s, peers


@pytest.fixture(scope="module")
def expected(smollm2, slice_cache) -> str:
    return whole_model_text(smollm2, slice_cache, QUESTION, 24)


def client(peer: PeerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=peer.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_list(swarm) -> None:
    for peer in swarm[1]:
        models = client(peer).models.list()
        assert [(m.id, m.owned_by) for m in models.data] == [(MODEL, "dppan")]
        assert client(peer).models.retrieve(MODEL).model_dump() == models.data[0].model_dump()


def test_an_unknown_model_is_a_404_in_the_error_shape(swarm) -> None:
    peer = swarm[1][0]
    with pytest.raises(openai.NotFoundError):
        client(peer).models.retrieve("smollm2:999m")
    for unknown in ["smollm2:999m", "org/smollm2:135m", "smollm2"]:
        status, body = request_json("GET", f"{peer.url}/v1/models/{unknown}")
        assert status == 404 and isinstance(body["error"], str), unknown


def test_every_peer_answers_like_the_whole_model(swarm, expected: str) -> None:
    for peer in swarm[1]:
        c = client(peer)
        reply = c.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0)
        assert reply.choices[0].message.content == expected
        assert reply.usage.prompt_tokens > 0 and reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
        chunks = list(c.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0, stream=True))
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == expected
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")
        assert all(ch.choices[0].finish_reason is None for ch in chunks[:-1])


def test_max_tokens_reached_is_length(swarm) -> None:
    reply = client(swarm[1][0]).chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=3, temperature=0)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 3


def test_stop_strings_end_the_reply(swarm, expected: str) -> None:
    stop = expected[5:9]
    reply = client(swarm[1][1]).chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0, stop=[stop])
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].message.content == expected[: expected.index(stop)]


def test_eight_concurrent_requests_all_succeed(swarm, expected: str) -> None:
    peers = swarm[1]

    def ask(i: int) -> str:
        reply = client(peers[i % 3]).chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0)
        return reply.choices[0].message.content

    before = [p.get("/health")["batching"]["step_rounds_by_lane"] for p in peers]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(8)))
    assert answers == [expected] * 8
    # The sessions went round the chain in lanes (one per stage, up to 4): every stage ran
    # step calls of several (each entry spreads its 2-3 concurrent sessions over them).
    for peer, was in zip(peers, before):
        now = peer.get("/health")["batching"]["step_rounds_by_lane"]
        assert len(now) == 4 and now[3] == was[3], (peer.name, was, now)
        assert sum(n > w for n, w in zip(now, was)) >= 2, (peer.name, was, now)


def test_sampling_with_a_seed_is_reproducible(swarm) -> None:
    c = client(swarm[1][2])
    runs = [c.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16, temperature=0.9, seed=7)
            for _ in range(2)]  # fmt: skip
    assert runs[0].choices[0].message.content == runs[1].choices[0].message.content


def _png(width: int, height: int) -> bytes:
    def block(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    raw = b"".join(b"\0" + b"\0\0\0" * width for _ in range(height))
    return b"\x89PNG\r\n\x1a\n" + block(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)) + \
        block(b"IDAT", zlib.compress(raw)) + block(b"IEND", b"")  # fmt: skip


def test_documented_errors(swarm) -> None:
    peer = swarm[1][1]
    c = client(peer)
    with pytest.raises(openai.UnprocessableEntityError) as unknown:
        c.chat.completions.create(model="no-such:model", messages=QUESTION)
    assert unknown.value.status_code == 422 and "not in the registry" in unknown.value.response.json()["error"]

    with pytest.raises(openai.BadRequestError) as effort:
        c.chat.completions.create(model=MODEL, messages=QUESTION, reasoning_effort="high")
    assert "'none'" in effort.value.response.json()["error"]

    image = "data:image/png;base64," + base64.b64encode(_png(4, 4)).decode()
    with pytest.raises(openai.BadRequestError) as media:
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": image}}]}])  # fmt: skip
    envelope = media.value.response.json()["error"]
    assert envelope["type"] == envelope["code"] == "unsupported_modality" and "message" in envelope

    # smollm2's template offers no tools: a demanded call would have been answered in prose.
    weather = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    with pytest.raises(openai.BadRequestError) as tools:
        c.chat.completions.create(model=MODEL, messages=QUESTION, tools=weather, tool_choice="required")
    assert "cannot call tools" in tools.value.response.json()["error"]
    with pytest.raises(openai.BadRequestError) as structured:
        c.chat.completions.create(model=MODEL, messages=QUESTION, response_format={"type": "json_object"})
    assert "response_format" in structured.value.response.json()["error"]

    malformed = httpx.post(peer.url + "/v1/chat/completions", content=b'{"model": ', headers={"content-type": "application/json"})
    assert malformed.status_code == 400 and "not valid JSON" in malformed.json()["error"]
    missing = httpx.post(peer.url + "/v1/chat/completions", json={"model": MODEL})
    assert missing.status_code == 400 and "messages" in missing.json()["error"]

    huge = {"model": MODEL, "messages": [{"role": "user", "content": "x" * (25 * 1024 * 1024)}]}
    oversize = httpx.post(peer.url + "/v1/chat/completions", json=huge, timeout=60)
    assert oversize.status_code == 413 and "error" in oversize.json()


def _sessions(peer: PeerProcess) -> dict[str, int]:
    return peer.get("/health")["sessions"]


def test_a_client_that_disconnects_mid_stream_frees_every_stage(swarm) -> None:
    s, peers = swarm
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.stream("POST", peers[0].url + "/v1/chat/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        for _ in range(6):
            next(lines)
        assert _sessions(peers[2])["stage"] == 1, "the generation should be running"
    # The connection is closed: the entry cancels and every stage frees the session.
    s.wait(lambda: all(_sessions(p) == {"stage": 0, "entry": 0} for p in peers), 10, "sessions freed")


def test_clients_leaving_mid_stream_at_any_moment_never_take_the_api_down(swarm) -> None:
    """A streamed generation runs in the app's nursery; a client that left while it was
    ready to run once made it raise there, and every later request of the peer failed
    ("Nursery is closed to new arrivals"). Unit-tested in tests/test_relay.py."""
    s, peers = swarm
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 64, "temperature": 0, "stream": True}
    for read in range(1, 9):
        with httpx.stream("POST", peers[1].url + "/v1/chat/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            for _ in range(read):
                next(lines)
    status, answer = request_json("POST", peers[1].url + "/v1/chat/completions", {**body, "stream": False, "max_tokens": 4})
    assert status == 200 and answer["choices"][0]["message"]["content"]
    s.wait(lambda: all(_sessions(p) == {"stage": 0, "entry": 0} for p in peers), 10, "sessions freed")
    log = peers[1].log_path.read_text(errors="replace")
    assert "Error in ASGI Framework" not in log and "producer failed" not in log


def test_delete_session_stops_a_generation(swarm) -> None:
    s, peers = swarm
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 400, "temperature": 0, "stream": True}
    events: list[dict] = []
    with httpx.stream("POST", peers[1].url + "/v1/chat/completions", json=body, timeout=60) as response:
        session = response.headers["x-dppan-session-id"]
        lines = response.iter_lines()
        next(lines)
        deleted = httpx.delete(f"{peers[1].url}/sessions/{session}")
        assert deleted.status_code == 204 and "content-type" not in deleted.headers
        for line in lines:
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
    assert events[-1].get("status") == 409 and "closed" in events[-1]["error"]
    s.wait(lambda: all(_sessions(p) == {"stage": 0, "entry": 0} for p in peers), 10, "sessions freed")
    again = httpx.delete(f"{peers[1].url}/sessions/{session}")
    assert again.status_code == 404 and "error" in again.json()
    # A body-less 204 once ran quart's asyncio-only body iterator under trio, failing after
    # the status line went out (the peer logged "Error in ASGI Framework").
    assert "Error in ASGI Framework" not in peers[1].log_path.read_text(errors="replace")


async def test_ws_chat_streams_the_same_answer(swarm, expected: str) -> None:
    from trio_websocket import open_websocket_url

    peer = swarm[1][2]
    async with open_websocket_url(f"ws://127.0.0.1:{peer.api_port}/ws/chat") as ws:
        await ws.send_message(json.dumps({"model": MODEL, "messages": QUESTION, "max_tokens": 24, "temperature": 0}))
        text, frames = "", []
        while (frame := await ws.get_message()) != "[DONE]":
            frames.append(json.loads(frame))
        text = "".join(f["choices"][0]["delta"].get("content") or "" for f in frames if f.get("choices"))
        assert text == expected and frames[-1]["choices"][0]["finish_reason"] in ("stop", "length")
        await ws.send_message(json.dumps({"model": "nope", "messages": QUESTION}))
        error = json.loads(await ws.get_message())
        assert error["status"] == 422 and "error" in error


def test_openapi_lists_exactly_what_is_served(swarm) -> None:
    doc = swarm[1][0].get("/openapi.json")
    assert doc["openapi"].startswith("3.")
    for path, method in [("/v1/chat/completions", "post"), ("/v1/models", "get"), ("/v1/models/{model_id}", "get"),
                         ("/api/models", "get"), ("/nodes", "get"), ("/sessions/{session_id}", "delete"), ("/health", "get")]:  # fmt: skip
        assert method in doc["paths"][path], path
    assert doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]["required"] == ["model", "messages"]


def test_a_peer_holding_another_model_serves_this_one(swarm, expected: str, smollm2, tmp_path: Path) -> None:
    """It has none of SmolLM2's layers and no copy of it: it fetches the vocabulary from a
    peer that has, and routes the chain through the others."""
    import subprocess
    import sys

    from gguf_factory import write_random_gguf

    s, peers = swarm
    home = tmp_path / "other-home"
    tiny = write_random_gguf(tmp_path / "tiny.gguf", "llama", tokenizer_from=smollm2.path)
    env = {"INCLAVATE_HOME": str(home)}
    subprocess.run([sys.executable, "-m", "inclavate", "pull", str(tiny), "--as", "tiny:test"], check=True,
                   env={**__import__("os").environ, **env}, capture_output=True)  # fmt: skip
    other = s.start("other", model="tiny:test", bootstrap=peers[0], env=env)
    s.wait_ready(other)
    s.wait(lambda: any(m["id"] == MODEL and m["chain_complete"] for m in other.get("/api/models")), 20, "the swarm's view")
    assert not (home / "models" / "smollm2@135m").exists()
    reply = client(other).chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0)
    assert reply.choices[0].message.content == expected
    s.stop(other)


def test_no_session_is_left_open_and_a_gap_is_a_503(swarm) -> None:
    s, peers = swarm
    s.wait(lambda: all(_sessions(p) == {"stage": 0, "entry": 0} for p in peers), 10, "no sessions left")
    s.stop(peers[2])
    s.wait(lambda: not peers[0].get("/api/models")[0]["chain_complete"], 10, "the gap to be seen")
    with pytest.raises(openai.InternalServerError) as gap:
        client(peers[0]).chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4)
    assert gap.value.status_code == 503 and "20-30" in gap.value.response.json()["error"]
