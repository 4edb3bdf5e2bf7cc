"""Measuring audio and transcripts in tests: WAV facts, loudness, word error rate."""

from __future__ import annotations

import io
import re
import struct
import wave

import numpy as np


def wav_facts(data: bytes) -> tuple[int, int, int, float]:
    """(sample rate, channels, sample width, seconds) from the header; raises if not a WAV."""
    assert data[:4] == b"RIFF" and data[8:12] == b"WAVE", "not a RIFF/WAVE file"
    with wave.open(io.BytesIO(data), "rb") as clip:
        return clip.getframerate(), clip.getnchannels(), clip.getsampwidth(), clip.getnframes() / clip.getframerate()


def rms(data: bytes) -> float:
    """Root-mean-square level of a 16-bit WAV, 0..1 (silence is ~0)."""
    with wave.open(io.BytesIO(data), "rb") as clip:
        samples = np.frombuffer(clip.readframes(clip.getnframes()), dtype="<i2").astype(np.float64) / 32768.0
    return float(np.sqrt(np.mean(samples**2))) if samples.size else 0.0


def words(text: str) -> list[str]:
    """Lower case, no punctuation; hyphens and thousands separators split or vanish alike."""
    text = re.sub(r"(?<=\d),(?=\d{3})", "", text.lower()).replace("-", " ")
    return re.findall(r"[a-z0-9']+", text)


SENTENCE = "Hello from the swarm of volunteers."
"""What the speech tests say and then transcribe."""
SENTENCE_MAX_WER = 2 / 6
"""Two of :data:`SENTENCE`'s six words. Piper samples noise as it speaks (the voice's noise
scales), so the same text sounds a little different every time, and whisper-tiny now and
then hears "the swarm" as "this warm" (two edits; seen once in CI). Audio that went wrong
anywhere on its way scores near 1."""


def word_error_rate(reference: str, hypothesis: str) -> float:
    """Levenshtein distance over words divided by the reference's length."""
    ref, hyp = words(reference), words(hypothesis)
    row = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, start=1):
        prev, row[0] = row[0], i
        for j, h in enumerate(hyp, start=1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (r != h))
    return row[len(hyp)] / max(1, len(ref))


def tone_wav(rate: int, seconds: float, bits: int = 8) -> bytes:
    """A mono PCM WAV of a quiet 440 Hz tone at any sample rate the header can name, 1 Hz
    included (what a hostile client sends): every byte of an 8-bit clip at 1 Hz is a second."""
    n = max(1, int(rate * seconds))
    tone = np.sin(2 * np.pi * 440 * np.arange(n) / max(rate, 1)) * 0.1
    samples = ((tone * 127 + 128).astype(np.uint8).tobytes() if bits == 8
               else (tone * 32767).astype("<i2").tobytes())  # fmt: skip
    block = bits // 8
    fmt = struct.pack("<HHIIHH", 1, 1, rate, rate * block, block, bits)
    body = b"WAVEfmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(samples)) + samples
    return b"RIFF" + struct.pack("<I", len(body)) + body
