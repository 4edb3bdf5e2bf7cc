"""GGML blocks repacked into MLX's affine layout must hold exactly the values ``gguf``'s own
dequantizers read from them, and MLX must read the layout the same way."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf.quants import dequantize, quantize
from q4k import quantize_q4_k

from node.gguf_repack import GROUP_SIZE, Q, repack

ROWS, COLS = 6, 512


def _blocks(qtype: Q, rng: np.random.Generator) -> np.ndarray:
    x = rng.standard_normal((ROWS, COLS)).astype(np.float32)
    return quantize_q4_k(x) if qtype == Q.Q4_K else quantize(x, qtype)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K], ids=lambda q: q.name)
def test_repack_is_exact(qtype: Q) -> None:
    raw = _blocks(qtype, np.random.default_rng(1))
    expected = dequantize(raw, qtype)
    packed = repack(raw, qtype, ROWS, COLS)
    assert np.array_equal(packed.dequantize(), expected)
    got = mx.dequantize(
        mx.array(packed.codes), mx.array(packed.scales), mx.array(packed.biases), group_size=GROUP_SIZE, bits=packed.bits
    )
    assert np.array_equal(np.array(got), expected)


def test_repack_of_arbitrary_q4_k_bytes_is_exact() -> None:
    """Every bit pattern of the scale/min bytes and nibbles, not only what a quantizer emits."""
    rng = np.random.default_rng(2)
    _, size = GGML_QUANT_SIZES[Q.Q4_K]
    raw = rng.integers(0, 256, (ROWS, COLS // 256, size), dtype=np.uint8)
    raw[:, :, 0:4] = (rng.standard_normal((ROWS, COLS // 256, 2)) * 0.01).astype(np.float16).view(np.uint8).reshape(ROWS, -1, 4)
    raw = raw.reshape(ROWS, -1)
    assert np.array_equal(repack(raw, Q.Q4_K, ROWS, COLS).dequantize(), dequantize(raw, Q.Q4_K))


def test_quantized_matmul_on_repacked_q4_k_matches_dequantized_weights() -> None:
    raw = _blocks(Q.Q4_K, np.random.default_rng(3))
    packed = repack(raw, Q.Q4_K, ROWS, COLS)
    x = np.random.default_rng(4).standard_normal((3, COLS)).astype(np.float32)
    got = mx.quantized_matmul(
        mx.array(x), mx.array(packed.codes), mx.array(packed.scales), mx.array(packed.biases),
        transpose=True, group_size=GROUP_SIZE, bits=4,
    )  # fmt: skip
    expected = x.astype(np.float64) @ dequantize(raw, Q.Q4_K).astype(np.float64).T
    assert np.max(np.abs(np.array(got) - expected)) < 1e-3 * np.max(np.abs(expected))


def test_types_without_an_exact_form_are_refused() -> None:
    with pytest.raises(ValueError, match="Q5_0 has no exact MLX form"):
        repack(np.zeros((1, 22), np.uint8), Q.Q5_0, 1, 32)
