"""A layer range on MLX (Apple Silicon's array framework; a CPU build runs it on Linux).

It runs the same GGUF file as the llama.cpp engine, so peers of both kinds can form one
chain: it reads only its range's tensors (``node.mlx_weights``), computes llama, qwen2 and
qwen3 blocks (``node.mlx_model``) and honours the ``LayerEngine`` contract: sessions with
their own KV cache, rewind by starting an item before the cached end, and one forward for a
whole batch. All the batch's rows go through each weight matrix together; only attention
runs per session, over that session's cache.

**One thread for all MLX work.** MLX binds streams to the thread that created them: an
array still being built on one thread fails to evaluate on another ("There is no Stream(cpu,
0) in current thread"), and a stage calls its engine from the event-loop thread for a decode
step and from trio's worker threads for a prefill. So the engine owns one worker thread and
runs loading, every forward and closing on it.

**KV cache.** Per session and layer, float32 buffers that grow in steps of
``KV_GROWTH`` positions up to the context length and are written with ``slice_update``; a
rewind only moves the session's length back (stale positions are overwritten before they
are read). The new buffers replace the old ones before evaluation so that MLX can update
them in place; if evaluation then fails the batch's sessions are dropped, never left half
written.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import mlx.core as mx
import numpy as np

from inclavate.gguf_meta import read_metadata
from inclavate.types import LayerRange, ModelId, SessionId
from node.engine import (
    BatchItem,
    EngineConfig,
    EngineInfo,
    LayerEngine,
    MemoryReport,
    StageOutput,
    check_batch,
)
from node.errors import DecodeFailed, EngineLoadError
from node.mlx_model import KV, HParams, RangeWeights, Segment
from node.mlx_weights import GgufTensorReader

log = logging.getLogger(__name__)

MIN_MLX_VERSION = (0, 32)
"""Older releases decoded Q4_1 wrongly (shared/NOTES.md)."""
KV_GROWTH = 256

T = TypeVar("T")


def mlx_version_ok(version: str) -> bool:
    parts = []
    for piece in version.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts) >= MIN_MLX_VERSION


@dataclass
class _Session:
    length: int = 0
    caches: list[KV] = field(default_factory=list)

    @property
    def capacity(self) -> int:
        return int(self.caches[0][0].shape[2]) if self.caches else 0


class MlxEngine(LayerEngine):
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
        del model_sha256, slice_cache  # the whole file is read in place: no slice to cache
        if not mlx_version_ok(mx.__version__):
            raise EngineLoadError(f"the MLX engine needs mlx >= 0.32 (found {mx.__version__})")
        self.config = config
        self._sessions: dict[SessionId, _Session] = {}
        self._thread: ThreadPoolExecutor | None = ThreadPoolExecutor(1, thread_name_prefix="mlx")
        try:
            self._on_thread(lambda: self._load(model_id, model_path, layers))
        except BaseException:
            self.close()
            raise

    def _load(self, model_id: ModelId, path: Path, layers: LayerRange) -> None:
        meta = read_metadata(path)
        self.hp = hp = HParams.from_metadata(meta)
        if layers.end > hp.n_layers:
            raise EngineLoadError(f"layer range {layers} exceeds the model's {hp.n_layers} layers")
        reader = GgufTensorReader(path, meta)
        self._weights = RangeWeights.load(hp, reader, layers)
        self.info = EngineInfo(
            model_id=model_id, layers=layers, n_layers=hp.n_layers, d_model=hp.d_model,
            n_vocab=hp.n_vocab, arch=hp.arch,
        )  # fmt: skip
        self._weights_bytes = self._weights.nbytes
        self._kv_per_position = len(layers) * 2 * hp.n_head_kv * hp.head_dim * 4
        log.info(
            "MLX loaded %s layers %s of %d (%s, d_model %d): read %d MB of %s",
            model_id, layers, hp.n_layers, hp.arch, hp.d_model, reader.bytes_read >> 20, path.name,
        )  # fmt: skip

    def _on_thread(self, fn: Callable[[], T]) -> T:
        if self._thread is None:
            raise DecodeFailed("the engine is closed")
        return self._thread.submit(fn).result()

    # ---------------------------------------------------------------- forward

    def forward(self, items: list[BatchItem]) -> list[StageOutput]:
        return self._on_thread(lambda: self._forward(items))

    def _forward(self, items: list[BatchItem]) -> list[StageOutput]:
        check_batch(
            self.info, self.config, items, session_length=self.session_length,
            is_open=self._sessions.__contains__,
            free_slots=self.config.max_sessions - len(self._sessions),
        )  # fmt: skip
        if not items:
            return []
        sessions = [self._sessions.setdefault(item.session_id, _Session()) for item in items]
        segments, row = [], 0
        for item in items:
            segments.append(Segment(row, item.n_tokens, item.start_pos))
            row += item.n_tokens
        try:
            for session, seg in zip(sessions, segments):
                self._reserve(session, seg.start_pos + seg.n)
            x = self._input(items)
            for layer, block in enumerate(self._weights.blocks):
                x, caches = block(x, segments, [s.caches[layer] for s in sessions])
                for session, cache in zip(sessions, caches):
                    session.caches[layer] = cache
            if self.info.is_last:
                last_rows = mx.array([seg.row + seg.n - 1 for seg in segments])
                result = self._weights.logits(self.hp, x[last_rows])
            else:
                result = x
            mx.eval(result, [s.caches for s in sessions])
            out = np.array(result, dtype=np.float32)
        except Exception as exc:
            for item in items:
                self._sessions.pop(item.session_id, None)
            log.exception("MLX forward failed; dropped the batch's sessions")
            raise DecodeFailed(f"MLX forward failed: {exc}") from exc
        for session, seg in zip(sessions, segments):
            session.length = seg.start_pos + seg.n
        if self.info.is_last:
            return [StageOutput(item.session_id, logits=out[i]) for i, item in enumerate(items)]
        return [
            StageOutput(item.session_id, hidden=out[seg.row : seg.row + seg.n])
            for item, seg in zip(items, segments)
        ]

    def _input(self, items: list[BatchItem]) -> mx.array:
        if self.info.is_first:
            assert self._weights.embed is not None
            ids = np.concatenate([np.asarray(item.tokens, dtype=np.int32) for item in items])
            return self._weights.embed.rows(mx.array(ids))
        return mx.array(np.concatenate([np.asarray(item.hidden, dtype=np.float32) for item in items]))

    def _reserve(self, session: _Session, positions: int) -> None:
        """Grow the session's buffers to hold ``positions`` (a rewind needs no change)."""
        if positions <= session.capacity:
            return
        hp = self.hp
        capacity = min(self.config.context_length, -(-positions // KV_GROWTH) * KV_GROWTH)
        shape = (1, hp.n_head_kv, capacity - session.capacity, hp.head_dim)
        pad = mx.zeros(shape, dtype=mx.float32)
        if not session.caches:
            session.caches = [(pad, pad) for _ in self._weights.blocks]
        else:
            session.caches = [
                (mx.concatenate([k, pad], axis=2), mx.concatenate([v, pad], axis=2)) for k, v in session.caches
            ]

    # ---------------------------------------------------------------- sessions

    def session_length(self, session_id: SessionId) -> int:
        session = self._sessions.get(session_id)
        return session.length if session else 0

    def close_session(self, session_id: SessionId) -> bool:
        if self._thread is None:
            return False
        return self._on_thread(lambda: self._sessions.pop(session_id, None) is not None)

    def rename_session(self, old: SessionId, new: SessionId) -> int:
        def rename() -> int:
            if old not in self._sessions or new in self._sessions:
                return 0
            session = self._sessions[new] = self._sessions.pop(old)
            return session.length

        return self._on_thread(rename) if self._thread is not None else 0

    def memory(self) -> MemoryReport:
        """KV as reserved by every slot at full context (what a peer must budget for)."""
        kv = self._kv_per_position * self.config.context_length * self.config.max_sessions
        return MemoryReport(self._weights_bytes, kv, len(self._sessions))

    def kv_positions_held(self) -> int:
        """Positions of KV buffer actually allocated now, over all sessions (tests)."""
        return sum(s.capacity for s in self._sessions.values())

    # --------------------------------------------------------------- lifetime

    def close(self) -> None:
        thread, self._thread = self._thread, None
        if thread is None:
            return

        def release() -> None:
            self._sessions.clear()
            self._weights = None  # type: ignore[assignment]
            mx.clear_cache()

        thread.submit(release).result()
        thread.shutdown(wait=True)

