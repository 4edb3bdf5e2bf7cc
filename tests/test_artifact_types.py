"""The artifact store's settings and the small parsers at its edge."""

from __future__ import annotations

import pytest

from inclavate.artifact_types import (
    ArtifactConfig,
    ArtifactMeta,
    BadArtifactRequest,
    Usage,
    media_type_of,
    rfc3339,
    safe_filename,
)
from inclavate.errors import ConfigError


def test_config_from_the_environment() -> None:
    assert ArtifactConfig.from_env({}) == ArtifactConfig()
    cfg = ArtifactConfig.from_env({"DPPAN_ARTIFACT_MAX_BYTES": "1000", "DPPAN_ARTIFACT_MAX_OBJECTS": " 7 ",
                                   "DPPAN_ARTIFACT_TTL_HOURS": "0.5"})  # fmt: skip
    assert (cfg.max_bytes, cfg.max_objects, cfg.ttl_hours, cfg.ttl_ms) == (1000, 7, 0.5, 1_800_000)
    assert cfg.sweep_interval_s == 60.0
    assert ArtifactConfig.from_env({"DPPAN_ARTIFACT_TTL_HOURS": "0.001"}).sweep_interval_s == pytest.approx(0.9)


@pytest.mark.parametrize(
    "env",
    [{"DPPAN_ARTIFACT_MAX_BYTES": "-1"}, {"DPPAN_ARTIFACT_MAX_BYTES": "1e9"}, {"DPPAN_ARTIFACT_MAX_OBJECTS": "lots"},
     {"DPPAN_ARTIFACT_TTL_HOURS": "0"}, {"DPPAN_ARTIFACT_TTL_HOURS": "nan"}, {"DPPAN_ARTIFACT_TTL_HOURS": "-2"},
     {"DPPAN_ARTIFACT_TTL_HOURS": "inf"}],
)  # fmt: skip
def test_a_bad_setting_stops_the_peer(env: dict[str, str]) -> None:
    with pytest.raises(ConfigError):
        ArtifactConfig.from_env(env)


def test_media_types() -> None:
    assert media_type_of(None) == media_type_of("") == "application/octet-stream"
    assert media_type_of("Audio/X-WAV; codecs=1") == "audio/x-wav"
    for bad in ["audio", "audio/", "/wav", "a/b/c", "au dio/wav", "audio/w\x00av", "ü/x"]:
        with pytest.raises(BadArtifactRequest):
            media_type_of(bad)


def test_filenames_are_display_text_only() -> None:
    assert safe_filename("../../etc/passwd") == "passwd"
    assert safe_filename("C:\\Users\\x\\clip.wav") == "clip.wav"
    assert safe_filename("a\x00b\x1f\u202ec.wav") == "abc.wav"  # controls and bidi overrides go
    assert safe_filename(None) == safe_filename("") == safe_filename("..") == "file"
    assert len(safe_filename("x" * 1000)) == 255


def test_meta_records_round_trip_and_are_strict() -> None:
    meta = ArtifactMeta("1deaf021-07a3-407c-9d6f-1af47c23db18", "audio/wav", 3, "ab", "ready", "generated", 1_754_471_662_981)
    assert ArtifactMeta.from_record(meta.to_record()) == meta
    assert meta.to_json()["created_at"] == rfc3339(1_754_471_662_981) == "2025-08-06T09:14:22.981Z"
    for field, value in [("state", "done"), ("kind", "stolen"), ("size_bytes", -1), ("size_bytes", True), ("id", 5)]:
        with pytest.raises(ValueError):
            ArtifactMeta.from_record({**meta.to_record(), field: value})


def test_usage_json() -> None:
    assert "default_ttl_hours" not in Usage().to_json()
    assert Usage(default_ttl_hours=2.0).to_json()["default_ttl_hours"] == 2.0
    with pytest.raises(ValueError):
        Usage.from_json({"generated": {"bytes": -1, "objects": 0}, "uploaded": {}, "max_bytes": 0, "max_objects": 0})


@pytest.mark.parametrize("recorded, served", [
    ("text/plain", "text/plain; charset=utf-8"),
    ("text/plain; charset=utf-8", "text/plain; charset=utf-8"),  # a transcript, as a generator records it
    ("text/plain; charset=UTF-16", "text/plain; charset=utf-16"),  # an upload's own charset is kept
    ('text/plain; format=flowed; charset="iso-8859-1"', "text/plain; charset=iso-8859-1"),
    ("text/plain; charset=a b", "text/plain; charset=utf-8"),  # not a token: not repeated
    ("audio/wav; codecs=1", "audio/wav"),
    ("text/html; charset=utf-8", "application/octet-stream"),
])  # fmt: skip
def test_a_download_is_served_by_its_type_s_essence_with_text_s_own_charset(recorded: str, served: str) -> None:
    """A transcript recorded as ``text/plain; charset=utf-8`` went out as octet-stream (an
    audit from outside), and the first fix labelled every text UTF-8, garbling a UTF-16
    upload (a review, the same day)."""
    from api.downloads import served_media_type

    assert served_media_type(recorded) == served
