"""A neighbour's answer to our registry sync (``/inclavate/registry-sync/2``) is hostile input
we asked for: we ask on every connection, so a stranger can make us read one as often as it
reconnects, and identities are free. What it may cost us is bounded: records repeated in one
answer are decoded once, a long answer is applied with the event loop still turning, and a
reconnecting neighbour is not asked again at once; records we hold verbatim, stale ones and
ones the quotas refuse are never typed nor verified, an answer that keeps being refused is
abandoned, and all answers together type and verify no more than the sync budget. Gossip
reads the header first as well.

Work is counted where it is done (the schema typing a record, a signature checked), never
timed."""

from __future__ import annotations

import contextlib
import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self

import pytest
import trio
import trio.testing
from registry_helpers import signed

from inclavate.types import PeerId
from p2p import gossip, record_schema
from p2p import records as records_module
from p2p.errors import P2PError
from p2p.framing import FramedStream
from p2p.gossip import RegistryService
from p2p.identity import Identity
from p2p.records import SignedRecord, legacy_node_id, slim_record
from p2p.registry import Liveness, RegistryLimits, Verdict
from p2p.sync_answer import MAX_PAGE_BYTES, MAX_PAGES, SyncDrop, answer_pages
from p2p.sync_serve import SERVE_WAIT_S, SERVES_AT_ONCE, WAITING_AT_ONCE, ServeDrop, ServeRefused, ServeTurns

NOW = 1_000_000
ME, MALLORY = Identity.generate(), Identity.generate()


class _Answer:
    """A sync stream whose far end answers ``pages``, one frame each."""

    def __init__(self, pages: list[bytes]) -> None:
        self.pages = list(pages)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:  # fmt: skip
        return None

    async def send(self, data: bytes, timeout: float) -> None:
        return None

    async def receive(self, timeout: float) -> bytes:
        await trio.lowlevel.checkpoint()
        return self.pages.pop(0)


def _pages(records: list[str]) -> list[bytes]:
    """An answer of ``records`` in their order, in pages as a peer sends them."""
    return list(answer_pages(r.encode() for r in records))


class _Neighbour:
    """A host whose every neighbour answers a sync with ``records`` (then with each of
    ``more`` in turn, the last one for ever)."""

    def __init__(self, records: list[str], *more: list[str]) -> None:
        self.answers = [_pages(r) for r in (records, *more)]
        self.asked = 0

    async def new_stream(self, peer: PeerId, protocol: str, *, timeout: float, max_frame_size: int) -> _Answer:
        self.asked += 1
        return _Answer(self.answers[min(self.asked, len(self.answers)) - 1])

    def is_connected(self, peer: PeerId) -> bool:
        return False


def _service(host: object, limits: RegistryLimits | None = None) -> RegistryService:
    return RegistryService(host, ME, Liveness(), clock=lambda: NOW, limits=limits or RegistryLimits())  # type: ignore[arg-type]


@dataclass
class _Work:
    typed: int = 0
    """Records the schema typed (a full parse and every field read)."""
    verified: int = 0
    """Signatures checked."""


@pytest.fixture
def work(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Work]:
    """Counts the costly part of taking a record, wherever the code under test does it."""
    counted = _Work()
    decode_record, verify = record_schema.decode_record, records_module.verify

    def typing(data: Any) -> Any:
        counted.typed += 1
        return decode_record(data)

    def verifying(peer_id: str, data: bytes, signature: bytes) -> bool:
        counted.verified += 1
        return verify(peer_id, data, signature)

    monkeypatch.setattr(record_schema, "decode_record", typing)
    monkeypatch.setattr(records_module, "verify", verifying)
    yield counted


def _wire(record: SignedRecord) -> str:
    return record.encode().decode()


def _legacy(signer: Identity, name: str, seq: int = NOW, **fields: Any) -> SignedRecord:
    return signed(signer, 0, 10, node_id=legacy_node_id(signer.peer_id, name), relayed=True, seq=seq, ts_ms=NOW, **fields)


def _holding(service: RegistryService, held: list[SignedRecord]) -> None:
    for record in held:
        assert service._accept(record, "gossip") is Verdict.ACCEPTED


async def _pull_counting_turns(service: RegistryService) -> tuple[int, int]:
    """(records accepted, turns another task got while the answer was applied)."""
    turns = 0
    async with trio.open_nursery() as nursery:

        async def other_work() -> None:
            nonlocal turns
            while True:
                await trio.lowlevel.checkpoint()
                turns += 1

        nursery.start_soon(other_work)
        accepted = await service.sync_with(MALLORY.peer_id)
        nursery.cancel_scope.cancel()
    return accepted, turns


