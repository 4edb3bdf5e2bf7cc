"""Registry merge rules as a pure reducer: signatures, replays, clocks, ageing."""

from __future__ import annotations

import dataclasses

import pytest
import trio
from registry_helpers import MODEL, signed, view

from inclavate.types import LayerRange
from p2p.coverage import has_chain, model_coverage, uncovered
from p2p.gossip import RegistryService
from p2p.identity import Identity
from p2p.records import InvalidRecord, MetricSample, NodeRecord, SignedRecord, legacy_node_id, slim_record
from p2p.registry import (
    HEAL_FIELDS, Cadence, Liveness, RegistryLimits, Table, Verdict, admit, apply, effective_state, expire, remove,
)

NOW = 1_000_000
LIVE = Liveness()
ALICE, MALLORY = Identity.generate(), Identity.generate()


def test_a_signed_record_round_trips_and_verifies() -> None:
    rec = signed(ALICE, 0, 10, hardware={"gpu": "none", "cores": 2}, samples=())
    again = SignedRecord.decode(rec.encode())
    assert again.record == rec.record and again.verified()


def test_unknown_fields_from_newer_peers_are_ignored_and_still_verify() -> None:
    import base64
    import json

    payload = json.dumps({**signed(ALICE, 0, 10).record.to_json(), "future_field": 1}, sort_keys=True).encode()
    envelope = {"v": 1, "record": payload.decode(), "sig": base64.b64encode(ALICE.sign(payload)).decode()}
    rec = SignedRecord.decode(json.dumps(envelope).encode())
    assert rec.verified() and rec.record.start_layer == 0


def test_accepts_new_records_and_ignores_duplicates() -> None:
    table, verdict = apply(Table(), signed(ALICE, 0, 10), NOW, LIVE)
    assert verdict is Verdict.ACCEPTED and len(table) == 1
    assert apply(table, signed(ALICE, 0, 10), NOW, LIVE)[1] is Verdict.DUPLICATE
    newer, verdict = apply(table, signed(ALICE, 0, 12, seq=2), NOW, LIVE)
    assert verdict is Verdict.ACCEPTED and newer.get(ALICE.peer_id).record.end_layer == 12


def test_forged_record_is_rejected() -> None:
    # Mallory signs a record that claims to be Alice's.
    forged = SignedRecord(signed(ALICE, 0, 10).record, signed(ALICE, 0, 10).payload, MALLORY.sign(b"x"))
    assert apply(Table(), forged, NOW, LIVE)[1] is Verdict.BAD_SIGNATURE
    # And tampering with a field after signing breaks the signature too.
    genuine = signed(ALICE, 0, 10)
    tampered = SignedRecord(genuine.record.replace(end_layer=30), genuine.payload.replace(b'"end_layer":10', b'"end_layer":30'), genuine.signature)
    assert apply(Table(), tampered, NOW, LIVE)[1] is Verdict.BAD_SIGNATURE
    with pytest.raises(InvalidRecord):
        SignedRecord.sign(signed(ALICE, 0, 10).record, MALLORY)


def test_replayed_older_record_is_rejected() -> None:
    table, _ = apply(Table(), signed(ALICE, 0, 10, seq=5), NOW, LIVE)
    assert apply(table, signed(ALICE, 0, 30, seq=4), NOW, LIVE)[1] is Verdict.REPLAY


def test_timestamps_out_of_bounds_are_rejected() -> None:
    future = signed(ALICE, 0, 10, ts_ms=NOW + int(LIVE.max_future_skew_s * 1000) + 1)
    assert apply(Table(), future, NOW, LIVE)[1] is Verdict.FROM_THE_FUTURE
    ancient = signed(ALICE, 0, 10, ts_ms=NOW - int(LIVE.drop_after_s * 1000) - 1)
    assert apply(Table(), ancient, NOW, LIVE)[1] is Verdict.TOO_OLD


def test_a_peer_may_not_publish_another_nodes_record() -> None:
    with pytest.raises(InvalidRecord):
        NodeRecord.from_json(dataclasses.replace(signed(ALICE, 0, 10).record, node_id="someone-else").to_json())


def test_silence_degrades_then_kills_then_forgets() -> None:
    table, _ = apply(Table(), signed(ALICE, 0, 10), NOW, LIVE)
    entry = table.get(ALICE.peer_id)
    at = lambda s: NOW + int(s * 1000)  # noqa: E731
    assert effective_state(entry, at(LIVE.degraded_after_s - 0.1), LIVE) == "Ready"
    assert effective_state(entry, at(LIVE.degraded_after_s + 0.1), LIVE) == "Degraded"
    assert effective_state(entry, at(LIVE.dead_after_s + 0.1), LIVE) == "Dead"
    assert len(expire(table, at(LIVE.drop_after_s - 1), LIVE)) == 1
    # A lookup of one node ages it as the listing does (what a session's health poll reads).
    for seconds in (0, LIVE.degraded_after_s + 0.1, LIVE.dead_after_s + 0.1):
        assert table.view(ALICE.peer_id, at(seconds), LIVE) == next(iter(table.views(at(seconds), LIVE)))
    assert table.view(MALLORY.peer_id, NOW, LIVE) is None
    assert len(expire(table, at(LIVE.drop_after_s + 1), LIVE)) == 0


def test_departure_is_dead_at_once() -> None:
    table, _ = apply(Table(), signed(ALICE, 0, 10), NOW, LIVE)
    table, _ = apply(table, signed(ALICE, 0, 10, seq=2, state="Dead"), NOW, LIVE)
    assert effective_state(table.get(ALICE.peer_id), NOW, LIVE) == "Dead"


