"""Understanding jobs addressed to a chat LLM of the swarm (``modality: "text"``).

The swarm's chat models read text only, so a job that hands one media fails with the
spec's ``unsupported_input`` (the job contract: refused inside the job, not as an HTTP
status, since the media type is only known once the artifact is read). Reading text
artifacts as a job is not offered either; a chat completion does that. This generator is
never listed in capabilities: it exists so that naming a chat model gives the clear job
error instead of "no generator".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from node.generators.base import (
    CancelCheck,
    GenerationFailed,
    GenerationTask,
    GeneratorOutput,
    InvalidParams,
    Modality,
    ProgressReport,
)


class ChatModelReader:
    modality: Modality = "text"

    def __init__(self, model: str) -> None:
        self.model = model

    def capabilities(self) -> dict[str, Any]:
        return {}

    def check(self, modality: str, params: Mapping[str, Any], n_inputs: int) -> None:
        if modality != "text":
            raise InvalidParams(f"{self.model} is a chat model; it generates no {modality}")

    def run(self, task: GenerationTask, cancelled: CancelCheck, progress: ProgressReport) -> GeneratorOutput:
        progress("reading_input", 0.0)
        kinds = sorted({m.media_type for m in task.inputs})
        raise GenerationFailed(
            "unsupported_input",
            f"{self.model} reads text only and cannot read {', '.join(kinds) or 'these inputs'} as a job; "
            "for text, use /v1/chat/completions",
        )

    def close(self) -> None:
        pass