async def test_a_record_repeated_in_a_sync_answer_is_decoded_once(work: _Work) -> None:
    one = signed(MALLORY, 0, 10, seq=NOW, ts_ms=NOW).encode().decode()
    service = _service(_Neighbour([one] * 2000))
    accepted, _ = await _pull_counting_turns(service)
    assert (accepted, work.typed) == (1, 1)
    assert service.drops[Verdict.DUPLICATE] == 1999


async def test_a_long_sync_answer_leaves_the_event_loop_turning() -> None:
    """Before, the whole answer was decoded and applied in one turn: thousands of records
    from throw-away signers held every other task (forward frames, heartbeats) for seconds."""
    records = [signed(MALLORY, 0, 10, node_id=legacy_node_id(MALLORY.peer_id, f"n{i}"), relayed=True,
                      seq=NOW, ts_ms=NOW).encode().decode() for i in range(60)]  # fmt: skip
    for _ in range(4):
        signer = Identity.generate()
        records += [signed(signer, 0, 10, seq=NOW, ts_ms=NOW).encode().decode()]
    service = _service(_Neighbour(records))
    accepted, turns = await _pull_counting_turns(service)
    assert accepted == len(records)
    assert turns >= len(records)  # a turn for the rest of the peer between every two records
    assert len(service.table) == len(records)


@dataclass
class _Event:
    peer: PeerId
    connected: bool = True


async def test_a_neighbour_that_reconnects_is_not_synced_with_again_at_once() -> None:
    host = _Neighbour([])
    service = _service(host)
    synced: list[str] = []

    async def sync_with(peer: str, *, prompted: bool = False) -> int:
        assert prompted, "a neighbour connecting is its doing, not our choice"
        synced.append(peer)
        return 0

    service.sync_with = sync_with  # type: ignore[method-assign]
    other = Identity.generate().peer_id
    send, receive = trio.open_memory_channel[_Event](16)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(service._sync_on_connect, receive, nursery)
        for peer in (MALLORY.peer_id, MALLORY.peer_id, other, MALLORY.peer_id):
            await send.send(_Event(peer))
        await send.aclose()
    assert synced == [MALLORY.peer_id, other]


async def test_an_honest_answer_costs_only_the_records_we_lack(work: _Work) -> None:
    """Most of a neighbour's table is what gossip already brought us: those records, which
    we hold verbatim, are recognized by their bytes, and only what is new is typed."""
    held = [_legacy(MALLORY, f"n{i}") for i in range(40)]
    newer = [_legacy(MALLORY, f"n{i}", seq=NOW + 1, slim=True) for i in range(5)]
    service = _service(_Neighbour([_wire(r) for r in held + newer]))
    _holding(service, held)
    typed_before = work.typed
    assert await service.sync_with(MALLORY.peer_id) == 5
    assert (work.typed - typed_before, work.verified) == (5, len(held) + 5)


async def test_stale_and_over_quota_records_are_refused_before_they_are_typed(work: _Work) -> None:
    """Records that cannot change the table (older seqs of nodes we hold, new nodes of a
    signer at its quota, new nodes of a signer holding its fair share once the table is
    full) are refused on their header."""
    limits = RegistryLimits(max_records=60, max_records_per_signer=30)
    held = [_legacy(MALLORY, f"n{i}", seq=NOW - 1) for i in range(30)]
    held += [_legacy(ME, f"m{i}", seq=NOW - 1) for i in range(29)]
    stale = [_legacy(MALLORY, f"n{i}", seq=NOW - 2) for i in range(30)]
    over_quota = [_legacy(MALLORY, f"extra{i}") for i in range(10)]
    last_room = [signed(Identity.generate(), 0, 10, seq=NOW, ts_ms=NOW)]
    table_full = [_legacy(ME, f"m{i}") for i in range(29, 39)]  # 29 held: one short of the largest
    answer = stale + over_quota + last_room + table_full
    service = _service(_Neighbour([_wire(r) for r in answer]), limits)
    _holding(service, held)
    typed_before = work.typed
    assert await service.sync_with(MALLORY.peer_id) == 1
    assert work.typed == typed_before + 1
    assert (service.drops[Verdict.REPLAY], service.drops[Verdict.SIGNER_FULL]) == (30, 10)
    assert service.drops[Verdict.TABLE_FULL] == 10


