"""Records from strangers, without a network: every field typed, ownership, seq bound, quotas,
and our own record never silently outgrowing what receivers accept."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
from registry_helpers import record, signed

from inclavate.untrusted import Reason
from p2p.gossip import RegistryService
from p2p.identity import Identity
from p2p.record_schema import MAX_RECORD_BYTES, decode_envelope, fit_record
from p2p.records import (
    InvalidRecord,
    MetricSample,
    MinuteBucket,
    RecordProblem,
    SignedRecord,
    canonical_bytes,
    legacy_node_id,
    slim_record,
)
from p2p.registry import Liveness, RegistryLimits, Table, Verdict, apply, effective_state, expire

ALICE = Identity.generate()
NOW = 1_000_000


def envelope_of(fields: dict[str, Any], signer: Identity = ALICE) -> bytes:
    payload = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    return json.dumps({"v": 1, "record": payload.decode(), "sig": base64.b64encode(signer.sign(payload)).decode()}).encode()


def good_fields(**changes: Any) -> dict[str, Any]:
    return {**record(ALICE, 0, 10).to_json(), **changes}


def problem(data: bytes) -> object:
    with pytest.raises(InvalidRecord) as info:
        decode_envelope(data)
    return info.value.reason


def test_an_honest_record_round_trips() -> None:
    original = signed(ALICE, 0, 10, samples=(MetricSample(1.5, 2.0, 5),), buckets=(MinuteBucket(60_000, 3, 4),))
    assert decode_envelope(original.encode()).record == original.record


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"start_layer": "0"}, Reason.WRONG_TYPE),
        ({"end_layer": 10.0}, Reason.WRONG_TYPE),
        ({"n_layers": True}, Reason.WRONG_TYPE),
        ({"state": "Godlike"}, Reason.BAD_VALUE),
        ({"seq": 2**70}, Reason.OUT_OF_RANGE),
        ({"step_ms_per_layer": "fast"}, Reason.WRONG_TYPE),
        ({"throughput_tps": -1.0}, Reason.OUT_OF_RANGE),
        ({"buckets": [{"ts_ms": 60_000, "requests": "1", "tokens": 0}]}, Reason.WRONG_TYPE),
        ({"buckets": [{"ts_ms": 60_000, "requests": 2**70, "tokens": 0}]}, Reason.OUT_OF_RANGE),
        ({"buckets": [[1, 2, 3]]}, Reason.WRONG_TYPE),
        ({"samples": [{"tps": 1.0, "latency_ms": 1.0}]}, Reason.MISSING),
        ({"counters": {"tokens_total": -5}}, Reason.OUT_OF_RANGE),
        ({"requests_by_model": {"m": "many"}}, Reason.WRONG_TYPE),
        ({"multiaddrs": [1]}, Reason.WRONG_TYPE),
        ({"hardware": {"a": {"b": {"c": {"d": {"e": {"f": {"g": {}}}}}}}}}, Reason.TOO_DEEP),
        ({"node_id": "x" * 10_000}, Reason.TOO_LONG),
        ({"start_layer": 10, "end_layer": 10}, RecordProblem.BAD_LAYERS),
        ({"heartbeat_ms": "2000"}, Reason.WRONG_TYPE),
        ({"heartbeat_ms": -1}, Reason.OUT_OF_RANGE),
        ({"heartbeat_ms": 2**40}, Reason.OUT_OF_RANGE),
    ],
)
def test_a_mistyped_field_is_a_typed_rejection(changes: dict[str, Any], reason: object) -> None:
    assert problem(envelope_of(good_fields(**changes))) == reason


@pytest.mark.parametrize("url", [
    "http://192.168.1.1/cgi-bin/reboot?", "http://169.254.169.254/latest/meta-data#", "http://10.0.0.1:80/admin",
    "http://h:1/", "http://user:pw@h:1", "ftp://h:1", "file:///etc/passwd", "http://h:0", "http://h:1\x00", "http:///x",
])  # fmt: skip
def test_an_api_url_is_an_origin_and_nothing_more(url: str) -> None:
    """Other peers send a job's requests to a record's ``api_url`` with a fixed path appended:
    a path, query or fragment of the record's choosing had honest peers send GET, POST and
    DELETE to any path of any host they reach, a volunteer's LAN included (an audit,
    2026-12-07)."""
    assert problem(envelope_of(good_fields(api_url=url))) == Reason.BAD_VALUE
    for origin in ("", "http://127.0.0.1:8001", "https://peer.example.org", "http://[::1]:8001"):
        assert decode_envelope(envelope_of(good_fields(api_url=origin))).record.api_url == origin


def test_malformed_envelopes_are_typed_rejections() -> None:
    assert problem(b'{"records":1}') == Reason.MISSING
    assert problem(b"[" * 100_000) == Reason.TOO_DEEP
    assert problem(b'{"v":1,"record":"{}","sig":"!!"}') == Reason.BAD_VALUE
    assert problem(b'{"v":2,"record":"{}","sig":""}') == RecordProblem.BAD_VERSION
    deep = json.dumps({"v": 1, "record": "[" * 5000 + "]" * 5000, "sig": base64.b64encode(bytes(64)).decode()})
    assert problem(deep.encode()) == Reason.TOO_DEEP


def test_a_peer_cannot_publish_another_peers_node() -> None:
    mallory = Identity.generate()
    forged = good_fields(node_id=ALICE.peer_id, peer_id=mallory.peer_id)
    assert problem(envelope_of(forged, mallory)) == RecordProblem.NOT_OWNER
    # "relayed" used to be a way around it: a vouched-for node may be named anything.
    relayed = good_fields(node_id=ALICE.peer_id, peer_id=mallory.peer_id, relayed=True)
    assert problem(envelope_of(relayed, mallory)) == RecordProblem.NOT_OWNER
    other = good_fields(node_id=legacy_node_id(ALICE.peer_id, "n1"), peer_id=mallory.peer_id, relayed=True)
    assert problem(envelope_of(other, mallory)) == RecordProblem.NOT_OWNER
    mine = good_fields(node_id=legacy_node_id(mallory.peer_id, "n1"), peer_id=mallory.peer_id, relayed=True)
    assert decode_envelope(envelope_of(mine, mallory)).record.node_id == f"{mallory.peer_id}:n1"


def test_seq_may_not_run_ahead_of_the_signers_clock() -> None:
    live = Liveness()
    held, verdict = apply(Table(), signed(ALICE, 0, 10, seq=NOW, ts_ms=NOW), NOW, live)
    assert verdict is Verdict.ACCEPTED
    _, verdict = apply(held, signed(ALICE, 0, 10, seq=2**62, ts_ms=NOW), NOW, live)
    assert verdict is Verdict.SEQ_AHEAD
    # The genuine next record still gets through afterwards.
    _, verdict = apply(held, signed(ALICE, 0, 10, seq=NOW + 2000, ts_ms=NOW + 2000), NOW + 2000, live)
    assert verdict is Verdict.ACCEPTED


def test_signer_and_table_quotas() -> None:
    live, limits = Liveness(), RegistryLimits(max_records_per_signer=3, max_records=5)
    table = Table()
    for i in range(3):
        node = legacy_node_id(ALICE.peer_id, f"n{i}")
        table, verdict = apply(table, signed(ALICE, 0, 10, node_id=node, relayed=True, seq=NOW, ts_ms=NOW), NOW, live, limits=limits)
        assert verdict is Verdict.ACCEPTED
    extra = signed(ALICE, 0, 10, node_id=legacy_node_id(ALICE.peer_id, "n9"), relayed=True, seq=NOW, ts_ms=NOW)
    assert apply(table, extra, NOW, live, limits=limits)[1] is Verdict.SIGNER_FULL
    # Updating a record already held is not a new one.
    again = signed(ALICE, 0, 10, node_id=legacy_node_id(ALICE.peer_id, "n0"), relayed=True, seq=NOW + 1, ts_ms=NOW)
    updated, verdict = apply(table, again, NOW, live, limits=limits)
    assert verdict is Verdict.ACCEPTED
    # ...and leaves the signer's count where it was (counts are carried from table to table).
    assert apply(updated, extra, NOW, live, limits=limits)[1] is Verdict.SIGNER_FULL
    for _ in range(2):
        other = Identity.generate()
        table, verdict = apply(table, signed(other, 0, 10, seq=NOW, ts_ms=NOW), NOW, live, limits=limits)
        assert verdict is Verdict.ACCEPTED
    # The table is full: a new signer's node takes the place of one of Alice's while she
    # holds two more than it (the fair share), and is refused once nobody does.
    for alices in (2, 1):
        table, verdict = apply(table, signed(Identity.generate(), 0, 10, seq=NOW, ts_ms=NOW), NOW, live, limits=limits)
        assert (verdict, len(table), table.signed_by(ALICE.peer_id)) == (Verdict.ACCEPTED, 5, alices)
    assert apply(table, signed(Identity.generate(), 0, 10, seq=NOW, ts_ms=NOW), NOW, live, limits=limits)[1] is Verdict.TABLE_FULL


def test_free_identities_filling_the_table_cannot_lock_newcomers_out() -> None:
    """64 throw-away signers x 64 records, each claiming the longest believed heartbeat
    (300 s: silence keeps a record 30 x 300 s = 2.5 hours), filled every peer's table, and
    from then on every new node was refused everywhere (TABLE_FULL) for as long as they
    lived. A full table is now shared by signer: an honest newcomer, through gossip's
    header check and then the whole rules, takes the place of a hoarder's record, and the
    evicted record cannot evict a sibling to come back."""
    live, limits = Liveness(), RegistryLimits()
    clock = [NOW]
    service = RegistryService(object(), Identity.generate(), live, clock=lambda: clock[0])  # type: ignore[arg-type]
    hoarders = [Identity.generate() for _ in range(limits.max_records // limits.max_records_per_signer)]
    for hoarder in hoarders:
        for i in range(limits.max_records_per_signer):
            node = hoarder.peer_id if i == 0 else legacy_node_id(hoarder.peer_id, f"n{i}")
            hoarded = signed(hoarder, 0, 10, node_id=node, relayed=i > 0, seq=NOW, ts_ms=NOW, heartbeat_ms=300_000)
            assert service._accept(hoarded, "gossip") is Verdict.ACCEPTED
    clock[0] += 3600_000  # an hour of silence later, every hoarded record is still held
    service.table = expire(service.table, clock[0], live)
    assert len(service.table) == limits.max_records
    newcomers = [Identity.generate() for _ in range(3)]
    for peer in [ALICE, *newcomers]:
        honest = signed(peer, 0, 10, seq=clock[0], ts_ms=clock[0]).encode()
        assert service._validate(peer.peer_id, honest)
        assert service._take(honest, "gossip") is Verdict.ACCEPTED
        assert service.view(peer.peer_id) is not None and len(service.table) == limits.max_records
    # Each came at a hoarder's expense, never at an honest peer's or a hoarder's own node.
    assert all(service.view(h.peer_id) is not None for h in hoarders)
    lost = [h for h in hoarders if service.table.signed_by(h.peer_id) < limits.max_records_per_signer]
    assert len(lost) == 4 and all(service.table.signed_by(h.peer_id) == limits.max_records_per_signer - 1 for h in lost)
    # An evicted record's next heartbeat finds its signer one short of the largest: refused.
    loser = lost[0]
    gone = next(legacy_node_id(loser.peer_id, f"n{i}") for i in range(1, 64)
                if service.table.get(legacy_node_id(loser.peer_id, f"n{i}")) is None)  # fmt: skip
    back = signed(loser, 0, 10, node_id=gone, relayed=True, seq=clock[0], ts_ms=clock[0], heartbeat_ms=300_000)
    assert not service._validate(loser.peer_id, back.encode())
    assert service._take(back.encode(), "gossip") is Verdict.TABLE_FULL


def test_our_own_record_is_trimmed_to_fit_never_dropped() -> None:
    huge = record(ALICE, 0, 10, samples=tuple(MetricSample(1.0, 1.0, i) for i in range(60)),
                  buckets=tuple(MinuteBucket(i * 60_000, 1, 1) for i in range(60)),
                  hardware={"blob": "x" * (2 * MAX_RECORD_BYTES)})  # fmt: skip
    fitted = fit_record(huge, MAX_RECORD_BYTES)
    assert len(canonical_bytes(fitted)) <= MAX_RECORD_BYTES
    assert fitted.layers == huge.layers
    small = record(ALICE, 0, 10, samples=tuple(MetricSample(1.0, 1.0, i) for i in range(60)))
    assert fit_record(small, MAX_RECORD_BYTES) is small
    trimmed = fit_record(small, len(canonical_bytes(small)) - 10)
    assert 0 < len(trimmed.samples) < 60 and trimmed.samples[-1] == small.samples[-1], "newest samples kept"
    many = record(ALICE, 0, 10, requests_by_model={f"m{i}": i for i in range(100)}, multiaddrs=tuple(f"/a/{i}" for i in range(50)))
    fitted = fit_record(many)
    assert decode_envelope(SignedRecord.sign(fitted, ALICE).encode()).record == fitted
    assert "m99" in fitted.requests_by_model and "m0" not in fitted.requests_by_model


def test_decoded_numbers_are_safe_for_sqlite_sums() -> None:
    # The schema bounds counters so that a full table's sum stays a 64-bit integer.
    from p2p.record_schema import MAX_COUNT

    assert RegistryLimits().max_records * MAX_COUNT < 2**63


def test_a_slow_heartbeat_claim_buys_a_bounded_grace_and_never_fakes_freshness() -> None:
    """A record may announce a long heartbeat (a large swarm's); a liar claiming an hour is
    believed up to ``max_heartbeat_s``, and its silence still ends in Dead and then oblivion."""
    live = Liveness()
    liar = signed(ALICE, 0, 10, seq=NOW, ts_ms=NOW, heartbeat_ms=3_600_000)
    table, verdict = apply(Table(), liar, NOW, live)
    assert verdict is Verdict.ACCEPTED
    bound = live.for_record(liar.record)
    assert bound.heartbeat_s == live.max_heartbeat_s
    entry = table.get(ALICE.peer_id)
    assert effective_state(entry, NOW + int(bound.dead_after_s * 1000) + 1, live) == "Dead"
    assert len(expire(table, NOW + int(bound.drop_after_s * 1000) + 1, live)) == 0


def test_details_cannot_be_replayed_or_forged_through_the_details_path() -> None:
    """Full records carry the details (samples, buckets, hashes...) readers see through every
    slim heartbeat: an older full record, or one signed by someone else, changes nothing."""
    live = Liveness()
    details = signed(ALICE, 0, 10, seq=NOW, ts_ms=NOW, model_sha256="a" * 64)
    heartbeat = SignedRecord.sign(slim_record(details.record.replace(seq=NOW + 2000, ts_ms=NOW + 2000)), ALICE)
    table, _ = apply(Table(), details, NOW, live)
    table, _ = apply(table, heartbeat, NOW + 2000, live)
    older = signed(ALICE, 0, 10, seq=NOW - 5000, ts_ms=NOW - 5000, model_sha256="b" * 64)
    assert apply(table, older, NOW + 2000, live)[1] is Verdict.REPLAY
    mallory = Identity.generate()
    newer = details.record.replace(seq=NOW + 1000, model_sha256="c" * 64)
    forged = SignedRecord(newer, canonical_bytes(newer), mallory.sign(canonical_bytes(newer)))
    assert apply(table, forged, NOW + 2000, live)[1] is Verdict.BAD_SIGNATURE
    assert table.get(ALICE.peer_id).record.model_sha256 == "a" * 64
    # Both parts of every node count as one record against the quotas (one entry each).
    assert len(table) == 1 and len(table.signed_records()) == 2
