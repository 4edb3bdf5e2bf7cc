"""The id codec: valid UUIDs (v4 layout) that carry their owner's tag."""

from __future__ import annotations

import uuid

import pytest

from inclavate.owner_ids import MalformedId, new_id, owner_candidates, owner_tag, parse_id, tag_of

PEER_A = "12D3KooWAaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
PEER_B = "12D3KooWBbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb"


def test_new_id_is_a_version_4_uuid_carrying_the_owner_tag() -> None:
    id_ = new_id(PEER_A)
    parsed = uuid.UUID(id_)
    assert str(parsed) == id_ and parsed.version == 4 and parsed.variant == uuid.RFC_4122
    assert tag_of(id_) == owner_tag(PEER_A)
    assert owner_candidates(id_, [PEER_B, PEER_A]) == [PEER_A]
    assert owner_candidates(id_, [PEER_B]) == []


def test_ids_are_unique_and_random_beyond_the_tag() -> None:
    ids = {new_id(PEER_A) for _ in range(2000)}
    assert len(ids) == 2000
    assert len({i[9:] for i in ids}) == 2000


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
