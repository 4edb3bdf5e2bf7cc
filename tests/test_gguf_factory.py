"""The random-GGUF factory: file structure without llama.cpp, then real loads with it.

Structural tests borrow a four-token tokenizer so they parse fast and run without SmolLM2;
the llama.cpp tests need SmolLM2's real vocabulary and skip without it.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import gguf
import pytest

from gguf_factory import (
    MODEL_NAME,
    SUPPORTED_ARCHS,
    GgufFactoryError,
    write_random_gguf,
)

# Variants llama.cpp must load: every arch with its defaults, plus the untied, F16 and
# per-layer-array layouts real checkpoints use.
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {arch: (arch, {}) for arch in SUPPORTED_ARCHS} | {
    "llama-untied": ("llama", {"tied_output": False}),
    "phi3-untied": ("phi3", {"tied_output": False}),
    "qwen3-f16": ("qwen3", {"dtype": "f16"}),
    "gemma3-arrays": ("gemma3", {"layer_arrays": True}),
}
PROMPT = b"The quick brown fox jumps over the lazy dog."
N_GENERATED = 16
# Every variant measured 15-22 distinct tokens in 32 greedy steps; 4 in 16 leaves margin.
MIN_DISTINCT = 4
# One thread: these models are tiny, and llama.cpp's OpenMP workers busy-wait at every graph
# node, so two threads on a shared 2-core machine were measured up to 30x slower per token.
N_THREADS = 1
SMALL: dict[str, Any] = {"n_layers": 3, "d_model": 32, "n_head": 4, "n_head_kv": 1, "n_ff": 48}


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok") / "tok.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["<s>", "a", "b", "c"])
    writer.add_token_types([3, 1, 1, 1])
    writer.add_bos_token_id(0)
    writer.add_chat_template("{{ messages }}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def smollm2_path(smollm2) -> Path:
    return smollm2.path


def _fields(path: Path) -> tuple[dict[str, Any], gguf.GGUFReader]:
    reader = gguf.GGUFReader(path)
    return {key: field.contents() for key, field in reader.fields.items()}, reader


def _names_known_to_gguf(arch: str, n_layers: int) -> set[str]:
    arch_id = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    templates = [gguf.TENSOR_NAMES[kind] for kind in gguf.MODEL_TENSORS[arch_id]]
    return {t.format(bid=il) for t in templates for il in range(n_layers)}


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
def test_tensors_are_named_as_gguf_constants_say(arch: str, tiny_tokenizer: Path, tmp_path: Path) -> None:
    path = write_random_gguf(tmp_path / "m.gguf", arch, tokenizer_from=tiny_tokenizer, **SMALL)
    _, reader = _fields(path)
    names = {t.name.rsplit(".", 1)[0] for t in reader.tensors}
    assert names <= _names_known_to_gguf(arch, SMALL["n_layers"])
    per_block = [{n.split(".", 2)[2] for n in names if n.startswith(f"blk.{il}.")} for il in range(3)]
    assert per_block[0] and per_block[0] == per_block[1] == per_block[2]
    shapes = {t.name: tuple(int(x) for x in t.shape) for t in reader.tensors}
    assert shapes["token_embd.weight"] == (32, 4)  # ggml order: (n_embd, n_vocab)
    assert shapes["output_norm.weight"] == (32,)


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
def test_hyperparameters_are_what_was_asked(arch: str, tiny_tokenizer: Path, tmp_path: Path) -> None:
    path = write_random_gguf(tmp_path / "m.gguf", arch, tokenizer_from=tiny_tokenizer, **SMALL)
    fields, _ = _fields(path)
    assert fields["general.architecture"] == arch
    assert fields["general.name"] == MODEL_NAME
    expected = {"block_count": 3, "embedding_length": 32, "feed_forward_length": 48,
                "attention.head_count": 4, "attention.head_count_kv": 1, "rope.dimension_count": 8}
    assert {key: fields[f"{arch}.{key}"] for key in expected} == expected
    if arch.startswith("gemma"):
        period, n_swa = (2, 1) if arch == "gemma2" else (6, 5)
        pattern = fields[f"{arch}.attention.sliding_window_pattern"]
        assert pattern == [il % period < n_swa for il in range(3)]
    if arch == "gemma2":
        assert fields["gemma2.final_logit_softcapping"] == pytest.approx(30.0)
        assert fields["gemma2.attn_logit_softcapping"] == pytest.approx(50.0)
    if arch == "qwen3moe":
        assert fields["qwen3moe.expert_count"] > fields["qwen3moe.expert_used_count"] > 0
        assert fields["qwen3moe.expert_feed_forward_length"] == 48


def test_layer_arrays_have_one_entry_per_layer(tiny_tokenizer: Path, tmp_path: Path) -> None:
    path = write_random_gguf(tmp_path / "m.gguf", "qwen3", tokenizer_from=tiny_tokenizer,
                             layer_arrays=True, **SMALL)
    fields, _ = _fields(path)
    assert fields["qwen3.attention.head_count"] == [4, 4, 4]
    assert fields["qwen3.attention.head_count_kv"] == [1, 1, 1]
    assert fields["qwen3.feed_forward_length"] == [48, 48, 48]


def test_tokenizer_is_copied_and_template_overridden(tiny_tokenizer: Path, tmp_path: Path) -> None:
    source, _ = _fields(tiny_tokenizer)
    kept, _ = _fields(write_random_gguf(tmp_path / "a.gguf", "llama", tokenizer_from=tiny_tokenizer))
    assert {k: v for k, v in kept.items() if k.startswith("tokenizer.")} == {
        k: v for k, v in source.items() if k.startswith("tokenizer.")}
    overridden, _ = _fields(write_random_gguf(
        tmp_path / "b.gguf", "llama", tokenizer_from=tiny_tokenizer, chat_template="<think>{{ x }}"))
    assert overridden["tokenizer.chat_template"] == "<think>{{ x }}"


def test_same_seed_same_bytes(tiny_tokenizer: Path, tmp_path: Path) -> None:
    def write(name: str, seed: int) -> bytes:
        return write_random_gguf(tmp_path / name, "qwen3moe", tokenizer_from=tiny_tokenizer,
                                 seed=seed).read_bytes()

    assert write("a.gguf", 7) == write("b.gguf", 7)
    assert write("c.gguf", 8) != write("a.gguf", 7)


@pytest.mark.parametrize(("arch", "options"), [("mamba", {}), ("gemma2", {"tied_output": False}),
                                               ("llama", {"n_head": 3})])
def test_rejects_what_llama_cpp_cannot_load(arch: str, options: dict[str, Any],
                                            tiny_tokenizer: Path, tmp_path: Path) -> None:
    with pytest.raises(GgufFactoryError):
        write_random_gguf(tmp_path / "m.gguf", arch, tokenizer_from=tiny_tokenizer, **options)
    assert not (tmp_path / "m.gguf").exists()





def _greedy(path: Path) -> tuple[list[int], dict[str, str]]:
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, verbose=False, n_threads=N_THREADS)
    try:
        tokens = llm.generate(llm.tokenize(PROMPT), temp=0.0)
        return list(itertools.islice(tokens, N_GENERATED)), dict(llm.metadata)
    finally:
        llm.close()


@pytest.mark.parametrize("variant", VARIANTS)
def test_llama_cpp_generates_deterministically(variant: str, smollm2_path: Path, tmp_path: Path) -> None:
    arch, options = VARIANTS[variant]
    path = write_random_gguf(tmp_path / f"{variant}.gguf", arch, tokenizer_from=smollm2_path, **options)
    first, metadata = _greedy(path)
    second, _ = _greedy(path)
    assert first == second
    assert len(first) == N_GENERATED and all(0 <= t < 49152 for t in first)
    assert len(set(first)) >= MIN_DISTINCT
    assert metadata["general.architecture"] == arch
    assert metadata[f"{arch}.block_count"] == "6"
    assert metadata[f"{arch}.embedding_length"] == "64"


def test_llama_cpp_reads_layer_arrays_like_scalars(smollm2_path: Path, tmp_path: Path) -> None:
    scalars = write_random_gguf(tmp_path / "s.gguf", "qwen3", tokenizer_from=smollm2_path)
    arrays = write_random_gguf(tmp_path / "a.gguf", "qwen3", tokenizer_from=smollm2_path, layer_arrays=True)
    assert _greedy(scalars)[0] == _greedy(arrays)[0]


def test_llama_cpp_sees_the_chat_template_override(smollm2_path: Path, tmp_path: Path) -> None:
    template = "{% for m in messages %}<think>{{ m.content }}</think>{% endfor %}"
    path = write_random_gguf(tmp_path / "m.gguf", "llama", tokenizer_from=smollm2_path, chat_template=template)
    assert _greedy(path)[1]["tokenizer.chat_template"] == template
