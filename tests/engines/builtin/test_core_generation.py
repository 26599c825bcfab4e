"""The engine core's greedy output equals HF transformers' generate, token for token, however
the work is batched: concurrent requests, chunked prefill, forked contexts, preemption."""

from __future__ import annotations

import asyncio

import pytest
import torch

from engines.builtin.config import EngineConfig
from engines.builtin.engine import LLMEngine
from engines.builtin.types import SamplingParams

MAX_TOKENS = 12
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
PROMPT_LENGTHS = (1, 9, 16, 37, 70)


def random_prompts(lengths, seed=1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (n,), generator=generator).tolist() for n in lengths]


def hf_greedy(hf_model, prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    output = hf_model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=None)
    return output[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def references(tiny_hf_model):
    cache: dict[tuple[int, ...], list[int]] = {}

    def reference(prompt: list[int]) -> list[int]:
        key = tuple(prompt)
        if key not in cache:
            cache[key] = hf_greedy(tiny_hf_model, prompt)
        return cache[key]

    return reference


async def collect(stream) -> list[int]:
    return [event.token_id async for event in stream]


def assert_all_blocks_free(engine: LLMEngine) -> None:
    stats = engine.stats()
    assert (stats.running, stats.waiting) == (0, 0)
    assert stats.blocks_free == stats.blocks_total


@pytest.mark.parametrize("budget", [1024, 7], ids=["whole-prefill", "chunked-prefill"])
async def test_concurrent_greedy_matches_hf(make_engine, references, budget):
    engine = make_engine(max_num_batched_tokens=budget)
    prompts = random_prompts(PROMPT_LENGTHS)
    outputs = await asyncio.gather(*(collect(engine.generate_from_prompt(p, GREEDY)) for p in prompts))
    for prompt, output in zip(prompts, outputs):
        assert output == references(prompt), f"prompt of {len(prompt)} tokens"
    assert engine.stats().generation_tokens == MAX_TOKENS * len(prompts)
    assert_all_blocks_free(engine)


async def test_forked_contexts_match_full_prompts(make_engine, references):
    engine = make_engine()
    prefix, *suffixes = random_prompts((37, 5, 16, 30, 1), seed=2)  # 37: a partial last block to copy
    parent = await engine.fill(prefix)
    assert (parent.num_tokens, parent.cached_tokens) == (len(prefix), 0)
    computed_before = engine.computed_tokens

    children = []
    for i, suffix in enumerate(suffixes):
        if i % 2:  # both ways of making a child: fill with a parent, or fork then fill
            child = await engine.fill(suffix, parent_context_id=parent.context_id)
        else:
            child = await engine.fill(suffix, context_id=engine.fork(parent.context_id))
        assert (child.num_tokens, child.cached_tokens) == (len(prefix) + len(suffix), len(prefix))
        children.append(child.context_id)
    assert engine.computed_tokens - computed_before == sum(map(len, suffixes)), "the prefix was computed again"

    outputs = await asyncio.gather(*(collect(engine.generate(c, GREEDY)) for c in children))
    for suffix, output in zip(suffixes, outputs):
        assert output == references(prefix + suffix)
    # Generated tokens extend the context: continuing it equals one longer prompt.
    more = await collect(engine.generate(children[0], GREEDY))
    assert more == hf_greedy_continuation(references, prefix + suffixes[0], outputs[0])

    for context_id in [parent.context_id, *children]:
        await engine.free_context(context_id)
    assert_all_blocks_free(engine)


def hf_greedy_continuation(references, prompt, first_output):
    return references(prompt + first_output)


async def test_preemption_by_recompute_keeps_outputs(make_engine, references):
    # 10 blocks of 16 slots: the five prompts plus their tokens need 17, so some must be evicted.
    engine = make_engine(num_blocks=10, max_num_batched_tokens=64)
    prompts = random_prompts(PROMPT_LENGTHS, seed=3)
    outputs = await asyncio.gather(*(collect(engine.generate_from_prompt(p, GREEDY)) for p in prompts))
    assert engine.scheduler.num_preemptions > 0
    for prompt, output in zip(prompts, outputs):
        assert output == references(prompt)
    assert_all_blocks_free(engine)


async def test_idle_context_kv_is_evicted_and_recomputed(make_engine, references):
    engine = make_engine(num_blocks=8)
    idle_prompt, busy_prompt = random_prompts((70, 60), seed=4)
    idle = await engine.fill(idle_prompt)
    # The second request needs more blocks than are free: the idle context gives its KV up.
    assert await collect(engine.generate_from_prompt(busy_prompt, GREEDY)) == references(busy_prompt)
    assert engine.scheduler.contexts[idle.context_id].num_computed_tokens < len(idle_prompt)
    assert await collect(engine.generate(idle.context_id, GREEDY)) == references(idle_prompt)
    await engine.free_context(idle.context_id)
    assert_all_blocks_free(engine)


def test_generate_batch_without_loop_thread(tiny_model_dir, references):
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), max_num_batched_tokens=32))
    prompts = random_prompts(PROMPT_LENGTHS, seed=5)
    assert engine.generate_batch(prompts, GREEDY) == [references(p) for p in prompts]
    assert_all_blocks_free(engine)