def test_anti_entropy_cannot_revive_a_stale_record() -> None:
    old = signed(ALICE, 0, 10, ts_ms=NOW - 20_000)
    table, verdict = apply(Table(), old, NOW, LIVE, via="sync")
    assert verdict is Verdict.ACCEPTED
    assert effective_state(table.get(ALICE.peer_id), NOW, LIVE) == "Dead"


def test_coverage_needs_ranges_that_meet() -> None:
    assert uncovered([LayerRange(0, 10), LayerRange(20, 30)], 30) == [LayerRange(10, 20)]
    assert has_chain([LayerRange(0, 12), LayerRange(10, 20), LayerRange(12, 30)], 30)
    assert not has_chain([LayerRange(0, 12), LayerRange(10, 30)], 30)
    views = [view("a", 0, 10), view("b", 10, 30), view("c", 10, 30, "Degraded"), view("d", 0, 10, idle=True)]
    cov = model_coverage(views)[MODEL]
    assert cov.chain_complete and cov.gaps == ()
    assert cov.ranges == (LayerRange(0, 10), LayerRange(10, 30))
    assert cov.states == {"Ready": 3, "Joining": 0, "Degraded": 1, "Dead": 0, "Idle": 1}
    broken = model_coverage([view("a", 0, 10), view("b", 20, 30)])[MODEL]
    assert not broken.chain_complete and broken.gaps == (LayerRange(10, 20),)


def test_free_records_cannot_outvote_the_catalog_on_a_model_s_shape() -> None:
    """Three records of fresh identities on layers 0-1 saying 29 layers outvoted three honest
    peers, and /api/models showed the catalog's 30-layer model as 29 layers with a gap 1-29
    (an audit, 2026-12-07). A model of the catalog has the catalog's shape; a record stating
    another holds no part of it, and no route goes through it."""
    from types import SimpleNamespace

    from inclavate.peer import Peer
    from inclavate.types import PeerId
    from p2p.routing import choose_route

    honest = [view("a", 0, 10), view("b", 10, 20), view("c", 20, 30)]
    strangers = [view(f"s{i}", 0, 1, n_layers=29) for i in range(3)]
    wide = [view(f"w{i}", 0, 30, d_model=1024) for i in range(3)]
    catalog = {MODEL: (30, 576)}.get
    for swarm in ([*honest, *strangers], [*honest, *wide]):
        peer = SimpleNamespace(views=lambda swarm=swarm: list(swarm), _catalog_shape=catalog,
                               registry=SimpleNamespace(coverage=lambda swarm=swarm: model_coverage(swarm)))  # fmt: skip
        cov = Peer.coverage(peer)[MODEL]  # type: ignore[arg-type]  # what /api/models and /admin/chain read
        assert (cov.n_layers, cov.d_model, cov.chain_complete, cov.gaps) == (30, 576, True, ())
        assert cov.ranges == (LayerRange(0, 10), LayerRange(10, 20), LayerRange(20, 30))
        assert cov.node_count == 3 and cov.states["Ready"] == 3
        assert model_coverage(swarm, catalog)[MODEL] == cov
        for _ in range(20):
            route = choose_route(swarm, MODEL, PeerId("x"), n_layers=30, d_model=576)
            assert [h.node_id for h in route] == ["a", "b", "c"]
    # Only records of another shape: no holder of the catalog's model.
    assert MODEL not in model_coverage(strangers, catalog)
    # Outside the catalog, what most peers state (a tie: the smaller).
    assert model_coverage([*honest, *strangers])[MODEL].n_layers == 29


def test_generator_entries_in_records_are_small_and_shaped() -> None:
    from p2p.records import MAX_GENERATORS, InvalidRecord, check_generators

    good = {"modality": "audio", "model": "piper:joe", "builtin_voices": ["joe"], "requires_speaker": False,
            "speed_range": {"min": 0.5, "max": 2.0}}  # fmt: skip
    check_generators((good,))
    for bad in [
        ({"model": "m"},),  # no modality
        ({**good, "script": "<x>"},),  # unknown key
        ({**good, "builtin_voices": [1]},),
        ({**good, "builtin_voices": ["v" * 65]},),
        ({**good, "speed_range": {"min": "fast"}},),
        # speech requests read both bounds by key: an entry without them failed those with a 500
        ({**good, "speed_range": {}},),
        ({**good, "speed_range": {"min": 0.5}},),
        ({**good, "speed_range": {"min": 2.0, "max": 0.5}},),
        ({**good, "speed_range": {"min": 0.5, "max": float("inf")}},),
        ({**good, "speed_range": {"min": 0.5, "max": 2.0, "step": 0.1}},),
        ({**good, "model": "m" * 101},),
        (good,) * (MAX_GENERATORS + 1),
        ({**good, "languages": ["x" * 60] * 80},),  # over the byte budget
    ]:
        with pytest.raises(InvalidRecord):
            check_generators(bad)


# ---------------------------------------------- slim heartbeats and full records (details)


def _full(seq: int, **fields: object) -> SignedRecord:
    samples = (MetricSample(1.5, 2.5, NOW - 10_000),)
    return signed(ALICE, 0, 10, seq=seq, ts_ms=NOW, samples=samples, hardware={"gpu": "none"},
                  requests_by_model={MODEL: 3}, model_sha256="a" * 64, **fields)  # fmt: skip


