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
signer's quota, and the table's or its fair share of it (:func:`fair_donor`); the signature
must verify against the publisher's PeerID.
Who may publish which node id (ownership) is checked when the record is decoded
(:meth:`p2p.records.NodeRecord.check_ownership`): a record carries its node's owner.

Liveness is judged on our own clock: a record is fresh from when we first saw its sequence
number, except that anti-entropy (a neighbour handing us its table) cannot make a record
fresher than its own timestamp, so a dead peer's last record does not come back to life.
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
import functools
import itertools
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal, Protocol

from inclavate.types import ModelId, NodeId, PeerId
from p2p.records import NodeRecord, NodeState, SignedRecord, with_details


class Header(Protocol):
    """What the registry's rules read before the signature: a decoded record's fields, or a
    sync answer's record read that far only (:class:`p2p.record_schema.RecordHeader`)."""

    @property
    def node_id(self) -> NodeId: ...
    @property
    def peer_id(self) -> PeerId: ...
    @property
    def seq(self) -> int: ...
    @property
    def ts_ms(self) -> int: ...
    @property
    def heartbeat_ms(self) -> int: ...
    @property
    def slim(self) -> bool: ...


@dataclass(frozen=True)
class Liveness:
    """How long silence lasts before a node is Degraded, Dead, then forgotten.

    With a 2 s heartbeat, Degraded means three beats missed and Dead six. A publisher in a
    large swarm beats less often (:class:`Cadence`) and says so in its records
    (``heartbeat_ms``); its silence is judged by :meth:`for_record`, the same number of beats,
    never less time than the defaults here and never more than ``max_heartbeat_s`` allows."""

    heartbeat_s: float = 2.0
    degraded_after_s: float = 6.0
    dead_after_s: float = 12.0
    drop_after_s: float = 60.0
    max_future_skew_s: float = 10.0
    max_heartbeat_s: float = 300.0
    """The longest announced interval believed: a record claiming more stays Ready no longer."""

    def for_record(self, record: Header) -> Liveness:
        """The thresholds for a node that announced ``record.heartbeat_ms``."""
        return self.for_interval(record.heartbeat_ms / 1000)

    def for_interval(self, announced_s: float) -> Liveness:
        """The thresholds for a node beating every ``announced_s`` (believed up to
        :attr:`max_heartbeat_s`)."""
        announced = min(announced_s, self.max_heartbeat_s)
        if announced <= self.heartbeat_s:
            return self
        return _scaled(self, announced)


@functools.lru_cache(maxsize=256)
def _scaled(liveness: Liveness, announced: float) -> Liveness:
    """:meth:`Liveness.for_interval` beyond the default beat, built once per interval: every
    record of a large swarm announces one, and :func:`expire` and every view ask per record
    (a ``dataclasses.replace`` each was most of an ageing pass)."""
    k = announced / liveness.heartbeat_s
    return dataclasses.replace(liveness, heartbeat_s=announced, degraded_after_s=liveness.degraded_after_s * k,
                               dead_after_s=liveness.dead_after_s * k, drop_after_s=liveness.drop_after_s * k)  # fmt: skip


@dataclass(frozen=True)
class Cadence:
    """How often a peer publishes, from the size of its swarm: the cost model in
    docs/ARCHITECTURE.md ("Gossip: the registry").

    Every peer receives every record, so an idle peer's CPU is ``base + rate x cost``, and
    the rate is what must not grow with the swarm. The heartbeat interval grows instead,
    beyond ``heartbeats_per_s`` records a second in all; full records (details) are sent on
    change no sooner than ``details_min_s`` after the previous one, at least every
    ``details_refresh_s`` while their samples move, and both spacings also grow beyond
    ``details_per_s`` full records a second in all."""

    heartbeats_per_s: float = 2.0
    details_per_s: float = 1.0
    details_min_s: float = 5.0
    details_refresh_s: float = 60.0

    def heartbeat_s(self, nodes: int, liveness: Liveness) -> float:
        return min(liveness.max_heartbeat_s, max(liveness.heartbeat_s, nodes / self.heartbeats_per_s))

    def details_spacing_s(self, nodes: int, *, refresh: bool) -> float:
        floor = self.details_refresh_s if refresh else self.details_min_s
        return max(floor, nodes / self.details_per_s)


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
    TABLE_FULL = "the registry is full and its signer holds a fair share"

    @property
    def rejected(self) -> bool:
        return self not in (Verdict.ACCEPTED, Verdict.DUPLICATE)


