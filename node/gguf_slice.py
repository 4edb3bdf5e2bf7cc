"""Cut a GGUF file down to a contiguous range of blocks that llama.cpp loads unpatched.

A slice keeps every metadata key, sets ``<arch>.block_count`` to the range length, renames
``blk.i.*`` to ``blk.(i - start).*`` and keeps the global tensors (``token_embd``,
``output_norm``, ``output``, rope factors). llama.cpp insists on ``token_embd`` even for a
middle slice; with mmap its pages cost disk, not RAM. Per-layer metadata arrays are cut to
the range, because the loader rejects an array whose length is not ``block_count``, and
sliding-window flags derived from the layer index are written out explicitly (see
``node.arch``).

Slices are cached on disk keyed by the model's SHA-256 and the range, written to a temporary
name and renamed into place so a crash never leaves a half-written slice to be loaded.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

import gguf

from inclavate.durable import replace_durably
from inclavate.gguf_meta import read_metadata
from inclavate.types import LayerRange
from node.arch import ArchRules, check_swa_range, rules_for, swa_flags
from node.errors import EngineLoadError

# The gguf writer narrates every file it writes at INFO; a peer's log is not the place.
logging.getLogger("gguf.gguf_writer").setLevel(logging.WARNING)

_BLOCK_TENSOR = re.compile(r"^blk\.(\d+)\.(.+)$")
_SLICE_FORMAT_VERSION = 1  # bump when the slicing rules change, so old caches are not reused


def cached_slice(source: Path, model_sha256: str, layers: LayerRange, cache_dir: Path) -> Path:
    """Return a slice of ``source`` for ``layers``, writing it on first use.

    The whole model is returned as is: there is nothing to cut. Architectures that cannot be
    cut exactly raise :class:`UnsupportedArchitecture` before anything is written.
    """
    meta = read_metadata(source)
    arch, n_layers = meta.arch, meta.n_layers
    if layers.end > n_layers:
        raise EngineLoadError(f"layer range {layers} exceeds the model's {n_layers} layers")
    whole = layers.start == 0 and layers.end == n_layers
    rules = rules_for(arch, n_layers, whole_model=whole)
    if whole:
        return source
    key = model_sha256[:16] if model_sha256 else f"{source.stat().st_size:x}-{source.name}"
    dest = cache_dir / key / f"v{_SLICE_FORMAT_VERSION}-{layers.start}-{layers.end}.gguf"
    if dest.exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    try:
        write_slice(gguf.GGUFReader(source), arch, n_layers, layers, rules, tmp)
        replace_durably(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def write_slice(
    reader: gguf.GGUFReader,
    arch: str,
    n_layers: int,
    layers: LayerRange,
    rules: ArchRules,
    dest: Path,
) -> None:
    swa_key = f"{arch}.attention.sliding_window_pattern"
    swa = _slice_swa_flags(reader, swa_key, n_layers, rules, layers)
    writer = gguf.GGUFWriter(dest, arch)
    writer.data_alignment = reader.alignment
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name == swa_key:
            continue
        if name == f"{arch}.block_count":
            writer.add_uint32(name, len(layers))
            continue
        vtype, sub_type, value = _field_payload(field)
        if name.startswith(f"{arch}.") and _is_layer_array(vtype, value, n_layers):
            value = value[layers.start : layers.end]
        writer.add_key_value(name, value, vtype, sub_type=sub_type)
    if swa is not None:
        writer.add_key_value(swa_key, swa, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.BOOL)
    writer.add_uint32("inclavate.slice.start_layer", layers.start)
    writer.add_uint32("inclavate.slice.end_layer", layers.end)

    for tensor in reader.tensors:
        match = _BLOCK_TENSOR.match(tensor.name)
        if match is None:
            name = tensor.name  # global tensor: embeddings, output norm/head, rope factors
        else:
            il = int(match.group(1))
            if not layers.start <= il < layers.end:
                continue
            name = f"blk.{il - layers.start}.{match.group(2)}"
        # Raw bytes copy quantized blocks untouched; without raw_shape the writer derives the
        # logical shape from the byte shape and the quantization type.
        writer.add_tensor(name, tensor.data, raw_dtype=tensor.tensor_type)
    _write(writer)


def _slice_swa_flags(
    reader: gguf.GGUFReader, key: str, n_layers: int, rules: ArchRules, layers: LayerRange
) -> list[bool] | None:
    """The sliding-window flags of the slice's layers, or None for a model without SWA.

    The loader derives them from the layer index when the file has no per-layer array, and
    the slice renumbers layers, so the slice always carries them explicitly (llama.cpp reads
    this BOOL array). A scalar in the file is the period of the by-index rule.
    """
    if rules.swa_period is None:
        return None
    field = reader.get_field(key)
    value = field.contents() if field is not None else None
    if field is not None and _is_layer_array(field.types[0], value, n_layers):
        flags = [bool(v) for v in value[layers.start : layers.end]]
    else:
        period = int(value) if isinstance(value, (int, float)) and value > 0 else rules.swa_period
        flags = swa_flags(period, range(layers.start, layers.end))
    check_swa_range(rules, layers, flags)
    return flags


def write_vocab_only(source: Path, dest: Path) -> Path:
    """Write a tensor-less copy of ``source``'s metadata: all a vocab-only load needs.

    A peer that serves the API for a model it holds no layers of tokenizes with this
    (megabytes) instead of downloading the weights (gigabytes).
    """
    reader = gguf.GGUFReader(source)
    arch = read_metadata(source).arch
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    try:
        writer = gguf.GGUFWriter(tmp, arch)
        for name, field in reader.fields.items():
            if name.startswith("GGUF.") or name == "general.architecture":
                continue
            vtype, sub_type, value = _field_payload(field)
            writer.add_key_value(name, value, vtype, sub_type=sub_type)
        _write(writer)
        replace_durably(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def _write(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _is_layer_array(vtype: gguf.GGUFValueType, value: Any, n_layers: int) -> bool:
    return vtype == gguf.GGUFValueType.ARRAY and len(value) == n_layers


def _field_payload(field: Any) -> tuple[gguf.GGUFValueType, gguf.GGUFValueType | None, Any]:
    vtype = field.types[0]
    sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
    return vtype, sub_type, field.contents()
