"""``PeerConfig``'s own checks and the memory budget's advice (no peer started)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from inclavate.errors import ConfigError
from inclavate.gguf_meta import read_metadata
from inclavate.peer_config import PeerConfig, capacity
from inclavate.types import ModelId
from node.engine import EngineConfig


def config(tmp_path: Path, **kw: object) -> PeerConfig:
    return PeerConfig(model_id=ModelId("smollm2:135m"), home=tmp_path, data_dir=tmp_path, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("drain", [math.nan, math.inf, -1.0])
def test_a_drain_timeout_that_is_no_finite_number_is_refused(tmp_path: Path, drain: float) -> None:
    """An audit from outside: ``--drain-timeout nan`` passed ``drain_s < 0`` (NaN compares
    False), and the peer's Ctrl-C ended in a traceback from trio.move_on_after before it
    announced its departure."""
    with pytest.raises(ConfigError, match="--drain-timeout must be a number of seconds >= 0"):
        config(tmp_path, drain_s=drain)
    assert config(tmp_path, drain_s=0.0).drain_s == 0.0


def test_a_kv_cache_too_big_for_the_budget_says_to_lower_context_or_sessions(smollm2, tmp_path: Path) -> None:
    """Before: a huge ``--context`` was told to "raise --memory-mb" (to 585937503 MB)."""
    meta = read_metadata(smollm2.path)
    for engine in (EngineConfig(context_length=100_000_000_000), EngineConfig(max_sessions=1_000_000_000)):
        with pytest.raises(ConfigError) as err:
            capacity(config(tmp_path, memory_mb=11373, engine=engine), meta)
        assert "KV cache of --context" in str(err.value), err.value
        assert str(err.value).endswith("lower --context or --max-sessions"), err.value
    with pytest.raises(ConfigError, match=r"cannot hold one layer .*; raise --memory-mb$"):
        capacity(config(tmp_path, memory_mb=1), meta)  # even where the KV cache is most of a layer
