"""The eval callback that reads a non-last range's output: the C one (built on first use)
and the Python one it replaces where no compiler works must give the same bits."""

from __future__ import annotations

import ctypes
import logging
import shutil

import numpy as np
import pytest

from inclavate.types import LayerRange, ModelId, SessionId
from node import eval_capture
from node.engine import BatchItem, EngineConfig
from node.llamacpp_engine import LlamaCppEngine


def _engine(smollm2, slice_cache) -> LlamaCppEngine:
    return LlamaCppEngine(model_id=ModelId("smollm2:135m"), model_path=smollm2.path, layers=LayerRange(0, 10),
                          config=EngineConfig(n_threads=1, context_length=1024, max_sessions=2, n_batch=1024),
                          slice_cache=slice_cache)  # fmt: skip


def _run(engine: LlamaCppEngine) -> list[np.ndarray]:
    """A prefill longer than one ubatch (512), then decode steps of two sessions batched."""
    rng = np.random.default_rng(7)
    a, b = SessionId("a"), SessionId("b")
    outs = [engine.forward([BatchItem(a, 0, tokens=rng.integers(1, 40000, 600).astype(np.int32))])[0].hidden]
    outs.append(engine.forward([BatchItem(b, 0, tokens=rng.integers(1, 40000, 9).astype(np.int32))])[0].hidden)
    for step in range(4):
        pair = engine.forward([BatchItem(a, 600 + step, tokens=np.array([5 + step], np.int32)),
                               BatchItem(b, 9 + step, tokens=np.array([7 + step], np.int32))])  # fmt: skip
        outs += [o.hidden for o in pair]
    return outs


def test_native_and_python_callbacks_capture_identical_hidden_states(smollm2, slice_cache, monkeypatch) -> None:
    if not any(shutil.which(cc[0]) for cc in eval_capture._compilers()):
        pytest.skip("no C compiler on this machine: peers use the Python callback")
    assert eval_capture.native_library() is not None, "a C compiler is here: the callback must build"
    with _engine(smollm2, slice_cache) as native:
        assert native._capture.native
        fast = _run(native)
    monkeypatch.setattr(eval_capture, "native_library", lambda: None)
    with _engine(smollm2, slice_cache) as python:
        assert not python._capture.native
        slow = _run(python)
    assert fast[0].shape == (600, 576)
    for x, y in zip(fast, slow, strict=True):
        assert x.dtype == np.float32 and np.array_equal(x, y)


@pytest.fixture
def fresh_build_state(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(eval_capture, "_native", None)
    monkeypatch.setattr(eval_capture, "_native_tried", False)


def test_without_a_working_compiler_the_python_callback_is_used_and_said(fresh_build_state, monkeypatch, caplog) -> None:
    monkeypatch.setattr(eval_capture, "_compilers", lambda: [["false"], ["/nonexistent/cc"]])
    with caplog.at_level(logging.WARNING, logger="node.llamacpp"):
        assert eval_capture.native_library() is None
        assert eval_capture.native_library() is None  # tried once per process
    assert len([r for r in caplog.records if "eval callback in Python" in r.message]) == 1
    assert not list((eval_capture.cache_dir()).glob("*.so"))


def test_the_native_callback_can_be_turned_off(fresh_build_state, monkeypatch) -> None:
    monkeypatch.setenv(eval_capture.NATIVE_ENV, "0")
    assert eval_capture.native_library() is None


def test_a_build_is_cached_per_source(fresh_build_state) -> None:
    first = eval_capture._build()
    stamp = first.stat().st_mtime_ns
    assert eval_capture._build() == first and first.stat().st_mtime_ns == stamp


class _FakeTensor(ctypes.Structure):
    """The leading fields of ``struct ggml_tensor`` the C callback reads."""

    _fields_ = [("type", ctypes.c_int32), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4)]


