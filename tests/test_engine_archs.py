"""Every architecture the engine accepts splits exactly; the others are refused at load time."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf_factory import write_random_gguf

from inclavate.types import LayerRange, ModelId
from node.arch import supported_architectures
from node.engine import EngineConfig, LayerEngine
from node.errors import UnsupportedArchitecture
from node.llamacpp_engine import LlamaCppEngine
from node.local_pipeline import greedy_run

CONFIG = EngineConfig(n_threads=1, context_length=256, max_sessions=2)
PROMPT = np.array([1, 4093, 198, 19556, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198] * 3, np.int32)

# (arch, write options, cut points); gemma cuts deliberately fall inside SWA periods so
# that a slice which lost its layers' original sliding-window flags would compute wrongly.
CASES = [
    ("llama", {}, [3, 5]),
    ("llama", {"tied_output": False}, [2]),
    ("qwen2", {}, [2, 4]),
    ("qwen3", {}, [3]),
    ("qwen3", {"dtype": "f16", "layer_arrays": True}, [1, 4]),
    ("qwen3moe", {}, [2, 4]),
    ("phi3", {}, [3]),
    ("gemma2", {"d_model": 64}, [3]),  # sqrt(64) = 8: exact pre-division of embd input
    ("gemma2", {"d_model": 64}, [2, 4]),
    ("gemma3", {"n_layers": 8, "seed": 5}, [3, 6]),
]


def _run(engines: list[LayerEngine], n: int) -> list[int]:
    return greedy_run(engines, PROMPT, n)[0]


def _engines(path: Path, cuts: list[int], n_layers: int, cache: Path) -> list[LayerEngine]:
    bounds = [0, *cuts, n_layers]
    return [
        LlamaCppEngine(
            model_id=ModelId("test"), model_path=path, layers=LayerRange(a, b), config=CONFIG, slice_cache=cache
        )
        for a, b in zip(bounds, bounds[1:])
    ]


@pytest.mark.parametrize(("arch", "options", "cuts"), CASES, ids=[f"{a}-{'-'.join(map(str, c))}" for a, o, c in CASES])
def test_split_equals_whole(arch: str, options: dict, cuts: list[int], smollm2, tmp_path: Path) -> None:
    n_layers = options.get("n_layers", 6)
    options = {"seed": 7, **options}
    path = write_random_gguf(tmp_path / f"{arch}.gguf", arch, tokenizer_from=smollm2.path, **options)
    whole = _engines(path, [], n_layers, tmp_path / "slices")
    parts = _engines(path, cuts, n_layers, tmp_path / "slices")
    try:
        expected = _run(whole, 16)
        assert len(set(expected)) > 2, "degenerate model: the comparison would prove little"
        assert _run(parts, 16) == expected
    finally:
        for engine in whole + parts:
            engine.close()


def test_accepted_architectures_are_the_verified_ones() -> None:
    assert set(supported_architectures()) == {"llama", "qwen2", "qwen3", "qwen3moe", "phi3", "gemma2", "gemma3"}


def test_unverified_architecture_is_refused_when_split_but_runs_whole(smollm2, tmp_path: Path) -> None:
    import gguf

    # Relabel a llama file as an architecture nobody verified: splitting must be refused
    # before anything is written or loaded, with a reason that says what to do instead.
    path = write_random_gguf(tmp_path / "m.gguf", "llama", tokenizer_from=smollm2.path)
    reader = gguf.GGUFReader(path)
    relabelled = tmp_path / "olmo.gguf"
    writer = gguf.GGUFWriter(relabelled, "olmo")
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        key = name.replace("llama.", "olmo.", 1)
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    for t in reader.tensors:
        writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    with pytest.raises(UnsupportedArchitecture, match="olmo.*run it whole"):
        _engines(relabelled, [3], 6, tmp_path / "slices")
    assert not (tmp_path / "slices").exists()


def test_gemma_27b_layer_counts_are_refused(smollm2, tmp_path: Path) -> None:
    path = write_random_gguf(tmp_path / "g.gguf", "gemma2", n_layers=46, d_model=32, n_ff=32, tokenizer_from=smollm2.path)
    with pytest.raises(UnsupportedArchitecture, match="46 layers"):
        _engines(path, [23], 46, tmp_path / "slices")


@pytest.mark.parametrize(("arch", "cut"), [("gemma2", 5), ("gemma3", 5)])
def test_a_range_of_only_global_layers_is_refused_not_crashed(arch: str, cut: int, smollm2, tmp_path: Path) -> None:
    """llama.cpp aborts the process on such a slice; we refuse it with a reason instead."""
    path = write_random_gguf(tmp_path / "g.gguf", arch, d_model=64, tokenizer_from=smollm2.path)
    with pytest.raises(UnsupportedArchitecture, match="5-6 are all global"):
        LlamaCppEngine(model_id=ModelId("t"), model_path=path, layers=LayerRange(cut, 6), config=CONFIG, slice_cache=tmp_path)