def test_a_heartbeat_keeps_the_details_of_the_newest_full_record() -> None:
    full = _full(1)
    heartbeat = SignedRecord.sign(slim_record(full.record.replace(seq=2, state="Degraded")), ALICE)
    assert heartbeat.record.samples == () and heartbeat.record.slim
    table, _ = apply(Table(), full, NOW, LIVE)
    table, verdict = apply(table, heartbeat, NOW + 1000, LIVE)
    entry = table.get(ALICE.peer_id)
    assert verdict is Verdict.ACCEPTED and entry.fresh_ms == NOW + 1000
    assert entry.record.state == "Degraded" and entry.record.samples == full.record.samples
    assert entry.record.hardware == {"gpu": "none"} and entry.record.requests_by_model == {MODEL: 3}
    assert entry.record.model_sha256 == "a" * 64
    # Anti-entropy hands a neighbour both envelopes, so it holds the same entry.
    again = Table()
    for envelope in table.signed_records():
        again, _ = apply(again, SignedRecord.decode(envelope.encode()), NOW + 1000, LIVE)
    assert again.get(ALICE.peer_id).record == entry.record


def test_a_full_record_overtaken_by_the_next_heartbeat_still_brings_its_details() -> None:
    full = _full(1)
    heartbeat = SignedRecord.sign(slim_record(full.record.replace(seq=2)), ALICE)
    table, _ = apply(Table(), heartbeat, NOW, LIVE)
    assert table.get(ALICE.peer_id).record.samples == ()  # a heartbeat alone reads sensibly
    table, verdict = apply(table, full, NOW + 5000, LIVE)
    entry = table.get(ALICE.peer_id)
    assert verdict is Verdict.ACCEPTED and entry.record.seq == 2 and entry.fresh_ms == NOW  # not fresher
    assert entry.record.samples == full.record.samples
    assert apply(table, full, NOW + 5000, LIVE)[1] is Verdict.DUPLICATE
    older_full = _full(0)
    assert apply(table, older_full, NOW, LIVE)[1] is Verdict.REPLAY  # older than both parts


def test_a_record_without_the_new_fields_is_a_full_record_judged_by_our_interval() -> None:
    import json

    data = {k: v for k, v in _full(1).record.to_json().items() if k not in ("slim", "heartbeat_ms")}
    record = NodeRecord.from_json(json.loads(json.dumps(data)))
    assert not record.slim and record.heartbeat_ms == 0 and record.samples
    assert LIVE.for_record(record) == LIVE
    assert not NodeRecord.from_json({**data, "slim": "yes"}).slim


def test_silence_is_judged_by_the_senders_announced_interval_within_bounds() -> None:
    slow = signed(ALICE, 0, 10, heartbeat_ms=20_000)
    table, _ = apply(Table(), slow, NOW, LIVE)
    entry = table.get(ALICE.peer_id)
    assert effective_state(entry, NOW + 50_000, LIVE) == "Ready"  # 2.5 beats of 20 s
    assert effective_state(entry, NOW + 70_000, LIVE) == "Degraded"
    assert effective_state(entry, NOW + 130_000, LIVE) == "Dead"
    assert len(expire(table, NOW + 500_000, LIVE)) == 1 and len(expire(table, NOW + 700_000, LIVE)) == 0
    # A claim beyond max_heartbeat_s is believed only up to it.
    lazy = signed(ALICE, 0, 10, heartbeat_ms=3_600_000)
    entry = apply(Table(), lazy, NOW, LIVE)[0].get(ALICE.peer_id)
    assert effective_state(entry, NOW + int(LIVE.max_heartbeat_s * 6 * 1000) + 1, LIVE) == "Dead"


def test_the_cadence_bounds_the_records_a_peer_receives() -> None:
    cadence = Cadence()
    assert cadence.heartbeat_s(4, LIVE) == LIVE.heartbeat_s  # small swarms (the tests') beat every 2 s
    assert LIVE.heartbeat_s < cadence.heartbeat_s(12, LIVE) < cadence.heartbeat_s(100, LIVE) <= LIVE.max_heartbeat_s
    for nodes in (100, 1000, 4000):
        assert nodes / cadence.heartbeat_s(nodes, LIVE) <= max(cadence.heartbeats_per_s, nodes / LIVE.max_heartbeat_s)
        assert nodes / cadence.details_spacing_s(nodes, refresh=False) <= max(cadence.details_per_s, nodes / cadence.details_min_s)
    assert cadence.details_spacing_s(1000, refresh=True) == 1000


class _Wire:
    """A host that keeps what the registry service publishes."""

    def __init__(self) -> None:
        self.sent: list[NodeRecord] = []

    async def publish(self, topic: str, data: bytes) -> None:
        self.sent.append(SignedRecord.decode(data).record)


async def test_heartbeats_are_slim_and_details_go_out_on_change_no_faster_than_the_cadence() -> None:
    clock = [NOW]
    wire = _Wire()
    service = RegistryService(wire, ALICE, LIVE, clock=lambda: clock[0])  # type: ignore[arg-type]
    own = _full(1).record

    async def beat(seconds: float, **changes: object) -> NodeRecord:
        clock[0] += int(seconds * 1000)
        await service.publish(own.replace(**changes))
        return wire.sent[-1]

    first = await beat(0)
    assert not first.slim and first.samples and first.heartbeat_ms == 2000
    assert (await beat(2)).slim  # nothing changed
    assert (await beat(2, requests_by_model={MODEL: 4})).slim  # changed, but 4 s after the last full record
    changed = await beat(2, requests_by_model={MODEL: 4})
    assert not changed.slim and changed.requests_by_model == {MODEL: 4}
    moved = own.samples + (MetricSample(0.0, 0.0, NOW),)
    assert (await beat(10, requests_by_model={MODEL: 4}, samples=moved)).slim  # samples alone wait for the refresh
    refreshed = await beat(50, requests_by_model={MODEL: 4}, samples=moved)
    assert not refreshed.slim and refreshed.samples == moved
    # Our own table reads the full record through every heartbeat.
    await beat(2, requests_by_model={MODEL: 4}, samples=moved)
    assert service.table.get(ALICE.peer_id).record.samples == moved
    assert service.own(ALICE.peer_id).samples == moved