_GET_NAME = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)  # a const char *, kept alive by the test
_TENSOR_GET = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t)
_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p, ctypes.c_bool, ctypes.c_void_p)


def test_the_c_callback_never_writes_past_its_buffer_nor_takes_a_wrong_tensor() -> None:
    """Driven directly, with ggml's accessors stood in: a tensor with more rows than the
    buffer holds, or of another type or width, is refused (the engine turns the error into a
    failed batch) and not a byte lands outside the buffer."""
    library = eval_capture.native_library()
    if library is None:
        pytest.skip("the C callback did not build here")
    width, capacity = 4, 3
    buffer = np.full((capacity + 1, width), -1.0, dtype=np.float32)  # one guard row past the end
    names = {}
    get_name = _GET_NAME(lambda tensor: names[tensor])
    tensor_get = _TENSOR_GET(lambda tensor, dest, offset, size: ctypes.memset(dest, 0x3F, size))
    state = eval_capture.CaptureState(
        get_name=ctypes.cast(get_name, ctypes.c_void_p).value, tensor_get=ctypes.cast(tensor_get, ctypes.c_void_p).value,
        dest=buffer.ctypes.data, capacity_rows=capacity, width=width, name=b"l_out-9",
    )  # fmt: skip
    callback = _CALLBACK(ctypes.cast(library.inclavate_eval_capture, ctypes.c_void_p).value)
    user = ctypes.addressof(state)

    def tensor(name: bytes, rows: int, type_: int = 0, cols: int = width) -> int:
        t = _FakeTensor(type=type_, ne=(ctypes.c_int64 * 4)(cols, rows, 1, 1))
        address = ctypes.addressof(t)
        text = ctypes.create_string_buffer(name)
        names[address] = ctypes.addressof(text)
        keep.extend((t, text))
        return address

    keep: list[object] = []
    other = tensor(b"attn_norm-3", 2)
    assert callback(other, True, user) is False and callback(other, False, user) is True
    good = tensor(b"l_out-9", 2)
    assert callback(good, True, user) is True
    assert callback(good, False, user) is False and (state.rows, state.error) == (2, 0)  # copied, graph aborted
    assert callback(tensor(b"l_out-9", 2), False, user) is False and state.error == 2  # 2 + 2 > 3 rows
    assert state.rows == 2
    state.error = 0
    assert callback(tensor(b"l_out-9", 1, type_=1), False, user) is False and state.error == 1  # f16, not f32
    state.error = 0
    assert callback(tensor(b"l_out-9", 1, cols=width + 1), False, user) is False and state.error == 1
    assert (buffer[2:] == -1.0).all(), "nothing was written past the rows taken"


def _half_of(library: ctypes.CDLL, x: np.ndarray) -> tuple[int, np.ndarray]:
    out = np.zeros(len(x), dtype=np.uint16)
    ok = library.inclavate_to_half(ctypes.c_void_p(x.ctypes.data), ctypes.c_void_p(out.ctypes.data), ctypes.c_int64(len(x)))
    return ok, out


def test_the_c_conversion_to_float16_gives_numpys_bits_and_refuses_what_does_not_fit() -> None:
    """The callback converts the rows it copies to float16 for the wire; a peer's next hop
    must get the very bits numpy's ``astype`` gave before. Random values at every scale,
    float16's subnormals, its rounding ties and its limits (every float32 up to 65,504 was
    checked once with ``scripts/check_half_conversion.py``, ~4 minutes)."""
    library = eval_capture.native_library()
    if library is None:
        pytest.skip("the C callback did not build here")
    rng = np.random.default_rng(11)
    top = 0x477FE000  # 65504.0f
    bits = np.concatenate([rng.integers(0, top + 1, 2_000_000, dtype=np.uint32),
                           np.arange(0x33000000 - 64, 0x38800000, 4099, dtype=np.uint32),  # around the subnormals
                           (np.arange(0, 1 << 16, dtype=np.uint32) << 13) + 0x1000,  # every tie of a float16 step
                           np.array([0, 1, 0x007FFFFF, 0x33000000, 0x38000000, top], dtype=np.uint32)])  # fmt: skip
    bits = bits[bits <= top]
    for sign in (0, 0x80000000):
        x = (bits | np.uint32(sign)).view(np.float32)
        ok, out = _half_of(library, x)
        assert ok == 1
        assert np.array_equal(out, x.astype(np.float16).view(np.uint16))
    for beyond in (65505.0, -65505.0, 1e30, np.inf, -np.inf, np.nan):
        ok, _ = _half_of(library, np.array([1.0, beyond, 2.0], dtype=np.float32))
        assert ok == 0, beyond


