"""The real SmolLM2-135M-Instruct (GGUF, loaded by our loader) against HF transformers' generate."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engines.builtin.config import EngineConfig
from engines.builtin.core import EngineCore
from engines.builtin.types import SamplingParams

QUESTIONS = ["Hi!", "What is the capital of France?", "Count from one to five."]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def engine():
    return EngineCore(EngineConfig(max_num_batched_tokens=48))  # the default model; chunked prompts


@pytest.fixture(scope="module")
def hf_model(smollm2_gguf):
    from transformers import AutoModelForCausalLM

    path = Path(smollm2_gguf)
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def test_greedy_batch_matches_hf_generate(engine, hf_model):
    assert engine.model_name.startswith("SmolLM2")
    prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True) for q in QUESTIONS]
    prompts = [p["input_ids"] if not isinstance(p, list) else p for p in prompts]
    # Up to EOS: past it the model is unsure, and float noise may pick a different near-tie.
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    outputs = engine.generate_batch(prompts, params)
    for prompt, output in zip(prompts, outputs):
        reference = hf_model.generate(
            torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=engine.eos_token_ids
        )
        assert output == reference[0, len(prompt) :].tolist(), engine.tokenizer.decode(output)
    assert "Paris" in engine.tokenizer.decode(outputs[1])
    stats = engine.stats()
    assert stats.blocks_free == stats.blocks_total
