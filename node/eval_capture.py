"""Reading a range's output out of llama.cpp's graph: the eval callback, native or Python.

A range that is not the last needs the residual stream after its last block (tensor
``l_out-<n-1>``), which llama.cpp only shows to the context's eval callback; after copying
it the callback aborts the graph (the output norm and vocabulary projection would cost ~30%
of the step). ggml asks the callback about every node first, 334 questions per decode step
of 10 blocks: ~0.7 ms in Python, on every non-last hop of every token. The C version
(``node/native/eval_capture.c``) answers them in microseconds. It is compiled on first use
with the machine's C compiler (the one that built llama.cpp) into the user cache, keyed by
its source; where that fails, or with ``INCLAVATE_NATIVE_CAPTURE=0``, the Python callback
does the same work, slower, and the peer says so once.

The same library converts hidden states to and from float16, the wire's default form: the
callback converts the rows it copies (:meth:`EvalCapture.take`) and
:func:`half_to_float32` decodes a received frame and checks it is finite in one pass. Both
run on caches a hop's engine call left cold, where the numpy calls they replace cost
~0.08-0.1 ms a hop each way; both give numpy's bits (``tests/test_eval_capture.py``,
``scripts/check_half_conversion.py``), and where the library did not build numpy does it.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import math
import os
import platform
import shlex
import subprocess
import sysconfig
import tempfile
import threading
from pathlib import Path

import llama_cpp
import numpy as np

from node import llamacpp_lib

log = logging.getLogger("node.llamacpp")

NATIVE_ENV = "INCLAVATE_NATIVE_CAPTURE"
_SOURCE = Path(__file__).with_name("native") / "eval_capture.c"
_lock = threading.Lock()
_native: ctypes.CDLL | None = None
_native_tried = False


class CaptureState(ctypes.Structure):
    """``struct capture`` of eval_capture.c."""

    _fields_ = [
        ("get_name", ctypes.c_void_p),
        ("tensor_get", ctypes.c_void_p),
        ("dest", ctypes.c_void_p),
        ("half_dest", ctypes.c_void_p),
        ("capacity_rows", ctypes.c_int64),
        ("width", ctypes.c_int64),
        ("rows", ctypes.c_int64),
        ("bad_width", ctypes.c_int64),
        ("bad_type", ctypes.c_int32),
        ("error", ctypes.c_int32),
        ("half_ok", ctypes.c_int32),
        ("name", ctypes.c_char * 64),
    ]


class CaptureError(Exception):
    """The captured tensor was not what the range expects (type, width or row count)."""


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "inclavate" / "native"


def native_library() -> ctypes.CDLL | None:
    """The compiled callback (built once per source and machine), or None where it cannot be."""
    global _native, _native_tried
    with _lock:
        if not _native_tried:
            _native_tried = True
            if os.environ.get(NATIVE_ENV, "1") not in ("0", ""):
                try:
                    _native = _typed(ctypes.CDLL(str(_build())))
                except OSError as exc:
                    log.warning("eval callback in Python (~0.7 ms more per hop): the C one did not build: %s", exc)
        return _native


def _typed(library: ctypes.CDLL) -> ctypes.CDLL:
    """``library`` with its conversions' argument types declared: ctypes then converts the
    arguments itself, without a guess per call."""
    for name in ("inclavate_to_half", "inclavate_from_half"):
        function = getattr(library, name)
        function.argtypes = [ctypes.c_void_p if name == "inclavate_to_half" else ctypes.c_char_p, ctypes.c_void_p, ctypes.c_int64]
        function.restype = ctypes.c_int
    return library


def half_to_float32(data: bytes, shape: tuple[int, ...]) -> np.ndarray | None:
    """float16 bytes as a float32 array of ``shape``, or None where the native library did
    not build, the size does not match, or a value is infinite or NaN (numpy then decodes,
    and the caller's check names what is wrong)."""
    library = _native if _native_tried else native_library()
    count = math.prod(shape)  # Python ints, before any allocation: the shape came off the network
    if library is None or min(shape, default=0) < 0 or 2 * count != len(data):
        return None
    out = np.empty(shape, dtype=np.float32)
    # The address from the array interface (a C getter), not ``out.ctypes.data``: that one
    # builds a helper object in two Python calls, on caches a hop's engine call left cold.
    if not library.inclavate_from_half(data, out.__array_interface__["data"][0], count):
        return None
    return out


def _build() -> Path:
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(source + platform.machine().encode() + platform.python_compiler().encode()).hexdigest()[:16]
    target = cache_dir() / f"eval_capture-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    failures = []
    for compiler in _compilers():
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            try:
                done = subprocess.run([*compiler, "-O2", "-shared", "-fPIC", "-o", str(built), str(_SOURCE)],
                                      capture_output=True, text=True, timeout=120)  # fmt: skip
            except (OSError, subprocess.SubprocessError) as exc:
                failures.append(f"{compiler[0]}: {exc}")
                continue
            if done.returncode == 0:
                os.replace(built, target)  # atomic: a peer building at the same time writes the same bytes
                return target
            failures.append(f"{' '.join(compiler)} exited with {done.returncode}: {done.stderr.strip()[:300]}")
    raise OSError("; ".join(failures) or "no C compiler")


def _compilers() -> list[list[str]]:
    """$CC, then the compiler Python was built with, then ``cc``: the first that works."""
    found: list[list[str]] = []
    for command in (os.environ.get("CC"), sysconfig.get_config_var("CC"), "cc"):
        if command and shlex.split(command) not in found:
            found.append(shlex.split(command))
    return found


class EvalCapture:
    """One engine's capture of ``l_out-<n-1>``: the callback to give llama.cpp, and the rows
    it copied during the last ``llama_decode`` (:meth:`take`; emptied by it or :meth:`reset`)."""

    def __init__(self, tensor_name: str, width: int, max_rows: int) -> None:
        self.tensor_name = tensor_name
        self.width = width
        self._rows: list[np.ndarray] = []
        library = native_library()
        self.native = library is not None
        if library is not None:
            self._buffer = np.empty((max_rows, width), dtype=np.float32)
            self._half = np.empty((max_rows, width), dtype=np.float16)
            lib = llamacpp_lib.ggml()
            self._state = CaptureState(
                get_name=ctypes.cast(lib.ggml_get_name, ctypes.c_void_p).value,
                tensor_get=ctypes.cast(lib.ggml_backend_tensor_get, ctypes.c_void_p).value,
                dest=self._buffer.ctypes.data, half_dest=self._half.ctypes.data, capacity_rows=max_rows, width=width,
                half_ok=1, name=tensor_name.encode(),
            )  # fmt: skip
            address = ctypes.cast(library.inclavate_eval_capture, ctypes.c_void_p).value
            self.callback = llama_cpp.ggml_backend_sched_eval_callback(address)
            self.user_data: int | None = ctypes.addressof(self._state)
        else:
            self._name = tensor_name.encode()
            # Keep a reference: ctypes frees the trampoline when the Python object dies.
            self.callback = llama_cpp.ggml_backend_sched_eval_callback(self._on_eval)
            self.user_data = None

    def reset(self) -> None:
        if self.native:
            self._state.rows = 0
            self._state.error = 0
            self._state.half_ok = 1
        else:
            self._rows = []

    def take(self, rows: int) -> tuple[np.ndarray, bytes | None]:
        """The ``rows`` rows the callback copied during the last decode, shape (rows, width),
        and the same rows as float16 bytes, bit for bit what numpy's ``astype(np.float16)``
        makes of them (None where the native callback did not convert them: not native, or a
        value NaN, infinite or beyond 65,504, so numpy decides). Raises CaptureError when the
        callback saw another tensor than expected or another row count.

        Leaves the capture empty for the next decode, whatever it raises: with the engine's
        ``_restore`` (which empties it after a failed call) that is what lets a lone step
        skip a ``reset`` before its call. One call where the engine made four (reset, rows,
        float16 bytes, its shape check): a hop pays them on caches its engine call left cold.
        """
        if not self.native:
            parts, self._rows = self._rows, []
            if not parts:
                parts = [np.empty((0, self.width), dtype=np.float32)]
            captured = parts[0] if len(parts) == 1 else np.concatenate(parts)
            if len(captured) != rows:
                raise CaptureError(f"captured {captured.shape} from {self.tensor_name}, expected ({rows}, {self.width})")
            return captured, None
        state = self._state
        got, error, half_ok = state.rows, state.error, state.half_ok
        state.rows, state.error, state.half_ok = 0, 0, 1
        if error == 1:
            raise CaptureError(f"unexpected {self.tensor_name}: type {state.bad_type} width {state.bad_width}")
        if error == 2:
            raise CaptureError(f"{self.tensor_name} had more rows than the batch ({len(self._buffer)})")
        if got != rows:
            raise CaptureError(f"captured ({got}, {self.width}) from {self.tensor_name}, expected ({rows}, {self.width})")
        return self._buffer[:rows].copy(), self._half[:rows].tobytes() if half_ok else None

    def _on_eval(self, tensor: int, ask: bool, _user_data: int) -> bool:
        """ggml's scheduler callback: ask=True "do you want this node?", then the node itself.

        Returning False after the copy aborts the rest of this ubatch's graph; llama_decode
        still returns 0 (and goes on to the next ubatch), and the KV cache of every block in
        this range has been written.
        """
        lib = llamacpp_lib.ggml()
        if ask:
            return lib.ggml_get_name(tensor) == self._name
        if lib.ggml_get_name(tensor) != self._name:
            return True
        header = llamacpp_lib.TensorHeader.from_address(tensor)
        rows, width = int(header.ne[1]), int(header.ne[0])
        if header.type != llamacpp_lib.GGML_TYPE_F32 or width != self.width:
            log.error("unexpected %s: type %d width %d", self.tensor_name, header.type, width)
            return False
        out = np.empty((rows, width), dtype=np.float32)
        lib.ggml_backend_tensor_get(tensor, out.ctypes.data, 0, out.nbytes)
        self._rows.append(out)
        return False
