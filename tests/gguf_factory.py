"""Small random-weight GGUF models, one per architecture, for engine and slicer tests.

Real checkpoints of every architecture the engine claims to run would cost gigabytes; these
files are 9-15 MB at the defaults (mostly the 49152-token embedding and vocabulary), load in
a fraction of a second, and exercise the same llama.cpp code paths (tensor names, shapes,
per-arch hyperparameters, SWA, MoE routing, softcapping).
The tokenizer is borrowed from a real GGUF (SmolLM2) so that prompts tokenize normally.

Choices worth knowing when a test leans on them:

* ``token_embd`` (and ``output`` when untied) are always F16: at vocab 49152 they are most of
  the file. ``dtype`` selects the type of every other matrix; 1-D tensors (norms, biases,
  rope factors) are always F32, as llama.cpp's converters write them.
* Matrices are N(0, 1/fan_in): each block then adds O(1) to a residual stream whose embedding
  part is small (std 0.02). With tied output and weak blocks the next-token logits would be
  dominated by ``E @ e_t``, i.e. the model would repeat its last token forever.
* gemma2/gemma3 get ``<arch>.attention.sliding_window_pattern``, a BOOL array of length
  n_layers holding llama.cpp's own by-index default (gemma2 ``il % 2 == 0``, gemma3
  ``il % 6 < 5``). Written explicitly so that a slicer that slices every n_layer-long
  ``<arch>.*`` array keeps each layer's original flag (measured: llama.cpp reads the array;
  inverting it changes the output, omitting it does not). The window is small (32 tokens) so
  that prompts of ordinary test length already cross it. Avoid n_layers 46 (gemma2) and 62
  (gemma3): llama.cpp takes those for "27B" and changes the attention scale.
* With ``layer_arrays=True``, head_count, head_count_kv and feed_forward_length are written as
  per-layer arrays (llama.cpp accepts either form) to exercise a slicer's array handling.
* phi3 gets ``rope_factors_long``/``rope_factors_short`` (both differ from plain RoPE) and an
  original context of 512: llama.cpp picks the long factors when n_ctx per sequence exceeds
  it (n_ctx >= 768 here; llama.cpp pads n_ctx up to a multiple of 256), so every stage of a
  chain must use the same n_ctx. gemma2 has no ``output`` tensor in llama.cpp (always tied).
* Each tensor's values depend only on (seed, tensor name): the tied and untied variants share
  ``token_embd``, and a file with more layers shares its first layers with a shorter one.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import gguf
import numpy as np
from gguf import MODEL_TENSOR as T

from inclavate.errors import InclavateError

# Neutral on purpose: llama.cpp's vocab loader switches on substrings of general.name
# (a name containing "phi3" enables Phi-3 special-token handling).
MODEL_NAME = "inclavate random test model"
CONTEXT_LENGTH = 2048
SLIDING_WINDOW = 32
N_EXPERT = 4
N_EXPERT_USED = 2
PHI3_ORIGINAL_CONTEXT = 512
EMBED_STD = 0.02
NORM_NOISE = 0.05


class GgufFactoryError(InclavateError, ValueError):
    """An architecture or option combination this factory cannot write."""


@dataclass(frozen=True)
class _Dims:
    n_layers: int
    d_model: int
    n_head: int
    n_head_kv: int
    n_ff: int

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def q_rows(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_rows(self) -> int:
        return self.n_head_kv * self.head_dim


# Shapes are numpy order (rows = output features, last axis = input features), the reverse of
# ggml's ne[] that llama.cpp error messages print.
_Shapes = dict[T, tuple[int, ...]]


def _attention(d: _Dims) -> _Shapes:
    return {
        T.ATTN_NORM: (d.d_model,),
        T.ATTN_Q: (d.q_rows, d.d_model),
        T.ATTN_K: (d.kv_rows, d.d_model),
        T.ATTN_V: (d.kv_rows, d.d_model),
        T.ATTN_OUT: (d.d_model, d.q_rows),
    }


def _qk_norm(d: _Dims) -> _Shapes:
    return {T.ATTN_Q_NORM: (d.head_dim,), T.ATTN_K_NORM: (d.head_dim,)}


def _dense_ffn(d: _Dims) -> _Shapes:
    return {
        T.FFN_NORM: (d.d_model,),
        T.FFN_GATE: (d.n_ff, d.d_model),
        T.FFN_UP: (d.n_ff, d.d_model),
        T.FFN_DOWN: (d.d_model, d.n_ff),
    }


def _gemma_post_norms(d: _Dims) -> _Shapes:
    return {T.ATTN_POST_NORM: (d.d_model,), T.FFN_POST_NORM: (d.d_model,)}


def _moe_ffn(d: _Dims) -> _Shapes:
    return {
        T.FFN_NORM: (d.d_model,),
        T.FFN_GATE_INP: (N_EXPERT, d.d_model),
        T.FFN_GATE_EXP: (N_EXPERT, d.n_ff, d.d_model),
        T.FFN_UP_EXP: (N_EXPERT, d.n_ff, d.d_model),
        T.FFN_DOWN_EXP: (N_EXPERT, d.d_model, d.n_ff),
    }


def _phi3_block(d: _Dims) -> _Shapes:
    # phi3 fuses q|k|v into one matrix and gate|up into ffn_up (llama.cpp splits them in the graph).
    return {
        T.ATTN_NORM: (d.d_model,),
        T.ATTN_QKV: (d.q_rows + 2 * d.kv_rows, d.d_model),
        T.ATTN_OUT: (d.d_model, d.q_rows),
        T.FFN_NORM: (d.d_model,),
        T.FFN_UP: (2 * d.n_ff, d.d_model),
        T.FFN_DOWN: (d.d_model, d.n_ff),
    }


def _qwen2_biases(d: _Dims) -> dict[str, tuple[int, ...]]:
    return {
        f"{gguf.TENSOR_NAMES[kind]}.bias": (rows,)
        for kind, rows in ((T.ATTN_Q, d.q_rows), (T.ATTN_K, d.kv_rows), (T.ATTN_V, d.kv_rows))
    }


def _swa_pattern(period: int, n_swa_per_period: int) -> Callable[[_Dims], dict[str, Any]]:
    def keys(d: _Dims) -> dict[str, Any]:
        flags = [il % period < n_swa_per_period for il in range(d.n_layers)]
        return {"attention.sliding_window": SLIDING_WINDOW, "attention.sliding_window_pattern": flags}

    return keys


def _head_dims(d: _Dims) -> dict[str, Any]:
    return {"attention.key_length": d.head_dim, "attention.value_length": d.head_dim}


@dataclass(frozen=True)
class _ArchSpec:
    block: Callable[[_Dims], _Shapes]
    extra_keys: Callable[[_Dims], dict[str, Any]] = lambda d: {}
    # Tensors whose names are not plain "<blk name>.weight" (biases), per layer.
    raw_block: Callable[[_Dims], dict[str, tuple[int, ...]]] = lambda d: {}
    has_output: bool = True  # False: llama.cpp never loads an ``output`` tensor (always tied)
    rms_eps: float = 1e-5
    rope_base: float = 10000.0
    rope_factors: bool = False


def _join(*parts: Callable[[_Dims], Any]) -> Callable[[_Dims], Any]:
    return lambda d: functools.reduce(lambda acc, part: acc | part(d), parts, {})


_ARCHS: Mapping[str, _ArchSpec] = {
    "llama": _ArchSpec(_join(_attention, _dense_ffn)),
    "qwen2": _ArchSpec(_join(_attention, _dense_ffn), raw_block=_qwen2_biases, rms_eps=1e-6),
    "qwen3": _ArchSpec(_join(_attention, _qk_norm, _dense_ffn), _head_dims, rms_eps=1e-6),
    "gemma2": _ArchSpec(
        _join(_attention, _dense_ffn, _gemma_post_norms),
        _join(_head_dims, _swa_pattern(2, 1), lambda d: {
            "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}),
        has_output=False, rms_eps=1e-6,
    ),
    "gemma3": _ArchSpec(
        _join(_attention, _qk_norm, _dense_ffn, _gemma_post_norms),
        _join(_head_dims, _swa_pattern(6, 5)), rms_eps=1e-6,
        # Differs from the fixed 10000 of gemma3's local layers, so a layer whose SWA flag is
        # wrong changes the output from the first token on.
        rope_base=1e6,
    ),
    "phi3": _ArchSpec(
        _phi3_block,
        lambda d: {"rope.scaling.original_context_length": PHI3_ORIGINAL_CONTEXT},
        rope_factors=True,
    ),
    "qwen3moe": _ArchSpec(
        _join(_attention, _qk_norm, _moe_ffn),
        _join(_head_dims, lambda d: {
            "expert_count": N_EXPERT, "expert_used_count": N_EXPERT_USED,
            "expert_feed_forward_length": d.n_ff}),
        rms_eps=1e-6,
    ),
}

SUPPORTED_ARCHS: tuple[str, ...] = tuple(_ARCHS)


def write_random_gguf(
    path: Path, arch: str, *, n_layers: int = 6, d_model: int = 64, n_head: int = 4,
    n_head_kv: int = 2, n_ff: int = 128, seed: int = 0, tokenizer_from: Path,
    chat_template: str | None = None, tied_output: bool = True,
    dtype: Literal["f32", "f16"] = "f32", layer_arrays: bool = False,
) -> Path:
    """Write a random model of ``arch`` to ``path``; same arguments give the same bytes.

    ``n_ff`` is the expert FFN width for qwen3moe. ``layer_arrays`` writes head counts and
    FFN width as per-layer arrays (see the module docstring).
    """
    spec = _ARCHS.get(arch)
    if spec is None:
        raise GgufFactoryError(f"unsupported arch {arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}")
    if not (spec.has_output or tied_output):
        raise GgufFactoryError(f"{arch} has no output tensor in llama.cpp: it is always tied")
    if d_model % n_head or n_head % n_head_kv:
        raise GgufFactoryError("d_model must be a multiple of n_head, n_head of n_head_kv")
    dims = _Dims(n_layers, d_model, n_head, n_head_kv, n_ff)
    tokenizer = _tokenizer_fields(Path(tokenizer_from))
    n_vocab = next(len(value) for key, value, _, _ in tokenizer if key == gguf.Keys.Tokenizer.LIST)

    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(MODEL_NAME)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if dtype == "f16" else gguf.LlamaFileType.ALL_F32)
    for key, value in _hparams(spec, dims, layer_arrays).items():
        _add_typed(writer, f"{arch}.{key}", value)
    for key, value, vtype, sub_type in tokenizer:
        if not (key == gguf.Keys.Tokenizer.CHAT_TEMPLATE and chat_template is not None):
            writer.add_key_value(key, value, vtype, sub_type)
    if chat_template is not None:
        writer.add_chat_template(chat_template)

    matrix_dtype = np.float16 if dtype == "f16" else np.float32
    for name, shape in _tensor_shapes(spec, dims, n_vocab, tied_output).items():
        writer.add_tensor(name, _random_tensor(name, shape, seed, matrix_dtype))
    if spec.rope_factors:
        for name, values in _rope_factors(dims).items():
            writer.add_tensor(name, values)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def _hparams(spec: _ArchSpec, d: _Dims, layer_arrays: bool) -> dict[str, Any]:
    def per_layer(value: int) -> int | list[int]:
        return [value] * d.n_layers if layer_arrays else value

    return {
        "context_length": CONTEXT_LENGTH,
        "embedding_length": d.d_model,
        "block_count": d.n_layers,
        "feed_forward_length": per_layer(d.n_ff),
        "attention.head_count": per_layer(d.n_head),
        "attention.head_count_kv": per_layer(d.n_head_kv),
        "attention.layer_norm_rms_epsilon": spec.rms_eps,
        "rope.freq_base": spec.rope_base,
        "rope.dimension_count": d.head_dim,
    } | spec.extra_keys(d)


def _add_typed(writer: gguf.GGUFWriter, key: str, value: Any) -> None:
    # Scalars as llama.cpp's converters write them (UINT32 / FLOAT32); lists become INT32 or
    # BOOL arrays, also as converters write them, which the loader's get_key_or_arr accepts.
    if isinstance(value, list):
        writer.add_array(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    else:
        writer.add_uint32(key, value)


def _tensor_shapes(spec: _ArchSpec, d: _Dims, n_vocab: int, tied: bool) -> dict[str, tuple[int, ...]]:
    names = gguf.TENSOR_NAMES
    shapes: dict[str, tuple[int, ...]] = {f"{names[T.TOKEN_EMBD]}.weight": (n_vocab, d.d_model)}
    for il in range(d.n_layers):
        for kind, shape in spec.block(d).items():
            shapes[f"{names[kind].format(bid=il)}.weight"] = shape
        for name, shape in spec.raw_block(d).items():
            shapes[name.format(bid=il)] = shape
    shapes[f"{names[T.OUTPUT_NORM]}.weight"] = (d.d_model,)
    if not tied:
        shapes[f"{names[T.OUTPUT]}.weight"] = (n_vocab, d.d_model)
    return shapes


_VOCAB_TENSORS = {f"{gguf.TENSOR_NAMES[T.TOKEN_EMBD]}.weight", f"{gguf.TENSOR_NAMES[T.OUTPUT]}.weight"}


def _random_tensor(name: str, shape: tuple[int, ...], seed: int, matrix_dtype: type) -> np.ndarray:
    # Seeded by (seed, name) rather than one stream, so a tensor does not depend on which
    # other tensors were drawn before it (see the module docstring).
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    noise = rng.standard_normal(shape, dtype=np.float32)
    if name == f"{gguf.TENSOR_NAMES[T.TOKEN_EMBD]}.weight":
        return (noise * EMBED_STD).astype(np.float16)
    if len(shape) == 1:
        # Biases near 0, norm gains near 1 (gemma's GGUF norms already include its "+1").
        return noise * EMBED_STD if name.endswith(".bias") else 1.0 + noise * NORM_NOISE
    scaled = noise / np.sqrt(shape[-1], dtype=np.float32)
    return scaled.astype(np.float16 if name in _VOCAB_TENSORS else matrix_dtype)


def _rope_factors(d: _Dims) -> dict[str, np.ndarray]:
    # Divisors of the rotary frequencies, one per rotated pair. Neither set is all ones and
    # they differ from each other, so which one llama.cpp picked shows in the output.
    n_pairs = d.head_dim // 2
    return {
        f"{gguf.TENSOR_NAMES[T.ROPE_FACTORS_SHORT]}.weight": np.linspace(1.0, 1.5, n_pairs, dtype=np.float32),
        f"{gguf.TENSOR_NAMES[T.ROPE_FACTORS_LONG]}.weight": np.linspace(1.0, 4.0, n_pairs, dtype=np.float32),
    }


_TokenizerField = tuple[str, Any, gguf.GGUFValueType, gguf.GGUFValueType | None]


@functools.lru_cache(maxsize=4)
def _tokenizer_fields(source: Path) -> tuple[_TokenizerField, ...]:
    """Every ``tokenizer.*`` key of ``source`` with its GGUF types, cached: parsing the
    ~100k vocab and merge strings of SmolLM2 takes about two seconds."""
    fields = []
    for key, field in gguf.GGUFReader(source).fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = gguf.GGUFValueType(field.types[0])
        sub_type = gguf.GGUFValueType(field.types[-1]) if vtype == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        fields.append((key, tuple(value) if isinstance(value, list) else value, vtype, sub_type))
    return tuple(fields)