async def test_an_answer_that_keeps_being_refused_is_abandoned(work: _Work) -> None:
    """Fresh signers are free: an answer of their records with a bad signature is read until
    it has been refused 64 times, not to its end."""
    forged = []
    for _ in range(300):
        real = signed(Identity.generate(), 0, 10, seq=NOW, ts_ms=NOW)
        forged.append(_wire(SignedRecord(real.record, real.payload, bytes(64))))
    service = _service(_Neighbour(forged))
    assert await service.sync_with(MALLORY.peer_id) == 0
    assert work.verified <= 64
    assert service.drops.snapshot().get("sync_answer_abandoned") == 1


async def test_one_node_is_taken_at_most_twice_from_one_answer(work: _Work) -> None:
    """An honest table holds a node's full record and its heartbeat; one node at ever newer
    seqs (each valid, each accepted before) is not typed beyond that."""
    bumps = [_wire(_legacy(MALLORY, "n0", seq=NOW + i)) for i in range(300)]
    service = _service(_Neighbour(bumps))
    assert await service.sync_with(MALLORY.peer_id) == 2
    assert work.typed == 2
    assert service.drops.snapshot().get("node_repeated_in_answer", 0) >= 1


async def test_strangers_answers_together_type_no_more_than_the_sync_budget(work: _Work) -> None:
    """Each answer (a fresh identity each time) carries valid, newer records of the nodes
    the stranger holds here: each one would be accepted. Together they may type and verify
    what a newcomer's first pull of a full table needs (here 32 nodes x 2 envelopes, with
    a quarter to spare: 80), then no sync is even asked for until the budget refills."""
    limits = RegistryLimits(max_records=32)
    answers = [[_wire(_legacy(MALLORY, f"n{i}", seq=NOW + 2 * k + j)) for i in range(32) for j in (0, 1)]
               for k in range(10)]  # fmt: skip
    host = _Neighbour(*answers)
    service = _service(host, limits)
    for _ in answers:
        await service.sync_with(Identity.generate().peer_id)
    assert work.typed <= 81  # 80, and what the budget may have refilled during the test
    assert host.asked < len(answers)
    assert service.drops.snapshot().get("sync_budget_spent", 0) >= 1


async def test_a_newcomer_still_pulls_a_whole_full_table_from_one_answer(work: _Work) -> None:
    """Honest convergence: a table of ``max_records`` nodes, each its full record and a
    newer heartbeat, all taken from the first answer (the budget is sized for it)."""
    limits = RegistryLimits(max_records=128)
    honest: list[SignedRecord] = []
    for _ in range(128):
        peer = Identity.generate()
        node = signed(peer, 0, 10, seq=NOW, ts_ms=NOW, hardware={"gpu": "none"})
        honest += [node, SignedRecord.sign(slim_record(node.record.replace(seq=NOW + 1)), peer)]
    service = _service(_Neighbour([_wire(r) for r in honest]), limits)
    assert await service.sync_with(MALLORY.peer_id) == 256
    assert len(service.table) == 128 and all(e.details is not None for e in service.table.entries.values())
    assert service.drops.total() == 0


async def test_anti_entropy_resumes_once_the_budget_has_refilled() -> None:
    """A spent budget pauses syncs, it does not end them: once it could pay for an answer
    again (here after the whole refill time), the next sync is asked for and applied."""
    from p2p.sync_answer import SyncBudget

    now = [0.0]
    host = _Neighbour([_wire(_legacy(MALLORY, "n0"))])
    service = _service(host)
    service.sync_budget = SyncBudget(100, refill_s=60.0, clock=lambda: now[0])
    assert service.sync_budget.spend(100)
    assert await service.sync_with(MALLORY.peer_id) == 0
    assert host.asked == 0
    now[0] = 60.0
    assert await service.sync_with(MALLORY.peer_id) == 1
    assert host.asked == 1


