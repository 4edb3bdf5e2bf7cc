"""The real generators in process: Piper speaks, Whisper transcribes it back (no fixtures)."""

from __future__ import annotations

import io
import wave

import numpy as np
import pytest
from speech_checks import SENTENCE, SENTENCE_MAX_WER, rms, tone_wav, wav_facts, word_error_rate

from node.generators.base import GenerationCancelled, GenerationFailed, GenerationTask, InputMedia, InvalidParams
from node.generators.piper_speech import MAX_PIECE_PHONEMES, pieces

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


LONG_UNPUNCTUATED = " ".join(["the quick brown fox jumps over the lazy dog while the river runs past the old mill"] * 25)
"""One sentence of 400 words, no punctuation: Piper's phonemizer gives it as one run of
~2,300 phonemes, one ONNX call of tens of seconds with no cancel check inside."""


def _synthesized(monkeypatch: pytest.MonkeyPatch, generators: dict) -> tuple[object, list[list[str]]]:
    """The real voice, and the phoneme runs it is asked to speak from now on."""
    voice = generators["piper:joe"]._loaded()
    runs: list[list[str]] = []
    real = voice.phonemes_to_ids

    def recording(phonemes: list[str]) -> list[int]:
        runs.append(list(phonemes))
        return real(phonemes)

    monkeypatch.setattr(voice, "phonemes_to_ids", recording)
    return voice, runs


