"""What reading a registry-sync answer may cost us: per answer, and per unit of time.

We ask every neighbour that connects for its whole table, so a stranger chooses the answer,
and identities are free. An answer's records are therefore read cheapest check first
(:meth:`p2p.gossip.RegistryService._take_synced`): records we hold verbatim, or that repeat in
the answer, cost a set lookup; the others are opened and their header read (a plain parse,
~1/7 of typing a record), and only those the registry's rules would accept on the header
(:func:`p2p.registry.admit`) are typed and verified. On top of that:

* **per answer**: an honest answer names each node at most twice (its full record and its
  heartbeat), and its records are ones we hold, lack, or hold older, so a few refusals at
  most; after :data:`MAX_REFUSALS` refused records the rest of the answer is not read;
* **over time**: :class:`SyncBudget`, a token bucket in units of one header read (~150 us);
  typing and verifying costs :data:`DECODE_COST` more, and the answer itself (its parse)
  one unit per :data:`ANSWER_BYTES_PER_UNIT`. It holds what a newcomer pulling a full table
  needs, and refills that in :data:`REFILL_S`; a spent budget stops the answer being read,
  and no sync is asked for until the budget could pay for the largest answer. Gossip does
  not draw on it.
"""

from __future__ import annotations

import enum
import json
import time
from collections.abc import Callable, Iterable, Iterator

from inclavate.types import NodeId
from p2p.registry import RegistryLimits

MAX_ANSWER_BYTES = 64 * 1024 * 1024
"""The most of one sync answer read (4,096 nodes' full records and heartbeats take ~44 MiB);
the rest of a larger one is not."""
PAGE_BYTES = 512 * 1024
"""An answer is sent in pages of about this much, each its own frame."""
MAX_PAGE_BYTES = 2 * 1024 * 1024
"""A page's frame limit: one record at its largest (a 256 KiB envelope whose every byte JSON
escapes as ``\\u00XX``: 1.5 MiB) fits in one page."""
MAX_PAGES = 2 * MAX_ANSWER_BYTES // PAGE_BYTES
"""Pages of one answer read at most (an honest one of 64 MiB has ~128): an answer of empty
pages costs its sender a few bytes each, and us a unit of the budget each."""
ANSWER_BYTES_PER_UNIT = 32 * 1024
"""Parsing an answer costs ~6 ms per MiB on the 2-core VM: one unit per 32 KiB is ~1.3x that."""
PEEK_COST = 1
"""Opening an envelope and reading its header (~150 us for an 8 KB full record on the 2-core VM)."""
DECODE_COST = 6
"""Typing the record and checking its signature, on top of the header (~900 us for the same)."""
MAX_REFUSALS = 64
"""Refused records after which an answer is abandoned."""
MAX_ENVELOPES_PER_NODE = 2
"""A node's full record and its newer heartbeat (:meth:`p2p.registry.Entry.envelopes`)."""
REFILL_S = 600.0
"""How long the budget takes to refill from empty."""


class SyncDrop(enum.Enum):
    """Why (part of) a sync answer was not read (drop-counter keys)."""

    NODE_REPEATED = "node_repeated_in_answer"
    """A third envelope of one node in one answer: no honest table holds it."""
    ANSWER_ABANDONED = "sync_answer_abandoned"
    """The answer had refused :data:`MAX_REFUSALS` records: the rest was not read."""
    BUDGET_SPENT = "sync_budget_spent"
    """The sync budget was spent: the rest of the answer was not read, or none was asked for."""
    ANSWER_TOO_LARGE = "sync_answer_too_large"
    """The answer went on past :data:`MAX_ANSWER_BYTES` or :data:`MAX_PAGES`: the rest was
    not read."""


