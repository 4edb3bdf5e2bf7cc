"""Registry merge rules as a pure reducer: signatures, replays, clocks, ageing."""

from __future__ import annotations

import dataclasses

import pytest
from registry_helpers import MODEL, signed, view

from inclavate.types import LayerRange
from p2p.coverage import has_chain, model_coverage, uncovered
from p2p.identity import Identity
from p2p.records import InvalidRecord, NodeRecord, SignedRecord
from p2p.registry import Liveness, Table, Verdict, apply, effective_state, expire

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
