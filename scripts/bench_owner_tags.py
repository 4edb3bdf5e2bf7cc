"""What checking listed ids' owner tags costs: ``p2p.artifact_wire.decode_keys`` on one
answer of KEYS keys from one peer, with a registry of PEERS identities (best of ROUNDS), for
ids minted now (60-bit tag) and for legacy ids (32-bit tag, 90 random bits). The registry's
tags (``inclavate.owner_ids.Owners``) are hashed inside the timed part, though a listing
hashes them once for all its peers' answers. Runs on the tree before the 60-bit tag too
(its ``decode_keys`` took no ``owners``), to compare.

Run with ``taskset -c N`` and ``PYTHONSAFEPATH=1`` (so ``PYTHONPATH`` picks the tree):
``PYTHONPATH=TREE python scripts/bench_owner_tags.py [--keys 5000] [--peers 200] [--rounds 200]``."""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import time
import uuid
from collections.abc import Callable

from inclavate.artifact_types import ListQuery
from inclavate.owner_ids import new_id
from p2p.artifact_wire import decode_keys, encode


def legacy_id(peer: str) -> str:
    """An id as minted before the widening: the 32-bit tag, then 90 random bits."""
    raw = bytearray(uuid.uuid4().bytes)
    raw[:4] = hashlib.sha256(b"inclavate/owner-tag/1:" + peer.encode()).digest()[:4]
    return str(uuid.UUID(bytes=bytes(raw)))


def best_ms(mint: Callable[[str], str], keys: int, peers: list[str], rounds: int) -> float:
    peer = peers[len(peers) // 2]
    answer = json.loads(encode({"ok": True, "keys": [[2_000_000_000_000 - i, mint(peer)] for i in range(keys)],
                                "truncated": False}))  # fmt: skip
    answer["keys"].sort(key=lambda k: (k[0], k[1]), reverse=True)
    query = ListQuery(limit=keys, offset=0)
    wide = "owners" in inspect.signature(decode_keys).parameters
    best = float("inf")
    for _ in range(rounds):
        began = time.perf_counter()
        if wide:
            from inclavate.owner_ids import Owners

            decode_keys(answer, peer, query, Owners(peers))  # type: ignore[call-arg]
        else:
            decode_keys(answer, peer, query)  # type: ignore[call-arg]
        best = min(best, time.perf_counter() - began)
    return best * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--keys", type=int, default=5000)
    parser.add_argument("--peers", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    peers = [f"12D3KooWpeer{i:05}" for i in range(args.peers)]
    for name, mint in (("new ids", new_id), ("legacy ids", legacy_id)):
        ms = best_ms(mint, args.keys, peers, args.rounds)
        print(f"decode_keys: {args.keys} {name}, {args.peers} known peers: {ms:.2f} ms (best of {args.rounds})")


if __name__ == "__main__":
    main()
