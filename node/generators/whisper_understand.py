"""Speech to text with faster-whisper (CTranslate2, int8 on CPU): an *understanding*
generator (``modality: "text"``, ``kind: "understand"``, ``input_modalities: ["audio"]``).

The media comes in as input artifacts and the answer goes out as one ``text/plain``
artifact. Whisper yields its transcript segment by segment: those are this generator's
frames (cancel and progress are checked between them). ``params.prompt`` is required by the
job contract but a dedicated ASR model has nothing to do with it, so it is not passed to
the model (as an initial prompt it would bias the transcript). ``params.language`` is a
filter, not a hint: a clip the model reports in another language yields an empty transcript.

The clips are decoded within ``max_seconds`` of audio for the whole job
(:mod:`node.generators.audio_decode`): a clip's sample rate and duration are the client's,
and a tiny WAV at 1 Hz decoded to gigabytes.
"""

from __future__ import annotations

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
from node.generators.audio_decode import DEFAULT_MAX_SECONDS, SampleBudget, decode_bounded
from node.generators.params import optional_int, optional_str

AUDIO_TYPES = frozenset({"audio/wav", "audio/x-wav", "audio/wave", "audio/vnd.wave", "audio/mpeg", "audio/mp3"})
"""The containers the spec accepts for transcription (decoded by PyAV inside faster-whisper)."""

MAX_OUTPUT_BYTES = 4 * 1024 * 1024
"""The spec's cap on an understanding job's text artifact."""

CPU_THREADS = 1
"""One decoder thread: peers share small machines (2 cores in CI) with llama.cpp."""


class WhisperUnderstand:
    modality: Modality = "text"

    def __init__(self, model: str, model_dir: Path, languages: tuple[str, ...] = (),
                 max_seconds: float = DEFAULT_MAX_SECONDS) -> None:  # fmt: skip
        self.model = model
        self.model_dir = model_dir
        self.languages = languages
        self.max_seconds = max_seconds
        """Audio a job's clips may hold together (``DPPAN_TRANSCRIPTION_MAX_SECONDS``)."""
        self._model: Any = None
        self._lock = threading.Lock()

    def capabilities(self) -> dict[str, Any]:
        return {"modality": "text", "kind": "understand", "model": self.model, "ready": True, "input_modalities": ["audio"]}

    def check(self, modality: str, params: Mapping[str, Any], n_inputs: int) -> None:
        if modality != "text":
            raise InvalidParams(f"{self.model} reads audio into text; use modality \"text\", not {modality!r}")
        optional_str(params, "prompt", max_length=4096)
        optional_str(params, "language", max_length=16)
        optional_int(params, "max_tokens", 1, 32768)

    def run(self, task: GenerationTask, cancelled: CancelCheck, progress: ProgressReport) -> GeneratorOutput:
        if cancelled():
            raise GenerationCancelled()
        progress("reading_input", 0.0)
        for media in task.inputs:
            if media.media_type.split(";")[0].strip().lower() not in AUDIO_TYPES:
                raise GenerationFailed("unsupported_input", f"{self.model} reads audio (wav, mp3), not {media.media_type}")
        budget = SampleBudget(self.max_seconds)
        clips = [decode_bounded(media.data, budget, cancelled) for media in task.inputs]
        model = self._loaded()
        wanted = task.params.get("language")
        texts: list[str] = []
        progress("understanding", 0.0)
        for index, clip in enumerate(clips):
            try:
                segments, info = model.transcribe(clip, beam_size=1, temperature=0.0, condition_on_previous_text=False)
                parts = []
                total = max(len(clip) / 16000.0, 1e-6)
                for segment in segments:  # decoding happens here, one segment at a time
                    if cancelled():
                        raise GenerationCancelled()
                    parts.append(segment.text)
                    progress("understanding", min((index + segment.end / total) / len(clips), 1.0))
            except (GenerationCancelled, GenerationFailed):
                raise
            except Exception as exc:  # ctranslate2 raises RuntimeError and friends
                raise GenerationFailed("inference_failed", f"transcription failed: {exc}") from exc
            if isinstance(wanted, str) and wanted and info.language != wanted.split("-")[0].lower():
                parts = []  # the filter: another language than asked comes back empty
            texts.append("".join(parts).strip())
        if cancelled():
            raise GenerationCancelled()
        progress("publishing", 1.0)
        data = "\n".join(texts).encode()
        if len(data) > MAX_OUTPUT_BYTES:
            data = data[:MAX_OUTPUT_BYTES].decode(errors="ignore").encode()
        return GeneratorOutput(data, "text/plain; charset=utf-8")

    def _loaded(self) -> Any:
        with self._lock:
            if self._model is None:
                try:
                    from faster_whisper import WhisperModel

                    self._model = WhisperModel(str(self.model_dir), device="cpu", compute_type="int8",
                                               cpu_threads=CPU_THREADS)  # fmt: skip
                except Exception as exc:
                    raise GenerationFailed("inference_failed", f"cannot load {self.model}: {exc}") from exc
            return self._model

    def close(self) -> None:
        self._model = None
