"""A layer range on llama.cpp, through llama-cpp-python's low-level C API, unpatched.

How a range runs (measured in shared/NOTES.md):

* the model file is a GGUF *slice* holding only this range's blocks (``node.gguf_slice``);
* the first range takes token ids; later ranges take hidden states through ``batch.embd``;
* a range that is not the last reads the residual stream after its last block through the
  context's eval callback (tensor ``l_out-<n-1>``) and then *aborts* the rest of the graph:
  the output norm and vocabulary projection would otherwise cost ~30% of the step;
* the last range reads ordinary logits.

Every token of a non-last batch is marked as an output, or llama.cpp drops the rows of
non-output tokens in the last block. Each session owns one sequence id and its own KV
stream, which is what lets sessions share a decode call without touching each other's
arithmetic (see ``_new_context``).
"""

from __future__ import annotations

import ctypes
import heapq
import logging
import threading
from dataclasses import dataclass
from pathlib import Path

import llama_cpp
import numpy as np

from inclavate.gguf_meta import read_metadata
from inclavate.types import LayerRange, ModelId, SessionId
from node import llamacpp_lib, teams_spin_alike
from node.arch import rules_for
from node.eval_capture import CaptureError, EvalCapture
from node.engine import (
    BatchItem,
    EngineConfig,
    EngineInfo,
    LayerEngine,
    MemoryReport,
    StageOutput,
    check_batch,
)
from node.errors import ContextFull, DecodeFailed, EngineLoadError
from node.gguf_slice import cached_slice

log = logging.getLogger(__name__)

_MAX_LOGIT_VIEWS = 64
"""Cached views of llama.cpp's logits buffer (one per address and row count in use)."""
SPLIT_KV_FROM = 256
"""Positions from which a one-token ubatch runs on one thread with ``exact_steps`` (see
``_set_threads``)."""


@dataclass
class _Slot:
    seq_id: int
    length: int = 0


@dataclass(frozen=True)
class _Segment:
    """Tokens ``[offset, offset + count)`` of item ``index`` placed in one decode call."""

    index: int
    offset: int
    count: int


