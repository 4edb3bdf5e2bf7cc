"""The MLX engine on random-weight GGUFs of each architecture it claims, and refusals of the rest.

For each: logits against the float64 NumPy reference, a split chain against one range, and
greedy tokens against llama.cpp on the same file (float32 weights, where llama.cpp does not
quantize activations, so the two engines agree closely: this is what pins each
architecture's RoPE layout to llama.cpp's and not merely to the reference's reading of it).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf_factory import write_random_gguf
from numpy_reference import NumpyModel, cosine
from q4k import requantize_q4_k, rewrite_gguf
from test_engine_archs import PROMPT, _run

from inclavate.types import LayerRange, ModelId, SessionId
from node.engine import BatchItem, EngineConfig, LayerEngine
from node.errors import UnsupportedArchitecture
from node.llamacpp_engine import LlamaCppEngine
from node.mlx_engine import MlxEngine

pytestmark = pytest.mark.slow
CONFIG = EngineConfig(n_threads=1, context_length=256, max_sessions=2)
N_LAYERS = 6

CASES = [
    ("llama", {}, [2, 4]),
    ("llama", {"tied_output": False}, [3]),
    ("qwen2", {}, [2, 4]),
    ("qwen3", {"dtype": "f16"}, [1, 4]),
]


def _mlx(path: Path, cuts: list[int]) -> list[LayerEngine]:
    bounds = [0, *cuts, N_LAYERS]
    return [
        MlxEngine(model_id=ModelId("t"), model_path=path, layers=LayerRange(a, b), config=CONFIG)
        for a, b in zip(bounds, bounds[1:])
    ]


def _close(engines: list[LayerEngine]) -> None:
    for engine in engines:
        engine.close()


@pytest.mark.parametrize(("arch", "options", "cuts"), CASES, ids=[f"{a}-{'-'.join(map(str, c))}" for a, _, c in CASES])
def test_mlx_matches_reference_and_llamacpp(arch: str, options: dict, cuts: list[int], smollm2, tmp_path: Path) -> None:
    path = write_random_gguf(tmp_path / f"{arch}.gguf", arch, tokenizer_from=smollm2.path, seed=7, **options)
    whole, parts = _mlx(path, []), _mlx(path, cuts)
    llama = LlamaCppEngine(model_id=ModelId("t"), model_path=path, layers=LayerRange(0, N_LAYERS), config=CONFIG,
                           slice_cache=tmp_path / "slices")  # fmt: skip
    try:
        tokens = _run(whole, 16)
        assert len(set(tokens)) > 2, "degenerate model: the comparison would prove little"
        assert _run(parts, 16) == tokens
        assert _run([llama], 16) == tokens
        (out,) = whole[0].forward([_item(PROMPT)])
        assert cosine(out.logits, NumpyModel(path).logits(list(PROMPT))) > 0.99999
    finally:
        _close([*whole, *parts, llama])


def test_q4_k_weights_are_repacked_exactly(smollm2, tmp_path: Path) -> None:
    """A Q4_K model: MLX keeps it quantized and still matches the float64 reference, which
    dequantizes the same blocks with gguf's own code."""
    source = write_random_gguf(tmp_path / "f.gguf", "llama", d_model=256, n_head=4, n_head_kv=2, n_ff=512,
                               tokenizer_from=smollm2.path, seed=3)  # fmt: skip
    path = requantize_q4_k(source, tmp_path / "q4k.gguf")
    whole, parts = _mlx(path, []), _mlx(path, [3])
    try:
        (out,) = whole[0].forward([_item(PROMPT)])
        assert cosine(out.logits, NumpyModel(path).logits(list(PROMPT))) > 0.99999
        assert _run(parts, 8) == _run(whole, 8)
        # Kept quantized: 4.5 bits per weight plus float32 scale and bias per 32 (6.5 bits
        # in all), far below the 32 bits a dequantized copy would take.
        block_params = N_LAYERS * (2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 512)
        assert whole[0].memory().weights_bytes < block_params * 2 + 49152 * 256 * 2 + 2**20
    finally:
        _close(whole + parts)


def test_llama3_rope_frequency_factors_match_llamacpp(smollm2, tmp_path: Path) -> None:
    """Llama 3.1+ files carry ``rope_freqs`` (per-pair divisors of the rotary frequencies)."""
    source = write_random_gguf(tmp_path / "l.gguf", "llama", tokenizer_from=smollm2.path, seed=11)
    factors = np.linspace(1.0, 8.0, 64 // 4 // 2, dtype=np.float32)  # head_dim 16 -> 8 pairs
    path = rewrite_gguf(source, tmp_path / "l3.gguf", extra={"rope_freqs.weight": factors})
    mlx, plain = _mlx(path, [3]), _mlx(source, [])
    llama = LlamaCppEngine(model_id=ModelId("t"), model_path=path, layers=LayerRange(0, N_LAYERS), config=CONFIG,
                           slice_cache=tmp_path / "slices")  # fmt: skip
    try:
        tokens = _run(mlx, 16)
        assert _run([llama], 16) == tokens
        assert _run(plain, 16) != tokens, "the factors changed nothing: the test proves little"
    finally:
        _close([*mlx, *plain, llama])


def test_a_middle_range_takes_hidden_states_beyond_float16_range(smollm2, tmp_path: Path) -> None:
    """Some models' residual streams exceed 65,504; MLX computes in float32 so they pass
    through a middle range as they would through llama.cpp (the wire then picks f32/bf16)."""
    path = write_random_gguf(tmp_path / "m.gguf", "qwen2", tokenizer_from=smollm2.path, seed=5)
    x = np.random.default_rng(0).standard_normal((7, 64)).astype(np.float32) * 3e4
    x[0, 0] = 2e5
    with MlxEngine(model_id=ModelId("t"), model_path=path, layers=LayerRange(2, 4), config=CONFIG) as engine:
        (out,) = engine.forward([BatchItem(SessionId("big"), 0, hidden=x)])
    expected = NumpyModel(path).hidden([], range(2, 4), x=x.astype(np.float64))
    assert np.isfinite(out.hidden).all() and np.abs(out.hidden).max() > 65504
    assert cosine(out.hidden, expected) > 0.999999


@pytest.mark.parametrize(("arch", "options", "match"), [
    ("gemma2", {}, "MLX engine runs llama, qwen2, qwen3, not 'gemma2'"),
    ("phi3", {}, "not 'phi3'"),
    ("qwen3", {"layer_arrays": True}, "differs per layer"),
])  # fmt: skip
def test_other_architectures_are_refused(arch: str, options: dict, match: str, smollm2, tmp_path: Path) -> None:
    path = write_random_gguf(tmp_path / f"{arch}.gguf", arch, tokenizer_from=smollm2.path, **options)
    with pytest.raises(UnsupportedArchitecture, match=match):
        MlxEngine(model_id=ModelId("t"), model_path=path, layers=LayerRange(0, 3), config=CONFIG)


def _item(tokens: np.ndarray) -> BatchItem:
    return BatchItem(SessionId("ref"), 0, tokens=np.asarray(tokens, np.int32))
