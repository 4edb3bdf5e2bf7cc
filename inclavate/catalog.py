"""Which models exist: the shipped catalog plus the user's local overlay.

Every peer must agree on what ``smollm2:135m`` means (layer count for placement, hidden
size for the wire, hash for the weights), so the names come from a catalog shipped with
the package. A user adds or overrides entries in ``$INCLAVATE_HOME/config/models.toml``;
those win over shipped entries of the same id and are reported as ``source = "local"``.
Both files share one strict format (see ``catalog.toml``): unknown keys and wrong types
are errors naming the file and the entry, because a typo such as ``n_layer`` silently
falling back to a default would misplace layers across a whole swarm.
"""

from __future__ import annotations

import importlib.resources
import os
import re
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from inclavate.download import FileSource, InvalidSource, parse_source
from inclavate.durable import replace_durably
from inclavate.errors import ConfigError, ModelNotFound
from inclavate.types import ModelId

SHIPPED_CATALOG = "catalog.toml"

_MODEL_ID = re.compile(r"[a-z0-9][a-z0-9._-]*(?::[a-z0-9][a-z0-9._-]*)?")
_MAX_ID_LENGTH = 100
_SHA256 = re.compile(r"[0-9a-f]{64}")

_REQUIRED = ("arch", "n_layers", "d_model", "quant_type", "gguf_sha256", "sources")
_OPTIONAL = ("size_bytes", "input_modalities")


def validate_model_id(text: str) -> ModelId:
    """Check ``text`` is ``name`` or ``name:tag`` in lowercase letters, digits, ``._-``.

    The id becomes a directory name in the store, so the alphabet is kept safe on every
    filesystem, and lowercase only because macOS volumes are case-insensitive: ``A:b`` and
    ``a:b`` would share a directory there.
    """
    if len(text) > _MAX_ID_LENGTH or not _MODEL_ID.fullmatch(text):
        raise ConfigError(
            f"invalid model id {text!r}: use lowercase name or name:tag "
            f"(letters, digits, '.', '_', '-'; e.g. smollm2:135m)"
        )
    return ModelId(text)


def overlay_path(home: Path) -> Path:
    """The user's catalog overlay, ``$INCLAVATE_HOME/config/models.toml``."""
    return home / "config" / "models.toml"


@dataclass(frozen=True)
class ModelSpec:
    """One catalog entry: what a model is and where its GGUF comes from."""

    model_id: ModelId
    arch: str
    n_layers: int
    d_model: int
    quant_type: str
    gguf_sha256: str
    """Lowercase hex, or "" when unknown (see catalog.toml for what the store does then)."""
    sources: tuple[str, ...]
    source: Literal["catalog", "local"] = "catalog"
    size_bytes: int | None = None
    input_modalities: tuple[str, ...] = ("text",)
    local_path: Path | None = None
    """The user's own file for entries registered with ``pull FILE --as NAME``."""


class Catalog:
    """The merged, read-only view of shipped and overlay entries, in catalog order."""

    def __init__(self, specs: Iterable[ModelSpec]) -> None:
        self._specs: dict[str, ModelSpec] = {spec.model_id: spec for spec in specs}

    @classmethod
    def load(cls, home: Path) -> Catalog:
        """Read the shipped catalog and, if present, the overlay under ``home``."""
        shipped = importlib.resources.files("inclavate").joinpath(SHIPPED_CATALOG).read_text("utf-8")
        merged = {spec.model_id: spec for spec in parse_catalog(shipped, f"inclavate/{SHIPPED_CATALOG}", "catalog")}
        # Overridden entries keep their catalog position (dict assignment does not move
        # a key); entries only the overlay has come after the shipped ones.
        merged.update((spec.model_id, spec) for spec in load_overlay(home))
        return cls(merged.values())

    def get(self, model_id: str) -> ModelSpec:
        try:
            return self._specs[model_id]
        except KeyError:
            raise ModelNotFound(model_id, list(self._specs)) from None

    def all(self) -> list[ModelSpec]:
        return list(self._specs.values())

    def __contains__(self, model_id: object) -> bool:
        return model_id in self._specs


def load_overlay(home: Path) -> list[ModelSpec]:
    """The overlay's entries, or none when the file does not exist."""
    path = overlay_path(home)
    try:
        text = path.read_text("utf-8")
    except FileNotFoundError:
        return []
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from exc
    return parse_catalog(text, str(path), "local")


