"""The dashboard in a real browser, and ``inclavate status`` / ``inclavate chat``, against a
live 3-peer swarm on loopback (one swarm for the module; the peer kill comes last).

Screenshots of every page land in the test's ``tmp_path`` (``--basetemp`` keeps them).
"""

from __future__ import annotations

import io
import json
import os
import select
import signal
import subprocess
import sys
import time
import wave
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from browser import Console, chromium  # noqa: F401 - the fixture
from swarm import PeerProcess, Swarm, request_json

pytestmark = [pytest.mark.swarm, pytest.mark.slow]
MODEL = "smollm2:135m"
TOKEN = "dashboard-test-token"
QUESTION = "What is the capital of France?"
WAIT_MS = 30_000


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Swarm, dict[str, PeerProcess], dict[str, str]]]:
    with Swarm(tmp_path_factory.mktemp("dashboard"), extra_args=["--wire-dtype", "f32"]) as s:
        a = s.start("a", "--layers", "0-10", "--admin-token", TOKEN)
        a_id = s.wait(lambda: a.get("/health")["peer_id"], 60, "a to start", a)
        peers = {"a": a}
        for name, layers in (("b", "10-20"), ("c", "20-30")):
            peers[name] = s.start(name, "--layers", layers, "--admin-peer", a_id, bootstrap=a)
        ids = {name: s.wait_ready(p, timeout=120)["peer_id"] for name, p in peers.items()}
        s.wait(lambda: all(p.get("/api/models")[0]["chain_complete"] and len(p.get("/nodes")) == 3 for p in peers.values()),
               30, "every peer to see the whole chain")  # fmt: skip
        yield s, peers, ids


@pytest.fixture
def page(chromium: Any) -> Iterator[tuple[Any, Console]]:  # noqa: F811 - the fixture above
    context = chromium.new_context(viewport={"width": 1280, "height": 860})
    tab = context.new_page()
    tab.set_default_timeout(WAIT_MS)
    console = Console()
    console.attach(tab)
    try:
        yield tab, console
    finally:
        context.close()


def shoot(tab: Any, tmp_path: Path, name: str) -> None:
    tab.screenshot(path=str(tmp_path / f"{name}.png"), full_page=True)


def api_answer(peer: PeerProcess, max_tokens: int) -> str:
    status, body = request_json("POST", peer.url + "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": max_tokens, "temperature": 0,
    }, timeout=120)  # fmt: skip
    assert status == 200, body
    return body["choices"][0]["message"]["content"]


CORE_PAGES = {
    "swarm": "svg.coverage rect.cov",
    "nodes": "table.nodes-table tbody tr",
    "metrics": "svg.chart.requests rect.bar",
    "chat": "#chat-model option",
    "admin": "table.admin-table tbody tr",
}


def test_every_page_loads_without_console_errors(swarm, page, tmp_path: Path) -> None:
    _, peers, _ = swarm
    tab, console = page
    for name, ready in CORE_PAGES.items():
        tab.goto(f"{peers['b'].url}/#/{name}")
        tab.wait_for_selector(ready, state="attached")  # an idle minute's bar has no height
        tab.wait_for_timeout(300)  # one more poll: errors from a refresh would show now
        if name == "nodes":  # a row opens the node's hardware
            tab.click("table.nodes-table tbody tr.clickable >> nth=0")
            tab.wait_for_selector("tr.detail dl.kv")
            assert "Hardware of" in tab.inner_text("tr.detail")
        shoot(tab, tmp_path, name)
        assert console.errors() == [], name
        assert tab.inner_text("#page .banner") == "", name
    # The media API may be absent from this peer: a clear message, never a blank page.
    for name in ("generate", "storage"):
        tab.goto(f"{peers['b'].url}/#/{name}")
        tab.wait_for_selector("#page .message:not(.loading), #page section.card h2")
        text = tab.inner_text("#page")
        answers = ("not available on this peer", "not configured", "no speech or transcription generator", "Speech", "By origin")
        assert any(answer in text for answer in answers), text
        shoot(tab, tmp_path, name)
        assert console.errors(allowed_statuses=(404, 503), allowed_paths=("/v1/", "/admin/generations")) == [], name


