"""The simulator's two ways of running an app (benchmarks/sim/client.py, benchmarks/sim/gateway.py): a client pays
a round trip per dependent hop, Parrot's gateway one for the whole graph; prefill ahead warms a waiting call's
prefix on the engine it then runs on; the cache-aware router follows a prompt's prefix."""

from __future__ import annotations

import pytest

from benchmarks.sim.app import App, Call, Input
from benchmarks.sim.simulation import simulate
from benchmarks.sim.step_cost import EngineShape, StepCost

COST = StepCost(fixed_s=0.010, prefill_token_s=0.001, decode_seq_s=0.002)
SHAPE = EngineShape(max_batched_tokens=4096, max_seqs=64, block_size=16, kv_blocks=10_000)


def chain(steps: int, system: int = 0) -> App:
    """Each step's prompt: a constant system text, its own chunk, then the step before's output."""
    calls = [Call("s0", (("t:sys", system), ("v:chunk0", 100)) if system else (("v:chunk0", 100),), 10)]
    for k in range(1, steps):
        head = (("t:sys", system),) if system else ()
        calls.append(Call(f"s{k}", (*head, (f"v:chunk{k}", 100), Input(f"s{k - 1}")), 10))
    return App("chain", tuple(calls), calls[-1].name)


def seconds(mode: str, app: App, rtt_s: float, engines: int = 1, **gateway) -> float:
    return simulate(mode, [(0.0, app)], COST, SHAPE, engines, rtt_s, **gateway).seconds[app.name][0]


def test_a_client_pays_a_round_trip_per_dependent_call_and_parrot_one_per_graph():
    app = chain(4)
    engine_time = seconds("client", app, 0.0)
    assert seconds("client", app, 0.25) == pytest.approx(engine_time + 4 * 0.25)
    gaps = 4 * 0.0004  # the gateway's own time per call
    assert seconds("parrot", app, 0.25, prefill_when="off") == pytest.approx(engine_time + 0.25 + gaps)


def test_prefill_ahead_leaves_only_the_rest_of_a_waiting_calls_prompt_to_compute():
    app = chain(3, system=200)
    off = simulate("parrot", [(0.0, app)], COST, SHAPE, 1, 0.0, prefill_when="off")
    ahead = simulate("parrot", [(0.0, app)], COST, SHAPE, 1, 0.0, prefill_when="next_in_line")
    assert ahead.prefills == 2 and off.prefills == 0
    assert ahead.hit_rate > off.hit_rate
    # the warmed prefixes are computed ahead, not again: no more prompt tokens in all than without
    assert ahead.computed_tokens <= off.computed_tokens + 2 * 16


def test_prefill_ahead_skips_a_prefix_shorter_than_a_block():
    app = chain(3)  # the prefix before each step's input: its 100-token chunk, over a 128-token block
    shape = EngineShape(max_batched_tokens=4096, max_seqs=64, block_size=128, kv_blocks=1000)
    outcome = simulate("parrot", [(0.0, app)], COST, shape, 1, 0.0, prefill_when="submitted")
    assert outcome.prefills == 0 and outcome.prefill_skips == 2


def test_the_cache_aware_router_sends_a_shared_prefix_back_where_it_went():
    apps = [App("ask", (Call("q", (("t:system", 800), (f"v:question{i}", 20)), 4),), "q") for i in range(6)]
    starts = [(i * 1.0, app) for i, app in enumerate(apps)]
    cache_aware = simulate("client_cache_aware", starts, COST, SHAPE, 3, 0.0)
    round_robin = simulate("client", starts, COST, SHAPE, 3, 0.0)
    assert cache_aware.computed_tokens == 800 + 6 * 20  # the system prompt (50 full blocks) once; each question
    assert round_robin.computed_tokens > cache_aware.computed_tokens + 800


def test_a_warmed_call_pinned_where_it_was_warmed_runs_there():
    starts = [(i * 0.01, chain(4, system=200)._replace(name=f"chain{i}")) for i in range(12)]
    pinned = simulate("parrot", starts, COST, SHAPE, 4, 0.0, prefill_when="next_in_line", pin_warmed=True)
    assert pinned.prefills > 0 and pinned.warmed_placed == pinned.prefills


def test_the_gateway_runs_a_warmed_call_where_it_was_warmed_while_that_engine_takes_it_in():
    # 12 chains on 4 engines: the warmed engines run bigger batches than the others, and no queue builds up.
    starts = [(i * 0.01, chain(4, system=200)._replace(name=f"chain{i}")) for i in range(12)]
    shipped = simulate("parrot", starts, COST, SHAPE, 4, 0.0, prefill_when="next_in_line")
    assert shipped.prefills > 0 and shipped.warmed_placed == shipped.prefills