def parse_catalog(text: str, origin: str, source: Literal["catalog", "local"]) -> list[ModelSpec]:
    """Parse catalog-format TOML; ``origin`` names the file in every error message."""
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{origin}: invalid TOML: {exc}") from exc
    extra = set(document) - {"models"}
    if extra:
        raise ConfigError(f"{origin}: unknown top-level keys {sorted(extra)} (entries go under [models.\"ID\"])")
    models = document.get("models", {})
    if not isinstance(models, dict):
        raise ConfigError(f"{origin}: 'models' must be a table of [models.\"ID\"] entries")
    specs = []
    for model_id, entry in models.items():
        try:
            specs.append(_parse_entry(model_id, entry, source))
        except ConfigError as exc:
            raise ConfigError(f"{origin}: model {model_id!r}: {exc}") from exc
    return specs


def _parse_entry(model_id: str, entry: Any, source: Literal["catalog", "local"]) -> ModelSpec:
    if not isinstance(entry, dict):
        raise ConfigError("entry must be a table")
    missing = [key for key in _REQUIRED if key not in entry]
    unknown = sorted(set(entry) - set(_REQUIRED) - set(_OPTIONAL))
    if missing or unknown:
        raise ConfigError(f"missing keys {missing}" if missing else f"unknown keys {unknown}")
    sha = _typed(entry, "gguf_sha256", str)
    if sha and not _SHA256.fullmatch(sha):
        raise ConfigError("gguf_sha256 must be 64 lowercase hex digits, or \"\" when unknown")
    sources = _string_list(entry, "sources")
    if not sources:
        raise ConfigError("sources must list at least one source")
    try:
        parsed = [parse_source(text) for text in sources]
    except InvalidSource as exc:
        raise ConfigError(str(exc)) from exc
    size = entry.get("size_bytes")
    if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size <= 0):
        raise ConfigError(f"size_bytes must be a positive integer, got {size!r}")
    local_files = [s.path for s in parsed if isinstance(s, FileSource)]
    return ModelSpec(
        model_id=validate_model_id(model_id),
        arch=_typed(entry, "arch", str),
        n_layers=_positive(entry, "n_layers"),
        d_model=_positive(entry, "d_model"),
        quant_type=_typed(entry, "quant_type", str),
        gguf_sha256=sha,
        sources=tuple(sources),
        source=source,
        size_bytes=size,
        input_modalities=tuple(_string_list(entry, "input_modalities", default=["text"])),
        local_path=local_files[0] if source == "local" and local_files else None,
    )


def _typed(entry: Mapping[str, Any], key: str, kind: type) -> Any:
    value = entry[key]
    if not isinstance(value, kind):
        raise ConfigError(f"{key} must be a {kind.__name__}, got {value!r}")
    return value


def _positive(entry: Mapping[str, Any], key: str) -> int:
    value = entry[key]
    # bool is an int subclass: `n_layers = true` must not read as 1.
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{key} must be a positive integer, got {value!r}")
    return value


def _string_list(entry: Mapping[str, Any], key: str, default: list[str] | None = None) -> list[str]:
    value = entry.get(key, default)
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise ConfigError(f"{key} must be a list of strings, got {value!r}")
    return value


def save_overlay_entry(home: Path, spec: ModelSpec) -> Path:
    """Add or replace ``spec`` in the overlay, keeping the other entries; returns its path.

    The existing overlay is parsed first, so a malformed one stops us (ConfigError) instead
    of being overwritten. The file is rewritten from parsed entries: hand-written comments
    do not survive, which its header says. Written to a temporary file and renamed, so a
    crash never leaves half an overlay that would break every later command.
    """
    path = overlay_path(home)
    entries = {s.model_id: s for s in load_overlay(home)}
    entries[spec.model_id] = spec
    lines = [
        "# Local models for Inclavate: entries here override the shipped catalog.",
        "# Rewritten by `inclavate pull FILE --as NAME`; comments are not preserved.",
    ]
    for entry in entries.values():
        lines += ["", f"[models.{_toml_string(entry.model_id)}]"]
        lines += [f"{key} = {_toml_value(value)}" for key, value in _entry_fields(entry).items()]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text("\n".join(lines) + "\n", "utf-8")
    replace_durably(tmp, path)
    return path


def _entry_fields(spec: ModelSpec) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "arch": spec.arch,
        "n_layers": spec.n_layers,
        "d_model": spec.d_model,
        "quant_type": spec.quant_type,
        "gguf_sha256": spec.gguf_sha256,
        "sources": list(spec.sources),
        "input_modalities": list(spec.input_modalities),
    }
    if spec.size_bytes is not None:
        fields["size_bytes"] = spec.size_bytes
    return fields


def _toml_value(value: str | int | list[str]) -> str:
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_string(item) for item in value) + "]"
    return str(value)


def _toml_string(text: str) -> str:
    """A TOML basic string: escape what TOML forbids raw (quote, backslash, controls, DEL)."""
    escaped = []
    for char in text:
        if char in '"\\':
            escaped.append("\\" + char)
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            escaped.append(f"\\u{ord(char):04x}")
        else:
            escaped.append(char)
    return '"' + "".join(escaped) + '"'