def test_the_swarm_page_shows_every_peer_and_the_coverage(swarm, page, tmp_path: Path) -> None:
    _, peers, ids = swarm
    tab, console = page
    tab.goto(peers["a"].url + "/")
    tab.wait_for_selector('svg.network g.peer[data-state="Ready"] >> nth=2')
    shown = tab.eval_on_selector_all("svg.network g.peer", "els => els.map(e => [e.dataset.node, e.dataset.state])")
    assert sorted(map(tuple, shown)) == sorted((peer_id, "Ready") for peer_id in ids.values())
    counts = tab.eval_on_selector_all("svg.coverage rect.cov", "els => els.map(e => Number(e.dataset.count))")
    assert counts == [1] * 30
    lanes = tab.eval_on_selector_all("svg.coverage g.lane", "els => els.map(e => e.dataset.node)")
    assert sorted(lanes) == sorted(ids.values())
    card = tab.inner_text(".model-card")
    assert MODEL in card and "chain complete" in card and "30 layers" in card
    assert tab.locator("svg.network line.edge").count() == 2  # a -> b -> c
    shoot(tab, tmp_path, "swarm-ready")
    assert console.errors() == []


def _node(peer: str, start: int, end: int, *, draining: bool = False) -> dict[str, Any]:
    """One row of ``/nodes`` as a peer answers it."""
    return {"node_id": peer, "peer_id": peer, "model_id": MODEL, "start_layer": start, "end_layer": end, "n_layers": 30,
            "state": "Ready", "idle": False, "draining": draining, "legacy": False, "relayed": False, "engine": "llamacpp",
            "http_url": None, "grpc_url": None, "legacy_id": None, "multiaddrs": [], "avg_latency_ms": 1.0, "errors": 0,
            "requests_served": 0, "throughput_tps": 1.0, "tokens_total": 0, "uptime_s": 5, "vram_mb": 100}  # fmt: skip


def _swarm_page_with(tab: Any, url: str, nodes: list[dict[str, Any]]) -> tuple[str, str]:
    """The Swarm page drawn from ``nodes`` as ``/nodes``: its model card's and tiles' text."""
    tab.route("**/nodes", lambda route: route.fulfill(status=200, content_type="application/json", body=json.dumps(nodes)))
    tab.goto(url + "/")
    tab.wait_for_selector(".model-card")
    return tab.inner_text(".model-card"), tab.inner_text(".tiles")


def test_ranges_that_hold_every_layer_but_do_not_meet_are_no_chain(swarm, page) -> None:
    """A peer restarted with other --layers (0-10, 10-20, 15-30): every layer held, no chain,
    every chat a 503. Before, the Swarm page said "chain complete" going by gaps alone."""
    _, peers, _ = swarm
    tab, console = page
    overlapping = [_node("12D3KooWaaaa", 0, 10), _node("12D3KooWbbbb", 10, 20), _node("12D3KooWcccc", 15, 30)]
    card, tiles = _swarm_page_with(tab, peers["a"].url, overlapping)
    assert "chain complete" not in card and "no chain" in card, card
    assert "0 / 1" in tiles, tiles  # complete chains
    assert console.errors() == []


def test_a_record_stating_another_shape_does_not_stretch_the_model(swarm, page) -> None:
    """A stranger's record saying ``n_layers: 100000`` drew the model as 100,000 layers with
    one long gap, while every chat was served. The page takes the shape from the peer's
    ``/api/models`` (the catalog's) and counts only the records that state it."""
    _, peers, _ = swarm
    tab, console = page
    liar = {**_node("12D3KooWdddd", 0, 30), "n_layers": 100000}
    card, tiles = _swarm_page_with(tab, peers["a"].url, [_node("12D3KooWaaaa", 0, 10), _node("12D3KooWbbbb", 10, 20),
                                                          _node("12D3KooWcccc", 20, 30), liar])  # fmt: skip
    assert "30 layers" in card and "chain complete" in card and "fewest replicas 1" in card, card
    assert "100000" not in card, card
    assert console.errors() == []


