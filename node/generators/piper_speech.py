"""Text to speech with Piper (``piper-tts``, ONNX on CPU): one voice per installed model.

Piper speaks sentence by sentence, which gives the natural *frame* of this generator:
cancellation and progress are checked between pieces, ``max_duration_seconds`` stops
synthesis once enough audio exists and cuts the last piece to the exact length, and the
WAV is written whole at the end (nothing half-written on cancel). A piece is a sentence as
Piper's phonemizer splits them, unless it is longer than :data:`MAX_PIECE_PHONEMES`: then it
is cut at a comma (or colon, semicolon), else between words (:func:`pieces`). One ONNX call
per 2,300-phoneme sentence without punctuation took tens of seconds, and a cancel waited for
all of it; a piece takes about a second on a busy 2-core VM. Sentences within the bound are
spoken exactly as Piper's own ``synthesize`` speaks them; a sentence's pieces are held
until its last one so that all are normalized to the sentence's peak, as Piper does. At a cut, each piece's silent edge
(~0.1 s) is trimmed to a 10 ms faded tail (:func:`_joinable`), and :data:`CLAUSE_PAUSE_S` of
silence goes between pieces cut at a clause mark: the pieces' own edges paused ~190 ms
between two words of a phrase and too briefly at a comma (``scripts/bench_speech_cuts.py``).

Capabilities: the voice is a ``builtin_voice`` (baked into the checkpoint, no speaker clip:
``requires_speaker: false``); ``languages`` come from the voice's own ``.onnx.json``;
``speed`` maps onto Piper's ``length_scale`` (duration multiplier) as ``1 / speed``, within
:data:`SPEED_RANGE`. The ONNX session loads on first use, not at peer start, so a peer that
never speaks pays nothing for offering the voice.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from node.generators.base import (
    CancelCheck,
    GenerationCancelled,
    GenerationFailed,
    GenerationTask,
    GeneratorOutput,
    InvalidParams,
    Modality,
    ProgressReport,
)
from node.generators.params import optional_number, optional_str
from node.generators.wav import SAMPLE_WIDTH, encode_wav, frames_for

SPEED_RANGE = (0.5, 2.0)
"""Piper stays intelligible within these length scales (2x faster to 2x slower)."""

MAX_TEXT_CHARS = 4096
"""OpenAI's own ``input`` limit for speech; longer text belongs in several jobs."""

MAX_DURATION_S = 600.0
"""Ceiling on ``max_duration_seconds`` (ten minutes of 22 kHz int16 is ~26 MB)."""

MAX_PIECE_PHONEMES = 80
"""The longest run of phonemes synthesized in one call (so between two cancel checks):
0.7 s for 50 and 1.3 s for 100 on the 2-core VM under load; most sentences are shorter."""

_CLAUSE_ENDS = frozenset(",;:")
"""Phonemes after which a long sentence is best cut (Piper keeps punctuation as phonemes)."""

CLAUSE_PAUSE_S = 0.35
"""The silence at a join after a comma, colon or semicolon (times ``length_scale``): spoken
whole, this voice pauses 260-540 ms there (median ~390 ms, ``scripts/bench_speech_cuts.py``),
while a piece's own edges gave 150-315 ms."""

EDGE_KEEP_S = 0.01
"""Of a piece's silent edge at a join, this much is kept (the tail of its last sound). Each
piece starts and ends in ~0.1 s of silence, so a cut between words put a ~190 ms pause in
the middle of a phrase, where the whole sentence has none."""

_SILENCE = 327
"""-40 dBFS in int16: a 5 ms frame quieter than this (RMS) is silence."""


