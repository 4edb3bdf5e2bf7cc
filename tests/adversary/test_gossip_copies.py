"""A copy of a gossip message decides only what we send back to whoever sent it.

Since a forward to a neighbour that sent us the message itself is not sent
(``p2p.pubsub.Held``, docs/ARCHITECTURE.md "The crossing forward"), a copy
received is a new input that changes what we send. A hostile neighbour can send any copy
it likes (a forged one, of a message it never had, of one not yet published); it must only
ever stop forwards to itself, never to another peer, and what it makes us remember is bounded.
"""

from __future__ import annotations

import itertools

import pytest
import trio
from libp2p.pubsub.pb import rpc_pb2
from libp2p.pubsub.pubsub import Pubsub

from p2p.pubsub import Held
from test_host import TOPIC, running_hosts, wait_until


async def test_a_forged_copy_stops_only_the_forward_to_its_sender() -> None:
    """a - b - c in a line, x beside b. Before a publishes, x sends b a forged copy under the
    id a's next message will have. b still takes a's real message and forwards it to c; the
    only forward it drops is the one to x, who claimed to have it."""
    with trio.fail_after(30):
        async with running_hosts(4) as hosts:
            a, b, c, x = hosts
            subs = [await h.subscribe(TOPIC) for h in hosts]
            for left, right in ((a, b), (b, c), (x, b)):
                await left.connect(right.multiaddrs()[0])
            for left, right in ((a, b), (b, c), (x, b)):
                await wait_until(lambda left=left, right=right: right.peer_id in left.mesh_peers(TOPIC)
                                 and left.peer_id in right.mesh_peers(TOPIC), what="the mesh")  # fmt: skip
            pa, pb, px = (h._pubsub for h in (a, b, x))  # type: ignore[attr-defined]
            seqno = (pa.counter + 1).to_bytes(8, "big")
            forged = rpc_pb2.Message(from_id=pa.my_id.to_bytes(), seqno=seqno, data=b"forged",
                                     topicIDs=[TOPIC], signature=b"\0" * 64,
                                     key=a.libp2p_host.get_public_key().serialize())  # fmt: skip
            await Pubsub.write_msg(px, px.peers[pb.my_id], rpc_pb2.RPC(publish=[forged]))
            msg_id = pa.my_id.to_bytes() + seqno
            await wait_until(lambda: pb.held.has(px.my_id, msg_id), what="b to read x's copy")
            await a.publish(TOPIC, b"real")
            with trio.fail_after(5):
                assert (await subs[1].receive()).data == b"real"
                assert (await subs[2].receive()).data == b"real"  # c: forwarded by b
            await trio.sleep(1.5)  # past any deferred forward
            with pytest.raises(trio.WouldBlock):
                subs[3].receive_nowait()  # x: nothing, neither its forgery nor the real one


async def test_copies_of_ever_new_ids_keep_what_is_remembered_bounded() -> None:
    """A neighbour sending copies under ever new ids (each one cheap to forge) fills the
    table of who holds what to its bound, oldest out first; an evicted pair costs one copy
    sent as before, nothing else."""
    held = Held(kept=100)
    peers = ["x", "y"]
    for n, peer in zip(range(10_000), itertools.cycle(peers)):
        held.add(peer, n.to_bytes(8, "big"))  # type: ignore[arg-type]
    assert len(held) == 100
    assert held.has("y", (9_999).to_bytes(8, "big")) and not held.has("x", (0).to_bytes(8, "big"))  # type: ignore[arg-type]
    assert not held.has("x", (9_999).to_bytes(8, "big"))  # type: ignore[arg-type]  # keyed by its sender


async def test_a_flood_of_forged_copies_over_the_network_stays_within_the_bound() -> None:
    with trio.fail_after(60):
        async with running_hosts(2) as (b, x):
            await b.subscribe(TOPIC)
            await x.subscribe(TOPIC)
            await x.connect(b.multiaddrs()[0])
            pb, px = b._pubsub, x._pubsub  # type: ignore[attr-defined]
            await wait_until(lambda: pb.my_id in px.peers, what="x's pubsub stream to b")
            pb.held._kept = 50
            for n in range(200):
                junk = rpc_pb2.Message(from_id=px.my_id.to_bytes(), seqno=n.to_bytes(8, "big"), data=b"j",
                                       topicIDs=[TOPIC], signature=b"\0" * 64)  # fmt: skip
                await Pubsub.write_msg(px, px.peers[pb.my_id], rpc_pb2.RPC(publish=[junk]))
            last = px.my_id.to_bytes() + (199).to_bytes(8, "big")
            await wait_until(lambda: pb.held.has(px.my_id, last), timeout=20, what="b to read the flood")
            assert len(pb.held) == 50