def test_a_draining_sole_holder_is_shown_draining_and_no_chain(swarm, page) -> None:
    """The only holder of 10-20 stopping politely (Ctrl-C) serves its sessions but takes no
    new chat, which gets a 503. Before, the Swarm page counted it Ready and said "chain
    complete" for the whole drain (``inclavate status`` did too, until fixed the same day)."""
    _, peers, _ = swarm
    tab, console = page
    draining = [_node("12D3KooWaaaa", 0, 10), _node("12D3KooWbbbb", 10, 20, draining=True), _node("12D3KooWcccc", 20, 30)]
    card, tiles = _swarm_page_with(tab, peers["a"].url, draining)
    assert "chain complete" not in card and "2 / 3" in tiles, (card, tiles)  # nodes ready
    assert tab.locator(".lane.state-Draining").count() == 1  # its lane, greyed like an idle one
    assert console.errors() == []


def test_a_chat_streams_an_answer_into_the_page(swarm, page, tmp_path: Path) -> None:
    _, peers, ids = swarm
    tab, console = page
    tab.goto(peers["c"].url + "/#/chat")
    tab.wait_for_selector("#chat-model option", state="attached")
    tab.fill("#chat-max-tokens", "24")
    tab.fill("#chat-temperature", "0")
    tab.evaluate("""() => {
        window.answerLengths = [];
        new MutationObserver(() => {
            const a = document.querySelector('.msg.assistant .answer');
            if (a) window.answerLengths.push(a.textContent.length);
        }).observe(document.getElementById('chat-log'), {subtree: true, childList: true, characterData: true});
    }""")
    tab.fill("#chat-input", QUESTION)
    tab.click("#chat-send")
    tab.wait_for_selector("#chat-stop:not([disabled])")
    tab.wait_for_selector(".msg.assistant[data-done='true']", timeout=120_000)
    answer = tab.inner_text(".msg.assistant .answer")
    assert answer.strip() == api_answer(peers["c"], 24).strip()
    lengths = tab.evaluate("window.answerLengths")
    assert len({n for n in lengths if 0 < n < len(answer)}) >= 3, lengths  # it grew token by token
    meta = tab.inner_text(".msg.assistant .meta")
    assert "tok/s" in meta and "finish: length" in meta
    route = tab.inner_text(".msg.assistant .route")
    assert route.count("→") == 2 and all(peer_id[-6:] in route for peer_id in ids.values()), route
    assert tab.is_disabled("#chat-stop") and tab.is_enabled("#chat-send")
    shoot(tab, tmp_path, "chat")
    assert console.errors() == []


def test_stop_ends_the_generation_on_every_stage(swarm, page) -> None:
    s, peers, _ = swarm
    tab, console = page
    tab.goto(peers["a"].url + "/#/chat")
    tab.wait_for_selector("#chat-model option", state="attached")
    tab.fill("#chat-max-tokens", "400")
    tab.fill("#chat-input", "Write a long story about a dragon who learns to cook.")
    tab.click("#chat-send")
    tab.wait_for_function("() => (document.querySelector('.msg.assistant .answer') || {textContent: ''}).textContent.length > 20")
    tab.click("#chat-stop")
    tab.wait_for_selector(".msg.assistant[data-done='true']")
    assert "stopped" in tab.inner_text(".msg.assistant .meta")
    assert tab.locator(".msg.assistant .message.error").count() == 0  # stopping is not an error
    s.wait(lambda: all(not any(p.get("/health")["sessions"].values()) for p in peers.values()), 20, "every stage to free the session")
    assert console.errors() == []


def sse_body(*events: object) -> str:
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"


def chunk(**delta: object) -> dict[str, object]:
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}


class FakeApi:
    """Answers chosen requests in the browser (Playwright routing), for what this swarm cannot
    produce on demand: a reasoning model, a failing stream, the media API of another build."""

    def __init__(self, tab: Any, answers: dict[tuple[str, str], Any]) -> None:
        self.answers = answers
        self.calls: list[tuple[str, str, dict[str, str]]] = []
        self.bodies: list[str | None] = []
        tab.route("**/*", self._handle)

    def _handle(self, route: Any) -> None:
        request = route.request
        url = urlsplit(request.url)
        target = url.path + (f"?{url.query}" if url.query else "")
        answer = self.answers.get((request.method, target))
        if answer is None:
            route.continue_()
            return
        self.calls.append((request.method, target, request.headers))
        self.bodies.append(request.post_data)
        status, headers, body = answer() if callable(answer) else answer
        if not isinstance(body, (str, bytes)):
            body, headers = json.dumps(body), {"content-type": "application/json", **headers}
        route.fulfill(status=status, headers=headers, body=body)


