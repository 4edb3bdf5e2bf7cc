"""The id codec: valid UUIDs (v4 layout) that carry their owner's 60-bit tag, whose first 32
bits are the tag of ids minted before (legacy ids, still in peers' tables)."""

from __future__ import annotations

import uuid

import pytest
from owner_grinding import ground

import inclavate.owner_ids as owner_ids
from inclavate.owner_ids import (
    MalformedId,
    Owners,
    carries_owner,
    new_id,
    owner_candidates,
    parse_id,
)

PEER_A = "12D3KooWAaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
PEER_B = "12D3KooWBbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb"
HONEST = "12D3KooWBhonest"
HOSTILE = "12D3KooWAhostile"  # sorts first: asked first among candidates that tie


def digest_of(peer: str) -> bytes:
    """The owner digest, through the module's hashlib (which :func:`ground` replaces)."""
    return owner_ids.hashlib.sha256(b"inclavate/owner-tag/1:" + peer.encode()).digest()


def legacy_id(owner: str) -> str:
    """An id as minted before the widening: the 32-bit tag, then 90 random bits."""
    raw = bytearray(uuid.uuid4().bytes)
    raw[:4] = digest_of(owner)[:4]
    return str(uuid.UUID(bytes=bytes(raw)))


def test_new_id_is_a_version_4_uuid_carrying_the_owner_tag() -> None:
    id_ = new_id(PEER_A)
    parsed = uuid.UUID(id_)
    assert str(parsed) == id_ and parsed.version == 4 and parsed.variant == uuid.RFC_4122
    assert owner_candidates(id_, [PEER_B, PEER_A]) == [PEER_A]
    assert owner_candidates(id_, [PEER_B]) == []


@pytest.mark.parametrize("peer", [PEER_A, PEER_B, HONEST, HOSTILE, ""])
def test_the_tag_is_the_digest_s_first_60_bits_around_the_version_nibble(peer: str) -> None:
    """Bytes 0-5, the low nibble of byte 6 and byte 7 are the digest's first 60 bits: its
    first 32 are the old tag, so an old peer still finds the owner of a new id."""
    raw, digest = uuid.UUID(new_id(peer)).bytes, digest_of(peer)
    assert raw[:4] == digest[:4]  # the 32-bit tag, as before
    tag = int.from_bytes(digest[:8], "big") >> 4
    assert int.from_bytes(raw[:6], "big") == tag >> 12 and raw[6] & 0x0F == (tag >> 8) & 0x0F and raw[7] == tag & 0xFF
    assert raw[6] >> 4 == 4 and raw[8] >> 6 == 0b10  # version 4, RFC 4122 variant


def test_ids_are_unique_and_random_in_their_62_bits() -> None:
    """Every one of the 62 random bits (byte 8's low 6, bytes 9-15) varies between ids, and
    nothing else does."""
    ids = [uuid.UUID(new_id(PEER_A)).int for _ in range(2000)]
    assert len(set(ids)) == 2000
    varying = 0
    for i in ids:
        varying |= i ^ ids[0]
    assert varying == (1 << 62) - 1


def test_parse_id_normalises_case() -> None:
    id_ = new_id(PEER_B)
    assert parse_id(id_.upper()) == id_


@pytest.mark.parametrize(
    "text",
    ["", "nope", "../../etc/passwd", "1deaf021-07a3-407c-9d6f-1af47c23db1", "1deaf021-07a3-407c-9d6f-1af47c23db18x",
     "1deaf02107a3407c9d6f1af47c23db18", "{1deaf021-07a3-407c-9d6f-1af47c23db18}", "1deaf021_07a3_407c_9d6f_1af47c23db18",
     "１deaf021-07a3-407c-9d6f-1af47c23db18", "x" * 10000],
)  # fmt: skip
def test_parse_id_refuses_anything_but_a_uuid(text: str) -> None:
    with pytest.raises(MalformedId):
        parse_id(text)


def test_a_peer_ground_to_an_owners_32_bit_tag_is_no_candidate_for_its_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    """An identity ground to the honest peer's 32-bit tag (about 2^32 / N key generations)
    was a candidate owner of every id the honest peer mints, asked first when it sorts
    first; now only a peer carrying the id's whole 60-bit tag is."""
    ground(monkeypatch, HONEST, HOSTILE)
    assert new_id(HOSTILE)[:8] == new_id(HONEST)[:8]  # the grinding worked: the old tag is shared
    id_ = new_id(HONEST)
    assert owner_candidates(id_, [HOSTILE, HONEST]) == [HONEST]
    assert owner_candidates(new_id(HOSTILE), [HOSTILE, HONEST]) == [HOSTILE]


