"""The few facts about a GGUF file that the catalog and placement depend on.

Placement cuts a model into layer ranges, so it needs the block count and the hidden size
(what crosses the wire between ranges); a user registering a local file should not have to
type them. They come from :mod:`inclavate.gguf_meta`, which walks only the header and
tensor index: milliseconds even for a multi-gigabyte model (``gguf.GGUFReader`` takes seconds
on a 49k-token vocabulary).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf

from inclavate.errors import InclavateError
from inclavate.gguf_meta import GgufFormatError, GgufMetadata, read_metadata

CHAT_TEMPLATE_KEY = "tokenizer.chat_template"


class InvalidGguf(InclavateError):
    """The file is not a readable GGUF model, or lacks a key Inclavate needs."""

    def __init__(self, path: Path, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"{path}: not a usable GGUF model ({reason})")


@dataclass(frozen=True)
class GgufInfo:
    """What a GGUF header says about the model, in catalog terms."""

    arch: str
    n_layers: int
    d_model: int
    quant_type: str
    has_chat_template: bool


def read_gguf_info(path: Path) -> GgufInfo:
    """Read arch, block count, hidden size, quantisation and template presence from ``path``."""
    try:
        meta = read_metadata(path)
    except GgufFormatError as exc:
        raise InvalidGguf(path, str(exc)) from exc
    arch = _value(meta, path, "general.architecture")
    if not isinstance(arch, str) or not arch:
        raise InvalidGguf(path, "general.architecture is not a non-empty string")
    return GgufInfo(
        arch=arch,
        n_layers=_positive_int(meta, path, f"{arch}.block_count"),
        d_model=_positive_int(meta, path, f"{arch}.embedding_length"),
        quant_type=_quant_type(meta),
        has_chat_template=CHAT_TEMPLATE_KEY in meta.values,
    )


def _value(meta: GgufMetadata, path: Path, key: str) -> Any:
    if key not in meta.values:
        raise InvalidGguf(path, f"missing metadata key {key!r}")
    return meta.values[key]


def _positive_int(meta: GgufMetadata, path: Path, key: str) -> int:
    value = _value(meta, path, key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise InvalidGguf(path, f"{key} is {value!r}, expected a positive integer")
    return value


def _quant_type(meta: GgufMetadata) -> str:
    """The file type's conventional name (Q4_K_M, F16, ...), else the dominant block type.

    ``general.file_type`` is what llama.cpp's quantizer wrote and carries the mix name
    (Q4_K_M is Q4_K with some Q6_K tensors), which the tensor types alone cannot recover.
    Older or hand-written files omit it; then the type holding most blk.* weight elements
    is the best description (counting elements, not tensors, so a few large FFN matrices
    outweigh many small norms).
    """
    raw = meta.values.get("general.file_type")
    if raw is not None:
        try:
            file_type = gguf.LlamaFileType(int(raw))
        except (TypeError, ValueError):
            file_type = None
        if file_type is not None and file_type is not gguf.LlamaFileType.GUESSED:
            return file_type.name.removeprefix("MOSTLY_").removeprefix("ALL_")
    elements: Counter[str] = Counter()
    for name, tensor in meta.tensors.items():
        # 1-D tensors (norms, biases) stay F32 in every quantisation: they say nothing.
        if name.startswith("blk.") and len(tensor.dims) >= 2:
            try:
                kind = gguf.GGMLQuantizationType(tensor.ggml_type).name
            except ValueError:
                kind = f"type{tensor.ggml_type}"
            elements[kind] += tensor.n_elements
    if not elements:
        return "unknown"
    return elements.most_common(1)[0][0]