def test_reassign_and_force_remove_send_the_token_and_say_what_happened(swarm, page) -> None:
    """Both change the live swarm for minutes (a reload; a 10-minute ban), so the peer's
    answer is played by the browser here; the routes themselves are tested in test_swarm_admin."""
    _, peers, ids = swarm
    tab, console = page
    target = ids["c"]
    fake = FakeApi(tab, {
        ("POST", f"/admin/nodes/{target}/reassign"): (200, {}, {"ok": True, "node_id": target, "start_layer": 15, "end_layer": 30}),
        ("DELETE", f"/admin/nodes/{target}/force"): (200, {}, {"ok": True, "node_id": target}),
    })  # fmt: skip
    tab.goto(peers["a"].url + "/#/admin")
    tab.fill("#admin-token", TOKEN)
    tab.click("#admin-verify")
    tab.wait_for_selector("#admin-token-status .message.ok")
    row = f'tr[data-node="{target}"]'
    tab.fill(f"{row} input[aria-label='start layer']", "15")
    tab.click(f"{row} button.reassign")
    tab.wait_for_selector("#admin-result .message.ok >> text=Reassign")
    tab.click(f"{row} button.force-remove")
    assert fake.calls[-1][0] == "POST"  # the first click only arms the button
    tab.click(f"{row} button.force-remove")
    tab.wait_for_selector("#admin-result .message.ok >> text=Force-remove")
    (_, _, reassign_headers), (_, _, force_headers) = fake.calls
    assert reassign_headers["x-admin-token"] == TOKEN == force_headers["x-admin-token"]
    assert json.loads(fake.bodies[0]) == {"start_layer": 15, "end_layer": 30}
    assert console.errors() == []


def fake_node(n: int, model: str, start: int, end: int, n_layers: int, state: str = "Ready", **extra: object) -> dict[str, object]:
    peer = f"12D3KooWfake{n:08d}"
    return {"node_id": peer, "peer_id": peer, "model_id": model, "start_layer": start, "end_layer": end,
            "n_layers": n_layers, "state": state, "idle": False, "throughput_tps": 20.0 + n, "legacy": False, **extra}  # fmt: skip


def test_the_swarm_page_draws_every_state_replicas_and_two_models(swarm, page, tmp_path: Path) -> None:
    """A bigger swarm than this test can afford to run, as the registry would list it."""
    _, peers, _ = swarm
    tab, console = page
    nodes = [
        fake_node(1, "qwen3:8b", 0, 12, 36), fake_node(2, "qwen3:8b", 0, 12, 36), fake_node(3, "qwen3:8b", 12, 24, 36),
        fake_node(4, "qwen3:8b", 12, 24, 36, "Degraded"), fake_node(5, "qwen3:8b", 24, 36, 36, idle=True),
        fake_node(6, "qwen3:8b", 24, 30, 36, "Joining"), fake_node(7, "qwen3:8b", 30, 36, 36, legacy=True),
        fake_node(8, "smollm2:135m", 0, 15, 30), fake_node(9, "smollm2:135m", 15, 30, 30, "Dead"),
    ]  # fmt: skip
    FakeApi(tab, {("GET", "/nodes"): (200, {}, nodes)})
    tab.goto(peers["a"].url + "/#/swarm")
    tab.wait_for_selector('svg.coverage[data-model="smollm2:135m"] rect.cov', state="attached")
    counts = {model: tab.eval_on_selector_all(f'svg.coverage[data-model="{model}"] rect.cov', "els => els.map(e => Number(e.dataset.count))")
              for model in ("qwen3:8b", "smollm2:135m")}  # fmt: skip
    assert counts["qwen3:8b"] == [2] * 12 + [1] * 12 + [0] * 6 + [1] * 6  # idle, Joining, Degraded hold nothing
    assert counts["smollm2:135m"] == [1] * 15 + [0] * 15
    states = dict(tab.eval_on_selector_all("svg.network g.peer", "els => els.map(e => [e.dataset.node, e.getAttribute('class')])"))
    assert states[nodes[4]["node_id"]] == "peer state-Idle" and states[nodes[3]["node_id"]] == "peer state-Degraded"
    assert states[nodes[5]["node_id"]] == "peer state-Joining" and states[nodes[8]["node_id"]] == "peer state-Dead"
    cards = tab.inner_text("#page")
    assert "gap: layers 24–30" in cards and "gap: layers 15–30" in cards and "(legacy)" in cards
    assert "5 / 9" in cards  # nodes serving: 1, 2, 3, 7 and 8
    shoot(tab, tmp_path, "swarm-bigger")
    assert console.errors() == []


