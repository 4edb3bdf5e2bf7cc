"""How hidden states are packed to cross a process boundary.

Engines compute in float32; between stages the residual stream travels as float16 by
default, which halves prefill bandwidth and, on the models measured (shared/NOTES.md),
changes first-step logits by ~1e-3..1e-2 while greedy tokens still agree. float32 is
bit-exact and costs little for a decode step (one row of ``d_model`` floats), so the
precision is a per-link setting. A value that does not fit float16 (|x| > 65504) would
arrive as infinity and poison every later layer, so such a tensor falls back to a wider
type instead: bfloat16 keeps float32's range at float16's size, float32 keeps everything.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

WireDType = Literal["f16", "bf16", "f32"]
WIRE_DTYPES: tuple[WireDType, ...] = ("f16", "bf16", "f32")
FLOAT16_MAX = float(np.finfo(np.float16).max)
_ITEMSIZE = {"f16": 2, "bf16": 2, "f32": 4}


@dataclass(slots=True)
class EncodedTensor:
    """Immutable by convention, not frozen: a hop makes two a token (one decoded, one sent),
    and a frozen dataclass's ``__init__`` costs a C call per field on caches an engine call
    left cold. Compared, never hashed."""

    dtype: WireDType
    shape: tuple[int, ...]
    data: bytes

    @property
    def nbytes(self) -> int:
        return len(self.data)


class TensorDecodeError(ValueError):
    """The bytes do not describe a tensor of the declared dtype and shape."""


def choose_wire_dtype(x: np.ndarray, preferred: WireDType, fallback: WireDType = "f32") -> WireDType:
    """Keep ``preferred`` unless it would overflow; ``fallback`` must hold float32's range."""
    if preferred == "f16" and x.size and float(np.abs(x).max()) > FLOAT16_MAX:
        return fallback
    return preferred


def encode(x: np.ndarray, preferred: WireDType = "f16", fallback: WireDType = "f32", *,
           half: bytes | None = None) -> EncodedTensor:  # fmt: skip
    """Pack a float32 array, widening the dtype if ``preferred`` cannot hold its values.

    ``half``: ``x`` already converted to float16 by whoever made it, bit for bit
    ``x.astype(np.float16)``, and known to fit (``node.engine.StageOutput.half``). Taken as
    is for ``preferred`` f16: a hop's output is encoded on caches its engine call left cold,
    where the conversion and its overflow check cost ~0.1 ms of numpy calls."""
    if half is not None and preferred == "f16":
        return EncodedTensor("f16", x.shape, half)
    x = np.ascontiguousarray(x, dtype=np.float32)
    dtype = choose_wire_dtype(x, preferred, fallback)
    if dtype == "f32":
        data = x.tobytes()
    elif dtype == "f16":
        data = x.astype(np.float16).tobytes()
    else:
        data = _to_bfloat16(x).tobytes()
    return EncodedTensor(dtype, x.shape, data)  # numpy's shape is a tuple of Python ints


def validate(t: EncodedTensor) -> None:
    """Check dtype and size against the shape without decoding (cheap, before queueing)."""
    if t.dtype not in _ITEMSIZE:
        raise TensorDecodeError(f"unknown tensor dtype {t.dtype!r}")
    if t.shape and min(t.shape) < 0:  # one C call: a hop validates every frame
        raise TensorDecodeError(f"negative dimension in shape {list(t.shape)}")
    count = math.prod(t.shape)  # Python ints: np.prod would wrap around on a forged shape
    if count * _ITEMSIZE[t.dtype] != len(t.data):
        raise TensorDecodeError(
            f"{len(t.data)} bytes cannot hold a {t.dtype} tensor of shape {list(t.shape)}"
        )


def decode(t: EncodedTensor) -> np.ndarray:
    """Unpack to a float32 array of the declared shape."""
    validate(t)
    if t.dtype == "f32":
        out = np.frombuffer(t.data, dtype=np.float32).copy()
    elif t.dtype == "f16":
        out = np.frombuffer(t.data, dtype=np.float16).astype(np.float32)
    else:
        raw = np.frombuffer(t.data, dtype=np.uint16).astype(np.uint32) << 16
        out = raw.view(np.float32)
    return out.reshape(t.shape)


def _to_bfloat16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, rounding to nearest even (plain truncation biases toward 0)."""
    bits = x.view(np.uint32)
    rounding = 0x7FFF + ((bits >> 16) & 1)
    out = ((bits + rounding) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():  # rounding could carry a NaN's payload into infinity
        out[nan] = 0x7FC0
    return out
