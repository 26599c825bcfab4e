"""The simulator's engine model (benchmarks/sim/engine.py): known traces give the times worked out by hand from
the step costs, prefix caching and eviction behave as vLLM's do, and a decode run cut short by an arrival gives the
same times as stepping token by token."""

from __future__ import annotations

import pytest

from benchmarks.sim.clock import Clock
from benchmarks.sim.engine import SimEngine
from benchmarks.sim.prefix_cache import PrefixCache
from benchmarks.sim.sequence import Sequence
from benchmarks.sim.step_cost import EngineShape, StepCost

COST = StepCost(fixed_s=0.010, prefill_token_s=0.001, decode_seq_s=0.002)
SHAPE = EngineShape(max_batched_tokens=2048, max_seqs=64, block_size=16, kv_blocks=1000)


def run(requests: list[tuple[float, Sequence]], cost: StepCost = COST, shape: EngineShape = SHAPE
        ) -> tuple[dict[str, float], SimEngine]:
    """Each request's end time, submitted at its time to one engine."""
    clock = Clock()
    engine = SimEngine("e", clock, cost, shape)
    ended: dict[str, float] = {}
    for at, seq in requests:
        seq.on_done = lambda s: ended.__setitem__(s.name, clock.now)
        clock.at(at, lambda seq=seq: engine.submit(seq))
    clock.run()
    return ended, engine


def test_one_request_takes_its_prefill_step_then_one_step_per_further_token():
    ended, engine = run([(0.0, Sequence("a", [("p", 100)], 10))])
    # prefill step: 10 ms + 100 × 1 ms, its first token; then 9 decode steps of 10 + 2 ms
    assert ended["a"] == pytest.approx(0.110 + 9 * 0.012)
    assert engine.steps == 10 and engine.computed_tokens == 100


def test_a_request_arriving_mid_decode_joins_the_step_after_the_one_in_flight():
    ended, _ = run([(0.0, Sequence("a", [("p", 100)], 10)), (0.115, Sequence("b", [("q", 50)], 2))])
    # a: prefill ends 0.110, decode step 1 runs 0.110-0.122 (b arrives in it); step 2 carries b's prefill:
    # 10 + 50 × 1 + 1 × 2 ms = 0.062 → 0.184; then both decode (10 + 2 × 2 ms): b ends 0.198, a's 7 more steps
    assert ended["b"] == pytest.approx(0.184 + 0.014)
    assert ended["a"] == pytest.approx(0.184 + 0.014 + 6 * 0.012)


def test_a_decode_run_cut_short_gives_the_times_of_stepping_token_by_token():
    cost = StepCost(fixed_s=0.010, prefill_token_s=0.001, decode_seq_s=0.002, attention_pair_s=1e-5)
    requests = lambda: [(0.0, Sequence("a", [("p", 40)], 30)), (0.2, Sequence("b", [("q", 20)], 5))]  # noqa: E731
    ended, _ = run(requests(), cost)
    # the same trace worked out step by step: a's prefill, then single decode steps whose attention grows
    t, context = 0.010 + 40 * 0.001 + (40 * 41 / 2) * 1e-5, 41
    a_tokens = 1
    while t < 0.2:
        t += 0.010 + 0.002 + context * 1e-5
        context += 1
        a_tokens += 1
    step_b = 0.010 + 20 * 0.001 + (20 * 21 / 2) * 1e-5 + 0.002 + context * 1e-5  # b's prefill beside a's decode
    t += step_b
    context += 1
    a_tokens += 1
    b_context = 21
    for _ in range(4):  # b's remaining 4 tokens, both decoding
        t += 0.010 + 2 * 0.002 + (context + b_context) * 1e-5
        context += 1
        b_context += 1
        a_tokens += 1
    assert ended["b"] == pytest.approx(t)
    while a_tokens < 30:
        t += 0.010 + 0.002 + context * 1e-5
        context += 1
        a_tokens += 1
    assert ended["a"] == pytest.approx(t)


def test_a_shared_prefix_is_computed_once_in_full_blocks():
    first = Sequence("a", [("system", 100), ("user1", 20)], 1)
    second = Sequence("b", [("system", 100), ("user2", 20)], 1)
    ended, engine = run([(0.0, first), (1.0, second)])
    assert second.hit_tokens == 96  # 6 full blocks of 16: the 7th mixes the system prompt's end and the user turn
    assert engine.computed_tokens == 120 + 24
    assert ended["b"] == pytest.approx(1.0 + 0.010 + 24 * 0.001)


def test_a_fully_cached_prompt_still_computes_its_last_block():
    ended, engine = run([(0.0, Sequence("a", [("p", 64)], 1)), (1.0, Sequence("b", [("p", 64)], 1))])
    assert engine.computed_tokens == 64 + 16  # vLLM leaves the last token to compute: the last full block goes
    assert ended["b"] == pytest.approx(1.0 + 0.010 + 16 * 0.001)


def test_a_long_prompt_is_prefilled_in_chunks_of_the_token_budget():
    shape = EngineShape(max_batched_tokens=64, max_seqs=8, block_size=16, kv_blocks=100)
    ended, engine = run([(0.0, Sequence("a", [("p", 150)], 1))], shape=shape)
    assert engine.steps == 3  # 64 + 64 + 22 tokens
    assert ended["a"] == pytest.approx(3 * 0.010 + 150 * 0.001)


def test_the_least_recently_released_blocks_are_evicted_first():
    cache = PrefixCache(blocks=4)
    assert cache.reserve(2)
    cache.store(1)
    cache.store(2)
    cache.release([1, 2], private=0)  # 1 released before 2: evicted first
    assert cache.reserve(3)  # two empty blocks and the oldest idle one
    assert cache.longest_run([1, 2]) == 0 and cache.longest_run([2]) == 1
    assert not cache.reserve(2)  # one idle block left: no room for two


def test_blocks_in_use_are_never_evicted():
    cache = PrefixCache(blocks=2)
    assert cache.reserve(2)
    cache.store(7)
    assert not cache.reserve(1)
    assert cache.longest_run([7]) == 1


def test_a_request_waits_for_kv_room_until_another_finishes():
    shape = EngineShape(max_batched_tokens=2048, max_seqs=8, block_size=16, kv_blocks=4)
    ended, _ = run([(0.0, Sequence("a", [("p", 40)], 8)), (0.0, Sequence("b", [("q", 40)], 8))], shape=shape)
    a_done = 0.010 + 40 * 0.001 + 7 * 0.012
    assert ended["a"] == pytest.approx(a_done)  # 3 blocks each: b cannot start beside a
    assert ended["b"] == pytest.approx(a_done + 0.050 + 7 * 0.012)


def test_an_engine_ordering_by_priority_runs_urgent_work_first():
    shape = EngineShape(max_batched_tokens=100, max_seqs=1, block_size=16, kv_blocks=100, priority=True)
    requests = [(0.0, Sequence("busy", [("p", 10)], 5)), (0.001, Sequence("late", [("q", 10)], 1, level=2)),
                (0.002, Sequence("urgent", [("r", 10)], 1, level=0))]
    ended, _ = run(requests, shape=shape)
    assert ended["urgent"] < ended["late"]
