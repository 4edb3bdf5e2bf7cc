"""A stranger's libp2p peer against a live 3-peer swarm: it connects, answers registry syncs
and peer exchanges with garbage, gossips malformed, forged, oversized and far-future records.

After every attack each honest peer is alive, its registry holds the honest records
unchanged, and a chat through the whole chain answers with the whole model's text. One
swarm serves the module (starting peers is the slow part)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import trio
from hostile_peer import HostilePeer, envelope, honest_record, hostile_peer
from reference import whole_model_text
from swarm import PeerProcess, Swarm, request_json

from inclavate.types import PeerId
from p2p.discovery import PEERS_PROTOCOL
from p2p.gossip import SYNC_PROTOCOL
from p2p.identity import Identity
from p2p.records import legacy_node_id

pytestmark = [pytest.mark.swarm, pytest.mark.slow]
MODEL = "smollm2:135m"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
DEEP = b"[" * 100_000 + b"]" * 100_000


class Live:
    def __init__(self, swarm: Swarm, peers: list[PeerProcess]) -> None:
        self.swarm = swarm
        self.peers = peers
        self.ids = [p.get("/health")["peer_id"] for p in peers]
        self.addrs = [swarm.multiaddr(p) for p in peers]
        self.honest = {n["node_id"]: (n["start_layer"], n["end_layer"]) for n in peers[0].get("/nodes")}

    def table(self, peer: PeerProcess) -> dict[str, dict[str, Any]]:
        return {n["node_id"]: n for n in peer.get("/nodes")}

    def honest_unchanged(self) -> bool:
        for peer in self.peers:
            table = self.table(peer)
            for node, layers in self.honest.items():
                held = table.get(node)
                if held is None or (held["start_layer"], held["end_layer"]) != layers or held["state"] != "Ready":
                    return False
        return True


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    with Swarm(tmp_path_factory.mktemp("hostile"), extra_args=["--wire-dtype", "f32"]) as s:
        a = s.start("a", "--layers", "0-10")
        b = s.start("b", "--layers", "10-20", bootstrap=a)
        c = s.start("c", "--layers", "20-30", bootstrap=a)
        for peer in (a, b, c):
            s.wait_ready(peer, timeout=120)
        s.wait(lambda: a.get("/api/models")[0]["chain_complete"] and len(a.get("/nodes")) == 3, 30, "the swarm")
        yield Live(s, [a, b, c])


@pytest.fixture(scope="module")
def expected(smollm2, slice_cache) -> str:
    return whole_model_text(smollm2, slice_cache, QUESTION, 16)


def chat(peer: PeerProcess) -> str:
    status, body = request_json("POST", peer.url + "/v1/chat/completions",
                                {"model": MODEL, "messages": QUESTION, "max_tokens": 16, "temperature": 0}, timeout=120)  # fmt: skip
    assert status == 200, body
    return str(body["choices"][0]["message"]["content"])


def assert_swarm_healthy(live: Live, expected: str, entry: int = 1) -> None:
    for peer in live.peers:
        assert peer.alive(), f"{peer.name} exited:\n{peer.log_tail()}"
    live.swarm.wait(live.honest_unchanged, 10, "every peer to hold the honest records unchanged")
    assert chat(live.peers[entry]) == expected
    for peer in live.peers:
        assert peer.alive(), f"{peer.name} exited:\n{peer.log_tail()}"


async def wait_asked(evil: HostilePeer, protocol: str, timeout: float = 10.0) -> None:
    with trio.fail_after(timeout):
        while not evil.asked.get(protocol):
            await trio.sleep(0.05)


@pytest.mark.parametrize(
    "reply",
    [
        b'{"records":1}',
        DEEP,
        b'{"records":[1, {"a": 2}, "not an envelope", "' + b"[" * 3000 + b'"]}',
        b"\xff\xfe not even text",
    ],
    ids=["records-not-a-list", "deep-nesting", "garbage-entries", "not-utf8"],
)
async def test_a_garbage_registry_sync_reply_crashes_nobody(live: Live, expected: str, reply: bytes) -> None:
    # Before the fix the first reply made all three honest peers exit within seconds.
    with trio.fail_after(60):
        for addr in live.addrs:
            async with hostile_peer(addr, sync_reply=reply, gossip=False) as evil:
                await wait_asked(evil, SYNC_PROTOCOL)
                await trio.sleep(0.5)
    await trio.to_thread.run_sync(assert_swarm_healthy, live, expected)


async def test_a_sync_reply_with_malformed_records_crashes_nobody(live: Live, expected: str) -> None:
    me = Identity.generate()
    bad_layer = {**honest_record(me).to_json(), "start_layer": "zero"}
    bad_bucket = {**honest_record(me).to_json(), "buckets": [{"ts_ms": 0, "requests": "1", "tokens": 0}]}
    envelopes = []
    for fields in (bad_layer, bad_bucket):
        payload = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
        envelopes.append(envelope(payload, me).decode())
    reply = json.dumps({"records": envelopes}).encode()
    with trio.fail_after(60):
        async with hostile_peer(live.addrs[1], identity=me, sync_reply=reply, gossip=False) as evil:
            await wait_asked(evil, SYNC_PROTOCOL)
            await trio.sleep(0.5)
    await trio.to_thread.run_sync(assert_swarm_healthy, live, expected)


async def test_a_malformed_gossipsub_rpc_crashes_nobody(live: Live, expected: str) -> None:
    # protobuf's DecodeError escaped py-libp2p's pubsub reader and ended the peer.
    with trio.fail_after(60):
        for addr, victim in zip(live.addrs, live.ids, strict=True):
            async with hostile_peer(addr, gossip=False) as evil:
                await evil.send_raw_pubsub(PeerId(victim), b"\xff\xff\xff\xff not a protobuf")
                await evil.send_raw_pubsub(PeerId(victim), b"\x0a" * 1000)
    await trio.to_thread.run_sync(assert_swarm_healthy, live, expected)


async def test_garbage_peer_exchange_answers_crash_nobody(live: Live, expected: str) -> None:
    for reply in (DEEP, b'{"peers":1}', b'{"peers":[{"id":1,"addrs":"x"}]}'):
        with trio.fail_after(30):
            async with hostile_peer(live.addrs[2], peers_reply=reply, gossip=False) as evil:
                await wait_asked(evil, PEERS_PROTOCOL)
                await trio.sleep(0.5)
    await trio.to_thread.run_sync(assert_swarm_healthy, live, expected)


async def test_gossiped_records_that_used_to_crash_every_peer_are_dropped(live: Live, expected: str) -> None:
    with trio.fail_after(60):
        async with hostile_peer(live.addrs[0]) as evil:
            me = evil.identity
            base = honest_record(me, model=MODEL, start=10, end=20, state="Joining").to_json()
            poisons = [
                {"start_layer": "10"},
                {"buckets": [{"ts_ms": 60_000, "requests": "1", "tokens": 0}]},
                {"buckets": [{"ts_ms": 60_000, "requests": 2**70, "tokens": 0}]},
                {"step_ms_per_layer": "fast", "state": "Ready"},
                {"hardware": json.loads("[" * 500 + "]" * 500)},
            ]
            for i, changes in enumerate(poisons):
                await evil.publish_json({**base, **changes, "seq": base["seq"] + i})
            await evil.publish_raw(DEEP)
            await evil.publish_raw(b'{"v":1,"record":1,"sig":2}')
            await trio.sleep(2.0)

            def absent() -> bool:
                return all(me.peer_id not in live.table(p) for p in live.peers)

            assert await trio.to_thread.run_sync(absent)
            # Metrics that sum the records' buckets still answer.
            for peer in live.peers:
                status, body = await trio.to_thread.run_sync(lambda p=peer: request_json("GET", p.url + "/metrics/summary"))
                assert status == 200, body
    await trio.to_thread.run_sync(assert_swarm_healthy, live, expected)


async def test_nobody_can_take_over_another_peers_node_id(live: Live, expected: str) -> None:
    victim, victim_layers = live.ids[1], live.honest[live.ids[1]]
    with trio.fail_after(60):
        async with hostile_peer(live.addrs[0]) as evil:
            me = evil.identity
            far = 2**62
            claims = [
                # As a relayed (legacy) node of ours: the old loophole.
                honest_record(me, node_id=victim, model=MODEL, start=10, end=20, relayed=True, seq=far),
                honest_record(me, node_id=victim, model=MODEL, start=10, end=20, seq=far),
                # A legacy id namespaced under the victim, signed by us.
                honest_record(me, node_id=legacy_node_id(victim, "n1"), model=MODEL, start=10, end=20, relayed=True),
                # Our own node, with a seq that would freeze it for ever.
                honest_record(me, model=MODEL, start=10, end=20, state="Joining", seq=far),
            ]
            for record in claims:
                await evil.publish_record(record)
            await trio.sleep(2.0)
            # A sync reply carrying the same claims is refused the same way.
    for peer in live.peers:
        table = await trio.to_thread.run_sync(live.table, peer)
        assert table[victim]["peer_id"] == victim and (table[victim]["start_layer"], table[victim]["end_layer"]) == victim_layers
        assert all(n["peer_id"] != me.peer_id for n in table.values()), f"{peer.name} took a forged claim"
    # The victim's own heartbeats still land (its seq was not frozen out).
    before = (await trio.to_thread.run_sync(live.table, live.peers[0]))[victim]["uptime_s"]
    await trio.to_thread.run_sync(live.swarm.wait, lambda: live.table(live.peers[0])[victim]["uptime_s"] > before, 10, "a fresh heartbeat")
    await trio.to_thread.run_sync(assert_swarm_healthy, live, expected)


async def test_one_signer_cannot_fill_the_registry(live: Live, expected: str) -> None:
    with trio.fail_after(90):
        async with hostile_peer(live.addrs[0]) as evil:
            me = evil.identity
            for i in range(100):
                record = honest_record(me, node_id=legacy_node_id(me.peer_id, f"n{i}"), model=MODEL, start=10,
                                       end=20, relayed=True, state="Joining")  # fmt: skip
                await evil.publish_record(record)
                if i % 20 == 19:
                    await trio.sleep(0.3)  # stay under gossipsub's per-forwarder rate
            await trio.sleep(2.0)
            for peer in live.peers:
                table = await trio.to_thread.run_sync(live.table, peer)
                held = sum(n["peer_id"] == me.peer_id for n in table.values())
                assert 0 < held <= 64, f"{peer.name} holds {held} records of one signer"
    await trio.to_thread.run_sync(assert_swarm_healthy, live, expected)


def test_a_legacy_record_receivers_would_refuse_is_refused_at_registration(live: Live, expected: str) -> None:
    # The vouching peer checks its own records the way receivers will: a hardware profile
    # nested too deep to gossip is a 400, not a node that exists on one peer only.
    deep: dict[str, Any] = {}
    for _ in range(12):
        deep = {"x": deep}
    body = {"node_id": "deep-1", "model_id": MODEL, "http_url": "http://127.0.0.1:9", "start_layer": 10,
            "end_layer": 20, "hardware": deep}  # fmt: skip
    status, answer = request_json("POST", live.peers[0].url + "/nodes", body)
    assert status == 400, answer
    assert not any(n.get("legacy_id") == "deep-1" for n in live.peers[0].get("/nodes"))
    assert request_json("POST", live.peers[0].url + "/nodes/deep-1/health", {})[0] == 404
    assert_swarm_healthy(live, expected, entry=0)