class Eviction(enum.Enum):
    """Why a record left the table before its drop horizon (counted like drops)."""

    FAIR_SHARE = "evicted to share a full table between signers"


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
    """The node's newest record (a slim heartbeat or a full record): its liveness."""
    fresh_ms: int
    """Our clock's time this record was last known to be current."""
    details: SignedRecord | None = None
    """The node's newest full record, whose :data:`~p2p.records.DETAIL_FIELDS` readers see."""
    record: NodeRecord = field(default=None)  # type: ignore[assignment]
    """``signed``'s record with ``details``' details: what every reader uses."""

    def __post_init__(self) -> None:
        if self.record is None:
            details = self.details.record if self.details is not None else None
            object.__setattr__(self, "record", with_details(self.signed.record, details))

    def envelopes(self) -> list[SignedRecord]:
        """What a neighbour needs to hold the same entry (anti-entropy)."""
        if self.details is None or self.details is self.signed:
            return [self.signed]
        return [self.details, self.signed]


@dataclass(frozen=True)
class Table:
    entries: Mapping[NodeId, Entry] = field(default_factory=lambda: MappingProxyType({}))
    evicted: Mapping[NodeId, tuple[int, int]] = field(default_factory=lambda: MappingProxyType({}))
    """Nodes evicted to share a full table (:func:`fair_victim`), each with the highest
    ``seq`` we held of it and the time (ms) after which any record up to that ``seq`` is too
    old to apply anyway. A node forgotten at its drop horizon cannot be replayed (its records
    are too old by then); one evicted early could: a departed node's last Ready record,
    replayed once the table had room, made it Ready again. At most ``max_records`` rows."""

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, node_id: str) -> Entry | None:
        return self.entries.get(NodeId(node_id))

    @functools.cached_property
    def _by_signer(self) -> dict[PeerId, frozenset[NodeId]]:
        """The nodes each peer signs for (its own, and the legacy nodes it vouches for):
        indexed once per table, then carried to the table :func:`apply` builds from it, so a
        sync bringing thousands of new nodes stays linear."""
        index: dict[PeerId, set[NodeId]] = {}
        for node_id, entry in self.entries.items():
            index.setdefault(entry.record.peer_id, set()).add(node_id)
        return {peer: frozenset(nodes) for peer, nodes in index.items()}

    @functools.cached_property
    def _largest(self) -> tuple[int, PeerId] | None:
        """The signer holding the most records, with its count (ties: the greatest PeerId,
        so that peers holding the same nodes agree): the one that gives up a record when the
        table is full (:func:`fair_donor`). Found once per table (O(signers)), then carried
        to the tables :meth:`with_entry` builds from it, where only one signer can grow."""
        return max(((len(nodes), peer) for peer, nodes in self._by_signer.items()), default=None)

    def signed_by(self, peer_id: PeerId) -> int:
        return len(self._by_signer.get(peer_id, ()))

    def resumed(self, missed_ms: int, now_ms: int) -> Table:
        """This table with every node's freshness ``missed_ms`` later (never past ``now_ms``):
        the time this peer did not run, which is no node's silence (``GossipRegistry``'s
        pause check)."""
        entries = {node: dataclasses.replace(entry, fresh_ms=min(now_ms, entry.fresh_ms + missed_ms))
                   for node, entry in self.entries.items()}  # fmt: skip
        return Table(MappingProxyType(entries), self.evicted)

    def largest_signer(self) -> tuple[int, PeerId] | None:
        """``(records, signer)`` of the signer holding the most, or None if the table is empty."""
        return self._largest

    def nodes_signed_by(self, peer_id: PeerId) -> frozenset[NodeId]:
        return self._by_signer.get(peer_id, frozenset())

    def records_signed_by(self, peer_id: PeerId) -> list[NodeRecord]:
        """The records ``peer_id`` signs: its own node's and its legacy nodes'."""
        return [self.entries[node_id].record for node_id in self.nodes_signed_by(peer_id)]

    def with_entry(self, entry: Entry, now_ms: int | None = None) -> Table:
        """This table with ``entry`` added or replacing its node's (a node's signer never
        changes: a record is valid only from the peer its id is namespaced under), at
        ``now_ms`` (None: unknown, so the heal key changes for its model)."""
        entries = dict(self.entries)
        node_id, signer = entry.record.node_id, entry.record.peer_id
        new = node_id not in entries
        held = entries.get(node_id)
        entries[node_id] = entry
        evicted = self.evicted
        if node_id in evicted:  # back with a newer record: the entry holds its seq now
            kept = dict(evicted)  # a copy, in C
            del kept[node_id]
            evicted = MappingProxyType(kept)
        table = self._successor(entries, signer, (lambda nodes: nodes | {node_id}) if new else None, evicted)
        if "_largest" in self.__dict__:  # only ``signer`` may have grown
            grown = (table.signed_by(signer), signer)
            table.__dict__["_largest"] = grown if self._largest is None else max(self._largest, grown)
        if "_order" in self.__dict__:
            order = self._order
            if new:
                order = order.copy()  # in C
                bisect.insort(order, node_id)
            table.__dict__["_order"] = order
        if "_expiry" in self.__dict__:  # a lower bound still: only ``entry`` can fall due sooner
            liveness, due = self.__dict__["_expiry"]
            table.__dict__["_expiry"] = (liveness, min(due, _drop_ms(entry, liveness)))
        if "_heal" in self.__dict__:
            table.__dict__["_heal"] = self.__dict__["_heal"].replaced(table, held, entry, now_ms)
        return table

    def without(self, node_id: NodeId, evicted: Mapping[NodeId, tuple[int, int]] | None = None) -> Table:
        """This table less ``node_id``'s entry (the signer who held the most is found again
        when next asked: it may be the one that shrank), remembering ``evicted`` (default:
        what this table remembers)."""
        entry = self.entries.get(node_id)
        if entry is None:
            return self
        entries = dict(self.entries)
        del entries[node_id]
        table = self._successor(entries, entry.record.peer_id, lambda nodes: nodes - {node_id},
                                self.evicted if evicted is None else evicted)  # fmt: skip
        if "_expiry" in self.__dict__ and table.evicted is self.evicted:  # fewer rows: still a lower bound
            table.__dict__["_expiry"] = self.__dict__["_expiry"]
        if "_heal" in self.__dict__:
            table.__dict__["_heal"] = self.__dict__["_heal"].bumped(table, entry.record.model_id)
        return table

    def _successor(self, entries: dict[NodeId, Entry], signer: PeerId,
                   change: Callable[[frozenset[NodeId]], frozenset[NodeId]] | None,
                   evicted: Mapping[NodeId, tuple[int, int]]) -> Table:  # fmt: skip
        """A table of ``entries``, which differ from ours in one node of ``signer``'s: our
        signer index carried over if we built it (a copy, in C), with ``change`` applied to
        ``signer``'s nodes (None: they are the same nodes)."""
        table = Table(MappingProxyType(entries), evicted)
        if "_by_signer" in self.__dict__:
            index = self._by_signer
            if change is not None:
                index = dict(index)
                nodes = change(index.get(signer, frozenset()))
                if nodes:
                    index[signer] = nodes
                else:
                    del index[signer]
            table.__dict__["_by_signer"] = index
        return table

    def signed_records(self) -> list[SignedRecord]:
        return [signed for e in self.entries.values() for signed in e.envelopes()]

    @functools.cached_property
    def _order(self) -> list[NodeId]:
        """The node ids, sorted: what :meth:`views` lists in. Sorted once per table, then
        carried to the tables :meth:`with_entry` builds from it (a new node inserted)."""
        return sorted(self.entries)

    def views(self, now_ms: int, liveness: Liveness) -> Iterator[NodeView]:
        entries = self.entries
        for node_id in self._order:
            yield _view(entries[node_id], now_ms, liveness)

    def view(self, node_id: str, now_ms: int, liveness: Liveness) -> NodeView | None:
        """One node's view, without building the others' (what :meth:`views` would list)."""
        entry = self.get(node_id)
        return _view(entry, now_ms, liveness) if entry is not None else None

    def heal_key(self, model_id: ModelId, now_ms: int, liveness: Liveness) -> tuple[int | None, int]:
        """A key that stays the same only while ``model_id``'s views, as healing reads them
        (:data:`HEAL_FIELDS` and the state after ageing), stay the same: two calls, on this
        table or on tables built from it, that get equal keys saw equal views.

        The healer looks each second, and listing 4,096 records to find that nothing changed
        was ~10 ms of the event loop (scripts/bench_heal_check.py). Heartbeats, which change
        a record's counters and freshness only, keep the key; a record whose facts change, a
        node added or removed, and a node turning Degraded or Dead by silence change it. O(1)
        but when a node's state may have turned since the last call (then O(records), once)."""
        heal = self.__dict__.get("_heal")
        if heal is None or heal.liveness != liveness or not heal.since_ms <= now_ms <= heal.due_ms:
            heal = self.__dict__["_heal"] = _HealMarks.at(self, now_ms, liveness, heal)
        return heal.marks.get(model_id), heal.epoch

    def _models(self) -> set[ModelId]:
        return {entry.record.model_id for entry in self.entries.values()}