def test_gossiped_stale_and_over_quota_records_are_refused_before_they_are_typed(work: _Work) -> None:
    """Gossip reads the header first too: a stranger may send stale, replayed or over-quota
    records as fast as the spam limit lets it (200 a second per forwarder), and each used to
    be typed in full before the rules refused it."""
    limits = RegistryLimits(max_records=100, max_records_per_signer=30)
    service = _service(_Neighbour([]), limits)
    held = [_legacy(MALLORY, f"n{i}", seq=NOW - 1) for i in range(30)]
    _holding(service, held)
    stale = [_legacy(MALLORY, f"n{i}", seq=NOW - 2) for i in range(30)]
    over_quota = [_legacy(MALLORY, f"extra{i}") for i in range(10)]
    typed_before, verified_before = work.typed, work.verified
    for record in stale + over_quota:
        assert not service._validate(MALLORY.peer_id, record.encode())
        assert service._take(record.encode(), "gossip") in (Verdict.REPLAY, Verdict.SIGNER_FULL)
    assert (work.typed, work.verified) == (typed_before, verified_before)
    assert (service.drops[Verdict.REPLAY], service.drops[Verdict.SIGNER_FULL]) == (60, 20)
    fresh = _legacy(MALLORY, "n0", seq=NOW)
    assert service._validate(MALLORY.peer_id, fresh.encode())
    assert service._take(fresh.encode(), "gossip") is Verdict.ACCEPTED
    assert (work.typed, work.verified) == (typed_before + 1, verified_before + 1)


async def test_syncs_strangers_prompt_leave_half_the_budget_for_the_ones_we_choose() -> None:
    """Fresh identities connecting one after the other, each answering with a few cheap
    refusals, kept the budget spent and every sync waiting, ours too (an audit): now what a
    neighbour prompts stops at half the budget, and the periodic and joining syncs still run."""
    from p2p.sync_answer import SyncBudget

    host = _Neighbour([_wire(_legacy(MALLORY, "n0"))])
    service = _service(host)
    service.sync_budget = SyncBudget(100_000, clock=lambda: 0.0)
    assert service.sync_budget.spend(60_000)  # 40% left: strangers' answers spent the rest
    assert await service.sync_with(MALLORY.peer_id, prompted=True) == 0
    assert host.asked == 0
    assert await service.sync_with(MALLORY.peer_id) == 1
    assert host.asked == 1


class _Linked:
    """A host whose sync streams reach ``server``'s handler through the real framing, with
    the frame limit the asker opens its stream with at both ends, as ``asker``. ``pair``
    makes the link: a memory pair buffers whatever is sent, a windowed pair holds the
    sender while the asker has not read it (a slow reader holds its answer)."""

    def __init__(self, server: RegistryService, nursery: trio.Nursery, *, asker: PeerId = ME.peer_id,
                 pair: Callable[[], tuple[trio.abc.Stream, trio.abc.Stream]] = trio.testing.memory_stream_pair) -> None:  # fmt: skip
        self.server, self.nursery, self.asker, self.pair = server, nursery, asker, pair

    async def new_stream(self, peer: PeerId, protocol: str, *, timeout: float, max_frame_size: int) -> FramedStream:
        return self.open(self.asker, max_frame_size)[0]

    def open(self, asker: PeerId, max_frame_size: int = MAX_PAGE_BYTES) -> tuple[FramedStream, trio.abc.Stream]:
        """A sync stream from ``asker``, framed and raw (to read its answer byte by byte)."""
        ours, theirs = self.pair()
        served = FramedStream.over_trio(theirs, max_frame_size=max_frame_size)
        self.nursery.start_soon(self._serve, served, asker)
        return FramedStream.over_trio(ours, max_frame_size=max_frame_size), ours

    async def _serve(self, stream: FramedStream, asker: PeerId) -> None:
        """As the host runs a handler: the stream closed when it returns, reset if it raises."""
        with contextlib.suppress(P2PError):  # the asker may stop reading; the host confines this
            async with stream:
                await self.server._serve_sync(stream, asker)

    def is_connected(self, peer: PeerId) -> bool:
        return False


def _padded(signer: Identity, name: str) -> SignedRecord:
    """A legal record near the size limit: ~60 KB of characters JSON escapes."""
    hardware = {f"k{k}": "\x01" * 1000 for k in range(10)}
    return _legacy(signer, name, hardware=hardware)


