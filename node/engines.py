"""Which engine a peer runs its range on, and building it.

``auto`` means MLX on Apple Silicon macOS (where llama.cpp's CPU build would leave the GPU
idle and MLX is a dependency) and llama.cpp everywhere else. Both read the same GGUF and
speak the same hidden states, so routing does not care which one a peer picked; the kind
is still gossiped (node record, ``/nodes/:id/hardware``) so an operator can see it.
"""

from __future__ import annotations

import importlib.util
import platform
import sys
from pathlib import Path
from typing import Literal

from inclavate.errors import ConfigError
from inclavate.types import LayerRange, ModelId
from node.engine import EngineConfig, LayerEngine

EngineChoice = Literal["auto", "llamacpp", "mlx"]
EngineKind = Literal["llamacpp", "mlx"]
ENGINE_CHOICES: tuple[EngineChoice, ...] = ("auto", "llamacpp", "mlx")
ENGINE_KINDS: tuple[EngineKind, ...] = ("llamacpp", "mlx")


def is_apple_silicon() -> bool:
    return sys.platform == "darwin" and platform.machine() == "arm64"


def mlx_available() -> bool:
    return importlib.util.find_spec("mlx") is not None and importlib.util.find_spec("mlx.core") is not None


def resolve_engine(choice: str) -> EngineKind:
    """The engine ``choice`` means on this machine; a clear error if it cannot run here."""
    if choice == "auto":
        return "mlx" if is_apple_silicon() and mlx_available() else "llamacpp"
    if choice == "llamacpp":
        return "llamacpp"
    if choice == "mlx":
        if not mlx_available():
            hint = "pip install mlx" if is_apple_silicon() else "pip install 'inclavate[mlx]' (mlx's CPU build)"
            raise ConfigError(f"--engine mlx needs the mlx package, which is not installed: {hint}")
        return "mlx"
    raise ConfigError(f"unknown engine {choice!r}; choose one of {', '.join(ENGINE_CHOICES)}")


def load_engine(
    kind: EngineKind,
    *,
    model_id: ModelId,
    model_path: Path,
    layers: LayerRange,
    config: EngineConfig,
    model_sha256: str = "",
    slice_cache: Path | None = None,
) -> LayerEngine:
    """Build an engine of ``kind`` for ``layers``; imports only the engine it needs."""
    if kind == "mlx":
        from node.mlx_engine import MlxEngine

        engine_cls: type[LayerEngine] = MlxEngine
    else:
        from node.llamacpp_engine import LlamaCppEngine

        engine_cls = LlamaCppEngine
    return engine_cls(  # type: ignore[call-arg]
        model_id=model_id, model_path=model_path, layers=layers, config=config,
        model_sha256=model_sha256, slice_cache=slice_cache,
    )  # fmt: skip