def test_reasoning_shows_apart_from_the_answer_and_stream_errors_as_messages(swarm, page, tmp_path: Path) -> None:
    _, peers, _ = swarm
    tab, console = page
    replies = iter([
        (200, {"content-type": "text/event-stream", "x-dppan-session-id": "s1"}, sse_body(
            chunk(role="assistant", content=""), chunk(reasoning_content="The user asks for "), chunk(reasoning_content="a capital."),
            chunk(content="Paris"), chunk(content="."), {"choices": [], "usage": {"completion_tokens": 4}})),
        (200, {"content-type": "text/event-stream", "x-dppan-session-id": "s2"},
         sse_body(chunk(content="Rom"), {"error": "stage 12D3KooWxyz failed: engine_error", "status": 502})),
        (503, {}, {"error": "no Ready chain covers smollm2:135m: layers 20-30 have no Ready node"}),
    ])  # fmt: skip
    route = {"route": [{"node_id": "n1", "peer_id": "12D3KooWaaaaaa", "start_layer": 0, "end_layer": 30}]}
    FakeApi(tab, {("POST", "/v1/chat/completions"): lambda: next(replies),
                  ("GET", "/sessions/s1"): (200, {}, route), ("GET", "/sessions/s2"): (200, {}, route)})  # fmt: skip
    tab.goto(peers["a"].url + "/#/chat")
    tab.wait_for_selector("#chat-model option", state="attached")
    for n, question in enumerate(["Capital of France?", "And Italy?", "And Spain?"], start=1):
        tab.fill("#chat-input", question)
        tab.press("#chat-input", "Enter")
        tab.wait_for_selector(f".msg.assistant[data-done='true'] >> nth={n - 1}")
    first, second, third = (tab.locator(".msg.assistant").nth(i) for i in range(3))
    assert first.locator("details.reasoning").is_visible()
    assert first.locator(".reasoning-text").text_content() == "The user asks for a capital."
    assert first.locator(".answer").inner_text() == "Paris."
    assert "…aaaaaa [0–30)" in first.locator(".route").inner_text()
    assert second.locator(".answer").inner_text() == "Rom" and not second.locator("details.reasoning").is_visible()
    assert "stage 12D3KooWxyz failed: engine_error (HTTP 502)" in second.locator(".message.error").inner_text()
    assert "layers 20-30 have no Ready node (HTTP 503" in third.locator(".message.error").inner_text()
    shoot(tab, tmp_path, "chat-reasoning-and-errors")
    assert console.errors(allowed_statuses=(503,), allowed_paths=("/v1/chat/completions",)) == []


def tiny_wav() -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(8000), w.writeframes(b"\0\0" * 800)
    return out.getvalue()


JOB = {"id": "job-1", "state": "queued", "modality": "audio", "model": "piper-joe", "seed": 1, "input_artifacts": [],
       "output_artifacts": [], "progress_stage": None, "progress_fraction": None, "error_code": None,
       "error_message": None, "created_at": "2026-12-03T08:00:00.000Z", "started_at": None, "completed_at": None}  # fmt: skip
DELETED = {**JOB, "id": "job-0", "state": "completed", "artifacts_deleted": 1, "params": {"text": "old"}}


