"""Engine fixtures for the builtin engine's tests, on the tiny random Llama of tests/conftest.py."""

from __future__ import annotations

import pytest


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
        engine = EngineCore(EngineConfig(model=str(tiny_model_dir), **overrides))
        engine.start()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.shutdown()
