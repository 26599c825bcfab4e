"""Model fixtures for the builtin engine's tests: a tiny random Llama saved as an HF checkpoint
(with SmolLM2's real tokenizer beside it), and the real SmolLM2 GGUF."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    from engines.builtin.config import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smollm2_tokenizer_dir(tmp_path_factory, smollm2_gguf) -> Path:
    """SmolLM2's tokenizer (and chat template) saved as plain HF files: loads in a blink."""
    from transformers import AutoTokenizer

    directory = tmp_path_factory.mktemp("smollm2-tokenizer")
    path = Path(smollm2_gguf)
    AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(directory)
    return directory


def tiny_llama_config(**overrides):
    from transformers import LlamaConfig

    # SmolLM2's head geometry (head_dim 64, 9:3 GQA) and vocabulary, 2 layers. A wide init makes
    # the random model's greedy choices vary from token to token, so identity checks can fail.
    settings = dict(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=2,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        initializer_range=0.2,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    settings.update(overrides)
    return LlamaConfig(**settings)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm2_tokenizer_dir) -> Path:
    """A tiny random Llama as an HF checkpoint directory (safetensors + tokenizer)."""
    import shutil

    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(tiny_llama_config()).save_pretrained(directory)
    for item in smollm2_tokenizer_dir.iterdir():
        shutil.copy(item, directory)
    return directory


@pytest.fixture(scope="session")
def tiny_hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


@pytest.fixture
def make_engine(tiny_model_dir):
    """Builds started LLMEngines on the tiny model (EngineConfig overrides as keywords); shut down after the test."""
    from engines.builtin.config import EngineConfig
    from engines.builtin.engine import LLMEngine

    engines = []

    def make(**overrides):
        engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), **overrides))
        engine.start()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.shutdown()
