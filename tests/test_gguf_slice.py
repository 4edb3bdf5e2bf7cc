"""Slicing GGUF metadata: fast reads, per-layer arrays, the cache."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
from gguf_factory import write_random_gguf

from inclavate.gguf_meta import ArrayInfo, GgufFormatError, read_metadata
from inclavate.types import LayerRange
from node.gguf_slice import cached_slice, write_vocab_only


def test_fast_metadata_matches_the_reference_reader(smollm2) -> None:
    meta = read_metadata(smollm2.path)
    reader = gguf.GGUFReader(smollm2.path)
    assert meta.arch == "llama" and meta.n_layers == 30 and meta.d_model == 576
    assert meta.tensor_count == len(reader.tensors)
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        value = meta.values[key]
        if isinstance(value, ArrayInfo):
            assert value.length == len(field.data)
        else:
            assert value == field.contents()


def test_not_a_gguf_file(tmp_path: Path) -> None:
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"GGML" + b"\0" * 32)
    with pytest.raises(GgufFormatError):
        read_metadata(bad)


def test_slice_cuts_per_layer_arrays_and_renumbers_blocks(smollm2, tmp_path: Path) -> None:
    path = write_random_gguf(tmp_path / "q.gguf", "qwen3", n_layers=6, layer_arrays=True, tokenizer_from=smollm2.path)
    sliced = cached_slice(path, "abc123", LayerRange(2, 5), tmp_path / "cache")
    reader = gguf.GGUFReader(sliced)
    assert reader.get_field("qwen3.block_count").contents() == 3
    assert len(reader.get_field("qwen3.attention.head_count").contents()) == 3
    blocks = {t.name.split(".")[1] for t in reader.tensors if t.name.startswith("blk.")}
    assert blocks == {"0", "1", "2"}
    assert "token_embd.weight" in {t.name for t in reader.tensors}
    # Cached: the second request returns the same file without rewriting it.
    mtime = sliced.stat().st_mtime_ns
    assert cached_slice(path, "abc123", LayerRange(2, 5), tmp_path / "cache") == sliced
    assert sliced.stat().st_mtime_ns == mtime
    assert cached_slice(path, "abc123", LayerRange(0, 6), tmp_path / "cache") == path


def test_vocab_only_copy_has_metadata_and_no_tensors(smollm2, tmp_path: Path) -> None:
    from node.tokenizer import Tokenizer

    vocab = write_vocab_only(smollm2.path, tmp_path / "vocab.gguf")
    meta = read_metadata(vocab)
    assert meta.tensor_count == 0 and vocab.stat().st_size < 5 * 1024 * 1024
    with Tokenizer(vocab) as small, Tokenizer(smollm2.path) as full:
        text = "<|im_start|>user\nHello, world!<|im_end|>"
        assert small.tokenize(text) == full.tokenize(text)
