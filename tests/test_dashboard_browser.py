"""The dashboard in a real browser, and ``inclavate status`` / ``inclavate chat``, against a
live 3-peer swarm on loopback (one swarm for the module; the peer kill comes last).

Screenshots of every page land in the test's ``tmp_path`` (``--basetemp`` keeps them).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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
        tab.wait_for_selector(ready)
        tab.wait_for_timeout(300)  # one more poll: errors from a refresh would show now
        shoot(tab, tmp_path, name)
        assert console.errors() == [], name
        assert tab.inner_text("#page .banner") == "", name
    # The media API may be absent from this peer: a clear message, never a blank page.
    for name in ("generate", "storage"):
        tab.goto(f"{peers['b'].url}/#/{name}")
        tab.wait_for_selector("#page .message, #page section.card h2")
        text = tab.inner_text("#page")
        assert "not available on this peer" in text or "not configured" in text or "Speech" in text or "By origin" in text, text
        shoot(tab, tmp_path, name)
        assert console.errors(allowed_statuses=(404, 503), allowed_paths=("/v1/", "/admin/generations")) == [], name


def test_the_swarm_page_shows_every_peer_and_the_coverage(swarm, page, tmp_path: Path) -> None:
    _, peers, ids = swarm
    tab, console = page
    tab.goto(peers["a"].url + "/")
    tab.wait_for_selector('svg.network g.peer[data-state="Ready"] >> nth=2')
    shown = tab.eval_on_selector_all("svg.network g.peer", "els => els.map(e => [e.dataset.node, e.dataset.state])")
    assert sorted(shown) == sorted((peer_id, "Ready") for peer_id in ids.values())
    counts = tab.eval_on_selector_all("svg.coverage rect.cov", "els => els.map(e => Number(e.dataset.count))")
    assert counts == [1] * 30
    lanes = tab.eval_on_selector_all("svg.coverage g.lane", "els => els.map(e => e.dataset.node)")
    assert sorted(lanes) == sorted(ids.values())
    card = tab.inner_text(".model-card")
    assert MODEL in card and "chain complete" in card and "30 layers" in card
    assert tab.locator("svg.network line.edge").count() == 2  # a -> b -> c
    shoot(tab, tmp_path, "swarm-ready")
    assert console.errors() == []


def test_a_chat_streams_an_answer_into_the_page(swarm, page, tmp_path: Path) -> None:
    _, peers, ids = swarm
    tab, console = page
    tab.goto(peers["c"].url + "/#/chat")
    tab.wait_for_selector("#chat-model option")
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


def test_a_killed_peer_turns_dead_on_the_swarm_page(swarm, page, tmp_path: Path) -> None:
    s, peers, ids = swarm
    tab, console = page
    tab.goto(peers["a"].url + "/#/swarm")
    tab.wait_for_selector('svg.network g.peer[data-state="Ready"] >> nth=2')
    s.signal(peers["c"], signal.SIGKILL)
    dead = f'svg.network g.peer[data-node="{ids["c"]}"][data-state="Dead"]'
    tab.wait_for_selector(dead, timeout=60_000)
    counts = tab.eval_on_selector_all("svg.coverage rect.cov", "els => els.map(e => Number(e.dataset.count))")
    assert counts == [1] * 20 + [0] * 10
    assert "gap: layers 20–30" in tab.inner_text(".model-card")
    assert tab.locator("svg.network line.edge.broken").count() == 1
    shoot(tab, tmp_path, "swarm-dead")
    assert console.errors() == []