async def test_a_table_bloated_past_the_answer_limit_still_syncs_its_honest_records(monkeypatch: pytest.MonkeyPatch) -> None:
    """Strangers' records padded to the size limit made a peer's table outgrow the largest
    answer an asker reads: the answer, one frame, failed for every asker, and no peer could
    sync. Sent in pages, smallest first, the honest records arrive before the padding, and
    the asker stops reading at its byte cap."""
    monkeypatch.setattr(gossip, "MAX_ANSWER_BYTES", 1024 * 1024)
    server = _service(_Neighbour([]))
    honest = [_legacy(MALLORY, f"honest{i}") for i in range(10)]
    bloat = [_padded(Identity.generate(), "pad") for _ in range(24)]
    _holding(server, bloat[:12] + honest + bloat[12:])
    assert sum(len(r.encode()) for r in bloat) > gossip.MAX_ANSWER_BYTES
    async with trio.open_nursery() as nursery:
        asker = _service(_Linked(server, nursery))
        accepted = await asker.sync_with(MALLORY.peer_id)
    assert all(asker.table.get(r.record.node_id) is not None for r in honest)
    assert 10 <= accepted < len(honest) + len(bloat)
    assert asker.drops[SyncDrop.ANSWER_TOO_LARGE] == 1


async def test_a_peer_sends_only_a_few_sync_answers_at_once() -> None:
    """Any number of identities may ask for our table, each for as long as it reads slowly;
    every answer in flight held the whole table encoded. Beyond a few at once, an asker
    waits, and beyond a few waiting, it is refused at once (and counted); so is a peer
    asking again while its answer is on its way."""
    server = _service(_Neighbour([]))
    _holding(server, [_padded(Identity.generate(), "pad") for _ in range(12)])
    askers: list[FramedStream] = []
    async with trio.open_nursery() as nursery:
        host = _Linked(server, nursery, pair=_windowed_pair)
        others = [Identity.generate().peer_id for _ in range(SERVES_AT_ONCE + WAITING_AT_ONCE + 1)]
        for asker in [ME.peer_id, *others]:  # none of them reads its answer
            stream, _ = host.open(asker)
            await stream.send(b"{}", timeout=5.0)
            askers.append(stream)
            await trio.testing.wait_all_tasks_blocked()
        assert server.drops[ServeDrop.SERVES_BUSY] == 2
        assert server.drops[ServeDrop.PEER_BUSY] == 0
        twice, _ = host.open(ME.peer_id)
        await twice.send(b"{}", timeout=5.0)
        await trio.testing.wait_all_tasks_blocked()
        assert server.drops[ServeDrop.PEER_BUSY] == 1
        first = await askers[0].receive(timeout=5.0)  # the ones served are answered all the same
        assert json.loads(first)["records"]
        nursery.cancel_scope.cancel()


class _EndlessEmptyPages(_Answer):
    """An answer that never says it is done, one empty page after another."""

    async def receive(self, timeout: float) -> bytes:
        await trio.lowlevel.checkpoint()
        return b'{"records":[],"more":true}'


async def test_an_answer_of_endless_empty_pages_costs_a_bounded_share_of_the_budget() -> None:
    """Each page costs its sender a few bytes and us a unit of the budget: read without a
    bound on pages, one answer could spend the whole budget (and every sync after it for ten
    minutes) for a couple of megabytes."""
    host = _Neighbour([])
    host.new_stream = lambda *a, **k: _as_awaitable(_EndlessEmptyPages([]))  # type: ignore[method-assign]
    service = _service(host)
    with trio.fail_after(30):
        assert await service.sync_with(MALLORY.peer_id) == 0
    assert service.sync_budget.spent <= MAX_PAGES
    assert service.drops[SyncDrop.ANSWER_TOO_LARGE] == 1


async def _as_awaitable(value: Any) -> Any:
    return value


_HONEST_WAIT_S = 20.0
"""The longest an honest asker may wait for its whole answer while slow askers hold every
serve (with a fast link, reading takes no time on the test's clock)."""


class _Window:
    """One direction of a link as yamux makes it: a sender is held while more than
    ``window`` bytes wait unread, and one that resets the link with bytes unread has its
    reader told at once (a lockstep pair would let it drain them, a byte at a time)."""

    def __init__(self, window: int = 256 * 1024) -> None:
        self.unread, self.window = bytearray(), window
        self.closed = self.reset = self.reader_gone = False
        self.moved = trio.lowlevel.ParkingLot()

    def wake(self) -> None:
        self.moved.unpark_all()


class _WindowSend(trio.abc.SendStream):
    def __init__(self, window: _Window) -> None:
        self.w = window

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        self.w.unread += data
        self.w.wake()
        while len(self.w.unread) > self.w.window and not self.w.reader_gone:
            await self.w.moved.park()
        if self.w.reader_gone:
            raise trio.BrokenResourceError
        await trio.lowlevel.checkpoint()

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.checkpoint()

    async def send_eof(self) -> None:
        """A graceful close: what was sent is still read."""
        self.w.closed = True
        self.w.wake()
        await trio.lowlevel.checkpoint()

    async def aclose(self) -> None:
        """A reset (what ``FramedStream.reset`` does): what was not read is lost."""
        self.w.closed, self.w.reset = True, bool(self.w.unread)
        self.w.wake()
        await trio.lowlevel.checkpoint()


