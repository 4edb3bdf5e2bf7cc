"""Five real peers gossip one signed registry: convergence, forgery, replay, liveness."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator

import pytest
import trio
from swarm import PeerProcess, Swarm

from inclavate.types import ModelId, NodeId, PeerId
from p2p.gossip import TOPIC
from p2p.host import open_host
from p2p.identity import Identity
from p2p.records import NodeRecord, SignedRecord, canonical_bytes, now_ms
from p2p.registry import Cadence, Liveness

pytestmark = [pytest.mark.swarm, pytest.mark.slow]
LIVE = Liveness()


@pytest.fixture(scope="module")
def five(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Swarm, list[PeerProcess]]]:
    with Swarm(tmp_path_factory.mktemp("five")) as swarm:
        first = swarm.start("p0", "--max-layers", "6")
        peers = [first] + [swarm.start(f"p{i}", "--max-layers", "6", bootstrap=first) for i in range(1, 5)]
        for peer in peers:
            swarm.multiaddr(peer, timeout=60)
        yield swarm, peers


def registry(peer: PeerProcess) -> dict[str, tuple[int, int]]:
    return {n["node_id"]: (n["start_layer"], n["end_layer"]) for n in peer.get("/nodes")}


def test_every_peer_converges_to_the_same_registry(five) -> None:
    swarm, peers = five
    started = time.monotonic()
    ids = {p.get("/health")["peer_id"] for p in peers}

    def converged() -> bool:
        tables = [registry(p) for p in peers]
        return all(set(t) == ids for t in tables) and all(t == tables[0] for t in tables)

    swarm.wait(converged, 10.0, "identical registries on all five peers")
    assert time.monotonic() - started < 10.0
    # Self-placement with --max-layers 6 tiles the 30 layers exactly.
    for peer in peers:
        swarm.wait_ready(peer)
    swarm.wait(lambda: all(p.get("/api/models")[0]["chain_complete"] for p in peers), 15.0, "a complete chain")
    ranges = sorted(registry(peers[0]).values())
    assert ranges == [(0, 6), (6, 12), (12, 18), (18, 24), (24, 30)]
    # Heartbeats are slim: hardware travels in full records, and every peer still has it.
    def details_everywhere() -> bool:
        return all("gpu" in p.get(f"/nodes/{node}/hardware") for p in peers for node in ids)

    swarm.wait(details_everywhere, 10.0, "every node's hardware on every peer")


def _record(identity: Identity, seq: int, ts: int, end: int = 1, node: str | None = None) -> NodeRecord:
    return NodeRecord(
        node_id=NodeId(node or identity.peer_id), peer_id=PeerId(node or identity.peer_id),
        model_id=ModelId("test:inject"), start_layer=0, end_layer=end, n_layers=4, d_model=8,
        state="Ready", seq=seq, ts_ms=ts,
    )  # fmt: skip


async def test_forged_replayed_and_future_records_are_rejected(five) -> None:
    swarm, peers = five
    victim = await trio.to_thread.run_sync(peers[1].get, "/health")
    target = await trio.to_thread.run_sync(swarm.multiaddr, peers[0])
    me = Identity.generate()
    with trio.fail_after(60):
        async with open_host(me, listen_host="127.0.0.1") as host:
            await host.connect(target)
            await host.subscribe(TOPIC)
            while not host.gossip_peers(TOPIC):
                await trio.sleep(0.1)

            async def publish(signed: SignedRecord) -> None:
                await host.publish(TOPIC, signed.encode())

            # A genuine record reaches everyone: the injection path works. Published again
            # every 2 s, as a peer's heartbeat would be: a gossipsub peer that has just
            # connected may be backed off (a GRAFT too soon) and its first message dropped.
            good = _record(me, seq=now_ms(), ts=now_ms(), end=2)

            def everyone_has_it() -> bool:
                return all(registry(p).get(me.peer_id) == (0, 2) for p in peers)

            with trio.fail_after(30):
                while True:
                    await publish(SignedRecord.sign(good, me))
                    await trio.sleep(2.0)
                    if await trio.to_thread.run_sync(everyone_has_it):
                        break

            # Forged: claims to be peer 1, signed with our key.
            forged = _record(me, seq=now_ms() + 10**9, ts=now_ms(), end=3, node=victim["peer_id"])
            await publish(SignedRecord(forged, canonical_bytes(forged), me.sign(canonical_bytes(forged))))
            # Replayed: an older sequence number than the record everyone holds.
            await publish(SignedRecord.sign(_record(me, seq=good.seq - 1, ts=now_ms(), end=3), me))
            # From the future: a newer sequence number but a timestamp an hour ahead.
            await publish(SignedRecord.sign(_record(me, seq=good.seq + 1, ts=now_ms() + 3_600_000, end=4), me))
            await trio.sleep(2.0)
            for peer in peers:
                table = await trio.to_thread.run_sync(registry, peer)
                assert table[me.peer_id] == (0, 2), f"{peer.name} accepted a bad record"
                assert table[victim["peer_id"]] != (0, 3), f"{peer.name} accepted a forged record"


def _states(peer: PeerProcess, node_id: str) -> str | None:
    return next((n["state"] for n in peer.get("/nodes") if n["node_id"] == node_id), None)


def test_a_killed_peer_degrades_then_dies_and_a_stopped_one_dies_at_once(five) -> None:
    swarm, peers = five
    killed, stopped, survivors = peers[4], peers[3], peers[:3]
    killed_id = killed.get("/health")["peer_id"]
    stopped_id = stopped.get("/health")["peer_id"]

    # The heartbeat interval grows with the table (five peers and the injected node: 6).
    live = LIVE.for_record(_record(Identity.generate(), 1, 1).replace(heartbeat_ms=round(Cadence().heartbeat_s(6, LIVE) * 1000)))
    swarm.signal(killed, signal.SIGKILL)
    t0 = time.monotonic()
    swarm.wait(lambda: all(_states(p, killed_id) == "Degraded" for p in survivors),
               live.dead_after_s, "survivors to mark the killed peer Degraded")  # fmt: skip
    degraded_at = time.monotonic() - t0
    swarm.wait(lambda: all(_states(p, killed_id) == "Dead" for p in survivors),
               live.dead_after_s + 4, "survivors to mark the killed peer Dead")  # fmt: skip
    assert degraded_at >= live.degraded_after_s - live.heartbeat_s - 1, "degraded before any heartbeat was missed"
    assert time.monotonic() - t0 <= live.dead_after_s + 4

    t0 = time.monotonic()
    assert swarm.stop(stopped) == 0, stopped.log_tail()
    assert time.monotonic() - t0 < 8.0, "SIGTERM took too long"
    swarm.wait(lambda: all(_states(p, stopped_id) == "Dead" for p in survivors), 3.0,
               "survivors to mark the departed peer Dead at once")  # fmt: skip
