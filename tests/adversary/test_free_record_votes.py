"""Free records outvoting a live 3-peer swarm: records of fresh identities, as many as the
honest peers, stating a tiny context or another layer count for the model.

A record costs nothing (a new identity is a key pair), so what most peers state is any
stranger's to choose in a small swarm. Three records stating a context of 2 made every chat on
every peer a 400 "context holds 2"; three stating 29 layers showed the 30-layer model as 29
layers with a gap 1-29 on every peer's /api/models (an audit, 2026-12-07). Here the same
three records state both. They may only leave themselves out of routes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio
from hostile_peer import honest_record, hostile_peer
from live_swarm import MAX_TOKENS, MODEL, QUESTION, chat, three_peers
from reference import whole_model_text
from swarm import PeerProcess

from p2p.identity import Identity

pytestmark = [pytest.mark.swarm, pytest.mark.slow]
HEARTBEAT_MS = 300_000
"""What the audit's strangers claimed: one publish then lasts ~15 minutes."""


def strangers_on(peer: PeerProcess, ids: set[str]) -> int:
    return sum(n["peer_id"] in ids for n in peer.get("/nodes"))


def models_row(peer: PeerProcess) -> dict[str, Any]:
    row = next(m for m in peer.get("/api/models") if m["id"] == MODEL)
    return {k: row[k] for k in ("n_layers", "chain_complete", "gaps")}


def test_three_free_records_cannot_outvote_three_honest_peers(tmp_path: Path, smollm2, slice_cache) -> None:
    expected = whole_model_text(smollm2, slice_cache, QUESTION, MAX_TOKENS)
    with three_peers(tmp_path) as (s, peers):
        assert [models_row(p) for p in peers] == [{"n_layers": 30, "chain_complete": True, "gaps": []}] * 3
        strangers = [Identity.generate() for _ in range(3)]
        ids = {str(i.peer_id) for i in strangers}

        async def attack() -> None:
            with trio.fail_after(60):
                async with hostile_peer(s.multiaddr(peers[0])) as evil:
                    for ident in strangers:  # layers 0-1 of a 29-layer model: a range no route can use
                        record = honest_record(ident, model=MODEL, start=0, end=1, n_layers=29, context_length=2,
                                               heartbeat_ms=HEARTBEAT_MS)  # fmt: skip
                        await evil.publish_record(record, signer=ident)
                    for peer in peers:
                        await trio.to_thread.run_sync(s.wait, lambda p=peer: strangers_on(p, ids) == 3, 20, "the strangers' records", peer)

        trio.run(attack)
        # The stranger's host is gone; its records stay (they claim a 300 s heartbeat).
        for peer in peers:
            status, body = chat(peer)
            assert status == 200, (peer.name, status, body)
            assert body["choices"][0]["message"]["content"] == expected, peer.name
            assert models_row(peer) == {"n_layers": 30, "chain_complete": True, "gaps": []}, peer.name
            assert strangers_on(peer, ids) == 3, peer.name  # still there: the attack held throughout
            assert peer.alive(), f"{peer.name} exited:\n{peer.log_tail()}"
