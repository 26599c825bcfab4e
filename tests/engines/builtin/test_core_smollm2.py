"""The real SmolLM2-135M-Instruct (GGUF, loaded by our loader) against HF transformers' generate."""

from __future__ import annotations


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
def hf_model(smollm2_source):
    """transformers' own model of the GGUF's weights (as de-quantized into the converted cache)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_source.directory, dtype=torch.float32,
                                                **smollm2_source.hf_kwargs()).eval()


pytestmark = pytest.mark.model


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


def test_greedy_steps_take_the_heads_screen_and_give_the_full_heads_tokens(engine):
    """engines/builtin/greedy_head.py: batches of 1-3 all-greedy sequences take their tokens from the head's int8
    screen, and they are the tokens of the full head's logits, step after step (the screened run's tokens feed its
    next steps, so one differing token would change the rest)."""
    head = engine.runner.greedy_head
    assert head is not None, "SmolLM2's fp32 head is on the native kernel: it must have a screen"
    answered = []

    def counted(hidden, seqs):
        tokens = head(hidden, seqs)
        answered.append(tokens is not None)
        return tokens

    prompts = [engine.tokenizer.encode(q) for q in QUESTIONS]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    engine.runner.greedy_head = counted
    try:
        screened = engine.generate_batch(prompts, params)
        screened_steps = len(answered)
        with_logprobs = engine.generate_batch(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0, logprobs=True))
        engine.runner.greedy_head = None
        full = engine.generate_batch(prompts, params)
    finally:
        engine.runner.greedy_head = head

    assert screened == full
    assert screened_steps >= 40 and all(answered[:screened_steps])
    # A step wanting logprobs needs the logits: the screen declines it and the full head serves.
    assert answered[screened_steps:] == [False] * 4 and with_logprobs[0] == full[0][:4]