def test_a_pause_of_this_peer_is_no_nodes_silence() -> None:
    """The ageing loop reads the clock every second: a longer gap is time this peer did not
    run (stopped, swapped out), and its records age from when it runs again. Before, an
    entry stopped for 8 s found every hop Degraded and failed its sessions over (an audit,
    2026-12-08). A silence this peer was awake for ages the records as before."""
    clock = [NOW]
    service = RegistryService(_Wire(), ALICE, LIVE, clock=lambda: clock[0])  # type: ignore[arg-type]
    assert service._accept(signed(MALLORY, 0, 30, ts_ms=NOW, seq=NOW), "gossip") is Verdict.ACCEPTED
    service._last_read = clock[0]  # as the ageing loop does when it starts
    clock[0] += 8_000  # no reading for 8 s: this peer was stopped
    assert service.view(MALLORY.peer_id).state == "Ready"
    for _ in range(8):  # awake, a reading each second, and the node silent
        clock[0] += 1_000
        service.view(MALLORY.peer_id)
    assert service.view(MALLORY.peer_id).state == "Degraded"
    # A pause forgives at most a minute: after hours asleep, a node silent all along is
    # Dead, not Ready for as long again (a review).
    assert service._accept(signed(MALLORY, 0, 30, ts_ms=clock[0], seq=clock[0]), "gossip") is Verdict.ACCEPTED
    clock[0] += 2 * 3600 * 1000
    assert service.view(MALLORY.peer_id).state == "Dead"
    # A clock set back: pauses are seen again from the new reading.
    clock[0] -= 3600 * 1000
    service.view(MALLORY.peer_id)
    other = Identity.generate()
    assert service._accept(signed(other, 0, 30, ts_ms=clock[0], seq=clock[0]), "gossip") is Verdict.ACCEPTED
    clock[0] += 8_000
    assert service.view(other.peer_id).state == "Ready"


class _Connected(_Wire):
    def __init__(self, connected: set[str]) -> None:
        super().__init__()
        self.connected = connected

    def is_connected(self, peer: str) -> bool:
        return peer in self.connected


def _asking(connected: set[str]) -> tuple[RegistryService, list[str]]:
    """A service connected to ``connected``, and the peers it asks for a sync (recorded, not
    asked)."""
    asked: list[str] = []
    service = RegistryService(_Connected(connected), Identity.generate(), LIVE, clock=lambda: NOW)  # type: ignore[arg-type]

    async def sync_with(peer: str, *, prompted: bool = False) -> int:
        assert prompted, "a heartbeat lacking details is the neighbour's doing, not our choice"
        asked.append(peer)
        return 0

    service.sync_with = sync_with  # type: ignore[method-assign]
    return service, asked


async def test_a_heartbeat_without_known_details_asks_its_connected_owner_once() -> None:
    bob = Identity.generate()
    service, asked = _asking({ALICE.peer_id})
    async with trio.open_nursery() as nursery:
        service._nursery = nursery
        for seq in (2, 3):  # two heartbeats, one question
            service._take(SignedRecord.sign(slim_record(_full(seq).record), ALICE).encode(), "gossip")
        service._take(SignedRecord.sign(slim_record(signed(bob, 10, 20, ts_ms=NOW).record), bob).encode(), "gossip")
        service._take(_full(4).encode(), "gossip")
    assert asked == [ALICE.peer_id]  # bob is not connected: its heartbeat makes us dial nobody
    assert service.table.get(ALICE.peer_id).record.samples  # the full record filled the gap


async def test_an_owner_whose_many_nodes_lack_details_is_asked_once() -> None:
    """One pull of the owner's table brings every node's details: a peer vouching for 64
    legacy nodes used to make us pull its table once per node heartbeat."""
    service, asked = _asking({ALICE.peer_id})
    async with trio.open_nursery() as nursery:
        service._nursery = nursery
        for i in range(5):
            legacy = signed(ALICE, 0, 10, node_id=legacy_node_id(ALICE.peer_id, f"n{i}"), relayed=True, seq=NOW, ts_ms=NOW)
            service._take(SignedRecord.sign(slim_record(legacy.record), ALICE).encode(), "gossip")
    assert asked == [ALICE.peer_id]


# ------------------------------------------------- a full table, shared between signers

SHARED = RegistryLimits(max_records=6, max_records_per_signer=8)


def _node(signer: Identity, name: str | None, seq: int = NOW, ts_ms: int = NOW, **fields: object) -> SignedRecord:
    """``signer``'s own node (``name`` None) or one of the legacy nodes it vouches for."""
    if name is None:
        return signed(signer, 0, 10, seq=seq, ts_ms=ts_ms, **fields)
    return signed(signer, 0, 10, node_id=legacy_node_id(signer.peer_id, name), relayed=True, seq=seq, ts_ms=ts_ms, **fields)


def _filled(shares: list[tuple[Identity, int]], limits: RegistryLimits = SHARED) -> Table:
    """A table holding each signer's own node then its legacy nodes, one refreshed per
    second in that order (the own node is each signer's least recently refreshed)."""
    table, at = Table(), NOW
    for signer, count in shares:
        for i in range(count):
            table, verdict = apply(table, _node(signer, None if i == 0 else f"n{i}", ts_ms=at), at, LIVE, limits=limits)
            assert verdict is Verdict.ACCEPTED
            at += 1000
    return table


def _ids(table: Table) -> set[str]:
    return set(table.entries)


