"""What this machine offers: the hardware profile a peer gossips and its memory budget."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any


def _meminfo_mb(key: str) -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def total_memory_mb() -> int:
    total = _meminfo_mb("MemTotal")
    if total is not None:
        return total
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1024 * 1024)
    except (ValueError, OSError, AttributeError):
        return 0


def available_memory_mb() -> int:
    available = _meminfo_mb("MemAvailable")
    return available if available is not None else total_memory_mb() // 2


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def profile(engine: str = "llamacpp") -> dict[str, Any]:
    """The spec's hardware object (``gpu``, ``device_name``, ``vram_mb``) plus CPU facts.

    The llama.cpp engine runs on the CPU here, so ``gpu`` is "none" and ``vram_mb`` 0. The
    MLX engine on Apple Silicon computes on the GPU through Metal, in unified memory.
    """
    metal = engine == "mlx" and platform.system() == "Darwin" and platform.machine() == "arm64"
    return {
        "gpu": "metal" if metal else "none",
        "device_name": cpu_name(),
        "vram_mb": 0,
        "ram_mb": total_memory_mb(),
        "cpu_cores": os.cpu_count() or 1,
        "os": platform.system().lower(),
        "arch": platform.machine(),
    }
