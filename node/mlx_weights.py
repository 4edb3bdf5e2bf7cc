"""The tensors of one layer range, read straight from a GGUF file into MLX arrays.

A peer reads only what its range computes with: its blocks, plus the token embedding on the
first range and the output norm and head on the last. Each tensor's bytes are read at their
offset (``inclavate.gguf_meta`` records it), not through ``mx.load`` (which reads the whole
file) nor a memory map (whose touched pages would stay resident beside the MLX copy), so
resident memory is about the range's own weights.

How each GGML type becomes MLX (the table in docs/ARCHITECTURE.md):

* Q8_0, Q4_0, Q4_1, Q4_K: kept quantized, repacked exactly (``node.gguf_repack``);
* F32, F16, BF16: kept as they are (matmuls promote to the float32 activations exactly);
* everything else (Q6_K, Q5_*, Q2_K, Q3_K, IQ*, ...): dequantized with ``gguf``'s own
  dequantizers into float32: exact, but 4 bytes a weight.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from inclavate.gguf_meta import GgufMetadata, TensorInfo
from node.errors import EngineLoadError
from node.gguf_repack import GROUP_SIZE, REPACKED_TYPES, repack

Q = GGMLQuantizationType


@dataclass(frozen=True)
class QuantizedMatrix:
    """An affine-quantized (rows, cols) weight: ``y = x @ W.T`` without dequantizing W."""

    codes: mx.array
    scales: mx.array
    biases: mx.array
    bits: int

    def __call__(self, x: mx.array) -> mx.array:
        return mx.quantized_matmul(
            x, self.codes, self.scales, self.biases, transpose=True, group_size=GROUP_SIZE, bits=self.bits
        )

    def rows(self, ids: mx.array) -> mx.array:
        """Rows ``ids`` dequantized to float32 (embedding lookup)."""
        return mx.dequantize(
            self.codes[ids], self.scales[ids], self.biases[ids], group_size=GROUP_SIZE, bits=self.bits
        )

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes + self.biases.nbytes


@dataclass(frozen=True)
class DenseMatrix:
    """A float (rows, cols) weight in its file's precision; products are float32."""

    weight: mx.array

    def __call__(self, x: mx.array) -> mx.array:
        return mx.matmul(x, self.weight.T)

    def rows(self, ids: mx.array) -> mx.array:
        return self.weight[ids].astype(mx.float32)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes


Matrix = QuantizedMatrix | DenseMatrix


class GgufTensorReader:
    """Reads named tensors of one GGUF file by offset; nothing else of the file is touched."""

    def __init__(self, path: Path, meta: GgufMetadata) -> None:
        self.path = path
        self.meta = meta
        self.bytes_read = 0

    def has(self, name: str) -> bool:
        return name in self.meta.tensors

    def info(self, name: str) -> TensorInfo:
        try:
            return self.meta.tensors[name]
        except KeyError:
            raise EngineLoadError(f"{self.path.name} has no tensor {name!r}") from None

    def _raw(self, name: str) -> tuple[np.ndarray, TensorInfo]:
        info = self.info(name)
        if info.nbytes == 0:
            raise EngineLoadError(f"tensor {name!r} has GGML type {info.ggml_type}, unknown to this gguf release")
        with open(self.path, "rb") as f:
            f.seek(self.meta.data_offset + info.offset)
            data = f.read(info.nbytes)
        if len(data) != info.nbytes:
            raise EngineLoadError(f"{self.path.name} is truncated inside tensor {name!r}")
        self.bytes_read += info.nbytes
        return np.frombuffer(data, dtype=np.uint8), info

    def vector(self, name: str) -> mx.array:
        """A 1-D tensor (norm gains, biases, rope factors) as float32."""
        raw, info = self._raw(name)
        return mx.array(_to_float32(raw, info).reshape(-1))

    def matrix(self, name: str) -> Matrix:
        raw, info = self._raw(name)
        if len(info.dims) != 2:
            raise EngineLoadError(f"tensor {name!r} has {len(info.dims)} dimensions; the MLX engine runs 2-D weights")
        cols, rows = info.dims  # ggml order: ne0 is the row length
        qtype = Q(info.ggml_type)
        if qtype in REPACKED_TYPES and cols % GROUP_SIZE == 0:
            packed = repack(raw, qtype, rows, cols)
            return QuantizedMatrix(
                mx.array(packed.codes), mx.array(packed.scales), mx.array(packed.biases), packed.bits
            )
        if qtype == Q.F16:
            return DenseMatrix(mx.array(raw.view(np.float16).reshape(rows, cols)))
        if qtype == Q.BF16:
            weight = mx.array(_to_float32(raw, info).reshape(rows, cols)).astype(mx.bfloat16)
            mx.eval(weight)  # now, on the loading thread, not lazily inside the first forward
            return DenseMatrix(weight)
        return DenseMatrix(mx.array(_to_float32(raw, info).reshape(rows, cols)))


def _to_float32(raw: np.ndarray, info: TensorInfo) -> np.ndarray:
    qtype = Q(info.ggml_type)
    if qtype == Q.F32:
        return raw.view(np.float32)
    if qtype == Q.F16:
        return raw.view(np.float16).astype(np.float32)
    if qtype == Q.BF16:
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    try:
        return dequantize(raw, qtype).astype(np.float32, copy=False)
    except NotImplementedError:
        raise EngineLoadError(f"the gguf package cannot dequantize {qtype.name}") from None
