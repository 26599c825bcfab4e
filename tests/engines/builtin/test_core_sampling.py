"""Sampling through the engine (seeds, filters, penalties, stops, logprobs) and the sampler's
filters on hand-made distributions."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from engines.builtin.sampler import Sampler, filter_top_k_top_p_min_p
from engines.builtin.types import SamplingParams

PROMPT = list(range(1000, 1023))


async def run(engine, params: SamplingParams, prompt=PROMPT):
    return [event async for event in engine.generate_from_prompt(prompt, params)]


def ids(events) -> list[int]:
    return [event.token_id for event in events]


@pytest.fixture
def engine(make_engine):
    return make_engine()


async def test_seeded_sampling_repeats_whatever_shares_the_batch(engine):
    seeded = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    alone = ids(await run(engine, seeded))
    noise = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    crowded = await asyncio.gather(run(engine, seeded), run(engine, noise, PROMPT[:5]), run(engine, noise, PROMPT[3:]))
    assert ids(crowded[0]) == alone
    other_seed = ids(await run(engine, SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=99, ignore_eos=True)))
    assert other_seed != alone
    greedy = ids(await run(engine, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)))
    assert greedy != alone  # the random model's distribution is wide enough to make these differ


async def test_top_k_one_is_greedy(engine):
    greedy = ids(await run(engine, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)))
    top1 = ids(await run(engine, SamplingParams(max_tokens=8, temperature=5.0, top_k=1, seed=3, ignore_eos=True)))
    assert top1 == greedy


async def test_logit_bias_and_stop_token(engine):
    forced = SamplingParams(max_tokens=8, temperature=0.0, logit_bias={4242: 100.0}, stop_token_ids=[4242])
    events = await run(engine, forced)
    assert ids(events) == [4242] and events[-1].finish_reason == "stop"
    banned_eos = SamplingParams(max_tokens=5, temperature=0.0, logit_bias={4242: 100.0}, ignore_eos=True)
    events = await run(engine, banned_eos)
    assert ids(events) == [4242] * 5 and events[-1].finish_reason == "length"
    assert [e.finish_reason for e in events[:-1]] == [None] * 4


async def test_eos_stops_unless_ignored(engine):
    eos = engine.eos_token_ids[0]
    params = SamplingParams(max_tokens=4, temperature=0.0, logit_bias={eos: 100.0})
    events = await run(engine, params)
    assert ids(events) == [eos] and events[0].finish_reason == "stop"


async def test_penalties_push_away_repeated_tokens(engine):
    params = SamplingParams(max_tokens=6, temperature=0.0, logit_bias={4242: 30.0}, ignore_eos=True)
    assert ids(await run(engine, params)).count(4242) > 1
    penalised = SamplingParams(
        max_tokens=6, temperature=0.0, logit_bias={4242: 30.0}, frequency_penalty=50.0, presence_penalty=50.0, ignore_eos=True
    )
    assert ids(await run(engine, penalised)).count(4242) <= 1
    repetition = SamplingParams(max_tokens=6, temperature=0.0, logit_bias={4242: 30.0}, repetition_penalty=1e6, ignore_eos=True)
    assert ids(await run(engine, repetition)).count(4242) <= 1


async def test_logprobs(engine):
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=True, top_logprobs=3, ignore_eos=True)
    for event in await run(engine, params):
        assert event.logprob is not None and event.logprob <= 0.0
        assert len(event.top_logprobs) == 3
        top_id, top_logprob = event.top_logprobs[0]
        assert top_id == event.token_id and top_logprob == pytest.approx(event.logprob)
        assert [lp for _, lp in event.top_logprobs] == sorted((lp for _, lp in event.top_logprobs), reverse=True)
    plain = await run(engine, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    assert plain[0].logprob is None and plain[0].top_logprobs is None


def test_filters_on_a_known_distribution():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 3)
    params = [
        SamplingParams(top_k=2),
        SamplingParams(top_p=0.7),  # 0.5 alone is below 0.7, so 0.3 stays too
        SamplingParams(min_p=0.5),  # keeps tokens with at least half the top probability
    ]
    kept = filter_top_k_top_p_min_p(probs, params) > 0
    assert kept.tolist() == [[True, True, False, False], [True, True, False, False], [True, True, False, False]]
    assert bool((filter_top_k_top_p_min_p(probs, [SamplingParams()] * 3) == probs).all())


def test_top_p_zero_keeps_only_the_most_likely_token():
    probs = torch.tensor([[0.15, 0.5, 0.3, 0.05]])

    kept = filter_top_k_top_p_min_p(probs, [SamplingParams(top_p=0.0)]) > 0

    assert kept.tolist() == [[False, True, False, False]]


def test_a_greedy_batch_takes_the_row_argmax_and_torchs_where_it_declines(kernels):
    """The engine's sampler is given the C++ row argmax (torch's CPU argmax ~10x slower); a batch it declines
    (None) still gets torch's answer."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    greedy = [SimpleNamespace(params=SamplingParams(max_tokens=1, temperature=0.0)) for _ in range(3)]
    asked = []

    def declining(rows):
        asked.append(tuple(rows.shape))

    assert Sampler(0, declining)(logits, greedy).token_ids == logits.argmax(dim=-1).tolist()
    assert asked == [(3, 50)]
    assert Sampler(0, kernels.argmax_rows)(logits, greedy).token_ids == logits.argmax(dim=-1).tolist()


async def test_the_engines_greedy_batches_sample_with_the_native_argmax(engine, kernels):
    assert engine.runner.sampler.row_argmax == kernels.argmax_rows
