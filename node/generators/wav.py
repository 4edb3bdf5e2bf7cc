"""16-bit PCM WAV: writing a finished clip and cutting it to a duration.

Generators produce raw int16 frames; the artifact is a complete RIFF/WAVE file written in
one piece after the last frame, so a cancelled or failed job never leaves half a file.
"""

from __future__ import annotations

import io
import wave

SAMPLE_WIDTH = 2  # int16


def frames_for(seconds: float, sample_rate: int, channels: int = 1) -> int:
    """Bytes of int16 PCM holding ``seconds`` of audio (whole frames)."""
    return int(seconds * sample_rate) * SAMPLE_WIDTH * channels


def encode_wav(pcm: bytes, sample_rate: int, channels: int = 1) -> bytes:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(channels)
        out.setsampwidth(SAMPLE_WIDTH)
        out.setframerate(sample_rate)
        out.writeframes(pcm)
    return buffer.getvalue()
