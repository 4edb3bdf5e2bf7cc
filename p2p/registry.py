"""The registry: every peer's view of who holds which layers, as a pure reducer.

Gossip and anti-entropy deliver signed records; :func:`apply` decides whether each one
changes the table, and :func:`expire` ages the table. Both are pure functions of
``(table, input, now)``, so every merge rule is unit-tested without a network and every peer
that has seen the same records agrees on the same table (eventual consistency).

Rules, in order: the timestamp may be at most ``max_future_skew`` ahead of our clock and at
most ``drop_after`` behind it (older records describe a past that has already expired); the
sequence number may lead the record's own timestamp by at most ``max_seq_lead`` (it is the
publisher's clock, see :class:`RegistryLimits`) and must exceed the one we hold for that
node (an equal one is a harmless duplicate, a lower one a replay); a new node must fit the
signer's and the table's quotas; the signature must verify against the publisher's PeerID.
Who may publish which node id (ownership) is checked when the record is decoded
(:meth:`p2p.records.NodeRecord.check_ownership`): a record carries its node's owner.

Liveness is judged on our own clock: a record is fresh from when we first saw its sequence
number, except that anti-entropy (a neighbour handing us its table) cannot make a record
fresher than its own timestamp, so a dead peer's last record does not come back to life.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

from inclavate.types import NodeId
from p2p.records import NodeRecord, NodeState, SignedRecord


@dataclass(frozen=True)
class Liveness:
    """How long silence lasts before a node is Degraded, Dead, then forgotten.

    With a 2 s heartbeat, Degraded means three beats missed and Dead six."""

    heartbeat_s: float = 2.0
    degraded_after_s: float = 6.0
    dead_after_s: float = 12.0
    drop_after_s: float = 60.0
    max_future_skew_s: float = 10.0


class Verdict(enum.Enum):
    ACCEPTED = "accepted"
    DUPLICATE = "duplicate"
    BAD_SIGNATURE = "bad signature"
    FROM_THE_FUTURE = "timestamp too far in the future"
    TOO_OLD = "timestamp older than the drop horizon"
    REPLAY = "sequence number not newer than the one held"
    BANNED = "node banned by an admin"
    SEQ_AHEAD = "sequence number ahead of the signer's clock"
    SIGNER_FULL = "the signer already has its maximum number of records"
    TABLE_FULL = "the registry is full"

    @property
    def rejected(self) -> bool:
        return self not in (Verdict.ACCEPTED, Verdict.DUPLICATE)


@dataclass(frozen=True)
class RegistryLimits:
    """What one signer, and all of them together, may make a peer hold.

    ``seq`` is normally the publisher's clock in ms (``max(previous + 1, now_ms)``), so one
    further ahead of the record's own timestamp than ``max_seq_lead_s`` is not an honest
    counter: without this bound a single record with ``seq = 2**62`` would make every later
    genuine record of that node look like a replay for the rest of time."""

    max_seq_lead_s: float = 60.0
    max_records_per_signer: int = 64
    """A peer's own record plus the legacy nodes it vouches for."""
    max_records: int = 4096


@dataclass(frozen=True)
class Entry:
    signed: SignedRecord
    fresh_ms: int
    """Our clock's time this record was last known to be current."""

    @property
    def record(self) -> NodeRecord:
        return self.signed.record


@dataclass(frozen=True)
class Table:
    entries: Mapping[NodeId, Entry] = field(default_factory=lambda: MappingProxyType({}))

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, node_id: str) -> Entry | None:
        return self.entries.get(NodeId(node_id))

    def signed_records(self) -> list[SignedRecord]:
        return [e.signed for e in self.entries.values()]

    def views(self, now_ms: int, liveness: Liveness) -> Iterator[NodeView]:
        for entry in sorted(self.entries.values(), key=lambda e: e.record.node_id):
            yield NodeView(entry.record, effective_state(entry, now_ms, liveness))


@dataclass(frozen=True)
class NodeView:
    """A record with the state this peer currently believes (after ageing)."""

    record: NodeRecord
    state: NodeState

    @property
    def routable(self) -> bool:
        return self.state == "Ready" and not self.record.idle and not self.record.draining


def apply(
    table: Table,
    signed: SignedRecord,
    now_ms: int,
    liveness: Liveness,
    via: Literal["gossip", "sync"] = "gossip",
    limits: RegistryLimits = RegistryLimits(),
) -> tuple[Table, Verdict]:
    record = signed.record
    if record.ts_ms > now_ms + liveness.max_future_skew_s * 1000:
        return table, Verdict.FROM_THE_FUTURE
    if record.ts_ms < now_ms - liveness.drop_after_s * 1000:
        return table, Verdict.TOO_OLD
    if record.seq > record.ts_ms + limits.max_seq_lead_s * 1000:
        return table, Verdict.SEQ_AHEAD
    held = table.entries.get(record.node_id)
    if held is not None and record.seq <= held.record.seq:
        verdict = Verdict.DUPLICATE if record.seq == held.record.seq else Verdict.REPLAY
        return table, verdict
    if held is None:
        if len(table.entries) >= limits.max_records:
            return table, Verdict.TABLE_FULL
        if sum(e.record.peer_id == record.peer_id for e in table.entries.values()) >= limits.max_records_per_signer:
            return table, Verdict.SIGNER_FULL
    if not signed.verified():  # last: the only costly check
        return table, Verdict.BAD_SIGNATURE
    fresh = now_ms if via == "gossip" else min(now_ms, record.ts_ms)
    entries = dict(table.entries)
    entries[record.node_id] = Entry(signed, fresh)
    return Table(MappingProxyType(entries)), Verdict.ACCEPTED


def effective_state(entry: Entry, now_ms: int, liveness: Liveness) -> NodeState:
    record = entry.record
    if record.state == "Dead":
        return "Dead"
    age_s = (now_ms - entry.fresh_ms) / 1000
    if age_s > liveness.dead_after_s:
        return "Dead"
    if age_s > liveness.degraded_after_s:
        return "Degraded"
    return record.state


def expire(table: Table, now_ms: int, liveness: Liveness) -> Table:
    """Forget nodes silent (or departed) for longer than ``drop_after``.

    Nothing forgotten can be replayed: its records are then older than the drop horizon,
    which :func:`apply` refuses on the timestamp alone.
    """
    horizon = now_ms - liveness.drop_after_s * 1000
    keep = {node: entry for node, entry in table.entries.items() if entry.fresh_ms >= horizon}
    if len(keep) == len(table.entries):
        return table
    return Table(MappingProxyType(keep))


def remove(table: Table, node_id: str) -> Table:
    """Drop a node at once (admin force-deregistration on this peer)."""
    if node_id not in table.entries:
        return table
    entries = dict(table.entries)
    del entries[NodeId(node_id)]
    return Table(MappingProxyType(entries))
