"""Generators for the speech models installed in ``$INCLAVATE_HOME/speech``.

A peer offers every installed speech model (``inclavate pull --speech ID``) under its
catalog id; nothing is loaded here (each generator loads its weights on first use), so
offering them costs a peer nothing until a job arrives.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

from inclavate.speech_catalog import SpeechCatalog, SpeechSpec
from inclavate.speech_store import SpeechStore
from node.generators.audio_decode import DEFAULT_MAX_SECONDS
from node.generators.base import Generator
from node.generators.piper_speech import PiperSpeech
from node.generators.whisper_understand import WhisperUnderstand

log = logging.getLogger(__name__)

RUNTIMES = {"piper": "piper", "whisper": "faster_whisper"}
"""The Python package each engine needs (the ``speech`` extra installs both)."""


def load_generator(spec: SpeechSpec, directory: Path, max_audio_seconds: float = DEFAULT_MAX_SECONDS) -> Generator:
    if spec.engine == "piper":
        onnx = next(f for f in spec.files if f.name.endswith(".onnx"))
        return PiperSpeech(spec.model_id, spec.voice, directory / onnx.name)
    return WhisperUnderstand(spec.model_id, directory, max_seconds=max_audio_seconds)


def installed_generators(home: Path, max_audio_seconds: float = DEFAULT_MAX_SECONDS) -> dict[str, Generator]:
    """model id -> generator, for every speech model pulled under ``home`` whose runtime
    is installed (a missing one is logged, not fatal: the peer still serves chat).
    ``max_audio_seconds``: what a transcription job may hold (``DPPAN_TRANSCRIPTION_MAX_SECONDS``)."""
    generators: dict[str, Generator] = {}
    for spec, directory in SpeechStore(home).installed(SpeechCatalog.load()):
        if importlib.util.find_spec(RUNTIMES[spec.engine]) is None:
            log.warning("%s is installed but %s is not (pip install 'inclavate[speech]'); not offered",
                        spec.model_id, RUNTIMES[spec.engine])  # fmt: skip
            continue
        generators[spec.model_id] = load_generator(spec, directory, max_audio_seconds)
    return generators
