"""``POST /v1/generations`` body validation (api/generation_request.py): every 400."""

from __future__ import annotations

import pytest

from api.errors import BadRequest
from api.generation_request import MAX_DEADLINE_S, parse_generation, parse_page

ID = "1deaf021-07a3-407c-9d6f-1af47c23db18"


def test_a_full_body_parses() -> None:
    job = parse_generation({"model": "piper:joe", "modality": "audio", "params": {"text": "hi"}, "seed": 42,
                            "input_artifacts": [ID.upper()], "idempotency_key": "k", "deadline_seconds": 120})  # fmt: skip
    assert job.model == "piper:joe" and job.seed == 42 and job.input_artifacts == (ID,)
    assert job.idempotency_key == "k" and job.deadline_s == 120.0


@pytest.mark.parametrize(
    "body, field",
    [
        ([], "JSON object"),
        ({"modality": "audio"}, "model"),
        ({"model": "m", "modality": "smell"}, "modality"),
        ({"model": "m", "modality": "audio", "params": [1]}, "params"),
        ({"model": "m", "modality": "audio", "seed": -1}, "seed"),
        ({"model": "m", "modality": "audio", "seed": True}, "seed"),
        ({"model": "m", "modality": "audio", "input_artifacts": ["../etc"]}, "input_artifacts"),
        ({"model": "m", "modality": "audio", "input_artifacts": [ID] * 17}, "input_artifacts"),
        ({"model": "m", "modality": "audio", "idempotency_key": ""}, "idempotency_key"),
        ({"model": "m", "modality": "audio", "idempotency_key": "x" * 300}, "idempotency_key"),
        ({"model": "m", "modality": "audio", "deadline_seconds": 0}, "deadline_seconds"),
        ({"model": "m", "modality": "audio", "deadline_seconds": MAX_DEADLINE_S + 1}, "24 hours"),
    ],
)
def test_bad_bodies_are_400_naming_the_field(body: object, field: str) -> None:
    with pytest.raises(BadRequest, match=field):
        parse_generation(body)


def test_page_bounds() -> None:
    assert parse_page({}) == (100, 0)
    assert parse_page({"limit": "5", "offset": "10"}) == (5, 10)
    for args in ({"limit": "0"}, {"limit": "1001"}, {"offset": "-1"}, {"limit": "x"}):
        with pytest.raises(BadRequest):
            parse_page(args)
