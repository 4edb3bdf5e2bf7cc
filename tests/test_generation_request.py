"""``POST /v1/generations`` body validation (api/generation_request.py): every 400."""

from __future__ import annotations

import pytest

from api.errors import BadRequest
from api.generation_request import parse_generation, parse_page
from inclavate.errors import ConfigError
from inclavate.generation_settings import MAX_DEADLINE_S, GenerationSettings

ID = "1deaf021-07a3-407c-9d6f-1af47c23db18"


def test_a_full_body_parses() -> None:
    job = parse_generation({"model": "piper:joe", "modality": "audio", "params": {"text": "hi"}, "seed": 42,
                            "input_artifacts": [ID.upper()], "idempotency_key": "k", "deadline_seconds": 120}, 600)  # fmt: skip
    assert job.model == "piper:joe" and job.seed == 42 and job.input_artifacts == (ID,)
    assert job.idempotency_key == "k" and job.deadline_s == 120.0


@pytest.mark.parametrize(
    "body, field",
    [
        ([], "JSON object"),
        ({"modality": "audio"}, "model"),
        ({"model": "m", "modality": "smell"}, "modality"),
        ({"model": "m", "modality": "audio", "params": [1]}, "params"),
        ({"model": "m", "modality": "audio", "params": {"text": "x" * 70_000}}, "params take more"),
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
        parse_generation(body, 600)


def test_page_bounds() -> None:
    assert parse_page({}) == (100, 0)
    assert parse_page({"limit": "5", "offset": "10"}) == (5, 10)
    assert parse_page({"offset": str(10**15)}) == (100, 10**15)
    # Past SQLite's 64-bit integers the job table raised OverflowError: a 500.
    for args in ({"limit": "0"}, {"limit": "1001"}, {"offset": "-1"}, {"limit": "x"}, {"offset": str(10**15 + 1)},
                 {"offset": "9223372036854775808"}, {"offset": "99999999999999999999999"},
                 # read like /v1/artifacts' numbers: ASCII digits, nothing else
                 {"limit": "+5"}, {"limit": " 5"}, {"limit": "１"}, {"offset": "1_0"}):  # fmt: skip
        with pytest.raises(BadRequest):
            parse_page(args)


def test_the_default_deadline_is_the_servers() -> None:
    assert parse_generation({"model": "m", "modality": "audio"}, 42.0).deadline_s == 42.0


def test_settings_from_the_environment() -> None:
    settings = GenerationSettings.from_env({"DPPAN_SPEECH_SYNC_TIMEOUT_SECS": "5", "DPPAN_GENERATION_WORKERS": "2"})
    assert settings.speech_sync_timeout_s == 5.0 and settings.workers == 2 and settings.default_deadline_s == 600.0
    assert settings.transcription_max_seconds == 3600.0
    assert GenerationSettings.from_env({"DPPAN_TRANSCRIPTION_MAX_SECONDS": "300"}).transcription_max_seconds == 300.0
    for bad in ({"DPPAN_GENERATION_DEADLINE_SECS": "90000"}, {"DPPAN_SPEECH_SYNC_TIMEOUT_SECS": "soon"},
                {"DPPAN_TRANSCRIPTION_MAX_SECONDS": "0"},
                {"DPPAN_GENERATION_QUEUE_MAX": "0"}, {"DPPAN_MUSIC_SYNC_TIMEOUT_SECS": "nan"},
                {"DPPAN_SPEECH_MODEL": "/models/tts.gguf"}, {"DPPAN_SPEECH_MMPROJ": "/models/proj.gguf"}):  # fmt: skip
        with pytest.raises(ConfigError, match=next(iter(bad))):
            GenerationSettings.from_env(bad)
