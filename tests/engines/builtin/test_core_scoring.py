"""Scoring a prompt (the logprob of each token after the ones before it) equals HF transformers'
log-softmax of the same model's logits, however the prompt is chunked, and also when its blocks
are already in the prefix cache (cached KV has no logits: scoring recomputes them)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from engines.builtin.types import SamplingParams

pytestmark = pytest.mark.timeout(120)


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
    assert torch.allclose(torch.tensor([s.logprob for s in scores]), expected, atol=1e-4)
    for score, row in zip(scores, reference):
        top = row.topk(3)
        assert len(score.top_logprobs) == 3
        assert torch.allclose(torch.tensor([lp for _, lp in score.top_logprobs]), top.values, atol=1e-4)


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
        assert torch.allclose(torch.tensor([s.logprob for s in scores]), expected, atol=1e-4)
        assert all(s.top_logprobs == [] for s in scores)  # none asked for
    assert generated and reused >= 32  # the generation reused the two full blocks scoring computed
    stats = engine.stats()
    assert stats.running == stats.waiting == 0


def test_a_one_token_prompt_has_no_scores(make_engine):
    assert asyncio.run(make_engine().score([7])) == []
