"""Decode a client's audio clip to 16 kHz mono float32, within a bound on its duration.

A WAV's sample rate is whatever its header says. At 1 Hz, 8-bit mono, every byte of the
upload is one second of audio: ``faster_whisper.decode_audio`` resampled a 2 KiB clip to
2,048 s of 16 kHz float32 in one go (~0.85 MB of peer memory per uploaded byte once the
features were computed; ~20 KiB took the whole machine), and nothing could cancel it (an
audit, 2026-12-07). So, before anything is decoded, a clip whose header names an
implausible sample rate or a duration over the limit is refused; and since headers lie (a
WAV ``data`` size, an MP3 without a Xing tag is estimated from its first frame), the
decode itself runs frame by frame, counting what it produces, and stops at the limit with
``input_too_large``, checking the job's cancel flag between frames.

The frames are grouped and resampled exactly as ``decode_audio`` does (PyAV, s16 mono at
16 kHz, groups of 500,000 input samples, the resampler flushed at the end), so a clip within
the limits decodes to the same samples as before and its transcript does not change.
"""

from __future__ import annotations

import gc
import io
from collections.abc import Iterator
from typing import Any

import numpy as np

from node.generators.base import CancelCheck, GenerationCancelled, GenerationFailed

DECODE_RATE = 16000
"""Whisper's input rate."""

MIN_SAMPLE_RATE = 8000
"""Telephone audio, and the lowest rate an MP3 can carry (MPEG-2.5). Nothing lower holds
intelligible speech, and every halving of the rate doubles what one uploaded byte costs
once resampled to 16 kHz."""

MAX_SAMPLE_RATE = 192000
"""The highest rate recorders and sound cards use; above it nothing is speech either, and a
resampler group of 500,000 input samples stays above 2.6 s of audio."""

DEFAULT_MAX_SECONDS = 3600.0
"""An hour of audio per job (``DPPAN_TRANSCRIPTION_MAX_SECONDS``): a meeting or a podcast
(a 64 MiB MP3 at 128 kbit/s holds 70 minutes; half an hour, tried first, refused a 45-minute
podcast the spec accepts: a review, 2026-12-07). What transcribing costs grows with it
(~0.85 MB of memory per second of audio), so a small machine lowers it."""

GROUP_SAMPLES = 500_000
"""Input samples resampled at once (faster-whisper's own grouping, kept so that a clip
decodes to the same samples). With the rate at least :data:`MIN_SAMPLE_RATE`, one group
yields at most 1,000,000 output samples (2 MB), so the count below is checked often enough."""


def implausible_rate(rate: int) -> str | None:
    """Why audio at ``rate`` Hz is refused, or None when the rate is plausible."""
    if MIN_SAMPLE_RATE <= rate <= MAX_SAMPLE_RATE:
        return None
    return f"a sample rate of {rate} Hz is outside {MIN_SAMPLE_RATE}-{MAX_SAMPLE_RATE} Hz"


def too_long(seconds: float, max_seconds: float) -> str | None:
    """Why ``seconds`` of audio is refused, or None when it is within ``max_seconds``."""
    if seconds <= max_seconds:
        return None
    return f"the audio is {seconds:.0f} s long; at most {max_seconds:g} s are transcribed per job"


class SampleBudget:
    """The output samples a job's clips may still produce (one budget over all its clips)."""

    def __init__(self, max_seconds: float) -> None:
        self.max_seconds = max_seconds
        self.left = int(max_seconds * DECODE_RATE)

    def take(self, samples: int) -> None:
        self.left -= samples
        if self.left < 0:
            raise GenerationFailed("input_too_large", f"the audio decodes to more than {self.max_seconds:g} s; "
                                   f"at most {self.max_seconds:g} s are transcribed per job")  # fmt: skip


def decode_bounded(data: bytes, budget: SampleBudget, cancelled: CancelCheck) -> np.ndarray:
    """The clip as 16 kHz mono float32, refused (``input_too_large``, ``unsupported_input``,
    ``input_unreadable``) before or while decoding; :class:`GenerationCancelled` between frames."""
    import av

    try:
        with av.open(io.BytesIO(data), mode="r", metadata_errors="ignore") as container:
            if not container.streams.audio:
                raise GenerationFailed("input_unreadable", "the file has no audio stream")
            _check_header(container, budget.max_seconds)
            chunks = list(_resampled(container, budget, cancelled))
    except (GenerationFailed, GenerationCancelled):
        raise
    except Exception as exc:  # PyAV raises av.error.* for anything it cannot read
        raise GenerationFailed("input_unreadable", f"the audio could not be decoded: {exc}") from exc
    finally:
        gc.collect()  # PyAV's resampler objects are freed only by the collector (faster-whisper#390)
    audio = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int16)
    return audio.astype(np.float32) / 32768.0


def _check_header(container: Any, max_seconds: float) -> None:
    """Refuse on what the header says, before a single frame is decoded."""
    stream = container.streams.audio[0]
    if (why := implausible_rate(stream.codec_context.sample_rate or 0)) is not None:
        raise GenerationFailed("unsupported_input", why)
    # Only a WAV's length is exact here; others (an MP3 without a Xing tag) are estimated,
    # and may overstate an honest clip several times: the decode counts what they yield.
    exact = container.format.name == "wav"
    if exact and container.duration is not None and (why := too_long(container.duration / 1_000_000, max_seconds)):
        raise GenerationFailed("input_too_large", why)


def _resampled(container: Any, budget: SampleBudget, cancelled: CancelCheck) -> Iterator[np.ndarray]:
    """s16 mono 16 kHz chunks, each counted against ``budget`` as it is produced."""
    import av

    resampler = av.audio.resampler.AudioResampler(format="s16", layout="mono", rate=DECODE_RATE)
    fifo = av.audio.fifo.AudioFifo()

    def resample(frame: Any) -> Iterator[np.ndarray]:
        for out in resampler.resample(frame):
            chunk = out.to_ndarray().reshape(-1)
            budget.take(len(chunk))
            yield chunk

    for frame in _frames(container):
        if cancelled():
            raise GenerationCancelled()
        if (why := implausible_rate(frame.sample_rate)) is not None:  # a stream may change its rate
            raise GenerationFailed("unsupported_input", why)
        frame.pts = None  # as decode_audio: ignore the timestamp check
        fifo.write(frame)
        if fifo.samples >= GROUP_SAMPLES:
            yield from resample(fifo.read())
    if fifo.samples > 0:
        yield from resample(fifo.read())
    yield from resample(None)  # flush


def _frames(container: Any) -> Iterator[Any]:
    """The audio frames, skipping the ones PyAV finds invalid (as decode_audio does)."""
    import av

    frames = container.decode(audio=0)
    while True:
        try:
            yield next(frames)
        except StopIteration:
            return
        except av.error.InvalidDataError:
            continue