class SyncBudget:
    """A token bucket of the decode work all registry syncs together may make us do.

    ``capacity`` units are there at start and refill linearly in ``refill_s``. Its default
    (:meth:`for_limits`) is a newcomer's first pull of a full table (every node's full
    record and heartbeat, typed and verified) with a quarter to spare, so an honest join
    never waits on it, while a stream of strangers' answers gets at most ``capacity`` per
    ``refill_s`` (the bound in docs/ARCHITECTURE.md, "Threat model"; the runs that measured
    it in docs/SECURITY-LOG.md, "A sync answer is work we asked for")."""

    def __init__(self, capacity: int, refill_s: float = REFILL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity = capacity
        self.rate = capacity / refill_s
        self.clock = clock
        self._tokens = float(capacity)
        self._at: float | None = None
        self.spent = 0
        """Units spent since start (for tests and diagnostics)."""

    @classmethod
    def for_limits(cls, limits: RegistryLimits) -> SyncBudget:
        full_table = 2 * limits.max_records * (PEEK_COST + DECODE_COST)
        return cls(full_table * 5 // 4)

    def may_ask(self, *, prompted: bool = False) -> bool:
        """Whether a sync may be asked for: the budget could pay for the largest answer's
        parse (an eighth of the budget, if that is less), so every answer we ask for is read.

        A sync a neighbour prompted (by connecting, or by gossiping a node whose details we
        lack) leaves half the budget untouched: fresh identities connecting one after the
        other could otherwise keep it spent, and with it the syncs we choose (joining
        through a bootstrap peer, the periodic one), for as long as they kept at it."""
        floor = min(self.capacity // 8, answer_cost(MAX_ANSWER_BYTES))
        return self.left() >= floor + (self.capacity // 2 if prompted else 0)

    def _refill(self) -> None:
        now = self.clock()
        if self._at is not None:
            self._tokens = min(self.capacity, self._tokens + (now - self._at) * self.rate)
        self._at = now

    def left(self) -> float:
        self._refill()
        return self._tokens

    def spend(self, units: int) -> bool:
        """Take ``units``; False (and nothing taken) if fewer are left."""
        if self.left() < units:
            return False
        self._tokens -= units
        self.spent += units
        return True


def answer_pages(envelopes: Iterable[bytes]) -> Iterator[bytes]:
    """The frames of a sync answer, ``{"records": [envelope, ...], "more": bool}``, each
    page built only when the one before it has been taken.

    Why pages: an answer in one frame held the whole table, encoded (~3x its size at the
    peak), for every asker at once, and a table bloated with records padded to the limit
    outgrew any frame an asker would take, so no peer could sync at all."""
    page: list[str] = []
    size = 0
    for envelope in envelopes:
        item = json.dumps(envelope.decode())
        if page and size + len(item) > PAGE_BYTES:
            yield _page(page, more=True)
            page, size = [], 0
        page.append(item)
        size += len(item) + 1
    yield _page(page, more=False)


def _page(items: list[str], *, more: bool) -> bytes:
    return f'{{"records":[{",".join(items)}],"more":{"true" if more else "false"}}}'.encode()


def answer_cost(size: int) -> int:
    """What parsing an answer of ``size`` bytes costs, in budget units (at least one)."""
    return 1 + size // ANSWER_BYTES_PER_UNIT


class SyncAnswer:
    """What one answer has cost so far, and whether the rest of it is still worth reading."""

    def __init__(self, held: set[bytes], budget: SyncBudget) -> None:
        self.held = held
        """The envelopes we hold, as we would send them (and so as the neighbour does)."""
        self.budget = budget
        self.refusals = 0
        self.accepted = 0
        """Records of this answer that changed our table."""
        self.stopped: SyncDrop | None = None
        self._seen: set[bytes] = set()
        self._per_node: dict[NodeId, int] = {}

    def holds(self, data: bytes) -> bool:
        """Whether we hold ``data`` verbatim: the bulk of an honest answer, for a lookup."""
        return data in self.held

    def first_sight(self, data: bytes) -> bool:
        """Whether ``data`` is not a repeat of an envelope earlier in this answer."""
        if data in self._seen:
            return False
        self._seen.add(data)
        return True

    def node_turn(self, node_id: NodeId) -> bool:
        """Whether ``node_id`` may have one more envelope of this answer typed and verified."""
        count = self._per_node.get(node_id, 0) + 1
        self._per_node[node_id] = count
        return count <= MAX_ENVELOPES_PER_NODE

    def pay(self, units: int) -> bool:
        """Spend ``units`` of the budget; a spent budget stops the answer."""
        if self.budget.spend(units):
            return True
        self.stopped = SyncDrop.BUDGET_SPENT
        return False

    def refuse(self) -> None:
        """One more refused record; at :data:`MAX_REFUSALS` the answer stops."""
        self.refusals += 1
        if self.refusals >= MAX_REFUSALS:
            self.stopped = SyncDrop.ANSWER_ABANDONED
