"""The registry as a service: gossip it, sync it, age it.

* Every peer publishes its own signed record on the topic ``inclavate/registry/1`` when it
  changes and as a heartbeat, plus the records of legacy nodes it vouches for. A heartbeat
  is slim (no samples, buckets, hardware...: :data:`p2p.records.DETAIL_FIELDS`); a full
  record goes out when those details changed or the samples are due, no more often than
  :class:`p2p.registry.Cadence` allows, and the heartbeat interval grows with the swarm, so
  the records a peer receives per second stay bounded (docs/ARCHITECTURE.md has the model).
* A topic validator runs the registry's own rules (:func:`p2p.registry.apply`) on every
  message, so forged, replayed or future-dated records are neither delivered nor forwarded.
* Anti-entropy (``/inclavate/registry-sync/2``): on every new connection, and every
  ``sync_interval`` with a random neighbour (up to ``sync_max_interval`` while those
  periodic pulls teach nothing), a peer asks for the neighbour's whole table, so
  a joining or reconnecting peer does not wait for heartbeats to learn the swarm. The answer
  comes in pages, smallest records first; it costs what it brings, per answer and over time
  (:mod:`p2p.sync_answer`), and a peer sends at most a few answers at once, in turns
  (:mod:`p2p.sync_serve`).
* The table is aged every second (Degraded, Dead, then dropped).

The table itself is an immutable :class:`~p2p.registry.Table` swapped on every change;
readers take ``service.table`` and never see a half-applied update.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import random
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import trio

from inclavate.types import ModelId, NodeId, PeerId
from inclavate.untrusted import DropCounter, Malformed, Reason, as_str, parse_json, read_bool, read_list
from p2p.errors import P2PError
from p2p.framing import FramedStream
from p2p.host import P2PHost
from p2p.identity import Identity
from p2p.record_schema import MAX_RECORD_BYTES, Envelope, decode_opened, fit_record, open_envelope
from p2p.records import InvalidRecord, NodeRecord, SignedRecord, details_changed, now_ms, slim_record
from p2p.registry import Cadence, Eviction, Header, Liveness, NodeView, RegistryLimits, Table, Verdict, admit, apply, expire, remove
from p2p.sync_answer import (
    DECODE_COST,
    MAX_ANSWER_BYTES,
    MAX_PAGE_BYTES,
    MAX_PAGES,
    PEEK_COST,
    SyncAnswer,
    SyncBudget,
    SyncDrop,
    answer_cost,
    answer_pages,
)
from p2p.sync_serve import SERVE_WAIT_S, ServeDrop, ServeRefused, ServeTurns
from p2p.ticks import sleep_to_tick

log = logging.getLogger(__name__)

TOPIC = "inclavate/registry/1"
SYNC_PROTOCOL = "/inclavate/registry-sync/2"
_SYNC_TIMEOUT_S = 10.0
"""For the request, and for each page of the answer after the first."""
_SYNC_FIRST_PAGE_S = SERVE_WAIT_S + _SYNC_TIMEOUT_S
"""For the first page: the neighbour may have us wait for one of its few serves."""
_SYNC_ANSWER_S = 120.0
"""For a whole answer (44 MiB at 3 MB/s), so that no neighbour holds our syncs up longer."""
_VALIDATED_KEPT = 64
"""Validated envelopes awaiting delivery (a miss only costs decoding again)."""
_DETAILS_ASK_S = 30.0
"""How often we may ask a node's owner for the details we lack (see :meth:`_ask_details`)."""
_RESYNC_ON_CONNECT_S = 30.0
"""A neighbour that connects again within this long is not synced with again: a sync answer
costs us ~1 ms of decoding per record, and reconnecting is free for the neighbour."""
AGE_PERIOD_S = 1.0
"""How often the table is aged (and the clock read for it, at the least)."""
PAUSE_MS = 2_000
"""Time between two of the ageing loop's readings beyond its period that is this peer's own
pause, not its neighbours' silence: the process stopped or swapped out, its event loop
blocked, or the wall clock stepped forward. Shorter hiccups (a loaded machine's late turns)
age records as they come; a node is Degraded only after 6 s of silence anyway."""
MAX_PAUSE_MS = 60_000
"""The most a pause moves records' freshness: after a laptop slept for hours, a node that
died meanwhile would read Ready for as long again as its liveness allows (900 s at a 300 s
heartbeat) had the whole pause been forgiven (a review, 2026-12-08)."""


