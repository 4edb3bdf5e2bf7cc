"""What one registry-sync answer costs its receiver, in-process (no network).

We ask every neighbour that connects for its whole table (``/inclavate/registry-sync/2``),
so a stranger chooses the answer. Each scenario hands a :class:`p2p.gossip.RegistryService`
one answer (:meth:`~p2p.gossip.RegistryService.take_answer`), as large as an asker reads (8,192 envelopes, 64 MiB, in pages),
and reports the CPU time the sync took (``time.process_time``, best of ``--rounds``), per
answer and per envelope, with how many envelopes were typed by the schema and how many
signatures were checked:

- hostile: one signer's 64 nodes at ever newer seqs; one record from each of 8,192 fresh
  signers (the table holds 4,096); records we hold verbatim; fresh nodes with a bad
  signature; stale seqs of nodes we hold;
- honest: a newcomer pulling a 4,096-node swarm (each node's full record and heartbeat);
  a peer that holds the same swarm (from gossip) and sees 5% of its heartbeats newer.

Records are an idle peer's (``bench_registry.sample_record``): full 8.3 KB, heartbeat 1 KB.
With ``--stream N``, one service is then handed N such fresh-signer answers in a row (its
table emptied between them): what the sync budget lets a stream of strangers cost.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import trio
from bench_registry import sample_record

from inclavate.types import NodeId, PeerId
from p2p import record_schema, records
from p2p.gossip import RegistryService
from p2p.identity import Identity
from p2p.records import NodeRecord, SignedRecord, legacy_node_id, now_ms, slim_record
from p2p.registry import Liveness, Table, apply
from p2p.sync_answer import answer_pages

MAX_ANSWER_BYTES = 64 * 1024 * 1024
MAX_ENVELOPES = 8192


@dataclass
class Work:
    cpu_s: float
    envelopes: int
    typed: int
    """Envelopes the schema typed (decode_record calls)."""
    verified: int
    """Signatures checked."""
    accepted: int


def answer(envelopes: list[SignedRecord]) -> list[bytes]:
    """The sync answer's pages carrying as many of ``envelopes`` as an asker reads."""
    texts: list[str] = []
    size = 16
    for signed in envelopes[:MAX_ENVELOPES]:
        text = signed.encode().decode()
        size += len(json.dumps(text)) + 2
        if size > MAX_ANSWER_BYTES:
            break
        texts.append(text)
    return list(answer_pages(text.encode() for text in texts))


def _counting(module: object, name: str, counter: list[int]) -> Callable[[], None]:
    original = getattr(module, name)

    def counted(*args: object, **kwargs: object) -> object:
        counter[0] += 1
        return original(*args, **kwargs)

    setattr(module, name, counted)
    return lambda: setattr(module, name, original)


def service_holding(table: Table) -> RegistryService:
    """A registry service (no network: answers are handed to it) holding ``table``."""
    service = RegistryService(None, Identity.generate(), Liveness())  # type: ignore[arg-type]
    service.table = table
    return service


def sync_once(service: RegistryService, pages: list[bytes]) -> Work:
    """CPU of taking one sync answer into ``service``."""
    typed, verified = [0], [0]
    restore = [_counting(record_schema, "decode_record", typed), _counting(records, "verify", verified)]
    try:
        started = time.process_time()
        accepted = trio.run(service.take_answer, pages, PeerId("neighbour"))
        cpu = time.process_time() - started
    finally:
        for undo in restore:
            undo()
    count = sum(len(json.loads(page)["records"]) for page in pages)
    return Work(cpu, count, typed[0], verified[0], accepted)


def _node(identity: Identity, full: NodeRecord, **changes: object) -> NodeRecord:
    fields: dict[str, object] = {"node_id": NodeId(identity.peer_id), "peer_id": PeerId(identity.peer_id), "multiaddrs": ()}
    return full.replace(**{**fields, **changes})


