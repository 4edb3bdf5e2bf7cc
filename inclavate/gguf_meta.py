"""Read a GGUF file's scalar metadata in milliseconds.

``gguf.GGUFReader`` materialises every array element as its own numpy view: on a model with a
49k-token vocabulary that is ~2 s per open, paid by every peer start and every CLI listing.
This reader walks the key/value section once, keeps scalars and string values, skips array
payloads by arithmetic (string arrays by their length prefixes) and records only array lengths.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from inclavate.errors import InclavateError

_MAGIC = b"GGUF"
# GGUF value types: id -> (struct format, size). 8 = string, 9 = array.
_SCALARS: dict[int, tuple[str, int]] = {
    0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
    6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8),
}  # fmt: skip
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32


class GgufFormatError(InclavateError):
    """The file is not a GGUF file this reader understands."""


@dataclass(frozen=True)
class ArrayInfo:
    """Stands in for an array value: its element type and length, not its contents."""

    element_type: int
    length: int


@dataclass(frozen=True)
class TensorInfo:
    ggml_type: int
    dims: tuple[int, ...]
    nbytes: int
    """0 for a type this gguf release does not know."""
    offset: int = 0
    """Where the tensor's data starts, relative to :attr:`GgufMetadata.data_offset`."""

    @property
    def n_elements(self) -> int:
        count = 1
        for d in self.dims:
            count *= d
        return count


@dataclass(frozen=True)
class GgufMetadata:
    version: int
    tensor_count: int
    values: dict[str, Any]
    """Scalars and strings as Python values; arrays as :class:`ArrayInfo`."""
    tensors: dict[str, TensorInfo]
    """Every tensor's type, shape and data size, by name."""
    data_offset: int = 0
    """File offset of the tensor data section: a tensor's bytes start at
    ``data_offset + tensor.offset`` (so an engine can read just the tensors it needs)."""

    @property
    def tensor_bytes(self) -> dict[str, int]:
        """Size of every tensor's data (what a range of layers costs in memory)."""
        return {name: t.nbytes for name, t in self.tensors.items()}

    def layer_bytes(self, layer: int) -> int:
        prefix = f"blk.{layer}."
        return sum(t.nbytes for name, t in self.tensors.items() if name.startswith(prefix))

    @property
    def arch(self) -> str:
        return str(self.values["general.architecture"])

    def arch_value(self, suffix: str, default: Any = None) -> Any:
        return self.values.get(f"{self.arch}.{suffix}", default)

    @property
    def n_layers(self) -> int:
        return int(self.arch_value("block_count"))

    @property
    def d_model(self) -> int:
        return int(self.arch_value("embedding_length"))


def read_metadata(path: Path) -> GgufMetadata:
    try:
        with open(path, "rb") as f:
            if f.read(4) != _MAGIC:
                raise GgufFormatError(f"{path} is not a GGUF file")
            version, tensor_count, kv_count = struct.unpack("<IQQ", _read(f, 20))
            if version < 2:
                raise GgufFormatError(f"{path}: GGUF version {version} is too old")
            values: dict[str, Any] = {}
            for _ in range(kv_count):
                key = _read_string(f)
                (vtype,) = struct.unpack("<I", _read(f, 4))
                values[key] = _read_value(f, vtype)
            tensors = {}
            for _ in range(tensor_count):
                name = _read_string(f)
                (n_dims,) = struct.unpack("<I", _read(f, 4))
                dims = struct.unpack(f"<{n_dims}Q", _read(f, 8 * n_dims))
                ggml_type, offset = struct.unpack("<IQ", _read(f, 12))
                tensors[name] = TensorInfo(ggml_type, dims, _nbytes(dims, ggml_type), offset)
            alignment = values.get("general.alignment", _DEFAULT_ALIGNMENT)
            if not isinstance(alignment, int) or alignment < 1:
                raise GgufFormatError(f"{path}: bad general.alignment {alignment!r}")
            data_offset = -(-f.tell() // alignment) * alignment
            return GgufMetadata(version, tensor_count, values, tensors, data_offset)
    except (OSError, struct.error, UnicodeDecodeError) as exc:
        raise GgufFormatError(f"cannot read GGUF metadata from {path}: {exc}") from exc


def _nbytes(dims: tuple[int, ...], ggml_type: int) -> int:
    try:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        return 0  # a type this gguf release does not know: size unknown, not fatal
    elements = 1
    for d in dims:
        elements *= d
    return elements // block * type_size


def _read_value(f: BinaryIO, vtype: int) -> Any:
    if vtype in _SCALARS:
        fmt, size = _SCALARS[vtype]
        return struct.unpack(fmt, _read(f, size))[0]
    if vtype == _STRING:
        return _read_string(f)
    if vtype == _ARRAY:
        element_type, length = struct.unpack("<IQ", _read(f, 12))
        if element_type in _SCALARS:
            f.seek(_SCALARS[element_type][1] * length, 1)
        elif element_type == _STRING:
            for _ in range(length):
                (n,) = struct.unpack("<Q", _read(f, 8))
                f.seek(n, 1)
        else:
            raise GgufFormatError(f"nested GGUF array of type {element_type} is not supported")
        return ArrayInfo(element_type, length)
    raise GgufFormatError(f"unknown GGUF value type {vtype}")


def _read_string(f: BinaryIO) -> str:
    (n,) = struct.unpack("<Q", _read(f, 8))
    return _read(f, n).decode("utf-8")


def _read(f: BinaryIO, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise GgufFormatError("unexpected end of file in the metadata section")
    return data
