"""The hidden-state wire codec: float16 by default, never infinities."""

from __future__ import annotations

import numpy as np
import pytest

from inclavate import tensors


def test_float16_round_trip_is_close_and_half_the_size() -> None:
    x = np.random.default_rng(0).normal(size=(7, 576)).astype(np.float32) * 100
    packed = tensors.encode(x)
    assert packed.dtype == "f16" and packed.nbytes == x.size * 2
    np.testing.assert_allclose(tensors.decode(packed), x, rtol=1e-3)


def test_float32_is_exact() -> None:
    x = np.random.default_rng(1).normal(size=(3, 64)).astype(np.float32)
    assert np.array_equal(tensors.decode(tensors.encode(x, "f32")), x)


def test_values_beyond_float16_fall_back_instead_of_becoming_infinite() -> None:
    x = np.array([[1.0, 70000.0, -1e6]], np.float32)
    packed = tensors.encode(x, "f16")
    assert packed.dtype == "f32"
    assert np.array_equal(tensors.decode(packed), x)
    packed = tensors.encode(x, "f16", fallback="bf16")
    assert packed.dtype == "bf16" and np.isfinite(tensors.decode(packed)).all()


def test_bfloat16_rounds_to_nearest_even_and_keeps_nan() -> None:
    x = np.array([1.0, 1.00390625, 1.01171875, np.nan, -3.3e38], np.float32)
    out = tensors.decode(tensors.encode(x, "bf16"))
    assert out[0] == 1.0 and out[1] == 1.0 and out[2] == 1.015625
    assert np.isnan(out[3]) and np.isfinite(out[4])


def test_decode_refuses_bytes_that_do_not_match_the_shape() -> None:
    with pytest.raises(tensors.TensorDecodeError):
        tensors.decode(tensors.EncodedTensor("f16", (2, 3), b"\0" * 10))
    with pytest.raises(tensors.TensorDecodeError):
        tensors.decode(tensors.EncodedTensor("f8", (1,), b"\0"))  # type: ignore[arg-type]