def test_lookup_preference_the_whole_tag_wins_over_a_32_bit_match(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lookup preference: a peer carrying the whole tag is the only candidate, whatever
    else shares the first 32 bits; an owner this peer does not know leaves the 32-bit
    match (the grinder) as the candidate, as for a legacy id."""
    ground(monkeypatch, HONEST, HOSTILE)
    owners = Owners([HOSTILE, HONEST, PEER_A])
    id_ = new_id(HONEST)
    assert owners.candidates(id_) == [HONEST]
    assert Owners([HOSTILE, PEER_A]).candidates(id_) == [HOSTILE]  # what remains: an unknown owner


def test_a_legacy_id_falls_back_to_its_32_bit_tag(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ids minted before the widening have random bits where the tag's last 28 now are:
    matching no known peer's whole tag, they go to every peer carrying their 32 bits (the
    grinder too: what remains for legacy ids)."""
    old = legacy_id(PEER_A)
    assert owner_candidates(old, [PEER_B, PEER_A]) == [PEER_A]
    assert owner_candidates(old, [PEER_B]) == []
    ground(monkeypatch, HONEST, HOSTILE)
    assert owner_candidates(legacy_id(HONEST), [HOSTILE, HONEST, PEER_A]) == [HOSTILE, HONEST]


def test_a_peer_may_list_its_own_ids_and_legacy_ids_of_its_32_bit_tag(monkeypatch: pytest.MonkeyPatch) -> None:
    """Row validation: an id carrying the answering peer's whole tag, or a legacy id (its
    60-bit field names no known peer) carrying its 32 bits; never an id whose whole tag
    names another known peer, nor one of another tag."""
    ground(monkeypatch, HONEST, HOSTILE)
    known = Owners([HONEST, HOSTILE, PEER_A])
    mine, theirs, old = new_id(HONEST), new_id(PEER_A), legacy_id(HONEST)
    assert known.carries_owner(mine, HONEST) and known.carries_owner(old, HONEST)
    assert not known.carries_owner(theirs, HONEST) and not known.carries_owner(legacy_id(PEER_A), HONEST)
    assert not known.carries_owner(mine, HOSTILE)  # the ground identity, for the honest peer's ids
    assert known.carries_owner(old, HOSTILE)  # what remains: the honest peer's legacy ids
    assert known.carries_owner(new_id("12D3KooWstranger"), "12D3KooWstranger")  # a peer not in the registry (yet)
    assert carries_owner(mine, HONEST) and not carries_owner(mine, HOSTILE, known=[HONEST])


def _reference_carries(id_: str, peer: str, known: list[str]) -> bool:
    """The rule as the layout states it, bit by bit (what Owners' string compares must equal)."""
    raw = uuid.UUID(id_).bytes
    field = (int.from_bytes(raw[:6], "big") << 12) | ((raw[6] & 0x0F) << 8) | raw[7]

    def tag(p: str) -> int:
        return int.from_bytes(digest_of(p)[:8], "big") >> 4

    return field == tag(peer) or (field not in {tag(k) for k in known} and field >> 28 == tag(peer) >> 28)


def test_carries_owner_is_the_rule_for_every_kind_of_id(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its string shortcuts (its own ids, legacy ids of a peer alone with its 32 bits) agree
    with the bit-level rule on new, legacy, another peer's, and odd-version ids, for peers
    with and without a ground twin, and for a peer it was not built with."""
    ground(monkeypatch, HONEST, HOSTILE)
    known = [HONEST, HOSTILE, PEER_A, PEER_B]
    owners = Owners(known)
    ids = []
    for peer in [*known, "12D3KooWstranger"]:
        ids += [new_id(peer), legacy_id(peer), new_id(peer)[:14] + "5" + new_id(peer)[15:]]
    ids += [str(uuid.uuid4()) for _ in range(5)]
    for id_ in ids:
        for peer in [*known, "12D3KooWstranger"]:
            assert owners.carries_owner(id_, peer) == _reference_carries(id_, peer, known), (id_, peer)
