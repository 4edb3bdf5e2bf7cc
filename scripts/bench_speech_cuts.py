"""Whether Piper's pieces hurt a long sentence: WER, pauses, clicks and level at the joins.

Since ``MAX_PIECE_PHONEMES`` a sentence over 80 phonemes is spoken in pieces (so a cancel
is seen within a second). Each sentence below is spoken two ways: as the peer speaks it
(``PiperSpeech.run``, pieces) and whole (Piper's own ``synthesize``: one call per sentence,
as before the change), and both are transcribed by the peer's Whisper generator. Printed
per sentence: the word error rate of each against the text, and the pauses inside the
sentence in both audios (Piper gives this voice no alignments, so a join's place in the
whole audio is not known: the pauses are compared as sets, against the clause marks). Per
join: the silence there (ms), the sample jump into and out of it against the clip's median
jump in speech (a click detector), and the loudness step across it (mostly a phrase's own
rise and fall: the whole is measured at the same share of its length, not at a phrase
boundary). Last, the gain step that normalizing each piece to its own peak would put at a
join (the pieces now share their sentence's peak). Piper samples noise, so ``--runs``
repeats everything::

    PYTHONSAFEPATH=1 PYTHONPATH=. INCLAVATE_HOME=... python scripts/bench_speech_cuts.py [--runs 2]
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import wave
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from node.generators import piper_speech
from node.generators.base import GenerationTask, InputMedia
from node.generators.loader import installed_generators

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from speech_checks import word_error_rate  # noqa: E402

SENTENCES = (
    "When the storm finally passed over the valley late on Sunday evening, the farmers walked out into their "
    "fields, counted the broken fences and the fallen trees, and agreed among themselves that the damage, "
    "although serious, could be repaired before the spring planting began in earnest.",
    "The engineers who built the new bridge across the river spent most of the winter testing the steel cables "
    "and the concrete supports because the city council wanted to be certain that the structure would carry "
    "heavy trucks and crowded buses for at least a hundred years without needing major repairs.",
    "In 2019 the library lent out 48,000 books to 3,200 readers, and by 2023 the number of readers had grown to "
    "5,750 while the number of books lent each year had nearly doubled to 91,000, which the director explained "
    "by the 12 new branches that opened in the suburbs and the online catalogue that went live in the spring.",
    "The recipe is simple: mix two cups of flour with a pinch of salt and a spoonful of sugar; add the warm "
    "water slowly while stirring; knead the dough for ten minutes until it feels smooth and elastic; then "
    "cover the bowl with a clean towel and leave it in a warm corner of the kitchen for about an hour.",
    "My grandmother used to tell us about the summer she spent working at the lighthouse on the northern "
    "island where the keeper and his wife lived with their four children and a very old dog and where the "
    "supply boat came only once a month so that everyone had to plan their meals and their letters and their "
    "repairs long in advance and nobody ever complained about the quiet because the sea and the birds and the "
    "wind made more than enough noise to fill the long evenings.",
    "The train leaves from platform 9 at 6 in the morning and stops at 14 small stations before it reaches the "
    "coast about 3 hours later where more than 200 passengers get off to catch the ferry that crosses to the "
    "island in 45 minutes when the weather is calm.",
    "If you want to understand why the old town still floods every few years, you have to look at the maps "
    "from the last century, when the river was straightened to make room for the new harbour, the warehouses "
    "and the railway, because the engineers of that time did not expect the heavy rains that now arrive every "
    "autumn, and the walls they built are simply too low for the water that comes down from the hills after "
    "a wet week in the mountains, which is why the council is now debating whether to raise the walls, to "
    "move the homes that stand closest to the banks, or to give some of the fields back to the river.",
    "She opened the letter slowly and read it twice before she understood that the company had accepted her "
    "proposal and that she would be leading a team of engineers and designers in a new office across the "
    "country starting in the first week of the autumn.",
)
"""Eight single sentences of 40-120 words: commas, colon and semicolons, numbers, none at all."""

FRAME_S = 0.005
SILENCE_DBFS = -40.0
"""A 5 ms frame quieter than this (RMS against full scale) counts as silence."""
MIN_PAUSE_MS = 60.0
"""A silence this long inside a sentence is heard as a pause (stops and gaps between words are shorter)."""
LEVEL_S = 1.0
"""Loudness is compared over the speech in this much audio either side of a join."""


@dataclass
class Join:
    """One cut inside a sentence, measured in the pieces' audio."""

    after: str  # the phonemes just before the cut
    clause: bool  # cut after a comma, colon or semicolon (else between words)
    pause_ms: float  # the silence the join sits in
    jump: float  # |sample step| across the join / median |step| in speech
    level_db: float  # loudness of the speech after minus before the join