def swarm(n: int, full: NodeRecord) -> tuple[list[SignedRecord], list[Identity]]:
    """An honest swarm of ``n`` nodes: each node's full record and its newer heartbeat."""
    ids = [Identity.generate() for _ in range(n)]
    out: list[SignedRecord] = []
    for identity in ids:
        record = _node(identity, full)
        out.append(SignedRecord.sign(record, identity))
        out.append(SignedRecord.sign(slim_record(record.replace(seq=record.seq + 1)), identity))
    return out, ids


def holding(envelopes: list[SignedRecord]) -> Table:
    table, now, liveness = Table(), now_ms(), Liveness()
    for signed in envelopes:
        table, _ = apply(table, signed, now, liveness, "sync")
    return table


def scenarios(nodes: int) -> dict[str, tuple[list[bytes], Table]]:
    ts = now_ms()
    # A 300 s heartbeat keeps the records inside the drop horizon (2.5 h) for the whole run.
    full = sample_record(Identity.generate(), full=True).replace(heartbeat_ms=300_000, seq=ts, ts_ms=ts)
    honest, ids = swarm(nodes, full)
    held = holding(honest)
    out: dict[str, tuple[list[bytes], Table]] = {}

    mallory = Identity.generate()
    one_signer = [SignedRecord.sign(_node(mallory, full, node_id=legacy_node_id(mallory.peer_id, f"n{i % 64}"),
                                          relayed=True, seq=ts + i), mallory) for i in range(MAX_ENVELOPES)]  # fmt: skip
    out["hostile: one signer, 64 nodes, ever newer seqs"] = (answer(one_signer), Table())
    fresh = [Identity.generate() for _ in range(MAX_ENVELOPES)]
    out["hostile: a fresh signer per record"] = (answer([SignedRecord.sign(_node(i, full), i) for i in fresh]), Table())
    out["hostile: records we hold verbatim"] = (answer(honest), held)
    forged = [SignedRecord(s.record, s.payload, bytes(64)) for s in (SignedRecord.sign(_node(i, full), i) for i in fresh)]
    out["hostile: fresh nodes, bad signature"] = (answer(forged), Table())
    stale = [SignedRecord.sign(_node(i, full, seq=ts - 1), i) for i in ids]
    out["hostile: stale seqs of nodes we hold"] = (answer(stale), held)
    out[f"honest: a newcomer pulls {nodes} nodes"] = (answer(honest), Table())
    newer = list(honest)
    for k in range(0, len(ids), 20):  # 5% of the heartbeats moved on since we heard them
        beat = honest[2 * k + 1]
        newer[2 * k + 1] = SignedRecord.sign(beat.record.replace(seq=beat.record.seq + 1), ids[k])
    out[f"honest: a peer holding the {nodes} nodes, 5% newer"] = (answer(newer), held)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=4096, help="nodes of the honest swarm")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--only", default="", help="run the scenarios whose name holds this text")
    parser.add_argument("--stream", type=int, default=0,
                        help="then hand one service this many fresh-signer answers in a row")  # fmt: skip
    args = parser.parse_args()
    print(f"building the answers ({args.nodes} honest nodes, {MAX_ENVELOPES} hostile envelopes)...", flush=True)
    answers = scenarios(args.nodes)
    for name, (pages, table) in answers.items():
        if args.only not in name:
            continue
        runs = [sync_once(service_holding(table), pages) for _ in range(args.rounds)]
        report(name, min(runs, key=lambda w: w.cpu_s), pages)
    if args.stream:
        pages, table = answers["hostile: a fresh signer per record"]
        service = service_holding(table)
        for k in range(args.stream):  # each answer from a new stranger, at once: the budget does not refill
            service.table = Table()  # the table emptied, as if the last answer's nodes had expired
            report(f"stream of strangers, answer {k + 1}", sync_once(service, pages), pages)
    return 0


def report(name: str, work: Work, pages: list[bytes]) -> None:
    per = work.cpu_s / work.envelopes * 1e6 if work.envelopes else 0.0
    size = sum(map(len, pages))
    print(f"{name}: {work.envelopes} envelopes, {size / 2**20:.1f} MiB in {len(pages)} pages; CPU {work.cpu_s:.2f} s ({per:.0f} us per "
          f"envelope); typed {work.typed}, signatures {work.verified}, accepted {work.accepted}", flush=True)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
