"""The real generators in process: Piper speaks, Whisper transcribes it back (no fixtures)."""

from __future__ import annotations

import pytest
from speech_checks import SENTENCE, SENTENCE_MAX_WER, rms, wav_facts, word_error_rate

from node.generators.base import GenerationCancelled, GenerationFailed, GenerationTask, InputMedia, InvalidParams

TWO_SENTENCES = "The first sentence is short. The second sentence follows it."

pytestmark = pytest.mark.slow


def speak(generators: dict, text: str, **params: object) -> bytes:
    task = GenerationTask("job", "piper:joe", "audio", {"text": text, **params})
    return generators["piper:joe"].run(task, lambda: False, lambda stage, fraction: None).data


def transcribe(generators: dict, clip: bytes, media_type: str = "audio/wav", **params: object) -> str:
    task = GenerationTask("job", "whisper:tiny.en", "text", {"prompt": "transcribe", **params}, None,
                          (InputMedia(clip, media_type),))  # fmt: skip
    output = generators["whisper:tiny.en"].run(task, lambda: False, lambda stage, fraction: None)
    assert output.media_type.startswith("text/plain")
    return output.data.decode()


def test_capabilities_follow_the_spec(speech_generators: dict) -> None:
    piper = speech_generators["piper:joe"].capabilities()
    assert piper == {"modality": "audio", "model": "piper:joe", "builtin_voices": ["joe"], "requires_speaker": False,
                     "speed_range": {"min": 0.5, "max": 2.0}, "languages": ["en"]}  # fmt: skip
    assert speech_generators["whisper:tiny.en"].capabilities() == {
        "modality": "text", "kind": "understand", "model": "whisper:tiny.en", "ready": True, "input_modalities": ["audio"],
    }  # fmt: skip


def test_piper_speaks_a_valid_wav_that_is_not_silence(speech_generators: dict) -> None:
    clip = speak(speech_generators, SENTENCE)
    rate, channels, width, seconds = wav_facts(clip)
    assert (rate, channels, width) == (22050, 1, 2)
    assert 1.0 < seconds < 6.0
    assert rms(clip) > 0.02


def test_round_trip_piper_to_whisper_has_a_low_word_error_rate(speech_generators: dict) -> None:
    text = transcribe(speech_generators, speak(speech_generators, TWO_SENTENCES))
    assert word_error_rate(TWO_SENTENCES, text) <= 0.2, text


def test_speed_divides_the_duration_and_max_duration_truncates(speech_generators: dict) -> None:
    normal = wav_facts(speak(speech_generators, SENTENCE))[3]
    fast = wav_facts(speak(speech_generators, SENTENCE, speed=2.0))[3]
    assert fast < normal * 0.75
    cut = speak(speech_generators, TWO_SENTENCES, max_duration_seconds=0.75)
    assert wav_facts(cut)[3] == pytest.approx(0.75, abs=1 / 22050)


def test_piper_stops_between_sentences_when_cancelled(speech_generators: dict) -> None:
    calls: list[float] = []

    def progress(stage: str, fraction: float) -> None:
        calls.append(fraction)

    task = GenerationTask("job", "piper:joe", "audio", {"text": TWO_SENTENCES})
    with pytest.raises(GenerationCancelled):
        speech_generators["piper:joe"].run(task, lambda: bool([c for c in calls if c > 0]), progress)
    assert calls and max(calls) < 1.0  # stopped after the first sentence, not at the end


@pytest.mark.parametrize(
    "params, inputs, message",
    [
        ({"text": "hi", "voice": "alloy"}, 0, "unknown voice 'alloy'.*joe"),
        ({"text": "hi", "speed": 3.0}, 0, "speed must be within"),
        ({"text": "hi"}, 1, "speaker_unsupported"),
        ({"text": ""}, 0, "params.text is required"),
        ({"text": "hi", "language": "de"}, 0, "speaks en"),
        ({"text": "hi", "max_duration_seconds": -1}, 0, "max_duration_seconds"),
    ],
)
def test_piper_refuses_what_it_cannot_do(speech_generators: dict, params: dict, inputs: int, message: str) -> None:
    with pytest.raises(InvalidParams, match=message):
        speech_generators["piper:joe"].check("audio", params, inputs)


def test_whisper_language_is_a_filter(speech_generators: dict) -> None:
    clip = speak(speech_generators, SENTENCE)
    assert word_error_rate(SENTENCE, transcribe(speech_generators, clip, language="en")) <= SENTENCE_MAX_WER
    assert transcribe(speech_generators, clip, language="de") == ""


def test_whisper_job_errors(speech_generators: dict) -> None:
    with pytest.raises(GenerationFailed) as unsupported:
        transcribe(speech_generators, b"\x89PNG....", media_type="image/png")
    assert unsupported.value.code == "unsupported_input"
    with pytest.raises(GenerationFailed) as unreadable:
        transcribe(speech_generators, b"RIFF\x00\x00\x00\x00WAVEgarbage" * 10)
    assert unreadable.value.code == "input_unreadable"