def _view(entry: Entry, now_ms: int, liveness: Liveness) -> NodeView:
    """``entry`` as :func:`effective_state` sees it at ``now_ms``. The times its state turns
    are worked out once per entry and its views kept per state: every listing (the healer's
    each second, several per chat request) builds one per record, and doing the ageing
    afresh each time was most of ~5-15 ms at 4,096 records
    (tests/test_registry.py::test_views_age_as_effective_state_does)."""
    ageing = entry.__dict__.get("_ageing")  # _ageing() and _aged_state(), inline: once per record per listing
    if ageing is None or (ageing[0] is not liveness and ageing[0] != liveness):
        ageing = _ageing(entry, liveness)
    _, degraded_ms, dead_ms, made = ageing
    state: NodeState = "Dead" if now_ms > dead_ms else "Degraded" if now_ms > degraded_ms else entry.record.state
    view = made.get(state)
    if view is None:
        view = made[state] = NodeView(entry.record, state)
    return view


def _ageing(entry: Entry, liveness: Liveness) -> tuple[Liveness, float, float, dict[NodeState, NodeView]]:
    """``entry``'s turns (:func:`_turns`) and its views by state, worked out once per entry."""
    ageing = entry.__dict__.get("_ageing")
    if ageing is None or (ageing[0] is not liveness and ageing[0] != liveness):
        ageing = entry.__dict__["_ageing"] = (liveness, *_turns(entry, liveness), {})
    return ageing