def test_a_lone_steps_output_comes_with_its_float16_bits(smollm2, slice_cache) -> None:
    """The engine's lone decode step hands over the callback's float16 conversion, and the
    wire encoding built from it is the one numpy builds from the float32 rows."""
    if eval_capture.native_library() is None:
        pytest.skip("the C callback did not build here")
    from inclavate import tensors

    with _engine(smollm2, slice_cache) as engine:
        s = SessionId("s")
        engine.forward([BatchItem(s, 0, tokens=np.array([1, 2, 3], np.int32))])
        (out,) = engine.forward([BatchItem(s, 3, tokens=np.array([4], np.int32))])
    assert out.hidden is not None and out.half is not None
    assert out.half == out.hidden.astype(np.float16).tobytes()
    assert tensors.encode(out.hidden, "f16", half=out.half) == tensors.encode(out.hidden, "f16")


def test_the_native_float16_decode_gives_numpys_floats_and_refuses_what_is_not_finite() -> None:
    """A received float16 frame decodes to numpy's float32 values (every finite float16), and
    one holding an infinity or a NaN, or of another size than its shape, is left to numpy and
    the hop's checks (None)."""
    if eval_capture.native_library() is None:
        pytest.skip("the C callback did not build here")
    halves = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    finite = halves[(halves & 0x7C00) != 0x7C00]
    out = eval_capture.half_to_float32(finite.tobytes(), (len(finite),))
    assert out is not None
    assert np.array_equal(out.view(np.uint32), finite.view(np.float16).astype(np.float32).view(np.uint32))
    for bad in (0x7C00, 0xFC00, 0x7E00, 0x7C01):
        assert eval_capture.half_to_float32(np.array([0, bad], np.uint16).tobytes(), (1, 2)) is None
    assert eval_capture.half_to_float32(b"\0" * 6, (1, 2)) is None
    assert eval_capture.half_to_float32(b"\0" * 4, (-1, -2)) is None


def test_a_hop_decodes_a_float16_frame_as_before_and_rejects_it_as_before() -> None:
    """The hop's decode with the native pass takes and refuses what it took and refused."""
    from inclavate import tensors
    from inclavate.types import LayerRange, ModelId
    from node.engine import EngineInfo
    from p2p.forward_checks import FrameReason, FrameRejected, decoded_hidden

    info = EngineInfo(ModelId("m"), LayerRange(10, 20), 30, 4, 100, "llama")
    x = np.array([[1.5, -2.0, 6e-8, 65504.0]], dtype=np.float32)
    assert np.array_equal(decoded_hidden(tensors.encode(x, "f16"), info), x.astype(np.float16).astype(np.float32))
    for bad, reason in ((np.array([[1.0, np.inf, 0.0, 0.0]], np.float32), FrameReason.NOT_FINITE),
                        (np.array([[1.0, 2.0, 3.0]], np.float32), FrameReason.WRONG_INPUT)):  # fmt: skip
        encoded = tensors.EncodedTensor("f16", bad.shape, bad.astype(np.float16).tobytes())
        with pytest.raises(FrameRejected) as caught:
            decoded_hidden(encoded, info)
        assert caught.value.reason == reason