def test_a_full_table_makes_room_from_the_signer_holding_two_more_than_the_newcomer() -> None:
    carol = Identity.generate()
    table = _filled([(ALICE, 4), (MALLORY, 2)])
    later = NOW + 10_000
    newcomer = _node(carol, None, ts_ms=later)
    assert admit(table, newcomer.record, later, LIVE, SHARED) is None
    after, verdict = apply(table, newcomer, later, LIVE, limits=SHARED)
    assert verdict is Verdict.ACCEPTED and len(after) == SHARED.max_records
    # Alice's least recently refreshed node that she vouches for went; never her own node.
    assert _ids(table) - _ids(after) == {legacy_node_id(ALICE.peer_id, "n1")}
    assert after.get(ALICE.peer_id) is not None and after.signed_by(ALICE.peer_id) == 3
    # Alice now holds 3, Mallory 2, Carol 1: Mallory's new node waits, Carol's takes another
    # of Alice's, then the shares are equal and nobody's new node gets in.
    assert _refused(after, _node(MALLORY, "m9", ts_ms=later), later)
    after, verdict = apply(after, _node(carol, "c1", ts_ms=later), later, LIVE, limits=SHARED)
    assert verdict is Verdict.ACCEPTED and _ids(table) - _ids(after) == {legacy_node_id(ALICE.peer_id, f"n{i}") for i in (1, 2)}
    assert all(_refused(after, _node(signer, "z", ts_ms=later), later) for signer in (ALICE, MALLORY, carol))


def _refused(table: Table, newcomer: SignedRecord, now: int) -> bool:
    """Whether both the header check and the whole rules refuse ``newcomer`` for fullness."""
    early = admit(table, newcomer.record, now, LIVE, SHARED)
    return early is Verdict.TABLE_FULL and apply(table, newcomer, now, LIVE, limits=SHARED) == (table, early)


def test_a_departed_node_goes_before_a_live_one_of_the_same_signer() -> None:
    table = _filled([(ALICE, 5), (MALLORY, 1)])
    table, _ = apply(table, _node(ALICE, "n4", seq=NOW + 1, ts_ms=NOW + 9000, state="Dead"), NOW + 9000, LIVE, limits=SHARED)
    after, verdict = apply(table, _node(Identity.generate(), None, ts_ms=NOW + 9000), NOW + 9000, LIVE, limits=SHARED)
    assert verdict is Verdict.ACCEPTED and _ids(table) - _ids(after) == {legacy_node_id(ALICE.peer_id, "n4")}


def test_fair_shares_settle_and_evicted_nodes_coming_back_evict_nobody() -> None:
    """Shares converge to one apart, then stay put: every node ever seen keeps publishing
    (the evicted ones too), round after round, and the table no longer changes."""
    carol = Identity.generate()
    table = _filled([(ALICE, 5), (MALLORY, 1)])
    seen = _ids(table)
    at = NOW + 10_000
    for i in range(3):
        newcomer = _node(carol, None if i == 0 else f"c{i}", ts_ms=at)
        seen.add(newcomer.record.node_id)
        table, _ = apply(table, newcomer, at, LIVE, limits=SHARED)
    counts = sorted(table.signed_by(s.peer_id) for s in (ALICE, MALLORY, carol))
    assert counts == [1, 2, 3] and len(table) == SHARED.max_records
    settled = _ids(table)
    for beat in range(1, 4):
        at += 2000
        for node in sorted(seen):
            signer = next(s for s in (ALICE, MALLORY, carol) if node.startswith(s.peer_id))
            name = node.split(":", 1)[1] if ":" in node else None
            table, verdict = apply(table, _node(signer, name, seq=at, ts_ms=at), at, LIVE, limits=SHARED)
            assert verdict is (Verdict.ACCEPTED if node in settled else Verdict.TABLE_FULL)
        assert _ids(table) == settled


def test_shares_one_apart_evict_nobody() -> None:
    table = _filled([(ALICE, 3), (MALLORY, 2), (Identity.generate(), 1)])
    assert _refused(table, _node(ALICE, "n9"), NOW) and _refused(table, _node(MALLORY, "n9"), NOW)


def test_a_lone_signer_never_evicts_its_own_records() -> None:
    assert _refused(_filled([(ALICE, 6)]), _node(ALICE, "n9", ts_ms=NOW + 10_000), NOW + 10_000)


def test_a_newcomer_with_a_bad_signature_evicts_nothing() -> None:
    table = _filled([(ALICE, 6)])
    real = _node(Identity.generate(), None)
    forged = SignedRecord(real.record, real.payload, bytes(64))
    assert admit(table, forged.record, NOW, LIVE, SHARED) is None  # its header is fair...
    assert apply(table, forged, NOW, LIVE, limits=SHARED) == (table, Verdict.BAD_SIGNATURE)  # ...its signature is not


def test_admit_and_apply_agree_on_a_full_table_and_the_signer_index_follows() -> None:
    """Whatever the shares, a new node the header check lets through is not refused for
    fullness after its signature; and the per-signer counts and the largest signer carried
    from table to table are what indexing the table afresh finds."""
    import random
    from collections import Counter

    rng = random.Random(11)
    signers = [Identity.generate() for _ in range(4)]
    limits = RegistryLimits(max_records=8, max_records_per_signer=6)
    table, at, seen = Table(), NOW, Counter[str]()
    for step in range(200):
        at += 2000
        table = expire(table, at, LIVE)  # a table built afresh, without the index carried
        signer = rng.choices(signers, weights=(6, 3, 1, 1))[0]
        newcomer = _node(signer, f"x{rng.randrange(12)}", seq=at, ts_ms=at)
        early = admit(table, newcomer.record, at, LIVE, limits)
        new, verdict = apply(table, newcomer, at, LIVE, limits=limits)
        assert verdict is (early or Verdict.ACCEPTED), step
        assert len(new) <= limits.max_records
        evicted = verdict is Verdict.ACCEPTED and len(new) == len(table) and newcomer.record.node_id not in table.entries
        seen["evicted" if evicted else verdict.name] += 1
        table = new
        afresh = Table(table.entries)
        assert table.largest_signer() == afresh.largest_signer()
        assert [table.signed_by(s.peer_id) for s in signers] == [afresh.signed_by(s.peer_id) for s in signers]
    assert min(seen["evicted"], seen["TABLE_FULL"], seen["ACCEPTED"]) > 5, seen


