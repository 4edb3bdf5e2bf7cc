"""The contract every layer engine (llama.cpp, later MLX) implements.

An engine holds layers ``[start, end)`` of one model and runs *batches*: one or more
sessions' items decoded together, which is how a stage serves many conversations with one
pass over its weights. Engines are synchronous and not thread-safe; the stage that owns one
makes one call at a time, on its engine thread (``node.engine_thread``) or, for small
batches of an engine ``callable_from_any_thread``, on the event loop's.

Positions are explicit so the engine can check the caller's view of a session against its
own KV cache: an item must start where the session's cache ends, or earlier to rewind (the
cache beyond ``start_pos`` is discarded first; failover replays a session this way).
"""

from __future__ import annotations

import abc
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from inclavate.types import LayerRange, ModelId, SessionId
from node.errors import ContextFull, InvalidBatch, SessionLimitReached


def default_threads() -> int:
    """Physical-ish core count: llama.cpp's CPU kernels do not gain from hyperthreads."""
    count = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, count or 1)


@dataclass(frozen=True)
class EngineConfig:
    """Per-engine resources. Every stage of a chain must use the same ``context_length``:
    some architectures (phi3 longrope) choose rope factors from it."""

    n_threads: int = field(default_factory=default_threads)
    n_threads_shared: int | None = None
    """Threads while the engine holds more than one session (None: ``n_threads``).

    Peers that share a machine's cores (``inclavate swarm``) set their share here and all
    the cores in ``n_threads``: one stream through a chain computes at one stage at a time
    (but for the chunks of a long prompt, which overlap a little), so that stage may use
    every core, while the steps of several sessions run at every stage at once, where more
    threads than cores would wait at each barrier for partners without one
    (docs/ARCHITECTURE.md, "Thread wait policy")."""
    exact_steps: bool = False
    """Run one-token steps past position 256 on one thread, so that greedy (or seeded) text
    does not depend on the thread count, on who else is served, or on a failover's replay.
    At several threads llama.cpp's split-KV attention sums such a step in another order;
    one thread costs a lone stream ~1.5x a step past 256 at two threads
    (``scripts/bench_exact_steps.py``). Batches of several tokens or sessions are exact
    either way."""
    step_threads: int | None = None
    """Threads for a call of one token (a decode step), at most ``n_threads`` (None:
    ``n_threads``); calls of several tokens keep ``n_threads`` (or the shared count), as
    llama.cpp's ``-t`` sits beside its ``-tb``. For peers that share cores, which
    ``inclavate swarm`` gives the cores the other peers leave (``CoreSplit.step``): on the
    2-core VM its 3 peers streamed 9-24% faster with one thread a step than with two
    (docs/ARCHITECTURE.md, "A lone step's thread count"). A peer alone keeps every core."""
    context_length: int = 2048
    """Most positions one session may hold."""
    max_sessions: int = 8
    """Sequence slots; the KV cache is sized ``context_length * max_sessions``."""
    n_batch: int = 512
    """Most tokens per llama.cpp decode call; longer batches are split."""

    def __post_init__(self) -> None:
        for name in ("n_threads", "context_length", "max_sessions", "n_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.n_threads_shared is not None and not 1 <= self.n_threads_shared <= self.n_threads:
            raise ValueError(f"n_threads_shared must be between 1 and n_threads ({self.n_threads})")
        if self.step_threads is not None and not 1 <= self.step_threads <= self.n_threads:
            raise ValueError(f"step_threads must be between 1 and n_threads ({self.n_threads})")

    @property
    def threads_shared(self) -> int:
        return self.n_threads_shared or self.n_threads


@dataclass(eq=False, init=False)
class BatchItem:
    """One session's slice of a batch: token ids on the first range, hidden states after it.

    Treated as immutable, but not declared frozen: this, :class:`StageOutput` and
    ``node.stage.StageResult`` are made at every hop of every token on caches the engine
    call left cold, where a frozen dataclass's ``__init__`` (an ``object.__setattr__`` per
    field) costs ~6x a plain one."""

    session_id: SessionId
    start_pos: int
    tokens: np.ndarray | None = None
    """int32, shape (n,)."""
    hidden: np.ndarray | None = None
    """float32, shape (n, d_model)."""

    def __init__(self, session_id: SessionId, start_pos: int, tokens: np.ndarray | None = None,
                 hidden: np.ndarray | None = None) -> None:  # fmt: skip
        """The dataclass's own ``__init__``, plus ``n_tokens``: set here, asked ~18 times
        an item on a hop, and a lazy property cost two Python calls at its first asking
        (a hop's step asks it on caches its engine call left cold)."""
        self.session_id = session_id
        self.start_pos = start_pos
        self.tokens = tokens
        self.hidden = hidden
        rows = tokens if tokens is not None else hidden
        self.n_tokens: int = int(rows.shape[0]) if rows is not None and rows.ndim else 0
        """Positions the item carries (0 for neither tokens nor hidden states, which no
        engine accepts: ``check_batch``)."""


@dataclass(eq=False, slots=True)
class StageOutput:
    """What one item produced: hidden states for the next range, or the last token's logits."""

    session_id: SessionId
    hidden: np.ndarray | None = None
    """float32 (n, d_model) when this range is not the last."""
    logits: np.ndarray | None = None
    """float32 (n_vocab,) of the item's last position when this range is the last."""
    half: bytes | None = None
    """``hidden`` as float16 bytes, bit for bit ``hidden.astype(np.float16)``, where the engine
    converted it while it was still in the cache and every value fits (:func:`inclavate.tensors.encode`
    takes it as is)."""


@dataclass(frozen=True)
class EngineInfo:
    model_id: ModelId
    layers: LayerRange
    n_layers: int
    d_model: int
    n_vocab: int
    arch: str

    @functools.cached_property
    def is_first(self) -> bool:
        return self.layers.start == 0

    @functools.cached_property
    def is_last(self) -> bool:
        return self.layers.end == self.n_layers


@dataclass(frozen=True)
class MemoryReport:
    weights_bytes: int
    """Bytes of the weights this range computes with (its blocks, plus embeddings/head if used)."""
    kv_cache_bytes: int
    """Bytes reserved for the KV cache of every session slot."""
    sessions: int
    """Live sessions holding a sequence slot."""

    @property
    def total_mb(self) -> int:
        return (self.weights_bytes + self.kv_cache_bytes) // (1024 * 1024)


def check_batch(
    info: EngineInfo,
    config: EngineConfig,
    items: list[BatchItem],
    *,
    session_length: Callable[[SessionId], int],
    is_open: Callable[[SessionId], bool],
    free_slots: int,
) -> None:
    """Refuse a batch this range cannot run, before any state changes (every engine's rules)."""
    seen: set[SessionId] = set()
    d = info.d_model
    for item in items:
        if item.session_id in seen:
            raise InvalidBatch(f"session {item.session_id} appears twice in one batch")
        seen.add(item.session_id)
        if info.is_first:
            if item.tokens is None or item.tokens.ndim != 1:
                raise InvalidBatch("the first layer range takes a 1-D array of token ids")
            if item.tokens.size and (item.tokens.min() < 0 or item.tokens.max() >= info.n_vocab):
                raise InvalidBatch(f"token ids must lie in [0, {info.n_vocab})")
        elif item.hidden is None or item.hidden.ndim != 2 or item.hidden.shape[1] != d:
            raise InvalidBatch(f"layer range {info.layers} takes hidden states (n, {d})")
        n = item.n_tokens
        if n == 0:
            raise InvalidBatch("an item must carry at least one position")
        length = session_length(item.session_id)
        if item.start_pos < 0 or item.start_pos > length:
            raise InvalidBatch(
                f"session {item.session_id} holds {length} positions; cannot continue at {item.start_pos}"
            )
        if item.start_pos + n > config.context_length:
            raise ContextFull(
                f"session {item.session_id} would reach {item.start_pos + n} positions; "
                f"the context holds {config.context_length}"
            )
    if sum(1 for item in items if not is_open(item.session_id)) > free_slots:
        raise SessionLimitReached(
            f"all {config.max_sessions} session slots of {info.model_id} {info.layers} are in use"
        )


class LayerEngine(abc.ABC):
    """Runs one contiguous layer range; see the module docstring for the contract."""

    info: EngineInfo
    config: EngineConfig

    @property
    def context_length(self) -> int:
        return self.config.context_length

    @property
    def callable_from_any_thread(self) -> bool:
        """Whether a call may come from another OS thread than the engine thread at no extra
        cost to any call. The stage then runs decode-sized batches on the event loop's thread
        and skips two thread hand-offs a step. At one compute thread nothing depends on the
        caller; an engine that knows more says so."""
        return self.config.n_threads == 1

    @abc.abstractmethod
    def forward(self, items: list[BatchItem]) -> list[StageOutput]:
        """Run every item through this range in as few backend calls as possible.

        Items must belong to distinct sessions; outputs come back in the same order.
        """

    @abc.abstractmethod
    def close_session(self, session_id: SessionId) -> bool:
        """Free the session's KV cache and slot; False if it held none."""

    @abc.abstractmethod
    def rename_session(self, old: SessionId, new: SessionId) -> int:
        """Let ``new`` continue ``old``'s cache (a failover keeps a hop's KV under the new leg's
        id); returns the positions kept, 0 when ``old`` is not held or ``new`` already is."""

    @abc.abstractmethod
    def session_length(self, session_id: SessionId) -> int:
        """Positions cached for the session (0 for an unknown session)."""

    @abc.abstractmethod
    def memory(self) -> MemoryReport: ...

    @abc.abstractmethod
    def close(self) -> None:
        """Free every session and the model; the engine is unusable afterwards."""

    def __enter__(self) -> LayerEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