class PiperSpeech:
    modality: Modality = "audio"

    def __init__(self, model: str, voice_name: str, onnx_path: Path) -> None:
        self.model = model
        self.voice_name = voice_name
        self.onnx_path = onnx_path
        config = json.loads(onnx_path.with_name(onnx_path.name + ".json").read_text("utf-8"))
        self.sample_rate = int(config["audio"]["sample_rate"])
        language = config.get("language", {})
        family = language.get("family") or str(language.get("code", "")).split("_")[0]
        self.languages = sorted({family}) if family else []
        self._voice: Any = None
        self._lock = threading.Lock()

    def capabilities(self) -> dict[str, Any]:
        entry: dict[str, Any] = {
            "modality": "audio",
            "model": self.model,
            "builtin_voices": [self.voice_name],
            "requires_speaker": False,
            "speed_range": {"min": SPEED_RANGE[0], "max": SPEED_RANGE[1]},
        }
        if self.languages:
            entry["languages"] = self.languages
        return entry

    def check(self, modality: str, params: Mapping[str, Any], n_inputs: int) -> None:
        if modality != "audio":
            raise InvalidParams(f"{self.model} generates audio, not {modality}")
        if n_inputs:
            raise InvalidParams(f"speaker_unsupported: {self.model} has a built-in voice and takes no speaker clip")
        if params.get("reference_text") is not None:
            raise InvalidParams(f"{self.model} does not take reference_text")
        text = params.get("text")
        if not isinstance(text, str) or not text.strip():
            raise InvalidParams("params.text is required: the text to speak")
        if len(text) > MAX_TEXT_CHARS:
            raise InvalidParams(f"params.text is longer than {MAX_TEXT_CHARS} characters")
        # Refused here, before a job exists: a NUL crashed the job inside espeak (a C string),
        # and text without a letter or digit ("...", a zero-width space) failed it with
        # "nothing to speak": both were a 500 on /v1/audio/speech (an audit, 2026-12-07).
        if "\x00" in text:
            raise InvalidParams("params.text holds a NUL character (U+0000), which no voice can speak")
        if not any(ch.isalnum() for ch in text):
            raise InvalidParams("params.text has nothing to speak: it holds no letter or digit")
        voice = optional_str(params, "voice")
        if voice is not None and voice != self.voice_name:
            raise InvalidParams(f"unknown voice {voice!r} for {self.model}; voices: {self.voice_name}")
        optional_number(params, "speed", 0.0, 1e9)
        speed = params.get("speed")
        if speed is not None and not SPEED_RANGE[0] <= speed <= SPEED_RANGE[1]:
            raise InvalidParams(f"speed must be within {SPEED_RANGE[0]}-{SPEED_RANGE[1]} for {self.model}, got {speed}")
        optional_number(params, "max_duration_seconds", 0.0, MAX_DURATION_S)
        language = optional_str(params, "language", max_length=16)
        if language is not None and self.languages and language.split("-")[0].lower() not in self.languages:
            raise InvalidParams(f"{self.model} speaks {', '.join(self.languages)}, not {language!r}")

    def run(self, task: GenerationTask, cancelled: CancelCheck, progress: ProgressReport) -> GeneratorOutput:
        params = task.params
        self.check(task.modality, params, len(task.inputs))
        from piper import SynthesisConfig

        if cancelled():
            raise GenerationCancelled()
        progress("loading", 0.0)
        voice = self._loaded()
        speed = params.get("speed") or 1.0
        config = SynthesisConfig(length_scale=1.0 / float(speed))
        limit_s = params.get("max_duration_seconds")
        limit = frames_for(float(limit_s), self.sample_rate) if limit_s else None
        todo = [step for sentence in voice.phonemize(params["text"]) for step in _steps(pieces(sentence))]
        if not todo:
            raise GenerationFailed("inference_failed", "the text has nothing to speak")
        if voice.config.sample_rate != self.sample_rate:
            raise GenerationFailed("inference_failed", "the voice produced audio in an unexpected format")
        pcm = bytearray()
        held: list[tuple[Any, bool, str | None]] = []  # the sentence's pieces so far, raw
        progress("generating", 0.0)
        for done, (piece, after_cut, before) in enumerate(todo, start=1):
            if cancelled():
                raise GenerationCancelled()
            held.append((_raw(voice, piece, config), after_cut, before))
            progress("generating", min(done / len(todo), 1.0))
            if before is None or (limit is not None and len(pcm) + SAMPLE_WIDTH * sum(len(a) for a, _, _ in held) >= limit):
                pcm += _sentence(held, config, self.sample_rate)
                held = []
            if limit is not None and len(pcm) >= limit:
                del pcm[limit:]
                break
        if cancelled():
            raise GenerationCancelled()
        return GeneratorOutput(encode_wav(bytes(pcm), self.sample_rate), "audio/wav")

    def _loaded(self) -> Any:
        with self._lock:
            if self._voice is None:
                try:
                    from piper import PiperVoice

                    self._voice = PiperVoice.load(str(self.onnx_path))
                except Exception as exc:  # onnxruntime raises its own types
                    raise GenerationFailed("inference_failed", f"cannot load voice {self.model}: {exc}") from exc
            return self._voice

    def close(self) -> None:
        self._voice = None