def test_generate_runs_a_speech_job_with_live_progress_where_the_media_api_exists(swarm, page, tmp_path: Path) -> None:
    _, peers, _ = swarm
    tab, console = page
    caps = {"generators": [
        {"modality": "audio", "model": "piper-joe", "builtin_voices": ["joe"], "requires_speaker": False},
        {"modality": "text", "kind": "understand", "model": "whisper-tiny", "ready": True, "input_modalities": ["audio"]},
    ]}  # fmt: skip
    events = sse_body({**JOB, "state": "running", "progress_stage": "generating", "progress_fraction": 0.5},
                      {**JOB, "state": "completed", "progress_stage": "publishing", "progress_fraction": 1.0, "output_artifacts": ["art-1"]})  # fmt: skip
    fake = FakeApi(tab, {
        ("GET", "/v1/generations/capabilities"): (200, {}, caps),
        ("GET", "/v1/generations?limit=50"): (200, {}, {"generations": [DELETED], "truncated": False}),
        ("POST", "/v1/generations"): (202, {}, JOB),
        ("GET", "/v1/generations/job-1/events"): (200, {"content-type": "text/event-stream"}, events),
        ("GET", "/v1/artifacts/art-1"): (200, {"content-type": "audio/wav"}, tiny_wav()),
    })  # fmt: skip
    tab.goto(peers["a"].url + "/#/generate")
    tab.wait_for_selector("h2:text-is('Speech')")
    assert tab.locator("h2:text-is('Transcription')").count() == 1
    assert tab.locator('.job[data-job="job-0"]').count() == 0  # its audio is gone: listed under Storage
    tab.fill("textarea", "Hello from the swarm.")
    tab.click("button:text-is('Speak')")
    audio = tab.wait_for_selector('.job[data-job="job-1"].state-completed audio', state="attached")
    assert audio.get_attribute("src") == "/v1/artifacts/art-1"
    submitted = [c for c in fake.calls if c[0] == "POST"]
    assert len(submitted) == 1 and ("GET", "/v1/generations/job-1/events") in [c[:2] for c in fake.calls]
    shoot(tab, tmp_path, "generate-with-media")
    assert console.errors() == []


def test_storage_lists_usage_deletes_and_clears_orphaned_jobs(swarm, page, tmp_path: Path) -> None:
    _, peers, _ = swarm
    tab, console = page
    usage = {"bytes": 50_000, "objects": 2, "max_bytes": 0, "max_objects": 0,
             "generated": {"bytes": 40_000, "objects": 1}, "uploaded": {"bytes": 10_000, "objects": 1}}  # fmt: skip
    artifact = {"id": "art-9", "media_type": "audio/wav", "size_bytes": 40_000, "digest": "ab", "state": "ready",
                "created_at": "2026-12-03T08:00:00.000Z", "expires_at": None}  # fmt: skip
    fake = FakeApi(tab, {
        ("GET", "/v1/artifacts/usage"): (200, {}, usage),
        ("GET", "/v1/artifacts?kind=generated&limit=100"): (200, {}, {"artifacts": [artifact], "truncated": False}),
        ("GET", "/v1/generations?limit=200"): (200, {}, {"generations": [DELETED], "truncated": False}),
        ("DELETE", "/v1/artifacts/art-9"): (204, {}, ""),
        ("DELETE", "/admin/generations/job-0?artifacts=false"): (200, {}, {"id": "job-0", "artifacts_deleted": 0}),
    })  # fmt: skip
    tab.goto(peers["a"].url + "/#/admin")
    tab.fill("#admin-token", TOKEN)
    tab.click("#admin-verify")
    tab.wait_for_selector("#admin-token-status .message.ok")
    tab.goto(peers["a"].url + "/#/storage")
    tab.wait_for_selector('tr[data-artifact="art-9"]')
    assert "50 KB" in tab.inner_text(".tiles")
    shoot(tab, tmp_path, "storage-with-media")
    for selector in ('tr[data-artifact="art-9"] button', 'tr[data-job="job-0"] button'):
        tab.click(selector)  # arms
        tab.click(selector)  # confirms
        tab.wait_for_selector("#page .message.ok >> text=Deleted")
    deletes = {c[1]: c[2] for c in fake.calls if c[0] == "DELETE"}
    assert set(deletes) == {"/v1/artifacts/art-9", "/admin/generations/job-0?artifacts=false"}
    assert deletes["/admin/generations/job-0?artifacts=false"].get("x-admin-token") == TOKEN
    assert "x-admin-token" not in deletes["/v1/artifacts/art-9"]
    assert console.errors() == []