def samples_of(wav_bytes: bytes) -> np.ndarray:
    with wave.open(io.BytesIO(wav_bytes), "rb") as clip:
        return np.frombuffer(clip.readframes(clip.getnframes()), dtype="<i2").astype(np.float64) / 32768.0


def wav_of(samples: np.ndarray, rate: int) -> bytes:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes((np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes())
    return buffer.getvalue()


def silent_frames(audio: np.ndarray, rate: int) -> np.ndarray:
    frame = int(FRAME_S * rate)
    n = len(audio) // frame
    rms = np.sqrt(np.mean(audio[: n * frame].reshape(n, frame) ** 2, axis=1))
    return 20 * np.log10(np.maximum(rms, 1e-9)) < SILENCE_DBFS


def pause_ms(silent: np.ndarray, at: int, rate: int) -> float:
    """The run of silent frames around sample ``at`` (ms; 0 when it is in speech)."""
    i = min(at // int(FRAME_S * rate), len(silent) - 1)
    if not silent[i] and not (i > 0 and silent[i - 1]):
        return 0.0
    i = i if silent[i] else i - 1
    lo = hi = i
    while lo > 0 and silent[lo - 1]:
        lo -= 1
    while hi + 1 < len(silent) and silent[hi + 1]:
        hi += 1
    return (hi - lo + 1) * FRAME_S * 1000


def speech_level_db(audio: np.ndarray, silent: np.ndarray, lo: int, hi: int, rate: int) -> float:
    frame = int(FRAME_S * rate)
    lo, hi = max(0, lo), min(len(audio), hi)
    chunks = [audio[i : i + frame] for i in range(lo - lo % frame, hi, frame) if i // frame < len(silent) and not silent[i // frame]]
    if not chunks:
        return float("nan")
    return float(10 * np.log10(np.mean(np.concatenate(chunks) ** 2)))


def level_step_db(audio: np.ndarray, silent: np.ndarray, at: int, rate: int) -> float:
    span = int(LEVEL_S * rate)
    return speech_level_db(audio, silent, at, at + span, rate) - speech_level_db(audio, silent, at - span, at, rate)


def jump_ratio(audio: np.ndarray, silent: np.ndarray, at: tuple[int, int], rate: int) -> float:
    """The larger step into and out of the join (piece to pause to piece), against the
    median step inside speech: speech itself has steps up to ~10x its median."""
    frame = int(FRAME_S * rate)
    steps = np.abs(np.diff(audio))
    voiced = np.repeat(~silent, frame)[: len(steps)]
    typical = float(np.median(steps[: len(voiced)][voiced])) if voiced.any() else 1e-9
    return max(float(abs(audio[a] - audio[a - 1])) for a in at) / max(typical, 1e-9)


def spoken_in_pieces(piper: Any, text: str) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """The peer's own path (``PiperSpeech.run``), and for each join the sample where the
    piece before it ends and the one where the next begins (a clause's pause between)."""
    edges: list[tuple[int, int]] = []  # (start, end) of each piece in the clip
    real = piper_speech._joinable

    def recording(audio: Any, rate: int, trim_start: bool, trim_end: bool) -> Any:
        out = real(audio, rate, trim_start, trim_end)
        start = edges[-1][1] if edges else 0
        if trim_start and edges and gaps[len(edges) - 1]:
            start += piper_speech.frames_for(piper_speech.CLAUSE_PAUSE_S, rate) // 2
        edges.append((start, start + len(out)))
        return out

    voice = piper._loaded()
    gaps = [p[-1] in ",;:" for s in voice.phonemize(text) for p in piper_speech.pieces(s)]
    piper_speech._joinable = recording
    try:
        data = piper.run(GenerationTask("cut", "piper:joe", "audio", {"text": text}), lambda: False, lambda s, f: None).data
    finally:
        piper_speech._joinable = real
    audio = samples_of(data)
    assert edges[-1][1] == len(audio), "the joins were not where this script expects them"
    return audio, [(edges[i][1], edges[i + 1][0]) for i in range(len(edges) - 1)]


def spoken_whole(voice: Any, text: str) -> np.ndarray:
    """Piper's own ``synthesize``: one call for the sentence, as before the pieces."""
    from piper import SynthesisConfig

    (chunk,) = voice.synthesize(text, SynthesisConfig(length_scale=1.0))
    return chunk.audio_int16_array.astype(np.float64) / 32768.0


def inner_pauses(silent: np.ndarray) -> list[float]:
    """Every run of silence inside the clip, not at its ends (ms), of at least MIN_PAUSE_MS."""
    runs, start = [], None
    for i, quiet in enumerate(silent):
        if quiet and start is None:
            start = i
        elif not quiet and start is not None:
            if start > 0:
                runs.append((i - start) * FRAME_S * 1000)
            start = None
    return [r for r in runs if r >= MIN_PAUSE_MS]


def gain_steps(voice: Any, sentence: list[str]) -> list[float]:
    """|dB| between the gains that normalizing each piece to its own peak (as before the
    pieces shared their sentence's) would give two neighbours: a step the whole never has."""
    from piper import SynthesisConfig

    config = SynthesisConfig(length_scale=1.0)
    peaks = [float(np.max(np.abs(piper_speech._raw(voice, p, config)))) for p in piper_speech.pieces(sentence)]
    return [abs(20 * float(np.log10(a / b))) for a, b in zip(peaks, peaks[1:])]


def cut_positions(sentence: list[str], cut: list[list[str]]) -> list[int]:
    """The index in ``sentence`` of the last phoneme of each piece but the last."""
    positions, at = [], 0
    for piece in cut:
        while sentence[at] == " ":
            at += 1
        assert sentence[at : at + len(piece)] == piece
        at += len(piece)
        positions.append(at - 1)
    return positions[:-1]


def transcribe(whisper: Any, audio: np.ndarray, rate: int) -> str:
    task = GenerationTask("asr", "whisper:tiny.en", "text", {"prompt": "transcribe"}, None,
                          (InputMedia(wav_of(audio, rate), "audio/wav"),))  # fmt: skip
    return whisper.run(task, lambda: False, lambda s, f: None).data.decode()


@dataclass
class Sentence:
    number: int
    wer_cut: float
    wer_whole: float
    seconds_cut: float
    seconds_whole: float
    pauses_cut: list[float]  # inner pauses, joins included
    pauses_whole: list[float]
    marks: int  # clause marks inside the sentence
    joins: list[Join]
    level_whole_db: list[float]  # loudness steps of the whole at the joins' share of its length
    gain_steps_db: list[float]  # what per-piece normalization would add at each join


def one_sentence(generators: dict, number: int, text: str, rate: int) -> Sentence:
    piper, whisper = generators["piper:joe"], generators["whisper:tiny.en"]
    voice = piper._loaded()
    (sentence,) = [s for s in voice.phonemize(text) if s]
    cut = piper_speech.pieces(sentence)
    cut_audio, joins_at = spoken_in_pieces(piper, text)
    whole_audio = spoken_whole(voice, text)
    assert len(joins_at) == len(cut) - 1
    silent_cut, silent_whole = silent_frames(cut_audio, rate), silent_frames(whole_audio, rate)
    joins = [Join("".join(sentence[max(0, i - 5) : i + 1]), sentence[i] in ",;:", pause_ms(silent_cut, at[0], rate),
                  jump_ratio(cut_audio, silent_cut, at, rate), level_step_db(cut_audio, silent_cut, at[0], rate))
             for at, i in zip(joins_at, cut_positions(sentence, cut))]  # fmt: skip
    scale = len(whole_audio) / len(cut_audio)
    level_whole = [level_step_db(whole_audio, silent_whole, int(at[0] * scale), rate) for at in joins_at]
    return Sentence(number, word_error_rate(text, transcribe(whisper, cut_audio, rate)),
                    word_error_rate(text, transcribe(whisper, whole_audio, rate)), len(cut_audio) / rate,
                    len(whole_audio) / rate, inner_pauses(silent_cut), inner_pauses(silent_whole),
                    sum(p in ",;:" for p in sentence[:-1]), joins, level_whole, gain_steps(voice, sentence))  # fmt: skip


def show(run: int, text: str, s: Sentence) -> None:
    print(f"run {run} sentence {s.number} ({len(text.split())} words, {s.marks} clause marks): WER pieces "
          f"{s.wer_cut:.3f} whole {s.wer_whole:.3f}; {s.seconds_cut:.1f} s vs {s.seconds_whole:.1f} s; inner pauses "
          f"pieces {_ms(s.pauses_cut)}, whole {_ms(s.pauses_whole)}")  # fmt: skip
    for j in s.joins:
        print(f"    join after {j.after!r:16} {'clause' if j.clause else 'word  '}: pause {j.pause_ms:4.0f} ms, "
              f"jump x{j.jump:.2f}, level step {j.level_db:+.1f} dB")  # fmt: skip


def _ms(values: list[float]) -> str:
    return "[" + " ".join(f"{v:.0f}" for v in values) + "]"


def report(rows: list[Sentence], runs: int) -> None:
    wer_cut = statistics.mean(r.wer_cut for r in rows)
    wer_whole = statistics.mean(r.wer_whole for r in rows)
    joins = [j for r in rows for j in r.joins]
    clause = [j.pause_ms for j in joins if j.clause]
    word = [j.pause_ms for j in joins if not j.clause]
    whole_pauses = [p for r in rows for p in r.pauses_whole]

    def spread(values: list[float]) -> str:
        return f"median {statistics.median(values):.0f}, min {min(values):.0f}, max {max(values):.0f} ms" if values else "none"

    print(f"\n{len(SENTENCES)} sentences x {runs} runs, {len(joins)} joins ({len(clause)} at a clause mark, {len(word)} between words)")
    print(f"WER: pieces {wer_cut:.3f}, whole {wer_whole:.3f} (mean); duration pieces/whole "
          f"{statistics.mean(r.seconds_cut / r.seconds_whole for r in rows):.3f} (mean)")  # fmt: skip
    print(f"pause at clause-mark joins: {spread(clause)}; at between-word joins: {spread(word)}")
    print(f"whole: {len(whole_pauses)} inner pauses for {sum(r.marks for r in rows)} clause marks, {spread(whole_pauses)}")
    long = [p for p in whole_pauses if p >= 250]
    print(f"whole's pauses of 250 ms or more (where the clause marks are): {spread(long)}")
    print(f"inner pauses per sentence: pieces {statistics.mean(len(r.pauses_cut) for r in rows):.1f}, "
          f"whole {statistics.mean(len(r.pauses_whole) for r in rows):.1f} (mean)")  # fmt: skip
    if joins:
        print(f"sample jump across a join / median jump in speech: max x{max(j.jump for j in joins):.2f}")
        steps = [abs(j.level_db) for j in joins if not np.isnan(j.level_db)]
        whole = [abs(d) for r in rows for d in r.level_whole_db if not np.isnan(d)]
        print(f"loudness step across joins |dB|: pieces median {statistics.median(steps):.1f} max {max(steps):.1f}; "
              f"whole at the same share of its length median {statistics.median(whole):.1f} max {max(whole):.1f}")  # fmt: skip
    gains = [g for r in rows for g in r.gain_steps_db]
    if gains:
        print(f"gain step per-piece normalization would put at a join (now one gain per sentence): "
              f"median {statistics.median(gains):.1f}, max {max(gains):.1f} dB")  # fmt: skip
    print(f"verdict: cuts' WER within {wer_cut - wer_whole:+.3f} of whole's")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    generators = installed_generators(Path(os.environ["INCLAVATE_HOME"]))
    rate = generators["piper:joe"].sample_rate
    rows = []
    for run in range(1, args.runs + 1):
        for number, text in enumerate(SENTENCES, start=1):
            rows.append(one_sentence(generators, number, text, rate))
            show(run, text, rows[-1])
    report(rows, args.runs)


if __name__ == "__main__":
    main()