class RegistryService:
    def __init__(
        self,
        host: P2PHost,
        identity: Identity,
        liveness: Liveness = Liveness(),
        *,
        sync_interval: float = 30.0,
        sync_max_interval: float = 120.0,
        clock: Callable[[], int] = now_ms,
        limits: RegistryLimits = RegistryLimits(),
        cadence: Cadence = Cadence(),
        sync_budget: SyncBudget | None = None,
    ) -> None:
        self.host = host
        self.identity = identity
        self.liveness = liveness
        self.cadence = cadence
        self.limits = limits
        self.sync_interval = sync_interval
        self.sync_max_interval = sync_max_interval
        """A periodic sync that changed nothing doubles the wait for the next one, up to this;
        one that taught something, or a connection coming or going, brings it back to
        ``sync_interval``. In an idle swarm each periodic pull (a stream, every record of the
        neighbour's table decoded and checked, both envelopes of each node) taught nothing:
        heartbeats had brought it all, and a node whose full record never came is pulled from
        its owner (``_DETAILS_ASK_S``). What waits longer: a record lost to gossip in a
        swarm that lost none before, learned within 2 minutes instead of ~30 s."""
        self._sync_period = sync_interval
        self.clock = clock
        self._last_read: int | None = None
        """The clock's last reading for ageing (:meth:`_now`), once the ageing loop runs."""
        self.table = Table()
        self._own: dict[NodeId, NodeRecord] = {}
        """Records this peer publishes: its own, and legacy nodes it vouches for."""
        self._sent_full: dict[NodeId, tuple[int, NodeRecord]] = {}
        """When each of our records was last published in full, and as what."""
        self._changed = trio.Event()
        self._banned: dict[NodeId, int] = {}
        self._asked: dict[PeerId, float] = {}
        """When we last asked a node's owner for its full record (bounded by the table)."""
        self._synced_on_connect: dict[PeerId, float] = {}
        """When we last synced with a neighbour because it connected (bounded by the table)."""
        self._syncing = trio.Lock()
        self._serving = ServeTurns()
        """Who gets one of the few answers we send at once, and for how long."""
        self.sync_budget = sync_budget or SyncBudget.for_limits(limits)
        """The decode work all syncs together may make us do (:mod:`p2p.sync_answer`)."""
        self._nursery: trio.Nursery | None = None
        self._validated: dict[bytes, SignedRecord] = {}
        """Envelopes the gossip validator accepted, by their bytes, until delivered (bounded)."""
        self.drops = DropCounter()
        """Rejected inputs by fixed reason code (exposed for tests and diagnostics)."""
        self.refresh: Callable[[NodeRecord], NodeRecord] | None = None
        """Called before each heartbeat to update counters in our own record."""

    # --------------------------------------------------------------- reading

    def views(self) -> list[NodeView]:
        now = self._now()  # first: it may move the table on (a pause)
        return list(self.table.views(now, self.liveness))

    def view(self, node_id: NodeId) -> NodeView | None:
        """One node's view: what a hot path asks instead of listing the whole registry."""
        now = self._now()
        return self.table.view(node_id, now, self.liveness)

    def heal_key(self, model_id: ModelId) -> tuple[int | None, int]:
        """Changes whenever ``model_id``'s views may read differently to the healer
        (:meth:`p2p.registry.Table.heal_key`): while it stands, the healer's last look holds."""
        now = self._now()
        return self.table.heal_key(model_id, now, self.liveness)

    def own(self, node_id: NodeId) -> NodeRecord | None:
        """The latest version of a record this peer publishes."""
        return self._own.get(node_id)

    async def wait_changed(self) -> None:
        await self._changed.wait()

    def heartbeat_s(self) -> float:
        """This peer's heartbeat interval, from the size of its table."""
        return self.cadence.heartbeat_s(len(self.table), self.liveness)

    # --------------------------------------------------------------- writing

    async def publish(self, record: NodeRecord) -> NodeRecord:
        """Sign and publish one of our records (bumping its sequence number) now: in full if
        its details are due (:meth:`_full_due`), else as a slim heartbeat."""
        previous = self._own.get(record.node_id)
        ts = self.clock()
        seq = max(ts, previous.seq + 1 if previous else 0, record.seq + 1)
        record = record.replace(seq=seq, ts_ms=ts, peer_id=self.identity.peer_id, slim=False,
                                heartbeat_ms=round(self.heartbeat_s() * 1000))  # fmt: skip
        fitted = fit_record(record, MAX_RECORD_BYTES)
        if fitted is not record:
            log.warning("the record of %s outgrew %d bytes; published it without its oldest metrics",
                        record.node_id, MAX_RECORD_BYTES)  # fmt: skip
            record = fitted
        full = self._full_due(record, ts)
        signed = SignedRecord.sign(record if full else slim_record(record), self.identity)
        try:  # what every receiver will do with it: refuse here, loudly, rather than there
            SignedRecord.decode(signed.encode())
        except InvalidRecord as exc:
            log.warning("not publishing the record of %s: receivers would refuse it (%s)", record.node_id, exc)
            raise
        self._own[record.node_id] = record
        if full:
            self._sent_full[record.node_id] = (ts, record)
        verdict = self._accept(signed, "gossip")
        if verdict.rejected:  # every receiver would refuse it too: never fail silently
            log.warning("our own record of %s is refused by the registry rules: %s", record.node_id, verdict.value)
        try:
            await self.host.publish(TOPIC, signed.encode())
        except P2PError as exc:  # nobody subscribed yet, or a transient failure
            log.debug("publishing %s failed: %s", record.node_id, exc)
        return record

    def _full_due(self, record: NodeRecord, now: int) -> bool:
        """A full record: the first, then when details other than the samples changed (no
        sooner than the cadence's spacing after the last one), or when the samples moved
        and the longer refresh spacing has passed."""
        sent = self._sent_full.get(record.node_id)
        if sent is None:
            return True
        at, last = sent
        nodes = len(self.table)
        for refresh in (False, True):
            spacing_ms = self.cadence.details_spacing_s(nodes, refresh=refresh) * 1000
            if now - at >= spacing_ms and details_changed(record, last, samples=refresh):
                return True
        return False

    def remember(self, record: NodeRecord) -> NodeRecord:
        """Update one of our records for the next heartbeat, without publishing now."""
        self._own[record.node_id] = record
        return record

    async def withdraw(self, node_id: NodeId) -> None:
        """Publish a relayed node's departure and stop vouching for it, even when the
        departure cannot be published: a record kept here after a refused publish was
        republished, and refused, on every heartbeat for the life of the peer, its node gone
        from the legacy table (no leave could reach it) and its id taken."""
        record = self._own.get(node_id)
        if record is None:
            return
        try:
            await self.publish(record.replace(state="Dead"))
        except InvalidRecord:
            pass  # ``publish`` said why; unannounced, the record ages out like a silent peer's
        finally:
            self.stop_vouching(node_id)

    def forget(self, node_id: str) -> None:
        """Drop a node from this peer's table at once (it comes back if it publishes again)."""
        self._set_table(remove(self.table, node_id))

    def ban(self, node_id: str, seconds: float) -> None:
        """Drop a node and ignore its records for ``seconds`` (admin force-deregistration:
        the node is not told, so it keeps publishing for a while)."""
        self._banned[NodeId(node_id)] = self.clock() + int(seconds * 1000)
        self._own.pop(NodeId(node_id), None)
        self._sent_full.pop(NodeId(node_id), None)
        self.forget(node_id)

    def stop_vouching(self, node_id: str) -> None:
        """Stop republishing a relayed node's record without announcing anything: its record
        ages to Degraded and Dead like a peer that went silent."""
        self._own.pop(NodeId(node_id), None)
        self._sent_full.pop(NodeId(node_id), None)

    def _is_banned(self, node_id: str) -> bool:
        until = self._banned.get(NodeId(node_id))
        if until is None:
            return False
        if until < self.clock():
            del self._banned[NodeId(node_id)]
            return False
        return True

    # --------------------------------------------------------------- running

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self.host.set_topic_validator(TOPIC, self._validate)
        # A neighbour syncs once per connection (at most every 30 s): 2 at a time.
        self.host.set_stream_handler(SYNC_PROTOCOL, self._serve_sync, max_frame_size=MAX_PAGE_BYTES,
                                     max_streams_per_peer=2)
        messages = await self.host.subscribe(TOPIC)
        events = self.host.connection_events()
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._receive, messages)
            nursery.start_soon(self._heartbeat)
            nursery.start_soon(self._age)
            nursery.start_soon(self._sync_on_connect, events, nursery)
            nursery.start_soon(self._sync_periodically)
            for peer in self.host.connected_peers():
                nursery.start_soon(self.sync_with, peer)
            task_status.started()

    async def _receive(self, messages: trio.MemoryReceiveChannel[Any]) -> None:
        async with messages:
            async for message in messages:
                self._take(message.data, "gossip")

    async def _heartbeat(self) -> None:
        while True:
            await sleep_to_tick(self.heartbeat_s())
            for node_id, record in list(self._own.items()):
                if record.state == "Dead":
                    continue
                try:
                    if node_id == self.identity.peer_id and self.refresh is not None:
                        record = self.refresh(record)
                    await self.publish(record)
                except Exception:  # one bad record (a legacy node's) must not stop the others
                    log.exception("the heartbeat of %s failed; retrying next beat", node_id)

    async def _age(self) -> None:
        self._last_read = self.clock()  # read every second from now on: a longer gap is a pause
        while True:
            await sleep_to_tick(AGE_PERIOD_S)
            now = self._now()
            self._set_table(expire(self.table, now, self.liveness), notify=True)

    def _now(self) -> int:
        """The clock, for ageing records: first, if this peer did not run for a while
        (:data:`PAUSE_MS`), every record's freshness moves past that time. An entry stopped
        for 8 s (SIGSTOP, swapped out, a laptop's lid) found every hop Degraded when it
        woke, heard nothing for 6 s by its own clock, and failed all its sessions over onto
        other routes, blaming healthy peers (an audit, 2026-12-08)."""
        now = self.clock()
        last = self._last_read
        if last is None:  # the ageing loop is not running (a registry read in a test)
            return now
        self._last_read = now  # a clock set back: pauses are seen again from here
        missed = now - last - round(AGE_PERIOD_S * 1000)
        if missed > PAUSE_MS:
            log.info("this peer did not run for %.1f s: the registry's records age from now", missed / 1000)
            self._set_table(self.table.resumed(min(missed, MAX_PAUSE_MS), now), notify=True)
        return now

    async def _sync_on_connect(self, events: trio.MemoryReceiveChannel[Any], nursery: trio.Nursery) -> None:
        async with events:
            async for event in events:
                self._sync_period = self.sync_interval  # who holds what may have changed
                if event.connected and self._may_sync_on_connect(event.peer):
                    nursery.start_soon(functools.partial(self.sync_with, event.peer, prompted=True))

    def _may_sync_on_connect(self, peer: PeerId) -> bool:
        now = trio.current_time()
        if now - self._synced_on_connect.get(peer, -_RESYNC_ON_CONNECT_S) < _RESYNC_ON_CONNECT_S:
            return False
        if len(self._synced_on_connect) >= self.limits.max_records:
            self._synced_on_connect.clear()
        self._synced_on_connect[peer] = now
        return True

    async def _sync_periodically(self) -> None:
        while True:
            await trio.sleep(self._sync_period * random.uniform(0.75, 1.25))
            peers = self.host.connected_peers()
            if peers:
                self.synced(await self.sync_with(random.choice(peers)))

    def synced(self, accepted: int) -> None:
        """A periodic sync's outcome: the next one comes sooner if it taught something."""
        self._sync_period = self.sync_interval if accepted else min(2 * self._sync_period, self.sync_max_interval)

    # ---------------------------------------------------------- anti-entropy

    async def sync_with(self, peer: PeerId, *, prompted: bool = False) -> int:
        """Pull ``peer``'s whole table; returns how many records changed ours. ``prompted``:
        a neighbour's doing, not our choice (see :meth:`SyncBudget.may_ask`).

        Never raises: whatever the neighbour answers (or does not) is confined here, since
        this runs in the service's nursery, where one escaping error would end the peer."""
        try:
            return await self._pull(peer, prompted)
        except Exception:  # a bug must cost one sync, never the peer
            self.drops.count(Reason.HANDLER_FAILED)
            log.exception("registry sync with %s failed unexpectedly", peer)
            return 0

    async def _pull(self, peer: PeerId, prompted: bool) -> int:
        async with self._syncing:
            if not self.sync_budget.may_ask(prompted=prompted):
                self.drops.count(SyncDrop.BUDGET_SPENT)
                return 0
            return await self._pull_one(peer)

    async def _pull_one(self, peer: PeerId) -> int:
        answer = self._new_answer()
        try:
            with trio.move_on_after(_SYNC_ANSWER_S):
                stream = await self.host.new_stream(peer, SYNC_PROTOCOL, timeout=5.0, max_frame_size=MAX_PAGE_BYTES)
                async with stream:
                    await stream.send(b"{}", timeout=5.0)
                    await self._take_pages(_pages_of(stream), peer, answer)
        except P2PError as exc:
            log.debug("registry sync with %s failed: %s", peer, exc)
        return answer.accepted

    async def take_answer(self, pages: Iterable[bytes], peer: PeerId) -> int:
        """Apply ``peer``'s sync answer, already received, as :meth:`_pull_one` applies one
        as it arrives; returns how many records changed our table."""
        answer = self._new_answer()
        await self._take_pages(_iterate(pages), peer, answer)
        return answer.accepted

    async def _take_pages(self, pages: AsyncIterator[bytes], peer: PeerId, answer: SyncAnswer) -> None:
        """Apply an answer's pages in turn until one says it is the last, up to
        :data:`MAX_ANSWER_BYTES` and :data:`MAX_PAGES` in all; readers of the table are told
        once, at the end."""
        read = count = 0
        try:
            async with contextlib.aclosing(pages):  # stopped early, it is closed here, not by the GC
                async for page in pages:
                    read, count = read + len(page), count + 1
                    if read > MAX_ANSWER_BYTES or count > MAX_PAGES:
                        answer.stopped = SyncDrop.ANSWER_TOO_LARGE
                        self._stopped_reading(answer, peer)
                        return
                    if not await self._take_page(page, peer, answer):
                        return
        finally:
            if answer.accepted:
                self._notify()

    def _new_answer(self) -> SyncAnswer:
        return SyncAnswer({signed.encode() for signed in self.table.signed_records()}, self.sync_budget)

    async def _take_page(self, payload: bytes, peer: PeerId, answer: SyncAnswer) -> bool:
        """Apply one page of ``peer``'s answer as far as the budget and the answer's own
        refusals allow (:mod:`p2p.sync_answer`); True if more pages are worth reading."""
        if not answer.pay(answer_cost(len(payload))):
            self._stopped_reading(answer, peer)
            return False
        try:
            body = parse_json(payload, max_bytes=MAX_PAGE_BYTES, max_depth=2)
            envelopes = read_list(body, "records", max_len=2 * self.limits.max_records)  # liveness + details
            more = read_bool(body, "more", default=False)
        except Malformed as exc:
            self.drops.count(exc.reason)
            log.info("registry sync with %s: malformed answer (%s)", peer, exc)
            return False
        # A checkpoint between records: an answer of thousands of records must not hold the
        # event loop (forward frames, heartbeats) for the seconds its decoding takes.
        for envelope in envelopes:
            await trio.lowlevel.checkpoint()
            answer.accepted += self._take_synced(envelope, answer) is Verdict.ACCEPTED
            if answer.stopped is not None:
                self._stopped_reading(answer, peer)
                return False
        return more

    def _stopped_reading(self, answer: SyncAnswer, peer: PeerId) -> None:
        assert answer.stopped is not None
        self.drops.count(answer.stopped)
        log.info("registry sync with %s: stopped reading its answer (%s)", peer, answer.stopped.value)

    def _take_synced(self, envelope: Any, answer: SyncAnswer) -> Verdict | None:
        """One record of a sync answer, cheapest check first: held verbatim or repeated (a
        set lookup), then its header against the table's rules (a plain parse), and only
        then typed and verified. Whatever is refused counts against the answer."""
        try:
            data = as_str(envelope, "records", max_len=MAX_PAGE_BYTES).encode()
        except Malformed as exc:
            self.drops.count(exc.reason)
            answer.refuse()
            return None
        if answer.holds(data):
            return Verdict.DUPLICATE
        if not answer.first_sight(data):
            self.drops.count(Verdict.DUPLICATE)
            return Verdict.DUPLICATE
        if not answer.pay(PEEK_COST):
            return None
        try:
            opened = open_envelope(data)
            refused = self._admit(opened.header(), answer)
        except InvalidRecord as exc:
            self.drops.count(exc.reason)
            answer.refuse()
            return None
        if refused is not None:
            if refused is not Verdict.DUPLICATE:
                answer.refuse()
            return refused
        if not answer.pay(DECODE_COST):
            return None
        verdict = self._take_opened(opened)
        if verdict is not Verdict.ACCEPTED:
            answer.refuse()
        return verdict

    def _admit(self, header: Header, answer: SyncAnswer) -> Verdict | SyncDrop | None:
        """What the table's rules say of a record from its header alone (counted if refused),
        or None if it is worth typing and verifying."""
        verdict = self._on_header(header)
        if verdict is None and not answer.node_turn(header.node_id):
            self.drops.count(SyncDrop.NODE_REPEATED)
            return SyncDrop.NODE_REPEATED
        return verdict

    async def _serve_sync(self, stream: FramedStream, remote: PeerId) -> None:
        """Send our table in pages (:func:`p2p.sync_answer.answer_pages`), smallest records
        first, when :class:`p2p.sync_serve.ServeTurns` gives ``remote`` a turn: a few
        answers at a time in all, since any number of identities may ask. Honest records
        are 1-8 KB, and whoever bloats the table does it with large ones, which then come
        last, where the asker's byte cap (or the end of a turn) stops the answer."""
        await stream.receive(timeout=5.0)  # before a slot is taken: a silent asker holds none
        try:
            async with self._serving.turn(remote) as turn:
                with turn:
                    await self._send_answer(stream)
                if turn.cancelled_caught:
                    self.drops.count(ServeDrop.TURN_OVER)
                    await stream.reset()
        except ServeRefused as refused:
            self.drops.count(refused.reason)
            await stream.reset()

    async def _send_answer(self, stream: FramedStream) -> None:
        """The pages of our table, each within the per-page timeout (the least rate an asker
        must read at) and all within the asker's own limit (it stops reading then)."""
        try:
            with trio.fail_after(_SYNC_ANSWER_S):
                envelopes = sorted((signed.encode() for signed in self.table.signed_records()), key=len)
                for page in answer_pages(envelopes):
                    await stream.send(page, timeout=_SYNC_TIMEOUT_S)
        except trio.TooSlowError:
            await stream.reset()

    # -------------------------------------------------------------- internals

    def _remember_validated(self, data: bytes, signed: SignedRecord) -> None:
        self._validated[data] = signed
        while len(self._validated) > _VALIDATED_KEPT:
            del self._validated[next(iter(self._validated))]

    def _take(self, data: bytes, via: str, *, notify: bool = True) -> Verdict | None:
        """Decode and apply one envelope from the network; a failure stays with it.

        Every gossiped message is validated, then delivered: what the validator typed and
        verified a moment ago is taken as it is, and a record its header refused or found a
        duplicate is not typed here either (typing and the signature are what a received
        record costs)."""
        return self._confined(lambda: self._take_now(data, via, notify))

    def _take_now(self, data: bytes, via: str, notify: bool) -> Verdict:
        validated = self._validated.pop(data, None)
        if validated is not None:
            return self._accept(validated, via, notify=notify)
        opened = open_envelope(data)
        early = self._on_header(opened.header())
        if early is not None:
            return early
        return self._accept(decode_opened(opened), via, notify=notify)

    def _take_opened(self, opened: Envelope) -> Verdict | None:
        """Type, verify and apply a sync answer's record whose header the rules admitted."""
        return self._confined(lambda: self._accept(decode_opened(opened), "sync", notify=False))

    def _confined(self, take: Callable[[], Verdict]) -> Verdict | None:
        """``take()``'s verdict; a record that fails to decode, or a bug, costs that record."""
        try:
            return take()
        except InvalidRecord as exc:
            self.drops.count(exc.reason)
        except Exception:  # a bug must cost one record, never the peer
            self.drops.count(Reason.HANDLER_FAILED)
            log.exception("a registry record could not be handled; dropped")
        return None

    def _on_header(self, header: Header) -> Verdict | None:
        """The verdict of the table's rules (and bans) on a record's header, counted if it
        refuses the record, or None if only its typing and signature are left to check."""
        if self._is_banned(header.node_id):
            verdict: Verdict | None = Verdict.BANNED
        else:
            now = self._now()
            verdict = admit(self.table, header, now, self.liveness, self.limits)
        if verdict is not None and verdict.rejected:
            self.drops.count(verdict)
        return verdict

    def _validate(self, origin: PeerId, data: bytes) -> bool:
        """Gossip's check before a message is delivered or forwarded: the header first (a
        plain parse), so a stale, replayed or over-quota record, the ones a stranger can
        send without limit, is refused without typing or verifying it."""
        try:
            opened = open_envelope(data)
            early = self._on_header(opened.header())
            if early is not None:
                if early.rejected:
                    log.debug("rejected a record from %s: %s", origin, early.value)
                return not early.rejected
            signed = decode_opened(opened)
        except InvalidRecord as exc:
            self.drops.count(exc.reason)
            return False
        now = self._now()
        _, verdict = apply(self.table, signed, now, self.liveness, limits=self.limits)
        if verdict.rejected:
            self.drops.count(verdict)
            log.debug("rejected a record from %s: %s", origin, verdict.value)
            return False
        self._remember_validated(data, signed)
        return True

    def _accept(self, signed: SignedRecord, via: str, *, notify: bool = True) -> Verdict:
        if self._is_banned(signed.record.node_id):
            return Verdict.BANNED
        now = self._now()
        table, verdict = apply(self.table, signed, now, self.liveness, via, self.limits)  # type: ignore[arg-type]
        if verdict is Verdict.ACCEPTED:
            if len(table) == len(self.table) and self.table.get(signed.record.node_id) is None:
                self.drops.count(Eviction.FAIR_SHARE)  # a new node, and no more rows: one made room
            self._set_table(table, notify)
            self._ask_details(table, signed.record)
        elif verdict.rejected:
            self.drops.count(verdict)
        return verdict

    def _ask_details(self, table: Table, record: NodeRecord) -> None:
        """A heartbeat of a node whose full record we never got (we joined after it was
        gossiped, and the neighbour we synced from lacked it too): pull the owner's table,
        at most once per ``_DETAILS_ASK_S`` per owner, and only from an owner we are
        connected to, so strangers' heartbeats cannot make us dial anyone. Per owner, not per
        node: one pull brings all of its nodes' details, and an owner vouching for 64 legacy
        nodes made us pull its table 64 times over."""
        entry = table.get(record.node_id)
        if entry is None or entry.details is not None or self._nursery is None:
            return
        owner = PeerId(record.peer_id)
        now = trio.current_time()
        if now - self._asked.get(owner, -_DETAILS_ASK_S) < _DETAILS_ASK_S:
            return
        if not self.host.is_connected(owner):
            return
        if len(self._asked) >= self.limits.max_records:
            self._asked.clear()
        self._asked[owner] = now
        self._nursery.start_soon(functools.partial(self.sync_with, owner, prompted=True))

    def _set_table(self, table: Table, notify: bool = True) -> None:
        if table is self.table:
            return
        self.table = table
        if notify:
            self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()


async def _pages_of(stream: FramedStream) -> AsyncIterator[bytes]:
    """A sync answer's pages as they arrive (the reader stops at the last one); the first
    may wait for a turn at the neighbour (:data:`_SYNC_FIRST_PAGE_S`)."""
    yield await stream.receive(timeout=_SYNC_FIRST_PAGE_S)
    while True:
        yield await stream.receive(timeout=_SYNC_TIMEOUT_S)


async def _iterate(pages: Iterable[bytes]) -> AsyncIterator[bytes]:
    for page in pages:
        yield page