class LlamaCppEngine(LayerEngine):
    def __init__(
        self,
        *,
        model_id: ModelId,
        model_path: Path,
        layers: LayerRange,
        config: EngineConfig = EngineConfig(),
        model_sha256: str = "",
        slice_cache: Path | None = None,
    ) -> None:
        llamacpp_lib.ensure_initialised()
        self.config = config
        self._n_threads, self._threads_shared, self._exact_steps = config.n_threads, config.threads_shared, config.exact_steps
        """``config``'s thread counts, read once: a lone step asks for them on every call."""
        self._step_threads = config.step_threads or config.n_threads
        self._lock = threading.Lock()
        meta = read_metadata(model_path)
        arch, n_layers = meta.arch, meta.n_layers
        whole = layers.start == 0 and layers.end == n_layers
        self._rules = rules_for(arch, n_layers, whole_model=whole)
        path = cached_slice(
            model_path, model_sha256, layers, slice_cache or model_path.parent / "slices"
        )
        self._model = self._load_model(path)
        self._ctx = None
        self._batch = None
        try:
            d_model = int(llama_cpp.llama_model_n_embd(self._model))
            self._vocab = llama_cpp.llama_model_get_vocab(self._model)
            self.info = EngineInfo(
                model_id=model_id,
                layers=layers,
                n_layers=n_layers,
                d_model=d_model,
                n_vocab=int(llama_cpp.llama_vocab_n_tokens(self._vocab)),
                arch=arch,
            )
            self._slice_layers = len(layers)
            self._input_scale = (
                1.0
                if self.info.is_first or self._rules.embd_input_scale is None
                else self._rules.embd_input_scale(_HParams(arch, self._model))
            )
            self._capture = EvalCapture(f"l_out-{self._slice_layers - 1}", d_model, config.n_batch)
            self._ctx = self._new_context()
            self._threads = (config.threads_shared, config.threads_shared)
            self._memory = llama_cpp.llama_get_memory(self._ctx)
            embd = 0 if self.info.is_first else d_model
            self._batch = llama_cpp.llama_batch_init(config.n_batch, embd, 1)
            self._batch_views()
        except BaseException:
            self.close()
            raise
        self._slots: dict[SessionId, _Slot] = {}
        self._logit_views: dict[tuple[int, int], np.ndarray] = {}
        # Lowest ids first: batched sessions then tend to have consecutive ids, which
        # llama.cpp runs in one ubatch (non-consecutive ones get a ubatch each).
        self._free_seq_ids = list(range(config.max_sessions))
        self._weights_bytes = int(llama_cpp.llama_model_size(self._model))
        self._kv_bytes = self._kv_cache_bytes()
        log.info(
            "loaded %s layers %s of %d (%s, d_model %d) from %s",
            model_id, layers, n_layers, arch, d_model, path.name,
        )

    @property
    def callable_from_any_thread(self) -> bool:
        """At several threads, only where the thread-wait policy makes a second OpenMP team
        (the caller's own) cost nothing: see ``node.teams_spin_alike``."""
        return self.config.n_threads == 1 or teams_spin_alike()

    # ----------------------------------------------------------------- set-up

    def _load_model(self, path: Path) -> llama_cpp.llama_model_p:
        params = llama_cpp.llama_model_default_params()
        params.n_gpu_layers = 0
        params.load_mode = llama_cpp.LLAMA_LOAD_MODE_MMAP  # pages of unused tensors stay on disk
        # Repacked "extra" weight buffers (AMX on recent Xeons) crash in
        # ggml_backend_amx_mul_mat in the llama.cpp pinned here; plain CPU buffers are exact.
        params.use_extra_bufts = False
        model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        if not model:
            raise EngineLoadError(f"llama.cpp could not load {path} (see the log for its reason)")
        return model

    def _new_context(self) -> llama_cpp.llama_context_p:
        cfg = self.config
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = cfg.context_length * cfg.max_sessions
        params.n_batch = cfg.n_batch
        params.n_ubatch = cfg.n_batch  # one graph per decode call, so one capture per call
        params.n_seq_max = cfg.max_sessions
        params.n_outputs_max_per_seq = 0  # default 1 would keep one row per session, we need all
        params.n_threads = cfg.threads_shared
        params.n_threads_batch = cfg.threads_shared
        # One KV stream per session. In a unified cache a session's tokens land in whatever
        # cells are free, sometimes before its earlier ones, and attention then sums them
        # in another order: concurrent users changed each other's greedy text. Separate
        # streams keep a session's arithmetic identical whoever else is served.
        params.kv_unified = False
        params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED  # llama.cpp's own default (auto) on CPU
        params.no_perf = True
        if not self.info.is_last:
            params.cb_eval = self._capture.callback
            params.cb_eval_user_data = self._capture.user_data
        ctx = llama_cpp.llama_init_from_model(self._model, params)
        if not ctx:
            raise EngineLoadError(
                f"llama.cpp could not create a context of {params.n_ctx} positions "
                f"for {self.info.model_id} {self.info.layers}"
            )
        return ctx

    def _batch_views(self) -> None:
        """numpy views over the native batch arrays, so filling a batch is vector work."""
        n = self.config.n_batch
        b = self._batch
        self._pos = np.ctypeslib.as_array(b.pos, shape=(n,))
        self._n_seq_id = np.ctypeslib.as_array(b.n_seq_id, shape=(n,))
        self._outputs = np.ctypeslib.as_array(b.logits, shape=(n,))
        self._seq_ptrs = [b.seq_id[i] for i in range(n)]
        if self.info.is_first:
            self._tokens = np.ctypeslib.as_array(b.token, shape=(n,))
        else:
            self._embd = np.ctypeslib.as_array(b.embd, shape=(n, self.info.d_model))

    # ---------------------------------------------------------------- forward

    def forward(self, items: list[BatchItem]) -> list[StageOutput]:
        with self._lock:
            if self._ctx is None:
                raise DecodeFailed("the engine is closed")
            if len(items) == 1:
                step = self._step(items[0])
                if step is not None:
                    return [step]
            self._validate(items)
            saved = self._admit(items)
            self._set_threads(max(item.start_pos + item.n_tokens for item in items))
            try:
                return self._run(items)
            except BaseException:
                self._restore(saved)
                raise

    def _step(self, item: BatchItem) -> StageOutput | None:
        """A lone decode step continuing its session at its length (what a session decoding
        alone sends at every token), or None when ``item`` is anything else: then the batch
        path validates, plans and runs it.

        The same checks and the same batch row as that path, without its loops, sort, plan and
        per-segment bookkeeping. Right after the previous step's compute has left the caches
        cold, the Python around a call costs 60-200 us, paid at every hop of a chain for every
        token; this path takes 0.43-0.62 of the batch path's (``scripts/bench_engine_call.py``,
        two runs on the 2-core VM, 2026-12-06). ``tests/test_engine.py -k lone_step``: the same
        bits as the batch path.

        The decode and the capture's read are written out here rather than called: each call
        a step skips is one fewer function a hop touches on cold caches (docs/ARCHITECTURE.md,
        "A lone step's Python in fewer calls"). The capture needs no reset before the call:
        ``take`` and ``_restore`` leave it empty.
        """
        slot = self._slots.get(item.session_id)
        if slot is None or item.n_tokens != 1 or item.start_pos != slot.length:
            return None
        if item.start_pos + 1 > self.config.context_length:
            return None  # the batch path raises ContextFull, with its message
        info = self.info
        if info.is_first:
            tokens = item.tokens
            if tokens is None or tokens.ndim != 1 or not 0 <= tokens[0] < info.n_vocab:
                return None
            self._tokens[0] = tokens[0]
        else:
            hidden = item.hidden
            if hidden is None or hidden.shape != (1, info.d_model):
                return None
            self._embd[0] = hidden[0] if self._input_scale == 1.0 else hidden[0] / self._input_scale
        self._set_threads(item.start_pos + 1)
        self._pos[0] = item.start_pos
        self._seq_ptrs[0][0] = slot.seq_id
        self._outputs[0] = 1
        self._n_seq_id[0] = 1
        self._batch.n_tokens = 1
        try:
            code = llama_cpp.llama_decode(self._ctx, self._batch)
            if code != 0:
                raise self._decode_error(code, 1)
            if info.is_last:
                output = StageOutput(item.session_id, logits=self._last_logits(1)[0].copy())
            else:
                hidden, half = self._capture.take(1)
                output = StageOutput(item.session_id, hidden=hidden, half=half)
        except CaptureError as exc:
            self._restore({item.session_id: slot.length})
            raise DecodeFailed(str(exc)) from exc
        except BaseException:
            self._restore({item.session_id: slot.length})
            raise
        slot.length += 1
        return output

    def _call(self, n: int) -> None:
        """``llama_decode`` of the batch's first ``n`` rows, its failures as our errors."""
        code = llama_cpp.llama_decode(self._ctx, self._batch)
        if code != 0:
            raise self._decode_error(code, n)

    def _decode_error(self, code: int, n: int) -> ContextFull | DecodeFailed:
        """What a call of ``n`` rows that ``llama_decode`` answered ``code`` (not 0) raises."""
        if code == 1:
            return ContextFull(
                f"the KV cache of {self.info.model_id} {self.info.layers} has no room for "
                f"{n} more positions"
            )
        return DecodeFailed(f"llama_decode returned {code}")

    def _captured(self, n: int) -> np.ndarray:
        """The ``n`` rows of the range's output the eval callback copied."""
        try:
            return self._capture.take(n)[0]
        except CaptureError as exc:
            raise DecodeFailed(str(exc)) from exc

    def _set_threads(self, reach: int) -> None:
        """For a call whose positions end at ``reach``: every thread while this engine holds
        one session (the batch's, once admitted), the shared count otherwise
        (``EngineConfig.n_threads_shared``); with ``EngineConfig.exact_steps``, one thread for
        calls of one token past ``SPLIT_KV_FROM``. Calls of one token take at most
        ``EngineConfig.step_threads``.

        ggml gives each output row to one thread, whichever, with one exception: a ubatch of
        one token attending to 512 or more KV cells (llama.cpp pads a stream's cells to 256,
        so from position 256 on) takes flash attention's split-KV path, which cuts the keys
        into one chunk per thread and merges the partial sums, in float, in another order.
        At several threads such a step differs from the same step at another count, batched
        with another session's (several streams in a ubatch never split) and replayed in a
        multi-token frame after a failover: greedy text changes with who else is served, and
        a stream failed over past position 256 goes on with another text (an outside audit,
        2026-12-06). At one thread the split path has one chunk and computes what the others
        do, bit for bit (``tests/test_engine.py -k split_kv``), at ~1.5x the time of two
        (``scripts/bench_exact_steps.py``): hence a choice, off by default."""
        n = self._n_threads if len(self._slots) == 1 else self._threads_shared
        step = self._step_threads  # no min(): this runs at every hop of every token
        single = 1 if self._exact_steps and reach > SPLIT_KV_FROM else step if step < n else n
        if (single, n) != self._threads:
            llama_cpp.llama_set_n_threads(self._ctx, single, n)
            self._threads = (single, n)

    def _validate(self, items: list[BatchItem]) -> None:
        check_batch(
            self.info, self.config, items, session_length=self.session_length,
            is_open=self._slots.__contains__, free_slots=len(self._free_seq_ids),
        )  # fmt: skip

    def _admit(self, items: list[BatchItem]) -> dict[SessionId, int | None]:
        """Give new sessions a slot and rewind continuing ones; return what to restore."""
        saved: dict[SessionId, int | None] = {}
        for item in items:
            slot = self._slots.get(item.session_id)
            if slot is None:
                saved[item.session_id] = None
                self._slots[item.session_id] = _Slot(heapq.heappop(self._free_seq_ids))
                continue
            saved[item.session_id] = slot.length
            if item.start_pos < slot.length:
                llama_cpp.llama_memory_seq_rm(self._memory, slot.seq_id, item.start_pos, -1)
                slot.length = item.start_pos
        return saved

    def _restore(self, saved: dict[SessionId, int | None]) -> None:
        """Undo a failed forward: a request must not leave half a batch in the KV cache, nor
        rows in the capture (a lone step reads it without a reset first)."""
        self._capture.reset()
        for session_id, length in saved.items():
            slot = self._slots.get(session_id)
            if slot is None:
                continue
            if length is None:
                self._release(session_id)
            else:
                llama_cpp.llama_memory_seq_rm(self._memory, slot.seq_id, length, -1)
                slot.length = length

    def _run(self, items: list[BatchItem]) -> list[StageOutput]:
        hidden_parts: list[list[np.ndarray]] = [[] for _ in items]
        logits: list[np.ndarray | None] = [None] * len(items)
        for call in self._plan_calls(items):
            for seg, rows in self._decode(items, call):
                if self.info.is_last:
                    if rows is not None:
                        logits[seg.index] = rows
                else:
                    hidden_parts[seg.index].append(rows)
        outputs = []
        for i, item in enumerate(items):
            self._slots[item.session_id].length = item.start_pos + item.n_tokens
            if self.info.is_last:
                outputs.append(StageOutput(item.session_id, logits=logits[i]))
            else:
                parts = hidden_parts[i]
                hidden = parts[0] if len(parts) == 1 else np.concatenate(parts)
                outputs.append(StageOutput(item.session_id, hidden=hidden))
        return outputs

    def _plan_calls(self, items: list[BatchItem]) -> list[list[_Segment]]:
        """Split items into decode calls: each multi-token chunk alone, single-token steps together.

        With per-session KV streams llama.cpp cuts a call into ubatches of equal tokens per
        sequence; keeping prefills alone keeps every call's row order predictable, and decode
        steps, where batching pays, still share calls.
        """
        calls: list[list[_Segment]] = []
        steps: list[_Segment] = []
        n_batch = self.config.n_batch
        for index, item in enumerate(items):
            if item.n_tokens == 1:
                steps.append(_Segment(index, 0, 1))
                continue
            for offset in range(0, item.n_tokens, n_batch):
                calls.append([_Segment(index, offset, min(n_batch, item.n_tokens - offset))])
        calls.extend(steps[i : i + n_batch] for i in range(0, len(steps), n_batch))
        return calls

    def _decode(self, items: list[BatchItem], call: list[_Segment]) -> list[tuple[_Segment, np.ndarray | None]]:
        """One llama_decode; returns each segment's hidden rows (or last-token logits)."""
        # Sequence ids ascending: llama.cpp's sequential split then emits ubatches whose
        # rows are in this order, so concatenated captures line up with the batch.
        ordered = sorted(call, key=lambda seg: self._slots[items[seg.index].session_id].seq_id)
        n = n_out = 0
        for seg in ordered:
            item = items[seg.index]
            end = n + seg.count
            lo, hi = seg.offset, seg.offset + seg.count
            if self.info.is_first:
                self._tokens[n:end] = item.tokens[lo:hi]
            else:
                block = item.hidden[lo:hi]
                self._embd[n:end] = block if self._input_scale == 1.0 else block / self._input_scale
            self._pos[n:end] = np.arange(item.start_pos + lo, item.start_pos + hi, dtype=np.int32)
            seq_id = self._slots[item.session_id].seq_id
            for k in range(n, end):
                self._seq_ptrs[k][0] = seq_id
            if self.info.is_last:
                # Logits only where an item ends: that is the one row the sampler needs.
                self._outputs[n:end] = 0
                if hi == item.n_tokens:
                    self._outputs[end - 1] = 1
                    n_out += 1
            else:
                self._outputs[n:end] = 1
            n = end
        self._n_seq_id[:n] = 1
        self._batch.n_tokens = n

        if not self.info.is_last:
            self._capture.reset()
        self._call(n)

        out: list[tuple[_Segment, np.ndarray | None]] = []
        if not self.info.is_last:
            captured = self._captured(n)
            offset = 0
            for seg in ordered:
                out.append((seg, captured[offset : offset + seg.count]))
                offset += seg.count
            return out
        # One copy of every output row: each session's row is a view into it, owned by the caller.
        rows = self._last_logits(n_out).copy() if n_out else None
        j = 0
        for seg in ordered:
            row = None
            if rows is not None and seg.offset + seg.count == items[seg.index].n_tokens:
                row = rows[j]
                j += 1
            out.append((seg, row))
        return out

    def _last_logits(self, n: int) -> np.ndarray:
        """The last decode's ``n`` rows of logits, one per output in batch order (llama.h:
        stored contiguously in the order they appeared in the batch): a view into llama.cpp's
        buffer, valid until the next decode.

        Views are cached by the buffer's address: right after a decode, on caches it left
        cold, ``np.ctypeslib.as_array`` cost ~35 us a row; a cached view costs ~1 us. The
        address is read on every call, so a buffer llama.cpp reallocates gets a new view."""
        # The pointer's value read from its own bytes: ``ctypes.cast`` is a Python function.
        address = ctypes.c_void_p.from_buffer(llama_cpp.llama_get_logits(self._ctx)).value
        if not address:
            raise DecodeFailed("llama.cpp returned no logits")
        view = self._logit_views.get((address, n))
        if view is None:
            if len(self._logit_views) >= _MAX_LOGIT_VIEWS:
                self._logit_views.clear()
            buffer = (ctypes.c_float * (n * self.info.n_vocab)).from_address(address)
            view = np.frombuffer(buffer, dtype=np.float32).reshape(n, self.info.n_vocab)
            self._logit_views[(address, n)] = view
        return view

    # ---------------------------------------------------------------- sessions

    def session_length(self, session_id: SessionId) -> int:
        slot = self._slots.get(session_id)
        return slot.length if slot else 0

    def sessions(self) -> list[SessionId]:
        return list(self._slots)

    def close_session(self, session_id: SessionId) -> bool:
        with self._lock:
            if self._ctx is None or session_id not in self._slots:
                return False
            self._release(session_id)
            return True

    def rename_session(self, old: SessionId, new: SessionId) -> int:
        with self._lock:
            if old not in self._slots or new in self._slots:
                return 0
            slot = self._slots[new] = self._slots.pop(old)
            return slot.length

    def _release(self, session_id: SessionId) -> None:
        slot = self._slots.pop(session_id)
        llama_cpp.llama_memory_seq_rm(self._memory, slot.seq_id, -1, -1)
        heapq.heappush(self._free_seq_ids, slot.seq_id)

    def cached_positions(self, session_id: SessionId) -> int:
        """What llama.cpp itself holds for the session (tests check this reaches 0)."""
        slot = self._slots.get(session_id)
        if slot is None:
            return 0
        return int(llama_cpp.llama_memory_seq_pos_max(self._memory, slot.seq_id)) + 1

    def _kv_cache_bytes(self) -> int:
        """What the cache reserves: every position of every slot, K and V in f16."""
        m = self._model
        heads, heads_kv = llama_cpp.llama_model_n_head(m), llama_cpp.llama_model_n_head_kv(m)
        head_dim = self.info.d_model // max(1, heads)
        n_ctx = self.config.context_length * self.config.max_sessions
        return int(n_ctx * self._slice_layers * 2 * heads_kv * head_dim * 2)

    def memory(self) -> MemoryReport:
        return MemoryReport(self._weights_bytes, self._kv_bytes, len(self._slots))

    # --------------------------------------------------------------- lifetime

    def close(self) -> None:
        with self._lock:
            if getattr(self, "_batch", None) is not None:
                llama_cpp.llama_batch_free(self._batch)
                self._batch = None
            if getattr(self, "_ctx", None) is not None:
                llama_cpp.llama_free(self._ctx)
                self._ctx = None
            if getattr(self, "_model", None) is not None:
                llama_cpp.llama_model_free(self._model)
                self._model = None
            if hasattr(self, "_slots"):
                self._slots.clear()


class _HParams(dict):
    """The metadata values ``ArchRules.embd_input_scale`` reads, taken from the loaded model."""

    def __init__(self, arch: str, model: llama_cpp.llama_model_p) -> None:
        super().__init__(embedding_length=int(llama_cpp.llama_model_n_embd(model)), arch=arch)
