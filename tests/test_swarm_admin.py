"""Nodes, admin and legacy nodes against a live 4-peer swarm (+1 legacy node) on loopback."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from reference import whole_model_text
from swarm import PeerProcess, Swarm, request_json

from inclavate.types import PeerId
from p2p.admin import AdminCommand, PROTOCOL as ADMIN_PROTOCOL, encode_command
from p2p.host import open_host
from p2p.identity import Identity

pytestmark = [pytest.mark.swarm, pytest.mark.slow]
MODEL = "smollm2:135m"
TOKEN = "s3cret-admin-token"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
ADMIN = {"X-Admin-Token": TOKEN}


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Swarm, dict[str, PeerProcess]]]:
    with Swarm(tmp_path_factory.mktemp("admin"), extra_args=["--wire-dtype", "f32"]) as s:
        a = s.start("a", "--layers", "0-10", "--admin-token", TOKEN)
        a_id = s.wait(lambda: a.get("/health")["peer_id"], 60, "a to start", a)
        trust = ["--admin-peer", a_id]
        peers = {"a": a}
        for name, layers in (("b", "10-20"), ("c", "20-30"), ("d", "20-30")):
            peers[name] = s.start(name, "--layers", layers, *trust, bootstrap=a)
        for peer in peers.values():
            s.wait_ready(peer, timeout=90)
        s.wait(lambda: a.get("/api/models")[0]["chain_complete"] and len(a.get("/nodes")) == 4, 20, "the swarm")
        yield s, peers


@pytest.fixture(scope="module")
def expected(smollm2, slice_cache) -> str:
    return whole_model_text(smollm2, slice_cache, QUESTION, 16)


def chat(peer: PeerProcess) -> str:
    status, body = request_json("POST", peer.url + "/v1/chat/completions",
                                {"model": MODEL, "messages": QUESTION, "max_tokens": 16, "temperature": 0}, timeout=120)  # fmt: skip
    assert status == 200, body
    return body["choices"][0]["message"]["content"]


def node(peer: PeerProcess, node_id: str) -> dict | None:
    """By registry id, or a legacy node by the id it registered with (namespaced in /nodes)."""
    return next((n for n in peer.get("/nodes") if node_id in (n["node_id"], n["legacy_id"])), None)


def admin(peer: PeerProcess, method: str, path: str, body: object = None, token: str | None = TOKEN) -> tuple[int, object]:
    headers = {"X-Admin-Token": token} if token is not None else {}
    return request_json(method, peer.url + path, body, timeout=180, headers=headers)


def test_every_peer_lists_the_same_nodes(swarm) -> None:
    s, peers = swarm

    def table(p: PeerProcess) -> list[tuple]:
        return sorted((n["node_id"], n["start_layer"], n["end_layer"], n["state"]) for n in p.get("/nodes"))

    s.wait(lambda: len({tuple(table(p)) for p in peers.values()}) == 1, 10, "identical /nodes")
    listed = peers["b"].get("/nodes")
    for field in ("node_id", "model_id", "http_url", "grpc_url", "start_layer", "end_layer", "state", "vram_mb",
                  "tokens_total", "requests_served", "avg_latency_ms", "uptime_s"):  # fmt: skip
        assert all(field in n for n in listed), field
    node_id = listed[0]["node_id"]
    hardware = peers["c"].get(f"/nodes/{node_id}/hardware")
    assert {"gpu", "device_name", "vram_mb"} <= hardware.keys()
    metrics = peers["d"].get(f"/nodes/{node_id}/metrics")
    assert metrics["node_id"] == node_id and isinstance(metrics["samples"], list)
    for path in ("/nodes/nope/hardware", "/nodes/nope/metrics"):
        status, body = request_json("GET", peers["a"].url + path)
        assert status == 404 and "error" in body


def test_admin_routes_need_the_token(swarm) -> None:
    _, peers = swarm
    assert admin(peers["a"], "GET", "/admin/verify") == (200, {"ok": True})
    status, body = admin(peers["a"], "GET", "/admin/verify", token="wrong")
    assert status == 403 and "error" in body
    assert admin(peers["a"], "GET", "/admin/verify", token=None)[0] == 403
    status, body = admin(peers["b"], "GET", "/admin/verify")  # b was started without a token
    assert status == 403 and "disabled" in body["error"]
    for method, path in (("DELETE", "/admin/nodes/x/force"), ("PATCH", "/admin/nodes/x/state"),
                         ("POST", "/admin/nodes/x/reassign"), ("GET", f"/admin/chain/{MODEL}")):  # fmt: skip
        assert admin(peers["c"], method, path, {})[0] == 403
    status, chain = admin(peers["a"], "GET", f"/admin/chain/{MODEL}")
    assert status == 200 and chain["ready"] and chain["gaps"] == [] and chain["n_layers"] == 30
    assert admin(peers["a"], "GET", "/admin/chain/unknown:model")[0] == 404
    # A model of the registry no node serves is one whole gap (it was a 404 while its chats were a 503).
    unserved = next(m for m in peers["a"].get("/models/registry") if m["model_id"] != MODEL)
    status, chain = admin(peers["a"], "GET", f"/admin/chain/{unserved['model_id']}")
    assert status == 200 and chain == {"model_id": unserved["model_id"], "n_layers": unserved["n_layers"], "covered": [],
                                       "gaps": [[0, unserved["n_layers"]]], "ready": False}, chain  # fmt: skip


def test_bad_admin_requests(swarm) -> None:
    _, peers = swarm
    b_id = peers["b"].get("/health")["peer_id"]
    assert admin(peers["a"], "PATCH", f"/admin/nodes/{b_id}/state", {"state": "sleepy"})[0] == 400
    assert admin(peers["a"], "POST", f"/admin/nodes/{b_id}/reassign", {"start_layer": 5, "end_layer": 2})[0] == 400
    status, body = admin(peers["a"], "POST", f"/admin/nodes/{b_id}/reassign", {"start_layer": 0, "end_layer": 999})
    assert status == 400 and "30 layers" in body["error"], body  # the request's fault, not a conflict
    assert (node(peers["a"], b_id)["start_layer"], node(peers["a"], b_id)["end_layer"]) == (10, 20)
    assert admin(peers["a"], "PATCH", "/admin/nodes/nobody/state", {"state": "idle"})[0] == 404


async def test_commands_from_untrusted_peers_are_refused(swarm) -> None:
    _, peers = swarm
    b = await trio.to_thread.run_sync(peers["b"].get, "/health")
    stranger = Identity.generate()
    with trio.fail_after(30):
        async with open_host(stranger) as host:
            await host.connect(b["multiaddrs"][0])
            stream = await host.new_stream(PeerId(b["peer_id"]), ADMIN_PROTOCOL)
            command = AdminCommand("set_state", b["peer_id"], stranger.peer_id, b["peer_id"], {"state": "idle"})
            await stream.send(encode_command(command, stranger), timeout=10)
            answer = await stream.receive(timeout=10)
    assert b'"ok": false' in answer and b"not trusted" in answer
    listed = await trio.to_thread.run_sync(node, peers["b"], b["peer_id"])
    assert listed is not None and not listed["idle"]


def test_a_legacy_node_serves_its_range_in_a_chain(swarm, expected: str, tmp_path: Path) -> None:
    s, peers = swarm
    legacy = s.start("legacy", "--legacy", "--orchestrator", peers["a"].url, "--layers", "10-20")
    health = s.wait(lambda: legacy.get("/health")["layers"] and legacy.get("/health"), 90, "the legacy node", legacy)
    legacy_id = health["node_id"]
    s.wait(lambda: all((n := node(p, legacy_id)) and n["state"] == "Ready" and n["legacy"] for p in peers.values()),
           15, "every peer to list the legacy node Ready")  # fmt: skip

    # Idle the libp2p peer holding 10-20: the only way through those layers is the legacy node.
    b_id = peers["b"].get("/health")["peer_id"]
    assert admin(peers["a"], "PATCH", f"/admin/nodes/{b_id}/state", {"state": "idle"}) == (200, {"ok": True, "node_id": b_id, "state": "Idle"})
    s.wait(lambda: all(node(p, b_id)["idle"] for p in peers.values()), 10, "b idle everywhere")
    before = node(peers["c"], legacy_id)["tokens_total"]
    b_before = node(peers["c"], b_id)["tokens_total"]
    for peer in (peers["a"], peers["c"]):
        assert chat(peer) == expected
    s.wait(lambda: node(peers["c"], legacy_id)["tokens_total"] > before, 10, "the legacy node's counters to move")
    assert node(peers["c"], b_id)["tokens_total"] == b_before, "an idle node received work"
    assert peers["a"].get("/api/models")[0]["idle_nodes"] == 1

    # Registration errors, in the spec's shapes.
    join = peers["d"].url + "/nodes/join"
    base = {"node_id": legacy_id, "model_id": MODEL, "http_url": "http://127.0.0.1:9", "n_total_layers": 30, "d_model": 576}
    assert request_json("POST", join, base)[0] == 409
    assert request_json("POST", join, {**base, "node_id": "n2", "model_id": "no:such"})[0] == 422
    assert request_json("POST", join, {**base, "node_id": "n2", "d_model": 4096})[0] == 422
    status, body = request_json("POST", join, {**base, "node_id": "n2"})
    assert status == 503 and "covered" in body["error"]
    assert request_json("POST", join, {"model_id": MODEL})[0] == 400
    assert request_json("POST", peers["d"].url + "/nodes/nobody/health", {})[0] == 404

    # Back to normal, then the legacy node dies: its heartbeats stop and it ages out.
    assert admin(peers["a"], "PATCH", f"/admin/nodes/{b_id}/state", {"state": "ready"})[0] == 200
    s.signal(legacy, signal.SIGKILL)
    s.wait(lambda: node(peers["d"], legacy_id)["state"] == "Degraded", 15, "the legacy node to degrade")
    s.wait(lambda: node(peers["d"], legacy_id)["state"] == "Dead", 15, "the legacy node to die")
    assert chat(peers["d"]) == expected
    # An admin names a legacy node by its own id, as /nodes/:id/hardware does (a 404 until 2026-12-07).
    status, body = admin(peers["a"], "DELETE", f"/admin/nodes/{legacy_id}/force")
    assert status == 200 and body["node_id"].endswith(":" + legacy_id), (status, body)
    s.wait(lambda: node(peers["a"], legacy_id) is None, 10, "the legacy node forgotten")


def test_reassign_moves_a_node_while_the_chain_keeps_answering(swarm, expected: str) -> None:
    s, peers = swarm
    d_id = peers["d"].get("/health")["peer_id"]
    answers: list[str] = []
    failures: list[str] = []
    stop = threading.Event()

    def keep_asking() -> None:
        while not stop.is_set():
            try:
                answers.append(chat(peers["b"]))
            except AssertionError as exc:
                failures.append(str(exc))

    worker = threading.Thread(target=keep_asking)
    worker.start()
    try:
        status, body = admin(peers["a"], "POST", f"/admin/nodes/{d_id}/reassign", {"start_layer": 10, "end_layer": 20})
        assert status == 200 and body == {"ok": True, "node_id": d_id, "start_layer": 10, "end_layer": 20}
        s.wait(lambda: all((n := node(p, d_id)) and (n["start_layer"], n["end_layer"], n["state"]) == (10, 20, "Ready")
                           for p in peers.values()), 15, "d Ready on 10-20 everywhere")  # fmt: skip
        time.sleep(1.0)
    finally:
        stop.set()
        worker.join(120)
    assert answers and all(a == expected for a in answers)
    assert not failures, failures
    assert peers["d"].get("/health")["layers"] == [10, 20]


def test_force_deregister_removes_a_node_everywhere(swarm) -> None:
    s, peers = swarm
    d_id = peers["d"].get("/health")["peer_id"]
    status, body = admin(peers["a"], "DELETE", f"/admin/nodes/{d_id}/force")
    assert (status, body) == (200, {"ok": True, "node_id": d_id})
    others = [peers[n] for n in ("a", "b", "c")]
    s.wait(lambda: all(node(p, d_id) is None for p in others), 10, "d gone from every other peer")
    time.sleep(3)  # d keeps heartbeating (it was not told); the others keep ignoring it
    assert all(node(p, d_id) is None for p in others)
    assert chat(peers["c"])


def test_metrics_count_real_traffic_the_same_on_every_peer_and_survive_a_restart(swarm) -> None:
    s, peers = swarm
    a_id = peers["a"].get("/health")["peer_id"]
    before = node(peers["a"], a_id)["requests_served"]
    for _ in range(3):
        chat(peers["a"])
    live = [peers[n] for n in ("a", "b", "c")]
    # Gossip carries a's new count to b within a heartbeat or two.
    s.wait(lambda: node(peers["b"], a_id)["requests_served"] >= before + 3, 10, "a's requests counted at b")

    def summaries() -> list[dict]:
        return [p.get("/metrics/summary") for p in live]

    s.wait(lambda: len({json_key(x) for x in summaries()}) == 1 and summaries()[0]["total_requests"] >= 3, 10,
           "the same summary on every peer")  # fmt: skip
    summary = summaries()[0]
    assert {"total_nodes", "ready_nodes", "total_tokens", "total_requests", "avg_latency_ms"} <= summary.keys()
    assert summary["total_tokens"] > 0
    # Requests by model travel in full records, at most one per node every details_min_s
    # (5 s), not in every heartbeat as the counters above do: they may arrive a little later.
    model = s.wait(lambda: (m := peers["b"].get(f"/metrics/model/{MODEL}"))["requests"] >= 3 and m, 15,
                   "a's requests by model counted at b")  # fmt: skip
    assert model["model_id"] == MODEL and model["tokens"] > 0
    assert request_json("GET", peers["b"].url + "/metrics/model/no:such")[0] == 404
    history = s.wait(lambda: (h := peers["c"].get("/metrics/history?minutes=5")["buckets"])
                     and sum(b["requests"] for b in h) >= 3 and h, 15, "a's minute buckets at c")  # so are buckets
    assert len(history) == 5
    assert request_json("GET", peers["c"].url + "/metrics/history?minutes=zero")[0] == 400
    ranks = peers["a"].get("/nodes/rankings")["rankings"]
    assert sorted(r["rank"] for r in ranks) == list(range(1, len(ranks) + 1))
    assert all(0 <= r["score"] <= 1 for r in ranks)

    # Counters live in SQLite under the data directory: a restarted peer keeps them.
    served = node(peers["b"], a_id)["requests_served"]
    assert served >= before + 3
    assert s.stop(peers["a"]) == 0
    again = s.start("a", "--layers", "0-10", "--admin-token", TOKEN, bootstrap=peers["b"])
    s.wait_ready(again)
    assert again.get("/health")["peer_id"] == a_id, "the identity must survive a restart"
    s.wait(lambda: (n := node(peers["b"], a_id)) and n["state"] == "Ready" and n["requests_served"] >= served, 15,
           "the restarted peer's counters")  # fmt: skip
    peers["a"] = again


def json_key(obj: object) -> str:
    import json

    return json.dumps(obj, sort_keys=True)
