"""Each app workload runs in both modes through a real gateway in front of the echoing fake upstream.

The fake answers "echo: <last user message>", so every output carries the prompt that produced it:
a consumer's output containing its producers' outputs proves the values really flowed along the
graph (server-side for Parrot, through the client for the baseline).
"""

from __future__ import annotations

import random
from dataclasses import replace

import httpx
import pytest

from benchmarks.workloads import WORKLOADS, chain, map_reduce, mixed, multi_agent, shared_prompt
from benchmarks.workloads.text import document, questions, system_prompt
from gateway.server.app import create_app
from tests.support.fake_upstream import MODEL
from tests.support.gateways import fake_gateway_config
from tests.support import plain_http

TINY = {
    "map_reduce": map_reduce.Config(chunks=3, chunk_words=20, seed=7),
    "chain": chain.Config(chunks=3, chunk_words=20, seed=7),
    "multi_agent": multi_agent.Config(coders=3, seed=7),
    "shared_prompt": shared_prompt.Config(users=3, system_words=60, seed=7),
}
pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def gateway_v1(serve_module, fake_url) -> str:
    return serve_module(create_app(fake_gateway_config(fake_url))) + "/v1"


def fake_requests(fake_url: str) -> int:
    return plain_http.get(f"{fake_url}/fake/stats").json()["requests"]


@pytest.fixture
async def client(gateway_v1):
    async with httpx.AsyncClient(base_url=gateway_v1, timeout=30) as client:
        yield client


@pytest.mark.parametrize("app", sorted(WORKLOADS))
async def test_both_modes_give_the_same_answer_with_every_call_run_once(app, client, fake_url):
    module, cfg = WORKLOADS[app], TINY[app]
    before = fake_requests(fake_url)
    parrot = await module.run_parrot(client, MODEL, cfg, rtt_ms=2)
    between = fake_requests(fake_url)
    baseline = await module.run_baseline(client, MODEL, cfg, rtt_ms=2)
    after = fake_requests(fake_url)

    assert parrot.calls == baseline.calls == between - before == after - between
    assert parrot.seconds > 0 and baseline.seconds > 0
    assert parrot.parts == baseline.parts
    assert parrot.output == baseline.output and parrot.output.startswith("echo: ")


async def test_map_reduce_reduce_reads_every_map_output(client):
    cfg = TINY["map_reduce"]
    chunks = document(cfg.seed, cfg.chunks, cfg.chunk_words)
    for run in (map_reduce.run_parrot, map_reduce.run_baseline):
        result = await run(client, MODEL, cfg)
        assert len(result.parts) == cfg.chunks
        for chunk, summary in zip(chunks, result.parts):
            assert chunk in summary
            assert summary in result.output  # the reduce prompt held each map's output


async def test_chain_each_step_reads_the_previous_summary(client):
    cfg = TINY["chain"]
    chunks = document(cfg.seed, cfg.chunks, cfg.chunk_words)
    for run in (chain.run_parrot, chain.run_baseline):
        result = await run(client, MODEL, cfg)
        assert len(result.parts) == cfg.chunks and result.output == result.parts[-1]
        for index, step in enumerate(result.parts):
            assert chunks[index] in step
            if index:
                assert result.parts[index - 1] in step


async def test_multi_agent_fans_the_plan_out_and_the_code_in(client):
    cfg = TINY["multi_agent"]
    for run in (multi_agent.run_parrot, multi_agent.run_baseline):
        result = await run(client, MODEL, cfg)
        plan, codes = result.parts[0], result.parts[1:]
        assert f"project {cfg.seed}" in plan and len(codes) == cfg.coders
        for index, code in enumerate(codes):
            assert plan in code and f"component {index + 1} " in code
            assert code in result.output


async def test_shared_prompt_answers_each_user_under_the_same_system_prompt(client, fake_url):
    cfg = TINY["shared_prompt"]
    asked = questions(cfg.seed, cfg.users)
    for run in (shared_prompt.run_parrot, shared_prompt.run_baseline):
        result = await run(client, MODEL, cfg)
        assert result.parts == [f"echo: {q}" for q in asked]
        last = plain_http.get(f"{fake_url}/fake/stats").json()["last_body"]
        assert last["messages"][0]["content"].startswith("You are the customer support assistant")
        assert "parrot" not in last  # the extension never reaches the upstream


async def test_shared_prompt_distinct_prompts_differ_from_their_first_word(client, fake_url):
    cfg = replace(TINY["shared_prompt"], distinct_prompts=True)
    result = await shared_prompt.run_baseline(client, MODEL, cfg)
    assert result.parts == [f"echo: {q}" for q in questions(cfg.seed, cfg.users)]
    system = plain_http.get(f"{fake_url}/fake/stats").json()["last_body"]["messages"][0]["content"]
    assert system.startswith("(desk ") and system.endswith(system_prompt(cfg.seed, cfg.system_words))


@pytest.mark.parametrize("app", ["map_reduce", "multi_agent"])
async def test_sequential_baseline_makes_one_call_at_a_time(app, client):
    """Every call sleeps one simulated round trip: only calls that never overlap add up to all of them."""
    module, cfg = WORKLOADS[app], TINY[app]
    concurrent = await module.run_baseline(client, MODEL, cfg)
    sequential = await module.run_baseline(client, MODEL, replace(cfg, sequential=True), rtt_ms=100)
    assert sequential.output == concurrent.output and sequential.parts == concurrent.parts
    assert sequential.seconds >= sequential.calls * 0.1


async def test_mixed_traffic_sends_the_same_arrivals_in_both_modes(client, fake_url):
    cfg = mixed.Config(duration_s=2.0, chat_sessions_per_s=4.0, think_s=0.0, job_interval_s=1.0,
                       job=map_reduce.Config(chunks=2, chunk_words=10), seed=3)
    answers = sum(len(turns) for _, turns in mixed.chat_sessions(cfg, random.Random(cfg.seed)))
    assert answers >= 2
    for parrot in (True, False):
        before = fake_requests(fake_url)
        result = await mixed.run(client, MODEL, cfg, parrot=parrot)
        assert len(result.chat_normalized_s) == answers and all(s > 0 for s in result.chat_normalized_s)
        assert len(result.job_seconds) == 2
        assert fake_requests(fake_url) - before == answers + 2 * (cfg.job.chunks + 1)  # every call once
