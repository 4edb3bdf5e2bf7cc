"""Rewriting test GGUFs: a plain Q4_K quantizer (``gguf`` can dequantize Q4_K but not write
it), and copies with tensors replaced or added.

Not llama.cpp's search for the best scales: per 32-value sub-block, min and range map to a
6-bit min and scale under the super-block's float16 ``d`` and ``dmin``. Good enough to make
a random model's Q4_K weights close to its float ones, which is all the tests need.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import gguf
import numpy as np

Q4_K = gguf.GGMLQuantizationType.Q4_K


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """(rows, cols) float -> (rows, cols / 256 * 144) uint8 Q4_K blocks; cols % 256 == 0."""
    rows, cols = x.shape
    sub = x.astype(np.float32).reshape(rows, cols // 256, 8, 32)
    lo = np.minimum(sub.min(-1), 0.0)
    scale = (sub.max(-1) - lo) / 15
    d = (scale.max(-1, keepdims=True) / 63).astype(np.float16)
    dmin = ((-lo).max(-1, keepdims=True) / 63).astype(np.float16)
    sc = np.clip(np.round(scale / np.maximum(d.astype(np.float32), 1e-30)), 0, 63).astype(np.uint8)
    m = np.clip(np.round(-lo / np.maximum(dmin.astype(np.float32), 1e-30)), 0, 63).astype(np.uint8)
    step = d.astype(np.float32)[..., None] * sc[..., None]
    offset = dmin.astype(np.float32)[..., None] * m[..., None]
    q = np.clip(np.round((sub + offset) / np.maximum(step, 1e-30)), 0, 15).astype(np.uint8)
    packed = np.empty((rows, cols // 256, 12), np.uint8)
    packed[..., 0:4] = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    packed[..., 4:8] = m[..., :4] | ((m[..., 4:] >> 4) << 6)
    packed[..., 8:12] = (sc[..., 4:] & 0x0F) | ((m[..., 4:] & 0x0F) << 4)
    q = q.reshape(rows, cols // 256, 4, 2, 32)
    qs = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).reshape(rows, cols // 256, 128)
    header = np.concatenate([d, dmin], axis=-1).view(np.uint8)
    return np.concatenate([header, packed, qs], axis=-1).reshape(rows, -1)


def rewrite_gguf(
    source: Path,
    dest: Path,
    transform: Callable[[gguf.ReaderTensor], tuple[np.ndarray, gguf.GGMLQuantizationType] | None] = lambda t: None,
    extra: Mapping[str, np.ndarray] = {},
) -> Path:
    """Copy a GGUF, replacing the tensors ``transform`` returns (data, type) for and adding ``extra``."""
    reader = gguf.GGUFReader(source)
    arch = str(reader.get_field("general.architecture").contents())
    writer = gguf.GGUFWriter(dest, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub)
    for t in reader.tensors:
        data, dtype = transform(t) or (t.data, t.tensor_type)
        writer.add_tensor(t.name, data, raw_dtype=dtype)
    for name, values in extra.items():
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dest


def requantize_q4_k(source: Path, dest: Path) -> Path:
    """Copy a GGUF with every block matrix rewritten as Q4_K (rows must be 256-multiples)."""

    def to_q4_k(t: gguf.ReaderTensor) -> tuple[np.ndarray, gguf.GGMLQuantizationType] | None:
        if not (t.name.startswith("blk.") and len(t.shape) == 2):
            return None
        return quantize_q4_k(gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)), Q4_K

    return rewrite_gguf(source, dest, to_q4_k)
