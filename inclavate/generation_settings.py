"""The ``DPPAN_*`` variables of generation jobs and the audio adapters, read once at start.

A value that cannot be read stops the peer with a message naming it (as the artifact
variables do): a deadline or a queue bound silently replaced by its default would be found
only when it mattered.

=========================================  ========  ==============================================
variable                                   default   meaning
=========================================  ========  ==============================================
``DPPAN_GENERATION_DEADLINE_SECS``         600       a job's deadline unless it asks for another
``DPPAN_SPEECH_SYNC_TIMEOUT_SECS``         120       ``/v1/audio/speech`` waits this long, then 504
``DPPAN_MUSIC_SYNC_TIMEOUT_SECS``          120       the same for ``/v1/audio/music``
``DPPAN_TRANSCRIPTION_SYNC_TIMEOUT_SECS``  120       the same for ``/v1/audio/transcriptions``
``DPPAN_GENERATION_WORKERS``               1         jobs this peer runs at once
``DPPAN_GENERATION_QUEUE_MAX``             32        queued + running jobs accepted; more is 429
``DPPAN_GENERATION_HISTORY_MAX``           10000     finished job records kept (oldest forgotten)
``DPPAN_TRANSCRIPTION_MAX_SECONDS``        3600      audio one transcription job may hold, all its
                                                     clips together; a longer clip is refused
=========================================  ========  ==============================================

``DPPAN_SPEECH_MODEL`` and ``DPPAN_SPEECH_MMPROJ`` (the spec's speech model named by file, a
GGUF and its audio projector) stop the peer with a message: this build runs the speech
models ``inclavate pull --speech`` installs and no projector yet, and a peer that ignored
them would offer no speech while its operator believes it does.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from inclavate.errors import ConfigError
from node.generators.audio_decode import DEFAULT_MAX_SECONDS

MAX_DEADLINE_S = 24 * 3600.0
UNSUPPORTED = ("DPPAN_SPEECH_MODEL", "DPPAN_SPEECH_MMPROJ")


@dataclass(frozen=True)
class GenerationSettings:
    default_deadline_s: float = 600.0
    speech_sync_timeout_s: float = 120.0
    music_sync_timeout_s: float = 120.0
    transcription_sync_timeout_s: float = 120.0
    workers: int = 1
    max_active: int = 32
    history_max: int = 10_000
    transcription_max_seconds: float = DEFAULT_MAX_SECONDS
    """A clip's sample rate and duration are the client's; decoding what a 20 KiB WAV at 1 Hz
    claimed took the machine's memory (an audit, 2026-12-07)."""

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> GenerationSettings:
        for name in UNSUPPORTED:
            if env.get(name, "").strip():
                raise ConfigError(f"{name} is not supported by this build (a speech model named by file needs a "
                                  "projector, not implemented yet): unset it and install a speech model with "
                                  "`inclavate pull --speech piper:joe` (or whisper:tiny.en), which every peer "
                                  "started afterwards offers")  # fmt: skip
        return cls(
            default_deadline_s=_seconds(env, "DPPAN_GENERATION_DEADLINE_SECS", 600.0, MAX_DEADLINE_S),
            speech_sync_timeout_s=_seconds(env, "DPPAN_SPEECH_SYNC_TIMEOUT_SECS", 120.0),
            music_sync_timeout_s=_seconds(env, "DPPAN_MUSIC_SYNC_TIMEOUT_SECS", 120.0),
            transcription_sync_timeout_s=_seconds(env, "DPPAN_TRANSCRIPTION_SYNC_TIMEOUT_SECS", 120.0),
            workers=_count(env, "DPPAN_GENERATION_WORKERS", 1, 64),
            max_active=_count(env, "DPPAN_GENERATION_QUEUE_MAX", 32, 100_000),
            history_max=_count(env, "DPPAN_GENERATION_HISTORY_MAX", 10_000, 10_000_000),
            transcription_max_seconds=_seconds(env, "DPPAN_TRANSCRIPTION_MAX_SECONDS", DEFAULT_MAX_SECONDS, 24 * 3600.0),
        )


def _seconds(env: Mapping[str, str], name: str, default: float, high: float = 7 * 24 * 3600.0) -> float:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0 < value <= high:  # NaN fails too
        raise ConfigError(f"{name}={raw!r} must be a number of seconds above 0 and at most {high:g}")
    return value


def _count(env: Mapping[str, str], name: str, default: int, high: int) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    if not raw.isdigit() or not 1 <= int(raw) <= high:
        raise ConfigError(f"{name}={raw!r} must be a whole number from 1 to {high}")
    return int(raw)
