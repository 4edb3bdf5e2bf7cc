"""The contract every generator implements, and what flows in and out of one.

A generator is a loaded model plus what it can honour (its *capabilities*, the entry it
contributes to ``GET /v1/generations/capabilities``). Requests are checked twice: cheaply
at submission (:meth:`Generator.check`, so a bad request is a 400 before a job exists) and
again by :meth:`Generator.run`, which raises :class:`GenerationFailed` with one of the
spec's job ``error_code`` values for anything that can only be known while running.

Errors::

    GeneratorError(InclavateError)
    ├── InvalidParams         the request cannot be run by this generator (HTTP 400)
    ├── GenerationFailed      a job failed; carries the job's error_code
    └── GenerationCancelled   the cancel check said stop; raised between frames
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from inclavate.errors import InclavateError

Modality = Literal["audio", "image", "video", "text"]
MODALITIES: tuple[Modality, ...] = ("audio", "image", "video", "text")

CancelCheck = Callable[[], bool]
"""True once the job should stop; a generator asks between frames (sentences, segments)."""

ProgressReport = Callable[[str, float], None]
"""``(stage, fraction in [0, 1])``; thread-safe, cheap, may be called often."""


class GeneratorError(InclavateError):
    """Base of the errors generators raise."""


class InvalidParams(GeneratorError):
    """The parameters cannot be honoured by this generator (refused before queueing)."""


class GenerationFailed(GeneratorError):
    """A job that ran and failed; ``code`` is the job record's ``error_code``."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class GenerationCancelled(GeneratorError):
    """The cancel check answered true; nothing was published."""


@dataclass(frozen=True)
class InputMedia:
    """One input artifact's bytes, read before the generator runs."""

    data: bytes
    media_type: str


@dataclass(frozen=True)
class GenerationTask:
    job_id: str
    model: str
    modality: Modality
    params: Mapping[str, Any]
    seed: int | None = None
    inputs: tuple[InputMedia, ...] = ()


@dataclass(frozen=True)
class GeneratorOutput:
    data: bytes
    media_type: str
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Facts a sync adapter may want (e.g. the detected language); not stored."""


class Generator(Protocol):
    model: str
    modality: Modality

    def capabilities(self) -> dict[str, Any]:
        """This generator's entry in ``GET /v1/generations/capabilities`` (spec shape,
        empty fields already omitted)."""
        ...

    def check(self, modality: str, params: Mapping[str, Any], n_inputs: int) -> None:
        """Refuse (:class:`InvalidParams`) a request this generator can never run."""
        ...

    def run(self, task: GenerationTask, cancelled: CancelCheck, progress: ProgressReport) -> GeneratorOutput:
        """Produce the output; blocking, called in a worker thread."""
        ...

    def close(self) -> None: ...