def _aged_state(entry: Entry, ageing: tuple[Liveness, float, float, object], now_ms: float) -> NodeState:
    _, degraded_ms, dead_ms, _ = ageing
    return "Dead" if now_ms > dead_ms else "Degraded" if now_ms > degraded_ms else entry.record.state


def _next_turn(entry: Entry, since_ms: float, liveness: Liveness) -> float:
    """The first time at or after ``since_ms`` that ``entry``'s state turns (inf: never)."""
    _, degraded_ms, dead_ms, _ = _ageing(entry, liveness)
    return min((t for t in (degraded_ms, dead_ms) if t >= since_ms), default=math.inf)


HEAL_FIELDS = ("model_id", "start_layer", "end_layer", "n_layers", "state", "idle", "draining", "relayed")
"""The record fields healing reads (:mod:`p2p.healing`, :func:`p2p.placement.holders`):
:meth:`Table.heal_key` changes when one of them, or a node's state after ageing, does."""

_TOKENS = itertools.count(1)
"""Every change :meth:`Table.heal_key` reports takes a new token, never reused."""


def _heal_facts(entry: Entry, now_ms: int, liveness: Liveness) -> tuple[object, ...]:
    record = entry.record
    return (*(getattr(record, name) for name in HEAL_FIELDS), _aged_state(entry, _ageing(entry, liveness), now_ms))


