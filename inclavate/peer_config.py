"""Everything a peer is configured with, and how many layers it can hold."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from inclavate.errors import ConfigError
from inclavate.gguf_meta import GgufMetadata
from inclavate.hardware import available_memory_mb
from inclavate.healer import HealConfig
from inclavate.tensors import WireDType
from inclavate.types import LayerRange, ModelId
from node.engine import EngineConfig
from node.engines import EngineKind
from p2p.failover import FailoverPolicy
from p2p.registry import Liveness
from p2p.wire import MAX_LANE

MEMORY_SHARE = 0.5
"""Share of the memory available at start that a peer budgets by default: a volunteer's
machine keeps working for its owner."""


@dataclass(frozen=True)
class PeerConfig:
    model_id: ModelId
    home: Path
    """``$INCLAVATE_HOME``: the model store and slice cache, shared by peers of one user."""
    data_dir: Path
    """This peer's own state: identity key, metrics database, vocabulary cache."""
    layers: LayerRange | None = None
    max_layers: int | None = None
    memory_mb: int | None = None
    api_host: str = "127.0.0.1"
    api_port: int = 8001
    p2p_host: str = "0.0.0.0"
    p2p_port: int = 0
    bootstrap: tuple[str, ...] = ()
    mdns: bool = True
    admin_token: str | None = None
    admin_peers: tuple[str, ...] = ()
    join_token: str | None = None
    """Legacy registration must present it (None: anyone may register a legacy node)."""
    allowed_hosts: tuple[str, ...] = ()
    """Extra ``Host`` header values the API accepts when it listens on loopback."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    engine_kind: EngineKind = "llamacpp"
    """Which engine runs the range (``--engine``, already resolved from "auto")."""
    wire_dtype: WireDType = "f16"
    direct_port: int | None = 0
    """TCP port of the direct data plane (``p2p.direct``; 0: any free port; None: forward
    over libp2p streams only, ``--direct-port -1``)."""
    liveness: Liveness = Liveness()
    settle_s: float = 2.0
    """How long a joining peer watches for others that chose the same layers."""
    join_timeout_s: float = 10.0
    """How long a peer with bootstrap addresses waits to learn the swarm before placing."""
    generators: bool = True
    """Offer the speech models installed in ``home`` as generators (``--no-generators``)."""
    inline_tokens: int = 8
    """Stage batches of at most this many tokens (decode steps) run on the event-loop thread
    where the engine allows it (one engine thread, or the default thread-wait policy: see
    ``node.teams_spin_alike``) and its steps take under 0.1 s (``Stage.inline_max_s``).
    With every process pinned to one core, a whole peer's decode step took 12.7-14.0 ms that
    way against 15.0-17.2 ms through the engine thread; at 2 threads a lone stream decoded
    5-15% faster (docs/ARCHITECTURE.md, "Decode steps on the event loop at any thread count")."""
    decode_lanes: int = 4
    """Most lanes of decode steps (``--decode-lanes``): as an entry, new sessions are spread
    over one lane per stage of their route, up to this many; as a stage of a chain, each
    engine call runs one lane's steps (lanes past this many fold onto them), so that the
    lanes go round the chain out of phase and its stages compute at once (1: every step of
    every session shares one call). A stage holding the whole model batches all lanes."""
    drain_s: float = 30.0
    """On Ctrl-C/SIGTERM, how long the peer waits (draining) for its sessions to move to
    other holders or finish before it leaves anyway (``--drain-timeout``)."""
    heal: HealConfig = HealConfig()
    """Moving to a gap in the swarm when this peer's span is replicated."""
    failover: FailoverPolicy = FailoverPolicy()
    """As an entry peer: how many times a request may move to a new route, step deadlines."""

    def __post_init__(self) -> None:
        if self.max_layers is not None and self.max_layers < 1:
            raise ConfigError("--max-layers must be at least 1")
        if not 1 <= self.decode_lanes <= MAX_LANE + 1:
            raise ConfigError(f"--decode-lanes must be between 1 and {MAX_LANE + 1}")
        if self.memory_mb is not None and self.memory_mb < 1:
            raise ConfigError("--memory-mb must be positive")
        # ``not >= 0``, not ``< 0``: NaN compares False both ways, and a NaN (or inf) drain
        # reached trio.move_on_after on Ctrl-C as a traceback, before the departure was announced.
        if not 0 <= self.drain_s < math.inf:
            raise ConfigError("--drain-timeout must be a number of seconds >= 0")


def _int(value: object, default: int) -> int:
    # Per-layer arrays are only measured, not read, by gguf_meta: fall back to the default.
    return int(value) if isinstance(value, (int, float)) and value > 0 else default


def kv_bytes_per_layer(meta: GgufMetadata, engine: EngineConfig, kv_value_bytes: int = 2) -> int:
    """One layer's share of the KV cache: ``--context`` x ``--max-sessions`` positions of K and V."""
    heads = _int(meta.arch_value("attention.head_count"), 1)
    heads_kv = _int(meta.arch_value("attention.head_count_kv"), heads)
    head_dim = _int(meta.arch_value("attention.key_length"), meta.d_model // heads)
    return engine.context_length * engine.max_sessions * 2 * heads_kv * head_dim * kv_value_bytes


def layer_cost_bytes(meta: GgufMetadata, engine: EngineConfig, kv_value_bytes: int = 2) -> int:
    """Memory one layer needs: its weights plus its share of the KV cache (llama.cpp keeps
    K and V in float16; the MLX engine in float32, ``kv_value_bytes=4``)."""
    weights = max(meta.layer_bytes(i) for i in range(meta.n_layers))
    return weights + kv_bytes_per_layer(meta, engine, kv_value_bytes)


def _mb(n_bytes: int) -> int:
    return n_bytes // (1024 * 1024) + 1


def capacity(config: PeerConfig, meta: GgufMetadata) -> int:
    """Layers this peer will hold: ``--max-layers``, or what its memory budget allows."""
    if config.max_layers is not None:
        return min(config.max_layers, meta.n_layers)
    budget_mb = config.memory_mb if config.memory_mb is not None else int(available_memory_mb() * MEMORY_SHARE)
    fixed = meta.tensor_bytes.get("token_embd.weight", 0) + meta.tensor_bytes.get("output.weight", 0)
    kv_value_bytes = 4 if config.engine_kind == "mlx" else 2
    per_layer = max(1, layer_cost_bytes(meta, config.engine, kv_value_bytes))
    fits = (budget_mb * 1024 * 1024 - fixed) // per_layer
    if fits < 1:
        kv = kv_bytes_per_layer(meta, config.engine, kv_value_bytes)
        # Where one layer's weights fit and its KV cache is what does not, a bigger budget is
        # rarely the fix (an audit's --context 100000000000 was told to "raise --memory-mb" to
        # 585937503 MB).
        fix = (f"the KV cache of --context {config.engine.context_length} x --max-sessions "
               f"{config.engine.max_sessions} is {_mb(kv)} MB of that: lower --context or --max-sessions"
               if fixed + per_layer - kv < budget_mb * 1024 * 1024 else "raise --memory-mb")  # fmt: skip
        raise ConfigError(
            f"a memory budget of {budget_mb} MB cannot hold one layer of {config.model_id} "
            f"({_mb(per_layer)} MB each); {fix}"
        )
    return int(min(fits, meta.n_layers))