def test_admin_actions_need_the_token(swarm, page, tmp_path: Path) -> None:
    s, peers, ids = swarm
    tab, console = page
    target = ids["b"]
    tab.goto(peers["a"].url + "/#/admin")
    row = f'tr[data-node="{target}"]'
    tab.wait_for_selector(row)
    tab.click(f"{row} button.set-idle")
    tab.wait_for_selector("#admin-result .message.error")
    assert "refused" in tab.inner_text("#admin-result") and "403" in tab.inner_text("#admin-result")
    tab.fill("#admin-token", "not-the-token")
    tab.click("#admin-verify")
    tab.wait_for_selector("#admin-token-status .message.error")
    tab.fill("#admin-token", TOKEN)
    tab.click("#admin-verify")
    tab.wait_for_selector("#admin-token-status .message.ok")
    # Kept in this tab only: no cookie, nothing in localStorage.
    assert tab.evaluate("[sessionStorage.getItem('inclavate.adminToken'), document.cookie, localStorage.length]") == [TOKEN, "", 0]
    tab.click(f"{row} button.set-idle")
    tab.wait_for_selector("#admin-result .message.ok")
    s.wait(lambda: next(n for n in peers["c"].get("/nodes") if n["node_id"] == target)["idle"], 15, "b to turn idle")
    tab.wait_for_selector(f"{row} button.set-ready")
    shoot(tab, tmp_path, "admin")
    tab.click(f"{row} button.set-ready")
    s.wait(lambda: all(not n["idle"] for p in peers.values() for n in p.get("/nodes")), 15, "b to serve again")
    assert console.errors(allowed_statuses=(403,), allowed_paths=("/admin/",)) == []


