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
from p2p.records import InvalidRecord, MetricSample, NodeRecord, SignedRecord, slim_record
from p2p.registry import Cadence, Liveness, Table, Verdict, apply, effective_state, expire

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


async def test_a_heartbeat_without_known_details_asks_its_connected_owner_once() -> None:
    class Connected(_Wire):
        def __init__(self, connected: set[str]) -> None:
            super().__init__()
            self.connected = connected

        def is_connected(self, peer: str) -> bool:
            return peer in self.connected

    asked: list[str] = []
    bob = Identity.generate()
    service = RegistryService(Connected({ALICE.peer_id}), Identity.generate(), LIVE, clock=lambda: NOW)  # type: ignore[arg-type]

    async def sync_with(peer: str) -> int:
        asked.append(peer)
        return 0

    service.sync_with = sync_with  # type: ignore[method-assign]
    async with trio.open_nursery() as nursery:
        service._nursery = nursery
        for seq in (2, 3):  # two heartbeats, one question
            service._take(SignedRecord.sign(slim_record(_full(seq).record), ALICE).encode(), "gossip")
        service._take(SignedRecord.sign(slim_record(signed(bob, 10, 20, ts_ms=NOW).record), bob).encode(), "gossip")
        service._take(_full(4).encode(), "gossip")
    assert asked == [ALICE.peer_id]  # bob is not connected: its heartbeat makes us dial nobody
    assert service.table.get(ALICE.peer_id).record.samples  # the full record filled the gap
