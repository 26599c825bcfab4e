"""Every family the engine runs, as a tiny random checkpoint built here (no downloads; SmolLM2's tokenizer):
greedy output token-identical to transformers' generate at fp32 (up to near ties, test_core_generation.Greedy),
for a mixed batch under chunked prefill and preemption, and for forks of one shared prefix. The windows of the
tiny configs are shorter than the prompts, so windowed layers attend to part of their context."""

from __future__ import annotations

import asyncio
import shutil

import pytest

from engines.builtin.config import EngineConfig
from engines.builtin.core import EngineCore
from tests.engines.builtin.test_core_generation import GREEDY, assert_all_blocks_free, collect, hf_greedy, random_prompts
from tests.support.models import TINY_FAMILIES, tiny_family_model

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module", params=sorted(TINY_FAMILIES))
def family(request, tmp_path_factory, smollm2_tokenizer_dir):
    """(checkpoint directory, transformers' model in eager attention: the one that soft-caps as Gemma 2 asks)."""
    from transformers import AutoModelForCausalLM

    directory = tmp_path_factory.mktemp(f"tiny-{request.param}")
    tiny_family_model(request.param).save_pretrained(directory)
    for item in smollm2_tokenizer_dir.iterdir():
        shutil.copy(item, directory)
    hf_model = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()
    return directory, hf_model


def test_mixed_batch_under_chunked_prefill_and_preemption_matches_transformers(family):
    directory, hf_model = family
    # 10 blocks of 16 slots for prompts and outputs needing 12 (as test_core_generation's preemption test), and
    # a 24-token budget: prompts are cut into chunks, and sequences are evicted and recomputed.
    engine = EngineCore(EngineConfig(model=str(directory), num_blocks=10, max_num_batched_tokens=24))
    prompts = random_prompts((1, 9, 37, 70), seed=3)
    outputs = engine.generate_batch(prompts, GREEDY)
    assert engine.scheduler.num_preemptions > 0
    for prompt, output in zip(prompts, outputs):
        assert hf_greedy(hf_model, prompt).accepts(output), f"prompt of {len(prompt)} tokens"
    assert_all_blocks_free(engine)
    engine.shutdown()


async def test_forks_of_a_shared_prefix_match_transformers(family):
    directory, hf_model = family
    engine = EngineCore(EngineConfig(model=str(directory)))
    engine.start()
    try:
        prefix, *suffixes = random_prompts((37, 5, 16, 1), seed=2)  # 37: a partial last block to copy
        parent = await engine.fill(prefix)
        children = [(await engine.fill(suffix, parent_context_id=parent.context_id)).context_id for suffix in suffixes]
        outputs = await asyncio.gather(*(collect(engine.generate(child, GREEDY)) for child in children))
        for suffix, output in zip(suffixes, outputs):
            assert hf_greedy(hf_model, prefix + suffix).accepts(output), f"suffix of {len(suffix)} tokens"
        for context_id in [parent.context_id, *children]:
            await engine.free_context(context_id)
        assert_all_blocks_free(engine)
    finally:
        engine.shutdown()
