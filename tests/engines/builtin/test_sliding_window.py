"""Sliding windows in the paged KV cache: windowed layers attend through the kernels to their window's keys only,
and a model whose every layer is windowed (Mistral here) frees the blocks behind the window, so a sequence
longer than the whole cache runs in it; greedy output token-identical to transformers' at fp32."""

from __future__ import annotations

import pytest

from engines.builtin import attention
from engines.builtin.config import EngineConfig
from engines.builtin.core import EngineCore
from engines.builtin.model import architecture_of
from tests.engines.builtin.test_core_generation import GREEDY, assert_all_blocks_free, hf_greedy, random_prompts
from tests.engines.builtin.test_model_families import forks_match_transformers
from tests.support.models import saved_tiny_family, tiny_family_config

pytestmark = pytest.mark.timeout(240)

WINDOW = 24  # the tiny Mistral's (tests/support/models.py)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory, smollm2_tokenizer_dir):
    return saved_tiny_family("mistral", tmp_path_factory.mktemp("tiny-mistral"), smollm2_tokenizer_dir)


@pytest.fixture
def kernels_only(monkeypatch):
    """The torch path that gathers each step's window by hand fails the test: the kernels must serve the windows."""
    def refuse(*args, **kwargs):
        raise AssertionError("a windowed layer went to windowed_attention, not the kernels")

    monkeypatch.setattr(attention, "windowed_attention", refuse)


@pytest.mark.model  # transformers' configs: importing transformers takes seconds
def test_every_layer_windowed_frees_blocks_and_alternating_layers_free_none():
    assert architecture_of(tiny_family_config("mistral")).freeing_window == WINDOW
    assert architecture_of(tiny_family_config("phi3")).freeing_window == 40
    assert architecture_of(tiny_family_config("gemma3")).freeing_window is None  # its global layer reads everything
    assert architecture_of(tiny_family_config("qwen3")).freeing_window is None


def test_a_sequence_longer_than_the_cache_runs_in_it(mistral, kernels_only):
    """6 blocks of 16 slots (96 tokens) and 24-token steps hold a 24-token window and a chunk: prompts of 150 and 70
    tokens and their outputs (up to 162 tokens each) run together, chunked, their old blocks freed as they go."""
    directory, hf_model = mistral
    engine = EngineCore(EngineConfig(model=str(directory), num_blocks=6, max_num_batched_tokens=24))
    assert engine.max_model_len == tiny_family_config("mistral").max_position_embeddings  # not the cache's 96
    prompts = random_prompts((150, 70), seed=5)
    outputs = engine.generate_batch(prompts, GREEDY)
    for prompt, output in zip(prompts, outputs):
        assert hf_greedy(hf_model, prompt).accepts(output), f"prompt of {len(prompt)} tokens"
    assert_all_blocks_free(engine)
    engine.shutdown()


async def test_forks_of_a_context_whose_old_blocks_were_freed(mistral, kernels_only):
    """A 100-token context keeps only its window's blocks; its forks share those and go on past it."""
    directory, hf_model = mistral
    engine = EngineCore(EngineConfig(model=str(directory), num_blocks=16, max_num_batched_tokens=32))
    prefix, *suffixes = random_prompts((100, 5, 30), seed=6)

    def blocks_behind_the_window_freed(engine):
        assert engine.stats().blocks_free >= 16 - -(-(WINDOW + 16) // 16) - 1  # of the prefix's 7, 3 at most held

    await forks_match_transformers(engine, hf_model, prefix, suffixes, blocks_behind_the_window_freed)
