"""GGUF quantized blocks rewritten, bit for bit, as MLX affine-quantized matrices.

MLX stores a quantized matrix as packed unsigned codes ``q`` (``bits`` per value, 32/bits
values per uint32, the first value in the lowest bits) with one ``scale`` and one ``bias``
per ``group_size`` values along a row: ``w = scale * q + bias``. Several GGML block types are
exactly that with a group of 32, so they can be kept quantized with no loss:

========  =========================  ===========================================
GGML      block value                MLX form (group 32)
========  =========================  ===========================================
Q8_0      ``d * q``, q in [-128,127]  8 bits, q + 128, scale d, bias -128 d
Q4_0      ``d * (q - 8)``             4 bits, scale d, bias -8 d
Q4_1      ``d * q + m``               4 bits, scale d, bias m
Q4_K      ``d*sc_j * q - dmin*m_j``   4 bits, scale d*sc_j, bias -dmin*m_j (per 32)
========  =========================  ===========================================

Only the nibble order differs: GGML puts the first half of a 32-value run in the low
nibbles and the second half in the high nibbles, MLX puts consecutive values in one byte.
``mx.load`` reads Q4_K without complaint but wrongly (odd sub-blocks corrupt; measured in
shared/NOTES.md), which is why this module reads the raw blocks itself.

Scales and biases are float32: Q4_K's ``d * sc`` (float16 times a 6-bit integer) needs it
to stay exact, and MLX computes in the scales' dtype (``mx.dequantize`` of float16 scales
rounds to float16), so float32 everywhere keeps every type exact for one more bit per weight.
Pure numpy: the conversion is tested against ``gguf``'s own dequantizers without MLX.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

Q = GGMLQuantizationType
GROUP_SIZE = 32
REPACKED_TYPES: frozenset[GGMLQuantizationType] = frozenset({Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K})


@dataclass(frozen=True)
class AffineMatrix:
    """The three arrays of an MLX affine-quantized (rows, cols) matrix, in numpy."""

    codes: np.ndarray
    """uint32 (rows, cols * bits / 32)."""
    scales: np.ndarray
    """float32 (rows, cols / 32)."""
    biases: np.ndarray
    bits: int

    def dequantize(self) -> np.ndarray:
        """float32 values, as MLX would compute them (for tests and the Python reference)."""
        per_word = 32 // self.bits
        shifts = (np.arange(per_word, dtype=np.uint32) * self.bits)[None, None, :]
        q = (self.codes[:, :, None] >> shifts) & np.uint32((1 << self.bits) - 1)
        q = q.reshape(self.codes.shape[0], -1, GROUP_SIZE).astype(np.float32)
        w = q * self.scales[:, :, None] + self.biases[:, :, None]
        return w.reshape(self.codes.shape[0], -1)


def repack(raw: np.ndarray, qtype: GGMLQuantizationType, rows: int, cols: int) -> AffineMatrix:
    """Rewrite the raw blocks of a (rows, cols) GGML matrix of a type in :data:`REPACKED_TYPES`."""
    block, size = GGML_QUANT_SIZES[qtype]
    if cols % block:
        raise ValueError(f"{qtype.name} rows of {cols} values are not whole {block}-value blocks")
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, cols // block, size)
    if qtype == Q.Q8_0:
        d = _f16(blocks[:, :, 0:2])
        codes = (blocks[:, :, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return AffineMatrix(_pack(codes, 8, rows), d, d * -128, 8)
    if qtype == Q.Q4_0:
        d = _f16(blocks[:, :, 0:2])
        return AffineMatrix(_pack(_split_nibbles(blocks[:, :, 2:]), 4, rows), d, d * -8, 4)
    if qtype == Q.Q4_1:
        d, m = _f16(blocks[:, :, 0:2]), _f16(blocks[:, :, 2:4])
        return AffineMatrix(_pack(_split_nibbles(blocks[:, :, 4:]), 4, rows), d, m, 4)
    if qtype == Q.Q4_K:
        return _repack_q4_k(blocks, rows)
    raise ValueError(f"{qtype.name} has no exact MLX form; dequantize it")


def _repack_q4_k(blocks: np.ndarray, rows: int) -> AffineMatrix:
    # 144-byte super-block of 256 values: d, dmin (f16), 12 bytes of packed 6-bit (scale, min)
    # pairs for 8 sub-blocks of 32, then 128 bytes: 4 chunks of 32 bytes whose low nibbles are
    # sub-block 2c and high nibbles sub-block 2c + 1.
    n_super = blocks.shape[1]
    d = _f16(blocks[:, :, 0:2])[:, :, None]
    dmin = _f16(blocks[:, :, 2:4])[:, :, None]
    sc, mins = _q4_k_scale_mins(blocks[:, :, 4:16])
    chunks = blocks[:, :, 16:].reshape(rows, n_super, 4, 32)
    codes = np.stack([chunks & 0x0F, chunks >> 4], axis=3)  # (rows, n_super, 4, 2, 32)
    codes = codes.reshape(rows, n_super * 8, GROUP_SIZE)
    scales = (d * sc).reshape(rows, n_super * 8)
    biases = -(dmin * mins).reshape(rows, n_super * 8)
    return AffineMatrix(_pack(codes, 4, rows), scales, biases, 4)


def _q4_k_scale_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and mins of each Q4_K super-block (llama.cpp's get_scale_min_k4)."""
    p = packed.astype(np.uint8)
    lo_sc, lo_m = p[..., 0:4] & 63, p[..., 4:8] & 63
    hi_sc = (p[..., 8:12] & 0x0F) | ((p[..., 0:4] >> 6) << 4)
    hi_m = (p[..., 8:12] >> 4) | ((p[..., 4:8] >> 6) << 4)
    sc = np.concatenate([lo_sc, hi_sc], axis=-1).astype(np.float32)
    mins = np.concatenate([lo_m, hi_m], axis=-1).astype(np.float32)
    return sc, mins


def _f16(two_bytes: np.ndarray) -> np.ndarray:
    """A float16 field of every block, widened to float32 (exactly)."""
    return np.ascontiguousarray(two_bytes).view(np.float16)[..., 0].astype(np.float32)


def _split_nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes -> 32 codes in GGML order: low nibbles are values 0-15, high nibbles 16-31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _pack(codes: np.ndarray, bits: int, rows: int) -> np.ndarray:
    """Unsigned codes in value order -> MLX words (first value in the lowest bits)."""
    flat = codes.reshape(rows, -1).astype(np.uint8)
    if bits == 4:
        flat = flat[:, 0::2] | (flat[:, 1::2] << 4)
    return np.ascontiguousarray(flat).view(np.uint32)
