"""The few native entry points the llama.cpp engine needs beyond llama-cpp-python's bindings.

llama-cpp-python binds ``libllama`` but not the ggml tensor accessors that an eval callback
needs to read a tensor out of the graph; those live in ``libggml-base`` beside it. This module
also owns process-wide setup (backend init, routing llama.cpp's logging into ``logging``),
done once however many engines a process opens.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from pathlib import Path

import llama_cpp

log = logging.getLogger("node.llamacpp")

GGML_TYPE_F32 = 0
_LOG_WARN, _LOG_ERROR = 3, 4  # ggml_log_level: NONE, DEBUG, INFO, WARN, ERROR, CONT

_init_lock = threading.Lock()
_initialised = False
_ggml: ctypes.CDLL | None = None


@llama_cpp.llama_log_callback
def _log_callback(level: int, text: bytes, _user_data: ctypes.c_void_p) -> None:
    # llama.cpp narrates every load in detail; keep it at DEBUG except warnings and errors.
    message = text.decode("utf-8", "replace").rstrip()
    if not message:
        return
    if level == _LOG_ERROR:
        log.error(message)
    elif level == _LOG_WARN:
        log.warning(message)
    else:
        log.debug(message)


def ensure_initialised() -> None:
    global _initialised
    with _init_lock:
        if _initialised:
            return
        llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
        _initialised = True


def ggml() -> ctypes.CDLL:
    """``libggml-base`` with the tensor accessors declared."""
    global _ggml
    with _init_lock:
        if _ggml is None:
            lib_dir = Path(llama_cpp.__file__).parent / "lib"
            lib = ctypes.CDLL(str(lib_dir / "libggml-base.so"))
            lib.ggml_get_name.argtypes = [ctypes.c_void_p]
            lib.ggml_get_name.restype = ctypes.c_char_p
            lib.ggml_nbytes.argtypes = [ctypes.c_void_p]
            lib.ggml_nbytes.restype = ctypes.c_size_t
            lib.ggml_backend_tensor_get.argtypes = [
                ctypes.c_void_p,
                ctypes.c_void_p,
                ctypes.c_size_t,
                ctypes.c_size_t,
            ]
            lib.ggml_backend_tensor_get.restype = None
            _ggml = lib
        return _ggml


class TensorHeader(ctypes.Structure):
    """The leading fields of ``struct ggml_tensor`` (stable across ggml releases):
    enough to check a captured tensor's type and shape before copying it."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * 4),
        ("nb", ctypes.c_size_t * 4),
    ]
