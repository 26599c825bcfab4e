"""Scoring a prompt (the logprob of each token after the ones before it) equals HF transformers'
log-softmax of the same model's logits, however the prompt is chunked, and also when its blocks
are already in the prefix cache (cached KV has no logits: scoring recomputes them)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from engines.builtin.types import SamplingParams
from tests.support.waiting import eventually

# Every test here loads a model (through its fixtures): marked here as well, so that
# `make test-fast` leaves the module unimported (tests/support/module_marks.py).
pytestmark = [pytest.mark.timeout(120), pytest.mark.model]


# fp32 both sides, summed in other orders (the engine's C++ linears and attention against torch's GEMMs):
# this random model's logits reach ±30, so a few units in their last place move a logprob by ~1e-4.
FP32_CLOSE = dict(rtol=1e-4, atol=1e-4)


def hf_logprobs(hf_model, tokens: list[int]) -> torch.Tensor:
    """[len - 1, vocab]: row p is the distribution over token p + 1."""
    with torch.inference_mode():
        logits = hf_model(torch.tensor([tokens])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def prompt(length: int, seed: int = 3) -> list[int]:
    return torch.randint(3, 49152, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("chunk_tokens", [1024, 16])  # one chunk, and a prefill split into chunks
def test_scores_match_hf(make_engine, tiny_hf_model, chunk_tokens):
    engine = make_engine(max_num_batched_tokens=chunk_tokens)
    tokens = prompt(45)

    scores = asyncio.run(engine.score(tokens, top_logprobs=3))

    reference = hf_logprobs(tiny_hf_model, tokens)
    assert [s.token_id for s in scores] == tokens[1:]
    expected = reference.gather(1, torch.tensor(tokens[1:]).unsqueeze(1)).squeeze(1)
    assert torch.allclose(torch.tensor([s.logprob for s in scores]), expected, **FP32_CLOSE)
    for score, row in zip(scores, reference):
        top = row.topk(3)
        assert len(score.top_logprobs) == 3
        assert [token for token, _ in score.top_logprobs] == top.indices.tolist()
        assert torch.allclose(torch.tensor([lp for _, lp in score.top_logprobs]), top.values, **FP32_CLOSE)


def test_scoring_fills_the_prefix_cache_and_a_cached_prompt_is_still_scored(make_engine, tiny_hf_model):
    engine = make_engine()
    tokens = prompt(40, seed=4)

    async def score_generate_score():
        first = await engine.score(tokens)
        hits = engine.stats().prefix_hit_tokens
        generated = [event async for event in engine.generate_from_prompt(tokens, SamplingParams(max_tokens=1))]
        reused = engine.stats().prefix_hit_tokens - hits
        return first, generated, reused, await engine.score(tokens)

    first, generated, reused, again = asyncio.run(score_generate_score())

    expected = hf_logprobs(tiny_hf_model, tokens).gather(1, torch.tensor(tokens[1:]).unsqueeze(1)).squeeze(1)
    for scores in (first, again):  # the second time every block is cached
        assert torch.allclose(torch.tensor([s.logprob for s in scores]), expected, **FP32_CLOSE)
        assert all(s.top_logprobs == [] for s in scores)  # none asked for
    assert generated and reused >= 32  # the generation reused the two full blocks scoring computed
    stats = engine.stats()
    assert stats.running == stats.waiting == 0


def test_a_one_token_prompt_has_no_scores(make_engine):
    assert asyncio.run(make_engine().score([7])) == []


def test_a_preempted_scoring_fill_resumes_where_it_was_and_scores_right(make_engine, tiny_hf_model):
    """Six blocks for a 60-token scoring fill and a higher-priority generation: the fill is preempted
    again and again; each time it comes back it reuses the blocks it had scored, not position 0."""
    engine = make_engine(num_blocks=6, max_num_batched_tokens=16)
    tokens = prompt(60, seed=4)

    async def score_beside_a_generation():
        generation = engine.generate_from_prompt(prompt(40, seed=5), SamplingParams(max_tokens=50, ignore_eos=True,
                                                                                    priority=10))
        await anext(generation)
        scoring = asyncio.create_task(engine.score(tokens, 2))
        generated = [event async for event in generation]
        return await scoring, generated

    scores, generated = asyncio.run(score_beside_a_generation())

    expected = hf_logprobs(tiny_hf_model, tokens).gather(1, torch.tensor(tokens[1:]).unsqueeze(1)).squeeze(1)
    assert torch.allclose(torch.tensor([s.logprob for s in scores]), expected, **FP32_CLOSE)
    assert len(generated) == 49
    assert 0 < engine.scheduler.num_preemptions <= 8  # 27 when every return started again from position 0


def test_a_cancelled_scoring_fill_frees_its_blocks(make_engine):
    engine = make_engine(max_num_batched_tokens=16)

    async def cancel_midway():
        scoring = asyncio.create_task(engine.score(prompt(500, seed=7), 1))
        # Midway: some of its 500 tokens computed (16 a step), not all.
        await eventually(lambda: any(0 < c.num_computed_tokens < 500 for c in list(engine.scheduler.contexts.values())))
        scoring.cancel()
        with pytest.raises(asyncio.CancelledError):
            await scoring
        await eventually(lambda: not engine.scheduler.contexts)  # the abort is applied by the engine's next step

    asyncio.run(cancel_midway())

    assert not engine.scheduler.contexts
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