@dataclass(frozen=True)
class _HealMarks:
    """What :meth:`Table.heal_key` answers from: a token per model, bumped when one of its
    nodes changes for healing, and an epoch, new each time ``since_ms`` is moved. Every
    node's state after ageing is constant from ``since_ms`` to ``due_ms`` (no entry turns
    Degraded or Dead in between): a lower bound carried to the tables built from this one,
    as :func:`expire`'s is."""

    liveness: Liveness
    since_ms: float
    due_ms: float
    epoch: int
    marks: Mapping[ModelId, int]

    @classmethod
    def at(cls, table: Table, now_ms: int, liveness: Liveness, held: _HealMarks | None) -> _HealMarks:
        """``held`` brought to ``now_ms``, past its ``due_ms`` (O(records)): the same epoch if no
        entry turned since ``since_ms`` (the bound was low: the entry that set it has been
        refreshed since), else a new one from ``now_ms``; new marks if there were none."""
        marks = held.marks if held is not None else {model: next(_TOKENS) for model in table._models()}
        since = held.since_ms if held is not None and held.liveness == liveness and held.since_ms <= now_ms else None
        turned, due = since is None, math.inf
        for entry in table.entries.values():
            _, degraded_ms, dead_ms, _ = _ageing(entry, liveness)
            for turn in (degraded_ms, dead_ms):
                if turn >= now_ms:
                    due = min(due, turn)
                elif since is not None and turn >= since:
                    turned = True
        if turned or held is None:
            return cls(liveness, now_ms, due, next(_TOKENS), marks)
        return dataclasses.replace(held, due_ms=due)

    def bumped(self, table: Table, *models: ModelId) -> _HealMarks:
        """New tokens for ``models`` in ``table``. A model whose last node left keeps its row,
        so rows are rebuilt (new tokens all round) once they outnumber twice the table's
        records: a stranger cycling model ids cannot grow them."""
        marks = dict(self.marks)
        for model in models:
            marks[model] = next(_TOKENS)
        if len(marks) > 2 * len(table.entries) + 8:
            marks = {model: next(_TOKENS) for model in table._models()}
        return dataclasses.replace(self, marks=marks)

    def replaced(self, table: Table, held: Entry | None, entry: Entry, now_ms: int | None) -> _HealMarks:
        """After ``entry`` replaced ``held`` (None: a new node) at ``now_ms``: the same
        marks when both read the same for healing then, and neither turns between
        ``since_ms`` and then (so each reads the same at every time the key stood for)."""
        turn = _next_turn(entry, self.since_ms, self.liveness)
        carried = dataclasses.replace(self, due_ms=min(self.due_ms, turn))
        same = (
            held is not None and now_ms is not None and self.since_ms <= now_ms <= carried.due_ms
            and _heal_facts(held, now_ms, self.liveness) == _heal_facts(entry, now_ms, self.liveness)
        )  # fmt: skip
        if same:
            return carried
        models = (entry.record.model_id,) if held is None else (entry.record.model_id, held.record.model_id)
        return carried.bumped(table, *models)