class _WindowReceive(trio.abc.ReceiveStream):
    def __init__(self, window: _Window) -> None:
        self.w = window

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        while not self.w.unread and not self.w.closed:
            await self.w.moved.park()
        if self.w.reset:
            raise trio.BrokenResourceError
        taken = bytes(self.w.unread[:max_bytes or len(self.w.unread)])
        del self.w.unread[:len(taken)]
        self.w.wake()
        await trio.lowlevel.checkpoint()
        return taken

    async def aclose(self) -> None:
        self.w.reader_gone = True
        self.w.wake()
        await trio.lowlevel.checkpoint()


def _windowed_pair() -> tuple[trio.abc.Stream, trio.abc.Stream]:
    """A two-way link with a window each way (see :class:`_Window`)."""
    there, back = _Window(), _Window()
    return (trio.StapledStream(_WindowSend(there), _WindowReceive(back)),
            trio.StapledStream(_WindowSend(back), _WindowReceive(there)))  # fmt: skip


async def _ask_slowly_for_ever(link: _Linked, chunk: int) -> None:
    """A hostile asker (a fresh identity each): it reads ``chunk`` bytes of its answer a
    second, and asks again the moment its answer ends."""
    asker = Identity.generate().peer_id
    while True:
        stream, raw = link.open(asker)
        await stream.send(b"{}", timeout=5.0)
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            while await raw.receive_some(chunk):
                await trio.sleep(1.0)


@pytest.mark.parametrize("chunk", [1, 64 * 1024], ids=["a_byte_a_second", "a_page_in_each_page_timeout"])
async def test_slow_askers_holding_every_serve_leave_an_honest_asker_its_answer(autojump_clock: trio.abc.Clock,
                                                                                chunk: int) -> None:  # fmt: skip
    """Four askers that read their answers slowly, each asking again as soon as it is cut
    off, held every serve for good: an honest newcomer was refused at once, every time.
    Now it waits its turn, ahead of whoever asks after it, and a serve that has had its
    turn gives way to it, so it gets the whole table within one turn."""
    server = _service(_Neighbour([]))
    records = [_padded(Identity.generate(), "pad") for _ in range(40)]  # ~3 MB: six pages
    _holding(server, records)
    async with trio.open_nursery() as nursery:
        link = _Linked(server, nursery, pair=_windowed_pair)
        for _ in range(SERVES_AT_ONCE):
            nursery.start_soon(_ask_slowly_for_ever, link, chunk)
        await trio.sleep(65.0)  # they hold every serve, and have been cut off or done (and back) already
        honest = _service(_Linked(server, nursery, asker=Identity.generate().peer_id,
                                  pair=_windowed_pair))  # fmt: skip
        asked = trio.current_time()
        accepted = await honest.sync_with(MALLORY.peer_id)
        waited = trio.current_time() - asked
        nursery.cancel_scope.cancel()
    assert accepted == len(records)
    assert waited <= _HONEST_WAIT_S
    assert SERVE_WAIT_S <= _HONEST_WAIT_S


async def test_serve_turns_are_never_lost_however_askers_give_up(autojump_clock: trio.abc.Clock) -> None:
    """A slot handed to a waiter just as it gives up (its wait over, or cancelled from
    outside) is passed on, not lost: after a storm of askers that give up at every moment,
    every slot is free again, and nobody is left waiting."""
    turns = ServeTurns(slots=2, waiting=3, turn_s=3.0, wait_s=4.0)
    chance = random.Random(7)

    async def ask(peer: PeerId, patience: float, reading: float) -> None:
        with trio.move_on_after(patience), contextlib.suppress(ServeRefused):
            async with turns.turn(peer) as turn:
                with turn:
                    await trio.sleep(reading)

    async with trio.open_nursery() as nursery:
        for n in range(200):
            peer = PeerId(f"asker{n % 12}")
            nursery.start_soon(ask, peer, chance.choice([0.5, 1.0, 2.0, 9.0]), chance.choice([0.5, 2.0, 5.0]))
            await trio.sleep(chance.choice([0.0, 0.25, 0.5, 1.0]))
    assert (turns.free, turns._serving, turns._waiting) == (2, {}, {})