def test_normal_sentences_are_spoken_as_piper_splits_them(speech_generators: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    voice, runs = _synthesized(monkeypatch, speech_generators)
    speak(speech_generators, TWO_SENTENCES)
    assert runs == [s for s in voice.phonemize(TWO_SENTENCES) if s]  # the same calls Piper's synthesize makes


def test_a_long_sentence_is_spoken_in_bounded_pieces(speech_generators: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """Cancel is checked between synthesis calls, so no call may be long: the sentence is cut
    between words (after a comma when there is one), nothing lost but the spaces at cuts."""
    voice, runs = _synthesized(monkeypatch, speech_generators)
    (sentence,) = voice.phonemize(LONG_UNPUNCTUATED)
    assert len(sentence) > 10 * MAX_PIECE_PHONEMES
    cut = pieces(sentence)
    assert all(0 < len(p) <= MAX_PIECE_PHONEMES for p in cut)
    assert "".join("".join(p) for p in cut).replace(" ", "") == "".join(sentence).replace(" ", "")
    assert all(p[0] != " " and p[-1] != " " for p in cut)
    assert pieces([" "]) == [] and pieces(list("x" * 25), 10) == [list("x" * 10)] * 2 + [list("x" * 5)]
    with_comma = pieces(list("abc def, gh ij"), 12)
    assert ["".join(p) for p in with_comma] == ["abc def,", "gh ij"]
    clip = speak(speech_generators, LONG_UNPUNCTUATED, max_duration_seconds=6.0)
    assert 1 < len(runs) < 10 and all(len(r) <= MAX_PIECE_PHONEMES for r in runs)
    assert wav_facts(clip)[3] == pytest.approx(6.0, abs=1 / 22050)  # stopped mid-sentence, at the limit


def test_cancel_takes_effect_within_a_long_sentence(speech_generators: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, the check came only between sentences: a cancel during this one waited for
    the whole of it. Now it is seen after the piece under way."""
    _, runs = _synthesized(monkeypatch, speech_generators)
    task = GenerationTask("job", "piper:joe", "audio", {"text": LONG_UNPUNCTUATED})
    with pytest.raises(GenerationCancelled):
        speech_generators["piper:joe"].run(task, lambda: bool(runs), lambda stage, fraction: None)
    assert len(runs) == 1  # one bounded piece spoken, then the cancel


@pytest.mark.parametrize(
    "params, inputs, message",
    [
        ({"text": "hi", "voice": "alloy"}, 0, "unknown voice 'alloy'.*joe"),
        ({"text": "hi", "speed": 3.0}, 0, "speed must be within"),
        ({"text": "hi"}, 1, "speaker_unsupported"),
        ({"text": ""}, 0, "params.text is required"),
        ({"text": "hi", "language": "de"}, 0, "speaks en"),
        ({"text": "hi", "max_duration_seconds": -1}, 0, "max_duration_seconds"),
        # a 500 on /v1/audio/speech until 2026-12-07: espeak crashed on the NUL, and the job
        # failed on text without a letter or digit
        ({"text": "a\x00b"}, 0, "NUL character"),
        ({"text": "..."}, 0, "nothing to speak"),
        ({"text": "\u200b"}, 0, "nothing to speak"),
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


def _whisper(generators: dict, max_seconds: float) -> object:
    """The session's whisper generator with another audio limit (the model stays shared)."""
    from copy import copy

    whisper = copy(generators["whisper:tiny.en"])
    whisper.max_seconds = max_seconds
    return whisper


def _refusal(generator: object, clips: list[bytes], cancelled: object = lambda: False,
             raises: type[Exception] = GenerationFailed) -> tuple[Exception, int]:  # fmt: skip
    """(the error, peak traced bytes) of a transcription that must fail with ``raises``."""
    import tracemalloc

    import av  # noqa: F401 - imported before tracing: a first import allocates ~1 MB of its own

    task = GenerationTask("job", "whisper:tiny.en", "text", {"prompt": "transcribe"}, None,
                          tuple(InputMedia(clip, "audio/wav") for clip in clips))  # fmt: skip
    tracemalloc.start()
    try:
        with pytest.raises(raises) as refused:
            generator.run(task, cancelled, lambda stage, fraction: None)  # type: ignore[attr-defined]
        return refused.value, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_whisper_refuses_an_implausible_sample_rate_before_decoding(speech_generators: dict) -> None:
    """An audit (2026-12-07): at 1 Hz every byte of an 8-bit WAV is a second of audio, which
    the decoder resampled to 16 kHz float32 whole (~0.85 MB per uploaded byte). 300 bytes
    here would have been 19 MB of samples; refused on the header, it allocates nothing."""
    error, peak = _refusal(speech_generators["whisper:tiny.en"], [tone_wav(1, 300)])
    assert error.code == "unsupported_input"  # type: ignore[attr-defined]
    assert peak < 2_000_000, peak


def test_whisper_refuses_a_clip_over_the_limit_on_its_header_and_while_decoding(speech_generators: dict) -> None:
    whisper = _whisper(speech_generators, max_seconds=2.0)
    error, peak = _refusal(whisper, [tone_wav(8000, 60)])  # the header says 60 s: refused before decoding
    assert error.code == "input_too_large" and peak < 2_000_000, peak  # type: ignore[attr-defined]
    # Each header is within the limit; the job's clips together are not: the decode stops.
    error, _ = _refusal(whisper, [tone_wav(8000, 1.5), tone_wav(8000, 1.5)])
    assert error.code == "input_too_large"  # type: ignore[attr-defined]


def test_whisper_stops_decoding_when_cancelled(speech_generators: dict) -> None:
    """The cancel flag is read between decoded frames: a job cancelled (or past its deadline)
    while its clip decodes stops there, not after the whole clip is in memory."""
    calls = iter([False])  # run's own check passes; the decode loop's first check stops it
    _, peak = _refusal(speech_generators["whisper:tiny.en"], [tone_wav(8000, 600)], lambda: next(calls, True),
                       raises=GenerationCancelled)  # fmt: skip
    assert peak < 10_000_000, peak  # 600 s whole: 9.6 MB of s16, then 38 MB of float32


CLAUSES = ("When the storm finally passed over the valley late on Sunday evening, the farmers walked out into their "
           "fields, counted the broken fences and the fallen trees and agreed among themselves that the damage could "
           "be repaired before the spring planting began in earnest.")  # fmt: skip
"""Cut at commas and, where none falls in a window, between words (scripts/bench_speech_cuts.py's first)."""


def _spoken_with_joins(generators: dict, monkeypatch: pytest.MonkeyPatch, text: str) -> tuple[np.ndarray, list[tuple[int, int, str]]]:
    """The peer's audio for ``text`` (int16), and per join the sample where the piece before
    it ends, the sample where the next begins, and the kind of cut."""
    from node.generators import piper_speech

    voice = generators["piper:joe"]._loaded()
    (sentence,) = voice.phonemize(text)
    kinds = [before for _, _, before in piper_speech._steps(pieces(sentence))]
    edges: list[tuple[int, int]] = []
    real = piper_speech._joinable

    def recording(audio: np.ndarray, rate: int, trim_start: bool, trim_end: bool) -> np.ndarray:
        out = real(audio, rate, trim_start, trim_end)
        start = edges[-1][1] if edges else 0
        if edges and kinds[len(edges) - 1] == "clause":
            start += int(piper_speech.CLAUSE_PAUSE_S * rate)
        edges.append((start, start + len(out)))
        return out

    monkeypatch.setattr(piper_speech, "_joinable", recording)
    with wave.open(io.BytesIO(speak(generators, text)), "rb") as clip:
        audio = np.frombuffer(clip.readframes(clip.getnframes()), dtype="<i2")
    assert edges[-1][1] == len(audio)
    return audio, [(edges[i][1], edges[i + 1][0], kinds[i]) for i in range(len(edges) - 1)]


def _silence_around(audio: np.ndarray, at: int, rate: int = 22050) -> float:
    """Seconds of -40 dBFS silence (5 ms frames) around sample ``at``."""
    frame = rate // 200
    n = len(audio) // frame
    quiet = np.sqrt(np.mean(audio[: n * frame].astype(np.float64).reshape(n, frame) ** 2, axis=1)) < 327
    i = min(at // frame, n - 1)
    lo, hi = i, i
    while lo > 0 and quiet[lo - 1]:
        lo -= 1
    while hi + 1 < n and quiet[hi + 1]:
        hi += 1
    return (hi - lo + 1) * frame / rate if quiet[i] else 0.0


def test_joins_are_silent_at_the_seam_with_a_comma_pause_or_none(speech_generators: dict,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Each piece began and ended in ~0.1 s of Piper's silence, so a cut between words put
    a 110-250 ms pause inside a phrase, and a cut at a comma 150-315 ms where the whole
    sentence pauses ~375 ms. Now: no pause but the pieces' 10 ms faded tails between
    words, CLAUSE_PAUSE_S at a comma, and every seam meets at zero (no click)."""
    from node.generators.piper_speech import CLAUSE_PAUSE_S, EDGE_KEEP_S

    audio, joins = _spoken_with_joins(speech_generators, monkeypatch, CLAUSES)
    assert {kind for _, _, kind in joins} == {"clause", "word"}
    for end, start, kind in joins:
        assert abs(int(audio[end - 1])) <= 1 and abs(int(audio[start])) <= 1  # faded to zero on both sides
        pause = _silence_around(audio, end)
        if kind == "word":
            assert pause <= 2 * EDGE_KEEP_S + _QUIET_PHONEMES_S, (end, pause)
        else:
            assert start - end == int(CLAUSE_PAUSE_S * 22050)
            assert CLAUSE_PAUSE_S <= pause <= CLAUSE_PAUSE_S + 2 * EDGE_KEEP_S + _QUIET_PHONEMES_S, (end, pause)


_QUIET_PHONEMES_S = 0.03
"""Quiet that the sounds beside a seam add to the faded tails. Piper samples noise for its
durations and waveform (no seed reaches its graph), so it varies from run to run: 15-30 ms
around a word seam in 40 runs of this text, 35 ms in 1 of 30 others, which the allowance of
10 ms before failed. The pauses this test guards against were 110-250 ms."""


def test_a_sentence_in_pieces_lasts_about_as_long_as_spoken_whole(speech_generators: dict) -> None:
    from piper import SynthesisConfig

    voice = speech_generators["piper:joe"]._loaded()
    (whole,) = voice.synthesize(CLAUSES, SynthesisConfig(length_scale=1.0))
    in_pieces = wav_facts(speak(speech_generators, CLAUSES))[3]
    assert in_pieces == pytest.approx(len(whole.audio_int16_array) / 22050, rel=0.15)
    assert word_error_rate(CLAUSES, transcribe(speech_generators, speak(speech_generators, CLAUSES))) <= 0.2


def test_edges_are_trimmed_only_at_cuts(speech_generators: dict) -> None:
    """A sentence's own ends keep Piper's silence (its pause between sentences)."""
    from piper import SynthesisConfig

    from node.generators.piper_speech import EDGE_KEEP_S, _joinable

    voice = speech_generators["piper:joe"]._loaded()
    (audio,) = voice.synthesize(SENTENCE, SynthesisConfig(length_scale=1.0))
    audio = audio.audio_int16_array
    assert np.array_equal(_joinable(audio, 22050, False, False), audio)
    trimmed = _joinable(audio, 22050, True, True)
    assert len(trimmed) < len(audio) and trimmed[0] == 0 and trimmed[-1] == 0
    assert _silence_around(trimmed, 0) <= EDGE_KEEP_S + 0.005 and _silence_around(trimmed, len(trimmed) - 1) <= EDGE_KEEP_S + 0.005
    assert np.array_equal(_joinable(np.zeros(1000, np.int16), 22050, True, True), np.zeros(1000, np.int16))


def test_a_sentence_in_one_piece_is_piper_s_own_audio(speech_generators: dict) -> None:
    """Without noise Piper is deterministic: the peer's bytes are ``synthesize``'s."""
    from piper import SynthesisConfig

    from node.generators.piper_speech import _raw, _sentence

    voice = speech_generators["piper:joe"]._loaded()
    config = SynthesisConfig(length_scale=1.0, noise_scale=0.0, noise_w_scale=0.0)
    (sentence,) = voice.phonemize(SENTENCE)
    (piper,) = voice.synthesize(SENTENCE, config)
    assert _sentence([(_raw(voice, sentence, config), False, None)], config, 22050) == piper.audio_int16_bytes


def test_the_pieces_of_a_sentence_share_its_peak(speech_generators: dict) -> None:
    """Each piece normalized to its own peak put a gain step between neighbours (1.6 dB
    median, 5.4 max, scripts/bench_speech_cuts.py) that the whole sentence never has."""
    from piper import SynthesisConfig

    from node.generators.piper_speech import _raw, _sentence

    voice = speech_generators["piper:joe"]._loaded()
    config = SynthesisConfig(length_scale=1.0, noise_scale=0.0, noise_w_scale=0.0)
    (sentence,) = voice.phonemize(CLAUSES)
    raw = [_raw(voice, piece, config) for piece in pieces(sentence)]
    peak = max(float(np.max(np.abs(a))) for a in raw)
    pcm = np.frombuffer(_sentence([(a, False, None) for a in raw], config, 22050), dtype=np.int16)
    expected = np.concatenate([np.clip(a / peak * 32767.0, -32767, 32767).astype(np.int16) for a in raw])
    assert len(raw) > 2 and np.array_equal(pcm, expected)
    assert int(np.max(np.abs(pcm))) == 32767  # the loudest piece reaches full scale, the others keep their level