def _turns(entry: Entry, liveness: Liveness) -> tuple[float, float]:
    """When ``entry`` turns Degraded, then Dead (:func:`effective_state`): it is, once
    ``now_ms`` is past each."""
    if entry.record.state == "Dead":
        return -math.inf, -math.inf
    liveness = liveness.for_record(entry.record)
    return entry.fresh_ms + liveness.degraded_after_s * 1000, entry.fresh_ms + liveness.dead_after_s * 1000


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
    refused = admit(table, record, now_ms, liveness, limits)
    if refused is not None:
        return table, refused
    held = table.entries.get(record.node_id)
    held_details = held.details if held is not None else None
    newer_live, newer_details = _newer(held, record)
    if not signed.verified():  # last: the only costly check
        return table, Verdict.BAD_SIGNATURE
    details = signed if newer_details else held_details
    if newer_live:
        fresh = now_ms if via == "gossip" else min(now_ms, record.ts_ms)
        entry = Entry(signed, fresh, details)
    else:
        assert held is not None
        entry = Entry(held.signed, held.fresh_ms, details)
    if held is None and len(table) >= limits.max_records:
        table = _make_room(table, record.peer_id, liveness, limits)
    return table.with_entry(entry, now_ms), Verdict.ACCEPTED


def admit(table: Table, record: Header, now_ms: int, liveness: Liveness,
          limits: RegistryLimits = RegistryLimits()) -> Verdict | None:  # fmt: skip
    """Every rule but the signature, from the header alone: the verdict refusing ``record``
    (or finding it a duplicate), or None if only its signature is left to check. A sync
    answer's records go through this before they are typed and verified, so a record that
    cannot change the table costs a header's parse, not a decode."""
    if record.ts_ms > now_ms + liveness.max_future_skew_s * 1000:
        return Verdict.FROM_THE_FUTURE
    if record.ts_ms < now_ms - liveness.for_record(record).drop_after_s * 1000:
        return Verdict.TOO_OLD
    if record.seq > record.ts_ms + limits.max_seq_lead_s * 1000:
        return Verdict.SEQ_AHEAD
    held = table.entries.get(record.node_id)
    if held is None:
        evicted = table.evicted.get(record.node_id)
        if evicted is not None and record.seq <= evicted[0]:
            return Verdict.DUPLICATE if record.seq == evicted[0] else Verdict.REPLAY
        if len(table.entries) >= limits.max_records and fair_donor(table, record.peer_id) is None:
            return Verdict.TABLE_FULL
        if table.signed_by(record.peer_id) >= limits.max_records_per_signer:
            return Verdict.SIGNER_FULL
        return None
    if any(_newer(held, record)):
        return None
    same = record.seq in (held.signed.record.seq, held.details.record.seq if held.details else -1)
    return Verdict.DUPLICATE if same else Verdict.REPLAY


def fair_donor(table: Table, signer: PeerId) -> PeerId | None:
    """Who gives up a record of a full table for a new node of ``signer``'s: the signer
    holding the most, if it holds at least two more than ``signer`` does, else nobody (the
    new node is refused, :attr:`Verdict.TABLE_FULL`).

    Identities are free, so a first-come table let 64 of them (64 records each) refuse every
    new node everywhere, for as long as their records lived (up to 2.5 hours of silence, see
    :meth:`Liveness.for_record`). Shared this way (as a stage's KV slots are,
    :mod:`node.slot_share`), a full table refuses a newcomer only while no signer holds two
    records more than the newcomer's: one record per signer takes as many identities as the
    table has rows. A lone signer never evicts its own records, and shares two apart converge
    to shares one apart, which stay put: the evicted node's next record finds its signer one
    record short of the largest, not two."""
    largest = table.largest_signer()
    if largest is None:
        return None
    count, donor = largest
    return donor if count >= table.signed_by(signer) + 2 else None


def fair_victim(table: Table, signer: PeerId) -> NodeId | None:
    """The node whose entry makes room for a new node of ``signer``'s (:func:`fair_donor`),
    or None if it is refused. O(signers) once per table, then the donor's nodes (at most
    ``max_records_per_signer``)."""
    donor = fair_donor(table, signer)
    if donor is None:
        return None
    return min(table.nodes_signed_by(donor), key=lambda node: _eviction_order(table.entries[node]))