def test_the_registry_service_counts_what_it_evicts() -> None:
    from p2p.registry import Eviction

    service = RegistryService(_Wire(), Identity.generate(), LIVE, clock=lambda: NOW, limits=SHARED)  # type: ignore[arg-type]
    service.table = _filled([(ALICE, 6)])
    newcomer = _node(MALLORY, None).encode()
    assert service._validate(MALLORY.peer_id, newcomer)
    assert service._take(newcomer, "gossip") is Verdict.ACCEPTED
    assert service.drops[Eviction.FAIR_SHARE] == 1 and service.table.signed_by(ALICE.peer_id) == 5


def test_a_node_evicted_for_fair_share_cannot_be_brought_back_by_replaying_an_older_record() -> None:
    # Forgetting a node only at its drop horizon meant nothing forgotten could be replayed
    # (its records were all too old by then). An eviction forgets it early: a stranger who
    # kept a departed node's last Ready record replayed it once the table had room, and the
    # node was Ready again (fresh as a record received now) on that peer for a whole liveness
    # cycle, so routes went to a peer that had left.
    table = _filled([(ALICE, 5), (MALLORY, 1)])
    ready = _node(ALICE, "n4", seq=NOW + 5000, ts_ms=NOW + 5000)  # what the stranger kept
    table, _ = apply(table, ready, NOW + 5000, LIVE, limits=SHARED)
    table, _ = apply(table, _node(ALICE, "n4", seq=NOW + 6000, ts_ms=NOW + 6000, state="Dead"), NOW + 6000, LIVE, limits=SHARED)
    later = NOW + 9000
    table, verdict = apply(table, _node(Identity.generate(), None, ts_ms=later), later, LIVE, limits=SHARED)
    departed = legacy_node_id(ALICE.peer_id, "n4")
    assert verdict is Verdict.ACCEPTED and departed not in table.entries  # evicted: Dead first
    table = table.without(MALLORY.peer_id)  # room again (a node expired, or left)
    assert admit(table, ready.record, later, LIVE, SHARED) is Verdict.REPLAY
    assert apply(table, ready, later, LIVE, limits=SHARED)[1] is Verdict.REPLAY
    # The evicted node's own newer records still come back (as fair share allows).
    newer = _node(ALICE, "n4", seq=later, ts_ms=later)
    table, verdict = apply(table, newer, later, LIVE, limits=SHARED)
    assert verdict is Verdict.ACCEPTED and table.get(departed) is not None
    # What is remembered of evicted nodes is forgotten at their records' drop horizon.
    horizon = later + int(LIVE.for_record(dataclasses.replace(ready.record, heartbeat_ms=300_000)).drop_after_s * 1000) + 70_000
    assert not expire(table, horizon, LIVE).evicted


def test_what_is_remembered_of_evicted_nodes_is_bounded() -> None:
    limits = RegistryLimits(max_records=4, max_records_per_signer=64)
    table = _filled([(ALICE, 4)], limits)
    at = NOW + 10_000
    for i in range(12):  # each fresh identity takes the place of one of Alice's legacy nodes...
        newcomer = _node(Identity.generate(), None, ts_ms=at)
        table, _ = apply(table, newcomer, at, LIVE, limits=limits)
        table, _ = apply(table, _node(ALICE, f"m{i}", seq=at, ts_ms=at), at, LIVE, limits=limits)  # ...and she vouches anew
        table = table.without(newcomer.record.node_id)
        at += 1000
    assert 0 < len(table.evicted) <= limits.max_records


