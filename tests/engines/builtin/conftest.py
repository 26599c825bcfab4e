"""Engine fixtures for the builtin engine's tests: on the tiny random Llama of tests/conftest.py, and the
default model served over HTTP (``smollm2_core``, ``base_url``) for the modules that talk to a real engine app."""

from __future__ import annotations

import pytest

from engines.builtin.config import EngineConfig
from engines.builtin.server.app import create_app
from tests.support.compiled import run_compiled_engine
from tests.support.markers import marks_users


@pytest.fixture(scope="session")
def tiny_hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


@pytest.fixture
def make_engine(tiny_model_dir):
    """Builds started LLMEngines on the tiny model (EngineConfig overrides as keywords); shut down after the test."""
    from engines.builtin.config import EngineConfig
    from engines.builtin.core import EngineCore

    engines = []

    def make(**overrides):
        engine = EngineCore(EngineConfig(**{"model": str(tiny_model_dir), **overrides}))
        engine.start()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.shutdown()


@pytest.fixture(scope="module")
@marks_users("model")
def smollm2_core():
    """The default model (SmolLM2) on a started engine core, 128 KV blocks (a 2048-token window)."""
    from engines.builtin.core import EngineCore

    engine = EngineCore(EngineConfig(num_blocks=128))
    engine.start()
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def base_url(smollm2_core, serve_module) -> str:
    """``smollm2_core`` behind the engine's HTTP app on loopback."""
    return serve_module(create_app(llm=smollm2_core))


@pytest.fixture(scope="session")  # a function; its users may be module-scoped
@marks_users("subprocess", "slow")
def run_compiled():
    """``run_compiled(model_dir, dtype, batches, **request)`` (tests/support/compiled.py): a compiled engine's
    outputs, in a process of its own."""
    return run_compiled_engine
