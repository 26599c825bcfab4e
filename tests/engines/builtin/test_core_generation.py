"""The engine core's greedy output equals HF transformers' generate, token for token, however
the work is batched: concurrent requests, chunked prefill, forked contexts, preemption.

Batching changes the order of float reductions, so where HF's two best logits are within
``NEAR_TIE`` either token is a correct greedy choice; the outputs are compared up to such a step."""

from __future__ import annotations

import asyncio

import pytest
import torch

from engines.builtin.config import EngineConfig
from engines.builtin.core import EngineCore
from engines.builtin.types import SamplingParams

# Every test here loads a model (through its fixtures): marked here as well, so that
# `make test-fast` leaves the module unimported (tests/support/module_marks.py).
pytestmark = pytest.mark.model

MAX_TOKENS = 12
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
PROMPT_LENGTHS = (1, 9, 16, 37, 70)


def random_prompts(lengths, seed=1, vocab_size=49152) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in lengths]


NEAR_TIE = 1e-3


class Greedy:
    """HF's greedy tokens and, per step, the gap between its two best logits."""

    def __init__(self, tokens: list[int], margins: list[float]):
        self.tokens = tokens
        self.margins = margins

    def accepts(self, output: list[int]) -> bool:
        if len(output) != len(self.tokens):
            return False
        for token, expected, margin in zip(output, self.tokens, self.margins):
            if margin < NEAR_TIE:
                return True  # a near tie: from here on both continuations are right
            if token != expected:
                return False
        return True


def hf_greedy(hf_model, prompt: list[int], max_tokens: int = MAX_TOKENS) -> Greedy:
    output = hf_model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                               eos_token_id=None, output_scores=True, return_dict_in_generate=True)
    top2 = [scores[0].topk(2).values for scores in output.scores]
    return Greedy(output.sequences[0, len(prompt):].tolist(), [float(v[0] - v[1]) for v in top2])


@pytest.fixture(scope="module")
def references(tiny_hf_model):
    cache: dict[tuple[int, ...], Greedy] = {}

    def reference(prompt: list[int]) -> Greedy:
        key = tuple(prompt)
        if key not in cache:
            cache[key] = hf_greedy(tiny_hf_model, prompt)
        return cache[key]

    return reference


async def collect(stream) -> list[int]:
    return [event.token_id async for event in stream]


def assert_all_blocks_free(engine: EngineCore) -> None:
    stats = engine.stats()
    assert (stats.running, stats.waiting) == (0, 0)
    assert stats.blocks_free == stats.blocks_total


@pytest.mark.parametrize("budget", [1024, 7], ids=["whole-prefill", "chunked-prefill"])
async def test_concurrent_greedy_matches_hf(make_engine, references, budget):
    engine = make_engine(max_num_batched_tokens=budget)
    prompts = random_prompts(PROMPT_LENGTHS)
    outputs = await asyncio.gather(*(collect(engine.generate_from_prompt(p, GREEDY)) for p in prompts))
    for prompt, output in zip(prompts, outputs):
        assert references(prompt).accepts(output), f"prompt of {len(prompt)} tokens"
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
        assert references(prefix + suffix).accepts(output)
    # Generated tokens extend the context: continuing it equals one longer prompt.
    more = await collect(engine.generate(children[0], GREEDY))
    assert hf_greedy_continuation(references, prefix + suffixes[0], outputs[0]).accepts(more)

    for context_id in [parent.context_id, *children]:
        await engine.free_context(context_id)
    assert_all_blocks_free(engine)


def hf_greedy_continuation(references, prompt, first_output):
    return references(prompt + first_output)


def test_preemption_by_recompute_keeps_outputs(tiny_model_dir, references):
    # 10 blocks of 16 slots: the five prompts plus their tokens need 17, so some must be evicted.
    # All five are queued before the first step (no loop thread), so that holds whatever the timing:
    # with the loop running, an early request could finish before the last arrived, and none be evicted.
    engine = EngineCore(EngineConfig(model=str(tiny_model_dir), num_blocks=10, max_num_batched_tokens=64))
    prompts = random_prompts(PROMPT_LENGTHS, seed=3)
    outputs = engine.generate_batch(prompts, GREEDY)
    assert engine.scheduler.num_preemptions > 0
    for prompt, output in zip(prompts, outputs):
        assert references(prompt).accepts(output)
    assert_all_blocks_free(engine)


async def test_idle_context_kv_is_evicted_and_recomputed(make_engine, references):
    engine = make_engine(num_blocks=8)
    idle_prompt, busy_prompt = random_prompts((70, 60), seed=4)
    idle = await engine.fill(idle_prompt)
    # The second request needs more blocks than are free: the idle context gives its KV up.
    assert references(busy_prompt).accepts(await collect(engine.generate_from_prompt(busy_prompt, GREEDY)))
    assert engine.scheduler.contexts[idle.context_id].num_computed_tokens < len(idle_prompt)
    assert references(idle_prompt).accepts(await collect(engine.generate(idle.context_id, GREEDY)))
    await engine.free_context(idle.context_id)
    assert_all_blocks_free(engine)