def test_expire_reads_the_table_only_when_something_may_fall_due(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ageing task calls :func:`expire` every second: it reads every entry (each asking
    :meth:`Liveness.for_record`) only when the earliest drop a pass saw, lowered by each
    record applied since, has come; in between it returns the table untouched. It still
    forgets each node at its drop horizon, one synced in late with an old timestamp too."""
    bob, carol = Identity.generate(), Identity.generate()
    reads = [0]
    original = Liveness.for_record
    ageing = [False]

    def counted(self: Liveness, record: object) -> Liveness:
        reads[0] += ageing[0]
        return original(self, record)  # type: ignore[arg-type]

    monkeypatch.setattr(Liveness, "for_record", counted)

    def age(table: Table, now: int) -> Table:
        ageing[0] = True
        try:
            return expire(table, now, LIVE)
        finally:
            ageing[0] = False

    table = Table()
    for who in (ALICE, bob):
        table, _ = apply(table, signed(who, 0, 10), NOW, LIVE)
    table = age(table, NOW)
    assert reads[0] == 2  # the first pass reads both
    drop = int(LIVE.drop_after_s * 1000)
    for second in range(1, 50):  # bob beats every 2 s, alice has gone quiet
        now = NOW + second * 1000
        if second % 2 == 0:
            table, verdict = apply(table, signed(bob, 0, 10, seq=1 + second, ts_ms=now), now, LIVE)
            assert verdict is Verdict.ACCEPTED
        table = age(table, now)
    assert reads[0] == 2 and len(table) == 2  # 49 idle seconds, no pass read the table again
    # carol arrives by sync with a record 55 s old: she falls due 5 s before alice does
    carol_ts = NOW - 5_000
    table, _ = apply(table, signed(carol, 10, 20, ts_ms=carol_ts), NOW + 50_000, LIVE, via="sync")
    assert len(age(table, carol_ts + drop)) == 3
    table = age(table, carol_ts + drop + 1)
    assert carol.peer_id not in table.entries and len(table) == 2
    passes = reads[0]
    table = age(table, NOW + drop)
    assert reads[0] == passes and ALICE.peer_id in table.entries  # alice is not due yet either
    table = age(table, NOW + drop + 1)
    assert ALICE.peer_id not in table.entries and bob.peer_id in table.entries


def test_views_age_as_effective_state_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """A listing builds a view per record (the healer's each second, several per chat
    request): each entry's ageing is worked out once, not per listing, and the states are
    :func:`effective_state`'s at every moment, for slow beaters and departed nodes too."""
    bob, carol = Identity.generate(), Identity.generate()
    table = Table()
    for record in (signed(ALICE, 0, 10), signed(bob, 10, 20, heartbeat_ms=30_000), signed(carol, 20, 30, state="Dead")):
        table, verdict = apply(table, record, NOW, LIVE)
        assert verdict is Verdict.ACCEPTED
    reads = [0]
    original = Liveness.for_record

    def counted(self: Liveness, record: object) -> Liveness:
        reads[0] += 1
        return original(self, record)  # type: ignore[arg-type]

    monkeypatch.setattr(Liveness, "for_record", counted)
    for ms in range(0, 400_000, 500):
        listed = list(table.views(NOW + ms, LIVE))
        assert [v.record.node_id for v in listed] == sorted(table.entries)
        assert [v.state for v in listed] == [effective_state(table.entries[v.record.node_id], NOW + ms, LIVE) for v in listed]
    reads[0] -= 800 * 2  # effective_state's own (carol's is Dead without asking)
    assert reads[0] <= 3  # once per entry, not per listing (before: 1,600)
    # a table built from it by a heartbeat lists in the same order and ages the new entry afresh
    newer, _ = apply(table, signed(bob, 10, 20, seq=2, ts_ms=NOW + 100_000, heartbeat_ms=30_000), NOW + 100_000, LIVE)
    assert [v.record.node_id for v in newer.views(NOW, LIVE)] == sorted(newer.entries)
    assert {v.record.node_id: v.state for v in newer.views(NOW + 100_000, LIVE)} == {
        ALICE.peer_id: "Dead", bob.peer_id: "Ready", carol.peer_id: "Dead"}


def _heal_facts(table: Table, model: str, now_ms: int) -> list[tuple[object, ...]]:
    """What healing reads of ``model``'s views at ``now_ms``."""
    return [(v.record.node_id, *(getattr(v.record, f) for f in HEAL_FIELDS), v.state)
            for v in table.views(now_ms, LIVE) if v.record.model_id == model]  # fmt: skip


def test_heal_key_stands_through_heartbeats_and_changes_with_what_healing_reads() -> None:
    """The healer looks each second and a swarm's heartbeats change the table about as
    often: a heartbeat (counters, freshness) keeps the model's key, so the look is skipped;
    a change healing reads (draining, layers, a node added or removed) changes it, and
    another model's changes do not."""
    bob, carol, dave = Identity.generate(), Identity.generate(), Identity.generate()
    table = Table()
    for rec in (signed(ALICE, 0, 10), signed(bob, 10, 20), signed(carol, 20, 30), signed(dave, 0, 30, model_id="m:2")):
        table, _ = apply(table, rec, NOW, LIVE)
    key = table.heal_key(MODEL, NOW, LIVE)
    other = table.heal_key("m:2", NOW, LIVE)
    at = NOW + 1000
    table, _ = apply(table, signed(ALICE, 0, 10, seq=2, ts_ms=at, uptime_s=9, vram_mb=99), at, LIVE)
    assert table.heal_key(MODEL, at, LIVE) == key  # a heartbeat
    table, _ = apply(table, signed(dave, 0, 30, model_id="m:2", seq=2, ts_ms=at, draining=True), at, LIVE)
    assert table.heal_key(MODEL, at, LIVE) == key and table.heal_key("m:2", at, LIVE) != other
    for change in ({"draining": True}, {"start_layer": 12}, {"state": "Joining"}, {"idle": True}, {"relayed": True}):
        at += 1
        changed, _ = apply(table, signed(bob, 10, 20, seq=at, ts_ms=at, **change), at, LIVE)
        assert changed.heal_key(MODEL, at, LIVE) != key, change
    newcomer, _ = apply(table, signed(Identity.generate(), 0, 10, ts_ms=at), at, LIVE)
    assert newcomer.heal_key(MODEL, at, LIVE) != key
    assert remove(table, bob.peer_id).heal_key(MODEL, at, LIVE) != key
    assert table.heal_key(MODEL, at, LIVE) == key  # the table they were built from still stands


def test_heal_key_changes_when_a_silent_node_turns_and_not_before() -> None:
    """A node ageing into Degraded, then Dead, changes what healing reads with no record
    arriving: the key changes at the first look after each turn, and at no other (the
    others beat every 2 s, which moves their own turns out of the way)."""
    bob, carol = Identity.generate(), Identity.generate()
    table = Table()
    for rec in (signed(ALICE, 0, 10), signed(bob, 10, 20), signed(carol, 20, 30)):
        table, _ = apply(table, rec, NOW, LIVE)
    keys = {}
    for ms in range(0, 14_001, 100):
        if ms and ms % 2000 == 0:
            for who, start in ((ALICE, 0), (bob, 10)):
                table, verdict = apply(table, signed(who, start, start + 10, seq=NOW + ms, ts_ms=NOW + ms), NOW + ms, LIVE)
                assert verdict is Verdict.ACCEPTED
        keys[ms] = table.heal_key(MODEL, NOW + ms, LIVE)
    changed = [ms for ms in keys if ms and keys[ms] != keys[ms - 100]]
    assert changed == [6100, 12100]  # carol Degraded after 6 s of silence, Dead after 12 s
    assert table.view(carol.peer_id, NOW + 12_100, LIVE).state == "Dead"  # type: ignore[union-attr]


def test_equal_heal_keys_mean_equal_views_whatever_happens() -> None:
    """Random heartbeats, changes, new nodes, removals, ageing and expiry, with the clock
    moving by up to 7 s (a silent node turns meanwhile) and sometimes back: whenever a key
    comes back, what healing reads of the model's views is what it was then."""
    import random

    rng = random.Random(11)
    ids = [Identity.generate() for _ in range(6)]
    held: dict[str, dict[str, object]] = {}
    table, now, seen = Table(), NOW, {}
    repeats = 0
    for _ in range(1500):
        roll = rng.random()
        if roll < 0.35:
            now += rng.choice([1, 100, 1000, 3000, 7000]) if rng.random() < 0.95 else -rng.randrange(1, 2000)
        elif roll < 0.9:
            who = rng.choice(ids)
            fields = held.setdefault(who.peer_id, {"start": 0, "end": 10})
            if rng.random() < 0.3:
                key = rng.choice(["draining", "idle", "state", "layers", "model_id", "heartbeat_ms"])
                fields[key] = {"draining": lambda: rng.random() < 0.5, "idle": lambda: rng.random() < 0.5,
                               "state": lambda: rng.choice(["Ready", "Joining", "Dead", "Degraded"]),
                               "layers": lambda: rng.choice([(0, 10), (10, 20), (20, 30), (0, 30)]),
                               "model_id": lambda: rng.choice([MODEL, "m:2"]),
                               "heartbeat_ms": lambda: rng.choice([0, 1000, 4000])}[key]()  # fmt: skip
            start, end = fields.get("layers", (0, 10))  # type: ignore[misc]
            extra = {k: v for k, v in fields.items() if k not in ("start", "end", "layers", "seq")}
            seq = max(now, int(fields.get("seq", 0)) + 1)  # type: ignore[call-overload]
            fields["seq"] = seq
            table, _ = apply(table, signed(who, start, end, seq=seq, ts_ms=now - rng.choice([0, 0, 3000]), uptime_s=seq % 97, **extra),
                             now, LIVE, via=rng.choice(["gossip", "sync"]))  # fmt: skip
        elif roll < 0.95:
            table = remove(table, rng.choice(ids).peer_id)
        else:
            table = expire(table, now, LIVE)
        for model in (MODEL, "m:2"):
            key, facts = (model, table.heal_key(model, now, LIVE)), _heal_facts(table, model, now)
            if key in seen:
                repeats += 1
                assert seen[key] == facts
            seen[key] = facts
    assert repeats > 1000  # most looks found nothing to do


def test_heal_key_changes_when_a_node_turned_before_its_next_record_came() -> None:
    """Alice turns Degraded by silence with nobody looking; then a neighbour's sync hands us
    a newer record of hers, signed long ago (slow beats: still Degraded, and Dead only
    later). At that moment old and new read the same, yet the last look saw her Ready: the
    record came after the bound the key stood on, so the key changes."""
    carol = Identity.generate()
    table = Table()
    for rec in (signed(ALICE, 0, 10), signed(carol, 10, 30)):
        table, _ = apply(table, rec, NOW, LIVE)
    key = table.heal_key(MODEL, NOW, LIVE)
    for ms in (2000, 4000, 6000):
        table, _ = apply(table, signed(carol, 10, 30, seq=NOW + ms, ts_ms=NOW + ms), NOW + ms, LIVE)
    late = signed(ALICE, 0, 10, seq=NOW + 6500, ts_ms=NOW - 12_500, heartbeat_ms=4000)
    table, verdict = apply(table, late, NOW + 6500, LIVE, via="sync")
    assert verdict is Verdict.ACCEPTED
    assert table.view(ALICE.peer_id, NOW + 6600, LIVE).state == "Degraded"  # type: ignore[union-attr]
    assert table.heal_key(MODEL, NOW + 6600, LIVE) != key


def test_heal_marks_stay_bounded_by_the_table() -> None:
    """A stranger cycling model ids (a node of a new model each time, then gone) leaves a
    row per model behind; the rows are rebuilt once they outnumber twice the table."""
    table, stranger = Table(), Identity.generate()
    table, _ = apply(table, signed(ALICE, 0, 10), NOW, LIVE)
    key = table.heal_key(MODEL, NOW, LIVE)
    for i in range(1, 500):
        table, verdict = apply(table, signed(stranger, 0, 10, model_id=f"m:x{i}", seq=i, ts_ms=NOW), NOW, LIVE)
        assert verdict is Verdict.ACCEPTED
        table = remove(table, stranger.peer_id)
        assert len(table.__dict__["_heal"].marks) <= 2 * len(table) + 8 + 1
    assert table.heal_key(MODEL, NOW, LIVE) != key  # rebuilt: new tokens (a look lists once)


def test_periodic_syncs_that_teach_nothing_back_off_and_one_that_teaches_resets() -> None:
    """An idle swarm's periodic pulls taught nothing (heartbeats brought it all) and cost
    a stream and a whole table decoded every ~30 s on each peer: they slow down to
    ``sync_max_interval``, never stop, and come back to ``sync_interval`` when one teaches."""
    service = RegistryService(None, Identity.generate(), LIVE, sync_interval=30.0, sync_max_interval=120.0)  # type: ignore[arg-type]
    periods = []
    for _ in range(4):
        service.synced(0)
        periods.append(service._sync_period)
    assert periods == [60.0, 120.0, 120.0, 120.0]
    service.synced(1)
    assert service._sync_period == 30.0