def pieces(sentence: list[str], limit: int = MAX_PIECE_PHONEMES) -> list[list[str]]:
    """``sentence`` (phonemes) in runs of at most ``limit``: whole if it fits; else cut after
    the last clause mark in the second half of each window, else at the last space there,
    else at ``limit`` (a word longer than that). Spaces at a cut are dropped."""
    out: list[list[str]] = []
    rest = sentence
    while len(rest) > limit:
        cut = _cut(rest, limit)
        head = rest[:cut]
        while head and head[-1] == " ":
            head = head[:-1]
        if head:
            out.append(head)
        rest = rest[cut:]
        while rest and rest[0] == " ":
            rest = rest[1:]
    if any(p != " " for p in rest):
        out.append(rest)
    return out


def _steps(cut: list[list[str]]) -> list[tuple[list[str], bool, str | None]]:
    """Each piece of one sentence with how it joins the pieces around it: whether a cut
    comes before it, and the cut after it (``"clause"`` after a clause mark, ``"word"``
    between words, None at the sentence's end, where Piper's own edges stay)."""
    return [(piece, i > 0, None if i == len(cut) - 1 else "clause" if piece[-1] in _CLAUSE_ENDS else "word")
            for i, piece in enumerate(cut)]  # fmt: skip


def _joinable(audio: Any, rate: int, trim_start: bool, trim_end: bool) -> Any:
    """``audio`` (int16) with its silent edge at a cut trimmed to :data:`EDGE_KEEP_S`, the
    kept edge faded to zero so that pieces meet at 0 (no click at a join). Piper's edges
    are left alone at a sentence's ends, where its own pause between sentences belongs."""
    import numpy as np

    frame = max(1, int(0.005 * rate))
    keep = int(EDGE_KEEP_S * rate)
    n = len(audio) // frame
    loud = np.sqrt(np.mean(audio[: n * frame].astype(np.float64).reshape(n, frame) ** 2, axis=1)) >= _SILENCE
    if not loud.any():
        return audio
    start = max(0, int(np.argmax(loud)) * frame - keep) if trim_start else 0
    end = min(len(audio), (n - int(np.argmax(loud[::-1]))) * frame + keep) if trim_end else len(audio)
    out = audio[start:end].astype(np.float64)
    if trim_start:
        out[:keep] *= np.linspace(0.0, 1.0, len(out[:keep]))
    if trim_end:
        tail = max(0, len(out) - keep)
        out[tail:] *= np.linspace(1.0, 0.0, len(out) - tail)
    return out.astype(np.int16)


def _cut(phonemes: list[str], limit: int) -> int:
    window = range(limit // 2, limit)
    for marks in (_CLAUSE_ENDS, frozenset(" ")):
        found = [i for i in window if phonemes[i] in marks]
        if found:
            return found[-1] + 1
    return limit


def _raw(voice: Any, phonemes: list[str], config: Any) -> Any:
    """One run of phonemes through the voice, before any normalization (float samples)."""
    return voice.phoneme_ids_to_audio(voice.phonemes_to_ids(phonemes), config)


def _sentence(held: list[tuple[Any, bool, str | None]], config: Any, rate: int) -> bytes:
    """A sentence's pieces (raw audio, cut before, cut after) as int16 PCM, finished as
    Piper's ``PiperVoice.synthesize`` finishes a sentence: normalized to the sentence's
    peak (each piece to its own put a gain step of 1.6 dB median, 5.4 max, at a cut), volume,
    clip; then joined (:func:`_joinable`, with :data:`CLAUSE_PAUSE_S` after a clause mark).
    A sentence in one piece comes out exactly as Piper speaks it."""
    import numpy as np

    peak = max((float(np.max(np.abs(audio))) for audio, _, _ in held if len(audio)), default=0.0)
    out = bytearray()
    for audio, after_cut, before in held:
        if config.normalize_audio:
            audio = np.zeros_like(audio) if peak < 1e-8 else audio / peak
        if config.volume != 1.0:
            audio = audio * config.volume
        audio = np.clip(audio, -1.0, 1.0).astype(np.float32)
        int16 = np.clip(audio * 32767.0, -32767.0, 32767.0).astype(np.int16)  # AudioChunk.audio_int16_array
        out += _joinable(int16, rate, after_cut, before is not None).tobytes()
        if before == "clause":
            out += bytes(frames_for(CLAUSE_PAUSE_S * config.length_scale, rate))
    return bytes(out)
