"""Media generators: models that turn a job's parameters into an artifact's bytes.

Public surface: :mod:`node.generators.base` (the :class:`Generator` contract, the task a
generator runs, its output and its errors), :func:`node.generators.loader.load_generator`
(a generator for an installed speech model), and the two real generators,
:mod:`node.generators.piper_speech` (text to speech) and
:mod:`node.generators.whisper_understand` (speech to text). Generators block: the job runner
calls :meth:`Generator.run` in a worker thread and hands it a cancel check and a progress
callback, so a generator stops between frames and never touches the event loop.
"""

from node.generators.base import (
    CancelCheck,
    GenerationCancelled,
    GenerationFailed,
    GenerationTask,
    Generator,
    GeneratorOutput,
    InputMedia,
    InvalidParams,
    ProgressReport,
)

__all__ = [
    "CancelCheck",
    "GenerationCancelled",
    "GenerationFailed",
    "GenerationTask",
    "Generator",
    "GeneratorOutput",
    "InputMedia",
    "InvalidParams",
    "ProgressReport",
]