def _eviction_order(entry: Entry) -> tuple[bool, bool, int, str]:
    """Which of a donor's nodes goes first: a legacy node it vouches for before its own node
    (a donor holds two or more, so a peer's own node, the peer itself, is never evicted), a
    departed node (Dead: kept only so that its departure is seen) before a live one, then
    the least recently refreshed (the likeliest to be gone), then by id, so that peers
    holding the same entries agree."""
    record = entry.record
    return record.node_id == record.peer_id, record.state != "Dead", entry.fresh_ms, record.node_id


def _make_room(table: Table, signer: PeerId, liveness: Liveness, limits: RegistryLimits) -> Table:
    """``table`` less the entry that a new node of ``signer``'s takes the place of, which is
    remembered in :attr:`Table.evicted`; called only once :func:`admit` found a donor and
    the record's signature verified."""
    victim = fair_victim(table, signer)
    assert victim is not None, "admit() lets a new node into a full table only if a donor holds more"
    entry = table.entries[victim]
    seq = max(signed.record.seq for signed in entry.envelopes())
    # A replayed record has ts_ms <= seq (a publisher's seq never trails its clock) and is
    # refused as too old once ts_ms is a drop horizon behind (at most the longest one).
    evicted = dict(table.evicted)  # a copy, in C: a sync may evict thousands
    evicted[victim] = (seq, seq + int(liveness.for_interval(liveness.max_heartbeat_s).drop_after_s * 1000))
    if len(evicted) > limits.max_records:  # the earliest evicted goes (expire() drops the stale)
        del evicted[next(iter(evicted))]
    return table.without(victim, MappingProxyType(evicted))


def _newer(held: Entry | None, record: Header) -> tuple[bool, bool]:
    """Whether ``record`` is newer than ``held``'s liveness record, and than its details.

    A record counts twice over: as liveness if newer than the newest record held, and (a
    full record) as details if newer than the newest full record held; a full record
    overtaken in flight by the next heartbeat still brings its details."""
    if held is None:
        return True, not record.slim
    details = held.details
    return record.seq > held.signed.record.seq, not record.slim and (details is None or record.seq > details.record.seq)


def effective_state(entry: Entry, now_ms: int, liveness: Liveness) -> NodeState:
    record = entry.record
    if record.state == "Dead":
        return "Dead"
    liveness = liveness.for_record(record)
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

    Called every second, and a pass reads every entry (~9 ms at 4,096 records beating every
    300 s, idle or not): a pass leaves on the table it returns the earliest time anything
    in it falls due, which the tables built from it carry as a lower bound
    (:meth:`Table.with_entry`), so until then this returns at once. An entry's drop comes
    ~30 of its beats after it was last refreshed: a full pass about once a minute in a small
    swarm, once in hours in a large one (tests/test_registry.py::test_expire_reads_the_table_only_when_something_may_fall_due).
    """
    bound = table.__dict__.get("_expiry")
    if bound is not None and bound[0] == liveness and now_ms <= bound[1]:
        return table
    drops = {node: _drop_ms(entry, liveness) for node, entry in table.entries.items()}
    keep = {node: entry for node, entry in table.entries.items() if drops[node] >= now_ms}
    evicted = {node: row for node, row in table.evicted.items() if row[1] >= now_ms}
    if len(keep) != len(table.entries) or len(evicted) != len(table.evicted):
        table = Table(MappingProxyType(keep), MappingProxyType(evicted))
    due = min((drops[node] for node in keep), default=math.inf)
    table.__dict__["_expiry"] = (liveness, min(due, min((row[1] for row in evicted.values()), default=math.inf)))
    return table


def _drop_ms(entry: Entry, liveness: Liveness) -> float:
    """When :func:`expire` forgets ``entry`` (it is kept while ``now_ms`` is at most this)."""
    return entry.fresh_ms + liveness.for_record(entry.record).drop_after_s * 1000


def remove(table: Table, node_id: str) -> Table:
    """Drop a node at once (admin force-deregistration on this peer)."""
    return table.without(NodeId(node_id))
