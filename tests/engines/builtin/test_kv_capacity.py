"""The KV cache planned by bytes (engines/builtin/kv_capacity.py), and a request past what can ever fit answered as
OpenAI answers it: a 400 with code context_length_exceeded, over real HTTP from the engine's app."""

from __future__ import annotations

import httpx
import psutil
import pytest
import torch

from engines.builtin.config import EngineConfig
from engines.builtin.core import EngineCore
from engines.builtin.kv_capacity import kv_block_bytes, longest_sequence, planned_blocks
from engines.builtin.server.app import create_app
from tests.support.models import tiny_family_config, tiny_llama_config
from tests.support import plain_http

pytestmark = pytest.mark.timeout(120)

CAPACITY_BLOCKS = 4  # 64 tokens of 16: shorter than the tiny model's 2,048-token context


def test_blocks_follow_the_models_layers_heads_and_dtype():
    config = tiny_llama_config()  # 2 layers, 3 kv heads of 64
    block = kv_block_bytes(config, 16, torch.float32)
    assert block == 2 * 2 * 3 * 64 * 16 * 4
    assert kv_block_bytes(config, 16, torch.bfloat16) == block // 2
    assert planned_blocks(EngineConfig(kv_cache_memory=10 * block + 1), config, torch.float32) == 10
    assert planned_blocks(EngineConfig(num_blocks=3, kv_cache_memory=10 * block), config, torch.float32) == 3
    with pytest.raises(ValueError, match="holds no block"):
        planned_blocks(EngineConfig(kv_cache_memory=block - 1), config, torch.float32)


def test_a_fraction_of_the_available_memory():
    config, fraction = tiny_llama_config(), 0.01
    block = kv_block_bytes(config, 16, torch.float32)
    before = psutil.virtual_memory().available
    blocks = planned_blocks(EngineConfig(kv_cache_memory_fraction=fraction), config, torch.float32)
    after = psutil.virtual_memory().available
    assert int(min(before, after) * fraction * 0.9) // block <= blocks <= int(max(before, after) * fraction * 1.1) // block
    with pytest.raises(ValueError, match="between 0 and 1"):
        EngineConfig(kv_cache_memory_fraction=1.5)


@pytest.mark.model  # transformers' configs: importing transformers takes seconds
def test_the_longest_sequence_is_the_models_unless_the_cache_holds_less():
    llama, mistral = tiny_llama_config(), tiny_family_config("mistral")  # mistral: every layer's window is 24
    config = EngineConfig(max_num_batched_tokens=24)
    assert longest_sequence(config, llama, 1000, None) == 2048
    assert longest_sequence(config, llama, CAPACITY_BLOCKS, None) == 64
    # Blocks behind the window are freed: 6 blocks hold a window and a step's chunk, so the cache bounds nothing.
    assert longest_sequence(config, mistral, 6, 24) == mistral.max_position_embeddings
    assert longest_sequence(config, mistral, 4, 24) == 64  # 64 < 24 + 24 + 32: as a model without windows


@pytest.fixture(scope="module")
def small_cache_url(tiny_model_dir, serve_module):
    """The tiny model's engine with a KV budget of CAPACITY_BLOCKS blocks, behind its HTTP app on loopback."""
    block = kv_block_bytes(tiny_llama_config(), 16, torch.float32)
    engine = EngineCore(EngineConfig(model=str(tiny_model_dir), kv_cache_memory=CAPACITY_BLOCKS * block))
    engine.start()
    yield serve_module(create_app(llm=engine))
    engine.shutdown()


def _context_length_error(response: httpx.Response) -> dict:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "context_length_exceeded")
    assert "64" in error["message"]
    return error


def test_past_what_the_cache_can_ever_hold_is_a_400(small_cache_url):
    model = plain_http.get(small_cache_url + "/v1/models").json()["data"][0]["id"]
    with httpx.Client(base_url=small_cache_url, timeout=30) as http:
        long_prompt = {"model": model, "prompt": list(range(3, 83)), "max_tokens": 1}  # 80 tokens > 64
        assert _context_length_error(http.post("/v1/completions", json=long_prompt))["param"] == "prompt"
        too_many = {"model": model, "prompt": list(range(3, 43)), "max_tokens": 40}  # 40 + 40 > 64
        assert _context_length_error(http.post("/v1/completions", json=too_many))["param"] == "max_tokens"
        fits = http.post("/v1/completions", json={**too_many, "max_tokens": 24})
        assert fits.status_code == 200 and fits.json()["usage"]["completion_tokens"] <= 24
