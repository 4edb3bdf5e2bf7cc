"""Choosing the engine (``--engine``), and the engine kind in node records."""

from __future__ import annotations

from pathlib import Path

import pytest
from registry_helpers import record, signed

from inclavate import cli
from inclavate.errors import ConfigError
from inclavate.gguf_meta import read_metadata
from inclavate.peer_config import PeerConfig, capacity
from node import engines
from node.engine import EngineConfig
from p2p.identity import Identity
from p2p.records import InvalidRecord, NodeRecord, SignedRecord


def test_auto_is_mlx_on_apple_silicon_and_llamacpp_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engines, "is_apple_silicon", lambda: False)
    assert engines.resolve_engine("auto") == "llamacpp"
    monkeypatch.setattr(engines, "is_apple_silicon", lambda: True)
    monkeypatch.setattr(engines, "mlx_available", lambda: True)
    assert engines.resolve_engine("auto") == "mlx"
    monkeypatch.setattr(engines, "mlx_available", lambda: False)
    assert engines.resolve_engine("auto") == "llamacpp"


def test_explicit_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engines, "mlx_available", lambda: True)
    assert engines.resolve_engine("llamacpp") == "llamacpp"
    assert engines.resolve_engine("mlx") == "mlx"
    with pytest.raises(ConfigError, match="unknown engine 'cuda'"):
        engines.resolve_engine("cuda")


def test_mlx_requested_without_mlx_installed_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engines, "mlx_available", lambda: False)
    monkeypatch.setattr(engines, "is_apple_silicon", lambda: False)
    with pytest.raises(ConfigError, match=r"--engine mlx needs the mlx package.*inclavate\[mlx\]"):
        engines.resolve_engine("mlx")


def test_this_test_machine_has_mlx() -> None:
    """CI must test the MLX engine, not skip it: scripts/setup installs inclavate[mlx]."""
    assert engines.mlx_available()


def test_the_engine_kind_travels_in_the_signed_record() -> None:
    me = Identity.generate()
    decoded = SignedRecord.decode(signed(me, 0, 10, engine="mlx").encode())
    assert decoded.verified() and decoded.record.engine == "mlx"
    assert record(me, 0, 10).engine == "llamacpp"  # the default, also for older peers' records


@pytest.mark.parametrize("bad", ["", "MLX!", "x" * 33, 7, None])
def test_a_malformed_engine_kind_is_rejected(bad: object) -> None:
    me = Identity.generate()
    data = record(me, 0, 10).to_json() | {"engine": bad}
    with pytest.raises(InvalidRecord):
        NodeRecord.from_json(data)


def test_an_mlx_peer_budgets_its_wider_kv_cache(smollm2, tmp_path: Path) -> None:
    meta = read_metadata(smollm2.path)
    engine = EngineConfig(context_length=8192, max_sessions=8)

    def layers(kind: str) -> int:
        config = PeerConfig(model_id=smollm2.spec.model_id, home=tmp_path, data_dir=tmp_path,
                            memory_mb=400, engine=engine, engine_kind=kind)  # fmt: skip
        return capacity(config, meta)

    assert layers("mlx") < layers("llamacpp")


def test_peer_with_mlx_missing_is_a_one_line_error(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(engines, "mlx_available", lambda: False)
    assert cli.main(["peer", "--model", "smollm2:135m", "--engine", "mlx", "--api-port", "0"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: --engine mlx needs the mlx package") and "Traceback" not in "".join(err)


@pytest.mark.parametrize(("version", "ok"), [("0.31.9", False), ("0.32.0", True), ("0.32.4", True), ("1.0.0.dev1", True)])
def test_mlx_older_than_0_32_is_refused(version: str, ok: bool) -> None:
    """mlx before 0.32 decoded Q4_1 blocks wrongly (shared/NOTES.md)."""
    from node.mlx_engine import mlx_version_ok

    assert mlx_version_ok(version) is ok