def test_the_entry_peer_tells_which_route_a_session_took(swarm) -> None:
    _, peers, ids = swarm
    reply = httpx.post(peers["b"].url + "/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 4, "temperature": 0})  # fmt: skip
    assert reply.status_code == 200, reply.text
    session = reply.headers["x-dppan-session-id"]
    for name in (session, f"chatcmpl-{session}"):
        info = peers["b"].get(f"/sessions/{name}")
        assert info["id"] == f"chatcmpl-{session}" and info["model"] == MODEL and info["active"] is False
        hops = [(h["peer_id"], h["start_layer"], h["end_layer"]) for h in info["route"]]
        assert hops == [(ids["a"], 0, 10), (ids["b"], 10, 20), (ids["c"], 20, 30)]
    # Only the entry peer knows it; unknown ids are a 404 in the spec's error shape.
    for peer, name in ((peers["a"], session), (peers["b"], "0" * 32), (peers["b"], "x" * 5000)):
        status, body = request_json("GET", f"{peer.url}/sessions/{name}")
        assert status == 404 and "error" in body


def inclavate(*args: str, stdin: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "inclavate", *args], input=stdin, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def test_status_command_shows_the_live_swarm(swarm) -> None:
    _, peers, ids = swarm
    done = inclavate("status", "--api", peers["b"].url)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert f"{MODEL}  30 layers  chain complete  (fewest replicas: 1)" in out
    assert "  coverage [" + "1" * 30 + "]" in out
    assert sum(" Ready " in line for line in out.splitlines()) == 3
    assert all(peer_id[-8:] in out for peer_id in ids.values())


def test_status_watch_refreshes_until_interrupted(swarm) -> None:
    _, peers, _ = swarm
    proc = subprocess.Popen([sys.executable, "-m", "inclavate", "status", "--api", peers["a"].url, "--watch", "--interval", "0.3"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        seen = 0
        assert proc.stdout is not None
        while seen < 2 and time.monotonic() < deadline:
            seen += "refreshed" in proc.stdout.readline()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=10)
    finally:
        proc.kill()
    assert seen == 2 and proc.returncode == 0 and "Traceback" not in err


def test_chat_command_streams_a_conversation(swarm) -> None:
    _, peers, ids = swarm
    done = inclavate("chat", "--api", peers["a"].url, "--max-tokens", "16", "--temperature", "0",
                     stdin=QUESTION + "\nAnd of Italy?\n")  # EOF after two turns: a clean exit
    assert done.returncode == 0, done.stderr
    expected = api_answer(peers["a"], 16)
    assert expected.strip() in done.stdout
    stats = [line for line in done.stderr.splitlines() if line.startswith("[")]
    assert len(stats) == 2 and all("tokens" in line and "tok/s" in line for line in stats), done.stderr
    assert stats[0].count("→") == 2 and all(peer_id[-6:] in stats[0] for peer_id in ids.values())
    assert "Traceback" not in done.stderr


def _read_at_least(proc: subprocess.Popen[str], n: int, timeout: float) -> str:
    """``n`` characters or more of ``proc``'s output within ``timeout``. A chat whose answer
    failed prints its error to stderr and waits for the next prompt: that must fail the
    test with the error, not block it on a read that never returns."""
    assert proc.stdout is not None
    fd, data, deadline = proc.stdout.fileno(), b"", time.monotonic() + timeout
    while len(data) < n:
        left = deadline - time.monotonic()
        chunk = os.read(fd, 4096) if left > 0 and select.select([fd], [], [], left)[0] else b""
        if not chunk:
            proc.kill()
            pytest.fail(f"the chat printed {data!r} and no more within {timeout:g} s; stderr: {proc.communicate()[1]!r}")
        data += chunk
    return data.decode(errors="replace")


def test_ctrl_c_stops_an_answer_and_the_chat_goes_on(swarm) -> None:
    s, peers, _ = swarm
    # Earlier tests turn peers idle and back: wait until b routes through a Ready chain again.
    s.wait(lambda: peers["b"].get("/api/models")[0]["chain_complete"], 30, "b to see a complete chain")
    proc = subprocess.Popen([sys.executable, "-m", "inclavate", "chat", "--api", peers["b"].url, "--max-tokens", "48"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=0)  # fmt: skip
    try:
        assert proc.stdin is not None
        proc.stdin.write("Write a long story about a dragon who learns to cook.\n")
        proc.stdin.flush()
        _read_at_least(proc, 40, timeout=60)  # "you> " and the first words of the answer
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate("Hi\n", timeout=120)  # a second turn, then EOF
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    stats = [line for line in err.splitlines() if line.startswith("[")]
    assert len(stats) == 2 and "finish stopped" in stats[0] and "Traceback" not in err


def test_a_killed_peer_turns_dead_on_the_swarm_page(swarm, page, tmp_path: Path) -> None:
    s, peers, ids = swarm
    tab, console = page
    tab.goto(peers["a"].url + "/#/swarm")
    tab.wait_for_selector('svg.network g.peer[data-state="Ready"] >> nth=2')
    on_victim = tab.context.new_page()  # a tab open on the peer that dies
    on_victim.goto(peers["c"].url + "/#/nodes")
    on_victim.wait_for_selector("table.nodes-table tbody tr")
    s.signal(peers["c"], signal.SIGKILL)
    dead = f'svg.network g.peer[data-node="{ids["c"]}"][data-state="Dead"]'
    tab.wait_for_selector(dead, timeout=60_000)
    counts = tab.eval_on_selector_all("svg.coverage rect.cov", "els => els.map(e => Number(e.dataset.count))")
    assert counts == [1] * 20 + [0] * 10
    assert "gap: layers 20–30" in tab.inner_text(".model-card")
    assert tab.locator("svg.network line.edge.broken").count() == 1
    shoot(tab, tmp_path, "swarm-dead")
    assert console.errors() == []
    # The tab on the dead peer says so instead of going blank.
    on_victim.wait_for_selector("#page .banner .message.error >> text=did not answer")
    assert "is it still running?" in on_victim.inner_text("#page .banner")
    shoot(on_victim, tmp_path, "victim-tab")