def test_generate_batch_without_loop_thread(tiny_model_dir, references):
    engine = EngineCore(EngineConfig(model=str(tiny_model_dir), max_num_batched_tokens=32))
    prompts = random_prompts(PROMPT_LENGTHS, seed=5)
    outputs = engine.generate_batch(prompts, GREEDY)
    assert all(references(p).accepts(o) for p, o in zip(prompts, outputs))
    assert_all_blocks_free(engine)


def test_prompts_sharing_a_prefix_in_one_step_compute_it_once(tiny_model_dir, references):
    prefix, *suffixes = random_prompts((40, 5, 9, 3), seed=6)  # 40 tokens: two full blocks of 16
    prompts = [prefix + suffix for suffix in suffixes]
    computed, hits = {}, {}
    for caching in (True, False):
        # All queued before the first step (no loop thread): one step admits them all.
        engine = EngineCore(EngineConfig(model=str(tiny_model_dir), enable_prefix_caching=caching))
        outputs = engine.generate_batch(prompts, GREEDY)
        assert all(references(p).accepts(o) for p, o in zip(prompts, outputs))
        computed[caching], hits[caching] = engine.computed_tokens, engine.stats().prefix_hit_tokens
        assert_all_blocks_free(engine)
    assert hits == {True: 32 * (len(prompts) - 1), False: 0}
    assert computed[False] - computed[True] == 32 * (len(prompts) - 1)


def test_a_fork_of_a_parent_still_filling_matches_its_next_blocks(tiny_model_dir, references):
    engine = EngineCore(EngineConfig(model=str(tiny_model_dir), max_num_batched_tokens=24))
    prefix, suffix = random_prompts((70, 5), seed=9)  # the parent's fill takes three steps of 24
    engine.ensure_context("parent", prefix)
    engine.step()  # 24 of 70 computed: the fork starts at the block boundary 16, not mid-block
    before = engine.computed_tokens
    output = engine.generate_batch([suffix], GREEDY, parent_context_id="parent")[0]
    assert references(prefix + suffix).accepts(output)
    by_the_fork = engine.computed_tokens - before - (len(prefix) - 24) - (MAX_TOKENS - 1)
    assert by_the_fork <= len(prefix) % 16 + len(suffix)  # the parent's partial tail and its own tokens


async def test_a_forks_own_tokens_are_found_in_the_prefix_cache(make_engine, references):
    engine = make_engine()
    prompt = random_prompts((45,), seed=12)[0]
    assert references(prompt).accepts(await collect(engine.generate_from_prompt(prompt, GREEDY)))  # caches 0-31
    parent = await engine.fill(prompt[:21])  # its second block, 16-20, partial: the fork copies those rows
    before = engine.computed_tokens
    output = await collect(engine.generate_from_prompt(prompt[21:], GREEDY, parent_context_id=parent.context_id))
    assert references(prompt).accepts(output)
    # The cached block 16-31 takes the copy's place: the fork computes 32-44, then decodes.
    assert engine.computed_tokens - before == (len(prompt) - 32) + (MAX_TOKENS - 1)
    await engine.free_context(parent.context_id)
    assert_all_blocks_free(engine)


async def test_a_failed_step_leaves_no_kv_to_reuse(make_engine, references, monkeypatch):
    engine = make_engine()
    prompt = random_prompts((40,), seed=7)[0]
    run = engine.runner.run
    monkeypatch.setattr(engine.runner, "run", lambda batch: 1 / 0)
    events = [event async for event in engine.generate_from_prompt(prompt, GREEDY)]
    assert [event.finish_reason for event in events] == ["abort"]
    assert engine.stats().cached_tokens == 0  # the blocks it was computing were unpublished
    assert_all_blocks_free(engine)
    monkeypatch.setattr(engine.runner, "run", run)
    assert references(prompt).accepts(await collect(engine.generate_from_prompt(prompt, GREEDY)))
    assert engine.stats().prefix_hit_tokens == 0


async def test_forks_that_bring_their_parents_tokens_create_it_and_share_its_blocks(make_engine, references):
    engine = make_engine()
    prefix, *suffixes = random_prompts((40, 5, 9, 3), seed=8)  # 40: two full blocks and 8 tokens
    before = engine.computed_tokens
    outputs = await asyncio.gather(*(
        collect(engine.generate_from_prompt(s, GREEDY, parent_context_id="shared", parent_tokens=prefix))
        for s in suffixes))
    assert all(references(prefix + s).accepts(o) for s, o in zip(suffixes, outputs))
    assert engine.context_length("shared") == len(prefix)  # created once, by whichever came first
    # Each full block of the prefix is computed once; every fork recomputes at most the partial tail.
    decodes = (MAX_TOKENS - 1) * len(suffixes)
    assert engine.computed_tokens - before - decodes <= len(prefix) + sum(8 + len(s) for s in suffixes)
    await engine.free_context("shared")
    assert_all_blocks_free(engine)
